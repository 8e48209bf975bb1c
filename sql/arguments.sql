-- Argument checking: 22023 for values out of range, 22004 for NULLs, the
-- message naming the argument.
SELECT rl_sliding_allow('', 5, 60000);
SELECT rl_sliding_allow('u', 0, 60000);
SELECT rl_sliding_allow('u', -1, 60000);
SELECT rl_sliding_allow('u', 5, 0);
SELECT rl_sliding_allow('u', 5, -60000);
SELECT rl_sliding_allow('u', 5, 60000, -1);
SELECT rl_fixed_allow('', 5, 60000);
SELECT rl_fixed_allow('u', 0, 60000);
SELECT rl_fixed_allow('u', 5, 0);
SELECT rl_fixed_allow('u', 5, 60000, -1);
SELECT * FROM rl_fixed('u', 5, 60000, -2);
SELECT * FROM rl_sliding('u', 5, 0);
SELECT rl_sliding_allow(NULL, 5, 60000);
SELECT rl_sliding_allow('u', NULL, 60000);
SELECT rl_sliding_allow('u', 5, NULL);
SELECT rl_sliding_allow('u', 5, 60000, NULL);
SELECT rl_fixed_allow(NULL, 5, 60000);
SELECT * FROM rl_fixed('u', 5, NULL);
SELECT rl_reset(NULL);
SELECT rl_reset('');
-- out of the argument types' range
SELECT rl_sliding_allow('u', 3000000000, 60000);
\set VERBOSITY default
-- the messages name the argument
SELECT rl_sliding_allow('', 5, 60000);
SELECT rl_sliding_allow('u', 0, 60000);
SELECT rl_sliding_allow('u', 5, 0);
SELECT rl_sliding_allow('u', 5, 60000, -1);
SELECT rl_sliding_allow('u', 5, NULL);
-- a NULL decision would let "IF NOT rl_sliding_allow(...)" through: the
-- functions are not strict and raise instead
SELECT count(*) AS functions, count(*) FILTER (WHERE proisstrict) AS strict
  FROM pg_proc WHERE proname LIKE 'rl\_%';
-- window_ms is bigint: a 30-day window is expressible, an int still resolves
SELECT pg_get_function_identity_arguments('rl_sliding_allow'::regproc);
SELECT rl_sliding_allow('args:month', 5, 2592000000);
SELECT rl_sliding_allow('args:int', 5, 60000::int);
SELECT rl_reset('args:month');
SELECT rl_reset('args:int');
-- at most 100 years, so that times in the scripts stay exact
SELECT rl_sliding_allow('u', 5, 3153600000001);
SELECT rl_fixed_allow('u', 5, 9200000000000000000);
SELECT rl_concurrency_acquire_allow('u', 5, 3153600000001);
-- the sliding log keeps one entry per unit: its lim is capped
SELECT rl_sliding_allow('u', 100001, 60000);
SELECT rl_sliding_counter_allow('args:big', 100001, 60000);
SELECT rl_reset('args:big');
\set VERBOSITY sqlstate
INSERT INTO rl_policy (name, algorithm, lim, window_ms) VALUES ('too.big', 'sliding', 100001, 60000);
INSERT INTO rl_policy (name, algorithm, lim, window_ms) VALUES ('too.long', 'fixed', 1, 3153600000001);
\set VERBOSITY default
-- The window (or a lease) as an interval, or as a text holding one; a text
-- of digits alone is milliseconds: the same limit, so the same count (on
-- the test clock at a window's start, so that no minute ends in between)
SET rl_redis.test_clock_ms = 1000000020000;
SELECT allowed, lim, remaining FROM rl_fixed('iv', 5, '1 minute');
SELECT allowed, lim, remaining FROM rl_fixed('iv', 5, interval '60 seconds');
SELECT allowed, lim, remaining FROM rl_fixed('iv', 5, 60000);
SELECT allowed, lim, remaining FROM rl_fixed('iv', 5, ' 60000 ');
SELECT rl_fixed_allow('iv', 5, '00:01:00'), rl_fixed_allow('iv', 5, '1 minute');
SELECT allowed, remaining FROM rl_token_bucket('iv', 10, '1 hour', 3, 4);
SELECT allowed, remaining FROM rl_token_bucket_refund('iv', 10, interval '3600 s', 2, 4);
SELECT identity, allowed, remaining FROM rl_sliding_many(ARRAY['iv1', 'iv2'], 2, '2 days');
SELECT rl_concurrency_acquire_allow('iv', 1, '30 seconds'), rl_concurrency_acquire_allow('iv', 1, interval '30 s');
RESET rl_redis.test_clock_ms;
-- refused: months and years (their length varies), fractions of a
-- millisecond, what is not an interval, and what is out of range
SELECT rl_fixed_allow('iv', 5, '1 month');
SELECT rl_gcra_allow('iv', 5, interval '1 year');
SELECT rl_fixed_allow('iv', 5, interval '1.5 ms');
SELECT rl_sliding_allow('iv', 5, 'soon');
SELECT rl_fixed_allow('iv', 5, '-1 minute');
SELECT rl_fixed_allow('iv', 5, interval '36525 days 1 ms');
SELECT rl_fixed_allow('iv', 5, NULL::interval);
SELECT rl_concurrency_acquire('iv', 1, interval '0');
-- every overload is its bigint form with another type of window: the same
-- C function, attributes, result and privileges (administrators only)
SELECT o.proname, pg_catalog.format_type(o.proargtypes[2], NULL) AS window_type,
       o.prosrc = b.prosrc AND o.provolatile = b.provolatile AND o.proparallel = b.proparallel
       AND o.proisstrict = b.proisstrict AND o.prorows = b.prorows AND o.prorettype = b.prorettype
       AND o.proretset = b.proretset AND o.proargnames[4:] IS NOT DISTINCT FROM b.proargnames[4:]
       AND o.pronargdefaults = b.pronargdefaults
       AND NOT has_function_privilege('public', o.oid, 'EXECUTE') AS same
  FROM pg_catalog.pg_proc o
  JOIN pg_catalog.pg_proc b ON b.proname = o.proname AND b.pronamespace = o.pronamespace
                           AND b.pronargs = o.pronargs AND b.proargtypes[2] = 'bigint'::regtype
 WHERE o.pronamespace = 'public'::regnamespace AND o.proargtypes[2] <> 'bigint'::regtype
 ORDER BY 1, 2;
