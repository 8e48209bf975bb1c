#!/usr/bin/env bash
# The benchmark (`make bench`). A measurement, not a test: it prints figures
# and exits 0 whether or not the targets are met; non-zero only when
# something could not be built, started or run.
#
# Installs missing packages, builds and installs the extension, starts a
# throwaway Redis and PostgreSQL on free loopback ports (sql_tests/lib.sh),
# and compares each rate-limit function with the two round trips it cannot
# avoid, one to PostgreSQL and one to Redis:
#
#   R1 = latency(SELECT rl_X_allow(...), 1 client)
#        / (latency(SELECT 1, 1 client) + latency(the same FCALL, 1 client))
#        target <= 1.03
#   E8 = TPS(SELECT rl_X_allow(...), 8 clients) / H,
#        H = 1 / (1/TPS(SELECT 1, 8 clients) + 1/TPS(the same FCALL, 8 clients))
#        target >= 0.90
#
# and the same with rl_redis.transport = shared (the calls go through the
# rl_redis worker's one pipelined connection): R1 target <= 1.10, E8 target
# >= 1.0. Last, the number of Redis connections the PostgreSQL server holds
# (CLIENT LIST) while 8 and then 100 sessions call rl_fixed_allow, in each
# mode.
#
# PostgreSQL side: pgbench -n -M prepared -T $BENCH_SECONDS over TCP
# loopback, 100000 random identities, a limit that is never reached (lim
# 100000 per minute; for the sliding log every session raises
# rl_redis.sliding_max_lim, 10000 by default, to 100000 through PGOPTIONS).
# Redis side: redis-benchmark sending the very command the extension sends
# for that call: FCALL of the function of the library compiled into the
# extension (built by src/embed_lua.sh from lua/; EVALSHA of a script for
# a baseline before 1.6), with the same arguments, on the same key
# layout rl:<algorithm>:{bench:<n>}:100000/60000. The command is taken from Redis's
# SLOWLOG after one call of the function, so it stays right when the
# scripts or their arguments change.
#
# Against a release: the same runs are made, in the same run of the
# script, with the build of the git commit BENCH_BASELINE (release 1.5 by
# default), and a last table gives each build's R1 and E8 and the ratio
# current / baseline. The baseline's source (git archive of the commit, or a
# copy of BENCH_BASELINE_DIR) is renamed in a throwaway folder to the
# extension rl_redis_base (its Makefile's EXTENSION and MODULE_big, its
# control file and module_pathname, its SQL scripts, the library its worker
# is started from), so that it installs beside rl_redis; it stays installed
# (remove $(pg_config --sharedir)/extension/rl_redis_base* and
# $(pg_config --pkglibdir)/rl_redis_base.so by hand); a source from before
# src/compat.h (1.5 is) is given the current one to build on PostgreSQL 16
# and later (baseline_port). Each build gets a
# PostgreSQL cluster and a Redis of its own, started alike (lib.sh), the
# cluster preloading only that build's library: both define the GUCs of
# rl_redis, so one backend never loads both, and a Redis per build keeps
# each build's FLUSHALLs, script cache and SLOWLOG capture apart while the
# idle one costs nothing. The Redis-side figures are taken per build
# against its own Redis, with the command that build sends. Every workload
# runs on the current build and right after on the baseline, in every
# round, so load that drifts on the machine hits both alike. Without git
# or the commit (a tarball of the source), the script says so and measures
# the current build alone, as it does when BENCH_BASELINE is empty. After
# the current build's tables come the baseline's raw figures and the table
# "against 1.5": per ratio each build's median and current / baseline, the
# median of the per-round quotients, with every round's (R1 above 1 or E8
# below 1 is worse than the baseline). README.md, "Performance", has figures.
#
# Environment:
#   BENCH_SECONDS  length of every measured run (default 10)
#   BENCH_ROUNDS   rounds of all runs, interleaved; the table shows medians
#                  (default 3: on a small shared machine single runs of a
#                  few seconds differ by more than the 3 % the targets allow)
#   BENCH_BASELINE the git commit to compare with (default 236198d, the last
#                  commit of release 1.5; empty: no comparison)
#   BENCH_BASELINE_DIR  a folder holding that commit's source, used instead
#                  of git (for a checkout without .git, e.g.
#                  git archive 236198d | tar -x -C DIR made elsewhere)
set -uo pipefail
cd "$(dirname "$0")/.."

