# Shared shell helpers for the test runner, the benchmark and the demo:
# start a throwaway Redis and a throwaway PostgreSQL cluster on free loopback
# ports inside one temporary folder, and stop them again.
#
# Usage (from bash):
#   . sql_tests/lib.sh
#   rl_build_install [DIR]      # packages, build, install (of the source in DIR)
#   rl_cluster_start            # sets RL_DIR, RL_PGPORT, RL_REDIS_PORT, PG* vars
#   ...                         # psql works, Redis answers on $RL_REDIS_PORT
#   rl_cluster_stop             # also registered as an EXIT trap
#
# PostgreSQL refuses to run as root, so when this runs as root the cluster is
# owned by, and started as, the unprivileged "postgres" user.
#
# The cluster preloads the library (shared_preload_libraries = 'rl_redis',
# as the README's install steps do), so the installed rl_redis.so must exist
# before rl_cluster_start; RL_PRELOAD=<list> overrides the setting (an empty
# list starts the cluster without preloading).
#
# RL_REDIS_SERVER / RL_REDIS_CLI name the server and its client (default
# redis-server / redis-cli; valkey-server / valkey-cli for Valkey); the
# Python tests (conftest.py) read the same variables.
RL_REDIS_SERVER=${RL_REDIS_SERVER:-redis-server}
RL_REDIS_CLI=${RL_REDIS_CLI:-redis-cli}
RL_TESTS_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# Installs the packages that are missing (sql_tests/install_deps.sh), then
# builds and installs the extension whose source is in DIR (default: this
# one); sudo for the install when not root. Without the LLVM bitcode that
# PGXS also builds for JIT inlining (clang compiles every file a second
# time, half of the build's CPU; no test uses it, and the package build of
# sql_tests/test_deb.sh builds and ships it), and without what an earlier
# install left of it, which would no longer match the library.
rl_build_install() {
	local sudo= dir=${1:-.} bitcode
	[ "$(id -u)" = 0 ] || sudo=sudo
	bash sql_tests/install_deps.sh || return 1
	make -s -C "$dir" -j"$(nproc)" with_llvm=no >/dev/null || return 1
	$sudo make -s -C "$dir" install with_llvm=no >/dev/null || return 1
	bitcode=$(pg_config --pkglibdir)/bitcode
	$sudo rm -rf "$bitcode/rl_redis" "$bitcode/rl_redis.index.bc"
}

# Prints a TCP port on 127.0.0.1 that nothing listens on right now (see
# sql_tests/ports.py: below the range of outgoing connections' own ports).
rl_free_port() {
	/usr/bin/python3 "$RL_TESTS_DIR/ports.py"
}

# Runs a command as the cluster owner (postgres when we are root).
rl_as_owner() {
	if [ "$(id -u)" = 0 ]; then
		runuser -u postgres -- "$@"
	else
		"$@"
	fi
}

# Waits until redis-server answers PING on the given port (about 10 s at most).
rl_wait_redis() {
	local port=$1 i
	for i in $(seq 1 100); do
		[ "$("$RL_REDIS_CLI" -p "$port" ping 2>/dev/null)" = PONG ] && return 0
		sleep 0.1
	done
	echo "$RL_REDIS_SERVER on port $port did not start" >&2
	return 1
}

