-- Fixed window counter.
-- State: a hash with w = start of the current window (ms) and n = units used
-- in it. Windows start at multiples of window_ms on the clock; a call in a
-- later window starts from zero. The key expires at its window's end.
ALG.fixed = function(key, lim, window_ms, cost, burst, now)
  local now_ms = now / 1000
  local start = math.floor(now_ms / window_ms) * window_ms
  local left = math.ceil(start + window_ms - now_ms)
  local used = 0
  local state = redis.call('HMGET', key, 'w', 'n')
  if tonumber(state[1]) == start then
    used = tonumber(state[2]) or 0
  end

  local function result(allowed, n, retry)
    local reset = 0
    if n > 0 then reset = left end
    return {allowed, lim, math.max(lim - n, 0), reset, retry}
  end
  local function save(n)
    return function()
      if n > 0 then
        redis.call('HSET', key, 'w', num(start), 'n', n)
        redis.call('PEXPIRE', key, left)
      else
        redis.call('DEL', key)
      end
    end
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
