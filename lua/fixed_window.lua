-- Fixed window counter.
-- State: a hash with w = start of the current window (ms), n = units used
-- in it, ts = the latest clock a call used (µs) and e = the key's epoch (see
-- new_epoch). Windows are numbered floor(now / window_ms) on the clock; a
-- call in a later window starts from zero. The key expires at its window's
-- end.
-- A rolled-back charge gives back its units while their window is current
-- and the key is the one they were taken from.
ALG.fixed = {}

-- The window of now: its number, start (ms) and ms left, the units used in
-- it and the key's epoch according to the key's state. now is never
-- earlier than ts, so a step back of the clock cannot reopen a window.
local function fixed_state(key, p, now)
  local state = redis.call('HMGET', key, 'w', 'n', 'ts', 'e')
  now = math.max(now, tonumber(state[3]) or 0)
  local idx = math.floor(now / (p.window_ms * 1000))
  local start = idx * p.window_ms
  local used = 0
  if tonumber(state[1]) == start then used = tonumber(state[2]) or 0 end
  return now, idx, start, math.ceil(start + p.window_ms - now / 1000), used,
    tonumber(state[4])
end

-- Writes n units for the window (or deletes the key when none are left);
-- returns the key's epoch (a new one when the key is made).
local function fixed_save(key, p, start, left, n, now, real, epoch)
  if n > 0 then
    epoch = epoch or new_epoch()
    redis.call('HSET', key, 'w', num(start), 'n', n, 'ts', num(now), 'e', num(epoch),
               'l', limit_sig(p))
    expire(key, left, now, real)
  else
    redis.call('DEL', key)
  end
  return epoch
end

ALG.fixed.decide = function(key, p, cost, real)
  local now, idx, start, left, used, epoch = fixed_state(key, p, real)
  local lim = p.lim

  local function result(allowed, n, retry)
    local reset = 0
    if n > 0 then reset = left end
    return {allowed, lim, math.max(lim - n, 0), reset, retry, now, epoch or 0}
  end
  local function save(n, r)
    return function() r[7] = fixed_save(key, p, start, left, n, now, real, epoch) or 0 end
  end

  if cost < 0 then
    local n = math.max(used + cost, 0)
    local r = result(1, n, 0)
    return r, save(n, r)
  end
  if used + cost <= lim then
    local r = result(1, used + cost, 0)
    local commit = nil
    if cost > 0 then commit = save(used + cost, r) end
    return r, commit
  end
  local retry = left
  if cost > lim then retry = -1 end
  return result(0, used, retry), nil
end

ALG.fixed.refund = function(key, p, real, r)
  local now, idx, start, left, used, epoch = fixed_state(key, p, real)
  if r.idx == idx and used > 0 and epoch == r.epoch then
    fixed_save(key, p, start, left, math.max(used - r.units, 0), now, real, epoch)
  end
end
