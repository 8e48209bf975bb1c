-- Token bucket on a frozen test clock: lim 10 per 60 s refills one token
-- every 6 s; the bucket holds lim tokens, or burst when given.
SET rl_redis.key_prefix = 'rltest:';
SELECT rl_reset('tb:a'), rl_reset('tb:b'), rl_reset('tb:c');
SET rl_redis.test_clock_ms = 1000000000000;

-- a full bucket: 10 at once, then empty; one token takes 6 s to come back
SELECT * FROM rl_token_bucket('tb:a', 10, 60000, 4);
SELECT * FROM rl_token_bucket('tb:a', 10, 60000, 6);
SELECT * FROM rl_token_bucket('tb:a', 10, 60000);
-- a cost of 3 waits for 3 tokens: 18 s
SELECT * FROM rl_token_bucket('tb:a', 10, 60000, 3);
-- 5.999 s later, still not one token
SET rl_redis.test_clock_ms = 1000000005999;
SELECT * FROM rl_token_bucket('tb:a', 10, 60000);
SET rl_redis.test_clock_ms = 1000000006000;
SELECT * FROM rl_token_bucket('tb:a', 10, 60000);
SELECT * FROM rl_token_bucket('tb:a', 10, 60000, 0);
-- refilled in full after 60 s, never above the capacity
SET rl_redis.test_clock_ms = 1000000300000;
SELECT * FROM rl_token_bucket('tb:a', 10, 60000, 0);
SELECT * FROM rl_token_bucket('tb:a', 10, 60000, 11);

-- burst 20: up to 20 at once, the same rate
SET rl_redis.test_clock_ms = 1000000000000;
SELECT * FROM rl_token_bucket('tb:b', 10, 60000, 20, 20);
SELECT * FROM rl_token_bucket('tb:b', 10, 60000, 1, 20);
SET rl_redis.test_clock_ms = 1000000012000;
SELECT rl_token_bucket_allow('tb:b', 10, 60000, 2, 20), rl_token_bucket_allow('tb:b', 10, 60000, 1, 20);

-- refund gives tokens back, never above the capacity
SET rl_redis.test_clock_ms = 1000000000000;
SELECT * FROM rl_token_bucket('tb:c', 10, 60000, 7);
SELECT * FROM rl_token_bucket_refund('tb:c', 10, 60000, 2);
SELECT * FROM rl_token_bucket_refund('tb:c', 10, 60000, 1000);
SELECT * FROM rl_token_bucket('tb:c', 10, 60000, 0);

-- argument errors
\set VERBOSITY sqlstate
SELECT rl_token_bucket_allow('tb:c', 10, 60000, 1, 0);
SELECT rl_token_bucket_allow('tb:c', 0, 60000);
SELECT rl_token_bucket_allow('tb:c', 10, 60000, -1);
SELECT rl_token_bucket_refund('tb:c', 10, 60000, -1);
SELECT rl_token_bucket_refund('tb:c', 10, 60000, NULL);
\set VERBOSITY default
SELECT rl_token_bucket_allow('tb:c', 10, 60000, 1, -5);
SELECT rl_token_bucket_refund('tb:c', 10, 60000, -1);
SELECT rl_reset('tb:a'), rl_reset('tb:b'), rl_reset('tb:c');
RESET rl_redis.test_clock_ms;
