-- Refunds for the 1.0 algorithms: units come back, never above lim.
SET rl_redis.key_prefix = 'rltest:';
SELECT rl_reset('rf:a');
SET rl_redis.test_clock_ms = 1000000000000;
SELECT * FROM rl_fixed('rf:a', 5, 60000, 5);
SELECT * FROM rl_fixed_refund('rf:a', 5, 60000, 2);
SELECT * FROM rl_fixed('rf:a', 5, 60000, 2);
SELECT * FROM rl_fixed_refund('rf:a', 5, 60000, 100);
SELECT * FROM rl_fixed('rf:a', 5, 60000, 0);
-- the sliding log gives back its newest units
SELECT * FROM rl_sliding('rf:a', 5, 60000, 3);
SET rl_redis.test_clock_ms = 1000000010000;
SELECT * FROM rl_sliding('rf:a', 5, 60000, 2);
SELECT * FROM rl_sliding_refund('rf:a', 5, 60000, 2);
SELECT * FROM rl_sliding_refund('rf:a', 5, 60000, 100);
SELECT * FROM rl_sliding('rf:a', 5, 60000, 0);
-- a refund on an identity with no state changes nothing
SELECT * FROM rl_fixed_refund('rf:none', 5, 60000);
SELECT rl_reset('rf:a'), rl_reset('rf:none');
RESET rl_redis.test_clock_ms;
