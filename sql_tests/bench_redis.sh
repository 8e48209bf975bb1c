#!/usr/bin/env bash
# The Redis-side benchmark (`make bench-redis`, issue 22). A measurement,
# not a test: it prints figures and exits 0 whether or not the targets are
# met; non-zero only when something could not be built, started or run.
#
# Builds and installs the extension, starts a throwaway Redis and
# PostgreSQL (sql_tests/lib.sh) and, for each algorithm (fixed, sliding,
# sliding_counter, token_bucket, gcra), compares in Redis the exact FCALL
# that rl_<alg>_allow(identity, LIM, WINDOW_MS) sends, captured from Redis's
# SLOWLOG after a call through PostgreSQL (rl_capture_call, as
# sql_tests/bench.sh does, so that it stays right when the scripts or their
# arguments change), with the plain pattern for the same algorithm: the
# Lua files in sql_tests/bench_redis/ (benchmark fixtures, not the
# extension's scripts), loaded with SCRIPT LOAD and run by EVALSHA on the
# same key names with the arguments lim, window_ms:
#
#   fixed            INCRBY, PEXPIRE on the first call
#   sliding          a sorted set, one member per call (ZREMRANGEBYSCORE,
#                    ZCARD, ZADD, PEXPIRE)
#   sliding_counter  two counters weighted by overlap (MGET, INCR, PEXPIRE)
#   token_bucket     tokens and time in a hash (HMGET, HSET, PEXPIRE)
#   gcra             one TAT string, SET PX (as redis_rate does)
#
# 1. Throughput: redis-benchmark, 8 connections, BENCH_REQUESTS requests,
#    the identity bench:__rand_int__ with -r 1000000 (a million random
#    identities). Every round runs each algorithm's extension call and
#    right after its plain pattern, each from an empty Redis (FLUSHALL);
#    the table gives per algorithm the median of the rounds and the median
#    of the per-round ratios extension / plain (target >= 0.75), and beside
#    them Redis's own time per call (INFO commandstats, usec_per_call of
#    FCALL or EVALSHA),
#    which depends far less on the machine's other load. With two CPUs or
#    more, Redis runs on the last CPU and redis-benchmark on the others.
# 2. Memory per identity: for each algorithm, BENCH_IDENTITIES distinct
#    identities called once each (redis-cli --pipe) through the
#    extension's FCALL and then through the plain pattern:
#    (used_memory after - before) / BENCH_IDENTITIES and the ratio (target
#    for the fixed window: at most 1.25 times INCR + PEXPIRE).
# 3. E8 with the plain sliding script as the Redis side (bench.sh's E8 with
#    another denominator): TPS(SELECT rl_sliding_allow(...), 8 clients)
#    * (1 / TPS(SELECT 1, 8 clients) + 1 / TPS(plain sliding EVALSHA, 8
#    connections)), target >= 0.90; pgbench -n -M prepared -T BENCH_SECONDS
#    over TCP loopback, in every round after the Redis runs, with the Redis
#    figure of the same round. The E8 against the extension's own FCALL
#    is printed beside it, and so is the E8 of the floor: rl_bench_floor
#    (sql_tests/bench_redis/floor/, a fixture built here and not
#    installed), a C function that sends one EVALSHA of the plain sliding
#    script per call and waits for it as rl_redis does (one WaitEventSet
#    with the latch), and does nothing else: no checks, no keys of its
#    own, no statistics, no hiredis. No function that waits for Redis
#    through PostgreSQL's latch can go below the floor's cost, so its E8
#    is the most any can reach on this machine, and extension / floor is
#    how much of that rl_redis reaches (both PostgreSQL's side and Redis's:
#    the floor sends the plain script, rl_redis its own call).
#
# LIM = 100 calls per WINDOW_MS = 1 hour, so that a token bucket's or a
# GCRA's key lives long enough (36 s per token) for the memory figures and
# no identity is denied.
#
# Environment:
#   BENCH_ROUNDS      interleaved rounds (default 3)
#   BENCH_REQUESTS    requests per redis-benchmark run (default 200000)
#   BENCH_IDENTITIES  identities of the memory figures (default 100000)
#   BENCH_SECONDS     length of each pgbench run of the E8 figure (default 10)
set -uo pipefail
cd "$(dirname "$0")/.."

