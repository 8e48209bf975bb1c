-- What an ordinary role may and may not do.
SET rl_redis.key_prefix = 'rlpriv:';
CREATE ROLE rl_app LOGIN;
CREATE ROLE rl_admin;
SET rl_redis.password = '';
SET rl_redis.test_clock_ms = 1000000000000;

SET ROLE rl_app;
-- decisions are for everyone
SELECT rl_sliding_allow('priv:u', 5, 60000), rl_fixed_allow('priv:u', 5, 60000);
SELECT server LIKE '127.0.0.1:%' AS ok, rtt_ms >= 0 AS measured FROM rl_redis_ping();
-- nothing that moves the limits or makes them fail open
\set VERBOSITY sqlstate
SET rl_redis.host = '10.0.0.1';
SET rl_redis.port = 6380;
SET rl_redis.username = 'other';
SET rl_redis.password = 'guess';
SET rl_redis.database = 3;
SET rl_redis.key_prefix = 'mine:';
SET rl_redis.on_error = 'allow';
SET rl_redis.connect_timeout = 1;
SET rl_redis.command_timeout = 1;
SET rl_redis.retry_interval = 100000;
SET rl_redis.refund_on_abort = 'all';
SET rl_redis.test_clock_ms = 1;
-- the password cannot be read
SHOW rl_redis.password;
SELECT current_setting('rl_redis.password');
\set VERBOSITY default
SELECT count(*) FROM pg_settings WHERE name = 'rl_redis.password';
SELECT name FROM pg_settings WHERE name LIKE 'rl\_redis.%' ORDER BY name;
-- resetting a quota is administrative
SELECT rl_reset('priv:u');
RESET ROLE;

-- a superuser can grant it
GRANT EXECUTE ON FUNCTION rl_reset(text) TO rl_admin;
GRANT rl_admin TO rl_app;
SET ROLE rl_app;
SELECT rl_reset('priv:u');
RESET ROLE;
SELECT has_function_privilege('public', 'rl_reset(text)', 'EXECUTE') AS public_may_reset,
       has_function_privilege('public', 'rl_sliding_allow(text,integer,bigint,integer)', 'EXECUTE') AS public_may_decide;

-- the password is visible to superusers only, and only as set
SET rl_redis.password = 'not-shown-to-others';
SHOW rl_redis.password;
RESET rl_redis.password;

REVOKE rl_admin FROM rl_app;
REVOKE EXECUTE ON FUNCTION rl_reset(text) FROM rl_admin;
DROP ROLE rl_app;
DROP ROLE rl_admin;
RESET rl_redis.test_clock_ms;

-- search_path tricks: an operator or table of the same name earlier in the
-- search_path is never used by the extension's own queries
CREATE SCHEMA trap;
CREATE FUNCTION trap.texteq_trap(text, text) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    RAISE NOTICE 'trap operator called';
    RETURN $1 OPERATOR(pg_catalog.=) $2;
END $$;
CREATE OPERATOR trap.= (LEFTARG = text, RIGHTARG = text, FUNCTION = trap.texteq_trap);
CREATE TABLE trap.rl_policy (name text, algorithm text, lim int, window_ms bigint, burst int);
INSERT INTO trap.rl_policy VALUES ('trap.policy', 'fixed', 1000000, 1000, NULL);
INSERT INTO rl_policy (name, algorithm, lim, window_ms) VALUES ('real.policy', 'fixed', 1, 60000);
SET search_path = trap, public, pg_catalog;
SELECT (rl_check('real.policy', 'priv:trap')).lim;
SELECT rl_check('trap.policy', 'priv:trap');
SELECT rl_headers(rl_check('real.policy', 'priv:trap', 0), 'real.policy') IS NOT NULL;
SELECT rl_reset('priv:trap');
RESET search_path;
DELETE FROM rl_policy;
DROP SCHEMA trap CASCADE;
