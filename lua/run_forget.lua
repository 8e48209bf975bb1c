-- Main part of the forget script: a transaction committed, so the refund
-- records its scopes keep in the token bucket's and GCRA's keys will never
-- be used; drops them (and keeps the count of records right).
-- KEYS[i]  a key the transaction charged
-- ARGV     the transaction's scope id
-- Returns the number of keys.
-- Drops the scope's records of one key.
local function forget(key)
  if call('EXISTS', key) == 1 then
    local recs = records().read(key)
    local gone = false
    for scope, r in pairs(recs) do
      if records().top_of(scope) == ARGV[1] then
        r[1] = 0
        gone = true
      end
    end
    if gone then records().write(key, recs) end
  end
end

for i = 1, #KEYS do
  -- a key whose records Redis cannot read (not rl_redis's) keeps them and
  -- stops no other key's forget; a key fails before its first write or
  -- not at all (see records_read)
  pcall(forget, KEYS[i])
end
return #KEYS
