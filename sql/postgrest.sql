-- The PostgREST recipe in examples/postgrest, called the way PostgREST
-- calls it: with request.jwt.claims set, inside the request's transaction.
SET rl_redis.key_prefix = 'rltest:';
SET rl_redis.test_clock_ms = 1000000000000;
SET client_min_messages = warning;
\set ECHO none
\i examples/postgrest/rate_limit.sql
\set ECHO all
RESET client_min_messages;
INSERT INTO rl_policy (name, algorithm, lim, window_ms, burst) VALUES
    ('api.anonymous', 'sliding',        1, 60000, NULL),
    ('api.free',      'sliding',        2, 60000, NULL),
    ('api.pro',       'token_bucket', 600, 60000, 100);
SELECT rl_reset('user-1'), rl_reset('user-2'), rl_reset('ip:203.0.113.7');

-- a free user: two requests, then PostgREST's error for a 429 with the
-- headers, Retry-After among them
BEGIN;
SELECT set_config('request.jwt.claims', '{"sub": "user-1", "tier": "free"}', true);
SELECT api.check_rate_limit();
SELECT current_setting('response.headers');
COMMIT;
BEGIN;
SELECT set_config('request.jwt.claims', '{"sub": "user-1", "tier": "free"}', true);
SELECT api.check_rate_limit();
COMMIT;
BEGIN;
SELECT set_config('request.jwt.claims', '{"sub": "user-1", "tier": "free"}', true);
SELECT api.check_rate_limit();
\echo :LAST_ERROR_SQLSTATE
ROLLBACK;
-- a pro user has its own, larger quota
BEGIN;
SELECT set_config('request.jwt.claims', '{"sub": "user-2", "tier": "pro"}', true);
SELECT api.check_rate_limit();
SELECT current_setting('response.headers')::jsonb -> 1;
COMMIT;

-- no token: the anonymous quota of the client address
BEGIN;
SELECT set_config('request.headers', '{"x-forwarded-for": "203.0.113.7"}', true);
SELECT api.check_rate_limit();
COMMIT;
BEGIN;
SELECT set_config('request.headers', '{"x-forwarded-for": "203.0.113.7"}', true);
SELECT api.check_rate_limit();
ROLLBACK;

DROP SCHEMA api CASCADE;
DELETE FROM rl_policy;
SELECT rl_reset('user-1'), rl_reset('user-2'), rl_reset('ip:203.0.113.7');
RESET rl_redis.test_clock_ms;
