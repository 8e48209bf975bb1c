-- rl_redis.on_error when Redis cannot be reached (nothing listens on port 1).
SET rl_redis.port = 1;
SET rl_redis.on_error = 'error';
SELECT rl_sliding_allow('oe:u', 5, 60000);
SELECT * FROM rl_fixed('oe:u', 5, 60000);
\echo :LAST_ERROR_SQLSTATE
-- fail open: allowed, with a warning
SET rl_redis.on_error = 'allow';
SELECT rl_sliding_allow('oe:u', 5, 60000);
SELECT * FROM rl_fixed('oe:u', 5, 60000, 2);
-- fail closed: denied, with a warning
SET rl_redis.on_error = 'deny';
SELECT rl_fixed_allow('oe:u', 5, 60000);
SELECT * FROM rl_sliding('oe:u', 5, 60000);
-- administrative calls always raise
SELECT rl_reset('oe:u');
SELECT * FROM rl_redis_ping();
\echo :LAST_ERROR_SQLSTATE
-- argument errors are raised whatever the policy
SELECT rl_fixed_allow('oe:u', 0, 60000);
-- back on the real server, the same session works again
RESET rl_redis.port;
RESET rl_redis.on_error;
SELECT rl_reset('oe:u');
SELECT rl_fixed_allow('oe:u', 5, 60000);
SELECT rl_reset('oe:u');
