/* rl_redis--1.5--1.6.sql */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION rl_redis UPDATE TO '1.6'" to load this file. \quit

-- Guards checked when created (issue 21, item 3) ---------------------------

-- Refuses at CREATE TRIGGER a guard that would fail at its first write: of
-- the wrong kind, naming a missing policy or column, or a malformed limit.
CREATE FUNCTION @extschema@.rl_guard_created()
RETURNS event_trigger
AS 'MODULE_PATHNAME', 'rl_guard_created'
LANGUAGE C
SET search_path = pg_catalog, pg_temp;
REVOKE ALL ON FUNCTION @extschema@.rl_guard_created() FROM PUBLIC;

CREATE EVENT TRIGGER rl_guard_created ON ddl_command_end
    WHEN TAG IN ('CREATE TRIGGER')
    EXECUTE FUNCTION @extschema@.rl_guard_created();

-- rl_guard_check(): one row per problem of every guard in the database
-- (guards made before 1.6, or whose policy was deleted since); no rows when
-- all are fine. It reads what the catalogs and rl_policy show every role.
CREATE FUNCTION @extschema@.rl_guard_check(
    OUT table_name regclass, OUT trigger_name name, OUT problem text)
RETURNS SETOF record
AS 'MODULE_PATHNAME', 'rl_guard_check'
LANGUAGE C
SET search_path = pg_catalog, pg_temp;
GRANT EXECUTE ON FUNCTION @extschema@.rl_guard_check() TO PUBLIC;
