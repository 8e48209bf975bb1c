#!/usr/bin/env bash
# The batch benchmark (`make bench`). A measurement, not a test: it prints
# figures and exits 0 whether or not the target is met; non-zero only when
# something could not be started or run. It does not build: it uses the
# installed library, which must have rl_check_many (1.5).
#
# On a throwaway Redis and PostgreSQL (sql_tests/lib.sh), for the policies
# bench (fixed) and bench_sc (sliding_counter), 100000000 per 60000 ms (never
# denied), it measures decisions per second of:
#   B    SELECT count(*) FROM rl_check_many(policy, ids), 1 client; ids: 10000
#        distinct identities, a literal in the script (-M prepared: parsed once)
#   P    redis-benchmark -P 100 -r 100000, -c 1 and -c 8, sending the command
#        of rl_check(policy, <n>), taken from SLOWLOG as bench.sh does
#   S    redis-benchmark -P 20 -c 1 sending the batch script's call of 500 keys
#        (the extension sends 10000 identities as 20 such calls, pipelined): a
#        2-identity call's command from SLOWLOG, widened to 500 keys <n>
#   1x1  SELECT count(*) FROM generate_series(1, 10000) g, rl_check(policy, g)
# and the ratios B/P (P: the better of -c 1 and -c 8; target >= 0.80) and B/S.
# Identities are 12-digit numbers, like redis-benchmark's __rand_int__. Every
# run starts from an empty Redis; a pgbench run must have made the script calls
# (EVAL, FCALL in INFO commandstats) its transactions imply.
#
# Environment: BENCH_SECONDS  length of every measured run (default 10)
#              BENCH_ROUNDS   rounds of all runs, interleaved (default 3; medians)
set -uo pipefail
cd "$(dirname "$0")/.."

BENCH_SECONDS=${BENCH_SECONDS:-10}
BENCH_ROUNDS=${BENCH_ROUNDS:-3}
BATCH=10000 # identities per rl_check_many call
CHUNK=500   # keys per batch script call (RL_BATCH_KEYS in src/engine.c)
IDENTITIES=100000
WARMUP_SECONDS=2
TARGET=0.80
POLICIES=(bench bench_sc)
declare -A ALG=([bench]=fixed [bench_sc]=sliding_counter)
WORKLOADS=(B P1 P8 S one)

die() { echo "bench_batch: $*" >&2; exit 1; }

[[ $BENCH_SECONDS =~ ^[1-9][0-9]*$ ]] || die "BENCH_SECONDS must be a positive integer"
[[ $BENCH_ROUNDS =~ ^[1-9][0-9]*$ ]] || die "BENCH_ROUNDS must be a positive integer"

. sql_tests/lib.sh
for tool in pg_config pgbench psql redis-server redis-cli redis-benchmark /usr/bin/python3; do
	command -v "$tool" >/dev/null || die "$tool not found"
done
installed_so="$(pg_config --pkglibdir)/rl_redis.so"
[ -f "$installed_so" ] || die "$installed_so is not installed"
so_sum=$(md5sum <"$installed_so")

rl_cluster_start || die "could not start Redis and PostgreSQL"

