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

COMMENT ON FUNCTION @extschema@.rl_fixed(text, integer, interval, integer) IS
    'Like rl_fixed(text, integer, bigint, integer) with the window as an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_fixed(text, integer, text, integer) IS
    'Like rl_fixed(text, integer, bigint, integer) with the window as a text: digits are milliseconds, anything else an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_fixed_allow(text, integer, interval, integer) IS
    'Like rl_fixed_allow(text, integer, bigint, integer) with the window as an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_fixed_allow(text, integer, text, integer) IS
    'Like rl_fixed_allow(text, integer, bigint, integer) with the window as a text: digits are milliseconds, anything else an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_sliding(text, integer, interval, integer) IS
    'Like rl_sliding(text, integer, bigint, integer) with the window as an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_sliding(text, integer, text, integer) IS
    'Like rl_sliding(text, integer, bigint, integer) with the window as a text: digits are milliseconds, anything else an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_sliding_allow(text, integer, interval, integer) IS
    'Like rl_sliding_allow(text, integer, bigint, integer) with the window as an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_sliding_allow(text, integer, text, integer) IS
    'Like rl_sliding_allow(text, integer, bigint, integer) with the window as a text: digits are milliseconds, anything else an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_token_bucket(text, integer, interval, integer, integer) IS
    'Like rl_token_bucket(text, integer, bigint, integer, integer) with the window as an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_token_bucket(text, integer, text, integer, integer) IS
    'Like rl_token_bucket(text, integer, bigint, integer, integer) with the window as a text: digits are milliseconds, anything else an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_token_bucket_allow(text, integer, interval, integer, integer) IS
    'Like rl_token_bucket_allow(text, integer, bigint, integer, integer) with the window as an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_token_bucket_allow(text, integer, text, integer, integer) IS
    'Like rl_token_bucket_allow(text, integer, bigint, integer, integer) with the window as a text: digits are milliseconds, anything else an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_token_bucket_refund(text, integer, interval, integer, integer) IS
    'Like rl_token_bucket_refund(text, integer, bigint, integer, integer) with the window as an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_token_bucket_refund(text, integer, text, integer, integer) IS
    'Like rl_token_bucket_refund(text, integer, bigint, integer, integer) with the window as a text: digits are milliseconds, anything else an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_gcra(text, integer, interval, integer, integer) IS
    'Like rl_gcra(text, integer, bigint, integer, integer) with the window as an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_gcra(text, integer, text, integer, integer) IS
    'Like rl_gcra(text, integer, bigint, integer, integer) with the window as a text: digits are milliseconds, anything else an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_gcra_allow(text, integer, interval, integer, integer) IS
    'Like rl_gcra_allow(text, integer, bigint, integer, integer) with the window as an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_gcra_allow(text, integer, text, integer, integer) IS
    'Like rl_gcra_allow(text, integer, bigint, integer, integer) with the window as a text: digits are milliseconds, anything else an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_gcra_refund(text, integer, interval, integer, integer) IS
    'Like rl_gcra_refund(text, integer, bigint, integer, integer) with the window as an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_gcra_refund(text, integer, text, integer, integer) IS
    'Like rl_gcra_refund(text, integer, bigint, integer, integer) with the window as a text: digits are milliseconds, anything else an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_sliding_counter(text, integer, interval, integer) IS
    'Like rl_sliding_counter(text, integer, bigint, integer) with the window as an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_sliding_counter(text, integer, text, integer) IS
    'Like rl_sliding_counter(text, integer, bigint, integer) with the window as a text: digits are milliseconds, anything else an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_sliding_counter_allow(text, integer, interval, integer) IS
    'Like rl_sliding_counter_allow(text, integer, bigint, integer) with the window as an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_sliding_counter_allow(text, integer, text, integer) IS
    'Like rl_sliding_counter_allow(text, integer, bigint, integer) with the window as a text: digits are milliseconds, anything else an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_sliding_counter_refund(text, integer, interval, integer) IS
    'Like rl_sliding_counter_refund(text, integer, bigint, integer) with the window as an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_sliding_counter_refund(text, integer, text, integer) IS
    'Like rl_sliding_counter_refund(text, integer, bigint, integer) with the window as a text: digits are milliseconds, anything else an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_fixed_refund(text, integer, interval, integer) IS
    'Like rl_fixed_refund(text, integer, bigint, integer) with the window as an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_fixed_refund(text, integer, text, integer) IS
    'Like rl_fixed_refund(text, integer, bigint, integer) with the window as a text: digits are milliseconds, anything else an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_sliding_refund(text, integer, interval, integer) IS
    'Like rl_sliding_refund(text, integer, bigint, integer) with the window as an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_sliding_refund(text, integer, text, integer) IS
    'Like rl_sliding_refund(text, integer, bigint, integer) with the window as a text: digits are milliseconds, anything else an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_concurrency_acquire(text, integer, interval) IS
    'Like rl_concurrency_acquire(text, integer, bigint) with the lease as an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_concurrency_acquire(text, integer, text) IS
    'Like rl_concurrency_acquire(text, integer, bigint) with the lease as a text: digits are milliseconds, anything else an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_concurrency_acquire_allow(text, integer, interval) IS
    'Like rl_concurrency_acquire_allow(text, integer, bigint) with the lease as an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_concurrency_acquire_allow(text, integer, text) IS
    'Like rl_concurrency_acquire_allow(text, integer, bigint) with the lease as a text: digits are milliseconds, anything else an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_fixed_many(text[], integer, interval, integer) IS
    'Like rl_fixed_many(text[], integer, bigint, integer) with the window as an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_fixed_many(text[], integer, text, integer) IS
    'Like rl_fixed_many(text[], integer, bigint, integer) with the window as a text: digits are milliseconds, anything else an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_sliding_many(text[], integer, interval, integer) IS
    'Like rl_sliding_many(text[], integer, bigint, integer) with the window as an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_sliding_many(text[], integer, text, integer) IS
    'Like rl_sliding_many(text[], integer, bigint, integer) with the window as a text: digits are milliseconds, anything else an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_sliding_counter_many(text[], integer, interval, integer) IS
    'Like rl_sliding_counter_many(text[], integer, bigint, integer) with the window as an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_sliding_counter_many(text[], integer, text, integer) IS
    'Like rl_sliding_counter_many(text[], integer, bigint, integer) with the window as a text: digits are milliseconds, anything else an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_token_bucket_many(text[], integer, interval, integer, integer) IS
    'Like rl_token_bucket_many(text[], integer, bigint, integer, integer) with the window as an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_token_bucket_many(text[], integer, text, integer, integer) IS
    'Like rl_token_bucket_many(text[], integer, bigint, integer, integer) with the window as a text: digits are milliseconds, anything else an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_gcra_many(text[], integer, interval, integer, integer) IS
    'Like rl_gcra_many(text[], integer, bigint, integer, integer) with the window as an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_gcra_many(text[], integer, text, integer, integer) IS
    'Like rl_gcra_many(text[], integer, bigint, integer, integer) with the window as a text: digits are milliseconds, anything else an interval; for the roles granted EXECUTE.';