BENCH_ROUNDS=${BENCH_ROUNDS:-3}
BENCH_REQUESTS=${BENCH_REQUESTS:-200000}
BENCH_IDENTITIES=${BENCH_IDENTITIES:-100000}
BENCH_SECONDS=${BENCH_SECONDS:-10}
ALGORITHMS=(fixed sliding sliding_counter token_bucket gcra)
IDENTITIES=1000000
CLIENTS=8
LIM=100
WINDOW_MS=3600000
TARGET=0.75
MEMORY_TARGET=1.25
E8_TARGET=0.90

die() {
	echo "bench-redis: $*" >&2
	exit 1
}

for v in BENCH_ROUNDS BENCH_REQUESTS BENCH_IDENTITIES BENCH_SECONDS; do
	[[ ${!v} =~ ^[1-9][0-9]*$ ]] || die "$v must be a positive integer"
done

. sql_tests/lib.sh
rl_build_install || die "could not install the packages, build or install"
for tool in pgbench psql redis-benchmark "$RL_REDIS_CLI" /usr/bin/python3; do
	command -v "$tool" >/dev/null || die "$tool not found"
done
rl_cluster_start || die "could not start Redis and PostgreSQL"
psql -X -q -v ON_ERROR_STOP=1 -c "CREATE EXTENSION rl_redis" || die "CREATE EXTENSION rl_redis failed"

rcli() {
	"$RL_REDIS_CLI" -p "$RL_REDIS_PORT" "$@"
}

# With two CPUs or more, Redis runs on the last one and redis-benchmark on
# the others, so that neither takes the other's CPU (on a 2-CPU machine the
# figures of unpinned runs varied by a third from run to run)
# (the CPUs this script may use, as taskset lists them: "0-3", "2,5-7")
pinning="none (one CPU)"
cpus=()
if command -v taskset >/dev/null; then
	mapfile -t cpus < <(taskset -p -c $$ | sed 's/.*: //' | tr ',' '\n' |
		awk -F- '{ for (c = $1; c <= ($2 == "" ? $1 : $2); c++) print c }')
