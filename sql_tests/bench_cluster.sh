#!/usr/bin/env bash
# The Redis Cluster benchmark (`make bench`, after bench.sh). A measurement,
# not a test: it prints figures and exits 0 whether or not the targets are
# met; non-zero only when something could not be built, started or run.
#
# Installs missing packages, builds and installs the extension, starts a
# throwaway Redis and PostgreSQL on free loopback ports (sql_tests/lib.sh),
# and, in the same temporary folder, two Redis Clusters on free loopback
# ports: one of 3 masters (redis-cli --cluster create, no replicas) and one
# of a single master that owns all 16384 slots (CLUSTER ADDSLOTSRANGE). It
# then compares the same call, SELECT rl_fixed_allow('bench:' || n, 100000,
# 60000) with n random in 1..100000 (a limit never reached), made in three
# setups:
#
#   standalone  rl_redis.mode = standalone, the one Redis of lib.sh
#   cluster1    rl_redis.mode = cluster, rl_redis.nodes = the lone master
#   cluster3    rl_redis.mode = cluster, rl_redis.nodes = one of the 3
#               masters (the other two are learnt from CLUSTER SLOTS)
#
#   L1 = latency(cluster3, 1 client) / latency(standalone, 1 client)
#        target <= 1.05
#        (cluster1 at 1 client is shown too, without a target: it tells
#        what cluster mode costs apart from the number of masters)
#   T8 = decisions/s at 8 clients of standalone, cluster1 and cluster3, and
#        the ratios cluster1/standalone and cluster3/standalone (no target:
#        on a small machine the 3 masters share its CPUs with PostgreSQL)
#   C8 = connections per backend: while 8 pgbench clients run in cluster3,
#        the connections each master holds from them (CLIENT LIST, and per
#        backend process with ss when it is installed) and the connections
#        each master accepted during the run (INFO stats
#        total_connections_received, less this script's own redis-cli
#        calls); target 1 per master, 3 per backend
#
# Every session is pointed at its setup with PGOPTIONS ("-c rl_redis.mode=...
# -c rl_redis.nodes=..."): the settings are superuser-only and pgbench
# connects as the superuser postgres. Before measuring, each setup is
# checked: SHOW gives the mode, and a call writes its key to that setup's
# Redis and nowhere else. After every run, the script calls (FCALL, EVAL)
# counted by INFO commandstats on that setup's servers must be at least the
# transactions pgbench made, and the other servers must have seen none.
#
# PostgreSQL side: pgbench -n -M prepared -T $BENCH_SECONDS over TCP
# loopback (-j 2 with 8 clients); latency = 1000 / TPS of the 1-client run.
# Runs are interleaved within a round (the order alternates between rounds)
# and every run starts from empty servers (FLUSHALL, CONFIG RESETSTAT).
#
# Environment:
#   BENCH_SECONDS  length of every measured run (default 10)
#   BENCH_ROUNDS   rounds of all runs, interleaved; the table shows medians
#                  (default 3)
set -uo pipefail
cd "$(dirname "$0")/.."

BENCH_SECONDS=${BENCH_SECONDS:-10}
BENCH_ROUNDS=${BENCH_ROUNDS:-3}
IDENTITIES=100000
WARMUP_SECONDS=2
CONN_SECONDS=6 # the run during which connections are counted
SETUPS=(standalone cluster1 cluster3)

die() {
	echo "bench_cluster: $*" >&2
	exit 1
}

[[ $BENCH_SECONDS =~ ^[1-9][0-9]*$ ]] || die "BENCH_SECONDS must be a positive integer"
[[ $BENCH_ROUNDS =~ ^[1-9][0-9]*$ ]] || die "BENCH_ROUNDS must be a positive integer"

. sql_tests/lib.sh
rl_build_install || die "could not install the packages, build or install"
installed_so="$(pg_config --pkglibdir)/rl_redis.so"
so_sum=$(md5sum <"$installed_so")

for tool in pgbench redis-server redis-cli psql timeout /usr/bin/python3; do
	command -v "$tool" >/dev/null || die "$tool not found"
done
have_ss=0
command -v ss >/dev/null && have_ss=1