-- Descriptions and named constraints (issue 21): every object says what it
-- does and who may call it (\df+ rl_*, \dT+, \dv+, \dd rl_policy*), and
-- each check of rl_policy is named for what it checks. A function's
-- description ends "; for every role." exactly when PUBLIC may execute it
-- (upgrade.sql checks both).

COMMENT ON TYPE @extschema@.rl_result IS
    'One rate-limit decision: allowed, the limit applied, units remaining, ms until the quota is back, ms until a retry can pass (-1: never).';

COMMENT ON FUNCTION @extschema@.rl_fixed(text, integer, bigint, integer) IS
    'Takes cost units from a fixed window of lim units per window_ms and returns the decision; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_fixed_allow(text, integer, bigint, integer) IS
    'Like rl_fixed, returning only whether the call may go ahead; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_fixed_refund(text, integer, bigint, integer) IS
    'Gives amount units back to the current fixed window; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_fixed_many(text[], integer, bigint, integer) IS
    'Decides a fixed window for each identity of the array on its own, one row each; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_sliding(text, integer, bigint, integer) IS
    'Takes cost units from a sliding window log of lim units in any window_ms and returns the decision; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_sliding_allow(text, integer, bigint, integer) IS
    'Like rl_sliding, returning only whether the call may go ahead; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_sliding_refund(text, integer, bigint, integer) IS
    'Removes the newest amount entries of the sliding window log; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_sliding_many(text[], integer, bigint, integer) IS
    'Decides a sliding window log for each identity of the array on its own, one row each; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_sliding_counter(text, integer, bigint, integer) IS
    'Takes cost units from a sliding window counter (the previous window weighted) of lim units per window_ms; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_sliding_counter_allow(text, integer, bigint, integer) IS
    'Like rl_sliding_counter, returning only whether the call may go ahead; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_sliding_counter_refund(text, integer, bigint, integer) IS
    'Gives amount units back to the current window of a sliding window counter; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_sliding_counter_many(text[], integer, bigint, integer) IS
    'Decides a sliding window counter for each identity of the array on its own, one row each; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_token_bucket(text, integer, bigint, integer, integer) IS
    'Takes cost tokens from a bucket of burst tokens (NULL: lim) refilled at lim per window_ms; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_token_bucket_allow(text, integer, bigint, integer, integer) IS
    'Like rl_token_bucket, returning only whether the call may go ahead; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_token_bucket_refund(text, integer, bigint, integer, integer) IS
    'Puts amount tokens back into the bucket, up to its capacity; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_token_bucket_many(text[], integer, bigint, integer, integer) IS
    'Decides a token bucket for each identity of the array on its own, one row each; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_gcra(text, integer, bigint, integer, integer) IS
    'Takes cost units by the generic cell rate algorithm: lim per window_ms, bursts of burst (NULL: lim); for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_gcra_allow(text, integer, bigint, integer, integer) IS
    'Like rl_gcra, returning only whether the call may go ahead; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_gcra_refund(text, integer, bigint, integer, integer) IS
    'Moves the theoretical arrival time back by amount units, never before now; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_gcra_many(text[], integer, bigint, integer, integer) IS
    'Decides GCRA for each identity of the array on its own, one row each; for the roles granted EXECUTE.';

