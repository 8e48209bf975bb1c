/* rl_redis--1.5--1.6.sql */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION rl_redis UPDATE TO '1.6'" to load this file. \quit

-- Shadow policies (issue 21, item 2): rl_policy.mode 'shadow' decides and
-- charges in Redis as 'enforce' does, but allows every call; what it would
-- have denied is counted in shadow_denied (rl_redis_stats,
-- rl_redis_shadow_denied_total) and, with rl_redis.track_denials, in
-- rl_top_denied.
ALTER TABLE @extschema@.rl_policy
    ADD COLUMN mode text NOT NULL DEFAULT 'enforce'
    CONSTRAINT rl_policy_mode_known CHECK (mode IN ('enforce', 'shadow'));

-- the statistics' new last column: the function, its view and the metrics
-- that read the view are made again
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
    OUT shadow_denied bigint)
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
       s.shadow_denied
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
           ('shadow_denied', 'Calls a shadow policy would have denied (it allowed them).', 10)
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
                            WHEN 'shadow_denied' THEN r.shadow_denied ELSE r.outages END
      FROM counters c, rows r
    UNION ALL
    SELECT 11, '', 0, E'# HELP rl_redis_errors_by_kind_total Calls that got no decision, by kind of failure.\n'
           || '# TYPE rl_redis_errors_by_kind_total counter'
    UNION ALL
    SELECT 11, r.labels, k.i, 'rl_redis_errors_by_kind_total' || r.labels || ',kind="' || k.kind || '"} ' || k.n
      FROM rows r,
           LATERAL (VALUES (1, 'connection', r.errors_connection), (2, 'timeout', r.errors_timeout),
                           (3, 'reply', r.errors_reply), (4, 'protocol', r.errors_protocol)) k(i, kind, n)
    UNION ALL
    SELECT 12, '', 0, E'# HELP rl_redis_rtt_seconds Time of the calls Redis answered, from sending to the reply.\n'
           || '# TYPE rl_redis_rtt_seconds histogram'
    UNION ALL
    SELECT 12, r.labels, b.i, 'rl_redis_rtt_seconds_bucket' || r.labels || ',le="'
           || CASE WHEN b.bound = 'infinity' THEN '+Inf' ELSE (b.bound / 1000)::text END || '"} '
           || (SELECT sum(x) FROM unnest(r.rtt_buckets[1:b.i]) x)
      FROM rows r, unnest(@extschema@.rl_redis_rtt_bounds()) WITH ORDINALITY b(bound, i)
    UNION ALL
    SELECT 12, r.labels, 100, 'rl_redis_rtt_seconds_sum' || r.labels || '} ' || (r.rtt_sum_ms / 1000)
      FROM rows r
    UNION ALL
    SELECT 12, r.labels, 101, 'rl_redis_rtt_seconds_count' || r.labels || '} '
           || (r.allowed + r.denied)
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
