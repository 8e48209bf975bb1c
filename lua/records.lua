-- The state of the token bucket and GCRA (algorithms.h: keeps_records),
-- and its refund records; the build puts this file after common.lua in
-- their scripts (src/embed_lua.sh).
--
-- Their key is a hash. Field "v" holds the level (tokens; a backlog in µs)
-- and the clock it was measured at (µs), packed as two little-endian
-- doubles (16 bytes: struct "<dd"), which hold every level and time
-- rl_redis writes exactly (see checked) and cost a call no conversion to
-- or from text.
--
-- Refund records, in the same hash: field "s:<scope>" = "<owed>:<last_us>",
-- what the charges of a refund scope would give back if it rolled back
-- now. A transaction's scope id has no '/'; a savepoint's is "<transaction's
-- id>/<n>". Field "k" counts them.
-- The records of different transactions (their charges are disjoint) owe
-- at most the key's deficit together, and a savepoint's record at most its
-- transaction's: had all those charges never happened the bucket would
-- have been full whenever the deficit fell that low, so the refill since
-- then would have been lost anyway, whichever of them roll back, in any
-- order. A transaction that commits has its records forgotten
-- (run_forget.lua); at most MAX_SCOPES records are kept, the least recently
-- charged transaction's going first (its refund then gives back nothing:
-- never too much).

-- Reads a key's level and the clock it was measured at (field v), and the
-- number of its refund records: level, ts, nrec; nil, nil, 0 when there is
-- no key. A v that is not 16 bytes is refused (see wrong_kind), as are
-- records without a level (rl_redis writes v whenever it writes a key), and
-- both numbers go through checked.
local function level_read(key)
  local state = call('HMGET', key, 'v', 'k')
  local v = state[1]
  if not v then
    if state[2] then wrong_kind() end
    return nil, nil, 0
  end
  if #v ~= 16 then wrong_kind() end
  local level, ts = sunpack('<dd', v)
  return checked(level), checked(ts), tonumber(state[2]) or 0
end

-- Writes a key's level as measured at now (µs): field v (see level_read).
local function level_write(key, level, now)
  call('HSET', key, 'v', spack('<dd', level, now))
end

-- Splits "a,b,c" into {"a", "b", "c"}; "" gives {}. For the records (a
-- charge's scopes) and the refund script (a scope's parents).
local function split(s)
  local out = {}
  if s and s ~= '' then
    for part in string.gmatch(s, '[^,]+') do out[#out + 1] = part end
  end
  return out
end

-- The record functions below, made on the first use of them and kept (for
-- the rest of a script's call; a library's functions keep them): a script
-- that meets no records makes none. They keep no state of a call.
-- records() returns {read, lower, write, add, take, top_of}.
local records_made = nil
local function records()
  if records_made then return records_made end
  local MAX_SCOPES = 64

  -- A number as a record's text: integral values without an exponent, the
  -- others with the digits that read back exactly.
  local function num(x)
    if x == floor(x) then
      return string.format('%.0f', x)
    end
    return string.format('%.17g', x)
  end

  -- Reads the refund records of key: {scope = {owed, last_us, original}};
  -- a record that is not two such numbers is refused (see checked). A
  -- decide reads them before it returns its write, and a refund before its
  -- first write, so that no write fails halfway.
  local function records_read(key)
    local recs = {}
    local all = call('HGETALL', key)
    for i = 1, #all, 2 do
      if sub(all[i], 1, 2) == 's:' then
        local owed, last = string.match(all[i + 1], '^([^:]+):(.+)$')
        recs[sub(all[i], 3)] = {checked(tonumber(owed)), checked(tonumber(last)),
                                       all[i + 1]}
      end
    end
    return recs
  end

  -- The transaction's scope id of a scope id.
  local function top_of(scope)
    return string.match(scope, '^[^/]+')
  end

  -- Lowers the records to fit bound (the deficit) as said above.
  local function records_lower(recs, bound)
    local tops, total = {}, 0
    for scope, r in pairs(recs) do
      if top_of(scope) == scope then
        tops[#tops + 1] = scope
        total = total + r[1]
      end
    end
    if total > bound then
      table.sort(tops, function(a, b) return recs[a][2] < recs[b][2] end)
      local excess = total - bound
      for _, scope in ipairs(tops) do
        if excess <= 0 then break end
        local cut = min(recs[scope][1], excess)
        recs[scope][1] = recs[scope][1] - cut
        excess = excess - cut
      end
    end
    for scope, r in pairs(recs) do
      local top = recs[top_of(scope)]
      r[1] = min(r[1], top and top[1] or 0)
    end
  end

  -- Writes the records that changed, drops those that owe nothing.
  local function records_write(key, recs)
    local k = 0
    for scope, r in pairs(recs) do
      if r[1] <= 0 then
        if r[3] ~= '' then call('HDEL', key, 's:' .. scope) end
      else
        local v = num(r[1]) .. ':' .. num(r[2])
        if v ~= r[3] then call('HSET', key, 's:' .. scope, v) end
        k = k + 1
      end
    end
    call('HSET', key, 'k', k)
  end

  -- Adds amount, charged at now, to the records of every scope of scopes
  -- ("a,b", see common.lua; made as needed). Beyond MAX_SCOPES records, drops first the records of
  -- this transaction's savepoints that are no longer open (not in scopes:
  -- released into an enclosing level, which owes their charges too), then
  -- the least recently charged other transaction's; never the open scopes of
  -- this charge.
  local function records_add(recs, scopes, amount, now)
    scopes = split(scopes)
    local n = 0
    for _, r in pairs(recs) do
      if r[1] > 0 then n = n + 1 end
    end
    local mine = {}
    for _, scope in ipairs(scopes) do
      mine[scope] = true
      local r = recs[scope]
      if r and r[1] > 0 then
        r[1], r[2] = r[1] + amount, now
      else
        recs[scope] = {amount, now, r and r[3] or ''}
        n = n + 1
      end
    end
    if n <= MAX_SCOPES or #scopes == 0 then return end
    local top = top_of(scopes[1])
    for scope, r in pairs(recs) do
      if n <= MAX_SCOPES then return end
      if r[1] > 0 and not mine[scope] and top_of(scope) == top then
        r[1] = 0
        n = n - 1
      end
    end
    while n > MAX_SCOPES do
      local oldest = nil
      for scope, r in pairs(recs) do
        if top_of(scope) == scope and r[1] > 0 and not mine[scope] and
           (oldest == nil or r[2] < recs[oldest][2]) then
          oldest = scope
        end
      end
      if oldest == nil then return end
      for scope, r in pairs(recs) do
        if top_of(scope) == oldest and r[1] > 0 then
          r[1] = 0
          n = n - 1
        end
      end
    end
  end

  -- Takes the record of scope r.scope out (with its savepoints' records when
  -- it is a transaction) and lowers its parents' by what it gives back;
  -- returns that (at most bound).
  local function records_take(recs, r, bound)
    local mine = recs[r.scope]
    if not mine then return 0 end
    local give = min(mine[1], bound)
    mine[1] = 0
    if top_of(r.scope) == r.scope then
      for scope, rec in pairs(recs) do
        if top_of(scope) == r.scope then rec[1] = 0 end
      end
    end
    for _, parent in ipairs(r.parents) do
      local p = recs[parent]
      if p then p[1] = max(p[1] - give, 0) end
    end
    return give
  end
  records_made = {read = records_read, lower = records_lower,
                  write = records_write, add = records_add,
                  take = records_take, top_of = top_of}
  return records_made
end
