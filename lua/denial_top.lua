-- Main part of the top-denials script (rl_top_denied): the identities most
-- denied under a policy in the given minutes' buckets (denial_note.lua).
-- KEYS     the minutes' buckets, <prefix>denials:{<policy>}:<minute>, then
--          a scratch key <prefix>denials:{<policy>}:top (deleted again)
-- ARGV     n (1 to 10000)
-- Returns {identity, denials, identity, denials, ...}, most denied first.
local tmp = KEYS[#KEYS]
local buckets = {}
for i = 1, #KEYS - 1 do buckets[i] = KEYS[i] end
call('ZUNIONSTORE', tmp, #buckets, unpack(buckets))
local top = call('ZREVRANGE', tmp, 0, tonumber(ARGV[1]) - 1, 'WITHSCORES')
call('DEL', tmp)
return top
