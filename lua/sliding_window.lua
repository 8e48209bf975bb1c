-- Sliding window log.
-- One sorted set per identity holding a member per unit taken, scored by the
-- time it was taken (microseconds). A unit counts for window_ms after it was
-- taken, then drops out; denied calls record nothing.
-- KEYS[1]  the identity's key
-- ARGV[1]  lim        units allowed in any window of window_ms
-- ARGV[2]  window_ms  window length
-- ARGV[3]  cost       units this call takes (0 = look only)
-- ARGV[4]  now_us     optional test clock in microseconds; else Redis TIME
-- Returns {allowed, lim, remaining, reset_ms, retry_after_ms}.
local key = KEYS[1]
local lim = tonumber(ARGV[1])
local window_ms = tonumber(ARGV[2])
local cost = tonumber(ARGV[3])
local window = window_ms * 1000
local now
if ARGV[4] then
  now = tonumber(ARGV[4])
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- microseconds until the entry scored s leaves the window, as whole ms
local function ms_until_gone(s)
  return math.max(math.ceil((tonumber(s) + window - now) / 1000), 1)
end

redis.call('ZREMRANGEBYSCORE', key, '-inf', now - window)
local used = redis.call('ZCARD', key)

if used + cost <= lim then
  if cost > 0 then
    -- members must be unique even for many units in one microsecond
    local seq = used
    local stamp = string.format('%.0f', now)
    for _ = 1, cost do
      while redis.call('ZADD', key, 'NX', now, stamp .. '-' .. seq) == 0 do
        seq = seq + 1
      end
      seq = seq + 1
    end
    used = used + cost
    redis.call('PEXPIRE', key, window_ms)
    return {1, lim, lim - used, window_ms, 0}
  end
  local reset = 0
  if used > 0 then
    reset = ms_until_gone(redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')[2])
  end
  return {1, lim, lim - used, reset, 0}
end

local reset = 0
if used > 0 then
  reset = ms_until_gone(redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')[2])
end
local retry = -1
if cost <= lim then
  -- the call fits once the (used + cost - lim) oldest units have left
  local k = used + cost - lim - 1
  retry = ms_until_gone(redis.call('ZRANGE', key, k, k, 'WITHSCORES')[2])
end
return {0, lim, math.max(lim - used, 0), reset, retry}
