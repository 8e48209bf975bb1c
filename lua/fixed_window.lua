-- Fixed window counter.
-- State: a packed string (Lua struct, little-endian unsigned integers) in
-- one of two forms, told apart by its length:
--   2k + 7 bytes (9, 11, 13, 15)    n, l (k bytes each), e (7 bytes)
--   2k + 15 bytes (17, 19, 21, 23)  n, l, e, w (8 bytes), the test-clock form
-- n = units used in the window, l = the lim it was last written under (for
-- refunds), in the fewest bytes k (1 to 4) that hold both (n can exceed l
-- after a change of lim and an administrator's refund); e = the key's epoch
-- (see new_epoch), made anew for each window; w = the window's number.
-- Windows are numbered floor(now / window_ms) on the clock. The epoch is
-- Redis's clock when the window's state was made, so on that clock it lies
-- in the window itself (a clock step back keeps the epoch, see below) and
-- the window's number is floor(e / (window_ms * 1000)); on the test clock
-- (rl_redis.test_clock_ms) it may not be, and the state holds the number
-- too. A state is written in the short form exactly when it is written on
-- Redis's clock (every one written on the test clock takes the long form)
-- and its epoch gives its window's number. A call in a later window starts
-- from zero, and a call whose clock is in an earlier one (the clock stepped
-- back) is decided in window w: a step back cannot reopen a window. The key
-- expires FIXED_SLACK_MS after its window's end (on Redis's clock: later
-- by the step back), the same moment for every write of the window on
-- Redis's clock: the write that makes a window's state sets it, and a later
-- write on Redis's clock over a short-form state of the same window keeps
-- it (SET ... KEEPTTL, about 10 k instructions fewer than SET ... PX in
-- Redis 7.0); on the test clock (whose states live 10 s of real time at
-- least) or over a long-form state, a write sets it anew. So a short-form
-- state that another writer left with an earlier expiry, or none, keeps it
-- until a call of a later window writes the key anew; among them a state
-- that a development build of 1.6 before this one wrote on the test clock
-- in the short form. A rolled-back
-- charge gives back its units while their window is current, the key's
-- epoch is the one they were taken under and its state was last written
-- under the charge's lim (a policy keeps its key when its lim changes, and
-- shares it with another database's policy of the same name and window:
-- their units cannot be told apart).
-- Every other length is refused (WRONGTYPE), among them 22: the layout of
-- 1.6's development builds before this one (n, w, e, l in 4, 7, 7, 4
-- bytes), whose w would be misread as an epoch.
-- (Release 1.5 and before kept a hash under the kind "fixed"; keys of kind
-- "fixed.2" hold this layout only.)

-- How long a key outlives its window (ms), as its later writes keep the
-- expiry its first one set: Redis may count that expiry from a moment a
-- little before this call's TIME (7.2 and later: the command's start), and
-- a Cluster slot moved to a node whose clock is behind takes a key's time
-- to live with it (MIGRATE), so that it would end early on that clock.
local FIXED_SLACK_MS = 1000

-- The struct formats of a state whose counts take k = 1 to 4 bytes, the
-- k-th of each list: short form, and the test-clock form (I8 appended).
local FIXED_FORMATS = {'<I1I1I7', '<I2I2I7', '<I3I3I7', '<I4I4I7'}
local FIXED_FORMATS_W = {'<I1I1I7I8', '<I2I2I7I8', '<I3I3I7I8', '<I4I4I7I8'}

-- The window of now: its number and ms left, the units used in it, the
-- key's epoch and the lim its state was written under (nil, nil when
-- there is no key or its state is of an earlier window), and whether the
-- key's expiry is its window's end already (a short-form state of this
-- window: written on Redis's clock). now is never earlier than the start
-- of the state's window.
local function fixed_state(key, p, now)
  local v = call('GET', key)
  local wus = p.window_ms * 1000
  local used, epoch, lim, timed = 0, nil, nil, false
  if v then
    local short = #v <= 15
    local k = short and (#v - 7) / 2 or (#v - 15) / 2
    if k < 1 or k > 4 or k % 1 ~= 0 then wrong_kind() end
    local w
    if short then
      used, lim, epoch = sunpack(FIXED_FORMATS[k], v)
      w = floor(checked(epoch) / wus)
    else
      used, lim, epoch, w = sunpack(FIXED_FORMATS_W[k], v)
      checked(epoch)
    end
    now = max(now, checked(w * wus))
    if floor(now / wus) ~= w then
      used, epoch, lim = 0, nil, nil
    else
      timed = short
    end
  end
  local idx = now / wus
  idx = idx - idx % 1   -- floor (idx >= 0), without a call
  return now, idx, ceil((idx + 1) * p.window_ms - now / 1000), used,
    epoch, lim, timed
end

-- Writes n units for window idx (or deletes the key when none are left),
-- with its expiry (kept when timed, see fixed_state, and the call is on
-- Redis's clock), and puts the key's epoch (a new one when the window's
-- state is made) in the decision's result r (nil for a refund).
local function fixed_save(key, p, idx, left, n, now, real, epoch, timed, r)
  if n > 0 then
    epoch = epoch or new_epoch()
    local high = n > p.lim and n or p.lim
    local k = 4
    if high < 256 then k = 1 elseif high < 65536 then k = 2
    elseif high < 16777216 then k = 3 end
    local w = epoch / (p.window_ms * 1000)
    if on_test_clock or w - w % 1 ~= idx then
      call('SET', key, spack(FIXED_FORMATS_W[k], n, p.lim, epoch, idx), 'PX',
        ttl_ms(left, now, real))
    elseif timed then
      call('SET', key, spack(FIXED_FORMATS[k], n, p.lim, epoch), 'KEEPTTL')
    else
      call('SET', key, spack(FIXED_FORMATS[k], n, p.lim, epoch), 'PX',
        ttl_ms(left, now, real) + FIXED_SLACK_MS)
    end
  else
    call('DEL', key)
  end
  if r then r[7] = epoch or 0 end
end

-- Decides a call on a fixed window (see decide in common.lua).
local function fixed_decide(key, p, cost, real)
  local now, idx, left, used, epoch, _, timed = fixed_state(key, p, real)
  local lim = p.lim
  local n = used + cost

  if cost < 0 then
    n = max(n, 0)
  elseif n > lim then
    local retry = left
    if cost > lim then retry = -1 end
    local reset = 0
    if used > 0 then reset = left end
    return {0, lim, max(lim - used, 0), reset, retry, now, epoch or 0}, nil
  end
  local reset = 0
  if n > 0 then reset = left end
  local r = {1, lim, n < lim and lim - n or 0, reset, 0, now, epoch or 0}
  if cost == 0 then return r, nil end
  return r, fixed_save, key, p, idx, left, n, now, real, epoch, timed, r
end

-- Gives back a rolled-back charge on a fixed window (see refund in common.lua).
local function fixed_refund(key, p, real, r)
  local now, idx, left, used, epoch, lim, timed = fixed_state(key, p, real)
  if r.idx == idx and used > 0 and epoch == r.epoch and lim == p.lim then
    fixed_save(key, p, idx, left, max(used - r.units, 0), now, real, epoch,
      timed)
  end
end

ALG.fixed = {decide = fixed_decide, refund = fixed_refund}
