/* rl_redis--1.1--1.2.sql */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION rl_redis UPDATE TO '1.2'" to load this file. \quit

-- Row guard: BEFORE (or AFTER) INSERT OR UPDATE ... FOR EACH ROW
--   EXECUTE FUNCTION rl_guard(limit, identity_columns [, cost_column])
-- limit is a policy name or '<algorithm>:<lim>/<window_ms>[/<burst>]';
-- identity_columns one column or several separated by commas. A denied row
-- raises SQLSTATE PT429.
CREATE FUNCTION @extschema@.rl_guard()
RETURNS trigger
AS 'MODULE_PATHNAME', 'rl_guard'
LANGUAGE C;

-- Statement guard: AFTER INSERT OR UPDATE ... REFERENCING NEW TABLE AS n
--   FOR EACH STATEMENT EXECUTE FUNCTION rl_guard_statement(limit, identity_columns [, cost_column])
-- charges every identity its rows in one Redis call, all or nothing.
CREATE FUNCTION @extschema@.rl_guard_statement()
RETURNS trigger
AS 'MODULE_PATHNAME', 'rl_guard_statement'
LANGUAGE C;

-- Windows longer than 100 years are refused by the functions; refuse them
-- in policies too.
ALTER TABLE @extschema@.rl_policy
    ADD CONSTRAINT rl_policy_window_ms_max CHECK (window_ms <= 3153600000000);

-- The sliding window log keeps one entry per unit: at most 100 000.
ALTER TABLE @extschema@.rl_policy
    ADD CONSTRAINT rl_policy_sliding_lim_max CHECK (algorithm <> 'sliding' OR lim <= 100000);
