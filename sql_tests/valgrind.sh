#!/usr/bin/env bash
# Runs the pg_regress suite (sql/*.sql, what `make installcheck` runs) against
# a throwaway cluster whose postmaster, and so every backend it forks, runs
# under valgrind memcheck, then reports the valgrind errors whose stack goes
# through the extension (rl_redis.so or its sources). NOT part of `make test`:
# it takes a few minutes.
#
# Usage: bash sql_tests/valgrind.sh [pg_regress test names...]
#   (no names: the whole REGRESS list of the Makefile)
#
# Environment:
#   RL_VALGRIND_KEEP=DIR   copy the valgrind logs (one per process), the
#                          regression diffs and the server log
#                          (postgres-log.txt) to DIR before cleaning up
#   RL_VALGRIND_ERROR_EXITCODE   valgrind's --error-exitcode (default 1, see
#                          below; 0 turns it off)
#   RL_VALGRIND_PYTEST="sql_tests/test_faults.py ..."   also run these pytest
#                          files (or -k expressions after them) against the
#                          server under valgrind, after pg_regress: they
#                          exercise the failure paths (refused and timed-out
#                          connects, lost connections, cancels, error
#                          replies). Their timing assertions are expected to
#                          fail under valgrind; their outcome is reported,
#                          not counted. The servers they start themselves
#                          (PgServer: the shared transport's worker, other
#                          settings) run this build under valgrind too.
#
# Nothing is installed system-wide and the source tree is left alone: the
# extension is built with -O0 -g (exact lines in the report) in a copy of
# the tree, installed with DESTDIR into the test folder, and the server runs
# from a private copy of the postgres binary whose $libdir and share folder
# (PostgreSQL finds them relative to the binary) are links to the system's
# files plus this build of rl_redis. So other test runs that `make install`
# meanwhile cannot swap the library under it, and it cannot disturb them.
#
# Exit status: 0 when no valgrind error involves the extension, 1 when some
# do (they are printed), 2 when the set-up failed. Failures of the regression
# tests themselves (timing under valgrind can change output) are reported but
# do not change the exit status.
#
# PostgreSQL's own src/tools/valgrind.supp is not installed by Debian, so
# sql_tests/valgrind.supp carries the entries for the noise a Debian 15 server
# makes (uninitialised padding written to WAL and files, allocations kept for
# the process's life). Errors outside the extension are counted, not shown.
set -uo pipefail
cd "$(dirname "$0")/.."
SRC=$(pwd)

sudo=
[ "$(id -u)" = 0 ] || sudo=sudo

. sql_tests/lib.sh

bash sql_tests/install_deps.sh || exit 2
if ! command -v valgrind >/dev/null; then
	$sudo apt-get install -y -qq valgrind >/dev/null || exit 2
fi

# started without shared_preload_libraries: the system's rl_redis.so (which
# may be missing or another build) is never loaded; the restart under
# valgrind below preloads the private build, as the test cluster does
RL_PRELOAD= rl_cluster_start || exit 2
PGBIN=$(pg_config --bindir)
PKGLIBDIR=$(pg_config --pkglibdir)
SHAREDIR=$(pg_config --sharedir)
VG_DIR=$RL_DIR/valgrind
BUILD=$RL_DIR/build

cleanup() {
	if [ -n "${RL_VALGRIND_KEEP:-}" ] && [ -d "$VG_DIR" ]; then
		mkdir -p "$RL_VALGRIND_KEEP" && cp -r "$VG_DIR"/. "$RL_VALGRIND_KEEP"/
		[ -f "$BUILD/regression.diffs" ] && cp "$BUILD/regression.diffs" "$RL_VALGRIND_KEEP"/
		cp "$RL_DIR/postgres.log" "$RL_VALGRIND_KEEP"/postgres-log.txt
	fi
	rl_cluster_stop
}
trap cleanup EXIT

# -- build a debug copy of the extension and a private installation ----------

echo "== building rl_redis with -O0 -g in $BUILD"
mkdir -p "$BUILD"
tar --exclude=.git --exclude=results --exclude='*.o' --exclude='*.bc' --exclude='*.so' \
	-cf - . | tar -C "$BUILD" -xf - || exit 2
(
	cd "$BUILD" || exit 1
	make -s clean >/dev/null 2>&1
	make -s COPT='-O0 -g3 -fno-omit-frame-pointer' >/dev/null &&
		make -s install DESTDIR="$RL_DIR/stage" >/dev/null
) || exit 2