# Starts Redis and PostgreSQL in a new temporary folder and exports the
# variables that psql, pg_regress and the Python tests read.
rl_cluster_start() {
	RL_PGBIN=${RL_PGBIN:-$(pg_config --bindir)}
	RL_DIR=$(mktemp -d "${TMPDIR:-/tmp}/rl_redis_test.XXXXXX")
	chmod 755 "$RL_DIR"
	[ "$(id -u)" = 0 ] && chown postgres "$RL_DIR"
	RL_REDIS_PORT=$(rl_free_port)
	RL_PGPORT=$(rl_free_port)
	export RL_DIR RL_REDIS_PORT RL_PGPORT
	trap rl_cluster_stop EXIT

	"$RL_REDIS_SERVER" --port "$RL_REDIS_PORT" --bind 127.0.0.1 --save '' \
		--appendonly no --dir "$RL_DIR" --logfile "$RL_DIR/redis.log" \
		--pidfile "$RL_DIR/redis.pid" --daemonize yes >/dev/null
	rl_wait_redis "$RL_REDIS_PORT" || return 1

	rl_as_owner "$RL_PGBIN/initdb" -D "$RL_DIR/pgdata" -U postgres \
		--auth=trust --no-sync -E UTF8 --locale=C >"$RL_DIR/initdb.log" 2>&1 ||
		{ cat "$RL_DIR/initdb.log" >&2; return 1; }
	cat >>"$RL_DIR/pgdata/postgresql.conf" <<-EOF
		port = $RL_PGPORT
		listen_addresses = '127.0.0.1'
		unix_socket_directories = '$RL_DIR'
		fsync = off
		max_connections = 130
		max_prepared_transactions = 10
		wal_level = replica
		max_wal_senders = 4
		hot_standby = on
		shared_preload_libraries = '${RL_PRELOAD-rl_redis}'
		rl_redis.host = '127.0.0.1'
		rl_redis.port = $RL_REDIS_PORT
	EOF
	echo "host replication all 127.0.0.1/32 trust" >>"$RL_DIR/pgdata/pg_hba.conf"
	rl_as_owner "$RL_PGBIN/pg_ctl" -D "$RL_DIR/pgdata" -l "$RL_DIR/postgres.log" \
		-w -t 60 start >/dev/null || { cat "$RL_DIR/postgres.log" >&2; return 1; }

	export PGHOST=127.0.0.1 PGPORT=$RL_PGPORT PGUSER=postgres PGDATABASE=postgres
}

# Stops whatever rl_cluster_start started and removes its folder.
rl_cluster_stop() {
	[ -n "${RL_DIR:-}" ] && [ -d "$RL_DIR" ] || return 0
	if [ -f "$RL_DIR/pgdata/postmaster.pid" ]; then
		rl_as_owner "$RL_PGBIN/pg_ctl" -D "$RL_DIR/pgdata" -m immediate -w stop >/dev/null 2>&1
	fi
	if [ -f "$RL_DIR/redis.pid" ]; then
		kill "$(cat "$RL_DIR/redis.pid")" 2>/dev/null
	fi
	sleep 0.2
	rm -rf "$RL_DIR"
	RL_DIR=
}

# Prints, one argument a line, the script call (FCALL; EVALSHA for a build
# before release 1.6) that the statement SQL sends to the Redis on PORT on
# a key holding TAG, as SLOWLOG records it (the second of two runs of SQL:
# the first may have to load the library); psql must reach the PostgreSQL
# that sends it. The benchmarks replay this command so that it stays right
# when the scripts or their arguments change.
rl_capture_call() {
	local port=$1 sql=$2 tag=$3 old
	old=$("$RL_REDIS_CLI" -p "$port" CONFIG GET slowlog-log-slower-than | tail -1)
	"$RL_REDIS_CLI" -p "$port" CONFIG SET slowlog-log-slower-than 0 >/dev/null &&
		"$RL_REDIS_CLI" -p "$port" SLOWLOG RESET >/dev/null || return 1
	psql -X -q -A -t -v ON_ERROR_STOP=1 -c "$sql" -c "$sql" >/dev/null || return 1
	"$RL_REDIS_CLI" -p "$port" CONFIG SET slowlog-log-slower-than "$old" >/dev/null || return 1
	"$RL_REDIS_CLI" -p "$port" --json SLOWLOG GET 128 | RL_TAG=$tag /usr/bin/python3 -c '
import json, os, sys
tag = os.environ["RL_TAG"]
for entry in json.load(sys.stdin):          # newest first
    args = entry[3]
    if args and args[0].upper() in ("FCALL", "EVALSHA") and any(tag in a for a in args):
        if len(args) >= 32 or any(a.endswith("more bytes)") or "\n" in a for a in args):
            sys.exit("the command is too long for SLOWLOG: %r" % args)
        print("\n".join(args))
        sys.exit(0)
sys.exit("no FCALL or EVALSHA on a key holding %s in SLOWLOG" % tag)
'
}

# rl_allowed_decisions PORT CMD...: runs CMD on the Redis on PORT and prints
# how many of the decisions in its reply allow: a plain pattern's integer 1,
# one decision packed by lua/common.lua (seven little-endian 8-byte
# integers, the first 1 when it allows) or an array of them (a batch), or a
# decision of a build before 1.6 (an array of integers, the first 1 when it
# allows). redis-cli --no-raw shows a packed decision as "\x01\x00..."
# (allowed), one element a line. When none allows, the reply also goes to
# stderr.
rl_allowed_decisions() {
	local port=$1 reply n
	shift
	reply=$("$RL_REDIS_CLI" -p "$port" --no-raw "$@") || return 1
	n=$(awk '
		/^ *[0-9]+\) "\\x01\\x00\\x00\\x00\\x00\\x00\\x00\\x00/ { n++ }
		NR == 1 && /^"\\x01\\x00\\x00\\x00\\x00\\x00\\x00\\x00/ { n++ }
		NR == 1 && ($0 == "(integer) 1" || $0 == "1) (integer) 1") { n++ }
		END { print n + 0 }' <<<"$reply")
	[ "$n" -gt 0 ] || echo "the reply: $reply" >&2
	echo "$n"
}

