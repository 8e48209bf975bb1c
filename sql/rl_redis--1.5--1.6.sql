/* rl_redis--1.5--1.6.sql */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION rl_redis UPDATE TO '1.6'" to load this file. \quit

-- Windows as intervals (issue 21): every function of explicit arguments
-- also takes its window (or a slot's lease) as an interval, or as a text
-- that holds one ('1 minute'; a number alone is milliseconds), so
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
    'Like rl_fixed(text, integer, bigint, integer) with the window as a text: a number alone is milliseconds, anything else an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_fixed_allow(text, integer, interval, integer) IS
    'Like rl_fixed_allow(text, integer, bigint, integer) with the window as an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_fixed_allow(text, integer, text, integer) IS
    'Like rl_fixed_allow(text, integer, bigint, integer) with the window as a text: a number alone is milliseconds, anything else an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_sliding(text, integer, interval, integer) IS
    'Like rl_sliding(text, integer, bigint, integer) with the window as an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_sliding(text, integer, text, integer) IS
    'Like rl_sliding(text, integer, bigint, integer) with the window as a text: a number alone is milliseconds, anything else an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_sliding_allow(text, integer, interval, integer) IS
    'Like rl_sliding_allow(text, integer, bigint, integer) with the window as an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_sliding_allow(text, integer, text, integer) IS
    'Like rl_sliding_allow(text, integer, bigint, integer) with the window as a text: a number alone is milliseconds, anything else an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_token_bucket(text, integer, interval, integer, integer) IS
    'Like rl_token_bucket(text, integer, bigint, integer, integer) with the window as an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_token_bucket(text, integer, text, integer, integer) IS
    'Like rl_token_bucket(text, integer, bigint, integer, integer) with the window as a text: a number alone is milliseconds, anything else an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_token_bucket_allow(text, integer, interval, integer, integer) IS
    'Like rl_token_bucket_allow(text, integer, bigint, integer, integer) with the window as an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_token_bucket_allow(text, integer, text, integer, integer) IS
    'Like rl_token_bucket_allow(text, integer, bigint, integer, integer) with the window as a text: a number alone is milliseconds, anything else an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_token_bucket_refund(text, integer, interval, integer, integer) IS
    'Like rl_token_bucket_refund(text, integer, bigint, integer, integer) with the window as an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_token_bucket_refund(text, integer, text, integer, integer) IS
    'Like rl_token_bucket_refund(text, integer, bigint, integer, integer) with the window as a text: a number alone is milliseconds, anything else an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_gcra(text, integer, interval, integer, integer) IS
    'Like rl_gcra(text, integer, bigint, integer, integer) with the window as an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_gcra(text, integer, text, integer, integer) IS
    'Like rl_gcra(text, integer, bigint, integer, integer) with the window as a text: a number alone is milliseconds, anything else an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_gcra_allow(text, integer, interval, integer, integer) IS
    'Like rl_gcra_allow(text, integer, bigint, integer, integer) with the window as an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_gcra_allow(text, integer, text, integer, integer) IS
    'Like rl_gcra_allow(text, integer, bigint, integer, integer) with the window as a text: a number alone is milliseconds, anything else an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_gcra_refund(text, integer, interval, integer, integer) IS
    'Like rl_gcra_refund(text, integer, bigint, integer, integer) with the window as an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_gcra_refund(text, integer, text, integer, integer) IS
    'Like rl_gcra_refund(text, integer, bigint, integer, integer) with the window as a text: a number alone is milliseconds, anything else an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_sliding_counter(text, integer, interval, integer) IS
    'Like rl_sliding_counter(text, integer, bigint, integer) with the window as an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_sliding_counter(text, integer, text, integer) IS
    'Like rl_sliding_counter(text, integer, bigint, integer) with the window as a text: a number alone is milliseconds, anything else an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_sliding_counter_allow(text, integer, interval, integer) IS
    'Like rl_sliding_counter_allow(text, integer, bigint, integer) with the window as an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_sliding_counter_allow(text, integer, text, integer) IS
    'Like rl_sliding_counter_allow(text, integer, bigint, integer) with the window as a text: a number alone is milliseconds, anything else an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_sliding_counter_refund(text, integer, interval, integer) IS
    'Like rl_sliding_counter_refund(text, integer, bigint, integer) with the window as an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_sliding_counter_refund(text, integer, text, integer) IS
    'Like rl_sliding_counter_refund(text, integer, bigint, integer) with the window as a text: a number alone is milliseconds, anything else an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_fixed_refund(text, integer, interval, integer) IS
    'Like rl_fixed_refund(text, integer, bigint, integer) with the window as an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_fixed_refund(text, integer, text, integer) IS
    'Like rl_fixed_refund(text, integer, bigint, integer) with the window as a text: a number alone is milliseconds, anything else an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_sliding_refund(text, integer, interval, integer) IS
    'Like rl_sliding_refund(text, integer, bigint, integer) with the window as an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_sliding_refund(text, integer, text, integer) IS
    'Like rl_sliding_refund(text, integer, bigint, integer) with the window as a text: a number alone is milliseconds, anything else an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_concurrency_acquire(text, integer, interval) IS
    'Like rl_concurrency_acquire(text, integer, bigint) with the lease as an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_concurrency_acquire(text, integer, text) IS
    'Like rl_concurrency_acquire(text, integer, bigint) with the lease as a text: a number alone is milliseconds, anything else an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_concurrency_acquire_allow(text, integer, interval) IS
    'Like rl_concurrency_acquire_allow(text, integer, bigint) with the lease as an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_concurrency_acquire_allow(text, integer, text) IS
    'Like rl_concurrency_acquire_allow(text, integer, bigint) with the lease as a text: a number alone is milliseconds, anything else an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_fixed_many(text[], integer, interval, integer) IS
    'Like rl_fixed_many(text[], integer, bigint, integer) with the window as an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_fixed_many(text[], integer, text, integer) IS
    'Like rl_fixed_many(text[], integer, bigint, integer) with the window as a text: a number alone is milliseconds, anything else an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_sliding_many(text[], integer, interval, integer) IS
    'Like rl_sliding_many(text[], integer, bigint, integer) with the window as an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_sliding_many(text[], integer, text, integer) IS
    'Like rl_sliding_many(text[], integer, bigint, integer) with the window as a text: a number alone is milliseconds, anything else an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_sliding_counter_many(text[], integer, interval, integer) IS
    'Like rl_sliding_counter_many(text[], integer, bigint, integer) with the window as an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_sliding_counter_many(text[], integer, text, integer) IS
    'Like rl_sliding_counter_many(text[], integer, bigint, integer) with the window as a text: a number alone is milliseconds, anything else an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_token_bucket_many(text[], integer, interval, integer, integer) IS
    'Like rl_token_bucket_many(text[], integer, bigint, integer, integer) with the window as an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_token_bucket_many(text[], integer, text, integer, integer) IS
    'Like rl_token_bucket_many(text[], integer, bigint, integer, integer) with the window as a text: a number alone is milliseconds, anything else an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_gcra_many(text[], integer, interval, integer, integer) IS
    'Like rl_gcra_many(text[], integer, bigint, integer, integer) with the window as an interval; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_gcra_many(text[], integer, text, integer, integer) IS
    'Like rl_gcra_many(text[], integer, bigint, integer, integer) with the window as a text: a number alone is milliseconds, anything else an interval; for the roles granted EXECUTE.';

-- Inspecting a quota (issue 21, item 1): rl_inspect, rl_concurrency_holders
-- and the peeks of the statistics.

-- what rl_check (or rl_acquire) would answer now; charges and writes nothing
CREATE FUNCTION @extschema@.rl_inspect(policy text, identity text, cost integer DEFAULT 1)
RETURNS @extschema@.rl_result
AS 'MODULE_PATHNAME', 'rl_inspect'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

-- who holds the slots of a concurrency policy (one identity's, or with
-- identity NULL every identity's): backends' pids, so for administrators
CREATE FUNCTION @extschema@.rl_concurrency_holders(policy text, identity text DEFAULT NULL)
RETURNS TABLE (identity text, holder text, backend_pid integer, lease_ends timestamptz)
AS 'MODULE_PATHNAME', 'rl_concurrency_holders'
LANGUAGE C VOLATILE PARALLEL RESTRICTED;
REVOKE ALL ON FUNCTION @extschema@.rl_concurrency_holders(text, text) FROM PUBLIC;

-- peeks (calls of cost 0 and rl_inspect) are counted apart, and so are the
-- calls a shadow policy would have denied (below): two columns at the end of
-- rl_redis_stats_rows and of the view, and two metrics; the view and
-- rl_redis_metrics are made again over the new function, with their grants.
-- The histogram's count is the sum of its buckets (a denial the deny cache
-- answered made no round trip: 1.5 counted it in the count, not in a bucket)
DROP FUNCTION @extschema@.rl_redis_metrics();
DROP VIEW @extschema@.rl_redis_stats;
DROP FUNCTION @extschema@.rl_redis_stats_rows();

CREATE FUNCTION @extschema@.rl_redis_stats_rows(
    OUT dbid oid, OUT policy text, OUT algorithm text,
    OUT calls bigint, OUT allowed bigint, OUT denied bigint,
    OUT units_taken bigint, OUT units_refunded bigint,
    OUT errors bigint, OUT errors_connection bigint, OUT errors_timeout bigint,
    OUT errors_reply bigint, OUT errors_protocol bigint,
    OUT fallback_allow bigint, OUT fallback_deny bigint, OUT outages bigint,
    OUT rtt_buckets bigint[], OUT rtt_sum_ms double precision,
    OUT peeks bigint, OUT shadow_denied bigint)
RETURNS SETOF record
AS 'MODULE_PATHNAME', 'rl_redis_stats_rows'
LANGUAGE C VOLATILE PARALLEL RESTRICTED;

CREATE VIEW @extschema@.rl_redis_stats AS
SELECT d.datname AS dbname, s.policy, s.algorithm,
       s.calls, s.allowed, s.denied, s.units_taken, s.units_refunded,
       s.errors, s.errors_connection, s.errors_timeout, s.errors_reply,
       s.errors_protocol, s.fallback_allow, s.fallback_deny, s.outages,
       s.rtt_buckets, s.rtt_sum_ms,
       @extschema@.rl_redis_stats_scope() AS scope,
       s.peeks, s.shadow_denied
  FROM @extschema@.rl_redis_stats_rows() s
  LEFT JOIN pg_catalog.pg_database d ON d.oid = s.dbid;

-- The statistics in Prometheus' text exposition format (version 0.0.4).
CREATE FUNCTION @extschema@.rl_redis_metrics()
RETURNS text
LANGUAGE sql VOLATILE PARALLEL RESTRICTED
SET search_path = pg_catalog, pg_temp
SET extra_float_digits = 1
BEGIN ATOMIC
  WITH rows AS (
    SELECT '{database="' || replace(replace(replace(coalesce(s.dbname, ''), '\', '\\'), '"', '\"'), E'\n', '\n')
           || '",policy="' || replace(replace(replace(coalesce(s.policy, ''), '\', '\\'), '"', '\"'), E'\n', '\n')
           || '",algorithm="' || replace(replace(replace(s.algorithm, '\', '\\'), '"', '\"'), E'\n', '\n')
           || '"' AS labels, s.*
      FROM @extschema@.rl_redis_stats s
     WHERE s.dbname IS NOT NULL     -- rows of dropped databases stay until a restart
  ), counters(metric, help, ord) AS (
    VALUES ('calls', 'Decisions asked of Redis (allowed + denied + errors).', 1),
           ('allowed', 'Calls Redis allowed.', 2),
           ('denied', 'Calls Redis denied.', 3),
           ('units_taken', 'Units taken by allowed calls.', 4),
           ('units_refunded', 'Units given back (rolled-back transactions, refund functions).', 5),
           ('errors', 'Calls that got no decision from Redis.', 6),
           ('fallback_allow', 'Failed calls that rl_redis.on_error allowed.', 7),
           ('fallback_deny', 'Failed calls that rl_redis.on_error denied.', 8),
           ('outages', 'Failures that began an outage (the circuit breaker opened).', 9),
           ('peeks', 'Peeks Redis answered (rl_inspect, cost 0), not in calls.', 12),
           ('shadow_denied', 'Calls a shadow policy would have denied (it allowed them).', 13)
  ), lines(ord, grp, sub, line) AS (
    SELECT c.ord, '', 0, '# HELP rl_redis_' || c.metric || '_total ' || c.help || E'\n'
           || '# TYPE rl_redis_' || c.metric || '_total counter'
      FROM counters c
    UNION ALL
    SELECT c.ord, r.labels, 0, 'rl_redis_' || c.metric || '_total' || r.labels || '} '
           || CASE c.metric WHEN 'calls' THEN r.calls WHEN 'allowed' THEN r.allowed
                            WHEN 'denied' THEN r.denied WHEN 'units_taken' THEN r.units_taken
                            WHEN 'units_refunded' THEN r.units_refunded WHEN 'errors' THEN r.errors
                            WHEN 'fallback_allow' THEN r.fallback_allow
                            WHEN 'fallback_deny' THEN r.fallback_deny
                            WHEN 'peeks' THEN r.peeks
                            WHEN 'shadow_denied' THEN r.shadow_denied ELSE r.outages END
      FROM counters c, rows r
    UNION ALL
    SELECT 10, '', 0, E'# HELP rl_redis_errors_by_kind_total Calls that got no decision, by kind of failure.\n'
           || '# TYPE rl_redis_errors_by_kind_total counter'
    UNION ALL
    SELECT 10, r.labels, k.i, 'rl_redis_errors_by_kind_total' || r.labels || ',kind="' || k.kind || '"} ' || k.n
      FROM rows r,
           LATERAL (VALUES (1, 'connection', r.errors_connection), (2, 'timeout', r.errors_timeout),
                           (3, 'reply', r.errors_reply), (4, 'protocol', r.errors_protocol)) k(i, kind, n)
    UNION ALL
    SELECT 11, '', 0, E'# HELP rl_redis_rtt_seconds Time of the calls Redis answered, from sending to the reply.\n'
           || '# TYPE rl_redis_rtt_seconds histogram'
    UNION ALL
    SELECT 11, r.labels, b.i, 'rl_redis_rtt_seconds_bucket' || r.labels || ',le="'
           || CASE WHEN b.bound = 'infinity' THEN '+Inf' ELSE (b.bound / 1000)::text END || '"} '
           || (SELECT sum(x) FROM unnest(r.rtt_buckets[1:b.i]) x)
      FROM rows r, unnest(@extschema@.rl_redis_rtt_bounds()) WITH ORDINALITY b(bound, i)
    UNION ALL
    SELECT 11, r.labels, 100, 'rl_redis_rtt_seconds_sum' || r.labels || '} ' || (r.rtt_sum_ms / 1000)
      FROM rows r
    UNION ALL
    SELECT 11, r.labels, 101, 'rl_redis_rtt_seconds_count' || r.labels || '} '
           || (SELECT coalesce(sum(x), 0) FROM unnest(r.rtt_buckets) x)
      FROM rows r
  )
  SELECT coalesce(string_agg(line, E'\n' ORDER BY ord, grp, sub), '') || E'\n'
    FROM lines;
END;

REVOKE ALL ON FUNCTION @extschema@.rl_redis_stats_rows() FROM PUBLIC;
REVOKE ALL ON FUNCTION @extschema@.rl_redis_metrics() FROM PUBLIC;
REVOKE ALL ON @extschema@.rl_redis_stats FROM PUBLIC;
GRANT EXECUTE ON FUNCTION @extschema@.rl_redis_stats_rows() TO pg_read_all_stats;
GRANT EXECUTE ON FUNCTION @extschema@.rl_redis_metrics() TO pg_read_all_stats;
GRANT SELECT ON @extschema@.rl_redis_stats TO pg_read_all_stats;

-- Shadow policies (issue 21, item 2): rl_policy.mode 'shadow' decides and
-- charges in Redis as 'enforce' does, but allows every call; what it would
-- have denied is counted in shadow_denied (rl_redis_stats,
-- rl_redis_shadow_denied_total) and, with rl_redis.track_denials, in
-- rl_top_denied (the statistics' column and metric are made above).
ALTER TABLE @extschema@.rl_policy
    ADD COLUMN mode text NOT NULL DEFAULT 'enforce'
    CONSTRAINT rl_policy_mode_known CHECK (mode IN ('enforce', 'shadow'));

-- rl_headers: Retry-After follows retry_after_ms > 0 also when the result
-- is allowed (a shadow policy's would-be denial), so that the headers say
-- what enforcing would say; a denial's 0 still gives Retry-After: 0.
CREATE OR REPLACE FUNCTION @extschema@.rl_headers(r @extschema@.rl_result, policy text DEFAULT NULL)
RETURNS json
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    item text;
    quota integer;
    window_s bigint;
    reset_s bigint;
    headers json[] := '{}';
BEGIN
    IF r IS NULL OR r.allowed IS NULL THEN
        RAISE EXCEPTION 'r must not be null' USING ERRCODE = '22004';
    END IF;
    IF policy ~ E'[^\\x20-\\x7E]' THEN
        RAISE EXCEPTION 'policy name must be printable ASCII'
            USING ERRCODE = '22023',
                  DETAIL = 'The RateLimit headers carry it as an RFC 8941 string: characters 0x20 to 0x7E only.';
    END IF;
    -- E'' strings: the same whatever standard_conforming_strings says
    item := '"' || replace(replace(coalesce(policy, 'default'), E'\\', E'\\\\'), '"', E'\\"') || '"';
    reset_s := ceil(r.reset_ms / 1000.0);
    IF policy IS NOT NULL THEN
        SELECT p.lim, ceil(p.window_ms / 1000.0) INTO quota, window_s
          FROM @extschema@.rl_policy p
         WHERE p.name = policy AND p.algorithm <> 'concurrency';
        IF FOUND THEN
            headers := headers || json_build_object('RateLimit-Policy',
                format('%s;q=%s;w=%s', item, quota, window_s));
        END IF;
    END IF;
    headers := headers
        || json_build_object('RateLimit', format('%s;r=%s;t=%s', item, r.remaining, reset_s))
        || json_build_object('X-RateLimit-Limit', r.lim::text)
        || json_build_object('X-RateLimit-Remaining', r.remaining::text)
        || json_build_object('X-RateLimit-Reset', reset_s::text);
    IF r.retry_after_ms > 0 OR (NOT r.allowed AND r.retry_after_ms = 0) THEN
        headers := headers || json_build_object('Retry-After',
            ceil(r.retry_after_ms / 1000.0)::bigint::text);
    END IF;
    RETURN array_to_json(headers);
END
$$;

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

COMMENT ON FUNCTION @extschema@.rl_inspect(text, text, integer) IS
    'Says what a call of cost would get now under a policy (slots held, for a concurrency policy), charging nothing and writing nothing in Redis; counted as a peek; for every role.';
COMMENT ON FUNCTION @extschema@.rl_concurrency_holders(text, text) IS
    'Lists the holders of a concurrency policy''s slots now, of one identity or (identity NULL) of every identity: identity, token, backend pid and lease end; for the roles granted EXECUTE.';
COMMENT ON FUNCTION @extschema@.rl_guard_check() IS
    'Lists every guard of the database with what is wrong with it (its kind, a missing policy or column, a malformed limit); no rows when all are fine; for every role.';
COMMENT ON FUNCTION @extschema@.rl_guard_created() IS
    'The event trigger rl_guard_created''s function: refuses at CREATE TRIGGER a guard that would fail at its first write; nobody calls it.';
COMMENT ON EVENT TRIGGER rl_guard_created IS
    'Refuses at CREATE TRIGGER a guard of the wrong kind, naming a missing policy or column, or with a malformed limit.';
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

-- closes this session's idle connections to Redis (as postgres_fdw_disconnect
-- does for its own): for a pooler's reset query; only the caller's session
CREATE FUNCTION @extschema@.rl_redis_disconnect()
RETURNS integer
AS 'MODULE_PATHNAME', 'rl_redis_disconnect'
LANGUAGE C VOLATILE PARALLEL RESTRICTED;
COMMENT ON FUNCTION @extschema@.rl_redis_disconnect() IS
    'Closes this session''s connections to Redis that carry no work and returns how many stay open; for every role.';
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
COMMENT ON CONSTRAINT rl_policy_mode_known ON @extschema@.rl_policy IS
    'A policy enforces (enforce, the default) or only counts what it would deny (shadow).';
COMMENT ON CONSTRAINT rl_policy_burst_only_for_buckets ON @extschema@.rl_policy IS
    'Only token_bucket and gcra policies take a burst; the others leave it NULL.';
COMMENT ON CONSTRAINT rl_policy_burst_refill_max ON @extschema@.rl_policy IS
    'The whole burst refills within 100 years: burst * window_ms <= lim * 3153600000000.';
