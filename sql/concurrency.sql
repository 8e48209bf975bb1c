-- Concurrency slots in one session; slots of a transaction are given back
-- when it ends. (Several sessions, and a backend that dies: sql_tests/.)
SET rl_redis.key_prefix = 'rltest:';
SET rl_redis.test_clock_ms = 1000000000000;
SELECT rl_reset('cc:a');
SELECT current_setting('rl_redis.port') AS port \gset
\setenv RLPORT :port

BEGIN;
SELECT * FROM rl_concurrency_acquire('cc:a', 2, 30000);
SELECT * FROM rl_concurrency_acquire('cc:a', 2, 30000);
-- full: the first lease ends in 30 s
SELECT * FROM rl_concurrency_acquire('cc:a', 2, 30000);
\! redis-cli -p $RLPORT zcard 'rltest:concurrency:{cc:a}:2/30000'
-- give one back early
SELECT rl_concurrency_release('cc:a');
SELECT rl_concurrency_acquire_allow('cc:a', 2, 30000);
COMMIT;
-- the commit gave both back
\! redis-cli -p $RLPORT zcard 'rltest:concurrency:{cc:a}:2/30000'
SELECT rl_concurrency_release('cc:a');

-- an aborted transaction gives its slots back too
BEGIN;
SELECT rl_concurrency_acquire_allow('cc:a', 2, 30000);
SELECT 1 / 0;
ROLLBACK;
\! redis-cli -p $RLPORT zcard 'rltest:concurrency:{cc:a}:2/30000'

-- so does a rolled-back savepoint, at once
BEGIN;
SAVEPOINT s;
SELECT rl_concurrency_acquire_allow('cc:a', 2, 30000);
\! redis-cli -p $RLPORT zcard 'rltest:concurrency:{cc:a}:2/30000'
ROLLBACK TO s;
\! redis-cli -p $RLPORT zcard 'rltest:concurrency:{cc:a}:2/30000'
-- a released one hands its slot to the transaction
SAVEPOINT t;
SELECT rl_concurrency_acquire_allow('cc:a', 2, 30000);
RELEASE t;
\! redis-cli -p $RLPORT zcard 'rltest:concurrency:{cc:a}:2/30000'
COMMIT;
\! redis-cli -p $RLPORT zcard 'rltest:concurrency:{cc:a}:2/30000'

-- a lease that ends frees the slot even if its holder never gives it back
BEGIN;
SELECT rl_concurrency_acquire_allow('cc:a', 2, 30000);
SET LOCAL rl_redis.test_clock_ms = 1000000029999;
SELECT * FROM rl_concurrency_acquire('cc:a', 2, 30000);
SELECT * FROM rl_concurrency_acquire('cc:a', 2, 30000);
SET LOCAL rl_redis.test_clock_ms = 1000000030000;
SELECT * FROM rl_concurrency_acquire('cc:a', 2, 30000);
COMMIT;

\set VERBOSITY sqlstate
SELECT rl_concurrency_acquire('cc:a', 0, 30000);
SELECT rl_concurrency_acquire('cc:a', 1, 0);
SELECT rl_concurrency_acquire('cc:a', 1, NULL);
SELECT rl_concurrency_acquire('', 1, 1000);
SELECT rl_concurrency_release(NULL);
\set VERBOSITY default
SELECT rl_concurrency_acquire('cc:a', 1, 0);
SELECT rl_concurrency_acquire('cc:a', 1, 3600001);
SET rl_redis.max_lease = '2h';
SELECT rl_concurrency_acquire_allow('cc:a', 1, 3600001);
RESET rl_redis.max_lease;
SELECT rl_reset('cc:a');
RESET rl_redis.test_clock_ms;
