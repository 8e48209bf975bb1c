-- Fixed window, on a frozen test clock so every figure is exact.
-- 1000000000000 ms lies 40000 ms into a 60000 ms window (windows start at
-- multiples of window_ms), so 20000 ms are left in it.
SET rl_redis.key_prefix = 'rltest:';
SELECT rl_reset('fx:a'), rl_reset('fx:b'), rl_reset('fx:c');
SET rl_redis.test_clock_ms = 1000000000000;

-- five allowed, the sixth denied until the window ends
SELECT * FROM rl_fixed('fx:a', 5, 60000);
SELECT * FROM rl_fixed('fx:a', 5, 60000);
SELECT * FROM rl_fixed('fx:a', 5, 60000);
SELECT * FROM rl_fixed('fx:a', 5, 60000);
SELECT * FROM rl_fixed('fx:a', 5, 60000);
SELECT * FROM rl_fixed('fx:a', 5, 60000);
-- cost 0 only looks: the denied call took nothing
SELECT * FROM rl_fixed('fx:a', 5, 60000, 0);
-- another identity has its own quota
SELECT * FROM rl_fixed('fx:b', 5, 60000);

-- 1 ms before the window ends: still denied, retry after 1 ms
SET rl_redis.test_clock_ms = 1000000019999;
SELECT * FROM rl_fixed('fx:a', 5, 60000);
-- the next window starts from zero: the boundary burst of a fixed window
SET rl_redis.test_clock_ms = 1000000020000;
SELECT * FROM rl_fixed('fx:a', 5, 60000, 5);
SELECT * FROM rl_fixed('fx:a', 5, 60000);

-- cost is all-or-nothing: 3 + 3 > 5 takes nothing, 3 + 2 fits
SET rl_redis.test_clock_ms = 1000000000000;
SELECT * FROM rl_fixed('fx:c', 5, 60000, 3);
SELECT * FROM rl_fixed('fx:c', 5, 60000, 3);
SELECT * FROM rl_fixed('fx:c', 5, 60000, 2);
-- cost 0 looks without taking
SELECT * FROM rl_fixed('fx:c', 5, 60000, 0);
-- cost above lim can never be allowed: retry_after_ms is -1
SELECT * FROM rl_fixed('fx:b', 5, 60000, 6);
SELECT * FROM rl_fixed('fx:b', 5, 60000, 0);

-- the boolean form agrees
SELECT rl_fixed_allow('fx:b', 5, 60000, 4), rl_fixed_allow('fx:b', 5, 60000);

-- a month-long window: 30 days
SELECT rl_reset('fx:month');
SELECT * FROM rl_fixed('fx:month', 2, 2592000000, 2);
SELECT * FROM rl_fixed('fx:month', 2, 2592000000);
SELECT rl_reset('fx:month');
RESET rl_redis.test_clock_ms;
