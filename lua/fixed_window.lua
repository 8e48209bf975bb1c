-- Fixed window counter.
-- State: a hash with w = start of the current window (ms), n = units used
-- in it and ts = the latest clock a call used (µs). Windows are numbered
-- floor(now / window_ms) on the clock; a call in a later window starts from
-- zero. The key expires at its window's end.
-- A rolled-back charge gives back its units while their window is current.
ALG.fixed = {}

-- The window of now: its number, start (ms) and ms left, and the units used
-- in it according to the key's state. now is never earlier than ts, so a
-- step back of the clock cannot reopen a window.
local function fixed_state(key, p, now)
  local state = redis.call('HMGET', key, 'w', 'n', 'ts')
  now = math.max(now, tonumber(state[3]) or 0)
  local idx = math.floor(now / (p.window_ms * 1000))
  local start = idx * p.window_ms
  local used = 0
  if tonumber(state[1]) == start then used = tonumber(state[2]) or 0 end
  return now, idx, start, math.ceil(start + p.window_ms - now / 1000), used
end

-- Writes n units for the window (or deletes the key when none are left).
local function fixed_save(key, start, left, n, now)
  if n > 0 then
    redis.call('HSET', key, 'w', num(start), 'n', n, 'ts', num(now))
    redis.call('PEXPIRE', key, left)
  else
    redis.call('DEL', key)
  end
end

ALG.fixed.decide = function(key, p, cost, now)
  local idx, start, left, used
  now, idx, start, left, used = fixed_state(key, p, now)
  local lim = p.lim

  local function result(allowed, n, retry)
    local reset = 0
    if n > 0 then reset = left end
    return {allowed, lim, math.max(lim - n, 0), reset, retry, now}
  end
  local function save(n)
    return function() fixed_save(key, start, left, n, now) end
  end

  if cost < 0 then
    local n = math.max(used + cost, 0)
    return result(1, n, 0), save(n)
  end
  if used + cost <= lim then
    local commit = nil
    if cost > 0 then commit = save(used + cost) end
    return result(1, used + cost, 0), commit
  end
  local retry = left
  if cost > lim then retry = -1 end
  return result(0, used, retry), nil
end

ALG.fixed.refund = function(key, p, now, r)
  local idx, start, left, used
  now, idx, start, left, used = fixed_state(key, p, now)
  if r.idx == idx and used > 0 then
    fixed_save(key, start, left, math.max(used - r.units, 0), now)
  end
end
