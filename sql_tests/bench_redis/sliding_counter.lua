-- Benchmark fixture (sql_tests/bench_redis.sh), not the extension's script:
-- the plain sliding-window counter. Two counters, KEYS[1]:<window number>
-- for the current window and the previous one, the previous weighted by
-- the part of it still inside the sliding window; ARGV = lim, window_ms.
-- MGET, then INCR and PEXPIRE (on the first call of the window) of the
-- current one. Returns 1 (allowed) or 0.
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local lim, window = tonumber(ARGV[1]), tonumber(ARGV[2])
local idx = math.floor(now / window)
local cur_key = KEYS[1] .. ':' .. string.format('%d', idx)
local prev_key = KEYS[1] .. ':' .. string.format('%d', idx - 1)
local counts = redis.call('MGET', cur_key, prev_key)
local cur = tonumber(counts[1]) or 0
local prev = tonumber(counts[2]) or 0
local weight = 1 - (now - idx * window) / window
if prev * weight + cur + 1 > lim then return 0 end
redis.call('INCR', cur_key)
if cur == 0 then
  redis.call('PEXPIRE', cur_key, 2 * window)
end
return 1