COMMENT ON FUNCTION @extschema@.rl_concurrency_acquire(text, integer, bigint) IS
    'Takes one of lim concurrency slots, held until the transaction ends, a release or lease_ms; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_concurrency_acquire_allow(text, integer, bigint) IS
    'Like rl_concurrency_acquire, returning only whether a slot was taken; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_concurrency_release(text) IS
    'Gives back the slot this session took last for the identity, false when it holds none; for every role.';

COMMENT ON FUNCTION @extschema@.rl_check(text, text, integer) IS
    'Takes cost units from the identity''s quota under the named rl_policy row and returns the decision; for every role.';
COMMENT ON FUNCTION @extschema@.rl_allow(text, text, integer) IS
    'Like rl_check, returning only whether the call may go ahead; for every role.';
COMMENT ON FUNCTION @extschema@.rl_refund(text, text, integer) IS
    'Gives amount units back to the identity''s quota under the named policy; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_check_all(text[], text, integer) IS
    'Takes cost units under every named policy or under none, returning the most restrictive decision; for every role.';
COMMENT ON FUNCTION @extschema@.rl_allow_all(text[], text, integer) IS
    'Like rl_check_all, returning only whether the call may go ahead; for every role.';
COMMENT ON FUNCTION @extschema@.rl_check_many(text, text[], integer) IS
    'Decides the named policy for each identity of the array on its own, one row each; for every role.';
COMMENT ON FUNCTION @extschema@.rl_acquire(text, text) IS
    'Takes a slot of the named concurrency policy, held until the transaction ends, rl_release or the lease ends; for every role.';
COMMENT ON FUNCTION @extschema@.rl_acquire_allow(text, text) IS
    'Like rl_acquire, returning only whether a slot was taken; for every role.';
COMMENT ON FUNCTION @extschema@.rl_release(text, text) IS
    'Gives back the slot this session took last under the named concurrency policy, false when it holds none; for every role.';
COMMENT ON FUNCTION @extschema@.rl_headers(@extschema@.rl_result, text) IS
    'Builds the RateLimit, X-RateLimit-* and Retry-After HTTP headers of a decision as PostgREST''s JSON; for every role.';

COMMENT ON FUNCTION @extschema@.rl_guard() IS
    'Row guard trigger (AFTER INSERT OR UPDATE ... FOR EACH ROW) that charges each written row to a limit; the roles granted EXECUTE may create it.';
COMMENT ON FUNCTION @extschema@.rl_guard_statement() IS
    'Statement guard trigger (AFTER ... REFERENCING NEW TABLE ... FOR EACH STATEMENT) that charges a statement''s rows, all or nothing; the roles granted EXECUTE may create it.';
COMMENT ON FUNCTION @extschema@.rl_policy_changed() IS
    'Trigger of rl_policy that makes every session read the policies again; nobody calls it.';

