#!lua
-- Shared by every rl_redis script; the build puts it in front of the
-- algorithm files (src/embed_lua.sh). The "#!lua" line above (Redis 7
-- script flags, none given) makes Redis refuse a whole script while it is
-- out of memory, instead of letting its writes through once the first one,
-- which frees memory, has run. (The library of Redis functions made of
-- these files has a first line of its own, with its name, and its
-- functions no flags either: src/embed_lua.sh.)
--
-- Each algorithm file adds ALG.<name> = {decide = ..., refund = ...}:
--   decide(key, p, cost, now, scopes) reads the key's state and returns
--     result  {allowed, lim, remaining, reset_ms, retry_after_ms, stamp,
--             epoch}, the state as it is once the call is applied; stamp is
--             the clock the call was decided on (µs: now, or later when the
--             key's state is stamped later), epoch the key's (new_epoch;
--             0 for the algorithms that do not need one)
--     write, ...  for a call it allows that changes the state, the function
--             that writes the new state and its arguments (none else, and
--             decide itself writes nothing that counts: only a sliding log
--             drops the units that have left its window, and not when the
--             writes are deferred or in a dry run): the main part applies the call
--             with write(...), at once (see applied; never in a dry run)
--             or, for several limits, once all have allowed (run_all.lua);
--             a write fills in result's epoch
--   cost < 0 gives -cost units back at once (an administrator's refund);
--   it is always allowed and applied.
--   refund(key, p, now, r) undoes what a rolled-back (sub)transaction took
--     and still counts; r = {idx, units, prev, epoch, first, scope,
--     parents} (see run_refund.lua).
-- p = {lim, window_ms, cap, window_text} (see limit): cap is the burst, or
-- lim when none is given. now is Redis's clock (or the test clock) in
-- microseconds.
-- scopes names the refund scopes the charge belongs to as the call gives
-- them, "a,b", outermost first ('' for none; see split in records.lua).
--
-- The caller has checked every argument: lim > 0, 0 < window_ms <= 100
-- years, cap * window_ms / lim <= 100 years. Every time computed here is
-- then below 2^53 µs, so a double holds it exactly, and every expiry fits
-- PEXPIRE. Nothing below can fail after its first write, and the expiry is
-- the last write of each key. Numbers go to redis.call as Lua numbers:
-- Redis writes an integral one below 2^53 as an integer and any other with
-- the digits that read back exactly (%.17g; 7.2 and later, the shortest
-- such form), so only numbers joined into a string need formatting here.
-- Every time, level, backlog and refund record read from a state goes
-- through checked before it is used (counts are bounded by their fields'
-- widths and only compared), so a state rl_redis could not have written
-- changes nothing.
-- A number in a string is read with "+ 0" (Lua's coercion), which parses
-- it once (tonumber parses it twice); tonumber stays where the string may
-- be missing or be no number (a state's fields: checked refuses the nil).
local ALG = {}

-- Whether this call runs on the test clock (rl_redis.test_clock_ms).
local on_test_clock = false

-- Whether this call is a dry run (rl_inspect), set by the main part: it is
-- decided as usual, and nothing is written (the main part runs no write,
-- and what a decide would change on its way, it leaves).
local dry_run = false

-- Whether the writes of this call wait until every limit of it is decided
-- (run_all.lua, set by it): a limit's decide must then not write on its
-- way either, so that a later limit's refused state leaves every key as
-- it was.
local deferred = false

-- Real milliseconds that a key written on the test clock lives at least:
-- that clock stands still between a test's calls while Redis's expiry
-- runs on, so a state that counts for 1 ms of the test clock must outlive
-- the real time to the test's next call (see ttl_ms), also on a loaded
-- machine (1 000 ms was once too short there: a fixed window written 1 001
-- ms of test clock before its end was gone at the next call).
local TEST_CLOCK_MIN_TTL_MS = 10000

-- Redis's own clock in microseconds as this call read it (nil until then).
local redis_now = nil

-- The functions of Lua and Redis that calls use most, as locals: a local
-- costs a call less than a global's lookup (a table access, two for
-- math.max). new_call binds them, as the code of a library may reach no
-- global while Redis loads it.
local call, floor, ceil, max, min, sub, spack, sunpack

-- Makes the four values above those of a new call, and binds the locals
-- above. The main part of every script and every function of the library
-- calls it first (src/embed_lua.sh): Redis runs all of a library's
-- functions in one Lua state that outlives a call.
local function new_call()
  on_test_clock, dry_run, deferred, redis_now = false, false, false, nil
  if not call then
    call, floor, ceil, max, min, sub, spack, sunpack = redis.call, math.floor,
      math.ceil, math.max, math.min, string.sub, struct.pack, struct.unpack
  end
end

-- Redis's own clock in microseconds (TIME, the one read of it in a call):
-- the clock of the decisions off the test clock, and the epoch of the keys
-- the call makes, a number that tells one life of a key from the next (a
-- key deleted by FLUSHALL, eviction or rl_reset and made again), unique as
-- no two scripts run in the same microsecond and no script makes a key
-- twice.
local function new_epoch()
  if not redis_now then
    local t = call('TIME')
    redis_now = t[1] * 1000000 + t[2]
  end
  return redis_now
end

-- The clock in microseconds: the test clock when given, else Redis TIME
-- (read as new_epoch does, without its call: the first read of a call).
local function clock_us(test_now)
  if test_now and test_now ~= '' then
    on_test_clock = true
    return test_now + 0
  end
  local t = call('TIME')
  redis_now = t[1] * 1000000 + t[2]
  return redis_now
end

-- Microseconds as whole milliseconds, rounded up; the slack keeps
-- floating-point noise (5750.000000000001) from adding a millisecond. Only
-- for figures that are not a promise (reset_ms); waits use first_ms.
local function ms(us)
  return ceil(us / 1000 - 1e-6)
end

-- The first whole millisecond r >= 1 from now at which fits(now + r * 1000)
-- is true, starting from the estimate us (µs). The check uses the same test
-- as the decision, so a wait is never one step too early.
local function first_ms(us, now, fits)
  local r = max(ceil(us / 1000), 1)
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
    local extra = ceil(behind / 1000)
    if result[4] > 0 then result[4] = result[4] + extra end
    if result[5] > 0 then result[5] = result[5] + extra end
  end
  return result
end

-- The expiry, in ms from Redis's clock, of a state that counts for ttl ms
-- from now, the clock the call decided on. Redis expires keys on its own
-- clock, which is behind now by now - real µs after a step back: the
-- expiry is that much longer, so that the state lives as long as it
-- counts. On the test clock it is at least TEST_CLOCK_MIN_TTL_MS.
local function ttl_ms(ttl, now, real)
  if now ~= real then ttl = ttl + ceil((now - real) / 1000) end
  local least = on_test_clock and TEST_CLOCK_MIN_TTL_MS or 1
  if ttl < least then return least end
  return ttl
end

-- Raises the error Redis gives for a key of another type: key holds a
-- string that is not a state of the layout the caller reads.
local function wrong_kind()
  error({err = 'WRONGTYPE Operation against a key holding the wrong kind of value'})
end

-- The most a time, level or backlog in a state can be: 2^53 µs (the year
-- 2255), up to which a double holds every integer. The arguments' checks
-- keep every number rl_redis writes far below it.
local MAX_US = 9007199254740992

-- x, a number read from a key's state, when it lies in 0 .. 2^53, as every
-- one that rl_redis writes does; anything else (beyond, negative, NaN, or
-- nil for text that is no number) was not written by rl_redis, and is
-- refused as of another type before the call writes anything: taken as a
-- clock far ahead, it would lock the identity out or make an expiry Redis
-- refuses halfway through the call's writes.
local function checked(x)
  if not (x and x >= 0 and x <= MAX_US) then wrong_kind() end
  return x
end

-- The one limit of a call of one key (run_one.lua), filled anew by each:
-- a table costs a call more than the three numbers it holds.
local ONE = {lim = 0, window_ms = 0, cap = 0, window_text = ''}

-- The limit of a call's arguments (as ARGV gives them; burst "0": none):
-- lim, window_ms and the capacity cap, the burst or lim, in table p (ONE)
-- or, without one, in a new table; window_text is window_ms as the caller
-- wrote it, for an expiry of exactly one window: Redis takes text as it
-- is, where it formats a number first (%.17g). Every caller writes it as
-- plain digits of a checked window (pg_lltoa, src/engine.c and
-- src/refund.c), which PEXPIRE takes as it would the number.
local function limit(lim, window_ms, burst, p)
  p = p or {}
  lim = lim + 0
  local cap = burst + 0
  if cap == 0 then cap = lim end
  p.lim, p.window_ms, p.cap, p.window_text = lim, window_ms + 0, cap, window_ms
  return p
end

-- The seven numbers of a decision's result as one string, little-endian
-- signed 8-byte integers (src/decision.c reads them): Redis turns it into
-- its reply at a fraction of the cost of a table of numbers.
local function packed(r)
  return spack('<i8i8i8i8i8i8i8', r[1], r[2], r[3], r[4], r[5], r[6], r[7])
end

-- The result of a decision (decide's returns), applied at once: its write
-- is run with the arguments that follow it (not in a dry run).
local function applied(result, write, ...)
  if write and not dry_run then write(...) end
  return result
end
