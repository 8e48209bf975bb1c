/* rl_redis--1.4--1.5.sql */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION rl_redis UPDATE TO '1.5'" to load this file. \quit

-- Batch decisions: one limit decided for many identities, each on its own
-- (not all or nothing), one row per array element in the array's order, in
-- one pipelined round trip per Redis node.

-- A policy's decisions, for every role (like rl_check).
CREATE FUNCTION @extschema@.rl_check_many(policy text, identities text[],
                                          cost integer DEFAULT 1)
RETURNS TABLE (identity text, allowed boolean, lim integer, remaining integer,
               reset_ms bigint, retry_after_ms bigint)
AS 'MODULE_PATHNAME', 'rl_check_many'
LANGUAGE C VOLATILE PARALLEL UNSAFE ROWS 100;

-- Explicit limits, one function per algorithm; administrators only (like
-- rl_<algorithm>): they name any limit, so any key.
CREATE FUNCTION @extschema@.rl_fixed_many(identities text[], lim integer,
                                          window_ms bigint, cost integer DEFAULT 1)
RETURNS TABLE (identity text, allowed boolean, lim integer, remaining integer,
               reset_ms bigint, retry_after_ms bigint)
AS 'MODULE_PATHNAME', 'rl_fixed_many'
LANGUAGE C VOLATILE PARALLEL UNSAFE ROWS 100;

CREATE FUNCTION @extschema@.rl_sliding_many(identities text[], lim integer,
                                            window_ms bigint, cost integer DEFAULT 1)
RETURNS TABLE (identity text, allowed boolean, lim integer, remaining integer,
               reset_ms bigint, retry_after_ms bigint)
AS 'MODULE_PATHNAME', 'rl_sliding_many'
LANGUAGE C VOLATILE PARALLEL UNSAFE ROWS 100;

CREATE FUNCTION @extschema@.rl_sliding_counter_many(identities text[], lim integer,
                                                    window_ms bigint, cost integer DEFAULT 1)
RETURNS TABLE (identity text, allowed boolean, lim integer, remaining integer,
               reset_ms bigint, retry_after_ms bigint)
AS 'MODULE_PATHNAME', 'rl_sliding_counter_many'
LANGUAGE C VOLATILE PARALLEL UNSAFE ROWS 100;

CREATE FUNCTION @extschema@.rl_token_bucket_many(identities text[], lim integer,
                                                 window_ms bigint, cost integer DEFAULT 1,
                                                 burst integer DEFAULT NULL)
RETURNS TABLE (identity text, allowed boolean, lim integer, remaining integer,
               reset_ms bigint, retry_after_ms bigint)
AS 'MODULE_PATHNAME', 'rl_token_bucket_many'
LANGUAGE C VOLATILE PARALLEL UNSAFE ROWS 100;

CREATE FUNCTION @extschema@.rl_gcra_many(identities text[], lim integer,
                                         window_ms bigint, cost integer DEFAULT 1,
                                         burst integer DEFAULT NULL)
RETURNS TABLE (identity text, allowed boolean, lim integer, remaining integer,
               reset_ms bigint, retry_after_ms bigint)
AS 'MODULE_PATHNAME', 'rl_gcra_many'
LANGUAGE C VOLATILE PARALLEL UNSAFE ROWS 100;

REVOKE ALL ON FUNCTION @extschema@.rl_fixed_many(text[], integer, bigint, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION @extschema@.rl_sliding_many(text[], integer, bigint, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION @extschema@.rl_sliding_counter_many(text[], integer, bigint, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION @extschema@.rl_token_bucket_many(text[], integer, bigint, integer, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION @extschema@.rl_gcra_many(text[], integer, bigint, integer, integer) FROM PUBLIC;
