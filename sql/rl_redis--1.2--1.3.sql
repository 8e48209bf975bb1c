/* rl_redis--1.2--1.3.sql */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION rl_redis UPDATE TO '1.3'" to load this file. \quit

-- Counters restart once at this upgrade: keys of explicit-argument calls now
-- carry their limit (<prefix><alg>:{<identity>}:<lim>/<window_ms>[/<burst>]),
-- and the state of every algorithm gained fields. Policy keys keep their
-- names (<prefix><alg>:{<identity>}:<policy>); an identity containing '%',
-- '{' or '}' is now percent-encoded inside the braces.

-- The trust model. Ordinary roles decide only through limits an
-- administrator defined: named policies (rl_check, rl_allow, rl_check_all,
-- rl_allow_all, rl_acquire) and the guards on tables they write. Everything
-- that invents a limit (the explicit-argument functions, slots with an
-- explicit lease, guard triggers, which take one) or gives quota back or
-- resets it is for the roles an administrator grants it to.
REVOKE ALL ON FUNCTION @extschema@.rl_fixed(text, integer, bigint, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION @extschema@.rl_fixed_allow(text, integer, bigint, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION @extschema@.rl_fixed_refund(text, integer, bigint, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION @extschema@.rl_sliding(text, integer, bigint, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION @extschema@.rl_sliding_allow(text, integer, bigint, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION @extschema@.rl_sliding_refund(text, integer, bigint, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION @extschema@.rl_sliding_counter(text, integer, bigint, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION @extschema@.rl_sliding_counter_allow(text, integer, bigint, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION @extschema@.rl_sliding_counter_refund(text, integer, bigint, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION @extschema@.rl_token_bucket(text, integer, bigint, integer, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION @extschema@.rl_token_bucket_allow(text, integer, bigint, integer, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION @extschema@.rl_token_bucket_refund(text, integer, bigint, integer, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION @extschema@.rl_gcra(text, integer, bigint, integer, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION @extschema@.rl_gcra_allow(text, integer, bigint, integer, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION @extschema@.rl_gcra_refund(text, integer, bigint, integer, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION @extschema@.rl_concurrency_acquire(text, integer, bigint) FROM PUBLIC;
REVOKE ALL ON FUNCTION @extschema@.rl_concurrency_acquire_allow(text, integer, bigint) FROM PUBLIC;
REVOKE ALL ON FUNCTION @extschema@.rl_refund(text, text, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION @extschema@.rl_guard() FROM PUBLIC;
REVOKE ALL ON FUNCTION @extschema@.rl_guard_statement() FROM PUBLIC;

-- Concurrency limits as policies: lim slots at once, each with a lease of
-- window_ms. The algorithm constraint gets a name, so that later upgrades can
-- replace it.
ALTER TABLE @extschema@.rl_policy
    DROP CONSTRAINT rl_policy_algorithm_check;
ALTER TABLE @extschema@.rl_policy
    ADD CONSTRAINT rl_policy_algorithm_known
    CHECK (algorithm IN ('fixed', 'sliding', 'token_bucket', 'gcra', 'sliding_counter',
                         'concurrency'));

-- A bucket or GCRA burst must refill within 100 years (burst * window_ms /
-- lim), which keeps every time the scripts compute exact in a double.
ALTER TABLE @extschema@.rl_policy
    ADD CONSTRAINT rl_policy_burst_refill_max
    CHECK (burst IS NULL OR burst::numeric * window_ms <= lim::numeric * 3153600000000);

-- rl_acquire(policy, identity): takes a slot of a concurrency policy, held
-- until the transaction ends, rl_release, or the lease ends.
CREATE FUNCTION @extschema@.rl_acquire(policy text, identity text)
RETURNS @extschema@.rl_result
AS 'MODULE_PATHNAME', 'rl_acquire'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION @extschema@.rl_acquire_allow(policy text, identity text)
RETURNS boolean
AS 'MODULE_PATHNAME', 'rl_acquire_allow'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

-- rl_release(policy, identity): gives back the slot this session took last
-- for the policy and identity; false when it holds none.
CREATE FUNCTION @extschema@.rl_release(policy text, identity text)
RETURNS boolean
AS 'MODULE_PATHNAME', 'rl_release'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

-- The row guard now fires AFTER the row is written (so that ON CONFLICT DO
-- NOTHING charges a skipped row nothing and an upsert charges once); a
-- BEFORE trigger raises 39P01 from now on. Say which triggers need
-- recreating.
DO $$
DECLARE
    t record;
BEGIN
    FOR t IN
        SELECT tg.tgname, tg.tgrelid::regclass AS rel
          FROM pg_catalog.pg_trigger tg
         WHERE tg.tgfoid = '@extschema@.rl_guard()'::pg_catalog.regprocedure
           AND (tg.tgtype::integer & 2) <> 0
    LOOP
        RAISE WARNING 'trigger "%" on % calls rl_guard BEFORE the row is written',
            t.tgname, t.rel
            USING HINT = 'Recreate it as AFTER INSERT OR UPDATE ... FOR EACH ROW; rl_guard refuses to fire BEFORE since 1.3.';
    END LOOP;
END
$$;

-- (rl_headers is replaced below)

-- rl_headers: RateLimit-Policy advertises the policy's rate (q = rl_policy.lim
-- units per w = window seconds), not the burst a token bucket or GCRA result
-- reports as its lim; the policy name goes out as an RFC 8941 sf-string, so a
-- name outside printable ASCII is refused and '"' and '\' are escaped.
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
    IF NOT r.allowed AND r.retry_after_ms >= 0 THEN
        headers := headers || json_build_object('Retry-After',
            ceil(r.retry_after_ms / 1000.0)::bigint::text);
    END IF;
    RETURN array_to_json(headers);
END
$$;
