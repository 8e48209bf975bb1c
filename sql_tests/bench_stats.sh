#!/usr/bin/env bash
# The cost of the statistics (rl_redis.stats, 1.4). A measurement, not a
# test: it prints figures and exits 0 whether or not the target is met;
# non-zero only when something could not be started or run.
#
# Starts a throwaway Redis and PostgreSQL on free loopback ports
# (sql_tests/lib.sh; the cluster preloads the library, so the counters are
# in shared memory) and compares one decision with the statistics on and
# off, in the same cluster:
#
#   overhead(c) = 1 - TPS(stats on, c clients) / TPS(stats off, c clients)
#                 target <= 2 %, at 1 and at 8 clients
#
# Workload: pgbench -n -M prepared -T $BENCH_SECONDS over TCP loopback, the
# script
#     \set n random(1, 100000)
#     SELECT rl_fixed_allow('bench:' || :n, 100000, 60000);
# (a limit that is never reached); "off" runs set rl_redis.stats = off for
# their sessions through PGOPTIONS ('-c rl_redis.stats=off'), "on" runs
# leave the default (on). 8-client runs use -j 2.
#
# The rounds interleave on and off: every round runs, for 1 and then for 8
# clients, both settings one after the other, on first in odd rounds and off
# first in even ones, so that a drift of the machine does not favour one
# side. Every run starts from an empty Redis (FLUSHALL). The table shows the
# medians of the rounds; the overhead is computed from the medians, and per
# round from that round's pair.
#
# It does not build: it uses the installed library (which must be 1.4 or
# later: rl_redis.stats). BENCH_BUILD=1 first installs missing packages,
# builds and installs (rl_build_install), as sql_tests/bench.sh does.
#
# Environment:
#   BENCH_SECONDS  length of every measured run (default 10)
#   BENCH_ROUNDS   rounds of all runs, interleaved; the table shows medians
#                  (default 3)
#   BENCH_BUILD    1: build and install first (default 0)
set -uo pipefail
cd "$(dirname "$0")/.."

BENCH_SECONDS=${BENCH_SECONDS:-10}
BENCH_ROUNDS=${BENCH_ROUNDS:-3}
BENCH_BUILD=${BENCH_BUILD:-0}
IDENTITIES=100000
WARMUP_SECONDS=2
TARGET_PCT=2
CLIENTS=(1 8)

die() {
	echo "bench_stats: $*" >&2
	exit 1
}

[[ $BENCH_SECONDS =~ ^[1-9][0-9]*$ ]] || die "BENCH_SECONDS must be a positive integer"
[[ $BENCH_ROUNDS =~ ^[1-9][0-9]*$ ]] || die "BENCH_ROUNDS must be a positive integer"

. sql_tests/lib.sh
if [ "$BENCH_BUILD" = 1 ]; then
	rl_build_install || die "could not install the packages, build or install"
fi
for tool in pg_config pgbench psql redis-server redis-cli /usr/bin/python3; do
	command -v "$tool" >/dev/null || die "$tool not found"
done
installed_so="$(pg_config --pkglibdir)/rl_redis.so"
[ -f "$installed_so" ] || die "$installed_so is not installed (make install, or BENCH_BUILD=1)"
so_sum=$(md5sum <"$installed_so")

rl_cluster_start || die "could not start Redis and PostgreSQL"

rcli() {
	redis-cli -p "$RL_REDIS_PORT" "$@"
}

# psql as the superuser, unaligned, without the PGOPTIONS of the "off" runs
q() {
	PGOPTIONS= psql -X -q -A -t -v ON_ERROR_STOP=1 "$@"
}

q -c 'CREATE EXTENSION rl_redis' || die "CREATE EXTENSION failed"
q -c 'SHOW rl_redis.stats' >/dev/null 2>&1 ||
	die "the installed rl_redis has no rl_redis.stats (1.4 or later needed)"
[ "$(q -c 'SELECT rl_redis_stats_scope()')" = server ] ||
	die "the statistics are not in shared memory (is rl_redis preloaded?)"

work="$RL_DIR/bench_stats"
mkdir -p "$work" || die "cannot create $work"
cat >"$work/fixed.sql" <<-EOF
	\set n random(1, $IDENTITIES)
	SELECT rl_fixed_allow('bench:' || :n, 100000, 60000);
EOF

# calls counted in the explicit fixed-window row of this database
counted() {
	q -c "SELECT coalesce(sum(calls), 0) FROM rl_redis_stats
	       WHERE dbname = current_database() AND policy IS NULL AND algorithm = 'fixed'"
}

# PGOPTIONS of a mode (on, off)
opts_of() {
	[ "$1" = off ] && echo "-c rl_redis.stats=off" || echo ""
}

# the settings work: a call with stats off is not counted, one with it on is
before=$(counted) || die "cannot read rl_redis_stats"
PGOPTIONS="$(opts_of off)" psql -X -q -A -t -v ON_ERROR_STOP=1 \
	-c "SELECT rl_fixed_allow('bench:probe', 100000, 60000)" >/dev/null || die "a call with stats off failed"
[ "$(counted)" = "$before" ] || die "PGOPTIONS='$(opts_of off)' did not turn the statistics off"
q -c "SELECT rl_fixed_allow('bench:probe', 100000, 60000)" >/dev/null || die "a call with stats on failed"
[ "$(counted)" = $((before + 1)) ] || die "a call with the statistics on was not counted"

flush() {
	[ "$(rcli FLUSHALL)" = OK ] || die "FLUSHALL failed"
}

