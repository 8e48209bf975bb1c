-- Rate limiting for a PostgREST API, with rl_redis.
--
-- PostgREST runs the function named by db-pre-request before every request,
-- in the request's transaction, with the JWT claims in the setting
-- request.jwt.claims. This one charges the caller's tier policy and sends
-- the RateLimit headers with every response (response.headers). A denial
-- rolls the transaction back, taking response.headers with it, so it is
-- raised as PostgREST's own SQLSTATE 'PGRST' error (PostgREST 11 and later),
-- whose JSON DETAIL carries the HTTP status, 429, and the headers, among
-- them Retry-After.
--
--   postgrest.conf:   db-pre-request = "api.check_rate_limit"
--
-- Policies (one per tier) are rows of rl_policy, for example:
--   INSERT INTO rl_policy (name, algorithm, lim, window_ms, burst) VALUES
--     ('api.anonymous',  'sliding',       30, 60000, NULL),
--     ('api.free',       'sliding',      100, 60000, NULL),
--     ('api.pro',        'token_bucket', 1000, 60000, 200);

CREATE SCHEMA IF NOT EXISTS api;

CREATE OR REPLACE FUNCTION api.check_rate_limit()
RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, public
AS $$
DECLARE
    claims  jsonb := nullif(current_setting('request.jwt.claims', true), '')::jsonb;
    subject text := claims ->> 'sub';
    policy  text := 'api.' || coalesce(claims ->> 'tier', 'free');
    r       rl_result;
BEGIN
    IF subject IS NULL THEN
        -- no token: one shared anonymous quota per client address
        subject := 'ip:' || coalesce(
            nullif(current_setting('request.headers', true), '')::jsonb ->> 'x-forwarded-for',
            'unknown');
        policy := 'api.anonymous';
    END IF;

    r := rl_check(policy, subject);
    PERFORM set_config('response.headers', rl_headers(r, policy)::text, true);

    IF NOT r.allowed THEN
        RAISE SQLSTATE 'PGRST'
            USING MESSAGE = jsonb_build_object(
                      'code', 'RL429',
                      'message', 'rate limit exceeded',
                      'details', format('%s allows %s requests; %s remaining.', policy, r.lim, r.remaining),
                      'hint', format('Retry after %s s.', ceil(r.retry_after_ms / 1000.0)))::text,
                  DETAIL = jsonb_build_object(
                      'status', 429,
                      'headers', (SELECT jsonb_object_agg(h.key, h.value)
                                    FROM json_array_elements(rl_headers(r, policy)) AS e,
                                         json_each_text(e) AS h))::text;
    END IF;
END
$$;