COMMENT ON FUNCTION @extschema@.rl_reset(text) IS
    'Deletes every rate-limit and concurrency key of the identity in Redis; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_redis_ping() IS
    'Sends PING to Redis and reports the server and the round-trip time in ms; for every role.';
COMMENT ON FUNCTION @extschema@.rl_redis_stats_rows() IS
    'Returns the raw decision and error counters behind the view rl_redis_stats; for pg_read_all_stats.';
COMMENT ON FUNCTION @extschema@.rl_redis_stats_scope() IS
    'Says where the statistics are kept: server (shared memory, library preloaded) or backend; for pg_read_all_stats.';
COMMENT ON FUNCTION @extschema@.rl_redis_rtt_bounds() IS
    'Returns the upper bounds in ms of the round-trip time histogram''s buckets; for pg_read_all_stats.';
COMMENT ON FUNCTION @extschema@.rl_redis_stats_reset() IS
    'Sets every statistics counter back to zero; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_redis_metrics() IS
    'Returns the statistics in the Prometheus text exposition format; for pg_read_all_stats.';
COMMENT ON FUNCTION @extschema@.rl_redis_connections() IS
    'Lists this backend''s connections to Redis with their state and last error; for pg_read_all_stats.';
COMMENT ON FUNCTION @extschema@.rl_top_denied(text, interval, integer) IS
    'Lists the n identities most denied under a policy since an interval ago (rl_redis.track_denials); for the roles granted EXECUTE.';

COMMENT ON VIEW @extschema@.rl_redis_stats IS
    'Decision, error and round-trip time counters per database and policy; readable by pg_read_all_stats.';

COMMENT ON TABLE @extschema@.rl_policy IS
    'Named rate and concurrency limits: read by every role, written by its owner and the roles it grants.';
COMMENT ON TRIGGER rl_policy_changed ON @extschema@.rl_policy IS
    'Makes every session read the policies again after a change to the table.';

ALTER TABLE @extschema@.rl_policy RENAME CONSTRAINT rl_policy_name_check TO rl_policy_name_format;
ALTER TABLE @extschema@.rl_policy RENAME CONSTRAINT rl_policy_lim_check TO rl_policy_lim_positive;
ALTER TABLE @extschema@.rl_policy RENAME CONSTRAINT rl_policy_window_ms_check TO rl_policy_window_ms_positive;
ALTER TABLE @extschema@.rl_policy RENAME CONSTRAINT rl_policy_burst_check TO rl_policy_burst_positive;
ALTER TABLE @extschema@.rl_policy RENAME CONSTRAINT rl_policy_check TO rl_policy_burst_only_for_buckets;

COMMENT ON CONSTRAINT rl_policy_pkey ON @extschema@.rl_policy IS
    'A policy name is unique.';
COMMENT ON CONSTRAINT rl_policy_name_format ON @extschema@.rl_policy IS
    'A policy name is letters, digits and _ . : - only, under 64 bytes.';
COMMENT ON CONSTRAINT rl_policy_algorithm_known ON @extschema@.rl_policy IS
    'The algorithm is fixed, sliding, token_bucket, gcra, sliding_counter or concurrency.';
COMMENT ON CONSTRAINT rl_policy_lim_positive ON @extschema@.rl_policy IS
    'lim is greater than zero.';
COMMENT ON CONSTRAINT rl_policy_sliding_lim_max ON @extschema@.rl_policy IS
    'A sliding window log keeps one entry per unit: its lim is at most 100000.';
COMMENT ON CONSTRAINT rl_policy_window_ms_positive ON @extschema@.rl_policy IS
    'window_ms is greater than zero.';
COMMENT ON CONSTRAINT rl_policy_window_ms_max ON @extschema@.rl_policy IS
    'window_ms is at most 3153600000000 (100 years).';
COMMENT ON CONSTRAINT rl_policy_burst_positive ON @extschema@.rl_policy IS
    'A burst, when given, is greater than zero.';
COMMENT ON CONSTRAINT rl_policy_burst_only_for_buckets ON @extschema@.rl_policy IS
    'Only token_bucket and gcra policies take a burst; the others leave it NULL.';
COMMENT ON CONSTRAINT rl_policy_burst_refill_max ON @extschema@.rl_policy IS
    'The whole burst refills within 100 years: burst * window_ms <= lim * 3153600000000.';
