#!/usr/bin/env bash
# The demo (`make demo`): installs missing packages, builds and installs the
# extension, starts a throwaway Redis and PostgreSQL on free loopback ports
# (sql_tests/lib.sh), and shows what rl_redis does with psql:
#   a) a sliding-window limit on tenant-scoped identities
#   b) two sessions sharing one quota
#   c) the fixed window's boundary burst next to the sliding window
#   d) a named policy guarding a table
#   e) the keys in Redis
# Runs unattended; both servers are stopped and removed on exit.
set -euo pipefail
cd "$(dirname "$0")/.."

. sql_tests/lib.sh
rl_build_install
rl_cluster_start

# psql without ~/.psqlrc, stopping at the first error
q() {
	psql -X -q -v ON_ERROR_STOP=1 "$@"
}
rcli() {
	redis-cli -p "$RL_REDIS_PORT" "$@"
}
section() {
	echo
	echo "==== $*"
}
say() {
	echo "-- $*"
}

# now on the Redis clock, in milliseconds (the clock the scripts use)
redis_now_ms() {
	rcli TIME | tr -d '\r' | {
		read -r s
		read -r us
		echo $((s * 1000 + us / 1000))
	}
}

# sleep_ms N: sleeps N milliseconds
sleep_ms() {
	sleep "$(printf '%d.%03d' $(($1 / 1000)) $(($1 % 1000)))"
}

echo "rl_redis demo: PostgreSQL on 127.0.0.1:$PGPORT, Redis on 127.0.0.1:$RL_REDIS_PORT (throwaway, in $RL_DIR)"
q -c 'CREATE EXTENSION rl_redis'
q -c 'SELECT * FROM rl_redis_ping()'

# ---------------------------------------------------------------------------
section "a) 5 calls per 60 s, sliding window, on tenant-scoped identities"
say "Each call takes one unit from 'tenant:acme:user:42'; the 6th is denied and"
say "retry_after_ms says when a unit comes back. Denied calls take nothing."
{
	echo '\pset footer off'
	echo '\set ECHO queries'
	for _ in 1 2 3 4 5 6; do
		echo "SELECT * FROM rl_sliding('tenant:acme:user:42', 5, 60000);"
	done
	echo "\\echo '-- The 6th call is denied: retry_after_ms is the wait until the oldest of the 5'"
	echo "\\echo '-- units leaves the 60 s window (the calls above took a few ms at most).'"
	echo '\echo'
	echo "\\echo '-- Another tenant''s user 42 has a quota of its own:'"
	echo "SELECT * FROM rl_sliding('tenant:globex:user:42', 5, 60000);"
} | q

# ---------------------------------------------------------------------------
section "b) two sessions, one quota"
say "Two psql sessions (two backends, each with its own Redis connection) call"
say "rl_sliding_allow('tenant:acme:report-export', 5, 60000) in turn, 8 calls in all."

# A session is a psql process reading SQL from one FIFO and writing one line
# of unaligned output per query to another.
declare -A sess_in sess_out sess_pid
open_session() {
	local name=$1 in_fd out_fd fd
	mkfifo "$RL_DIR/$name.in" "$RL_DIR/$name.out"
	(
		# not the other sessions' ends: each psql must see EOF when its
		# own input is closed
		for fd in "${sess_in[@]}" "${sess_out[@]}"; do
			eval "exec $fd>&-"
		done
		PGAPPNAME="demo session $name" exec psql -X -q -A -t -F ' ' \
			-v ON_ERROR_STOP=1
	) <"$RL_DIR/$name.in" >"$RL_DIR/$name.out" 2>&1 &
	sess_pid[$name]=$!
	exec {in_fd}>"$RL_DIR/$name.in"
	exec {out_fd}<"$RL_DIR/$name.out"
	sess_in[$name]=$in_fd
	sess_out[$name]=$out_fd
}
# ask NAME SQL: runs SQL (one result row) in session NAME and prints the row
ask() {
	local line
	echo "$2" >&"${sess_in[$1]}"
	if ! read -r -t 10 -u "${sess_out[$1]}" line; then
		echo "demo: session $1 did not answer" >&2
		return 1
	fi
	echo "$line"
}
close_session() {
	local in_fd=${sess_in[$1]} out_fd=${sess_out[$1]}
	exec {in_fd}>&-
	wait "${sess_pid[$1]}"
	exec {out_fd}<&-
}

