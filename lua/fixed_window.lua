-- Fixed window counter.
-- One hash per identity: w = start of the current window (ms on the clock
-- below), n = units used in it. A call in a later window starts from zero.
-- KEYS[1]  the identity's key
-- ARGV[1]  lim        units allowed per window
-- ARGV[2]  window_ms  window length
-- ARGV[3]  cost       units this call takes (0 = look only)
-- ARGV[4]  now_us     optional test clock in microseconds; else Redis TIME
-- Returns {allowed, lim, remaining, reset_ms, retry_after_ms}.
local key = KEYS[1]
local lim = tonumber(ARGV[1])
local window = tonumber(ARGV[2])
local cost = tonumber(ARGV[3])
local now
if ARGV[4] then
  now = tonumber(ARGV[4]) / 1000
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
end

local start = math.floor(now / window) * window
local left = math.ceil(start + window - now)   -- ms until this window ends
local used = 0
local state = redis.call('HMGET', key, 'w', 'n')
if tonumber(state[1]) == start then
  used = tonumber(state[2]) or 0
end

if used + cost <= lim then
  if cost > 0 then
    used = used + cost
    redis.call('HSET', key, 'w', string.format('%.0f', start), 'n', used)
    redis.call('PEXPIRE', key, left)
  end
  local reset = 0
  if used > 0 then reset = left end
  return {1, lim, lim - used, reset, 0}
end

local retry = left
if cost > lim then retry = -1 end
local reset = 0
if used > 0 then reset = left end
return {0, lim, math.max(lim - used, 0), reset, retry}
