/* rl_redis--1.0.sql */

-- complain if script is sourced in psql, rather than via CREATE EXTENSION
\echo Use "CREATE EXTENSION rl_redis" to load this file. \quit

-- One rate-limit decision.
--   allowed         the call may go ahead (its cost was taken)
--   lim             the limit that was applied
--   remaining       units left after this call
--   reset_ms        milliseconds until the identity's quota is fully back
--   retry_after_ms  0 when allowed; else milliseconds until a call of this
--                   cost can be allowed; -1 when it never can (cost > lim)
CREATE TYPE @extschema@.rl_result AS (
	allowed boolean,
	lim integer,
	remaining integer,
	reset_ms bigint,
	retry_after_ms bigint
);

-- Fixed window: at most lim units per window_ms window, windows aligned on
-- the Redis clock.
CREATE FUNCTION @extschema@.rl_fixed(identity text, lim integer, window_ms bigint,
                                     cost integer DEFAULT 1)
RETURNS @extschema@.rl_result
AS 'MODULE_PATHNAME', 'rl_fixed'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION @extschema@.rl_fixed_allow(identity text, lim integer, window_ms bigint,
                                           cost integer DEFAULT 1)
RETURNS boolean
AS 'MODULE_PATHNAME', 'rl_fixed_allow'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

-- Sliding window log: at most lim units in any window_ms interval.
CREATE FUNCTION @extschema@.rl_sliding(identity text, lim integer, window_ms bigint,
                                       cost integer DEFAULT 1)
RETURNS @extschema@.rl_result
AS 'MODULE_PATHNAME', 'rl_sliding'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION @extschema@.rl_sliding_allow(identity text, lim integer, window_ms bigint,
                                             cost integer DEFAULT 1)
RETURNS boolean
AS 'MODULE_PATHNAME', 'rl_sliding_allow'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

-- Forgets every algorithm's state of one identity. Administrative: not for
-- PUBLIC; GRANT EXECUTE to the roles that may reset quotas.
CREATE FUNCTION @extschema@.rl_reset(identity text)
RETURNS void
AS 'MODULE_PATHNAME', 'rl_reset'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

REVOKE ALL ON FUNCTION @extschema@.rl_reset(text) FROM PUBLIC;

-- Checks the connection to Redis and reports the round-trip time of a PING.
CREATE FUNCTION @extschema@.rl_redis_ping(OUT server text, OUT rtt_ms double precision)
RETURNS record
AS 'MODULE_PATHNAME', 'rl_redis_ping'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
