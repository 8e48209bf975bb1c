-- Benchmark fixture (sql_tests/bench_redis.sh), not the extension's script:
-- the plain token bucket. KEYS[1] is a hash with t = tokens and ts = when
-- they were counted (ms); ARGV = lim, window_ms; the capacity is lim.
-- HMGET, refill and take one token, HSET, PEXPIRE until the bucket is full
-- again. Returns 1 (allowed) or 0.
local t = redis.call('TIME')
local now = t[1] * 1000 + t[2] / 1000
local lim, window = tonumber(ARGV[1]), tonumber(ARGV[2])
local rate = lim / window
local state = redis.call('HMGET', KEYS[1], 't', 'ts')
local tokens = lim
if state[1] then
  tokens = math.min(lim, tonumber(state[1]) + (now - tonumber(state[2])) * rate)
end
if tokens < 1 then return 0 end
tokens = tokens - 1
redis.call('HSET', KEYS[1], 't', tokens, 'ts', now)
redis.call('PEXPIRE', KEYS[1], math.ceil((lim - tokens) / rate))
return 1
