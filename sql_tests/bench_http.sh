#!/usr/bin/env bash
# The HTTP service (examples/http_service/server.py) under wrk, next to
# pgbench running the decision statement alone, on a throwaway cluster.
#
#   1 connection, keep-alive:  POST fixed-window, limit 10^9 (every answer a 200)
#                              vs. pgbench -c 1 on rl_fixed
#   16 connections:            POST sliding-window on ONE identity, limit 1000
#                              vs. pgbench -c 16 on rl_sliding
#
# Targets (issue 12): p50 <= 1 ms with 1 connection; >= 3000 requests/s with
# 16, of which exactly `limit` are 200 (counted by wrk, by the service's
# access log and in Redis). Exits 1 when one is missed.
#
# BENCH_SECONDS (10) per run, BENCH_WORKERS (nproc) worker processes. The
# service runs as it would in production: its own role with the README's
# GRANTs, access log on (to a file), default limits.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${BENCH_SECONDS:-10}
workers=${BENCH_WORKERS:-$(nproc)}
limit=1000

if ! command -v wrk >/dev/null; then
	sudo=
	[ "$(id -u)" = 0 ] || sudo=sudo
	$sudo apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq wrk >/dev/null
fi

. sql_tests/lib.sh
rl_build_install
rl_cluster_start
psql -X -q -v ON_ERROR_STOP=1 <<'SQL'
CREATE EXTENSION rl_redis;
CREATE ROLE ratelimiter LOGIN;
GRANT EXECUTE ON FUNCTION
    rl_fixed(text, integer, bigint, integer),
    rl_sliding(text, integer, bigint, integer)
  TO ratelimiter;
SQL

run=$(date +%s)-$$
out=$RL_DIR/bench
mkdir -p "$out"
chmod 777 "$out"

# --- pgbench: the statement the service prepares, with literal arguments
# (pgbench reads ":name" as a variable: no colons in the identities)
pg_stmt() { # function identity limit
	echo "SELECT r.allowed, r.lim, r.remaining, r.reset_ms, r.retry_after_ms, CAST(rl_headers(r) AS text) FROM $1('$2', $3, 3600000, 1) AS r;"
}
pgbench_run() { # label clients function identity limit
	local dir=$out/pgbench_$2
	mkdir -p "$dir" && chmod 777 "$dir"
	pg_stmt "$3" "$4" "$5" >"$dir/stmt.sql"
	(cd "$dir" && pgbench -n -U ratelimiter -M prepared -f stmt.sql -c "$2" -j "$(($2 < 2 ? 1 : 2))" \
		-T "$seconds" -l >"$dir/out.txt" 2>&1) || { cat "$dir/out.txt" >&2; exit 1; }
	# per-transaction latencies (us) from the logs: p50, p99
	local tps pct
	tps=$(awk '/^tps/ {printf "%d", $3}' "$dir/out.txt")
	pct=$(cat "$dir"/pgbench_log.* | awk '{print $3}' | sort -n |
		awk '{v[NR]=$1} END {printf "%.3f %.3f", v[int(NR*0.5)]/1000, v[int(NR*0.99)]/1000}')
	printf '  %-44s %10s %9s %9s\n' "$1" "$tps" ${pct}
}

# --- the service
log=$out/http_service.log
/usr/bin/python3 examples/http_service/server.py --dsn "user=ratelimiter" --port 0 \
	--workers "$workers" >"$out/stdout" 2>"$log" &
svc=$!
trap 'kill -TERM $svc 2>/dev/null; wait $svc 2>/dev/null; rl_cluster_stop' EXIT
for _ in $(seq 100); do
	grep -q '^listening on' "$out/stdout" && break
	sleep 0.1
done
url=$(sed -n 's/^listening on //p' "$out/stdout")
[ -n "$url" ] || { cat "$log" >&2; exit 1; }