open_session A
open_session B
allowed=0
for i in 1 2 3 4 5 6 7 8; do
	s=A
	[ $((i % 2)) = 0 ] && s=B
	read -r pid ok < <(ask "$s" "SELECT pg_backend_pid(), rl_sliding_allow('tenant:acme:report-export', 5, 60000);")
	[ "$ok" = t ] && allowed=$((allowed + 1))
	printf '   call %d  session %s (backend pid %s): %s\n' "$i" "$s" "$pid" \
		"$([ "$ok" = t ] && echo allowed || echo denied)"
done
close_session A
close_session B
say "together: $allowed of 8 calls allowed (limit 5); the quota lives in Redis, not in a session."

# ---------------------------------------------------------------------------
section "c) the fixed window's boundary burst, next to the sliding window"
say "Limit 5 per 2000 ms. Fixed windows are aligned on the Redis clock:"
say "window start = floor(now_ms / 2000) * 2000. 5 calls ~1700 ms into one fixed window,"
say "5 more ~300 ms into the next one: the fixed window starts counting afresh, the"
say "sliding window still sees the first 5 calls of ~0.6 s ago."

# burst TAG: 5 calls of each function in one statement (a volatile function
# in the select list runs once per row); prints the table and sets
# fixed_n / sliding_n to the numbers allowed
burst() {
	local out
	out=$(q -v fixed="$1:fixed" -v sliding="$1:sliding" <<-'EOF'
		\pset footer off
		SELECT n AS call,
		       rl_fixed_allow(:'fixed', 5, 2000) AS fixed_allowed,
		       rl_sliding_allow(:'sliding', 5, 2000) AS sliding_allowed
		FROM generate_series(1, 5) AS n;
	EOF
	)
	echo "$out"
	fixed_n=$(awk -F'|' '$1 ~ /^ *[0-9]+ *$/ && $2 ~ /t/' <<<"$out" | wc -l)
	sliding_n=$(awk -F'|' '$1 ~ /^ *[0-9]+ *$/ && $3 ~ /t/' <<<"$out" | wc -l)
}

done_ok=
for attempt in 1 2 3; do
	tag="demo:burst$attempt"
	now=$(redis_now_ms)
	sleep_ms $(((1700 - now % 2000 + 2000) % 2000))
	t0=$(redis_now_ms)
	window=$((t0 / 2000 * 2000))
	say "batch 1, $((t0 - window)) ms into the fixed window that starts at $window (ms, Redis clock):"
	burst "$tag"
	fixed_total=$fixed_n
	sliding_total=$sliding_n
	t1=$(redis_now_ms)
	if [ $((t1 / 2000 * 2000)) != "$window" ]; then
		say "(batch 1 ran past the window's end: the machine is slow; trying again)"
		continue
	fi
	sleep_ms $((window + 2000 + 300 - t1))
	t2=$(redis_now_ms)
	say "batch 2, $((t2 - window - 2000)) ms into the next fixed window, $((t2 - t0)) ms after batch 1:"
	burst "$tag"
	fixed_total=$((fixed_total + fixed_n))
	sliding_total=$((sliding_total + sliding_n))
	t3=$(redis_now_ms)
	if [ $((t3 / 2000 * 2000)) != $((window + 2000)) ]; then
		say "(batch 2 ran past the next window's end: the machine is slow; trying again)"
		continue
	fi
	echo
	printf '   fixed window  : %2d of 10 calls allowed within %d ms -- twice the limit around the boundary\n' \
		"$fixed_total" $((t3 - t0))
	printf '   sliding window: %2d of 10 calls allowed -- never more than 5 in any 2000 ms\n' \
		"$sliding_total"
	done_ok=1
	break
