-- Main part of the several-limits script: all limits decide on one clock,
-- and the calls are applied to all of them or to none.
-- KEYS[i]  the key of limit i, each a different one (rl_check_all takes
--          each policy once, a guard each identity): a key's second write
--          would follow the
--          first one's, decided on a state the first changed (a fixed
--          window's SET ... KEEPTTL after its DEL would leave no expiry)
-- ARGV     now_us ('' for Redis TIME), refund scopes ('' for none), then for
--          each limit: algorithm, lim, window_ms, burst (0: none), cost
--          (< 0: give back), shadow ('1': a shadow policy's, '0')
-- A shadow limit that denies stops nothing and is not applied (a denial
-- takes nothing); the others are applied when none of them denies.
-- Returns the most restrictive limit's {lim, remaining, reset_ms,
-- retry_after_ms} after allowed (1 when the call is applied), followed by
-- its index (1-based), then the clock each limit was decided on (µs), one
-- per key, then each key's epoch (see run_one.lua), then each limit's own
-- verdict (1 allowed, 0 denied). The most restrictive is a denied one with
-- the longest wait (-1 counts longest), else the one with the fewest units
-- left; when the call is denied, it is one of the enforced limits (not
-- shadow), whose wait is the caller's.

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

-- A decide's returns: its result and, when it has a write, a function that
-- runs it (see common.lua), to run once every limit has allowed.
local function later(result, write, ...)
  if not write then return result, nil end
  local args = {n = select('#', ...), ...}
  return result, function() write(unpack(args, 1, args.n)) end
end

deferred = true
local now = clock_us(ARGV[1])
local commits = {}
local results = {}
local shadows = {}
local all_allowed = true
local worst, worst_index = nil, 0
for i = 1, #KEYS do
  local b = 2 + (i - 1) * 6
  local p = limit(ARGV[b + 2], ARGV[b + 3], ARGV[b + 4])
  local result, commit = later(ALG[ARGV[b + 1]].decide(KEYS[i], p,
    ARGV[b + 5] + 0, now, ARGV[2]))
  from_clock(result, now)
  local shadow = ARGV[b + 6] == '1'
  if result[1] == 0 and not shadow then all_allowed = false end
  if commit and (result[1] == 1 or not shadow) then
    commits[#commits + 1] = commit
  end
  results[i] = result
  shadows[i] = shadow
end
-- a denied call waits for its enforced limits only: a shadow one stops nothing
for i = 1, #KEYS do
  if (all_allowed or not shadows[i]) and
     (worst == nil or tighter(results[i], worst)) then
    worst, worst_index = results[i], i
  end
end
if all_allowed then
  for _, commit in ipairs(commits) do commit() end
end
local reply = {all_allowed and 1 or 0, worst[2], worst[3], worst[4], worst[5],
  worst_index}
for i = 1, #KEYS do
  reply[6 + i] = results[i][6]
  reply[6 + #KEYS + i] = results[i][7]
  reply[6 + 2 * #KEYS + i] = results[i][1]
end
return reply
