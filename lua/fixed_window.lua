-- Fixed window counter.
-- State: a string of FIXED_BYTES bytes, struct FIXED_FORMAT: n = units used
-- in the window, w = the window's number, e = the key's epoch (see
-- new_epoch) and l = the lim it was last written under. Windows are
-- numbered floor(now / window_ms) on the clock; a call in a later window
-- starts from zero, and a call whose clock is in an earlier one (the clock
-- stepped back) is decided in window w: a step back cannot reopen a window.
-- The key expires at its window's end (on Redis's clock: later by the step
-- back). A rolled-back charge gives back its units while their window is
-- current, the key is the one they were taken from and its state was last
-- written under the charge's lim (a policy keeps its key when its lim
-- changes, and shares it with another database's policy of the same name
-- and window: their units cannot be told apart).
-- (Release 1.5 and before kept a hash under the kind "fixed"; keys of kind
-- "fixed.2" hold this layout only.)
ALG.fixed = {}

local FIXED_FORMAT = '<I4I7I7I4'
local FIXED_BYTES = 22

-- The window of now: its number and ms left, the units used in it, the
-- key's epoch and the lim its state was written under (nil, nil
-- without a key). now is never earlier than the start of window w.
local function fixed_state(key, p, now)
  local v = redis.call('GET', key)
  local wus = p.window_ms * 1000
  local used, epoch, lim = 0, nil, nil
  if v then
    if #v ~= FIXED_BYTES then wrong_kind() end
    local w
    used, w, epoch, lim = struct.unpack(FIXED_FORMAT, v)
    now = math.max(now, w * wus)
    if math.floor(now / wus) ~= w then used = 0 end
  end
  local idx = math.floor(now / wus)
  return now, idx, math.ceil((idx + 1) * p.window_ms - now / 1000), used,
    epoch, lim
end

-- Writes n units for window idx (or deletes the key when none are left),
-- with its expiry; returns the key's epoch (a new one when the key is made).
local function fixed_save(key, p, idx, left, n, now, real, epoch)
  if n > 0 then
    epoch = epoch or new_epoch()
    redis.call('SET', key, struct.pack(FIXED_FORMAT, n, idx, epoch, p.lim),
               'PX', ttl_ms(left, now, real))
  else
    redis.call('DEL', key)
  end
  return epoch
end

ALG.fixed.decide = function(key, p, cost, real)
  local now, idx, left, used, epoch = fixed_state(key, p, real)
  local lim = p.lim
  local n = used + cost

  if cost < 0 then
    n = math.max(n, 0)
  elseif n > lim then
    local retry = left
    if cost > lim then retry = -1 end
    local reset = 0
    if used > 0 then reset = left end
    return {0, lim, math.max(lim - used, 0), reset, retry, now, epoch or 0}, nil
  end
  local reset = 0
  if n > 0 then reset = left end
  local r = {1, lim, math.max(lim - n, 0), reset, 0, now, epoch or 0}
  if cost == 0 then return r, nil end
  return r, function()
    r[7] = fixed_save(key, p, idx, left, n, now, real, epoch) or 0
  end
end

ALG.fixed.refund = function(key, p, real, r)
  local now, idx, left, used, epoch, lim = fixed_state(key, p, real)
  if r.idx == idx and used > 0 and epoch == r.epoch and lim == p.lim then
    fixed_save(key, p, idx, left, math.max(used - r.units, 0), now, real, epoch)
  end
end
