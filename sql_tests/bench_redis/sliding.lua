-- Benchmark fixture (sql_tests/bench_redis.sh), not the extension's script:
-- the plain sliding log. KEYS[1] is a sorted set with one member per
-- allowed call, scored by its time (µs); ARGV = lim, window_ms.
-- ZREMRANGEBYSCORE of the calls out of the window, ZCARD, ZADD, PEXPIRE.
-- Returns 1 (allowed) or 0.
local t = redis.call('TIME')
local now = t[1] * 1000000 + t[2]
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[2]) * 1000)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], now, now)
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
