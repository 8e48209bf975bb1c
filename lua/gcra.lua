-- Generic cell rate algorithm, with the semantics of redis-cell's
-- CL.THROTTLE: a rate of lim per window_ms, and up to burst units (lim when
-- burst is 0) at once.
-- State: one string, the theoretical arrival time (TAT, µs): when the
-- identity would be back to a full allowance. The key expires at the TAT.
ALG.gcra = function(key, lim, window_ms, cost, burst, now)
  local cap = lim
  if burst > 0 then cap = burst end
  local interval = window_ms * 1000 / lim   -- µs per unit
  local tolerance = interval * cap          -- how far the TAT may run ahead
  local tat = math.max(tonumber(redis.call('GET', key)) or now, now)

  local function save(t)
    return function()
      if t > now then
        redis.call('SET', key, num(t), 'PX', math.max(ms(t - now), 1))
      else
        redis.call('DEL', key)
      end
    end
  end
  -- units that still fit when the TAT is t (the slack absorbs rounding)
  local function fits(t)
    return math.max(math.floor((tolerance - (t - now)) / interval + 1e-9), 0)
  end

  if cost < 0 then
    local t = math.max(tat + cost * interval, now)
    return {1, cap, fits(t), ms(t - now), 0}, save(t)
  end
  local new_tat = tat + cost * interval
  local allow_at = new_tat - tolerance
  if now - allow_at >= -1e-6 then
    local commit = nil
    if cost > 0 then commit = save(new_tat) end
    return {1, cap, fits(new_tat), ms(new_tat - now), 0}, commit
  end
  local retry = -1
  if cost <= cap then retry = math.max(ms(allow_at - now), 1) end
  return {0, cap, fits(tat), ms(tat - now), retry}, nil
end