cat >"$out/post.lua" <<'EOF'
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = os.getenv("BODY")
EOF
wrk_run() { # label connections endpoint body -> prints a row; leaves wrk's output in $out/wrk_<connections>
	local f=$out/wrk_$2
	BODY=$4 wrk -t "$(($2 < 2 ? 1 : 2))" -c "$2" -d "${seconds}s" --latency -s "$out/post.lua" "$url$3" >"$f"
	local rps p50 p99
	rps=$(awk '/^Requests\/sec/ {printf "%d", $2}' "$f")
	p50=$(awk '$1 == "50%" {print $2}' "$f" | ms)
	p99=$(awk '$1 == "99%" {print $2}' "$f" | ms)
	printf '  %-44s %10s %9s %9s\n' "$1" "$rps" "$p50" "$p99"
}
ms() { # wrk's 512.00us / 1.20ms / 1.01s -> ms
	sed -E 's/us$/ 0.001/; s/ms$/ 1/; s/s$/ 1000/' | awk '{printf "%.3f", $1 * $2}'
}

# warm-up: sessions opened and statements prepared in every worker
BODY='{"identity": "bench-warmup-'$run'", "limit": 1000000000, "windowSeconds": 3600}' \
	wrk -t 2 -c 16 -d 2s -s "$out/post.lua" "$url/api/v1/rate-limiter/fixed-window" >/dev/null

echo "HTTP service ($workers workers, $(nproc) cores) vs. the decision statement alone; ${seconds} s a run"
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
printf '  %-44s %10s %9s %9s\n' "" "requests/s" "p50 ms" "p99 ms"
echo "1 connection, keep-alive"
pgbench_run "pgbench -c 1, rl_fixed" 1 rl_fixed "bench-pg1-$run" 1000000000
wrk_run "wrk -c 1, POST fixed-window" 1 /api/v1/rate-limiter/fixed-window \
	'{"identity": "bench-c1-'$run'", "limit": 1000000000, "windowSeconds": 3600}'
echo "16 connections, one identity, limit $limit"
pgbench_run "pgbench -c 16, rl_sliding" 16 rl_sliding "bench-pg16-$run" "$limit"
before=$(wc -l <"$log")
identity=bench-c16-$run
wrk_run "wrk -c 16, POST sliding-window" 16 /api/v1/rate-limiter/sliding-window \
	'{"identity": "'"$identity"'", "limit": '$limit', "windowSeconds": 3600}'
sleep 1 # answers to requests in flight when wrk stopped reach the log

# exactly `limit` allowed: as wrk counted, as the service logged, as Redis holds
total=$(awk '/requests in/ {print $1}' "$out/wrk_16")
non2xx=$(awk '/Non-2xx/ {print $5}' "$out/wrk_16")
errors=$(awk '/Socket errors/ {print}' "$out/wrk_16")
wrk_200=$((total - ${non2xx:-0}))
log_200=$(tail -n +"$((before + 1))" "$log" | grep -c '" 200 ' || true)
log_all=$(tail -n +"$((before + 1))" "$log" | grep -c '" [0-9][0-9][0-9] ' || true)
redis_n=$(redis-cli -p "$RL_REDIS_PORT" ZCARD "rl:sliding:{$identity}:$limit/3600000")
echo "16 connections: $total answers counted by wrk, $wrk_200 of them 200; the service logged $log_all answers," \
	"$log_200 of them 200; Redis holds $redis_n; ${errors:-no socket errors}"

p50=$(awk '$1 == "50%" {print $2}' "$out/wrk_1" | ms)
rps=$(awk '/^Requests\/sec/ {printf "%d", $2}' "$out/wrk_16")
fail=0
check() { # description condition
	if eval "$2"; then echo "  met:    $1"; else echo "  MISSED: $1"; fail=1; fi
}
echo "targets"
check "1 connection p50 $p50 ms <= 1 ms" "awk 'BEGIN {exit !($p50 <= 1)}'"
check "16 connections $rps requests/s >= 3000" "[ $rps -ge 3000 ]"
check "16 connections exactly $limit 200s (wrk $wrk_200, log $log_200, Redis $redis_n)" \
	"[ $wrk_200 -eq $limit ] && [ $log_200 -eq $limit ] && [ $redis_n -eq $limit ]"
check "no socket errors" "[ -z '$errors' ]"
check "no traceback in the service's log" "! grep -q Traceback '$log'"
exit $fail
