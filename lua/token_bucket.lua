-- Token bucket.
-- State: a hash with t = tokens in the bucket and ts = when t was measured
-- (µs). The bucket holds up to burst tokens (lim when burst is 0) and refills
-- continuously at lim tokens per window_ms; a call takes cost tokens. A full
-- bucket is the same as no key, so the key expires when the bucket is full.
ALG.token_bucket = function(key, lim, window_ms, cost, burst, now)
  local cap = lim
  if burst > 0 then cap = burst end
  local rate = lim / (window_ms * 1000)    -- tokens per µs
  local tokens = cap
  local state = redis.call('HMGET', key, 't', 'ts')
  if state[1] then
    local elapsed = math.max(now - tonumber(state[2]), 0)
    tokens = math.min(cap, tonumber(state[1]) + elapsed * rate)
  end

  -- ms until the bucket holds n tokens again
  local function until_has(n, have)
    return math.max(ms((n - have) / rate), 0)
  end
  local function result(allowed, have, retry)
    return {allowed, cap, math.floor(have + 1e-9), until_has(cap, have), retry}
  end
  local function save(have)
    return function()
      if have >= cap then
        redis.call('DEL', key)
      else
        redis.call('HSET', key, 't', num(have), 'ts', num(now))
        redis.call('PEXPIRE', key, math.max(until_has(cap, have), 1))
      end
    end
  end

  if cost < 0 then
    local have = math.min(cap, tokens - cost)
    return result(1, have, 0), save(have)
  end
  -- the small slack absorbs floating-point error in the refill
  if tokens + 1e-9 >= cost then
    local have = math.max(tokens - cost, 0)
    local commit = nil
    if cost > 0 then commit = save(have) end
    return result(1, have, 0), commit
  end
  local retry = -1
  if cost <= cap then retry = math.max(until_has(cost, tokens), 1) end
  return result(0, tokens, retry), nil
end
