/* rl_redis--1.0--1.1.sql */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION rl_redis UPDATE TO '1.1'" to load this file. \quit

-- More algorithms, each with a decision, a boolean and a refund form.
-- burst: the most units at once (the bucket's capacity); NULL means lim.

CREATE FUNCTION @extschema@.rl_token_bucket(identity text, lim integer, window_ms bigint,
                                            cost integer DEFAULT 1, burst integer DEFAULT NULL)
RETURNS @extschema@.rl_result
AS 'MODULE_PATHNAME', 'rl_token_bucket'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION @extschema@.rl_token_bucket_allow(identity text, lim integer, window_ms bigint,
                                                  cost integer DEFAULT 1, burst integer DEFAULT NULL)
RETURNS boolean
AS 'MODULE_PATHNAME', 'rl_token_bucket_allow'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION @extschema@.rl_token_bucket_refund(identity text, lim integer, window_ms bigint,
                                                   amount integer DEFAULT 1, burst integer DEFAULT NULL)
RETURNS @extschema@.rl_result
AS 'MODULE_PATHNAME', 'rl_token_bucket_refund'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION @extschema@.rl_gcra(identity text, lim integer, window_ms bigint,
                                    cost integer DEFAULT 1, burst integer DEFAULT NULL)
RETURNS @extschema@.rl_result
AS 'MODULE_PATHNAME', 'rl_gcra'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION @extschema@.rl_gcra_allow(identity text, lim integer, window_ms bigint,
                                          cost integer DEFAULT 1, burst integer DEFAULT NULL)
RETURNS boolean
AS 'MODULE_PATHNAME', 'rl_gcra_allow'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION @extschema@.rl_gcra_refund(identity text, lim integer, window_ms bigint,
                                           amount integer DEFAULT 1, burst integer DEFAULT NULL)
RETURNS @extschema@.rl_result
AS 'MODULE_PATHNAME', 'rl_gcra_refund'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION @extschema@.rl_sliding_counter(identity text, lim integer, window_ms bigint,
                                               cost integer DEFAULT 1)
RETURNS @extschema@.rl_result
AS 'MODULE_PATHNAME', 'rl_sliding_counter'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION @extschema@.rl_sliding_counter_allow(identity text, lim integer, window_ms bigint,
                                                     cost integer DEFAULT 1)
RETURNS boolean
AS 'MODULE_PATHNAME', 'rl_sliding_counter_allow'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION @extschema@.rl_sliding_counter_refund(identity text, lim integer, window_ms bigint,
                                                      amount integer DEFAULT 1)
RETURNS @extschema@.rl_result
AS 'MODULE_PATHNAME', 'rl_sliding_counter_refund'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

-- Refunds for the 1.0 algorithms.
CREATE FUNCTION @extschema@.rl_fixed_refund(identity text, lim integer, window_ms bigint,
                                            amount integer DEFAULT 1)
RETURNS @extschema@.rl_result
AS 'MODULE_PATHNAME', 'rl_fixed_refund'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION @extschema@.rl_sliding_refund(identity text, lim integer, window_ms bigint,
                                              amount integer DEFAULT 1)
RETURNS @extschema@.rl_result
AS 'MODULE_PATHNAME', 'rl_sliding_refund'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

-- Concurrency limits: at most lim slots held at once. A slot is given back
-- when the transaction that took it ends, by rl_concurrency_release, or
-- when its lease ends (a backend that died).
CREATE FUNCTION @extschema@.rl_concurrency_acquire(identity text, lim integer, lease_ms bigint)
RETURNS @extschema@.rl_result
AS 'MODULE_PATHNAME', 'rl_concurrency_acquire'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION @extschema@.rl_concurrency_acquire_allow(identity text, lim integer, lease_ms bigint)
RETURNS boolean
AS 'MODULE_PATHNAME', 'rl_concurrency_acquire_allow'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION @extschema@.rl_concurrency_release(identity text)
RETURNS boolean
AS 'MODULE_PATHNAME', 'rl_concurrency_release'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

-- Named policies. Rows are read by every role (rl_check needs them);
-- writing them is for the table's owner and whom it grants.
CREATE TABLE @extschema@.rl_policy (
    name text PRIMARY KEY
        CHECK (name ~ '^[A-Za-z0-9_.:-]+$' AND octet_length(name) < 64),
    algorithm text NOT NULL
        CHECK (algorithm IN ('fixed', 'sliding', 'token_bucket', 'gcra', 'sliding_counter')),
    lim integer NOT NULL CHECK (lim > 0),
    window_ms bigint NOT NULL CHECK (window_ms > 0),
    burst integer CHECK (burst > 0),
    description text,
    CHECK (burst IS NULL OR algorithm IN ('token_bucket', 'gcra'))
);

SELECT pg_catalog.pg_extension_config_dump('@extschema@.rl_policy', '');
GRANT SELECT ON @extschema@.rl_policy TO PUBLIC;

-- Every change to rl_policy makes every session read it again.
CREATE FUNCTION @extschema@.rl_policy_changed()
RETURNS trigger
AS 'MODULE_PATHNAME', 'rl_policy_changed'
LANGUAGE C;

REVOKE ALL ON FUNCTION @extschema@.rl_policy_changed() FROM PUBLIC;

CREATE TRIGGER rl_policy_changed
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON @extschema@.rl_policy
    FOR EACH STATEMENT EXECUTE FUNCTION @extschema@.rl_policy_changed();

CREATE FUNCTION @extschema@.rl_check(policy text, identity text, cost integer DEFAULT 1)
RETURNS @extschema@.rl_result
AS 'MODULE_PATHNAME', 'rl_check'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION @extschema@.rl_allow(policy text, identity text, cost integer DEFAULT 1)
RETURNS boolean
AS 'MODULE_PATHNAME', 'rl_allow'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION @extschema@.rl_refund(policy text, identity text, amount integer DEFAULT 1)
RETURNS @extschema@.rl_result
AS 'MODULE_PATHNAME', 'rl_refund'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

-- Several policies at once, in one Redis call: the cost is taken from all of
-- them or from none; the result is the most restrictive policy's.
CREATE FUNCTION @extschema@.rl_check_all(policies text[], identity text, cost integer DEFAULT 1)
RETURNS @extschema@.rl_result
AS 'MODULE_PATHNAME', 'rl_check_all'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION @extschema@.rl_allow_all(policies text[], identity text, cost integer DEFAULT 1)
RETURNS boolean
AS 'MODULE_PATHNAME', 'rl_allow_all'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

-- HTTP response headers for a result, as the JSON array of one-field
-- objects that PostgREST's response.headers setting takes: the IETF
-- RateLimit and RateLimit-Policy fields (draft-ietf-httpapi-ratelimit-headers),
-- the X-RateLimit-Limit/-Remaining/-Reset trio (reset in seconds from now)
-- and, when denied, Retry-After (seconds, rounded up).
CREATE FUNCTION @extschema@.rl_headers(r @extschema@.rl_result, policy text DEFAULT NULL)
RETURNS json
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    item text := '"' || replace(replace(coalesce(policy, 'default'), '\', '\\'), '"', '\"') || '"';
    window_s bigint;
    reset_s bigint := ceil(r.reset_ms / 1000.0);
    headers json[] := '{}';
BEGIN
    IF r IS NULL OR r.allowed IS NULL THEN
        RAISE EXCEPTION 'r must not be null' USING ERRCODE = '22004';
    END IF;
    IF policy IS NOT NULL THEN
        SELECT ceil(p.window_ms / 1000.0) INTO window_s
          FROM @extschema@.rl_policy p WHERE p.name = policy;
        IF window_s IS NOT NULL THEN
            headers := headers || json_build_object('RateLimit-Policy',
                format('%s;q=%s;w=%s', item, r.lim, window_s));
        END IF;
    END IF;
    headers := headers
        || json_build_object('RateLimit', format('%s;r=%s;t=%s', item, r.remaining, reset_s))
        || json_build_object('X-RateLimit-Limit', r.lim::text)
        || json_build_object('X-RateLimit-Remaining', r.remaining::text)
        || json_build_object('X-RateLimit-Reset', reset_s::text);
    IF NOT r.allowed AND r.retry_after_ms >= 0 THEN
        headers := headers || json_build_object('Retry-After',
            ceil(r.retry_after_ms / 1000.0)::bigint::text);
    END IF;
    RETURN array_to_json(headers);
END
$$;
