-- Concurrency limit: at most lim slots held at once.
-- State: a sorted set with one member per held slot (a token unique to the
-- holder), scored by when its lease ends (µs). Slots are given back with
-- ZREM by their holder; a holder that never does (a crashed backend) loses
-- its slot when the lease ends. The key expires with its last lease.
-- KEYS[1]  the identity's key
-- ARGV     lim, lease_ms, token, now_us ('' for Redis TIME), then for a dry
--          run (rl_inspect) the slots asked for: the call says whether they
--          fit and holds nothing ('' takes one slot)
-- Returns allowed, lim, remaining, reset_ms, retry_after_ms, now_us and 0,
-- packed (see packed in common.lua);
-- reset_ms is the time until the last lease ends, retry_after_ms the time
-- until enough leases end (-1: never, more slots asked than lim). A dry run
-- leaves the leases that ended in place and counts them out; its remaining
-- is lim less the slots held now.
local key = KEYS[1]
local lim = ARGV[1] + 0
local lease_ms = ARGV[2] + 0
local now = clock_us(ARGV[4])
dry_run = ARGV[5] ~= nil and ARGV[5] ~= ''
local asked = dry_run and tonumber(ARGV[5]) or 1
-- the end of the last lease (µs; nil without a key), read and checked
-- before the first write (see checked)
local last_end = call('ZRANGE', key, -1, -1, 'WITHSCORES')[2]
if last_end then last_end = checked(last_end + 0) end
local gone = 0
if dry_run then
  gone = call('ZCOUNT', key, '-inf', now)
else
  call('ZREMRANGEBYSCORE', key, '-inf', now)
end
local held = call('ZCARD', key) - gone

-- ms until the lease at rank r among the held ones (0 = first to end, -1 =
-- last) ends
local function lease_left(r)
  local s = last_end
  if r >= 0 then
    s = checked(call('ZRANGE', key, r + gone, r + gone, 'WITHSCORES')[2] + 0)
  end
  return max(ms(s - now), 1)
end

if dry_run then
  local reset = 0
  if held > 0 then reset = lease_left(-1) end
  if held + asked <= lim then
    return packed({1, lim, lim - held, reset, 0, now, 0})
  end
  local retry = -1
  if asked <= lim then retry = lease_left(held + asked - lim - 1) end
  return packed({0, lim, max(lim - held, 0), reset, retry, now, 0})
end
if held < lim then
  -- the key lives as long as its last lease, read before the first write
  local last = lease_ms
  if held > 0 then last = max(lease_left(-1), lease_ms) end
  call('ZADD', key, now + lease_ms * 1000, ARGV[3])
  call('PEXPIRE', key, last)
  return packed({1, lim, lim - held - 1, last, 0, now, 0})
end
return packed({0, lim, 0, lease_left(-1), lease_left(0), now, 0})
