#!lua
-- Shared by every rl_redis script; the build puts it in front of the
-- algorithm files (src/embed_lua.sh). The "#!lua" line above (Redis 7
-- script flags, none given) makes Redis refuse a whole script while it is
-- out of memory, instead of letting its writes through once the first one,
-- which frees memory, has run.
--
-- Each algorithm file adds ALG.<name> = {decide = ..., refund = ...}:
--   decide(key, p, cost, now, scopes) reads the key's state and returns
--     result  {allowed, lim, remaining, reset_ms, retry_after_ms, stamp,
--             epoch}, the state as it is once the call is applied; stamp is
--             the clock the call was decided on (µs: now, or later when the
--             key's state is stamped later), epoch the key's (new_epoch;
--             0 for the algorithms that do not need one)
--     commit  a function that writes the new state, or nil when there is
--             nothing to write; the caller runs it only when it applies
--             the call
--   cost < 0 gives -cost units back at once (an administrator's refund);
--   its result is always allowed and its commit always runs.
--   refund(key, p, now, r) undoes what a rolled-back (sub)transaction took
--     and still counts; r = {idx, units, prev, epoch, first, scope,
--     parents} (see run_refund.lua).
-- p = {lim, window_ms, burst, cap}: burst is 0 when not given, cap is the
-- burst or lim. now is Redis's clock (or the test clock) in microseconds.
-- scopes is the list of refund scopes the charge belongs to, outermost
-- first (empty: none).
--
-- The caller has checked every argument: lim > 0, 0 < window_ms <= 100
-- years, cap * window_ms / lim <= 100 years. Every time computed here is
-- then below 2^53 µs, so a double holds it exactly, and every expiry fits
-- PEXPIRE. Nothing below can fail after its first write, and the expiry is
-- the last write of each key.
local ALG = {}

-- Whether this call runs on the test clock (rl_redis.test_clock_ms).
local on_test_clock = false

-- Real milliseconds that a key written on the test clock lives at least:
-- that clock stands still between a test's calls while Redis's expiry
-- runs on, so a state that counts for 1 ms of the test clock must outlive
-- the real time to the test's next call (see expire).
local TEST_CLOCK_MIN_TTL_MS = 1000

-- The clock in microseconds: the test clock when given, else Redis TIME.
local function clock_us(test_now)
  if test_now and test_now ~= '' then
    on_test_clock = true
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

-- The limit a hash state was last written under, "lim/window_ms/burst"
-- (field l; burst 0 for none or lim, as in the key): a refund of charges made under another limit gives nothing
-- back, as their units cannot be told apart any more. A policy's fixed
-- window or sliding counter keeps its key when its lim changes, and is
-- shared with another database's policy of the same name and window
-- whatever its lim: a call under another lim since gives nothing back too.
local function limit_sig(p)
  local burst = p.burst
  if burst == p.lim then burst = 0 end   -- the same capacity as none
  return p.lim .. '/' .. string.format('%.0f', p.window_ms) .. '/' .. burst
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

-- Sets key's expiry to ttl ms counted from now, the clock the call decided
-- on. Redis expires keys on its own clock, which is behind now by
-- now - real µs after a step back: the expiry is that much longer, so that
-- the state lives as long as it counts. On the test clock it is at least
-- TEST_CLOCK_MIN_TTL_MS.
local function expire(key, ttl, now, real)
  local least = on_test_clock and TEST_CLOCK_MIN_TTL_MS or 1
  redis.call('PEXPIRE', key, math.max(ttl + math.ceil((now - real) / 1000), least))
end

-- A number that tells one life of a key from the next (a key deleted by
-- FLUSHALL, eviction or rl_reset and made again): Redis's own clock in µs
-- when it was made, unique as no two scripts run in the same microsecond.
local function new_epoch()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- Refund records of the token bucket and GCRA, in the key's hash: field
-- "s:<scope>" = "<owed>:<last_us>", what the charges of a refund scope
-- would give back if it rolled back now. A transaction's scope id has no
-- '/'; a savepoint's is "<transaction's id>/<n>". Field "k" counts them.
-- The records of different transactions (their charges are disjoint) owe
-- at most the key's deficit together, and a savepoint's record at most its
-- transaction's: had all those charges never happened the bucket would
-- have been full whenever the deficit fell that low, so the refill since
-- then would have been lost anyway, whichever of them roll back, in any
-- order. A transaction that commits has its records forgotten
-- (run_forget.lua); at most MAX_SCOPES records are kept, the least recently
-- charged transaction's going first (its refund then gives back nothing:
-- never too much).
local MAX_SCOPES = 64

-- Reads the refund records of key: {scope = {owed, last_us, original}}.
local function records_read(key)
  local recs = {}
  local all = redis.call('HGETALL', key)
  for i = 1, #all, 2 do
    if string.sub(all[i], 1, 2) == 's:' then
      local owed, last = string.match(all[i + 1], '^([^:]+):(.+)$')
      recs[string.sub(all[i], 3)] = {tonumber(owed), tonumber(last), all[i + 1]}
    end
  end
  return recs
end

-- The transaction's scope id of a scope id.
local function top_of(scope)
  return string.match(scope, '^[^/]+')
end

-- Lowers the records to fit bound (the deficit) as said above.
local function records_lower(recs, bound)
  local tops, total = {}, 0
  for scope, r in pairs(recs) do
    if top_of(scope) == scope then
      tops[#tops + 1] = scope
      total = total + r[1]
    end
  end
  if total > bound then
    table.sort(tops, function(a, b) return recs[a][2] < recs[b][2] end)
    local excess = total - bound
    for _, scope in ipairs(tops) do
      if excess <= 0 then break end
      local cut = math.min(recs[scope][1], excess)
      recs[scope][1] = recs[scope][1] - cut
      excess = excess - cut
    end
  end
  for scope, r in pairs(recs) do
    local top = recs[top_of(scope)]
    r[1] = math.min(r[1], top and top[1] or 0)
  end
end

-- Writes the records that changed, drops those that owe nothing.
local function records_write(key, recs)
  local k = 0
  for scope, r in pairs(recs) do
    if r[1] <= 0 then
      if r[3] ~= '' then redis.call('HDEL', key, 's:' .. scope) end
    else
      local v = num(r[1]) .. ':' .. num(r[2])
      if v ~= r[3] then redis.call('HSET', key, 's:' .. scope, v) end
      k = k + 1
    end
  end
  redis.call('HSET', key, 'k', k)
end

-- Adds amount, charged at now, to the records of every scope in scopes
-- (made as needed). Beyond MAX_SCOPES records, drops first the records of
-- this transaction's savepoints that are no longer open (not in scopes:
-- released into an enclosing level, which owes their charges too), then
-- the least recently charged other transaction's; never the open scopes of
-- this charge.
local function records_add(recs, scopes, amount, now)
  local n = 0
  for _, r in pairs(recs) do
    if r[1] > 0 then n = n + 1 end
  end
  local mine = {}
  for _, scope in ipairs(scopes) do
    mine[scope] = true
    local r = recs[scope]
    if r and r[1] > 0 then
      r[1], r[2] = r[1] + amount, now
    else
      recs[scope] = {amount, now, r and r[3] or ''}
      n = n + 1
    end
  end
  if n <= MAX_SCOPES or #scopes == 0 then return end
  local top = top_of(scopes[1])
  for scope, r in pairs(recs) do
    if n <= MAX_SCOPES then return end
    if r[1] > 0 and not mine[scope] and top_of(scope) == top then
      r[1] = 0
      n = n - 1
    end
  end
  while n > MAX_SCOPES do
    local oldest = nil
    for scope, r in pairs(recs) do
      if top_of(scope) == scope and r[1] > 0 and not mine[scope] and
         (oldest == nil or r[2] < recs[oldest][2]) then
        oldest = scope
      end
    end
    if oldest == nil then return end
    for scope, r in pairs(recs) do
      if top_of(scope) == oldest and r[1] > 0 then
        r[1] = 0
        n = n - 1
      end
    end
  end
end

-- Takes the record of scope r.scope out (with its savepoints' records when
-- it is a transaction) and lowers its parents' by what it gives back;
-- returns that (at most bound).
local function records_take(recs, r, bound)
  local mine = recs[r.scope]
  if not mine then return 0 end
  local give = math.min(mine[1], bound)
  mine[1] = 0
  if top_of(r.scope) == r.scope then
    for scope, rec in pairs(recs) do
      if top_of(scope) == r.scope then rec[1] = 0 end
    end
  end
  for _, parent in ipairs(r.parents) do
    local p = recs[parent]
    if p then p[1] = math.max(p[1] - give, 0) end
  end
  return give
end
