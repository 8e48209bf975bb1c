-- Main part of the one-algorithm scripts: one decision (or refund) on one key.
-- KEYS[1]  the identity's key
-- ARGV     algorithm, lim, window_ms, cost (< 0: refund), burst (0: none),
--          now_us (test clock; '' for Redis TIME)
-- Returns {allowed, lim, remaining, reset_ms, retry_after_ms}.
local result, commit = ALG[ARGV[1]](KEYS[1], tonumber(ARGV[2]),
  tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), clock_us(ARGV[6]))
if result[1] == 1 and commit then
  commit()
end
return result