# run_pgbench MODE CLIENTS SECONDS: prints "TPS transactions" (TPS without
# the initial connection time, transactions processed)
run_pgbench() {
	local mode=$1 clients=$2 seconds=$3 threads=1 out tps failed n
	[ "$clients" -gt 1 ] && threads=2
	out=$(PGOPTIONS="$(opts_of "$mode")" pgbench -n -M prepared -T "$seconds" \
		-c "$clients" -j "$threads" -f "$work/fixed.sql" 2>&1) ||
		{ echo "$out" >&2; die "pgbench (stats $mode) -c $clients failed"; }
	failed=$(sed -n 's/^number of failed transactions: \([0-9]*\).*/\1/p' <<<"$out")
	tps=$(sed -n 's/^tps = \([0-9.]*\) (without initial connection time)$/\1/p' <<<"$out")
	n=$(sed -n 's/^number of transactions actually processed: \([0-9]*\).*/\1/p' <<<"$out")
	if [ -z "$tps" ] || [ -z "$n" ] || [ "${failed:-0}" != 0 ]; then
		echo "$out" >&2
		die "pgbench (stats $mode) -c $clients: no TPS or failed transactions"
	fi
	echo "$tps $n"
}

# median of the arguments
median() {
	printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END { if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}

# calc EXPR: evaluates an awk expression
calc() {
	awk "BEGIN { printf \"%.6f\", $1 }"
}

# ---------------------------------------------------------------------------
# machine

start_s=$SECONDS
cpu_model=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)
pg_version=$(q -c 'SHOW server_version')
ext_version=$(q -c "SELECT extversion FROM pg_extension WHERE extname = 'rl_redis'")
redis_version=$(rcli INFO server | tr -d '\r' | sed -n 's/^redis_version://p')
echo "== rl_redis statistics overhead"
echo "machine     : $(nproc) CPUs${cpu_model:+ ($cpu_model)}, $(uname -sr)"
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg) (before the runs)"
echo "PostgreSQL  : $pg_version, pgbench $(pgbench --version | awk '{ print $3 }'), rl_redis $ext_version (preloaded)"
echo "Redis       : $redis_version"
echo "runs        : ${BENCH_SECONDS} s each, $BENCH_ROUNDS round(s), on/off interleaved, loopback TCP,"
echo "              $IDENTITIES identities, pgbench -n -M prepared, SELECT rl_fixed_allow('bench:' || :n, 100000, 60000)"
echo "stats off   : PGOPTIONS='$(opts_of off)'"

# ---------------------------------------------------------------------------
# warm-up

echo
echo "warm-up (${WARMUP_SECONDS} s per run) ..."
flush
for c in "${CLIENTS[@]}"; do
	for mode in on off; do
		run_pgbench "$mode" "$c" "$WARMUP_SECONDS" >/dev/null
		flush
	done
done

# ---------------------------------------------------------------------------
# measured rounds

q -c 'SELECT rl_redis_stats_reset()' >/dev/null || die "rl_redis_stats_reset() failed"
declare -A tps
on_transactions=0
for ((r = 1; r <= BENCH_ROUNDS; r++)); do
	if ((r % 2)); then order=(on off); else order=(off on); fi
	echo "round $r of $BENCH_ROUNDS (${order[0]} first) ..."
	for c in "${CLIENTS[@]}"; do
		for mode in "${order[@]}"; do
			read -r t n < <(run_pgbench "$mode" "$c" "$BENCH_SECONDS")
			[ -n "${t:-}" ] || exit 1
			tps[$mode.$c.$r]=$t
			[ "$mode" = on ] && on_transactions=$((on_transactions + n))
			flush
		done
	done
done
counted_calls=$(counted)

# ---------------------------------------------------------------------------
# figures

values() {
	local r
	for ((r = 1; r <= BENCH_ROUNDS; r++)); do
		echo "${tps[$1.$r]}"
	done
}

echo
printf '%-9s %12s %12s %10s %8s  %-4s  %s\n' "clients" "TPS on" "TPS off" "overhead" "target" "met" "per round (1 - on/off)"
for c in "${CLIENTS[@]}"; do
	on=$(median $(values "on.$c"))
	off=$(median $(values "off.$c"))
	overhead=$(calc "100 * (1 - $on / $off)")
	met=$(awk -v v="$overhead" -v t="$TARGET_PCT" 'BEGIN { print (v <= t) ? "yes" : "no" }')
	per=
	for ((r = 1; r <= BENCH_ROUNDS; r++)); do
		per+="$(printf '%+.2f%%' "$(calc "100 * (1 - ${tps[on.$c.$r]} / ${tps[off.$c.$r]})")") "
	done
	printf '%-9s %12.1f %12.1f %9.2f%% %8s  %-4s  %s\n' "$c" "$on" "$off" "$overhead" "<= ${TARGET_PCT} %" "$met" "${per% }"
done
echo "(TPS: medians of $BENCH_ROUNDS round(s); overhead = 1 - median on / median off; negative: on was faster)"
echo "calls counted by rl_redis_stats during the measured runs: $counted_calls" \
	"(transactions of the \"on\" runs: $on_transactions; \"off\" runs are not counted)"
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg) (after the runs)"
echo "runtime     : $((SECONDS - start_s)) s"
if [ "$(md5sum <"$installed_so")" != "$so_sum" ]; then
	echo "WARNING: $installed_so was replaced during the run (another make install?);"
	echo "         backends started after that ran the other build, so the figures may mix builds."
fi
exit 0
