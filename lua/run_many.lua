-- Main part of the batch script: one limit decided for many keys, each on
-- its own (a denial of one key does not stop the others), all on one clock.
-- KEYS[i]  the key of identity i (several may be the same key: they are
--          decided one after another, in order)
-- ARGV     algorithm, lim, window_ms, burst (0: none), cost (>= 0),
--          now_us ('' for Redis TIME), refund scopes ('' for none)
-- Returns, for each key in order, its decision packed as run_one.lua
-- returns it; for a key that cannot be decided (it holds a value of another
-- type), its error (an error reply in the array), and nothing is written
-- to it: a decision
-- fails before its first write or not at all (see common.lua), so the
-- other keys' decisions stand.
-- Decides the call on one key and applies it (see applied), both under
-- the caller's pcall: a key whose decision or write fails is that key's
-- error alone.
local function decide_one(alg, key, p, cost, now, scopes)
  return applied(alg.decide(key, p, cost, now, scopes))
end

local p = limit(ARGV[2], ARGV[3], ARGV[4])
local alg = ALG[ARGV[1]]
local cost = ARGV[5] + 0
local now = clock_us(ARGV[6])
local reply = {}
for i = 1, #KEYS do
  local ok, result = pcall(decide_one, alg, KEYS[i], p, cost, now, ARGV[7] or '')
  if ok then
    reply[i] = packed(from_clock(result, now))
  elseif type(result) == 'table' then
    reply[i] = result
  else
    reply[i] = {err = tostring(result)}
  end
end
return reply
