-- Token bucket.
-- State: a hash with t = tokens in the bucket and ts = when t was measured
-- (µs), plus the refund records (see records_add). The bucket holds up to
-- cap tokens and refills continuously at lim tokens per window_ms; a call
-- takes cost tokens. A full bucket is the same as no key, so the key
-- expires when the bucket is full.
-- A rolled-back charge gives back what its scope's record still owes: the
-- tokens the bucket would hold had the charges never happened.
ALG.token_bucket = {}

-- Slack for floating-point error in the refill and the additions: a few
-- units in the last place of the capacity.
local function bucket_eps(cap)
  return 1e-9 + cap * 1e-13
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
local function bucket_save(key, p, have, now, real)
  if have >= p.cap then
    redis.call('DEL', key)
  else
    local rate = p.lim / (p.window_ms * 1000)
    redis.call('HSET', key, 't', num(have), 'ts', num(now), 'l', limit_sig(p))
    expire(key, math.max(ms((p.cap - have) / rate), 1), now, real)
  end
end

ALG.token_bucket.decide = function(key, p, cost, real, scopes)
  local now, tokens, records = bucket_state(key, p, real)
  local cap = p.cap
  local rate = p.lim / (p.window_ms * 1000)   -- tokens per µs
  local eps = bucket_eps(cap)

  local function fits_at(t, units)
    return math.min(cap, tokens + (t - now) * rate) + eps >= units
  end
  local function result(allowed, have, retry)
    return {allowed, cap, math.floor(have + eps),
            math.max(ms((cap - have) / rate), 0), retry, now, 0}
  end

  if cost < 0 then
    local have = math.min(cap, tokens - cost)
    return result(1, have, 0), function()
      if have < cap and records > 0 then
        local recs = records_read(key)
        records_lower(recs, cap - have)
        records_write(key, recs)
      end
      bucket_save(key, p, have, now, real)
    end
  end
  if fits_at(now, cost) then
    local have = math.max(tokens - cost, 0)
    local commit = nil
    if cost > 0 then
      commit = function()
        if have < cap and (records > 0 or #scopes > 0) then
          local recs = {}
          if records > 0 then
            recs = records_read(key)
            records_lower(recs, cap - tokens)
          end
          records_add(recs, scopes, tokens - have, now)
          records_lower(recs, cap - have)
          records_write(key, recs)
        end
        bucket_save(key, p, have, now, real)
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

ALG.token_bucket.refund = function(key, p, real, r)
  local now, tokens, records = bucket_state(key, p, real)
  if records == 0 or tokens >= p.cap then return end
  local recs = records_read(key)
  records_lower(recs, p.cap - tokens)
  local have = math.min(p.cap, tokens + records_take(recs, r, p.cap - tokens))
  records_lower(recs, p.cap - have)
  records_write(key, recs)
  bucket_save(key, p, have, now, real)
end
