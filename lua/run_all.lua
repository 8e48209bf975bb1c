-- Main part of the several-limits script: all limits decide on one clock,
-- and the calls are applied to all of them or to none.
-- KEYS[i]  the key of limit i
-- ARGV     now_us ('' for Redis TIME), then for each limit:
--          algorithm, lim, window_ms, burst (0: none), cost (< 0: refund)
-- Returns the most restrictive limit's {allowed, lim, remaining, reset_ms,
-- retry_after_ms} followed by its index (1-based): a denied one with the
-- longest wait (-1 counts longest), else the one with the fewest units left.

-- True when result a is more restrictive than result b.
local function tighter(a, b)
  if a[1] ~= b[1] then return a[1] == 0 end
  if a[1] == 0 then
    if a[5] == -1 or b[5] == -1 then return a[5] == -1 and b[5] ~= -1 end
    return a[5] > b[5]
  end
  if a[3] ~= b[3] then return a[3] < b[3] end
  return a[4] > b[4]
end

local now = clock_us(ARGV[1])
local commits = {}
local all_allowed = true
local worst, worst_index = nil, 0
for i = 1, #KEYS do
  local b = 1 + (i - 1) * 5
  local result, commit = ALG[ARGV[b + 1]](KEYS[i], tonumber(ARGV[b + 2]),
    tonumber(ARGV[b + 3]), tonumber(ARGV[b + 5]), tonumber(ARGV[b + 4]), now)
  if result[1] == 0 then all_allowed = false end
  if commit then commits[#commits + 1] = commit end
  if worst == nil or tighter(result, worst) then
    worst, worst_index = result, i
  end
end
if all_allowed then
  for _, commit in ipairs(commits) do commit() end
end
worst[6] = worst_index
return worst
