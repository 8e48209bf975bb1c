-- Main part of the denial script (rl_redis.track_denials): counts one
-- denial of an identity under a policy in the bucket of its minute, a
-- sorted set kept a day after its minute ends and bounded: once it holds
-- RL_DENIAL_MEMBERS identities, further ones count under "(other)".
-- KEYS[1]  <prefix>denials:{<policy>}:<minute>
-- ARGV     the identity (at most 128 bytes: the caller shortens longer
--          ones), the minute (since the epoch), now_us ('' for Redis TIME)
-- Returns the identity's denials in this minute.
local members, keep_ms = 10000, 86400000
local key, member = KEYS[1], ARGV[1]
local now = clock_us(ARGV[3])
if not redis.call('ZSCORE', key, member) and
   redis.call('ZCARD', key) >= members then
  member = '(other)'
end
local n = redis.call('ZINCRBY', key, 1, member)
redis.call('PEXPIRE', key, math.ceil(math.max((tonumber(ARGV[2]) + 1) * 60000000 - now, 0) / 1000) + keep_ms)
return tonumber(n)