rl_cluster_start || die "could not start Redis and PostgreSQL"

# ---------------------------------------------------------------------------
# the Redis Clusters, in $RL_DIR; stopped with the rest on exit

bg_pid= # a pgbench running in the background, if any

stop_all() {
	local f pid i
	[ -n "$bg_pid" ] && kill "$bg_pid" 2>/dev/null
	for f in "${RL_DIR:-/nonexistent}"/node_*/redis.pid; do
		[ -f "$f" ] || continue
		pid=$(cat "$f")
		kill "$pid" 2>/dev/null || continue
		for i in $(seq 1 50); do
			kill -0 "$pid" 2>/dev/null || break
			sleep 0.1
		done
	done
	rl_cluster_stop
}
trap stop_all EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# rport PORT ARGS...: redis-cli on a port, bounded in time
rport() {
	local port=$1
	shift
	timeout -k 5 20 redis-cli -p "$port" "$@"
}

# start_node NAME PORT: a cluster-enabled redis-server; the cluster bus gets
# a free port of its own (port + 10000 may be taken or above 65535)
start_node() {
	local name=$1 port=$2 dir="$RL_DIR/node_$1"
	mkdir -p "$dir" || return 1
	redis-server --port "$port" --bind 127.0.0.1 \
		--cluster-enabled yes --cluster-config-file "$dir/nodes.conf" \
		--cluster-node-timeout 5000 --cluster-port "$(rl_free_port)" \
		--save '' --appendonly no --dir "$dir" --logfile "$dir/redis.log" \
		--pidfile "$dir/redis.pid" --daemonize yes >/dev/null || return 1
	rl_wait_redis "$port"
}

# cluster_ok NODES PORT...: every port says cluster_state:ok, all slots
# assigned and ok, and knows NODES nodes
cluster_ok() {
	local n=$1 port info
	shift
	for port in "$@"; do
		info=$(rport "$port" CLUSTER INFO 2>/dev/null | tr -d '\r') || return 1
		grep -qx 'cluster_state:ok' <<<"$info" &&
			grep -qx 'cluster_slots_assigned:16384' <<<"$info" &&
			grep -qx 'cluster_slots_ok:16384' <<<"$info" &&
			grep -qx "cluster_known_nodes:$n" <<<"$info" || return 1
	done
}

# wait_cluster_ok NODES PORT...: waits for cluster_ok, 90 s at most
wait_cluster_ok() {
	local i
	for i in $(seq 1 450); do
		cluster_ok "$@" && return 0
		sleep 0.2
	done
	return 1
}

# free, distinct ports for the 4 nodes
ports=("$RL_REDIS_PORT" "$RL_PGPORT")
new_port() {
	local p i
	for i in $(seq 1 20); do
		p=$(rl_free_port) || return 1
		[[ " ${ports[*]} " == *" $p "* ]] || { ports+=("$p"); echo "$p"; return 0; }
	done
	return 1
}
M1=$(new_port) && ports+=("$M1") && M2=$(new_port) && ports+=("$M2") &&
	M3=$(new_port) && ports+=("$M3") && C1=$(new_port) && ports+=("$C1") ||
	die "could not find free ports"
MASTERS=("$M1" "$M2" "$M3")
ALL_PORTS=("$RL_REDIS_PORT" "$C1" "${MASTERS[@]}")

echo "starting a Redis Cluster of 3 masters ($M1 $M2 $M3) and one of 1 master ($C1) ..."
for p in "${MASTERS[@]}"; do
	start_node "$p" "$p" || die "could not start the cluster node on port $p"
done
start_node "$C1" "$C1" || die "could not start the cluster node on port $C1"

timeout -k 5 120 redis-cli --cluster create \
	"127.0.0.1:$M1" "127.0.0.1:$M2" "127.0.0.1:$M3" --cluster-yes \
	>"$RL_DIR/cluster_create.log" 2>&1 ||
	{ cat "$RL_DIR/cluster_create.log" >&2; die "redis-cli --cluster create failed"; }
[ "$(rport "$C1" CLUSTER ADDSLOTSRANGE 0 16383)" = OK ] ||
	die "CLUSTER ADDSLOTSRANGE 0 16383 on port $C1 failed"