BENCH_SECONDS=${BENCH_SECONDS:-10}
BENCH_ROUNDS=${BENCH_ROUNDS:-3}
BENCH_BASELINE=${BENCH_BASELINE-236198d}
BENCH_BASELINE_DIR=${BENCH_BASELINE_DIR:-}
IDENTITIES=100000
WARMUP_SECONDS=2
ALGORITHMS=(sliding fixed)
SHARED=(sliding@shared fixed@shared)

die() {
	echo "bench: $*" >&2
	exit 1
}

[[ $BENCH_SECONDS =~ ^[1-9][0-9]*$ ]] || die "BENCH_SECONDS must be a positive integer"
[[ $BENCH_ROUNDS =~ ^[1-9][0-9]*$ ]] || die "BENCH_ROUNDS must be a positive integer"

. sql_tests/lib.sh
rl_build_install || die "could not install the packages, build or install"

for tool in pgbench redis-benchmark redis-cli psql /usr/bin/python3; do
	command -v "$tool" >/dev/null || die "$tool not found"
done

# ---------------------------------------------------------------------------
# the builds: cur, and base when a baseline is measured; per build the
# extension's name, the header its Lua scripts were compiled into, and its
# name in the output

builds=(cur)
declare -A ext=([cur]=rl_redis) lua_h=([cur]=src/lua_scripts.h) label=([cur]=current)
base_src=
base_ported=
clusters=()

# Stops every build's Redis and PostgreSQL and removes the baseline's source.
stop_all() {
	local d
	for d in "${clusters[@]}"; do
		RL_DIR=$d rl_cluster_stop
	done
	if [ -n "$base_src" ]; then
		rm -rf "$base_src"
	fi
}
trap stop_all EXIT

# baseline_source DIR: puts the baseline's source into the empty folder DIR,
# a copy of BENCH_BASELINE_DIR or BENCH_BASELINE exported by git archive;
# says why and fails when there is no git or no such commit here
baseline_source() {
	local err
	if [ -n "$BENCH_BASELINE_DIR" ]; then
		[ -f "$BENCH_BASELINE_DIR/Makefile" ] || die "BENCH_BASELINE_DIR ($BENCH_BASELINE_DIR) holds no Makefile"
		cp -a "$BENCH_BASELINE_DIR/." "$1/" || die "cannot copy $BENCH_BASELINE_DIR"
		return 0
	fi
	if ! command -v git >/dev/null; then
		err="git is not installed"
	elif ! err=$(git rev-parse -q --verify "$BENCH_BASELINE^{commit}" 2>&1 >/dev/null); then
		err="no commit $BENCH_BASELINE in a git repository here${err:+ (${err%%$'\n'*})}"
	else
		git archive "$BENCH_BASELINE" | tar -x -C "$1" || die "git archive $BENCH_BASELINE failed"
		return 0
	fi
	echo "bench: the baseline $BENCH_BASELINE is not measured: $err;"
	echo "       set BENCH_BASELINE_DIR to a folder with its source, or BENCH_BASELINE= to skip it"
	return 1
}