# The server finds $libdir and its share folder relative to its binary:
# <root>/<bindir relative to /> -> <root>/<pkglibdir relative to /> etc.
ROOT=$RL_DIR/pgroot
mkdir -p "$ROOT$PGBIN" "$ROOT$PKGLIBDIR" "$ROOT$SHAREDIR/extension"
cp "$PGBIN/postgres" "$ROOT$PGBIN/postgres" || exit 2
for f in "$PKGLIBDIR"/*; do
	[ "$(basename "$f")" = rl_redis.so ] || ln -s "$f" "$ROOT$PKGLIBDIR/"
done
for f in "$SHAREDIR"/*; do
	[ "$(basename "$f")" = extension ] || ln -s "$f" "$ROOT$SHAREDIR/"
done
for f in "$SHAREDIR"/extension/*; do
	case "$(basename "$f")" in rl_redis*) ;; *) ln -s "$f" "$ROOT$SHAREDIR/extension/" ;; esac
done
cp "$RL_DIR/stage$PKGLIBDIR/rl_redis.so" "$ROOT$PKGLIBDIR/" || exit 2
cp "$RL_DIR/stage$SHAREDIR"/extension/rl_redis* "$ROOT$SHAREDIR/extension/" || exit 2
chmod -R a+rX "$ROOT"

# -- restart the cluster under valgrind ---------------------------------------

rl_as_owner "$PGBIN/pg_ctl" -D "$RL_DIR/pgdata" -m fast -w stop >/dev/null || exit 2
cat >>"$RL_DIR/pgdata/postgresql.conf" <<-EOF
	# under valgrind: fewer background processes, nothing parallel
	autovacuum = off
	jit = off
	max_parallel_workers_per_gather = 0
	max_worker_processes = 2
	shared_buffers = 32MB
	log_min_messages = warning
	# preloaded, as in the test cluster (sql_tests/lib.sh): this build,
	# from the private libdir
	shared_preload_libraries = 'rl_redis'
EOF

mkdir -p "$VG_DIR"
[ "$(id -u)" = 0 ] && chown postgres "$VG_DIR"
cp sql_tests/valgrind.supp "$VG_DIR/valgrind.supp"
chmod 644 "$VG_DIR/valgrind.supp"

# --error-exitcode=1: a backend with errors exits with 1, which the
# postmaster takes as an ordinary FATAL exit (2 or more would make it
# restart every process as after a crash). The startup process must stay
# clean, though: exit code 1 from it stops the server, so an unsuppressed
# error there shows as "startup process exited with exit code 1".
VALGRIND=(
	valgrind
	--tool=memcheck
	--trace-children=yes
	--error-exitcode="${RL_VALGRIND_ERROR_EXITCODE:-1}"
	--leak-check=full
	--show-leak-kinds=definite
	--errors-for-leak-kinds=definite
	--track-origins=yes
	--read-var-info=yes
	--num-callers=40
	--fullpath-after=
	--gen-suppressions=all
	--suppressions="$VG_DIR/valgrind.supp"
	--log-file="$VG_DIR/%p.log"
)
# the one way a server runs under valgrind here: this script, for the
# cluster below and for the servers the pytest files start (conftest.py's
# PgServer with RL_VALGRIND_POSTGRES), so that they run this build too
VG_POSTGRES=$RL_DIR/postgres-under-valgrind
{
	echo '#!/bin/sh'
	printf 'exec'
	printf ' %q' "${VALGRIND[@]}" "$ROOT$PGBIN/postgres"
	printf ' "$@"\n'
} >"$VG_POSTGRES"
chmod 755 "$VG_POSTGRES"
echo "== starting PostgreSQL under valgrind (port $RL_PGPORT)"
rl_as_owner "$VG_POSTGRES" -D "$RL_DIR/pgdata" \
	>>"$RL_DIR/postgres.log" 2>&1 </dev/null &
vg_pid=$!
ready=
for _ in $(seq 1 600); do
	if "$PGBIN/pg_isready" -q -h 127.0.0.1 -p "$RL_PGPORT"; then
		ready=1
		break
	fi
	kill -0 "$vg_pid" 2>/dev/null || break
	sleep 0.5
done
if [ -z "$ready" ]; then
	echo "PostgreSQL did not start under valgrind:" >&2
	tail -20 "$RL_DIR/postgres.log" >&2
	for f in "$VG_DIR"/*.log; do
		grep -q 'ERROR SUMMARY: [1-9]' "$f" && { echo "-- $f" >&2; cat "$f" >&2; }
	done
	exit 2
fi

# the backends load this build, not the system's rl_redis.so
loaded=$(psql -X -q -At -d postgres 2>&1 <<-'EOF'
	LOAD 'rl_redis';
	SELECT pg_backend_pid() AS pid \gset
	\setenv BPID :pid
	\! grep -o '/[^ ]*rl_redis\.so' /proc/$BPID/maps | sort -u
EOF
)
if [ "$loaded" != "$ROOT$PKGLIBDIR/rl_redis.so" ]; then
	echo "the server did not load the private build: $loaded" >&2
	exit 2
fi
echo "== backends load $loaded"

# -- the regression suite -----------------------------------------------------

tests=("$@")
if [ ${#tests[@]} -eq 0 ]; then
	read -r -a tests <<<"$(sed -n 's/^REGRESS *= *//p' Makefile)"
