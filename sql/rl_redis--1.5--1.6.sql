/* rl_redis--1.5--1.6.sql */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION rl_redis UPDATE TO '1.6'" to load this file. \quit

-- Windows as intervals (issue 21): every function of explicit arguments
-- also takes its window (or a slot's lease) as an interval, or as a text
-- that holds one ('1 minute'; a text of digits alone is milliseconds), so
-- that rl_fixed('api', 5, '1 minute') works. Each overload is the same C
-- function: the window argument is read in one place (rl_get_window_ms),
-- which refuses months and years (their length varies) and fractions of a
-- millisecond. Administrators only, like the bigint forms.

CREATE FUNCTION @extschema@.rl_fixed(identity text, lim integer, window_length interval, cost integer DEFAULT 1)
RETURNS @extschema@.rl_result
AS 'MODULE_PATHNAME', 'rl_fixed'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
REVOKE ALL ON FUNCTION @extschema@.rl_fixed(identity text, lim integer, window_length interval, cost integer) FROM PUBLIC;

CREATE FUNCTION @extschema@.rl_fixed(identity text, lim integer, window_length text, cost integer DEFAULT 1)
RETURNS @extschema@.rl_result
AS 'MODULE_PATHNAME', 'rl_fixed'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
REVOKE ALL ON FUNCTION @extschema@.rl_fixed(identity text, lim integer, window_length text, cost integer) FROM PUBLIC;

CREATE FUNCTION @extschema@.rl_fixed_allow(identity text, lim integer, window_length interval, cost integer DEFAULT 1)
RETURNS boolean
AS 'MODULE_PATHNAME', 'rl_fixed_allow'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
REVOKE ALL ON FUNCTION @extschema@.rl_fixed_allow(identity text, lim integer, window_length interval, cost integer) FROM PUBLIC;

CREATE FUNCTION @extschema@.rl_fixed_allow(identity text, lim integer, window_length text, cost integer DEFAULT 1)
RETURNS boolean
AS 'MODULE_PATHNAME', 'rl_fixed_allow'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
REVOKE ALL ON FUNCTION @extschema@.rl_fixed_allow(identity text, lim integer, window_length text, cost integer) FROM PUBLIC;

CREATE FUNCTION @extschema@.rl_sliding(identity text, lim integer, window_length interval, cost integer DEFAULT 1)
RETURNS @extschema@.rl_result
AS 'MODULE_PATHNAME', 'rl_sliding'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
REVOKE ALL ON FUNCTION @extschema@.rl_sliding(identity text, lim integer, window_length interval, cost integer) FROM PUBLIC;

CREATE FUNCTION @extschema@.rl_sliding(identity text, lim integer, window_length text, cost integer DEFAULT 1)
RETURNS @extschema@.rl_result
AS 'MODULE_PATHNAME', 'rl_sliding'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
REVOKE ALL ON FUNCTION @extschema@.rl_sliding(identity text, lim integer, window_length text, cost integer) FROM PUBLIC;

CREATE FUNCTION @extschema@.rl_sliding_allow(identity text, lim integer, window_length interval, cost integer DEFAULT 1)
RETURNS boolean
AS 'MODULE_PATHNAME', 'rl_sliding_allow'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
REVOKE ALL ON FUNCTION @extschema@.rl_sliding_allow(identity text, lim integer, window_length interval, cost integer) FROM PUBLIC;

CREATE FUNCTION @extschema@.rl_sliding_allow(identity text, lim integer, window_length text, cost integer DEFAULT 1)
RETURNS boolean
AS 'MODULE_PATHNAME', 'rl_sliding_allow'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
REVOKE ALL ON FUNCTION @extschema@.rl_sliding_allow(identity text, lim integer, window_length text, cost integer) FROM PUBLIC;

CREATE FUNCTION @extschema@.rl_token_bucket(identity text, lim integer, window_length interval, cost integer DEFAULT 1, burst integer DEFAULT NULL::integer)
RETURNS @extschema@.rl_result
AS 'MODULE_PATHNAME', 'rl_token_bucket'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
REVOKE ALL ON FUNCTION @extschema@.rl_token_bucket(identity text, lim integer, window_length interval, cost integer, burst integer) FROM PUBLIC;

CREATE FUNCTION @extschema@.rl_token_bucket(identity text, lim integer, window_length text, cost integer DEFAULT 1, burst integer DEFAULT NULL::integer)
RETURNS @extschema@.rl_result
AS 'MODULE_PATHNAME', 'rl_token_bucket'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
REVOKE ALL ON FUNCTION @extschema@.rl_token_bucket(identity text, lim integer, window_length text, cost integer, burst integer) FROM PUBLIC;

CREATE FUNCTION @extschema@.rl_token_bucket_allow(identity text, lim integer, window_length interval, cost integer DEFAULT 1, burst integer DEFAULT NULL::integer)
RETURNS boolean
AS 'MODULE_PATHNAME', 'rl_token_bucket_allow'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
REVOKE ALL ON FUNCTION @extschema@.rl_token_bucket_allow(identity text, lim integer, window_length interval, cost integer, burst integer) FROM PUBLIC;

CREATE FUNCTION @extschema@.rl_token_bucket_allow(identity text, lim integer, window_length text, cost integer DEFAULT 1, burst integer DEFAULT NULL::integer)
RETURNS boolean
AS 'MODULE_PATHNAME', 'rl_token_bucket_allow'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
REVOKE ALL ON FUNCTION @extschema@.rl_token_bucket_allow(identity text, lim integer, window_length text, cost integer, burst integer) FROM PUBLIC;

CREATE FUNCTION @extschema@.rl_token_bucket_refund(identity text, lim integer, window_length interval, amount integer DEFAULT 1, burst integer DEFAULT NULL::integer)
RETURNS @extschema@.rl_result
AS 'MODULE_PATHNAME', 'rl_token_bucket_refund'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
REVOKE ALL ON FUNCTION @extschema@.rl_token_bucket_refund(identity text, lim integer, window_length interval, amount integer, burst integer) FROM PUBLIC;

CREATE FUNCTION @extschema@.rl_token_bucket_refund(identity text, lim integer, window_length text, amount integer DEFAULT 1, burst integer DEFAULT NULL::integer)
RETURNS @extschema@.rl_result
AS 'MODULE_PATHNAME', 'rl_token_bucket_refund'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
REVOKE ALL ON FUNCTION @extschema@.rl_token_bucket_refund(identity text, lim integer, window_length text, amount integer, burst integer) FROM PUBLIC;

CREATE FUNCTION @extschema@.rl_gcra(identity text, lim integer, window_length interval, cost integer DEFAULT 1, burst integer DEFAULT NULL::integer)
RETURNS @extschema@.rl_result
AS 'MODULE_PATHNAME', 'rl_gcra'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
REVOKE ALL ON FUNCTION @extschema@.rl_gcra(identity text, lim integer, window_length interval, cost integer, burst integer) FROM PUBLIC;

CREATE FUNCTION @extschema@.rl_gcra(identity text, lim integer, window_length text, cost integer DEFAULT 1, burst integer DEFAULT NULL::integer)
RETURNS @extschema@.rl_result
AS 'MODULE_PATHNAME', 'rl_gcra'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
REVOKE ALL ON FUNCTION @extschema@.rl_gcra(identity text, lim integer, window_length text, cost integer, burst integer) FROM PUBLIC;

CREATE FUNCTION @extschema@.rl_gcra_allow(identity text, lim integer, window_length interval, cost integer DEFAULT 1, burst integer DEFAULT NULL::integer)
RETURNS boolean
AS 'MODULE_PATHNAME', 'rl_gcra_allow'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
REVOKE ALL ON FUNCTION @extschema@.rl_gcra_allow(identity text, lim integer, window_length interval, cost integer, burst integer) FROM PUBLIC;

CREATE FUNCTION @extschema@.rl_gcra_allow(identity text, lim integer, window_length text, cost integer DEFAULT 1, burst integer DEFAULT NULL::integer)
RETURNS boolean
AS 'MODULE_PATHNAME', 'rl_gcra_allow'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
REVOKE ALL ON FUNCTION @extschema@.rl_gcra_allow(identity text, lim integer, window_length text, cost integer, burst integer) FROM PUBLIC;

CREATE FUNCTION @extschema@.rl_gcra_refund(identity text, lim integer, window_length interval, amount integer DEFAULT 1, burst integer DEFAULT NULL::integer)
RETURNS @extschema@.rl_result
AS 'MODULE_PATHNAME', 'rl_gcra_refund'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
REVOKE ALL ON FUNCTION @extschema@.rl_gcra_refund(identity text, lim integer, window_length interval, amount integer, burst integer) FROM PUBLIC;

CREATE FUNCTION @extschema@.rl_gcra_refund(identity text, lim integer, window_length text, amount integer DEFAULT 1, burst integer DEFAULT NULL::integer)
RETURNS @extschema@.rl_result
AS 'MODULE_PATHNAME', 'rl_gcra_refund'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
REVOKE ALL ON FUNCTION @extschema@.rl_gcra_refund(identity text, lim integer, window_length text, amount integer, burst integer) FROM PUBLIC;

CREATE FUNCTION @extschema@.rl_sliding_counter(identity text, lim integer, window_length interval, cost integer DEFAULT 1)
RETURNS @extschema@.rl_result
AS 'MODULE_PATHNAME', 'rl_sliding_counter'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
REVOKE ALL ON FUNCTION @extschema@.rl_sliding_counter(identity text, lim integer, window_length interval, cost integer) FROM PUBLIC;

CREATE FUNCTION @extschema@.rl_sliding_counter(identity text, lim integer, window_length text, cost integer DEFAULT 1)
RETURNS @extschema@.rl_result
AS 'MODULE_PATHNAME', 'rl_sliding_counter'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
REVOKE ALL ON FUNCTION @extschema@.rl_sliding_counter(identity text, lim integer, window_length text, cost integer) FROM PUBLIC;

CREATE FUNCTION @extschema@.rl_sliding_counter_allow(identity text, lim integer, window_length interval, cost integer DEFAULT 1)
RETURNS boolean
AS 'MODULE_PATHNAME', 'rl_sliding_counter_allow'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
REVOKE ALL ON FUNCTION @extschema@.rl_sliding_counter_allow(identity text, lim integer, window_length interval, cost integer) FROM PUBLIC;

CREATE FUNCTION @extschema@.rl_sliding_counter_allow(identity text, lim integer, window_length text, cost integer DEFAULT 1)
RETURNS boolean
AS 'MODULE_PATHNAME', 'rl_sliding_counter_allow'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
REVOKE ALL ON FUNCTION @extschema@.rl_sliding_counter_allow(identity text, lim integer, window_length text, cost integer) FROM PUBLIC;

CREATE FUNCTION @extschema@.rl_sliding_counter_refund(identity text, lim integer, window_length interval, amount integer DEFAULT 1)
RETURNS @extschema@.rl_result
AS 'MODULE_PATHNAME', 'rl_sliding_counter_refund'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
REVOKE ALL ON FUNCTION @extschema@.rl_sliding_counter_refund(identity text, lim integer, window_length interval, amount integer) FROM PUBLIC;

CREATE FUNCTION @extschema@.rl_sliding_counter_refund(identity text, lim integer, window_length text, amount integer DEFAULT 1)
RETURNS @extschema@.rl_result
AS 'MODULE_PATHNAME', 'rl_sliding_counter_refund'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
REVOKE ALL ON FUNCTION @extschema@.rl_sliding_counter_refund(identity text, lim integer, window_length text, amount integer) FROM PUBLIC;

CREATE FUNCTION @extschema@.rl_fixed_refund(identity text, lim integer, window_length interval, amount integer DEFAULT 1)
RETURNS @extschema@.rl_result
AS 'MODULE_PATHNAME', 'rl_fixed_refund'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
REVOKE ALL ON FUNCTION @extschema@.rl_fixed_refund(identity text, lim integer, window_length interval, amount integer) FROM PUBLIC;

CREATE FUNCTION @extschema@.rl_fixed_refund(identity text, lim integer, window_length text, amount integer DEFAULT 1)
RETURNS @extschema@.rl_result
AS 'MODULE_PATHNAME', 'rl_fixed_refund'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
REVOKE ALL ON FUNCTION @extschema@.rl_fixed_refund(identity text, lim integer, window_length text, amount integer) FROM PUBLIC;

CREATE FUNCTION @extschema@.rl_sliding_refund(identity text, lim integer, window_length interval, amount integer DEFAULT 1)
RETURNS @extschema@.rl_result
AS 'MODULE_PATHNAME', 'rl_sliding_refund'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
REVOKE ALL ON FUNCTION @extschema@.rl_sliding_refund(identity text, lim integer, window_length interval, amount integer) FROM PUBLIC;

CREATE FUNCTION @extschema@.rl_sliding_refund(identity text, lim integer, window_length text, amount integer DEFAULT 1)
RETURNS @extschema@.rl_result
AS 'MODULE_PATHNAME', 'rl_sliding_refund'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
REVOKE ALL ON FUNCTION @extschema@.rl_sliding_refund(identity text, lim integer, window_length text, amount integer) FROM PUBLIC;

CREATE FUNCTION @extschema@.rl_concurrency_acquire(identity text, lim integer, lease interval)
RETURNS @extschema@.rl_result
AS 'MODULE_PATHNAME', 'rl_concurrency_acquire'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
REVOKE ALL ON FUNCTION @extschema@.rl_concurrency_acquire(identity text, lim integer, lease interval) FROM PUBLIC;

CREATE FUNCTION @extschema@.rl_concurrency_acquire(identity text, lim integer, lease text)
RETURNS @extschema@.rl_result
AS 'MODULE_PATHNAME', 'rl_concurrency_acquire'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
REVOKE ALL ON FUNCTION @extschema@.rl_concurrency_acquire(identity text, lim integer, lease text) FROM PUBLIC;

CREATE FUNCTION @extschema@.rl_concurrency_acquire_allow(identity text, lim integer, lease interval)
RETURNS boolean
AS 'MODULE_PATHNAME', 'rl_concurrency_acquire_allow'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
REVOKE ALL ON FUNCTION @extschema@.rl_concurrency_acquire_allow(identity text, lim integer, lease interval) FROM PUBLIC;

CREATE FUNCTION @extschema@.rl_concurrency_acquire_allow(identity text, lim integer, lease text)
RETURNS boolean
AS 'MODULE_PATHNAME', 'rl_concurrency_acquire_allow'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
REVOKE ALL ON FUNCTION @extschema@.rl_concurrency_acquire_allow(identity text, lim integer, lease text) FROM PUBLIC;

CREATE FUNCTION @extschema@.rl_fixed_many(identities text[], lim integer, window_length interval, cost integer DEFAULT 1)
RETURNS TABLE(identity text, allowed boolean, lim integer, remaining integer, reset_ms bigint, retry_after_ms bigint)
AS 'MODULE_PATHNAME', 'rl_fixed_many'
LANGUAGE C VOLATILE PARALLEL UNSAFE ROWS 100;
REVOKE ALL ON FUNCTION @extschema@.rl_fixed_many(identities text[], lim integer, window_length interval, cost integer) FROM PUBLIC;

CREATE FUNCTION @extschema@.rl_fixed_many(identities text[], lim integer, window_length text, cost integer DEFAULT 1)
RETURNS TABLE(identity text, allowed boolean, lim integer, remaining integer, reset_ms bigint, retry_after_ms bigint)
AS 'MODULE_PATHNAME', 'rl_fixed_many'
LANGUAGE C VOLATILE PARALLEL UNSAFE ROWS 100;
REVOKE ALL ON FUNCTION @extschema@.rl_fixed_many(identities text[], lim integer, window_length text, cost integer) FROM PUBLIC;

CREATE FUNCTION @extschema@.rl_sliding_many(identities text[], lim integer, window_length interval, cost integer DEFAULT 1)
RETURNS TABLE(identity text, allowed boolean, lim integer, remaining integer, reset_ms bigint, retry_after_ms bigint)
AS 'MODULE_PATHNAME', 'rl_sliding_many'
LANGUAGE C VOLATILE PARALLEL UNSAFE ROWS 100;
REVOKE ALL ON FUNCTION @extschema@.rl_sliding_many(identities text[], lim integer, window_length interval, cost integer) FROM PUBLIC;

CREATE FUNCTION @extschema@.rl_sliding_many(identities text[], lim integer, window_length text, cost integer DEFAULT 1)
RETURNS TABLE(identity text, allowed boolean, lim integer, remaining integer, reset_ms bigint, retry_after_ms bigint)
AS 'MODULE_PATHNAME', 'rl_sliding_many'
LANGUAGE C VOLATILE PARALLEL UNSAFE ROWS 100;
REVOKE ALL ON FUNCTION @extschema@.rl_sliding_many(identities text[], lim integer, window_length text, cost integer) FROM PUBLIC;

CREATE FUNCTION @extschema@.rl_sliding_counter_many(identities text[], lim integer, window_length interval, cost integer DEFAULT 1)
RETURNS TABLE(identity text, allowed boolean, lim integer, remaining integer, reset_ms bigint, retry_after_ms bigint)
AS 'MODULE_PATHNAME', 'rl_sliding_counter_many'
LANGUAGE C VOLATILE PARALLEL UNSAFE ROWS 100;
REVOKE ALL ON FUNCTION @extschema@.rl_sliding_counter_many(identities text[], lim integer, window_length interval, cost integer) FROM PUBLIC;

CREATE FUNCTION @extschema@.rl_sliding_counter_many(identities text[], lim integer, window_length text, cost integer DEFAULT 1)
RETURNS TABLE(identity text, allowed boolean, lim integer, remaining integer, reset_ms bigint, retry_after_ms bigint)
AS 'MODULE_PATHNAME', 'rl_sliding_counter_many'
LANGUAGE C VOLATILE PARALLEL UNSAFE ROWS 100;
REVOKE ALL ON FUNCTION @extschema@.rl_sliding_counter_many(identities text[], lim integer, window_length text, cost integer) FROM PUBLIC;

CREATE FUNCTION @extschema@.rl_token_bucket_many(identities text[], lim integer, window_length interval, cost integer DEFAULT 1, burst integer DEFAULT NULL::integer)
RETURNS TABLE(identity text, allowed boolean, lim integer, remaining integer, reset_ms bigint, retry_after_ms bigint)
AS 'MODULE_PATHNAME', 'rl_token_bucket_many'
LANGUAGE C VOLATILE PARALLEL UNSAFE ROWS 100;
REVOKE ALL ON FUNCTION @extschema@.rl_token_bucket_many(identities text[], lim integer, window_length interval, cost integer, burst integer) FROM PUBLIC;

CREATE FUNCTION @extschema@.rl_token_bucket_many(identities text[], lim integer, window_length text, cost integer DEFAULT 1, burst integer DEFAULT NULL::integer)
RETURNS TABLE(identity text, allowed boolean, lim integer, remaining integer, reset_ms bigint, retry_after_ms bigint)
AS 'MODULE_PATHNAME', 'rl_token_bucket_many'
LANGUAGE C VOLATILE PARALLEL UNSAFE ROWS 100;
REVOKE ALL ON FUNCTION @extschema@.rl_token_bucket_many(identities text[], lim integer, window_length text, cost integer, burst integer) FROM PUBLIC;

CREATE FUNCTION @extschema@.rl_gcra_many(identities text[], lim integer, window_length interval, cost integer DEFAULT 1, burst integer DEFAULT NULL::integer)
RETURNS TABLE(identity text, allowed boolean, lim integer, remaining integer, reset_ms bigint, retry_after_ms bigint)
AS 'MODULE_PATHNAME', 'rl_gcra_many'
LANGUAGE C VOLATILE PARALLEL UNSAFE ROWS 100;
REVOKE ALL ON FUNCTION @extschema@.rl_gcra_many(identities text[], lim integer, window_length interval, cost integer, burst integer) FROM PUBLIC;

CREATE FUNCTION @extschema@.rl_gcra_many(identities text[], lim integer, window_length text, cost integer DEFAULT 1, burst integer DEFAULT NULL::integer)
RETURNS TABLE(identity text, allowed boolean, lim integer, remaining integer, reset_ms bigint, retry_after_ms bigint)
AS 'MODULE_PATHNAME', 'rl_gcra_many'
LANGUAGE C VOLATILE PARALLEL UNSAFE ROWS 100;
REVOKE ALL ON FUNCTION @extschema@.rl_gcra_many(identities text[], lim integer, window_length text, cost integer, burst integer) FROM PUBLIC;