# baseline_rename DIR: renames the extension whose source is in DIR to
# rl_redis_base (the Makefile's EXTENSION and MODULE_big and its SQL
# scripts, the control file and its module_pathname, the library the
# worker is started from), and checks that every rename took
baseline_rename() {
	local dir=$1 f
	[ -f "$dir/rl_redis.control" ] || return 1
	sed -i -e 's/^\(EXTENSION\|MODULE_big\)[[:space:]]*=[[:space:]]*rl_redis$/\1 = rl_redis_base/' \
		-e 's|sql/rl_redis--|sql/rl_redis_base--|' "$dir/Makefile" || return 1
	for f in "$dir"/sql/rl_redis--*.sql; do
		mv "$f" "$dir/sql/rl_redis_base--${f##*/rl_redis--}" || return 1
	done
	sed "s|^module_pathname[[:space:]]*=.*|module_pathname = '\$libdir/rl_redis_base'|" \
		"$dir/rl_redis.control" >"$dir/rl_redis_base.control" || return 1
	rm "$dir/rl_redis.control" || return 1
	sed -i '/bgw_library_name/s/"rl_redis"/"rl_redis_base"/' "$dir"/src/*.c || return 1
	[ "$(grep -c '^\(EXTENSION\|MODULE_big\) = rl_redis_base$' "$dir/Makefile")" = 2 ] &&
		grep -q 'sql/rl_redis_base--' "$dir/Makefile" &&
		grep -q "^module_pathname = '\$libdir/rl_redis_base'$" "$dir/rl_redis_base.control" &&
		! grep -q 'bgw_library_name.*"rl_redis"' "$dir"/src/*.c
}

# baseline_port DIR: a source from before src/compat.h (1.5 is) does not
# build on PostgreSQL 16 and later: gives it the current src/compat.h and
# makes its two calls that differ between majors use it, as commit 577dbf0
# did (the same code as before on 15); prints what it did
baseline_port() {
	local dir=$1
	[ -f "$dir/src/compat.h" ] && return 0
	cp src/compat.h "$dir/src/compat.h" || return 1
	sed -i '0,/^#include "postgres.h"$/s//&\n#include "compat.h"/' "$dir/src/rl_redis.h" || return 1
	sed -i -e 's/CreateWaitEventSet(TopMemoryContext, \([^)]*\))/rl_create_wait_event_set(\1)/' \
		-e 's/MyProc->pgprocno/rl_my_proc_number()/' "$dir"/src/*.c || return 1
	grep -q '^#include "compat.h"$' "$dir/src/rl_redis.h" &&
		! grep -q 'CreateWaitEventSet(TopMemoryContext\|MyProc->pgprocno' "$dir"/src/*.c || return 1
	echo ", given src/compat.h to build on PostgreSQL 16 and later"
}

if [ -n "$BENCH_BASELINE" ]; then
	base_src=$(mktemp -d "${TMPDIR:-/tmp}/rl_redis_base.XXXXXX") || die "cannot create a folder for the baseline"
	if baseline_source "$base_src"; then
		baseline_rename "$base_src" ||
			die "cannot rename the baseline's extension to rl_redis_base (its Makefile, control file or worker are not as this script expects)"
		base_ported=$(baseline_port "$base_src") || die "cannot give the baseline src/compat.h"
		rl_build_install "$base_src" || die "could not build or install the baseline $BENCH_BASELINE"
		builds+=(base)
		ext[base]=rl_redis_base
		lua_h[base]=$base_src/src/lua_scripts.h
		label[base]=$BENCH_BASELINE
		[ "$BENCH_BASELINE" = 236198d ] && label[base]=1.5
	fi
fi

declare -A so_file so_sum
for b in "${builds[@]}"; do
	so_file[$b]="$(pg_config --pkglibdir)/${ext[$b]}.so"
	so_sum[$b]=$(md5sum <"${so_file[$b]}")
done

# start_cluster BUILD: a Redis and a PostgreSQL (lib.sh) that preloads
# BUILD's library alone
declare -A pgport redisport
start_cluster() {
	local rc
	RL_PRELOAD=${ext[$1]} rl_cluster_start
	rc=$?
	clusters+=("$RL_DIR")
	trap stop_all EXIT # rl_cluster_start's trap stops the last cluster only
	pgport[$1]=$RL_PGPORT
	redisport[$1]=$RL_REDIS_PORT
	return $rc
}

# use BUILD: psql, pgbench and rcli talk to BUILD's PostgreSQL and Redis
use() {
	PGPORT=${pgport[$1]}
	RL_REDIS_PORT=${redisport[$1]}
}

for b in "${builds[@]}"; do
	start_cluster "$b" || die "could not start Redis and PostgreSQL"
	psql -X -q -v ON_ERROR_STOP=1 -c "CREATE EXTENSION ${ext[$b]}" || die "CREATE EXTENSION ${ext[$b]} failed"
done
# the sliding log's lim of 100000 is above the default rl_redis.sliding_max_lim
export PGOPTIONS="${PGOPTIONS:+$PGOPTIONS }-c rl_redis.sliding_max_lim=100000"

rcli() {
	redis-cli -p "$RL_REDIS_PORT" "$@"
}

work="${clusters[0]}/bench"
mkdir -p "$work" || die "cannot create $work"

# ---------------------------------------------------------------------------
# the workloads

# pgbench scripts: select1, fixed, sliding
echo 'SELECT 1;' >"$work/select1.sql"
for alg in "${ALGORITHMS[@]}"; do
	cat >"$work/$alg.sql" <<-EOT
		\set id random(1, $IDENTITIES)
		SELECT rl_${alg}_allow('bench:' || :id, 100000, 60000);
	EOT
done

# capture ALG: prints, one argument a line, the Redis command that
# rl_ALG_allow('bench:probe', 100000, 60000) sends (lib.sh)
capture() {
	rl_capture_call "$RL_REDIS_PORT" "SELECT rl_${1}_allow('bench:probe', 100000, 60000)" '{bench:probe}'
}

# cmd_BUILD_ALG: BUILD's command with the identity bench:__rand_int__,
# which redis-benchmark -r replaces by a random number on every request
declare -A script_name
for b in "${builds[@]}"; do
	use "$b"
	for alg in "${ALGORITHMS[@]}"; do
		mapfile -t probe < <(capture "$alg")
		[ ${#probe[@]} -ge 4 ] || die "could not capture the Redis command of ${label[$b]}'s rl_${alg}_allow"
		declare -n cmd=cmd_${b}_$alg
		cmd=("${probe[@]//\{bench:probe\}/\{bench:__rand_int__\}}")
		# the function, or the script's name in the lua_scripts.h of a build
		# that sent scripts (before 1.6)
		if [ "${cmd[0]}" = FCALL ]; then
			script_name[$b/$alg]="function ${cmd[1]}"
		else
			script_name[$b/$alg]=$(sed -n "s/^static const char RL_LUA_\([A-Za-z_]*\)_SHA\[\] = \"${cmd[1]}\";$/script \1/p" "${lua_h[$b]}")
		fi
		# one call on the benchmark's key layout must be allowed
		[ "$(rl_allowed_decisions "$RL_REDIS_PORT" "${cmd[@]//__rand_int__/check}")" = 1 ] ||
			die "replaying the command of ${label[$b]}'s rl_${alg}_allow did not allow a call"
		unset -n cmd
	done
done

flush() {
	[ "$(rcli FLUSHALL)" = OK ] || die "FLUSHALL failed"
}

# run_pgbench SCRIPT CLIENTS SECONDS: prints the TPS of pgbench running
# the workload SCRIPT (lib.sh); SCRIPT@shared with rl_redis.transport = shared
run_pgbench() {
	local script=${1%@shared} options=${PGOPTIONS:-}
	[ "$1" != "$script" ] && options+=" -c rl_redis.transport=shared"
	PGOPTIONS="$options" rl_pgbench_tps "$work/$script.sql" "$2" "$3" ||
		die "pgbench $script -c $2 failed"
}

# run_redis BUILD ALG CLIENTS REQUESTS: prints "rps avg_latency_ms" of
# redis-benchmark replaying BUILD's command of ALG (lib.sh)
run_redis() {
	local -n cmd=cmd_${1}_$2
	rl_redis_benchmark "$RL_REDIS_PORT" "$3" "$4" "$IDENTITIES" "${cmd[@]}" ||
		die "redis-benchmark $2 -c $3 failed"
}

# requests for a redis-benchmark run of about BENCH_SECONDS at rate rps
requests_for() {
	awk -v rps="$1" -v s="$BENCH_SECONDS" 'BEGIN { n = int(rps * s); if (n < 10000) n = 10000; print n }'
}

# ---------------------------------------------------------------------------
# machine

use cur
cpu_model=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)
pg_version=$(psql -X -A -t -c 'SHOW server_version')
ext_version=$(psql -X -A -t -c "SELECT extversion FROM pg_extension WHERE extname = 'rl_redis'")
redis_version=$(rcli INFO server | tr -d '\r' | sed -n 's/^redis_version://p')
echo "== rl_redis benchmark"
echo "machine     : $(nproc) CPUs${cpu_model:+ ($cpu_model)}, $(uname -sr)"
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg) (before the runs)"
echo "PostgreSQL  : $pg_version, pgbench $(pgbench --version | awk '{ print $3 }'), rl_redis $ext_version"
echo "Redis       : $redis_version, $(redis-benchmark --version | head -1)"
echo "runs        : ${BENCH_SECONDS} s each, $BENCH_ROUNDS round(s), loopback TCP, $IDENTITIES identities, pgbench -n -M prepared"
if [ -n "${ext[base]:-}" ]; then
	use base
	echo "baseline    : ${label[base]} = commit $BENCH_BASELINE${BENCH_BASELINE_DIR:+ (source from $BENCH_BASELINE_DIR)}," \
		"installed as rl_redis_base $(psql -X -A -t -c "SELECT extversion FROM pg_extension WHERE extname = 'rl_redis_base'")$base_ported," \
		"its own PostgreSQL cluster and Redis; every workload runs on the current build, then on ${label[base]}"
fi
for b in "${builds[@]}"; do
	prefix=
	[ "$b" = cur ] || prefix="${label[$b]}: "
	for alg in "${ALGORITHMS[@]}"; do
		declare -n cmd=cmd_${b}_$alg
		echo "${prefix}rl_${alg}_allow sends: $(rl_show_cmd "${cmd[@]//__rand_int__/<n>}")"
		echo "  (${script_name[$b/$alg]:-script NOT FOUND in ${lua_h[$b]}}; redis-benchmark replays this command)"
		unset -n cmd
	done
done

# ---------------------------------------------------------------------------
# warm-up: every workload once, short; also sizes the redis-benchmark runs

echo
echo "warm-up (${WARMUP_SECONDS} s per workload) ..."
for b in "${builds[@]}"; do
	use "$b"
	flush
done
declare -A nreq
for c in 1 8; do
	for w in select1 "${ALGORITHMS[@]}" "${SHARED[@]}"; do
		for b in "${builds[@]}"; do
			use "$b"
			run_pgbench "$w" "$c" "$WARMUP_SECONDS" >/dev/null
			flush
		done
	done
	for alg in "${ALGORITHMS[@]}"; do
		for b in "${builds[@]}"; do
			use "$b"
			read -r rps _ < <(run_redis "$b" "$alg" "$c" 20000) || die "warm-up of redis-benchmark failed"
			[ -n "${rps:-}" ] || die "warm-up of redis-benchmark $alg -c $c gave no figures"
			nreq[$b/$alg.$c]=$(requests_for "$rps")
			flush
		done
	done
done

# ---------------------------------------------------------------------------
# measured rounds; every run starts from an empty Redis (FLUSHALL); each
# workload runs on every build, one right after the other

declare -A tps rrps rlat
for ((r = 1; r <= BENCH_ROUNDS; r++)); do
	echo "round $r of $BENCH_ROUNDS ..."
	for c in 1 8; do
		for w in select1 "${ALGORITHMS[@]}" "${SHARED[@]}"; do
			for b in "${builds[@]}"; do
				use "$b"
				tps[$b/$w.$c.$r]=$(run_pgbench "$w" "$c" "$BENCH_SECONDS") || exit 1
				flush
			done
		done
		for alg in "${ALGORITHMS[@]}"; do
			for b in "${builds[@]}"; do
				use "$b"
				k=$b/$alg.$c
				read -r rrps[$k.$r] rlat[$k.$r] < <(run_redis "$b" "$alg" "$c" "${nreq[$k]}")
				[ -n "${rlat[$k.$r]:-}" ] || die "redis-benchmark $alg -c $c gave no figures"
				nreq[$k]=$(requests_for "${rrps[$k.$r]}") # keep runs near BENCH_SECONDS
				flush
			done
		done
	done
done
use cur

# ---------------------------------------------------------------------------
# figures

# fig FORMAT VALUE...: "median (min..max)" of the values, or the value alone
fig() {
	local fmt=$1
	shift
	if [ $# -eq 1 ]; then
		printf "$fmt" "$1"
	else
		printf "$fmt (%s..%s)" "$(rl_median "$@")" \
			"$(printf "$fmt" "$(printf '%s\n' "$@" | sort -g | head -1)")" \
			"$(printf "$fmt" "$(printf '%s\n' "$@" | sort -g | tail -1)")"
	fi
}

# latencies in ms of the 1-client pgbench runs of a workload (BUILD/NAME),
# per round
pg_lat() {
	local r
	for ((r = 1; r <= BENCH_ROUNDS; r++)); do
		rl_calc "1000 / ${tps[$1.1.$r]}"
		echo
	done
}

# per build and round: R1 and E8 of each algorithm, in each mode (the same
# Redis figures: the worker sends the very command)
declare -A R1 E8
for b in "${builds[@]}"; do
	for w in "${ALGORITHMS[@]}" "${SHARED[@]}"; do
		alg=${w%@shared}
		for ((r = 1; r <= BENCH_ROUNDS; r++)); do
			R1[$b/$w.$r]=$(rl_calc "(1000 / ${tps[$b/$w.1.$r]}) / (1000 / ${tps[$b/select1.1.$r]} + ${rlat[$b/$alg.1.$r]})")
			E8[$b/$w.$r]=$(rl_calc "${tps[$b/$w.8.$r]} * (1 / ${tps[$b/select1.8.$r]} + 1 / ${rrps[$b/$alg.8.$r]})")
		done
	done
done

rounds_of() {
	local -n arr=$2
	local r list=
	for ((r = 1; r <= BENCH_ROUNDS; r++)); do
		list+="$(printf '%.3f' "${arr[$1.$r]}") "
	done
	echo "${list% }"
}

row() {
	printf '  %-46s  %-30s  %s\n' "$1" "$2" "$3"
}
# raw_figures BUILD: the table of BUILD's measured figures
raw_figures() {
	local b=$1 alg
	row "" "1 client: latency ms" "8 clients: TPS"
	row "pgbench          SELECT 1" "$(fig %.4f $(pg_lat "$b/select1"))" "$(fig %.0f $(rl_values "$b/select1.8" tps))"
	for alg in "${ALGORITHMS[@]}"; do
		row "pgbench          SELECT rl_${alg}_allow(...)" "$(fig %.4f $(pg_lat "$b/$alg"))" \
			"$(fig %.0f $(rl_values "$b/$alg.8" tps))"
		row "  the same, transport = shared" "$(fig %.4f $(pg_lat "$b/$alg@shared"))" \
			"$(fig %.0f $(rl_values "$b/$alg@shared.8" tps))"
		row "redis-benchmark  script call of rl_${alg}_allow" "$(fig %.4f $(rl_values "$b/$alg.1" rlat))" \
			"$(fig %.0f $(rl_values "$b/$alg.8" rrps))"
	done
}

echo
if [ "$BENCH_ROUNDS" -gt 1 ]; then
	echo "raw figures: median of $BENCH_ROUNDS rounds (min..max)"
else
	echo "raw figures"
fi
raw_figures cur
echo "  pgbench latency = 1000 / TPS of the 1-client run (what pgbench's \"latency average\""
echo "  is, without its rounding to 1 us); redis-benchmark latency = its avg_latency_ms"
echo "  of the 1-client run (1 us resolution); 8-client pgbench runs use -j 2."

echo
# ratio NAME KEY ARRAY OP TARGET: one line of the table
ratio() {
	local v verdict
	v=$(rl_median $(rl_values "$2" "$3"))
	verdict=$(awk -v v="$v" -v t="$5" "BEGIN { print (v $4 t) ? \"met\" : \"MISSED\" }")
	printf '%-30s %8.3f %8s  %-8s %s\n' "$1" "$v" "$4 $5" "$verdict" "$(rounds_of "$2" "$3")"
}
printf '%-30s %8s %8s  %-8s %s\n' "ratio" "value" "target" "verdict" "per round"
for alg in "${ALGORITHMS[@]}"; do
	ratio "R1 rl_${alg}_allow" "cur/$alg" R1 "<=" 1.03
	ratio "E8 rl_${alg}_allow" "cur/$alg" E8 ">=" 0.90
	ratio "R1 rl_${alg}_allow shared" "cur/$alg@shared" R1 "<=" 1.10
	ratio "E8 rl_${alg}_allow shared" "cur/$alg@shared" E8 ">=" 1.0
done
echo "(each round's ratios come from runs made one after the other; the value is their median)"

# ---------------------------------------------------------------------------
# against the baseline: each build's R1 and E8, and current / baseline per
# round (the runs of a round's pair were made one right after the other)

if [ -n "${ext[base]:-}" ]; then
	base=${label[base]}
	echo
	echo "raw figures of $base (rl_redis_base, built from $BENCH_BASELINE), measured in the same rounds"
	raw_figures base
	echo
	echo "against $base: R1 and E8 of each build (median of the rounds), and current / $base"
	echo "(the median of the per-round quotients; R1 above 1 or E8 below 1 is worse than $base)"
	# against NAME ARRAY WORKLOAD: one line of the table
	against() {
		local -n arr=$2
		local r
		declare -A q=()
		for ((r = 1; r <= BENCH_ROUNDS; r++)); do
			q[x.$r]=$(rl_calc "${arr[cur/$3.$r]} / ${arr[base/$3.$r]}")
		done
		printf '%-30s %8.3f %8.3f %12.3f  %s\n' "$1" "$(rl_median $(rl_values "cur/$3" "$2"))" \
			"$(rl_median $(rl_values "base/$3" "$2"))" "$(rl_median $(rl_values x q))" "$(rounds_of x q)"
	}
	printf '%-30s %8s %8s %12s  %s\n' "ratio" "current" "$base" "current/$base" "per round"
	for alg in "${ALGORITHMS[@]}"; do
		against "R1 rl_${alg}_allow" R1 "$alg"
		against "E8 rl_${alg}_allow" E8 "$alg"
		against "R1 rl_${alg}_allow shared" R1 "$alg@shared"
		against "E8 rl_${alg}_allow shared" E8 "$alg@shared"
	done
fi

# ---------------------------------------------------------------------------
# Redis connections of the PostgreSQL server: CLIENT LIST in the middle of
# a run of N sessions, less redis-cli's own

connections() {
	local clients=$1 mode=$2 pid n
	PGOPTIONS="${PGOPTIONS:-} -c rl_redis.transport=$mode" pgbench -n -M prepared -T 4 \
		-c "$clients" -j 2 -f "$work/fixed.sql" >/dev/null 2>&1 &
	pid=$!
	sleep 2.5
	n=$(rcli CLIENT LIST | grep -vc 'cmd=client')
	wait "$pid" || die "pgbench -c $clients ($mode) failed"
	echo "$n"
}
echo
echo "Redis connections of the PostgreSQL server while N sessions call rl_fixed_allow"
printf '  %-10s %10s %10s\n' "sessions" "backend" "shared"
for n in 8 100; do
	printf '  %-10s %10s %10s\n' "$n" "$(connections "$n" backend)" "$(connections "$n" shared)"
done
echo "  (target for shared: 1, the number of Redis nodes, whatever the number of sessions;"
echo "  backend: one per session, plus the worker's while it is open)"
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg) (after the runs)"
for b in "${builds[@]}"; do
	if [ "$(md5sum <"${so_file[$b]}")" != "${so_sum[$b]}" ]; then
		echo "WARNING: ${so_file[$b]} was replaced during the run (another make install?);"
		echo "         backends started after that ran the other build, so the figures may mix builds."
	fi
done
exit 0