fi
echo "== pg_regress under valgrind: ${tests[*]}"
t0=$(date +%s)
regress_status=0
(cd "$BUILD" && make -s installcheck REGRESS="${tests[*]}") || regress_status=$?
echo "== pg_regress finished in $(($(date +%s) - t0)) s (status $regress_status)"
if [ "$regress_status" != 0 ] && [ -f "$BUILD/regression.diffs" ]; then
	echo "-- regression.diffs (first 60 lines):"
	head -60 "$BUILD/regression.diffs"
fi

pytest_status=-
if [ -n "${RL_VALGRIND_PYTEST:-}" ]; then
	echo "== pytest under valgrind: $RL_VALGRIND_PYTEST"
	# shellcheck disable=SC2086
	RL_VALGRIND_POSTGRES=$VG_POSTGRES \
		/usr/bin/python3 -m pytest -q -p no:cacheprovider $RL_VALGRIND_PYTEST \
		>"$VG_DIR/pytest.out" 2>&1
	pytest_status=$?
	grep -E '^(FAILED|ERROR|E  )|passed|failed' "$VG_DIR/pytest.out" | tail -40
	echo "== pytest finished (status $pytest_status; timing failures are expected)"
fi

# A clean shutdown, so that every process writes its leak report.
echo "== stopping PostgreSQL"
rl_as_owner "$PGBIN/pg_ctl" -D "$RL_DIR/pgdata" -m fast -w -t 300 stop >/dev/null ||
	echo "warning: PostgreSQL did not stop cleanly" >&2
sleep 1

# -- the report ---------------------------------------------------------------

echo "== valgrind report (sources of this build: $BUILD/src)"
/usr/bin/python3 - "$VG_DIR" "$SRC" <<-'EOF'
	import glob, os, re, sys

	vg_dir, src = sys.argv[1], sys.argv[2]
	# frames in the extension: its library, or (built with -g) its sources
	names = sorted(os.path.basename(p) for p in glob.glob(os.path.join(src, "src", "*.[ch]")))
	ours = re.compile(r"rl_redis\.so|[ /(](?:%s):\d" % "|".join(re.escape(n) for n in names))
	hits, other, processes, with_errors = [], 0, 0, 0
	for path in sorted(glob.glob(os.path.join(vg_dir, "*.log"))):
	    processes += 1
	    lines = open(path, errors="replace").read().splitlines()
	    # an error (or leak record, or generated suppression) is a run of
	    # "==pid== ..." lines between two "==pid== " blank lines
	    blocks, cur = [], []
	    for line in lines:
	        body = re.sub(r"^==\d+== ?", "", line)
	        if body.strip() == "":
	            if cur:
	                blocks.append(cur)
	            cur = []
	        else:
	            cur.append(body)
	    if cur:
	        blocks.append(cur)
	    summary = [l for l in lines if "ERROR SUMMARY" in l]
	    if summary and re.search(r"ERROR SUMMARY: [1-9]", summary[-1]):
	        with_errors += 1
	    for b in blocks:
	        head = b[0]
	        is_error = (
	            head.startswith(("Invalid", "Conditional jump", "Use of uninitialised",
	                             "Syscall param", "Mismatched", "Source and destination",
	                             "Process terminating"))
	            or "definitely lost" in head
	        )
	        if not is_error:
	            continue
	        if any(ours.search(l) for l in b):
	            hits.append((os.path.basename(path), b))
	        else:
	            other += 1
	print("processes traced: %d, with any valgrind error: %d" % (processes, with_errors))
	print("errors outside the extension (not shown): %d" % other)
	print("errors whose stack goes through rl_redis: %d" % len(hits))
	for name, b in hits:
	    print("\n--- %s" % name)
	    print("\n".join(b))
	sys.exit(1 if hits else 0)
EOF
status=$?
# what ran under valgrind: the failure reports the servers logged (the
# servers of PgServer log under $RL_DIR/pg-*, removed after each module)
echo "== failure reports in the log: $(grep -c 'CONTEXT:  rl_redis ' "$RL_DIR/postgres.log") with an rl_redis CONTEXT, $(grep -c ' HINT:  ' "$RL_DIR/postgres.log") with a HINT"
echo "== done: valgrind status $status, pg_regress status $regress_status, pytest status $pytest_status"
exit $status
