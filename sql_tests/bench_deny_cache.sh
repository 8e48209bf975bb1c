#!/usr/bin/env bash
# The local cache of denials (rl_redis.deny_cache, 1.5). A measurement, not
# a test: it prints figures and exits 0 whether or not the target is met;
# non-zero only when something could not be started or run.
#
# On a throwaway Redis and PostgreSQL (sql_tests/lib.sh; the cluster
# preloads the library, which the cache needs), 8 clients call
#     SELECT rl_allow('hot', 'abuser');
# on a policy whose limit that identity used up (fixed window, 10 per hour),
# so that every call is denied, and the figure is set against SELECT 1:
#
#   H = TPS(hot denied identity, deny_cache on, 8 clients)
#       / TPS(SELECT 1, 8 clients)              target >= 0.80
#
# The same with the cache off shows what it saves, and the Redis calls each
# run made (INFO commandstats) show that the cached runs asked Redis once
# per session at most. pgbench -n -M prepared -j 2 over TCP loopback;
# rounds interleaved, medians shown. It uses the installed library (1.5 or
# later) and does not build.
#
# Environment: BENCH_SECONDS (default 10), BENCH_ROUNDS (default 3)
set -uo pipefail
cd "$(dirname "$0")/.."

BENCH_SECONDS=${BENCH_SECONDS:-10}
BENCH_ROUNDS=${BENCH_ROUNDS:-3}
CLIENTS=8
TARGET=0.80

die() {
	echo "bench_deny_cache: $*" >&2
	exit 1
}

[[ $BENCH_SECONDS =~ ^[1-9][0-9]*$ ]] || die "BENCH_SECONDS must be a positive integer"
[[ $BENCH_ROUNDS =~ ^[1-9][0-9]*$ ]] || die "BENCH_ROUNDS must be a positive integer"

. sql_tests/lib.sh
for tool in pg_config pgbench psql redis-server redis-cli; do
	command -v "$tool" >/dev/null || die "$tool not found"
done
installed_so="$(pg_config --pkglibdir)/rl_redis.so"
[ -f "$installed_so" ] || die "$installed_so is not installed (make install)"

rl_cluster_start || die "could not start Redis and PostgreSQL"
trap rl_cluster_stop EXIT

rcli() {
	redis-cli -p "$RL_REDIS_PORT" "$@"
}
q() {
	PGOPTIONS= psql -X -q -A -t -v ON_ERROR_STOP=1 "$@"
}

q -c 'CREATE EXTENSION rl_redis' || die "CREATE EXTENSION failed"
q -c 'SHOW rl_redis.deny_cache' >/dev/null 2>&1 ||
	die "the installed rl_redis has no rl_redis.deny_cache (1.5 or later needed)"
q -c "INSERT INTO rl_policy (name, algorithm, lim, window_ms) VALUES ('hot', 'fixed', 10, 3600000)" ||
	die "cannot create the policy"
q -c "SELECT count(*) FROM generate_series(1, 10) g WHERE rl_allow('hot', 'abuser')" |
	grep -qx 10 || die "could not use up the limit of 'abuser'"
[ "$(q -c "SELECT rl_allow('hot', 'abuser')")" = f ] || die "'abuser' is not denied"

work="$RL_DIR/bench_deny_cache"
mkdir -p "$work" || die "cannot create $work"
echo 'SELECT 1;' >"$work/select1.sql"
echo "SELECT rl_allow('hot', 'abuser');" >"$work/hot.sql"

# script_calls: the script calls (EVAL, EVALSHA, FCALL) Redis has run so far
script_calls() {
	rcli INFO commandstats | tr -d '\r' |
		awk -F'[=,:]' '/^cmdstat_(eval|evalsha|fcall):/ { n += $3 } END { print n + 0 }'
}

# run WORKLOAD CACHE(on|off): prints "TPS redis_calls"
run() {
	local before out tps
	before=$(script_calls)
	out=$(PGOPTIONS="-c rl_redis.deny_cache=$2" pgbench -n -M prepared -T "$BENCH_SECONDS" \
		-c "$CLIENTS" -j 2 -f "$work/$1.sql" 2>&1) || { echo "$out" >&2; die "pgbench $1 failed"; }
	tps=$(sed -n 's/^tps = \([0-9.]*\) (without initial connection time)$/\1/p' <<<"$out")
	[ -n "$tps" ] || { echo "$out" >&2; die "pgbench $1 printed no TPS"; }
	echo "$tps $(($(script_calls) - before))"
}

median() {
	printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END { if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}

echo "== rl_redis denial cache benchmark"
echo "machine     : $(nproc) CPUs, $(uname -sr); load average $(cut -d' ' -f1-3 /proc/loadavg)"
echo "runs        : ${BENCH_SECONDS} s each, $BENCH_ROUNDS round(s), $CLIENTS clients, pgbench -n -M prepared -j 2"
declare -a s1 on off on_calls off_calls ratio
for ((r = 1; r <= BENCH_ROUNDS; r++)); do
	echo "round $r of $BENCH_ROUNDS ..."
	read -r t _ < <(run select1 off) || exit 1
	s1+=("$t")
	read -r t n < <(run hot on) || exit 1
	on+=("$t")
	on_calls+=("$n")
	read -r t n < <(run hot off) || exit 1
	off+=("$t")
	off_calls+=("$n")
	ratio+=("$(awk -v a="${on[-1]}" -v b="${s1[-1]}" 'BEGIN { printf "%.3f", a / b }')")
done
printf '\n%-46s %12s %14s\n' "" "TPS (median)" "Redis calls"
printf '%-46s %12.0f %14s\n' "SELECT 1" "$(median "${s1[@]}")" "-"
printf '%-46s %12.0f %14s\n' "rl_allow of a denied identity, deny_cache on" "$(median "${on[@]}")" "${on_calls[*]}"
printf '%-46s %12.0f %14s\n' "the same, deny_cache off" "$(median "${off[@]}")" "${off_calls[*]}"
v=$(median "${ratio[@]}")
printf '\n%-22s %8s %8s  %-8s %s\n' "ratio" "value" "target" "verdict" "per round"
printf '%-22s %8.3f %8s  %-8s %s\n' "H (cache on / SELECT 1)" "$v" ">= $TARGET" \
	"$(awk -v v="$v" -v t="$TARGET" 'BEGIN { print (v >= t) ? "met" : "MISSED" }')" "${ratio[*]}"
echo "(Redis calls per run: with the cache, at most one per session and denial period)"
exit 0
