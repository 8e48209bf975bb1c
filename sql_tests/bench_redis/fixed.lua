-- Benchmark fixture (sql_tests/bench_redis.sh), not the extension's script:
-- the plain fixed window. KEYS[1] counts the calls; ARGV = lim, window_ms.
-- INCRBY, and PEXPIRE on the first call of the window. Returns 1 (allowed)
-- or 0.
local n = redis.call('INCRBY', KEYS[1], 1)
if n == 1 then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
if n <= tonumber(ARGV[1]) then return 1 end
return 0
