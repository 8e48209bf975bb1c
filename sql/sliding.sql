-- Sliding window log, on a frozen test clock so every figure is exact.
SET rl_redis.key_prefix = 'rltest:';
SELECT rl_reset('sl:a'), rl_reset('sl:b'), rl_reset('sl:c'), rl_reset('sl:d');

-- 5 per 60 s: calls at t = 0, 10, 20, 30, 40 s are allowed
SET rl_redis.test_clock_ms = 1000000000000;
SELECT * FROM rl_sliding('sl:a', 5, 60000);
SET rl_redis.test_clock_ms = 1000000010000;
SELECT * FROM rl_sliding('sl:a', 5, 60000);
SET rl_redis.test_clock_ms = 1000000020000;
SELECT * FROM rl_sliding('sl:a', 5, 60000);
SET rl_redis.test_clock_ms = 1000000030000;
SELECT * FROM rl_sliding('sl:a', 5, 60000);
SET rl_redis.test_clock_ms = 1000000040000;
SELECT * FROM rl_sliding('sl:a', 5, 60000);
-- at 50 s the sixth is denied: the oldest (t = 0) leaves at 60 s
SET rl_redis.test_clock_ms = 1000000050000;
SELECT * FROM rl_sliding('sl:a', 5, 60000);
-- and a denied call is not recorded: at 59.999 s still denied, 1 ms to go
SET rl_redis.test_clock_ms = 1000000059999;
SELECT * FROM rl_sliding('sl:a', 5, 60000);
-- at exactly 60 s the first call has left the window
SET rl_redis.test_clock_ms = 1000000060000;
SELECT * FROM rl_sliding('sl:a', 5, 60000);
SELECT * FROM rl_sliding('sl:a', 5, 60000);
-- a cost of 2 needs the two oldest (t = 10 s and 20 s) gone: the second
-- leaves at 80 s
SELECT * FROM rl_sliding('sl:a', 5, 60000, 2);

-- no boundary burst: 5 at 59 s, then nothing more at 61 s
SET rl_redis.test_clock_ms = 1000000059000;
SELECT * FROM rl_sliding('sl:b', 5, 60000, 5);
SET rl_redis.test_clock_ms = 1000000061000;
SELECT * FROM rl_sliding('sl:b', 5, 60000);
SET rl_redis.test_clock_ms = 1000000119000;
SELECT * FROM rl_sliding('sl:b', 5, 60000, 5);

-- many units in one microsecond are all counted (members stay unique)
SET rl_redis.test_clock_ms = 1000000000000;
SELECT * FROM rl_sliding('sl:c', 100, 60000, 40);
SELECT * FROM rl_sliding('sl:c', 100, 60000, 60);
SELECT * FROM rl_sliding('sl:c', 100, 60000);
SELECT count(*) FILTER (WHERE rl_sliding_allow('sl:d', 10, 60000)) FROM generate_series(1, 25);
-- peek and impossible cost
SELECT * FROM rl_sliding('sl:c', 100, 60000, 0);
SELECT * FROM rl_sliding('sl:d', 10, 60000, 11);
RESET rl_redis.test_clock_ms;
