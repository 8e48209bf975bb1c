-- Token bucket.
-- State (see records.lua): the level is the tokens in the bucket, with the
-- clock they were measured at; plus the refund records. The bucket holds up to
-- cap tokens and refills continuously at lim tokens per window_ms; a call
-- takes cost tokens. A full bucket is the same as no key, so the key
-- expires when the bucket is full. The key's name carries lim, window_ms
-- and the burst (see src/keys.c), so the state needs no limit of its own.
-- A rolled-back charge gives back what its scope's record still owes: the
-- tokens the bucket would hold had the charges never happened.

-- Reads the bucket as of now (never earlier than its clock): tokens,
-- after refill, and the number of refund records.
local function bucket_state(key, p, now)
  local tokens, ts, nrec = level_read(key)
  if not tokens then return now, p.cap, 0 end
  if ts > now then now = ts end
  return now, min(p.cap, tokens + (now - ts) * p.lim / (p.window_ms * 1000)), nrec
end

-- Writes the bucket (or deletes the key, records and all, when it is full).
-- The expiry is the last write of a call.
local function bucket_save(key, p, have, now, real)
  if have >= p.cap then
    call('DEL', key)
  else
    local rate = p.lim / (p.window_ms * 1000)
    level_write(key, have, now)
    call('PEXPIRE', key, ttl_ms(max(ms((p.cap - have) / rate), 1), now, real))
  end
end

-- Writes the bucket after an allowed call of cost that found tokens and
-- the refund records recs (nil: none) and leaves have: the records, then
-- the level (see bucket_save).
local function bucket_write(key, p, cost, scopes, tokens, have, recs, now, real)
  if have < p.cap and (recs or (cost > 0 and scopes ~= '')) then
    local R = records()
    if recs then
      -- an administrator's refund (cost < 0) lowers the records to the
      -- new deficit; a charge first to the old one, then adds its own
      if cost > 0 then R.lower(recs, p.cap - tokens) end
    else
      recs = {}
    end
    if cost > 0 then R.add(recs, scopes, tokens - have, now) end
    R.lower(recs, p.cap - have)
    R.write(key, recs)
  end
  bucket_save(key, p, have, now, real)
end

-- Decides a call on a token bucket (see decide in common.lua).
local function token_bucket_decide(key, p, cost, real, scopes)
  local now, tokens, nrec = bucket_state(key, p, real)
  local cap = p.cap
  local rate = p.lim / (p.window_ms * 1000)   -- tokens per µs
  -- slack for floating-point error in the refill and the additions: a few
  -- units in the last place of the capacity
  local eps = 1e-9 + cap * 1e-13
  local have

  if cost < 0 then
    have = min(cap, tokens - cost)
  elseif tokens + eps >= cost then
    have = max(tokens - cost, 0)
  else
    -- denied: the first ms at which cost tokens are there
    local retry = -1
    if cost <= cap then
      retry = first_ms((cost - tokens - eps) / rate, now, function(t)
        return min(cap, tokens + (t - now) * rate) + eps >= cost
      end)
    end
    return {0, cap, floor(tokens + eps),
            max(ms((cap - tokens) / rate), 0), retry, now, 0}, nil
  end
  local result = {1, cap, floor(have + eps),
                  max(ms((cap - have) / rate), 0), 0, now, 0}
  if cost == 0 then return result, nil end
  -- the records are read here, so that the write cannot fail (see records.lua)
  local recs = nil
  if nrec > 0 then recs = records().read(key) end
  return result, bucket_write, key, p, cost, scopes, tokens, have, recs, now, real
end

-- Gives back a rolled-back charge on a token bucket (see refund in common.lua).
local function token_bucket_refund(key, p, real, r)
  local now, tokens, nrec = bucket_state(key, p, real)
  if nrec == 0 or tokens >= p.cap then return end
  local recs = records().read(key)
  records().lower(recs, p.cap - tokens)
  local have = min(p.cap, tokens + records().take(recs, r, p.cap - tokens))
  records().lower(recs, p.cap - have)
  records().write(key, recs)
  bucket_save(key, p, have, now, real)
end

ALG.token_bucket = {decide = token_bucket_decide, refund = token_bucket_refund}
