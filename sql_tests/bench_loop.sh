#!/usr/bin/env bash
# The cost of one call, this build against release 1.5: a server-side loop
# (DO ... PERFORM rl_fixed_allow(...)) of BENCH_CALLS calls (default 60000,
# 5000 identities, never denied), timed on each build in turn for
# BENCH_ROUNDS rounds (default 6), with rl_redis.transport = backend, then
# shared. Steadier than pgbench's 1-client runs: no client round trip, one
# transaction. A measurement, not a test: it prints the times and the
# per-round quotients.
#
# Needs 1.5 installed beside this build as rl_redis_base, which `make bench`
# (sql_tests/bench.sh) leaves installed; this build is installed as it is
# (run `make install` first). Each build gets a throwaway PostgreSQL cluster
# and Redis of its own (sql_tests/lib.sh), both running throughout.
set -uo pipefail
cd "$(dirname "$0")/.."

CALLS=${BENCH_CALLS:-60000}
ROUNDS=${BENCH_ROUNDS:-6}
[[ $CALLS =~ ^[1-9][0-9]*$ ]] || { echo "bench_loop: BENCH_CALLS must be a positive integer" >&2; exit 1; }
[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || { echo "bench_loop: BENCH_ROUNDS must be a positive integer" >&2; exit 1; }
[ -f "$(pg_config --sharedir)/extension/rl_redis_base.control" ] ||
	{ echo "bench_loop: rl_redis_base (release 1.5) is not installed: run make bench first" >&2; exit 1; }

. sql_tests/lib.sh
builds=(rl_redis rl_redis_base)
dirs=()
declare -A port
stop_all() {
	local d
	for d in "${dirs[@]}"; do
		RL_DIR=$d rl_cluster_stop
	done
}
for b in "${builds[@]}"; do
	RL_PRELOAD=$b rl_cluster_start || exit 1
	dirs+=("$RL_DIR")
	trap stop_all EXIT # rl_cluster_start's trap stops the last cluster only
	port[$b]=$RL_PGPORT
	psql -X -q -v ON_ERROR_STOP=1 -c "CREATE EXTENSION $b" || exit 1
done

# milliseconds of one loop of CALLS calls on build $1 with transport $2
loop_ms() {
	psql -X -q -h 127.0.0.1 -p "${port[$1]}" -U postgres -c "SET rl_redis.transport = $2" \
		-c '\timing on' \
		-c "DO \$\$ BEGIN FOR i IN 1..$CALLS LOOP PERFORM rl_fixed_allow('loop:' || (i % 5000), 100000000, 60000); END LOOP; END \$\$" \
		postgres | awk '/^Time/ { print $2 }'
}

echo "== $CALLS calls of rl_fixed_allow in one DO loop, ms; $ROUNDS rounds, each build in turn"
for mode in backend shared; do
	now=() base=() q=()
	for ((r = 0; r < ROUNDS; r++)); do
		now[r]=$(loop_ms rl_redis "$mode")
		base[r]=$(loop_ms rl_redis_base "$mode")
		q[r]=$(awk -v a="${now[r]}" -v b="${base[r]}" 'BEGIN { printf "%.3f", a / b }')
	done
	median() { printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
	printf '%-8s current %s ms (%s)\n' "$mode" "$(median "${now[@]}")" "${now[*]}"
	printf '%-8s 1.5     %s ms (%s)\n' "$mode" "$(median "${base[@]}")" "${base[*]}"
	printf '%-8s current / 1.5: median %s (rounds: %s)\n' "$mode" "$(median "${q[@]}")" "${q[*]}"
done