wait_cluster_ok 3 "${MASTERS[@]}" || die "the 3-master cluster did not reach cluster_state:ok"
wait_cluster_ok 1 "$C1" || die "the 1-master cluster did not reach cluster_state:ok"

# ---------------------------------------------------------------------------
# the setups and their servers

base_pgoptions=${PGOPTIONS:-}
declare -A setup_opts setup_ports setup_mode
setup_opts[standalone]="-c rl_redis.mode=standalone"
setup_opts[cluster1]="-c rl_redis.mode=cluster -c rl_redis.nodes=127.0.0.1:$C1"
setup_opts[cluster3]="-c rl_redis.mode=cluster -c rl_redis.nodes=127.0.0.1:$M1"
setup_ports[standalone]=$RL_REDIS_PORT
setup_ports[cluster1]=$C1
setup_ports[cluster3]="${MASTERS[*]}"
setup_mode=([standalone]=standalone [cluster1]=cluster [cluster3]=cluster)

# pgoptions SETUP: the PGOPTIONS of the setup's sessions (on_error = error,
# so that a call Redis did not answer fails and cannot pass unnoticed)
pgoptions() {
	echo "${base_pgoptions:+$base_pgoptions }-c rl_redis.on_error=error ${setup_opts[$1]}"
}

psql_setup() {
	local setup=$1
	shift
	PGOPTIONS=$(pgoptions "$setup") PGCONNECT_TIMEOUT=10 \
		timeout -k 5 60 psql -X -q -A -t -v ON_ERROR_STOP=1 "$@"
}

psql_setup standalone -c 'CREATE EXTENSION rl_redis' || die "CREATE EXTENSION failed"

work="$RL_DIR/bench"
mkdir -p "$work" || die "cannot create $work"
cat >"$work/fixed.sql" <<-EOF
	\set n random(1, $IDENTITIES)
	SELECT rl_fixed_allow('bench:' || :n, 100000, 60000);
EOF

# reset: every server empty, its statistics reset
reset() {
	local p
	for p in "${ALL_PORTS[@]}"; do
		[ "$(rport "$p" FLUSHALL)" = OK ] && [ "$(rport "$p" CONFIG RESETSTAT)" = OK ] ||
			die "FLUSHALL or CONFIG RESETSTAT on port $p failed"
	done
}

# script_calls PORT: EVAL, EVALSHA and FCALL calls since the last CONFIG RESETSTAT
script_calls() {
	rport "$1" INFO commandstats | tr -d '\r' |
		awk -F'[:=,]' '/^cmdstat_(eval|evalsha|eval_ro|evalsha_ro|fcall|fcall_ro):/ { n += $3 } END { print n + 0 }'
}

# info_field PORT SECTION FIELD
info_field() {
	rport "$1" INFO "$2" | tr -d '\r' | sed -n "s/^$3://p"
}

# check_calls SETUP TRANSACTIONS: the setup's servers ran at least that many
# script calls, each of them some, and the other servers none; leaves the
# calls per server in calls[PORT]
declare -A calls
check_calls() {
	local setup=$1 want=$2 p total=0
	for p in "${ALL_PORTS[@]}"; do
		calls[$p]=$(script_calls "$p")
		[[ ${calls[$p]} =~ ^[0-9]+$ ]] || die "cannot read INFO commandstats of port $p"
		if [[ " ${setup_ports[$setup]} " == *" $p "* ]]; then
			[ "${calls[$p]}" -gt 0 ] || die "$setup: the server on port $p got no script call"
			total=$((total + calls[$p]))
		else
			[ "${calls[$p]}" = 0 ] || die "$setup: port $p, not one of its servers, got ${calls[$p]} script calls"
		fi
	done
	[ "$total" -ge "$want" ] || die "$setup: $want transactions but only $total script calls on its servers"
}