done
[ -n "$done_ok" ] || { echo "demo: could not place the bursts around a window boundary" >&2; exit 1; }

# ---------------------------------------------------------------------------
section "d) a named policy guarding a table"
say "A row of rl_policy names the limit; an AFTER INSERT row trigger charges every"
say "insert into llm_requests to its tenant, whichever code path inserts. The 4th insert is"
say "refused with SQLSTATE PT429 (HTTP 429 for PostgREST), and the whole statement"
say "fails, so the units its other rows took are given back."
psql -X -q -v ON_ERROR_STOP=0 <<'SQL'
INSERT INTO rl_policy (name, algorithm, lim, window_ms, description)
    VALUES ('llm.free', 'sliding', 3, 60000, 'free tier: 3 model calls a minute');
CREATE TABLE llm_requests (id serial PRIMARY KEY, tenant_id text NOT NULL, prompt text);
CREATE TRIGGER llm_requests_rate_limit AFTER INSERT ON llm_requests
    FOR EACH ROW EXECUTE FUNCTION rl_guard('llm.free', 'tenant_id');
INSERT INTO llm_requests (tenant_id, prompt) VALUES ('acme', 'one'), ('acme', 'two');
INSERT INTO llm_requests (tenant_id, prompt) VALUES ('acme', 'three'), ('acme', 'four');
\echo -- SQLSTATE of the refused insert: :LAST_ERROR_SQLSTATE
SELECT tenant_id, count(*) AS rows_in_table FROM llm_requests GROUP BY 1;
SELECT * FROM rl_check('llm.free', 'acme', 0);
SQL

# ---------------------------------------------------------------------------
section "e) the keys in Redis"
say "<prefix><kind>:{<identity>}:<lim>/<window_ms> for a limit given as arguments,"
say "<prefix><kind>:{<identity>}:<policy>:/<window_ms> for a named sliding policy: two limits on one"
say "identity are two counters. fixed.2 = a packed string of 9 to 15 bytes (units used and the lim in"
say "1 to 4 bytes each, the key's epoch, whose window is the state's; on the test clock 8 more bytes"
say "hold the window's number), sliding = sorted set (one member per unit, score = time in microseconds);"
say "every key expires on its own (SET ... PX, PEXPIRE) once its window has passed."
printf '   %-56s %-6s %s\n' key type "ttl ms"
rcli --scan --pattern 'rl:*' | sort | while read -r key; do
	printf '   %-56s %-6s %s\n' "$key" "$(rcli TYPE "$key")" "$(rcli PTTL "$key")"
done
say "e.g. the fixed-window state of batch 2 (5 per 2000 ms), unpacked:"
rcli EVAL "local v = redis.call('GET', KEYS[1]) if not v then return {'(expired)'} end
local short = #v <= 15
local k = short and (#v - 7) / 2 or (#v - 15) / 2
local n, l, e, w = struct.unpack('<I' .. k .. 'I' .. k .. 'I7' .. (short and '' or 'I8'), v)
if short then w = math.floor(e / 2000000) end
return {'bytes ' .. #v, 'units ' .. n, 'lim ' .. l, 'epoch ' .. string.format('%.0f', e),
	'window ' .. string.format('%.0f', w)}" \
	1 "rl:fixed.2:{$tag:fixed}:5/2000" | sed 's/^/   /'

if [ -d examples/http_service ]; then
	echo
	say "The same limits over HTTP: examples/http_service/server.py (how to start it: examples/http_service/README.md, \"Running it\")."
fi

echo
echo "demo done; stopping the throwaway Redis and PostgreSQL."