rcli() { redis-cli -p "$RL_REDIS_PORT" "$@"; }
q() { psql -X -q -A -t -v ON_ERROR_STOP=1 "$@"; }
flush() { [ "$(rcli FLUSHALL)" = OK ] && rcli CONFIG RESETSTAT >/dev/null || die "FLUSHALL failed"; }
median() {
	printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END { if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}
calc() { awk "BEGIN { printf \"%.6f\", $1 }"; }
show_cmd() { local a out=; for a in "$@"; do out+="${a:-''} "; done; echo "${out% }"; }

q -c 'CREATE EXTENSION rl_redis' || die "CREATE EXTENSION failed"
[ "$(q -c "SELECT to_regprocedure('rl_check_many(text,text[],integer)') IS NOT NULL")" = t ] ||
	die "the installed rl_redis has no rl_check_many(text, text[], integer) (1.5 needed; this script does not build)"
for p in "${POLICIES[@]}"; do
	q -c "INSERT INTO rl_policy (name, algorithm, lim, window_ms) VALUES ('$p', '${ALG[$p]}', 100000000, 60000)" ||
		die "cannot define the policy $p"
done

work="$RL_DIR/bench_batch"
mkdir -p "$work" || die "cannot create $work"
ids=$(q -c "SELECT array_agg(lpad(g::text, 12, '0') ORDER BY g)::text FROM generate_series(1, $BATCH) g") &&
	[ -n "$ids" ] || die "cannot build the identities"
for p in "${POLICIES[@]}"; do
	echo "SELECT count(*) FROM rl_check_many('$p', '$ids'::text[]);" >"$work/B.$p.sql"
	echo "SELECT count(*) FROM generate_series(1, $BATCH) g, rl_check('$p', lpad(g::text, 12, '0'));" >"$work/one.$p.sql"
	echo "SELECT count(*), count(*) FILTER (WHERE allowed) FROM rl_check_many('$p', '$ids'::text[]);" >"$work/check.sql"
	[ "$(q -f "$work/check.sql")" = "$BATCH|$BATCH" ] ||
		die "rl_check_many('$p', <$BATCH identities>) did not allow $BATCH identities"
done

# capture SQL: prints, one argument a line, the newest FCALL on a key of an
# identity probe* that SQL (run twice: the first may load the library) sends
capture() {
	local old
	old=$(rcli CONFIG GET slowlog-log-slower-than | tail -1)
	rcli CONFIG SET slowlog-log-slower-than 0 >/dev/null && rcli SLOWLOG RESET >/dev/null || return 1
	q -c "$1" -c "$1" >/dev/null || return 1
	rcli CONFIG SET slowlog-log-slower-than "$old" >/dev/null || return 1
	rcli --json SLOWLOG GET 128 | /usr/bin/python3 -c '
import json, sys
for args in (e[3] for e in json.load(sys.stdin)):  # newest first
    if args[0].upper() == "FCALL" and any("{probe" in a for a in args):
        if len(args) >= 32 or any(a.endswith("more bytes)") or "\n" in a for a in args):
            sys.exit("the command is too long for SLOWLOG: %r" % args)
        print("\n".join(args)); sys.exit(0)
sys.exit("no FCALL on a key of a probe identity in SLOWLOG")'
}

# cmd_P_<policy>: rl_check's command; cmd_S_<policy>: the 500-key batch call
for p in "${POLICIES[@]}"; do
	mapfile -t one < <(capture "SELECT rl_check('$p', 'probe')")
	[ ${#one[@]} -ge 4 ] && [ "${one[2]}" = 1 ] || die "could not capture the command of rl_check('$p', ...)"
	declare -n cmd=cmd_P_$p
	cmd=("${one[@]//\{probe\}/\{__rand_int__\}}")
	[ "$(rl_allowed_decisions "$RL_REDIS_PORT" "${cmd[@]//__rand_int__/check}")" = 1 ] ||
		die "replaying rl_check('$p')'s command did not allow"
	unset -n cmd
	mapfile -t two < <(capture "SELECT count(*) FROM rl_check_many('$p', ARRAY['probe1', 'probe2'])")
	[ ${#two[@]} -ge 5 ] && [ "${two[2]}" = 2 ] && [ "${two[4]}" = "${two[3]//\{probe1\}/\{probe2\}}" ] ||
		die "could not capture the command of rl_check_many('$p', ...): ${two[*]}"
	declare -n cmd=cmd_S_$p
	cmd=(FCALL "${two[1]}" $CHUNK)
	for ((i = 0; i < CHUNK; i++)); do cmd+=("${two[3]//\{probe1\}/\{__rand_int__\}}"); done
	cmd+=("${two[@]:5}")
	[ "$(rl_allowed_decisions "$RL_REDIS_PORT" "${cmd[@]//__rand_int__/check}")" = $CHUNK ] ||
		die "replaying the widened batch command of '$p' did not give $CHUNK allowed decisions"
	unset -n cmd
done
flush

# run_pgbench SCRIPT SECONDS CALLS: prints the TPS; Redis must have counted
# at least CALLS script calls per transaction
run_pgbench() {
	local out tps n failed calls
	out=$(pgbench -n -M prepared -T "$2" -c 1 -f "$work/$1.sql" 2>&1) ||
		{ echo "$out" >&2; die "pgbench $1 failed"; }
	failed=$(sed -n 's/^number of failed transactions: \([0-9]*\).*/\1/p' <<<"$out")
	n=$(sed -n 's/^number of transactions actually processed: \([0-9]*\).*/\1/p' <<<"$out")
	tps=$(sed -n 's/^tps = \([0-9.]*\) (without initial connection time)$/\1/p' <<<"$out")
	[ -n "$tps" ] && [ -n "$n" ] && [ "${failed:-0}" = 0 ] ||
		{ echo "$out" >&2; die "pgbench $1: no TPS or failed transactions"; }
	calls=$(rcli INFO commandstats | awk -F'[:=,]' '/^cmdstat_(eval|evalsha|fcall):/ { n += $3 } END { print n + 0 }')
	[ "$calls" -ge $((n * $3)) ] || die "pgbench $1: Redis counted fewer than $3 script calls per transaction"
	echo "$tps"
}

# run_redis CMDVAR CLIENTS PIPELINE REQUESTS: prints the rps of redis-benchmark
run_redis() {
	local -n cmd=$1
	local out
	out=$(redis-benchmark -p "$RL_REDIS_PORT" -c "$2" -P "$3" -n "$4" -r "$IDENTITIES" --csv "${cmd[@]}" 2>&1) ||
		{ echo "$out" >&2; die "redis-benchmark $1 -c $2 failed"; }
	[ "$(rcli DBSIZE)" -gt 0 ] || { echo "$out" >&2; die "redis-benchmark $1 -c $2 wrote no keys"; }
	awk -F, '/^"test"/ { for (i = 1; i <= NF; i++) { gsub(/"/, "", $i); col[$i] = NF - i }; next }
		/^"/ && ("rps" in col) { gsub(/"/, ""); print $(NF - col["rps"]); found = 1 }
		END { exit !found }' <<<"$out" || { echo "$out" >&2; die "cannot read redis-benchmark's CSV"; }
}

# measure WORKLOAD POLICY SECONDS: sets decided, the decisions/s of one run
declare -A nreq
measure() {
	local w=$1 p=$2 s=$3 v n
	case $w in
	B) v=$(run_pgbench "B.$p" "$s" $((BATCH / CHUNK))) && decided=$(calc "$v * $BATCH") ;;
	one) v=$(run_pgbench "one.$p" "$s" $BATCH) && decided=$(calc "$v * $BATCH") ;;
	P1 | P8) v=$(run_redis "cmd_P_$p" "${w#P}" 100 "${nreq[$w.$p]:-50000}") && decided=$v ;;
	S) v=$(run_redis "cmd_S_$p" 1 $((BATCH / CHUNK)) "${nreq[$w.$p]:-200}") && decided=$(calc "$v * $CHUNK") ;;
	esac || exit 1
	n=$(awk -v r="$v" -v s="$BENCH_SECONDS" 'BEGIN { print int(r * s) }') # next run: about BENCH_SECONDS
	[[ $w == P* ]] && nreq[$w.$p]=$((n < 10000 ? 10000 : n))
	[ "$w" = S ] && nreq[$w.$p]=$((n < 100 ? 100 : n))
	flush
}

# ---------------------------------------------------------------------------
cpu_model=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)
echo "== rl_redis batch benchmark"
echo "machine     : $(nproc) CPUs${cpu_model:+ ($cpu_model)}, $(uname -sr)"
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg) (before the runs)"
echo "PostgreSQL  : $(q -c 'SHOW server_version'), rl_redis $(q -c "SELECT extversion FROM pg_extension WHERE extname = 'rl_redis'")"
echo "Redis       : $(rcli INFO server | tr -d '\r' | sed -n 's/^redis_version://p'), $(redis-benchmark --version | head -1)"
echo "runs        : ${BENCH_SECONDS} s each, $BENCH_ROUNDS round(s), loopback TCP, pgbench -n -M prepared -c 1"
for p in "${POLICIES[@]}"; do
	declare -n c1=cmd_P_$p c2=cmd_S_$p
	echo "$p (${ALG[$p]})"
	echo "  rl_check sends      $(show_cmd "${c1[@]//__rand_int__/<n>}")"
	echo "  rl_check_many sends ${c2[*]:0:3} ${c2[3]//__rand_int__/<n>} ... ($CHUNK keys) $(show_cmd "${c2[@]:$((CHUNK + 3))}")"
	unset -n c1 c2
done

echo
echo "warm-up (${WARMUP_SECONDS} s per pgbench run) ..."
for p in "${POLICIES[@]}"; do
	for w in "${WORKLOADS[@]}"; do measure "$w" "$p" "$WARMUP_SECONDS"; done
done

declare -A val
for ((r = 1; r <= BENCH_ROUNDS; r++)); do
	echo "round $r of $BENCH_ROUNDS ..."
	for p in "${POLICIES[@]}"; do
		for w in "${WORKLOADS[@]}"; do
			measure "$w" "$p" "$BENCH_SECONDS"
			val[$w.$p.$r]=$decided
		done
		val[P.$p.$r]=$(awk -v a="${val[P1.$p.$r]}" -v b="${val[P8.$p.$r]}" 'BEGIN { print (a > b) ? a : b }')
		val[BP.$p.$r]=$(calc "${val[B.$p.$r]} / ${val[P.$p.$r]}")
		val[BS.$p.$r]=$(calc "${val[B.$p.$r]} / ${val[S.$p.$r]}")
	done
done

# ---------------------------------------------------------------------------
# fig FORMAT KEY: "median (min..max)" over the rounds, or the one value
fig() {
	local v=() r
	for ((r = 1; r <= BENCH_ROUNDS; r++)); do v+=("${val[$2.$r]}"); done
	mapfile -t v < <(printf '%s\n' "${v[@]}" | sort -g)
	[ ${#v[@]} -eq 1 ] && printf "$1" "${v[0]}" || printf "$1 ($1..$1)" "$(median "${v[@]}")" "${v[0]}" "${v[-1]}"
}

echo
echo "decisions per second$([ "$BENCH_ROUNDS" -gt 1 ] && echo ": median of $BENCH_ROUNDS rounds (min..max)")"
for p in "${POLICIES[@]}"; do
	echo "  $p (${ALG[$p]})"
	printf '    %-58s %s\n' "B    rl_check_many, $BATCH identities per call, 1 client" "$(fig %.0f "B.$p")" \
		"P    FCALL of rl_check, redis-benchmark -P 100 -c 1" "$(fig %.0f "P1.$p")" \
		"P    FCALL of rl_check, redis-benchmark -P 100 -c 8" "$(fig %.0f "P8.$p")" \
		"S    $CHUNK-key batch FCALL, redis-benchmark -P $((BATCH / CHUNK)) -c 1" "$(fig %.0f "S.$p")" \
		"1x1  rl_check one by one, $BATCH per statement" "$(fig %.0f "one.$p")"
done

echo
printf '%-16s %8s %8s  %-8s %s\n' "ratio" "value" "target" "verdict" "per round"
for p in "${POLICIES[@]}"; do
	for k in BP BS; do
		v=() per=
		for ((r = 1; r <= BENCH_ROUNDS; r++)); do v+=("${val[$k.$p.$r]}"); per+="$(printf '%.3f' "${v[-1]}") "; done
		v=$(median "${v[@]}") target=- verdict=-
		[ $k = BP ] && target=">= $TARGET" verdict=$(awk -v v="$v" -v t=$TARGET 'BEGIN { print (v >= t) ? "met" : "MISSED" }')
		printf '%-16s %8.3f %8s  %-8s %s\n' "${k:0:1}/${k:1} $p" "$v" "$target" "$verdict" "${per% }"
	done
done
echo "(P: the better of -c 1 and -c 8 in that round; each round's ratio comes from runs made one after the other)"
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg) (after the runs)"
if [ "$(md5sum <"$installed_so")" != "$so_sum" ]; then
	echo "WARNING: $installed_so was replaced during the run (another make install?);"
	echo "         backends started after that ran the other build, so the figures may mix builds."
fi
exit 0
