-- Concurrency limit: at most lim slots held at once.
-- State: a sorted set with one member per held slot (a token unique to the
-- holder), scored by when its lease ends (µs). Slots are given back with
-- ZREM by their holder; a holder that never does (a crashed backend) loses
-- its slot when the lease ends. The key expires with its last lease.
-- KEYS[1]  the identity's key
-- ARGV     lim, lease_ms, token, now_us ('' for Redis TIME)
-- Returns {allowed, lim, remaining, reset_ms, retry_after_ms, now_us, 0};
-- reset_ms is the time until the last lease ends, retry_after_ms the time
-- until the first one does.
local key = KEYS[1]
local lim = tonumber(ARGV[1])
local lease_ms = tonumber(ARGV[2])
local now = clock_us(ARGV[4])
redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
local held = redis.call('ZCARD', key)

-- ms until the lease at rank r (0 = first to end, -1 = last) ends
local function lease_left(r)
  local s = redis.call('ZRANGE', key, r, r, 'WITHSCORES')[2]
  return math.max(ms(tonumber(s) - now), 1)
end

if held < lim then
  redis.call('ZADD', key, now + lease_ms * 1000, ARGV[3])
  local last = lease_left(-1)
  redis.call('PEXPIRE', key, last)
  return {1, lim, lim - held - 1, last, 0, now, 0}
end
return {0, lim, 0, lease_left(-1), lease_left(0), now, 0}
