-- Benchmark fixture (sql_tests/bench_redis.sh), not the extension's script:
-- the plain GCRA, as redis_rate does it. KEYS[1] holds the theoretical
-- arrival time (ms); ARGV = lim, window_ms; the burst is lim. GET, then
-- SET PX until the TAT. Returns 1 (allowed) or 0.
local t = redis.call('TIME')
local now = t[1] * 1000 + t[2] / 1000
local lim, window = tonumber(ARGV[1]), tonumber(ARGV[2])
local interval = window / lim
local tat = math.max(tonumber(redis.call('GET', KEYS[1])) or now, now)
local new_tat = tat + interval
if new_tat - interval * lim > now then return 0 end
redis.call('SET', KEYS[1], new_tat, 'PX', math.ceil(new_tat - now))
return 1
