-- rl_redis.on_error when Redis cannot be reached (nothing listens on port 1).
SET rl_redis.port = 1;
SET rl_redis.on_error = 'error';
SELECT rl_sliding_allow('oe:u', 5, 60000);
SELECT * FROM rl_fixed('oe:u', 5, 60000);
\echo :LAST_ERROR_SQLSTATE
-- after a failure the circuit breaker fails calls at once, without trying,
-- for rl_redis.retry_interval
SELECT rl_fixed_allow('oe:u', 5, 60000);
-- setting a connection parameter (even to the same value) tries again
SET rl_redis.port = 1;
-- fail open: allowed, with one warning per outage
SET rl_redis.on_error = 'allow';
SELECT rl_sliding_allow('oe:u', 5, 60000);
SELECT * FROM rl_fixed('oe:u', 5, 60000, 2);
SELECT rl_sliding_allow('oe:u', 5, 60000);
-- fail closed: denied, with one warning per outage
SET rl_redis.port = 1;
SET rl_redis.on_error = 'deny';
SELECT rl_fixed_allow('oe:u', 5, 60000);
SELECT * FROM rl_sliding('oe:u', 5, 60000);
-- without the breaker every call tries again (and still warns once)
SET rl_redis.retry_interval = 0;
SELECT rl_fixed_allow('oe:u', 5, 60000);
SET rl_redis.on_error = 'error';
SELECT rl_fixed_allow('oe:u', 5, 60000);
SET rl_redis.on_error = 'deny';
RESET rl_redis.retry_interval;
-- administrative calls always raise; rl_redis_ping always tries
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
