-- Named policies, several limits at once, and response headers.
SET rl_redis.key_prefix = 'rltest:';
SET rl_redis.test_clock_ms = 1000000000000;
SELECT rl_reset('po:u1'), rl_reset('po:u2');
INSERT INTO rl_policy (name, algorithm, lim, window_ms, burst, description) VALUES
    ('free',        'sliding',      5,      60000, NULL, 'free tier: 5 per minute'),
    ('free.daily',  'fixed',       20,   86400000, NULL, 'free tier: 20 per day'),
    ('pro',         'token_bucket', 60,     60000,  120, 'pro tier: 1 per second, bursts of 120'),
    ('search:gcra', 'gcra',         10,      1000, NULL, NULL),
    ('approx',      'sliding_counter', 100, 60000, NULL, NULL);

SELECT * FROM rl_check('free', 'po:u1');
SELECT * FROM rl_check('free', 'po:u1', 4);
SELECT * FROM rl_check('free', 'po:u1');
SELECT rl_allow('free', 'po:u2'), rl_allow('pro', 'po:u1', 120), rl_allow('pro', 'po:u1');
SELECT * FROM rl_check('search:gcra', 'po:u1', 10);
SELECT * FROM rl_check('approx', 'po:u1', 0);
-- a refund through the policy
SELECT * FROM rl_refund('free', 'po:u1', 2);

-- each policy keeps its own key, which carries the numbers its state
-- depends on: a bucket's rate and burst, a count's window alone:
-- <prefix><algorithm>:{<identity>}:<policy>:<lim>/<window_ms>[/<burst>]
-- <prefix><algorithm>:{<identity>}:<policy>:/<window_ms>
SELECT current_setting('rl_redis.port') AS port \gset
\setenv RLPORT :port
\! redis-cli -p $RLPORT --scan --pattern 'rltest:*{po:u1}*' | sort

-- all or nothing: 5/minute AND 20/day; nothing is taken unless both allow
SELECT * FROM rl_check_all('{free,free.daily}', 'po:u2', 4);
SELECT * FROM rl_check_all('{free,free.daily}', 'po:u2', 1);
SELECT * FROM rl_check('free.daily', 'po:u2', 0);
SET rl_redis.test_clock_ms = 1000000061000;
SELECT * FROM rl_check_all(ARRAY['free', 'free.daily'], 'po:u2', 5);
SELECT * FROM rl_check_all(ARRAY['free', 'free.daily'], 'po:u2', 1);
-- the most restrictive result is the one reported
SELECT * FROM rl_check_all(ARRAY['free.daily', 'pro'], 'po:u2', 1);
SELECT rl_allow_all(ARRAY['free.daily', 'free.daily'], 'po:u2', 10),
       rl_allow_all(ARRAY['free.daily'], 'po:u2', 1);

-- a change to the table is seen on the next call: a sliding count goes on
-- under the new lim
UPDATE rl_policy SET lim = 10 WHERE name = 'free';
SELECT * FROM rl_check('free', 'po:u2', 0);
DELETE FROM rl_policy WHERE name = 'approx';

-- errors
\set VERBOSITY sqlstate
SELECT rl_check('approx', 'po:u1');
SELECT rl_check('no such policy', 'po:u1');
SELECT rl_check('', 'po:u1');
SELECT rl_check(NULL, 'po:u1');
SELECT rl_check('free', '');
SELECT rl_check('free', 'po:u1', -1);
SELECT rl_check_all('{}', 'po:u1');
SELECT rl_check_all(NULL, 'po:u1');
SELECT rl_check_all('{free,NULL}', 'po:u1');
\set VERBOSITY default
-- a bad row names the constraint it violates
CREATE FUNCTION pg_temp.violation(row_values text) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    sqlstate_text text;
    violated text;
BEGIN
    EXECUTE 'INSERT INTO rl_policy (name, algorithm, lim, window_ms, burst) VALUES '
            || row_values;
    RETURN 'inserted';
EXCEPTION WHEN OTHERS THEN
    GET STACKED DIAGNOSTICS sqlstate_text = RETURNED_SQLSTATE, violated = CONSTRAINT_NAME;
    RETURN sqlstate_text || ' ' || violated;
END
$$;
SELECT v AS row_values, pg_temp.violation(v) AS error FROM (VALUES
    ($$('bad name', 'fixed', 1, 1000, NULL)$$),
    ($$(repeat('n', 64), 'fixed', 1, 1000, NULL)$$),
    ($$('free', 'fixed', 1, 1000, NULL)$$),
    ($$('bad', 'leaky', 1, 1000, NULL)$$),
    ($$('bad', 'fixed', 0, 1000, NULL)$$),
    ($$('bad', 'sliding', 100001, 1000, NULL)$$),
    ($$('bad', 'fixed', 1, 0, NULL)$$),
    ($$('bad', 'fixed', 1, 3153600000001, NULL)$$),
    ($$('bad', 'gcra', 1, 1000, 0)$$),
    ($$('bad', 'fixed', 1, 1000, 5)$$),
    ($$('bad', 'gcra', 1, 3153600000000, 2)$$),
    ($$('good', 'gcra', 1, 3153600000000, 1)$$)) t(v);
DELETE FROM rl_policy WHERE name = 'good';
SELECT rl_check('no_such_policy', 'po:u1');
SELECT rl_check_all('{}', 'po:u1');

-- response headers: IETF RateLimit fields, the X-RateLimit trio, Retry-After
SELECT rl_headers(rl_check('free', 'po:u1'), 'free');
SELECT rl_headers(ROW(false, 5, 0, 31250, 28750)::rl_result, 'free');
SELECT rl_headers(ROW(true, 100, 42, 1500, 0)::rl_result);
SELECT rl_headers(ROW(false, 5, 0, 0, -1)::rl_result, 'unknown');

-- rl_reset forgets policy keys too
SELECT rl_reset('po:u1'), rl_reset('po:u2');
\! redis-cli -p $RLPORT --scan --pattern 'rltest:*{po:u*' | sort
DELETE FROM rl_policy;
RESET rl_redis.test_clock_ms;
