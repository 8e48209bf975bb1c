-- Sliding window log.
-- State: a sorted set with one member per unit taken, scored by the time it
-- was taken (µs). A unit counts for window_ms, then drops out. The key
-- expires one window after its newest member. A member is named
-- "<time>-<n>" followed by "|<scope>|" for each refund scope of the charge
-- that took it, so that a rolled-back scope removes exactly its own units
-- that are still in the window.

-- Drops the units that have left the window (a dry run, or a call whose
-- writes are deferred, counts them instead: the write drops them, see
-- log_drop) and returns now (never earlier than the newest unit), the
-- number of units in the window and the number of members before them
-- (left in place when counted); without a key, only its newest member is
-- asked for. The key's expiry counts from the newest unit.
local function log_state(key, p, now)
  local newest = call('ZRANGE', key, -1, -1, 'WITHSCORES')[2]
  if not newest then return now, 0, 0 end
  now = max(now, checked(newest + 0))
  local gone = 0
  if dry_run or deferred then
    gone = call('ZCOUNT', key, '-inf', now - p.window_ms * 1000)
  else
    call('ZREMRANGEBYSCORE', key, '-inf', now - p.window_ms * 1000)
  end
  return now, call('ZCARD', key) - gone, gone
end

-- Drops the gone units that log_state counted and left in place (as of
-- now, the clock the call was decided on).
local function log_drop(key, p, gone, now)
  if gone > 0 then call('ZREMRANGEBYSCORE', key, '-inf', now - p.window_ms * 1000) end
end

-- Gives back the n newest units (and drops the gone ones, see log_drop).
local function log_pop(key, p, n, gone, now)
  log_drop(key, p, gone, now)
  if n > 0 then call('ZPOPMAX', key, n) end
end

-- Adds the cost units of a charge taken at now, numbered from seq and
-- tagged with the charge's refund scopes (and drops the gone ones, see
-- log_drop), and sets the key's expiry.
local function log_add(key, p, cost, seq, gone, now, real, scopes)
  log_drop(key, p, gone, now)
  -- members must be unique even for many units in one microsecond: add
  -- them in batches, with more sequence numbers for any that happened to
  -- exist already
  local tag = ''
  if scopes ~= '' then tag = '|' .. string.gsub(scopes, ',', '|') .. '|' end
  local stamp = string.format('%.0f', now)
  -- the score as text (Redis would format the number once per member),
  -- unless now is no whole number of µs (a foreign state's newest score)
  local score = now % 1 == 0 and stamp or now
  local missing = cost
  while missing > 0 do
    if missing == 1 then
      missing = missing - call('ZADD', key, 'NX', score, stamp .. '-' .. seq .. tag)
      seq = seq + 1
    else
      local batch = {}
      for _ = 1, min(missing, 500) do
        batch[#batch + 1] = score
        batch[#batch + 1] = stamp .. '-' .. seq .. tag
        seq = seq + 1
      end
      missing = missing - call('ZADD', key, 'NX', unpack(batch))
    end
  end
  -- (one window from Redis's clock: the caller's own text, 2.7 k
  -- instructions fewer than the number in Redis 7.0)
  if now == real and not on_test_clock then
    call('PEXPIRE', key, p.window_text)
  else
    call('PEXPIRE', key, ttl_ms(p.window_ms, now, real))
  end
end

-- ms (at least 1) until the unit at rank r of the window (0 = oldest, -1 =
-- newest; gone members before it, see log_state) leaves the window, on the
-- clock now; 0 when the window holds no unit (used).
local function log_wait(key, r, used, gone, p, now)
  if used == 0 then return 0 end
  if r >= 0 then r = r + gone end
  local s = call('ZRANGE', key, r, r, 'WITHSCORES')[2]
  return max(ms(s + p.window_ms * 1000 - now), 1)
end

-- Decides a call on a sliding log (see decide in common.lua).
local function sliding_decide(key, p, cost, real, scopes)
  local now, used, gone = log_state(key, p, real)
  local lim = p.lim

  if cost < 0 then
    -- give back the newest units
    local n = min(-cost, used)
    local after = used - n
    return {1, lim, max(lim - after, 0), log_wait(key, after - 1, after, gone, p, now),
            0, now, 0}, log_pop, key, p, n, gone, now
  end
  if used + cost <= lim then
    if cost == 0 then
      return {1, lim, lim - used, log_wait(key, -1, used, gone, p, now), 0, now, 0}, nil
    end
    return {1, lim, lim - used - cost, p.window_ms, 0, now, 0},
      log_add, key, p, cost, used, gone, now, real, scopes
  end
  local retry = -1
  if cost <= lim then
    -- the call fits once the (used + cost - lim) oldest units have left
    retry = log_wait(key, used + cost - lim - 1, used, gone, p, now)
  end
  return {0, lim, max(lim - used, 0), log_wait(key, -1, used, gone, p, now), retry,
          now, 0}, nil
end

-- Gives back a rolled-back charge on a sliding log (see refund in common.lua).
local function sliding_refund(key, p, real, r)
  -- only the scope's own entries are removed, and only those taken since
  -- its first charge can be its own (the window is not applied here: the
  -- limit may have changed since)
  local mark = '|' .. r.scope .. '|'
  local members = call('ZRANGEBYSCORE', key, r.first, '+inf')
  local doomed = {}
  for _, m in ipairs(members) do
    if string.find(m, mark, 1, true) then
      doomed[#doomed + 1] = m
      if #doomed == 500 then
        call('ZREM', key, unpack(doomed))
        doomed = {}
      end
    end
  end
  if #doomed > 0 then call('ZREM', key, unpack(doomed)) end
end

ALG.sliding = {decide = sliding_decide, refund = sliding_refund}
