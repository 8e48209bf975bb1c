-- Generic cell rate algorithm, with the semantics of redis-cell's
-- CL.THROTTLE: a rate of lim per window_ms, and up to cap units at once.
-- State: a hash with tat = the theoretical arrival time (µs), when the
-- identity would be back to a full allowance, and ts = the latest clock a
-- call used (µs), plus the refund records (see scopes_add). The key expires
-- at the TAT. (Release 1.2 kept the TAT as a plain string; such a key is
-- read once and rewritten as a hash.)
-- A rolled-back charge moves the TAT back by what its scope's record still
-- owes.
ALG.gcra = {}

-- Writes a backlog (or deletes the key, records and all, when it is none).
local function gcra_save(key, backlog, now)
  if backlog > 0 then
    redis.call('HSET', key, 'tat', num(now + backlog), 'ts', num(now))
    redis.call('PEXPIRE', key, math.max(ms(backlog), 1))
  else
    redis.call('DEL', key)
  end
end

-- Reads the key as of now (never earlier than ts): the backlog (tat - now,
-- at least 0, µs) and the number of refund records.
local function gcra_state(key, now)
  local state = redis.pcall('HMGET', key, 'tat', 'ts', 'k')
  if state.err then
    -- a 1.2 string key: its value is the TAT
    local tat = tonumber(redis.call('GET', key)) or now
    redis.call('DEL', key)
    gcra_save(key, math.max(tat - now, 0), now)
    return now, math.max(tat - now, 0), 0
  end
  if not state[1] then return now, 0, 0 end
  now = math.max(now, tonumber(state[2]) or 0)
  return now, math.max(tonumber(state[1]) - now, 0), tonumber(state[3]) or 0
end

ALG.gcra.decide = function(key, p, cost, now, scopes)
  local backlog, records
  now, backlog, records = gcra_state(key, now)
  local cap = p.cap
  local interval = p.window_ms * 1000 / p.lim   -- µs per unit
  local tolerance = interval * cap              -- the most backlog allowed
  local eps = 1e-6 + tolerance * 1e-14          -- rounding of µs figures

  -- units that still fit with backlog b (the slack absorbs rounding)
  local function room(b)
    local q = (tolerance - b) / interval
    return math.max(math.floor(q + 1e-9 + math.abs(q) * 1e-12), 0)
  end
  local function fits_at(t, units)
    return math.max(backlog - (t - now), 0) + units * interval <= tolerance + eps
  end

  if cost < 0 then
    local b = math.max(backlog + cost * interval, 0)
    return {1, cap, room(b), ms(b), 0, now}, function()
      gcra_save(key, b, now)
      if b > 0 and records > 0 then scopes_clamp(key, b) end
    end
  end
  if fits_at(now, cost) then
    local b = backlog + cost * interval
    local commit = nil
    if cost > 0 then
      commit = function()
        gcra_save(key, b, now)
        if records > 0 then scopes_clamp(key, backlog) end
        if #scopes > 0 then scopes_add(key, scopes, cost * interval, now) end
      end
    end
    return {1, cap, room(b), ms(b), 0, now}, commit
  end
  local retry = -1
  if cost <= cap then
    retry = first_ms(backlog + cost * interval - tolerance - eps, now,
                     function(t) return fits_at(t, cost) end)
  end
  return {0, cap, room(backlog), ms(backlog), retry, now}, nil
end

ALG.gcra.refund = function(key, p, now, r)
  local backlog, records
  now, backlog, records = gcra_state(key, now)
  if records == 0 or backlog <= 0 then return end
  local b = backlog - scopes_take(key, r, backlog)
  gcra_save(key, b, now)
  if b > 0 then scopes_clamp(key, b) end
end
