#!lua
-- Shared by every rl_redis script; the build puts it in front of the
-- algorithm files (src/embed_lua.sh). The "#!lua" line above (Redis 7
-- script flags, none given) makes Redis refuse a whole script while it is
-- out of memory, instead of letting its writes through once the first one,
-- which frees memory, has run.
--
-- Each algorithm file adds ALG.<name> = function(key, lim, window_ms, cost,
-- burst, now) that reads the key's state and returns
--   result  {allowed, lim, remaining, reset_ms, retry_after_ms}, the state
--           as it is once the call is applied
--   commit  a function that writes the new state, or nil when there is
--           nothing to write; the caller runs it only when it applies the call
-- cost < 0 gives -cost units back (a refund): its result is always allowed
-- and its commit always runs. burst is 0 when not given. now is the clock in
-- microseconds.
local ALG = {}

-- The clock in microseconds: the test clock when given, else Redis TIME.
local function clock_us(test_now)
  if test_now and test_now ~= '' then
    return tonumber(test_now)
  end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- Microseconds as whole milliseconds, rounded up; the slack keeps
-- floating-point noise (5750.000000000001) from adding a millisecond.
local function ms(us)
  return math.ceil(us / 1000 - 1e-6)
end

-- A number as Redis should store it: integral values without an exponent.
local function num(x)
  if x == math.floor(x) then
    return string.format('%.0f', x)
  end
  return string.format('%.17g', x)
end
