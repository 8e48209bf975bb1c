#!/usr/bin/env bash
# Measures what a decision costs while Redis is away, with the circuit
# breaker (rl_redis.retry_interval, default 1 s) and without it, on a
# throwaway cluster: Redis stopped (connection refused) and Redis hung
# (SIGSTOP, every call would wait command_timeout). Prints p50/p99/max over
# BENCH_CALLS (2000) calls; target: p99 under 1 ms with the breaker.
set -euo pipefail
cd "$(dirname "$0")/.."
calls=${BENCH_CALLS:-2000}

. sql_tests/lib.sh
rl_build_install
rl_cluster_start
psql -X -q -c 'CREATE EXTENSION rl_redis'

# One session: n calls under on_error = allow, each timed.
measure() {
	local label=$1 settings=$2 n=$3
	psql -X -q -At -v ON_ERROR_STOP=1 <<SQL
SET client_min_messages = error;
SET rl_redis.on_error = 'allow';
$settings
CREATE TEMP TABLE t (ms float8);
DO \$\$
DECLARE t0 timestamptz;
BEGIN
    FOR i IN 1..$n LOOP
        t0 := clock_timestamp();
        PERFORM rl_sliding_allow('bench:breaker', 100, 60000);
        INSERT INTO t VALUES (extract(epoch FROM clock_timestamp() - t0) * 1000);
    END LOOP;
END \$\$;
SELECT format('%-46s %6s calls  p50 %8s ms  p99 %8s ms  max %9s ms', '$label', count(*),
              round(percentile_cont(0.5) WITHIN GROUP (ORDER BY ms)::numeric, 3),
              round(percentile_cont(0.99) WITHIN GROUP (ORDER BY ms)::numeric, 3),
              round(max(ms)::numeric, 3))
  FROM t;
SQL
}

measure "Redis up (for reference)" "" "$calls"

redis_pid=$(cat "$RL_DIR/redis.pid")
kill -STOP "$redis_pid"
measure "Redis hung, breaker on (retry_interval 1s)" "SET rl_redis.command_timeout = 200;" "$calls"
measure "Redis hung, breaker off (retry_interval 0)" "SET rl_redis.command_timeout = 200; SET rl_redis.retry_interval = 0;" 10
kill -CONT "$redis_pid"

kill "$redis_pid"
sleep 0.5
measure "Redis stopped, breaker on (retry_interval 1s)" "" "$calls"
measure "Redis stopped, breaker off (retry_interval 0)" "SET rl_redis.retry_interval = 0;" "$calls"
echo "target: p99 < 1 ms with the breaker on ($(nproc) cores)"
