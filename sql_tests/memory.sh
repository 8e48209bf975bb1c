#!/usr/bin/env bash
# Measures how much Redis memory one identity's state takes, for every
# algorithm at lim 10, 100 and 10000, and prints a markdown table (bytes per
# identity, as MEMORY USAGE <key> SAMPLES 0 reports them: key, value and
# Redis's per-key overhead). A measurement, not a test.
#
# Usage: bash sql_tests/memory.sh   (from the source tree; builds and
# installs the extension first, like run_tests.sh, then starts a throwaway
# Redis and PostgreSQL through lib.sh)
#
# Each identity is filled to its limit with a one-day window:
#   fixed, token_bucket, gcra, sliding_counter  one call with cost = lim
#   sliding      one call with cost = lim, which records lim members, the
#                same as lim calls of cost 1 (members are "<µs>-<seq>" either
#                way); used for speed
#   concurrency  lim slots acquired in one open transaction (lease 1 h),
#                measured before the COMMIT gives them back
# The identity is 'tenant1:user7' for every row (the key name is part of the
# figure); the key of a limit given as arguments carries it, e.g.
# rl:sliding:{tenant1:user7}:100/86400000, rl:concurrency:{tenant1:user7}:100/3600000.
set -uo pipefail
cd "$(dirname "$0")/.."

. sql_tests/lib.sh
rl_build_install || exit 1
rl_cluster_start || exit 1

IDENT='tenant1:user7'
DAY_MS=86400000
LIMS=(10 100 10000)
ALGS=(fixed sliding token_bucket gcra sliding_counter concurrency)

psql() { command psql -X -q -v ON_ERROR_STOP=1 "$@"; }
rcli() { redis-cli -p "$RL_REDIS_PORT" "$@"; }

LEASE_MS=3600000 # rl_redis.max_lease (1 h) by default: the longest lease allowed

psql -c "CREATE EXTENSION rl_redis" >/dev/null || exit 1
VERSION=$(sed -n "s/^default_version = '\(.*\)'$/\1/p" rl_redis.control)
[ "$(psql -At -c "SELECT extversion FROM pg_extension WHERE extname = 'rl_redis'")" = "$VERSION" ] ||
	{ echo "rl_redis $VERSION (rl_redis.control) is not what got installed" >&2; exit 1; }

# measure ALG LIM: prints "<bytes> <encoding>"
measure() {
	local alg=$1 lim=$2 key out remaining kind=$1
	# the kind in the key of an algorithm whose state changed layout
	case $alg in fixed | sliding_counter | token_bucket | gcra) kind=$alg.2 ;; esac
	if [ "$alg" = concurrency ]; then
		key="rl:$kind:{$IDENT}:$lim/$LEASE_MS"
	else
		key="rl:$kind:{$IDENT}:$lim/$DAY_MS"
	fi
	rcli DEL "$key" >/dev/null
	if [ "$alg" = concurrency ]; then
		out=$(psql -At <<-EOF
			BEGIN;
			SELECT count(*) FILTER (WHERE rl_concurrency_acquire_allow('$IDENT', $lim, $LEASE_MS))
			  FROM generate_series(1, $lim);
			\! redis-cli -p $RL_REDIS_PORT MEMORY USAGE '$key' SAMPLES 0
			\! redis-cli -p $RL_REDIS_PORT OBJECT ENCODING '$key'
			COMMIT;
		EOF
		) || return 1
		# lines: slots taken, bytes, encoding
		set -- $out
		[ "$1" = "$lim" ] || { echo "only $1 of $lim slots taken" >&2; return 1; }
		echo "$2 $3"
	else
		remaining=$(psql -At -c "SELECT (r).remaining FROM rl_$alg('$IDENT', $lim, $DAY_MS, $lim) AS r") || return 1
		[ "$remaining" = 0 ] || { echo "$alg lim $lim: remaining $remaining after filling" >&2; return 1; }
		echo "$(rcli MEMORY USAGE "$key" SAMPLES 0) $(rcli OBJECT ENCODING "$key")"
	fi
	rcli DEL "$key" >/dev/null
}

declare -A bytes enc
for alg in "${ALGS[@]}"; do
	for lim in "${LIMS[@]}"; do
		read -r b e < <(measure "$alg" "$lim") || exit 1
		[ -n "${b:-}" ] || { echo "no figure for $alg lim $lim" >&2; exit 1; }
		bytes[$alg,$lim]=$b
		enc[$alg,$lim]=$e
	done
done

echo
echo "Redis memory per identity, bytes (MEMORY USAGE ... SAMPLES 0; $(redis-server --version | awk '{print $1, $3}'), key rl:<kind>:{$IDENT}:<lim>/<window or lease ms>, filled to lim)"
echo
printf '| %-15s |' algorithm
for lim in "${LIMS[@]}"; do printf ' %9s |' "lim $lim"; done
echo
printf '|%s|' "-----------------"
for lim in "${LIMS[@]}"; do printf '%s|' "----------:"; done
echo
for alg in "${ALGS[@]}"; do
	printf '| %-15s |' "$alg"
	for lim in "${LIMS[@]}"; do printf ' %9s |' "${bytes[$alg,$lim]}"; done
	echo
done
echo
echo "Encodings:"
for alg in "${ALGS[@]}"; do
	printf '  %-15s' "$alg"
	for lim in "${LIMS[@]}"; do printf ' lim %s: %s;' "$lim" "${enc[$alg,$lim]}"; done
	echo
done
