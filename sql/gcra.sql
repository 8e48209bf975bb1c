-- GCRA (redis-cell's CL.THROTTLE semantics) on a frozen test clock:
-- lim 10 per 60 s is one unit every 6 s; up to burst (default lim) at once.
SET rl_redis.key_prefix = 'rltest:';
SELECT rl_reset('gc:a'), rl_reset('gc:b'), rl_reset('gc:c');
SET rl_redis.test_clock_ms = 1000000000000;

SELECT * FROM rl_gcra('gc:a', 10, 60000);
SELECT * FROM rl_gcra('gc:a', 10, 60000, 9);
-- the allowance is used up: the next unit in 6 s
SELECT * FROM rl_gcra('gc:a', 10, 60000);
SELECT * FROM rl_gcra('gc:a', 10, 60000, 2);
SET rl_redis.test_clock_ms = 1000000006000;
SELECT * FROM rl_gcra('gc:a', 10, 60000);
SELECT * FROM rl_gcra('gc:a', 10, 60000);
-- looking takes nothing
SELECT * FROM rl_gcra('gc:a', 10, 60000, 0);
-- more than the burst can never pass
SELECT * FROM rl_gcra('gc:a', 10, 60000, 11);

-- burst 3: at most 3 at once, then one every 6 s
SET rl_redis.test_clock_ms = 1000000000000;
SELECT * FROM rl_gcra('gc:b', 10, 60000, 3, 3);
SELECT * FROM rl_gcra('gc:b', 10, 60000, 1, 3);
SET rl_redis.test_clock_ms = 1000000012000;
SELECT rl_gcra_allow('gc:b', 10, 60000, 1, 3), rl_gcra_allow('gc:b', 10, 60000, 1, 3);

-- refund moves the arrival time back, never before now
SET rl_redis.test_clock_ms = 1000000000000;
SELECT * FROM rl_gcra('gc:c', 10, 60000, 10);
SELECT * FROM rl_gcra_refund('gc:c', 10, 60000, 4);
SELECT * FROM rl_gcra_refund('gc:c', 10, 60000, 1000);
SELECT * FROM rl_gcra('gc:c', 10, 60000, 10);

-- O(1) state: a hash whose field v packs the backlog (how far the
-- theoretical arrival time lies ahead of the clock) and the clock, both in
-- microseconds, as two little-endian doubles
SELECT current_setting('rl_redis.port') AS port \gset
\setenv RLPORT :port
\! redis-cli -p $RLPORT type 'rltest:gcra.2:{gc:c}:10/60000'
\! redis-cli -p $RLPORT hstrlen 'rltest:gcra.2:{gc:c}:10/60000' v
\! redis-cli -p $RLPORT eval "local b, ts = struct.unpack('<dd', redis.call('HGET', KEYS[1], 'v')) return {b, ts}" 1 'rltest:gcra.2:{gc:c}:10/60000'

SELECT rl_reset('gc:a'), rl_reset('gc:b'), rl_reset('gc:c');
RESET rl_redis.test_clock_ms;
