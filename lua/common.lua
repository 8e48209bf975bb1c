#!lua
-- Shared by every rl_redis script; the build puts it in front of the
-- algorithm files (src/embed_lua.sh). The "#!lua" line above (Redis 7
-- script flags, none given) makes Redis refuse a whole script while it is
-- out of memory, instead of letting its writes through once the first one,
-- which frees memory, has run.
--
-- Each algorithm file adds ALG.<name> = {decide = ..., refund = ...}:
--   decide(key, p, cost, now, scopes) reads the key's state and returns
--     result  {allowed, lim, remaining, reset_ms, retry_after_ms, stamp},
--             the state as it is once the call is applied; stamp is the
--             clock the call was decided on (µs)
--     commit  a function that writes the new state, or nil when there is
--             nothing to write; the caller runs it only when it applies
--             the call
--   cost < 0 gives -cost units back at once (an administrator's refund);
--   its result is always allowed and its commit always runs.
--   refund(key, p, now, r) undoes what a rolled-back (sub)transaction took
--     and still counts; r = {idx, units, prev, scope, parents}.
-- p = {lim, window_ms, burst, cap}: burst is 0 when not given, cap is the
-- burst or lim. now is the clock in microseconds. scopes is the list of
-- refund scopes the charge belongs to, outermost first (empty: none).
--
-- The caller has checked every argument: lim > 0, 0 < window_ms <= 100
-- years, cap * window_ms / lim <= 100 years. Every time computed here is
-- then below 2^53 µs, so a double holds it exactly, and every expiry fits
-- PEXPIRE. Nothing below can fail after its first write.
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
-- floating-point noise (5750.000000000001) from adding a millisecond. Only
-- for figures that are not a promise (reset_ms); waits use first_ms.
local function ms(us)
  return math.ceil(us / 1000 - 1e-6)
end

-- The first whole millisecond r >= 1 from now at which fits(now + r * 1000)
-- is true, starting from the estimate us (µs). The check uses the same test
-- as the decision, so a wait is never one step too early.
local function first_ms(us, now, fits)
  local r = math.max(math.ceil(us / 1000), 1)
  if r > 1 and fits(now + (r - 1) * 1000) then r = r - 1 end
  for _ = 1, 8 do
    if fits(now + r * 1000) then return r end
    r = r + 1
  end
  return r
end

-- Makes the waits of a result count from the real clock real: a key whose
-- state is stamped later (the clock stepped back) was decided on its stamp,
-- and its waits end that much later on the clock.
local function from_clock(result, real)
  local behind = result[6] - real
  if behind > 0 then
    local extra = math.ceil(behind / 1000)
    if result[4] > 0 then result[4] = result[4] + extra end
    if result[5] > 0 then result[5] = result[5] + extra end
  end
  return result
end

-- A number as Redis should store it: integral values without an exponent.
local function num(x)
  if x == math.floor(x) then
    return string.format('%.0f', x)
  end
  return string.format('%.17g', x)
end

-- Splits "a,b,c" into {"a", "b", "c"}; "" gives {}.
local function split(s)
  local out = {}
  if s and s ~= '' then
    for part in string.gmatch(s, '[^,]+') do out[#out + 1] = part end
  end
  return out
end

-- Refund records of the token bucket and GCRA, in the key's hash: field
-- "s:<scope>" = "<owed>:<last_us>", what the charges of a refund scope
-- (a transaction or savepoint, with its committed savepoints) would give
-- back if it rolled back now; field "k" counts them. An owed amount never
-- exceeds the key's deficit: had the charges never happened the bucket
-- would have been full at any moment the deficit reached that amount, so
-- the refill since then would have been lost anyway.
local MAX_SCOPES = 32

-- Lowers every record of key to at most bound (the current deficit).
local function scopes_clamp(key, bound)
  local all = redis.call('HGETALL', key)
  local k = 0
  for i = 1, #all, 2 do
    local f = all[i]
    if string.sub(f, 1, 2) == 's:' then
      local owed, last = string.match(all[i + 1], '^([^:]+):(.+)$')
      owed = tonumber(owed)
      if owed > bound then
        if bound <= 0 then
          redis.call('HDEL', key, f)
        else
          redis.call('HSET', key, f, num(bound) .. ':' .. last)
          k = k + 1
        end
      else
        k = k + 1
      end
    end
  end
  redis.call('HSET', key, 'k', k)
end

-- Adds amount to the records of every scope in scopes (created as needed),
-- evicting the least recently charged record beyond MAX_SCOPES (its scope
-- then gives back nothing: never too much).
local function scopes_add(key, scopes, amount, now)
  local k = tonumber(redis.call('HGET', key, 'k')) or 0
  for _, s in ipairs(scopes) do
    local f = 's:' .. s
    local v = redis.call('HGET', key, f)
    local owed = 0
    if v then owed = tonumber(string.match(v, '^([^:]+):')) else k = k + 1 end
    redis.call('HSET', key, f, num(owed + amount) .. ':' .. num(now))
  end
  while k > MAX_SCOPES do
    local all = redis.call('HGETALL', key)
    local oldest, oldest_at = nil, nil
    for i = 1, #all, 2 do
      if string.sub(all[i], 1, 2) == 's:' then
        local at = tonumber(string.match(all[i + 1], ':(.+)$'))
        if oldest == nil or at < oldest_at then oldest, oldest_at = all[i], at end
      end
    end
    if oldest == nil then break end
    redis.call('HDEL', key, oldest)
    k = k - 1
  end
  redis.call('HSET', key, 'k', k)
end

-- Takes scope r.scope's record out of key and lowers its parents' records
-- by what it gives back; returns what it gives back (at most bound).
local function scopes_take(key, r, bound)
  local f = 's:' .. r.scope
  local v = redis.call('HGET', key, f)
  if not v then return 0 end
  local give = math.min(tonumber(string.match(v, '^([^:]+):')), bound)
  redis.call('HDEL', key, f)
  redis.call('HINCRBY', key, 'k', -1)
  for _, s in ipairs(r.parents) do
    local pf = 's:' .. s
    local pv = redis.call('HGET', key, pf)
    if pv then
      local owed, last = string.match(pv, '^([^:]+):(.+)$')
      redis.call('HSET', key, pf, num(math.max(tonumber(owed) - give, 0)) .. ':' .. last)
    end
  end
  return give
end
