-- Sliding window counter (two-window approximation).
-- State: a hash with w = start of the current window (ms), c = units used in
-- it, p = units used in the window before, ts = the latest clock a call used
-- (µs) and e = the key's epoch (see new_epoch). The estimate of the last
-- window_ms is p weighted by how much of the previous window still overlaps
-- it, plus c. O(1) memory; exact when the previous window's units were
-- spread evenly. The key expires when both windows have passed.
-- A rolled-back charge gives back its units from the count of the window it
-- was taken in, while that window is the current or the previous one and
-- the key is the one they were taken from.
ALG.sliding_counter = {}

-- Reads the key as of now (never earlier than ts): the window's number and
-- start (ms), the current and previous counts and the key's epoch.
local function counter_state(key, p, now)
  local state = redis.call('HMGET', key, 'w', 'c', 'p', 'ts', 'e')
  now = math.max(now, tonumber(state[4]) or 0)
  local W = p.window_ms
  local idx = math.floor(now / (W * 1000))
  local start = idx * W
  local c, prev = 0, 0
  local w = tonumber(state[1])
  if w == start then
    c, prev = tonumber(state[2]) or 0, tonumber(state[3]) or 0
  elseif w == start - W then
    prev = tonumber(state[2]) or 0
  end
  return now, idx, start, c, prev, tonumber(state[5])
end

-- Writes the counts (or deletes the key when both are zero); returns the
-- key's epoch (a new one when the key is made).
local function counter_save(key, p, start, c, prev, now, real, epoch)
  if c > 0 or prev > 0 then
    epoch = epoch or new_epoch()
    redis.call('HSET', key, 'w', num(start), 'c', c, 'p', prev, 'ts', num(now),
               'e', num(epoch), 'l', limit_sig(p))
    expire(key, math.ceil(start + 2 * p.window_ms - now / 1000), now, real)
  else
    redis.call('DEL', key)
  end
  return epoch
end

ALG.sliding_counter.decide = function(key, p, cost, real)
  local now, idx, start, c, prev, epoch = counter_state(key, p, real)
  local lim, W = p.lim, p.window_ms
  local left = start + W - now / 1000     -- ms until the current window ends

  -- the estimate at time t (µs, not before now) with cur units in this window
  local function estimate_at(t, cur)
    local into = t / 1000 - start
    if into < W then return prev * (W - into) / W + cur end
    if into < 2 * W then return cur * (2 * W - into) / W end
    return 0
  end
  local function fits_at(t, units)
    return estimate_at(t, c) + units <= lim + 1e-9
  end
  local function reset_of(cur)
    if cur > 0 then return math.ceil(left + W) end
    if prev > 0 then return math.ceil(left) end
    return 0
  end
  local function result(allowed, cur, retry)
    return {allowed, lim, math.max(math.floor(lim - estimate_at(now, cur) + 1e-9), 0),
            reset_of(cur), retry, now, epoch or 0}
  end
  local function save(cur, r)
    return function()
      r[7] = counter_save(key, p, start, cur, prev, now, real, epoch) or 0
    end
  end

  if cost < 0 then
    local cur = math.max(c + cost, 0)
    local r = result(1, cur, 0)
    return r, save(cur, r)
  end
  if fits_at(now, cost) then
    local r = result(1, c + cost, 0)
    local commit = nil
    if cost > 0 then commit = save(c + cost, r) end
    return r, commit
  end
  local retry = -1
  if cost <= lim then
    local us
    if c + cost <= lim and prev > 0 then
      -- until the previous window's weight has shrunk enough
      us = (left - (lim - c - cost) * W / prev) * 1000
    elseif c > 0 then
      -- into the next window, where c becomes the previous count
      us = (left + math.max(W - (lim - cost) * W / c, 0)) * 1000
    else
      us = left * 1000
    end
    retry = first_ms(us, now, function(t) return fits_at(t, cost) end)
  end
  return result(0, c, retry), nil
end

ALG.sliding_counter.refund = function(key, p, real, r)
  local now, idx, start, c, prev, epoch = counter_state(key, p, real)
  if epoch == nil or epoch ~= r.epoch then return end
  if r.idx == idx then
    c = math.max(c - r.units, 0)
    prev = math.max(prev - r.prev, 0)
  elseif r.idx == idx - 1 then
    prev = math.max(prev - r.units, 0)
  else
    return
  end
  counter_save(key, p, start, c, prev, now, real, epoch)
end
