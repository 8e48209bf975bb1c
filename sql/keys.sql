-- Key layout, expiry, binary-safe identities and rl_reset, checked in Redis
-- itself with redis-cli.
SET rl_redis.key_prefix = 'rlkeys:';
-- on the test clock, at the start of a fixed window (a multiple of 60000):
-- a window's keys cannot expire between a call and the look at them, as
-- they did on the real clock when a minute ended in between
SET rl_redis.test_clock_ms = 1000000020000;
SELECT current_setting('rl_redis.port') AS port \gset
\setenv RLPORT :port
\! redis-cli -p $RLPORT eval "for _, k in ipairs(redis.call('KEYS', ARGV[1])) do redis.call('DEL', k) end" 0 'rlkeys:*'

-- <key_prefix><kind>:{<identity>}:<lim>/<window_ms>: a string (packed) for
-- fixed, whose kind is fixed.2, a sorted set for sliding; two limits on one
-- identity are two counters
SELECT rl_fixed_allow('tenant:acme:user:42', 5, 60000),
       rl_sliding_allow('tenant:acme:user:42', 5, 60000);
\! redis-cli -p $RLPORT --no-raw --scan --pattern 'rlkeys:*' | sort
\! redis-cli -p $RLPORT type 'rlkeys:fixed.2:{tenant:acme:user:42}:5/60000'
\! redis-cli -p $RLPORT type 'rlkeys:sliding:{tenant:acme:user:42}:5/60000'
\! redis-cli -p $RLPORT zcard 'rlkeys:sliding:{tenant:acme:user:42}:5/60000'
-- both keys expire by themselves, within one window
\! for k in 'rlkeys:fixed.2:{tenant:acme:user:42}:5/60000' 'rlkeys:sliding:{tenant:acme:user:42}:5/60000'; do t=$(redis-cli -p $RLPORT pttl "$k"); if [ "$t" -gt 0 ] && [ "$t" -le 60000 ]; then echo "$k expires"; else echo "$k has pttl $t"; fi; done

SELECT rl_fixed_allow('tenant:acme:user:42', 1, 60000),
       rl_fixed_allow('tenant:acme:user:42', 1, 3600000),
       rl_fixed_allow('tenant:acme:user:42', 1, 60000);
\! redis-cli -p $RLPORT --no-raw --scan --pattern 'rlkeys:*' | sort

-- rl_reset forgets the identity under every algorithm and limit, and
-- nothing else
SELECT rl_fixed_allow('tenant:acme:user:43', 5, 60000);
SELECT rl_reset('tenant:acme:user:42');
\! redis-cli -p $RLPORT --no-raw --scan --pattern 'rlkeys:*' | sort
SELECT * FROM rl_sliding('tenant:acme:user:42', 5, 60000);
SELECT rl_reset('tenant:acme:user:42'), rl_reset('tenant:acme:user:43');

-- identities are binary-safe arguments: protocol bytes, braces and any
-- UTF-8 stay inside their own key (nothing is flushed, nothing else touched);
-- '%', '{' and '}' are percent-encoded, so the hash tag is never empty
-- and '%7D' is not '}'
SELECT rl_sliding_allow(E'x\r\n*1\r\n$8\r\nFLUSHALL\r\n', 5, 60000),
       rl_fixed_allow('a{b}c', 5, 60000),
       rl_fixed_allow('}', 5, 60000),
       rl_fixed_allow('%7D', 5, 60000),
       rl_fixed_allow('ünï 🙂', 5, 60000),
       rl_fixed_allow(E'\\x00', 5, 60000);
\! redis-cli -p $RLPORT --no-raw --scan --pattern 'rlkeys:*' | sort
SELECT rl_reset(E'x\r\n*1\r\n$8\r\nFLUSHALL\r\n'), rl_reset('a{b}c'),
       rl_reset('}'), rl_reset('%7D'), rl_reset('ünï 🙂'), rl_reset(E'\\x00');
\! redis-cli -p $RLPORT --no-raw --scan --pattern 'rlkeys:*' | sort

-- a 1 MB identity (the largest rl_redis.max_identity_bytes) works and is
-- counted like any other
SET rl_redis.test_clock_ms = 1000000000000;
SET rl_redis.max_identity_bytes = '1MB';
SELECT rl_fixed(repeat('i', 1048576), 2, 60000) AS first,
       rl_fixed(repeat('i', 1048576), 2, 60000) AS second,
       rl_fixed(repeat('i', 1048576), 2, 60000) AS third;
\! redis-cli -p $RLPORT --scan --pattern 'rlkeys:*' | wc -l
SELECT rl_reset(repeat('i', 1048576));
SET rl_redis.test_clock_ms = 1000000020000;
RESET rl_redis.max_identity_bytes;

-- the prefix can be changed by a superuser, and keeps its own counters
SET rl_redis.key_prefix = 'rlkeys:other:';
SELECT rl_fixed_allow('p', 1, 60000), rl_fixed_allow('p', 1, 60000);
SET rl_redis.key_prefix = 'rlkeys:';
SELECT rl_fixed_allow('p', 1, 60000);
\! redis-cli -p $RLPORT --no-raw --scan --pattern 'rlkeys:*' | sort
SELECT rl_reset('p');
SET rl_redis.key_prefix = 'rlkeys:other:';
SELECT rl_reset('p');
-- braces would break the one-slot-per-identity layout
SET rl_redis.key_prefix = 'rl{x}:';
RESET rl_redis.key_prefix;
RESET rl_redis.test_clock_ms;
