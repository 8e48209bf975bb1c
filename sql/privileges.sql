-- What an ordinary role may and may not do.
SET rl_redis.key_prefix = 'rlpriv:';
CREATE ROLE rl_app LOGIN;
CREATE ROLE rl_admin;
SET rl_redis.password = '';
SET rl_redis.test_clock_ms = 1000000000000;
INSERT INTO rl_policy (name, algorithm, lim, window_ms) VALUES ('priv.p', 'sliding', 5, 60000);

SET ROLE rl_app;
-- decisions through the limits an administrator defined are for everyone
SELECT rl_allow('priv.p', 'priv:u'), (rl_check('priv.p', 'priv:u')).remaining,
       rl_allow_all('{priv.p}', 'priv:u'), (rl_check_all('{priv.p}', 'priv:u')).remaining;
SELECT rl_headers(rl_check('priv.p', 'priv:u', 0), 'priv.p') ->> 0 AS policy_header;
SELECT server LIKE '127.0.0.1:%' AS ok, rtt_ms >= 0 AS measured FROM rl_redis_ping();
-- explicit arguments invent a limit: not for everyone
\set VERBOSITY sqlstate
SELECT rl_sliding_allow('priv:u', 5, 60000);
SELECT rl_fixed_allow('priv:u', 5, 60000);
-- nothing that moves the limits or makes them fail open
SET rl_redis.host = '10.0.0.1';
SET rl_redis.port = 6380;
SET rl_redis.username = 'other';
SET rl_redis.password = 'guess';
SET rl_redis.password_file = '/tmp/guess';
SET rl_redis.database = 3;
SET rl_redis.key_prefix = 'mine:';
SET rl_redis.on_error = 'allow';
SET rl_redis.connect_timeout = 1;
SET rl_redis.command_timeout = 1;
SET rl_redis.retry_interval = 100000;
SET rl_redis.refund_on_abort = 'all';
SET rl_redis.max_lease = 1;
SET rl_redis.sliding_max_lim = 1;
SET rl_redis.max_identity_bytes = '1MB';
SET rl_redis.test_clock_ms = 1;
-- the password (and its file) cannot be read
SHOW rl_redis.password;
SELECT current_setting('rl_redis.password');
SHOW rl_redis.password_file;
SELECT current_setting('rl_redis.password_file');
\set VERBOSITY default
SELECT count(*) FROM pg_settings WHERE name IN ('rl_redis.password', 'rl_redis.password_file');
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
       has_function_privilege('public', 'rl_allow(text,text,integer)', 'EXECUTE') AS public_may_decide,
       has_function_privilege('public', 'rl_sliding_allow(text,integer,bigint,integer)', 'EXECUTE') AS public_may_invent;

-- the password is visible to superusers only, and only as set
SET rl_redis.password = 'not-shown-to-others';
SHOW rl_redis.password;
RESET rl_redis.password;

-- database and role settings (pg_db_role_setting, proconfig) are readable by
-- every role, so the password is refused there: postgresql.conf, ALTER
-- SYSTEM or rl_redis.password_file
SELECT current_database() AS dbname \gset
\set VERBOSITY sqlstate
ALTER ROLE rl_app SET rl_redis.password = 'y';
ALTER ROLE rl_app IN DATABASE :"dbname" SET rl_redis.password = 'y';
ALTER ROLE ALL SET rl_redis.password = 'y';
ALTER DATABASE :"dbname" SET rl_redis.password = 'y';
CREATE FUNCTION priv_password() RETURNS int LANGUAGE sql
    SET rl_redis.password = 'y' AS 'SELECT 1';
\set VERBOSITY default
ALTER ROLE rl_app SET rl_redis.password = 'y';
-- an empty one is harmless
ALTER ROLE rl_app SET rl_redis.password = '';
SELECT setconfig FROM pg_db_role_setting WHERE setrole = 'rl_app'::regrole;
ALTER ROLE rl_app RESET rl_redis.password;
SELECT count(*) FROM pg_db_role_setting s, unnest(s.setconfig) c
 WHERE c LIKE 'rl\_redis.password%';
SELECT count(*) FROM pg_proc p, unnest(p.proconfig) c WHERE c LIKE 'rl\_redis.password%';

REVOKE rl_admin FROM rl_app;
REVOKE EXECUTE ON FUNCTION rl_reset(text) FROM rl_admin;
DROP ROLE rl_app;
DROP ROLE rl_admin;
DELETE FROM rl_policy WHERE name = 'priv.p';
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
