-- Main part of the denial script (rl_redis.track_denials): counts denials
-- of identities under a policy in the bucket of their minute, a sorted set
-- kept a day after its minute ends and bounded: once it holds
-- RL_DENIAL_MEMBERS identities, further ones count under "(other)".
-- KEYS[1]  <prefix>denials:{<policy>}:<minute>
-- ARGV     the minute (since the epoch), now_us ('' for Redis TIME), then
--          for each identity: the identity (at most 128 bytes: the caller
--          shortens longer ones) and its number of denials (the caller
--          sends at most 500 identities, each once)
-- Returns the number of identities counted.
local members, keep_ms = 10000, 86400000
local key = KEYS[1]
local now = clock_us(ARGV[2])
for i = 3, #ARGV - 1, 2 do
  local member = ARGV[i]
  if not call('ZSCORE', key, member) and
     call('ZCARD', key) >= members then
    member = '(other)'
  end
  call('ZINCRBY', key, tonumber(ARGV[i + 1]), member)
end
call('PEXPIRE', key, ceil(max((tonumber(ARGV[1]) + 1) * 60000000 - now, 0) / 1000) + keep_ms)
return (#ARGV - 2) / 2