fi
if [ ${#cpus[@]} -ge 2 ]; then
	redis_pid=$(rcli INFO server | tr -d '\r' | sed -n 's/^process_id://p')
	taskset -a -p -c "${cpus[-1]}" "$redis_pid" >/dev/null || die "taskset of Redis failed"
	RL_BENCH_CLIENT_CPUS=$(IFS=,; echo "${cpus[*]:0:${#cpus[@]}-1}")
	export RL_BENCH_CLIENT_CPUS
	pinning="Redis on CPU ${cpus[-1]}, redis-benchmark on CPU(s) $RL_BENCH_CLIENT_CPUS"
fi

flush() {
	[ "$(rcli FLUSHALL SYNC)" = OK ] || die "FLUSHALL failed"
}

work=$RL_DIR/bench_redis
mkdir -p "$work" || die "cannot create $work"

# ---------------------------------------------------------------------------
# the commands: cmd_ext_ALG, the extension's, and cmd_plain_ALG, the plain
# pattern's on the same key, both with the identity bench:__rand_int__

for alg in "${ALGORITHMS[@]}"; do
	mapfile -t probe < <(rl_capture_call "$RL_REDIS_PORT" \
		"SELECT rl_${alg}_allow('bench:probe', $LIM, $WINDOW_MS)" '{bench:probe}')
	[ ${#probe[@]} -ge 4 ] || die "could not capture the Redis command of rl_${alg}_allow"
	declare -n ext=cmd_ext_$alg plain=cmd_plain_$alg
	ext=("${probe[@]//\{bench:probe\}/\{bench:__rand_int__\}}")
	sha=$(rcli SCRIPT LOAD "$(cat "sql_tests/bench_redis/$alg.lua")") &&
		[[ $sha =~ ^[0-9a-f]{40}$ ]] || die "SCRIPT LOAD of sql_tests/bench_redis/$alg.lua failed: $sha"
	plain=(EVALSHA "$sha" 1 "${ext[3]}" "$LIM" "$WINDOW_MS")
	# one call of each on the benchmark's key layout (the same key) must be
	# allowed
	for side in ext plain; do
		flush
		declare -n cmd=cmd_${side}_$alg
		[ "$(rl_allowed_decisions "$RL_REDIS_PORT" "${cmd[@]//__rand_int__/check}")" = 1 ] ||
			die "the $side command of $alg did not allow a call"
		unset -n cmd
	done
	unset -n ext plain
done
flush

# run_redis SIDE ALG REQUESTS: prints the requests per second of
# redis-benchmark replaying SIDE's command of ALG
run_redis() {
	local -n cmd=cmd_${1}_$2
	local rps us
	[ "$(rcli CONFIG RESETSTAT)" = OK ] || die "CONFIG RESETSTAT failed"
	read -r rps _ < <(rl_redis_benchmark "$RL_REDIS_PORT" "$CLIENTS" "$3" "$IDENTITIES" "${cmd[@]}")
	[ -n "${rps:-}" ] || die "redis-benchmark of the $1 command of $2 gave no figures"
	us=$(rcli INFO commandstats | tr -d '\r' |
		sed -n 's/^cmdstat_\(evalsha\|fcall\):.*usec_per_call=\([0-9.]*\).*/\2/p')
	[ -n "$us" ] || die "no EVALSHA or FCALL in Redis's commandstats after the $1 command of $2"
	echo "$rps $us"
}

# fmt3 VALUE...: the values with 3 decimals, on one line
fmt3() {
	printf '%.3f ' "$@" | sed 's/ $//'
}

# verdict VALUE OP TARGET: met or MISSED
verdict() {
	awk -v v="$1" -v t="$3" "BEGIN { print (v $2 t) ? \"met\" : \"MISSED\" }"
}

# ---------------------------------------------------------------------------
# what is measured

cpu_model=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)
echo "== rl_redis Redis-side benchmark"
echo "machine     : $(nproc) CPUs${cpu_model:+ ($cpu_model)}, $(uname -sr)"
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg) (before the runs)"
echo "PostgreSQL  : $(psql -X -A -t -c 'SHOW server_version'), rl_redis" \
	"$(psql -X -A -t -c "SELECT extversion FROM pg_extension WHERE extname = 'rl_redis'")"
echo "Redis       : $(rcli INFO server | tr -d '\r' | sed -n 's/^redis_version://p'), $(redis-benchmark --version | head -1)"
echo "runs        : redis-benchmark -c $CLIENTS -n $BENCH_REQUESTS -r $IDENTITIES, $BENCH_ROUNDS round(s)," \
	"loopback TCP; lim $LIM, window_ms $WINDOW_MS"
echo "pinning     : $pinning"
for alg in "${ALGORITHMS[@]}"; do
	declare -n ext=cmd_ext_$alg plain=cmd_plain_$alg
	echo "$alg: rl_${alg}_allow sends  $(rl_show_cmd "${ext[@]//__rand_int__/<n>}")"
	echo "$alg: plain pattern (sql_tests/bench_redis/$alg.lua)  $(rl_show_cmd "${plain[@]//__rand_int__/<n>}")"
	unset -n ext plain
done

# ---------------------------------------------------------------------------
# warm-up and measured rounds

echo
echo "warm-up ..."
for alg in "${ALGORITHMS[@]}"; do
	for side in ext plain; do
		run_redis "$side" "$alg" $((BENCH_REQUESTS / 10 > 10000 ? BENCH_REQUESTS / 10 : 10000)) >/dev/null
		flush
	done
done

# the floor of E8 (see above), built in place and declared by its path
rm -rf "$work/floor" && cp -r sql_tests/bench_redis/floor "$work/floor" &&
	make -s -C "$work/floor" with_llvm=no >/dev/null || die "could not build the floor fixture"
psql -X -q -v ON_ERROR_STOP=1 -c "CREATE FUNCTION rl_bench_floor(int, text, int8, int, int8)
	RETURNS int8 AS '$work/floor/rl_bench_floor.so' LANGUAGE C STRICT" ||
	die "could not declare rl_bench_floor"
[ "$(psql -X -A -t -c "SELECT rl_bench_floor($RL_REDIS_PORT, '${cmd_plain_sliding[1]}', 0, $LIM, $WINDOW_MS)")" = 1 ] ||
	die "rl_bench_floor did not allow a call"
flush

cat >"$work/select1.sql" <<<'SELECT 1;'
cat >"$work/sliding.sql" <<-EOT
	\set id random(1, $IDENTITIES)
	SELECT rl_sliding_allow('bench:' || :id, $LIM, $WINDOW_MS);
EOT
cat >"$work/floor.sql" <<-EOT
	\set id random(1, $IDENTITIES)
	SELECT rl_bench_floor($RL_REDIS_PORT, '${cmd_plain_sliding[1]}', :id, $LIM, $WINDOW_MS);
EOT

declare -A rps us ratio tps
declare -a e8 e8ext e8floor of_floor # indexed by round
row() {
	printf '  %-16s %12s %12s %8s %10s %10s\n' "$@"
}
for ((r = 1; r <= BENCH_ROUNDS; r++)); do
	echo
	echo "round $r of $BENCH_ROUNDS (requests per second, $CLIENTS connections; Redis's own time per"
	echo "call from its commandstats, microseconds)"
	row algorithm extension plain ratio "ext. us" "plain us"
	for alg in "${ALGORITHMS[@]}"; do
		for side in ext plain; do
			read -r rps[$side/$alg.$r] us[$side/$alg.$r] < <(run_redis "$side" "$alg" "$BENCH_REQUESTS") ||
				exit 1
			[ -n "${us[$side/$alg.$r]:-}" ] || exit 1
			flush
		done
		ratio[$alg.$r]=$(rl_calc "${rps[ext/$alg.$r]} / ${rps[plain/$alg.$r]}")
		row "$alg" "$(printf %.0f "${rps[ext/$alg.$r]}")" "$(printf %.0f "${rps[plain/$alg.$r]}")" \
			"$(printf %.3f "${ratio[$alg.$r]}")" "${us[ext/$alg.$r]}" "${us[plain/$alg.$r]}"
	done
	for w in select1 sliding floor; do
		tps[$w.$r]=$(rl_pgbench_tps "$work/$w.sql" "$CLIENTS" "$BENCH_SECONDS") || die "pgbench $w failed"
		flush
	done
	e8[$r]=$(rl_calc "${tps[sliding.$r]} * (1 / ${tps[select1.$r]} + 1 / ${rps[plain/sliding.$r]})")
	e8ext[$r]=$(rl_calc "${tps[sliding.$r]} * (1 / ${tps[select1.$r]} + 1 / ${rps[ext/sliding.$r]})")
	e8floor[$r]=$(rl_calc "${tps[floor.$r]} * (1 / ${tps[select1.$r]} + 1 / ${rps[plain/sliding.$r]})")
	of_floor[$r]=$(rl_calc "${tps[sliding.$r]} / ${tps[floor.$r]}")
	printf '  pgbench, %d clients: SELECT 1 %.0f TPS, SELECT rl_sliding_allow(...) %.0f TPS;' \
		"$CLIENTS" "${tps[select1.$r]}" "${tps[sliding.$r]}"
	printf ' E8 %.3f (plain sliding), %.3f (its own FCALL)\n' "${e8[$r]}" "${e8ext[$r]}"
	printf '  the floor: SELECT rl_bench_floor(...) %.0f TPS, E8 %.3f; extension / floor %.3f\n' \
		"${tps[floor.$r]}" "${e8floor[$r]}" "${of_floor[$r]}"
done

echo
echo "Redis throughput: median of $BENCH_ROUNDS round(s), requests per second; ratio = median of the"
echo "rounds' extension / plain (each round's pair ran one right after the other)"
printf '  %-16s %10s %10s %8s %8s  %-8s %-20s %8s %8s\n' algorithm extension plain ratio target verdict \
	"per round" "ext. us" "plain us"
for alg in "${ALGORITHMS[@]}"; do
	v=$(rl_median $(rl_values "$alg" ratio))
	printf '  %-16s %10.0f %10.0f %8.3f %8s  %-8s %-20s %8.2f %8.2f\n' "$alg" \
		"$(rl_median $(rl_values "ext/$alg" rps))" "$(rl_median $(rl_values "plain/$alg" rps))" "$v" \
		">= $TARGET" "$(verdict "$v" ">=" "$TARGET")" "$(fmt3 $(rl_values "$alg" ratio))" \
		"$(rl_median $(rl_values "ext/$alg" us))" "$(rl_median $(rl_values "plain/$alg" us))"
done

# ---------------------------------------------------------------------------
# memory per identity

# resp SIDE ALG: SIDE's command of ALG for the identities 1 to
# BENCH_IDENTITIES, in the Redis protocol (for redis-cli --pipe)
resp() {
	local -n cmd=cmd_${1}_$2
	printf '%s\n' "${cmd[@]}" | LC_ALL=C awk -v n="$BENCH_IDENTITIES" '
		{ arg[NR] = $0 }
		END {
			for (i = 1; i <= n; i++) {
				printf "*%d\r\n", NR
				for (j = 1; j <= NR; j++) {
					a = arg[j]
					gsub(/__rand_int__/, i, a)
					printf "$%d\r\n%s\r\n", length(a), a
				}
			}
		}'
}

# used_memory: Redis's INFO used_memory
used_memory() {
	rcli INFO memory | tr -d '\r' | sed -n 's/^used_memory://p'
}

# memory SIDE ALG: bytes per identity after BENCH_IDENTITIES identities
# called once each through SIDE's command of ALG, from an empty Redis; a
# second try when keys expired meanwhile (a fixed window that ended)
memory() {
	local try before after out keys
	for try in 1 2; do
		flush
		before=$(used_memory)
		out=$(resp "$1" "$2" | rcli --pipe 2>&1)
		after=$(used_memory)
		keys=$(rcli DBSIZE)
		grep -q "errors: 0, replies: $BENCH_IDENTITIES\$" <<<"$out" ||
			{ echo "$out" >&2; die "redis-cli --pipe of the $1 command of $2 failed"; }
		[ "$keys" = "$BENCH_IDENTITIES" ] && break
	done
	[ "$keys" = "$BENCH_IDENTITIES" ] ||
		die "the $1 command of $2 left $keys keys for $BENCH_IDENTITIES identities"
	flush
	rl_calc "($after - $before) / $BENCH_IDENTITIES"
}

echo
echo "memory per identity: (used_memory after - before) / $BENCH_IDENTITIES identities called once each, bytes"
printf '  %-16s %10s %10s %8s %8s  %s\n' algorithm extension plain ratio target verdict
for alg in "${ALGORITHMS[@]}"; do
	m_ext=$(memory ext "$alg") || exit 1
	m_plain=$(memory plain "$alg") || exit 1
	v=$(rl_calc "$m_ext / $m_plain")
	if [ "$alg" = fixed ]; then
		t="<= $MEMORY_TARGET" verd=$(verdict "$v" "<=" "$MEMORY_TARGET")
	else
		t=- verd=
	fi
	printf '  %-16s %10.0f %10.0f %8.2f %8s  %s\n' "$alg" "$m_ext" "$m_plain" "$v" "$t" "$verd"
done

# ---------------------------------------------------------------------------
# E8

echo
echo "E8 = TPS(SELECT rl_sliding_allow(...), $CLIENTS clients) * (1 / TPS(SELECT 1, $CLIENTS clients)"
echo "     + 1 / TPS(Redis call, $CLIENTS connections)); pgbench -T $BENCH_SECONDS, median of $BENCH_ROUNDS round(s)"
printf '  %-34s %8.3f %8s  %-8s %s\n' "with the plain sliding EVALSHA" \
	"$(rl_median "${e8[@]}")" ">= $E8_TARGET" "$(verdict "$(rl_median "${e8[@]}")" ">=" "$E8_TARGET")" \
	"$(fmt3 "${e8[@]}")"
printf '  %-34s %8.3f %8s  %-8s %s\n' "with its own FCALL (as bench.sh)" \
	"$(rl_median "${e8ext[@]}")" "" "" "$(fmt3 "${e8ext[@]}")"
printf '  %-34s %8.3f %8s  %-8s %s\n' "the floor, with the plain sliding" \
	"$(rl_median "${e8floor[@]}")" "" "" "$(fmt3 "${e8floor[@]}")"
printf '  %-34s %8.3f %8s  %-8s %s\n' "extension / floor (TPS)" \
	"$(rl_median "${of_floor[@]}")" "" "" "$(fmt3 "${of_floor[@]}")"
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg) (after the runs)"
exit 0
