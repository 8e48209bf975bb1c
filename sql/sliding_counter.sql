-- Sliding-window counter on a frozen test clock. The estimate of the last
-- 60 s is the previous window's count weighted by its overlap plus the
-- current window's count. 1000000020000 is the start of a window.
SET rl_redis.key_prefix = 'rltest:';
SELECT rl_reset('sc:a'), rl_reset('sc:b');
SET rl_redis.test_clock_ms = 1000000020000;
SELECT * FROM rl_sliding_counter('sc:a', 10, 60000, 10);
SELECT * FROM rl_sliding_counter('sc:a', 10, 60000);
-- next window, 15 s in: the previous 10 weigh 0.75, so 7.5 are estimated
-- in the last 60 s; 2 more fit, 3 do not
SET rl_redis.test_clock_ms = 1000000095000;
SELECT * FROM rl_sliding_counter('sc:a', 10, 60000, 0);
SELECT * FROM rl_sliding_counter('sc:a', 10, 60000, 3);
SELECT * FROM rl_sliding_counter('sc:a', 10, 60000, 2);
SELECT * FROM rl_sliding_counter('sc:a', 10, 60000);
-- two windows later everything has slid out
SET rl_redis.test_clock_ms = 1000000200000;
SELECT * FROM rl_sliding_counter('sc:a', 10, 60000, 0);
-- the boundary burst of a fixed window is damped: 10 at the end of one
-- window, and nothing just after the boundary
SET rl_redis.test_clock_ms = 1000000079000;
SELECT rl_sliding_counter_allow('sc:b', 10, 60000, 10);
SET rl_redis.test_clock_ms = 1000000081000;
SELECT count(*) FILTER (WHERE rl_sliding_counter_allow('sc:b', 10, 60000))
  FROM generate_series(1, 10);
-- refund gives back from the current window only
SELECT * FROM rl_sliding_counter_refund('sc:b', 10, 60000, 5);
SELECT * FROM rl_sliding_counter('sc:b', 10, 60000, 11);
SELECT rl_reset('sc:a'), rl_reset('sc:b');
RESET rl_redis.test_clock_ms;
