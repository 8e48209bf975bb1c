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
