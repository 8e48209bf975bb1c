-- Main part of the one-algorithm scripts: one decision (or an
-- administrator's refund) on one key.
-- KEYS[1]  the identity's key
-- ARGV     algorithm, lim, window_ms, cost (< 0: give back), burst (0: none),
--          now_us (test clock; '' for Redis TIME), refund scopes
--          ("a,b": outermost first; '' for none), dry run ('1': decide
--          and write nothing, see rl_inspect; '': apply the call); the
--          caller may leave off empty ones at the end
-- Returns allowed, lim, remaining, reset_ms, retry_after_ms, stamp_us and
-- epoch (of the key, for the fixed window and the sliding counter; else 0)
-- packed in one string (see packed).
local p = limit(ARGV[2], ARGV[3], ARGV[5], ONE)
local now = clock_us(ARGV[6])
dry_run = ARGV[8] == '1'
local result = applied(ALG[ARGV[1]].decide(KEYS[1], p, ARGV[4] + 0, now,
  ARGV[7] or ''))
return packed(from_clock(result, now))