# check each setup: the settings reach the sessions, a call goes to its servers
reset
for setup in "${SETUPS[@]}"; do
	out=$(psql_setup "$setup" -c 'SHOW rl_redis.mode' -c 'SHOW rl_redis.nodes' \
		-c "SELECT rl_fixed_allow('bench:probe', 100000, 60000)") ||
		die "$setup: a session with PGOPTIONS='$(pgoptions "$setup")' failed"
	mapfile -t lines <<<"$out"
	[ "${lines[0]:-}" = "${setup_mode[$setup]}" ] ||
		die "$setup: SHOW rl_redis.mode gives '${lines[0]:-}', not ${setup_mode[$setup]}"
	[ "${lines[2]:-}" = t ] || die "$setup: rl_fixed_allow did not allow the probe (${lines[2]:-})"
	keys=0
	for p in "${ALL_PORTS[@]}"; do
		n=$(rport "$p" DBSIZE)
		if [[ " ${setup_ports[$setup]} " == *" $p "* ]]; then
			keys=$((keys + n))
		else
			[ "$n" = 0 ] || die "$setup: the probe wrote to port $p, not one of its servers"
		fi
	done
	[ "$keys" -ge 1 ] || die "$setup: the probe wrote no key to its servers"
	reset
done

# run_pgbench SETUP CLIENTS SECONDS: prints "TPS transactions" (TPS without
# the initial connection time)
run_pgbench() {
	local setup=$1 clients=$2 seconds=$3 threads=1 out tps n failed
	[ "$clients" -gt 1 ] && threads=2
	out=$(PGOPTIONS=$(pgoptions "$setup") PGCONNECT_TIMEOUT=10 \
		timeout -k 10 $((seconds + 120)) \
		pgbench -n -M prepared -T "$seconds" -c "$clients" -j "$threads" \
		-f "$work/fixed.sql" 2>&1) ||
		{ echo "$out" >&2; die "pgbench $setup -c $clients failed"; }
	failed=$(sed -n 's/^number of failed transactions: \([0-9]*\).*/\1/p' <<<"$out")
	n=$(sed -n 's/^number of transactions actually processed: \([0-9]*\).*/\1/p' <<<"$out")
	tps=$(sed -n 's/^tps = \([0-9.]*\) (without initial connection time)$/\1/p' <<<"$out")
	if [ -z "$tps" ] || [ -z "$n" ] || [ "${failed:-0}" != 0 ]; then
		echo "$out" >&2
		die "pgbench $setup -c $clients: no TPS or failed transactions"
	fi
	echo "$tps $n"
}

# measure SETUP CLIENTS SECONDS: one checked run from empty servers; sets
# last_tps
measure() {
	local res n
	res=$(run_pgbench "$1" "$2" "$3") || exit 1
	read -r last_tps n <<<"$res"
	check_calls "$1" "$n"
	reset
}

median() {
	printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END { if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}

calc() {
	awk "BEGIN { printf \"%.6f\", $1 }"
}

# ---------------------------------------------------------------------------
# machine

cpu_model=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)
pg_version=$(psql_setup standalone -c 'SHOW server_version')
ext_version=$(psql_setup standalone -c "SELECT extversion FROM pg_extension WHERE extname = 'rl_redis'")
redis_version=$(info_field "$RL_REDIS_PORT" server redis_version)
echo "== rl_redis Redis Cluster benchmark"
echo "machine     : $(nproc) CPUs${cpu_model:+ ($cpu_model)}, $(uname -sr)"
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg) (before the runs)"
echo "PostgreSQL  : $pg_version, pgbench $(pgbench --version | awk '{ print $3 }'), rl_redis $ext_version"
echo "Redis       : $redis_version; standalone on $RL_REDIS_PORT, cluster of 3 masters on $M1 $M2 $M3, cluster of 1 master on $C1"
echo "runs        : ${BENCH_SECONDS} s each, $BENCH_ROUNDS round(s), loopback TCP, $IDENTITIES identities, pgbench -n -M prepared"
echo "call        : SELECT rl_fixed_allow('bench:' || n, 100000, 60000)"
for setup in "${SETUPS[@]}"; do
	printf '  %-10s PGOPTIONS=%s\n' "$setup" "'$(pgoptions "$setup")'"
done

# ---------------------------------------------------------------------------
# warm-up, then the measured rounds

echo
echo "warm-up (${WARMUP_SECONDS} s per run) ..."
for setup in "${SETUPS[@]}"; do
	for c in 1 8; do
		measure "$setup" "$c" "$WARMUP_SECONDS"
	done
