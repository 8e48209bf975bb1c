-- Token bucket.
-- State: a hash with t = tokens in the bucket and ts = when t was measured
-- (µs), plus the refund records (see scopes_add). The bucket holds up to cap
-- tokens and refills continuously at lim tokens per window_ms; a call takes
-- cost tokens. A full bucket is the same as no key, so the key expires when
-- the bucket is full.
-- A rolled-back charge gives back what its scope's record still owes: the
-- tokens the bucket would hold had the charges never happened.
ALG.token_bucket = {}

-- Slack for floating-point error in the refill: tokens are at most 2^31,
-- where a double's rounding is about 1e-7.
local function bucket_eps(cap)
  return 1e-9 + cap * 1e-12
end

-- Reads the bucket as of now (never earlier than ts): tokens, after refill,
-- and the number of refund records.
local function bucket_state(key, p, now)
  local state = redis.call('HMGET', key, 't', 'ts', 'k')
  local tokens = p.cap
  if state[1] then
    now = math.max(now, tonumber(state[2]))
    tokens = math.min(p.cap, tonumber(state[1]) +
      (now - tonumber(state[2])) * p.lim / (p.window_ms * 1000))
  end
  return now, tokens, tonumber(state[3]) or 0
end

-- Writes the bucket (or deletes the key, records and all, when it is full).
-- The expiry is the last write of a call.
local function bucket_save(key, p, have, now)
  if have >= p.cap then
    redis.call('DEL', key)
  else
    local rate = p.lim / (p.window_ms * 1000)
    redis.call('HSET', key, 't', num(have), 'ts', num(now))
    redis.call('PEXPIRE', key, math.max(ms((p.cap - have) / rate), 1))
  end
end

ALG.token_bucket.decide = function(key, p, cost, now, scopes)
  local tokens, records
  now, tokens, records = bucket_state(key, p, now)
  local cap = p.cap
  local rate = p.lim / (p.window_ms * 1000)   -- tokens per µs
  local eps = bucket_eps(cap)

  local function fits_at(t, units)
    return math.min(cap, tokens + (t - now) * rate) + eps >= units
  end
  local function result(allowed, have, retry)
    return {allowed, cap, math.floor(have + eps),
            math.max(ms((cap - have) / rate), 0), retry, now}
  end

  if cost < 0 then
    local have = math.min(cap, tokens - cost)
    return result(1, have, 0), function()
      if have < cap and records > 0 then scopes_clamp(key, cap - have) end
      bucket_save(key, p, have, now)
    end
  end
  if fits_at(now, cost) then
    local have = math.max(tokens - cost, 0)
    local commit = nil
    if cost > 0 then
      commit = function()
        if have < cap then
          if records > 0 then scopes_clamp(key, cap - tokens) end
          if #scopes > 0 then scopes_add(key, scopes, tokens - have, now) end
        end
        bucket_save(key, p, have, now)
      end
    end
    return result(1, have, 0), commit
  end
  local retry = -1
  if cost <= cap then
    retry = first_ms((cost - tokens - eps) / rate, now,
                     function(t) return fits_at(t, cost) end)
  end
  return result(0, tokens, retry), nil
end

ALG.token_bucket.refund = function(key, p, now, r)
  local tokens, records
  now, tokens, records = bucket_state(key, p, now)
  if records == 0 or tokens >= p.cap then return end
  local give = scopes_take(key, r, p.cap - tokens)
  local have = math.min(p.cap, tokens + give)
  if have < p.cap then scopes_clamp(key, p.cap - have) end
  bucket_save(key, p, have, now)
end
