-- Sliding window counter (two-window approximation).
-- State: a string of COUNTER_BYTES bytes, struct COUNTER_FORMAT: c = units
-- used in window w, p = units used in the window before, ts = the latest
-- clock a call used (µs), e = the key's epoch (see new_epoch) and l = the lim
-- it was last written under. Windows are numbered floor(now / window_ms) on
-- the clock; w, the number of the window the state was written in, is that
-- of ts (every write is stamped with the clock it decided on), so the state
-- leaves it out. The estimate of the
-- last window_ms is p weighted by how much of the previous window still
-- overlaps it, plus c. O(1) memory; exact when the previous window's units
-- were spread evenly. The key expires when both windows have passed.
-- A rolled-back charge gives back its units from the count of the window it
-- was taken in, while that window is the current or the previous one, the
-- key is the one they were taken from and its state was last written under
-- the charge's lim (see fixed_window.lua).
-- (Release 1.5 and before kept a hash under the kind "sliding_counter";
-- keys of kind "sliding_counter.2" hold this layout only.)

local COUNTER_FORMAT = '<I4I4I7I7I4'
local COUNTER_BYTES = 26

-- Reads the key as of now (never earlier than ts): the window's number and
-- start (ms), the current and previous counts, the key's epoch and the lim
-- its state was written under (nil, nil without a key).
local function counter_state(key, p, now)
  local v = call('GET', key)
  local W = p.window_ms
  local c, prev, epoch, lim = 0, 0, nil, nil
  if v then
    if #v ~= COUNTER_BYTES then wrong_kind() end
    local sc, sp, ts
    sc, sp, ts, epoch, lim = sunpack(COUNTER_FORMAT, v)
    checked(epoch)
    now = max(now, checked(ts))
    local w = floor(ts / (W * 1000))
    local idx = floor(now / (W * 1000))
    if w == idx then
      c, prev = sc, sp
    elseif w == idx - 1 then
      prev = sc
    end
  end
  local idx = floor(now / (W * 1000))
  return now, idx, idx * W, c, prev, epoch, lim
end

-- Writes the counts of the window that starts at start (ms) and holds now
-- (or deletes the key when both are zero), with its expiry, and puts the
-- key's epoch (a new one when the key is made) in the decision's result r
-- (nil for a refund).
local function counter_save(key, p, start, c, prev, now, real, epoch, r)
  if c > 0 or prev > 0 then
    epoch = epoch or new_epoch()
    call('SET', key, spack(COUNTER_FORMAT, c, prev, now, epoch, p.lim),
               'PX', ttl_ms(ceil(start + 2 * p.window_ms - now / 1000), now, real))
  else
    call('DEL', key)
  end
  if r then r[7] = epoch or 0 end
end

-- The estimate of the units in the window_ms before t (µs): the window
-- that starts at start (ms) holds cur units, the one before it prev, spread
-- evenly over it.
local function counter_estimate(t, start, W, prev, cur)
  local into = t / 1000 - start
  if into < W then return prev * (W - into) / W + cur end
  if into < 2 * W then return cur * (2 * W - into) / W end
  return 0
end

-- Decides a call on a sliding-window counter (see decide in common.lua).
local function sliding_counter_decide(key, p, cost, real)
  local now, _, start, c, prev, epoch = counter_state(key, p, real)
  local lim, W = p.lim, p.window_ms
  local left = start + W - now / 1000     -- ms until the current window ends

  -- allowed, the units in the window once decided and the wait
  local allowed, cur, retry = 1, max(c + cost, 0), 0
  if cost >= 0 and counter_estimate(now, start, W, prev, c) + cost > lim + 1e-9 then
    allowed, cur, retry = 0, c, -1
    if cost <= lim then
      local us
      if c + cost <= lim and prev > 0 then
        -- until the previous window's weight has shrunk enough
        us = (left - (lim - c - cost) * W / prev) * 1000
      elseif c > 0 then
        -- into the next window, where c becomes the previous count
        us = (left + max(W - (lim - cost) * W / c, 0)) * 1000
      else
        us = left * 1000
      end
      retry = first_ms(us, now, function(t)
        return counter_estimate(t, start, W, prev, c) + cost <= lim + 1e-9
      end)
    end
  end
  local reset = 0
  if cur > 0 then reset = ceil(left + W) elseif prev > 0 then reset = ceil(left) end
  local r = {allowed, lim,
             max(floor(lim - counter_estimate(now, start, W, prev, cur) + 1e-9), 0),
             reset, retry, now, epoch or 0}
  if allowed == 0 or cost == 0 then return r, nil end
  return r, counter_save, key, p, start, cur, prev, now, real, epoch, r
end

-- Gives back a rolled-back charge on a sliding-window counter (see refund in common.lua).
local function sliding_counter_refund(key, p, real, r)
  local now, idx, start, c, prev, epoch, lim = counter_state(key, p, real)
  if epoch == nil or epoch ~= r.epoch or lim ~= p.lim then return end
  if r.idx == idx then
    c = max(c - r.units, 0)
    prev = max(prev - r.prev, 0)
  elseif r.idx == idx - 1 then
    prev = max(prev - r.units, 0)
  else
    return
  end
  counter_save(key, p, start, c, prev, now, real, epoch)
end

ALG.sliding_counter = {decide = sliding_counter_decide, refund = sliding_counter_refund}