done

# the runs of a round: "SETUP CLIENTS"
RUNS=("standalone 1" "cluster1 1" "cluster3 1" "standalone 8" "cluster1 8" "cluster3 8")
declare -A tps share
for ((r = 1; r <= BENCH_ROUNDS; r++)); do
	echo "round $r of $BENCH_ROUNDS ..."
	order=("${RUNS[@]}")
	if ((r % 2 == 0)); then # every other round in the reverse order
		order=()
		for ((i = ${#RUNS[@]} - 1; i >= 0; i--)); do
			order+=("${RUNS[i]}")
		done
	fi
	for run in "${order[@]}"; do
		read -r setup c <<<"$run"
		measure "$setup" "$c" "$BENCH_SECONDS"
		tps[$setup.$c.$r]=$last_tps
		if [ "$setup.$c" = cluster3.8 ]; then
			total=0
			for p in "${MASTERS[@]}"; do total=$((total + calls[$p])); done
			for p in "${MASTERS[@]}"; do share[$p.$r]=$(calc "100 * ${calls[$p]} / $total"); done
		fi
	done
done

# ---------------------------------------------------------------------------
# connections: 8 clients in cluster3 for CONN_SECONDS; counted midway

echo "connections (8 clients, cluster3, ${CONN_SECONDS} s) ..."
# the backends of the last runs must be gone: no client on the masters but
# redis-cli itself (20 s at most)
for i in $(seq 1 100); do
	left=0
	for p in "${MASTERS[@]}"; do
		left=$((left + $(info_field "$p" clients connected_clients) - 1))
	done
	[ "$left" = 0 ] && break
	sleep 0.2
done
[ "$left" = 0 ] || die "clients of earlier runs are still connected to the masters"

declare -A received_before cli_calls held opened
for p in "${MASTERS[@]}"; do
	received_before[$p]=$(info_field "$p" stats total_connections_received)
	cli_calls[$p]=0
done
PGOPTIONS=$(pgoptions cluster3) PGCONNECT_TIMEOUT=10 timeout -k 10 $((CONN_SECONDS + 120)) \
	pgbench -n -M prepared -T "$CONN_SECONDS" -c 8 -j 2 -f "$work/fixed.sql" \
	>"$work/conn.out" 2>&1 &
bg_pid=$!
sleep $((CONN_SECONDS / 2))
# the pgbench backends
backends=$(psql_setup standalone -c "SELECT string_agg(pid::text, ' ') FROM pg_stat_activity
	WHERE application_name = 'pgbench' AND backend_type = 'client backend'")
nbackends=$(wc -w <<<"$backends")
# CLIENT LIST of every master, less redis-cli's own connection
for p in "${MASTERS[@]}"; do
	held[$p]=$(printf 'CLIENT ID\nCLIENT LIST\n' | rport "$p" | tr -d '\r' |
		awk 'NR == 1 { self = "id=" $1 " "; next } /^id=/ && index($0, self) != 1 { n++ } END { print n + 0 }')
	cli_calls[$p]=$((cli_calls[$p] + 1))
done
# per backend process and master, from the client side (ss)
per_pair= per_backend=
if [ "$have_ss" = 1 ]; then
	for p in "${MASTERS[@]}"; do
		ss -Htnp state established "( dport = :$p )" 2>/dev/null |
			grep -o 'pid=[0-9]*' | sed "s/^pid=/$p /"
	done >"$work/ss.out"
	read -r per_pair per_backend < <(/usr/bin/python3 - "$work/ss.out" "$backends" "${MASTERS[@]}" <<-'EOF'
		import collections, sys
		pairs = collections.Counter(tuple(l.split()) for l in open(sys.argv[1]) if l.strip())
		backends, masters = sys.argv[2].split(), sys.argv[3:]
		pp = [pairs[(m, b)] for b in backends for m in masters]
		pb = [sum(pairs[(m, b)] for m in masters) for b in backends]
		r = lambda v: "%d..%d" % (min(v), max(v)) if v else "none"
		print(r(pp), r(pb))
	EOF
	)
fi
wait "$bg_pid"
rc=$?
bg_pid=
[ "$rc" = 0 ] || { cat "$work/conn.out" >&2; die "pgbench for the connection count failed"; }
for p in "${MASTERS[@]}"; do
	# the difference counts the connection of the INFO that reads it, too
	after=$(info_field "$p" stats total_connections_received)
	opened[$p]=$((after - received_before[$p] - cli_calls[$p] - 1))
done
n=$(sed -n 's/^number of transactions actually processed: \([0-9]*\).*/\1/p' "$work/conn.out")
[ -n "$n" ] || { cat "$work/conn.out" >&2; die "pgbench for the connection count: no transactions"; }
check_calls cluster3 "$n"
[ "$nbackends" -gt 0 ] || die "no pgbench backend found in pg_stat_activity"

# ---------------------------------------------------------------------------
# figures

# vals KEYPREFIX: the TPS of every round
vals() {
	local r
	for ((r = 1; r <= BENCH_ROUNDS; r++)); do echo "${tps[$1.$r]}"; done
}

# fig FORMAT VALUE...: "median (min..max)", or the value alone
fig() {
	local fmt=$1
	shift
	if [ $# -eq 1 ]; then
		printf "$fmt" "$1"
	else
		printf "$fmt (%s..%s)" "$(median "$@")" \
			"$(printf "$fmt" "$(printf '%s\n' "$@" | sort -g | head -1)")" \
			"$(printf "$fmt" "$(printf '%s\n' "$@" | sort -g | tail -1)")"
	fi
}

# per round: latencies, ratios
declare -A lat L1 R81 R83
for ((r = 1; r <= BENCH_ROUNDS; r++)); do
	lat[standalone.$r]=$(calc "1000 / ${tps[standalone.1.$r]}")
	lat[cluster1.$r]=$(calc "1000 / ${tps[cluster1.1.$r]}")
	lat[cluster3.$r]=$(calc "1000 / ${tps[cluster3.1.$r]}")
	L1[$r]=$(calc "${lat[cluster3.$r]} / ${lat[standalone.$r]}")
	R81[$r]=$(calc "${tps[cluster1.8.$r]} / ${tps[standalone.8.$r]}")
	R83[$r]=$(calc "${tps[cluster3.8.$r]} / ${tps[standalone.8.$r]}")
done
arr_vals() {
	local -n a=$1
	local r
	for ((r = 1; r <= BENCH_ROUNDS; r++)); do echo "${a[$r]}"; done
}
lat_vals() {
	local r
	for ((r = 1; r <= BENCH_ROUNDS; r++)); do echo "${lat[$1.$r]}"; done
}
rounds_of() {
	local -n a=$1
	local r list=
	for ((r = 1; r <= BENCH_ROUNDS; r++)); do list+="$(printf '%.3f' "${a[$r]}") "; done
	echo "${list% }"
}

echo
if [ "$BENCH_ROUNDS" -gt 1 ]; then
	echo "raw figures: median of $BENCH_ROUNDS rounds (min..max)"
else
	echo "raw figures"
fi
row() {
	printf '  %-34s  %-30s  %s\n' "$1" "$2" "$3"
}
row "" "1 client: latency ms" "8 clients: decisions/s"
row "standalone" "$(fig %.4f $(lat_vals standalone))" "$(fig %.0f $(vals standalone.8))"
row "cluster, 1 master" "$(fig %.4f $(lat_vals cluster1))" "$(fig %.0f $(vals cluster1.8))"
row "cluster, 3 masters" "$(fig %.4f $(lat_vals cluster3))" "$(fig %.0f $(vals cluster3.8))"
shares=
for p in "${MASTERS[@]}"; do
	v=()
	for ((r = 1; r <= BENCH_ROUNDS; r++)); do v+=("${share[$p.$r]}"); done
	shares+="$(printf '%.1f' "$(median "${v[@]}")")% "
done
echo "  latency = 1000 / TPS of the 1-client run; 8-client runs use -j 2."
echo "  cluster, 3 masters, 8 clients: script calls per master $M1/$M2/$M3: ${shares% }"
echo "  connections (8 clients, cluster, 3 masters, counted after $((CONN_SECONDS / 2)) s of ${CONN_SECONDS}):"
echo "    pgbench backends: $nbackends"
for p in "${MASTERS[@]}"; do
	echo "    master $p: $(printf '%3d' "${held[$p]}") held (CLIENT LIST), $(printf '%3d' "${opened[$p]}") accepted during the run"
done
if [ "$have_ss" = 1 ]; then
	echo "    per backend process (ss): ${per_pair} per master, ${per_backend} in all"
else
	echo "    per backend process: not counted (ss is not installed)"
fi

# connection figures per backend
held_total=0 opened_total=0 held_ok=1 opened_ok=1 held_pm= opened_pm=
for p in "${MASTERS[@]}"; do
	held_total=$((held_total + held[$p]))
	opened_total=$((opened_total + opened[$p]))
	[ "${held[$p]}" = "$nbackends" ] || held_ok=0
	[ "${opened[$p]}" = "$nbackends" ] || opened_ok=0
	held_pm+="$(calc "${held[$p]} / $nbackends" | xargs printf '%.2f')/"
	opened_pm+="$(calc "${opened[$p]} / $nbackends" | xargs printf '%.2f')/"
done
if [ "$have_ss" = 1 ]; then
	[ "$per_pair" = "1..1" ] && [ "$per_backend" = "3..3" ] || held_ok=0
fi
yes_no() { [ "$1" = 1 ] && echo yes || echo NO; }
le() { awk -v v="$1" -v t="$2" 'BEGIN { print (v <= t) ? "yes" : "NO" }'; }

echo
printf '%-44s %-18s %-9s %-4s %s\n' "what" "figure" "target" "met" "per round"
t() { printf '%-44s %-18s %-9s %-4s %s\n' "$@"; }
v=$(median $(lat_vals standalone))
t "latency, 1 client, standalone (ms)" "$(printf '%.4f' "$v")" "-" "-" ""
v=$(median $(lat_vals cluster1))
t "latency, 1 client, cluster 1 master (ms)" "$(printf '%.4f' "$v")" "-" "-" ""
v=$(median $(lat_vals cluster3))
t "latency, 1 client, cluster 3 masters (ms)" "$(printf '%.4f' "$v")" "-" "-" ""
v=$(median $(arr_vals L1))
t "L1 = cluster 3 masters / standalone" "$(printf '%.3f' "$v")" "<= 1.05" "$(le "$v" 1.05)" "$(rounds_of L1)"
t "decisions/s, 8 clients, standalone" "$(printf '%.0f' "$(median $(vals standalone.8))")" "-" "-" ""
t "decisions/s, 8 clients, cluster 1 master" "$(printf '%.0f' "$(median $(vals cluster1.8))")" "-" "-" ""
t "decisions/s, 8 clients, cluster 3 masters" "$(printf '%.0f' "$(median $(vals cluster3.8))")" "-" "-" ""
v=$(median $(arr_vals R81))
t "T8 ratio cluster 1 master / standalone" "$(printf '%.3f' "$v")" "-" "-" "$(rounds_of R81)"
v=$(median $(arr_vals R83))
t "T8 ratio cluster 3 masters / standalone" "$(printf '%.3f' "$v")" "-" "-" "$(rounds_of R83)"
t "C8 held per backend, per master" "${held_pm%/}" "1/1/1" "$(yes_no "$held_ok")" ""
t "C8 held per backend, in all" "$(calc "$held_total / $nbackends" | xargs printf '%.2f')" "3" "$(yes_no "$held_ok")" ""
t "C8 opened per backend, per master" "${opened_pm%/}" "1/1/1" "$(yes_no "$opened_ok")" ""
t "C8 opened per backend, in all" "$(calc "$opened_total / $nbackends" | xargs printf '%.2f')" "3" "$(yes_no "$opened_ok")" ""
echo "(each round's ratios come from runs made one after the other; the figure is their median)"
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg) (after the runs)"
if [ "$(md5sum <"$installed_so")" != "$so_sum" ]; then
	echo "WARNING: $installed_so was replaced during the run (another make install?);"
	echo "         backends started after that ran the other build, so the figures may mix builds."
fi
exit 0
