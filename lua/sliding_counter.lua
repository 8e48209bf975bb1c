-- Sliding window counter (two-window approximation).
-- State: a hash with w = start of the current window (ms), c = units used in
-- it and p = units used in the window before. The estimate of the last
-- window_ms is p weighted by how much of the previous window still overlaps
-- it, plus c. O(1) memory; exact when the previous window's units were
-- spread evenly. The key expires when both windows have passed.
ALG.sliding_counter = function(key, lim, window_ms, cost, burst, now)
  local now_ms = now / 1000
  local start = math.floor(now_ms / window_ms) * window_ms
  local c, p = 0, 0
  local state = redis.call('HMGET', key, 'w', 'c', 'p')
  local w = tonumber(state[1])
  if w == start then
    c, p = tonumber(state[2]) or 0, tonumber(state[3]) or 0
  elseif w == start - window_ms then
    p = tonumber(state[2]) or 0
  end
  local into = now_ms - start                  -- ms into the current window
  local weight = (window_ms - into) / window_ms
  local left = start + window_ms - now_ms      -- ms until the current window ends

  local function estimate(cur)
    return p * weight + cur
  end
  local function reset_of(cur)
    if cur > 0 then return math.ceil(left + window_ms) end
    if p > 0 then return math.ceil(left) end
    return 0
  end
  local function result(allowed, cur, retry)
    return {allowed, lim, math.max(math.floor(lim - estimate(cur) + 1e-9), 0),
            reset_of(cur), retry}
  end
  local function save(cur)
    return function()
      if cur > 0 or p > 0 then
        redis.call('HSET', key, 'w', num(start), 'c', cur, 'p', p)
        redis.call('PEXPIRE', key, math.ceil(left + window_ms))
      else
        redis.call('DEL', key)
      end
    end
  end

  if cost < 0 then
    local cur = math.max(c + cost, 0)
    return result(1, cur, 0), save(cur)
  end
  if estimate(c + cost) <= lim + 1e-9 then
    local commit = nil
    if cost > 0 then commit = save(c + cost) end
    return result(1, c + cost, 0), commit
  end
  local retry = -1
  if cost <= lim then
    if c + cost <= lim then
      -- wait until the previous window's weight has shrunk enough
      retry = left - (lim - c - cost) * window_ms / p
    elseif c > 0 then
      -- wait for the next window, where c becomes the previous count
      retry = left + math.max(window_ms - (lim - cost) * window_ms / c, 0)
    else
      retry = left
    end
    retry = math.max(math.ceil(retry), 1)
  end
  return result(0, c, retry), nil
end