# rl_redis_benchmark PORT CLIENTS REQUESTS RANDOM CMD...: runs
# redis-benchmark -r RANDOM with the command CMD (__rand_int__ in it is
# replaced by a random number below RANDOM on every request) and prints
# "rps avg_latency_ms" from its CSV (header "test","rps","avg_latency_ms",...;
# the latency has 3 decimals, i.e. 1 microsecond resolution). Fails, showing
# redis-benchmark's output, when it fails or wrote no keys (it keeps going
# when the server answers with errors). With RL_BENCH_CLIENT_CPUS set,
# redis-benchmark runs on those CPUs only (taskset -c).
rl_redis_benchmark() {
	local port=$1 clients=$2 requests=$3 random=$4 out before after
	shift 4
	before=$("$RL_REDIS_CLI" -p "$port" DBSIZE)
	out=$(${RL_BENCH_CLIENT_CPUS:+taskset -c "$RL_BENCH_CLIENT_CPUS"} \
		redis-benchmark -p "$port" -c "$clients" -n "$requests" -r "$random" --csv "$@" 2>&1) ||
		{ echo "$out" >&2; echo "redis-benchmark failed" >&2; return 1; }
	after=$("$RL_REDIS_CLI" -p "$port" DBSIZE)
	[ "$after" -gt "$before" ] || { echo "$out" >&2; echo "redis-benchmark wrote no keys" >&2; return 1; }
	awk -F, '
		/^"test"/ { for (i = 1; i <= NF; i++) { gsub(/"/, "", $i); col[$i] = NF - i }; next }
		/^"/ && ("rps" in col) { gsub(/"/, ""); print $(NF - col["rps"]), $(NF - col["avg_latency_ms"]); found = 1 }
		END { exit !found }
	' <<<"$out" || { echo "$out" >&2; echo "cannot read redis-benchmark's CSV" >&2; return 1; }
}

# Prints the median of the arguments (numbers).
rl_median() {
	printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END { if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}

# rl_pgbench_tps FILE CLIENTS SECONDS: runs pgbench -n -M prepared with the
# script FILE (-j 2 for more than one client) and prints its TPS (without
# the initial connection time). pgbench's "latency average" is
# 1000 * clients / TPS when neither -R nor -P is used, printed to 3 decimals
# only, so the benchmarks compute latencies from the TPS instead. Fails,
# showing pgbench's output, when it fails or a transaction failed.
rl_pgbench_tps() {
	local file=$1 clients=$2 seconds=$3 threads=1 out tps failed
	[ "$clients" -gt 1 ] && threads=2
	out=$(pgbench -n -M prepared -T "$seconds" -c "$clients" -j "$threads" -f "$file" 2>&1) ||
		{ echo "$out" >&2; return 1; }
	failed=$(sed -n 's/^number of failed transactions: \([0-9]*\).*/\1/p' <<<"$out")
	tps=$(sed -n 's/^tps = \([0-9.]*\) (without initial connection time)$/\1/p' <<<"$out")
	if [ -z "$tps" ] || [ "${failed:-0}" != 0 ]; then
		echo "$out" >&2
		echo "pgbench: no TPS or failed transactions" >&2
		return 1
	fi
	echo "$tps"
}

# Prints a command's arguments on one line, empty ones as ''.
rl_show_cmd() {
	local a out=
	for a in "$@"; do
		[ -z "$a" ] && a="''"
		out+="$a "
	done
	echo "${out% }"
}

# rl_calc EXPR: prints the value of an awk expression, 6 decimals.
rl_calc() {
	awk "BEGIN { printf \"%.6f\", $1 }"
}

# rl_values KEY ARRAY: prints ARRAY[KEY.r] for each round r from 1 to
# BENCH_ROUNDS, one a line (the benchmarks key their figures by round).
rl_values() {
	local -n arr=$2
	local r
	for ((r = 1; r <= BENCH_ROUNDS; r++)); do
		echo "${arr[$1.$r]}"
	done
}
