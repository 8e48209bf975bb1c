-- Main part of the refund script: gives back what a rolled-back transaction
-- or savepoint (a refund scope) took on each of its keys and still counts.
-- KEYS[i]  a key the scope charged
-- ARGV     now_us ('' for Redis TIME), the scope, its parent scopes
--          ("a,b"; '' for none), then for each key: algorithm, lim,
--          window_ms, burst (0: none), window number of the newest charge,
--          units taken in that window, units taken in the window before,
--          the key's epoch when charged, the clock of the scope's first
--          charge on it (µs)
-- Returns the number of keys.
local now = clock_us(ARGV[1])
local r = {scope = ARGV[2], parents = split(ARGV[3])}
for i = 1, #KEYS do
  local b = 3 + (i - 1) * 9
  local p = limit(ARGV[b + 2], ARGV[b + 3], ARGV[b + 4])
  r.idx, r.units, r.prev = ARGV[b + 5] + 0, ARGV[b + 6] + 0, ARGV[b + 7] + 0
  r.epoch, r.first = ARGV[b + 8] + 0, ARGV[b + 9] + 0
  -- a key Redis cannot read (another type: not rl_redis's) gives nothing
  -- back and stops no other key's refund; a refund fails before its first
  -- write or not at all (see common.lua)
  pcall(ALG[ARGV[b + 1]].refund, KEYS[i], p, now, r)
end
return #KEYS
