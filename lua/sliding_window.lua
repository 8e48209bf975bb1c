-- Sliding window log.
-- State: a sorted set with one member per unit taken, scored by the time it
-- was taken (µs). A unit counts for window_ms, then drops out. The key
-- expires one window after its newest member.
ALG.sliding = function(key, lim, window_ms, cost, burst, now)
  local window = window_ms * 1000
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now - window)
  local used = redis.call('ZCARD', key)

  -- ms until the member at rank r (0 = oldest, -1 = newest) leaves
  local function ms_until_gone(r)
    local s = redis.call('ZRANGE', key, r, r, 'WITHSCORES')[2]
    return math.max(ms(tonumber(s) + window - now), 1)
  end
  local function reset_of(n)
    if n == 0 then return 0 end
    return ms_until_gone(-1)
  end

  if cost < 0 then
    -- give back the newest units
    local n = math.min(-cost, used)
    local after = used - n
    local commit = function()
      if n > 0 then redis.call('ZPOPMAX', key, n) end
    end
    if after == 0 then
      return {1, lim, lim, 0, 0}, commit
    end
    return {1, lim, math.max(lim - after, 0),
            math.max(ms(tonumber(redis.call('ZRANGE', key, after - 1, after - 1,
              'WITHSCORES')[2]) + window - now), 1), 0}, commit
  end
  if used + cost <= lim then
    if cost == 0 then
      return {1, lim, lim - used, reset_of(used), 0}, nil
    end
    return {1, lim, lim - used - cost, window_ms, 0}, function()
      -- members must be unique even for many units in one microsecond:
      -- add them in batches, with more sequence numbers for any that
      -- happened to exist already
      local seq = used
      local stamp = num(now)
      local missing = cost
      while missing > 0 do
        local batch = {}
        for _ = 1, math.min(missing, 500) do
          batch[#batch + 1] = now
          batch[#batch + 1] = stamp .. '-' .. seq
          seq = seq + 1
        end
        missing = missing - redis.call('ZADD', key, 'NX', unpack(batch))
      end
      redis.call('PEXPIRE', key, window_ms)
    end
  end
  local retry = -1
  if cost <= lim then
    -- the call fits once the (used + cost - lim) oldest units have left
    retry = ms_until_gone(used + cost - lim - 1)
  end
  return {0, lim, math.max(lim - used, 0), reset_of(used), retry}, nil
end
