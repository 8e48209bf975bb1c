-- rl_redis.on_error when Redis cannot be reached (nothing listens on port 1).
SET rl_redis.port = 1;
SET rl_redis.on_error = 'error';
SELECT rl_sliding_allow('oe:u', 5, 60000);
SELECT * FROM rl_fixed('oe:u', 5, 60000);
\echo :LAST_ERROR_SQLSTATE
-- after a failure the circuit breaker fails calls at once, without trying,
-- for rl_redis.retry_interval
SELECT rl_fixed_allow('oe:u', 5, 60000);
-- setting a connection parameter (even to the same value) tries again
SET rl_redis.port = 1;
-- fail open: allowed, with one warning per outage
SET rl_redis.on_error = 'allow';
SELECT rl_sliding_allow('oe:u', 5, 60000);
SELECT * FROM rl_fixed('oe:u', 5, 60000, 2);
SELECT rl_sliding_allow('oe:u', 5, 60000);
-- fail closed: denied, with one warning per outage
SET rl_redis.port = 1;
SET rl_redis.on_error = 'deny';
SELECT rl_fixed_allow('oe:u', 5, 60000);
SELECT * FROM rl_sliding('oe:u', 5, 60000);
-- without the breaker every call tries again (and still warns once)
SET rl_redis.retry_interval = 0;
SELECT rl_fixed_allow('oe:u', 5, 60000);
SET rl_redis.on_error = 'error';
SELECT rl_fixed_allow('oe:u', 5, 60000);
SET rl_redis.on_error = 'deny';
RESET rl_redis.retry_interval;
-- administrative calls always raise; rl_redis_ping always tries
SELECT rl_reset('oe:u');
SELECT * FROM rl_redis_ping();
\echo :LAST_ERROR_SQLSTATE
-- argument errors are raised whatever the policy
SELECT rl_fixed_allow('oe:u', 0, 60000);
-- back on the real server, the same session works again
RESET rl_redis.port;
RESET rl_redis.on_error;
SELECT rl_reset('oe:u');
SELECT rl_fixed_allow('oe:u', 5, 60000);
SELECT rl_reset('oe:u');
-- guards: a denial that on_error = 'deny' decided is not a rate-limit denial:
-- 08006 "could not be checked", never PT429 "exceeded" (PostgREST answers
-- 503, not 429, and an application can tell an outage from a caller over
-- its quota)
SET rl_redis.test_clock_ms = 1000000000000;
CREATE TABLE oe_guarded (tenant text NOT NULL);
CREATE TRIGGER oe_row AFTER INSERT ON oe_guarded
    FOR EACH ROW EXECUTE FUNCTION rl_guard('fixed:1/60000', 'tenant');
SELECT rl_reset('oe:g');
INSERT INTO oe_guarded VALUES ('oe:g');
-- Redis's denial: PT429
INSERT INTO oe_guarded VALUES ('oe:g');
\echo :LAST_ERROR_SQLSTATE
-- Redis unreachable, on_error = deny: 08006, one warning per outage
SET rl_redis.port = 1;
SET rl_redis.on_error = 'deny';
INSERT INTO oe_guarded VALUES ('oe:h');
\echo :LAST_ERROR_SQLSTATE
-- the breaker's decision within retry_interval is on_error's too
INSERT INTO oe_guarded VALUES ('oe:h');
\echo :LAST_ERROR_SQLSTATE
-- the statement guard
DROP TRIGGER oe_row ON oe_guarded;
CREATE TRIGGER oe_statement AFTER INSERT ON oe_guarded
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION rl_guard_statement('fixed:1/60000', 'tenant');
INSERT INTO oe_guarded VALUES ('oe:h'), ('oe:h');
\echo :LAST_ERROR_SQLSTATE
-- allow lets the write through; error raises the failure itself
SET rl_redis.on_error = 'allow';
INSERT INTO oe_guarded VALUES ('oe:h');
SET rl_redis.on_error = 'error';
SET rl_redis.port = 1;
INSERT INTO oe_guarded VALUES ('oe:h');
\echo :LAST_ERROR_SQLSTATE
RESET rl_redis.port;
RESET rl_redis.on_error;
SELECT count(*) FROM oe_guarded;
DROP TABLE oe_guarded;
SELECT rl_reset('oe:g');
RESET rl_redis.test_clock_ms;
