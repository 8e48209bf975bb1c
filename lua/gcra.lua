-- Generic cell rate algorithm, with the semantics of redis-cell's
-- CL.THROTTLE: a rate of lim per window_ms, and up to cap units at once.
-- State (see records.lua): the level is the backlog (µs), how far the
-- theoretical arrival time (TAT), when the identity is back to a full
-- allowance, lies ahead of the latest clock a call used, which is the
-- level's clock; plus the refund records. The backlog is kept relative to
-- that clock, not as an absolute TAT,
-- so that it keeps its precision (an absolute time near 2^50 µs has only
-- 1/8 µs, which at 10^8 units per second is a dozen units). Decisions are
-- taken in units (backlog / interval) against the capacity. The key expires
-- when the backlog runs out. The key's name carries lim, window_ms and
-- the burst (see src/keys.c), so the state needs no limit of its own.
-- A rolled-back charge shortens the backlog by what its scope's record
-- still owes.

-- Writes the backlog b (µs) at now (or deletes the key, records and all,
-- when there is none). The expiry is the last write of a call.
local function gcra_save(key, p, b, now, real)
  if b > 0 then
    level_write(key, b, now)
    call('PEXPIRE', key, ttl_ms(max(ms(b), 1), now, real))
  else
    call('DEL', key)
  end
end

-- Reads the key as of now (never earlier than its clock): the backlog
-- (µs, at least 0) and the number of refund records.
local function gcra_state(key, p, now)
  local b, ts, nrec = level_read(key)
  if not b then return now, 0, 0 end
  if ts > now then now = ts end
  b = b - (now - ts)
  if b < 0 then b = 0 end
  return now, b, nrec
end

-- Writes the key after an allowed call of cost units of interval µs that
-- found backlog and the refund records recs (nil: none) and leaves backlog
-- b: the records, then the backlog (see gcra_save).
local function gcra_write(key, p, cost, scopes, interval, backlog, b, recs, now, real)
  if cost < 0 and b > 0 and recs then
    local R = records()
    R.lower(recs, b)
    R.write(key, recs)
  elseif cost > 0 and (recs or scopes ~= '') then
    local R = records()
    if recs then
      R.lower(recs, backlog)
    else
      recs = {}
    end
    R.add(recs, scopes, cost * interval, now)
    R.lower(recs, b)
    R.write(key, recs)
  end
  gcra_save(key, p, b, now, real)
end

-- Decides a call on a GCRA key (see decide in common.lua).
local function gcra_decide(key, p, cost, real, scopes)
  local now, backlog, nrec = gcra_state(key, p, real)
  local cap = p.cap
  local interval = p.window_ms * 1000 / p.lim   -- µs per unit
  local eps = 1e-9 + cap * 1e-13                -- rounding, in units
  local b

  if cost < 0 then
    b = max(backlog + cost * interval, 0)
  elseif backlog / interval + cost <= cap + eps then
    b = backlog + cost * interval
  else
    -- denied: the first ms at which cost units fit
    local retry = -1
    if cost <= cap then
      retry = first_ms(backlog - (cap - cost) * interval, now, function(t)
        return max(backlog - (t - now), 0) / interval + cost <= cap + eps
      end)
    end
    return {0, cap, max(floor(cap - backlog / interval + eps), 0),
            ms(backlog), retry, now, 0}, nil
  end
  -- units that still fit with backlog b
  local result = {1, cap, max(floor(cap - b / interval + eps), 0),
                  ms(b), 0, now, 0}
  if cost == 0 then return result, nil end
  -- the records are read here, so that the write cannot fail (see records.lua)
  local recs = nil
  if nrec > 0 then recs = records().read(key) end
  return result, gcra_write, key, p, cost, scopes, interval, backlog, b, recs, now, real
end

-- Gives back a rolled-back charge on a GCRA key (see refund in common.lua).
local function gcra_refund(key, p, real, r)
  local now, backlog, nrec = gcra_state(key, p, real)
  if nrec == 0 or backlog <= 0 then return end
  local recs = records().read(key)
  records().lower(recs, backlog)
  local b = backlog - records().take(recs, r, backlog)
  records().lower(recs, b)
  records().write(key, recs)
  gcra_save(key, p, b, now, real)
end

ALG.gcra = {decide = gcra_decide, refund = gcra_refund}
