#!/usr/bin/env bash
# The one test command (`make test`): installs missing packages, builds and
# installs the extension, starts a throwaway Redis and PostgreSQL on free
# loopback ports, runs every suite, stops both, prints the slowest tests and
# exits non-zero when any suite fails.
#
# The pytest suites run in parallel (pytest-xdist, RL_TEST_JOBS workers,
# default 4: on 2 cores, 6 workers and their servers spent about 30 s more
# CPU on contention and made the run about 40 s longer; 3 was about 10 s
# slower than 4), then the tests marked `alone` (they change a server the others
# share) run one at a time; the tests marked heavy run beside the others in
# a run of their own. The Debian package check runs beside pg_regress.
#
# A developer's loop: `bash sql_tests/run_tests.sh ARGS...` runs only pytest,
# with ARGS (for example sql_tests/test_idle.py or -k refund), on the same
# throwaway servers. RL_TEST_ORDER=reverse runs the modules in reverse order;
# RL_NO_BUILD=1 tests the extension as installed (no clean, build, install).
# RL_TEST_REGRESS=1 with ARGS runs pg_regress (make installcheck) on the same
# servers before pytest (sql_tests/test_matrix.sh runs each cell that way).
set -uo pipefail
cd "$(dirname "$0")/.."

. sql_tests/lib.sh
start=$SECONDS
if [ -z "${RL_NO_BUILD:-}" ]; then
	make -s clean >/dev/null 2>&1
	rl_build_install || exit 1
fi
rl_cluster_start || exit 1
echo "== built, installed and started in $((SECONDS - start)) s"

# Python may keep compiled modules (and pytest its rewritten test modules)
# in the throwaway folder: each of the runs' dozen pytest processes would
# otherwise rewrite every test module's asserts again (about 2.5 s of CPU
# each, where PYTHONDONTWRITEBYTECODE is set)
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=$RL_DIR/pycache

jobs=${RL_TEST_JOBS:-4}
export RL_DURATIONS_FILE=${RL_DURATIONS_FILE:-$RL_DIR/durations.tsv}
: >"$RL_DURATIONS_FILE"
pytest=(/usr/bin/python3 -m pytest -q -p no:cacheprovider -p xdist)

# Returns 0 for pytest's exit status 0, and for 5 (the arguments selected
# none of the run's tests).
pytest_ok() {
	[ "$1" -eq 0 ] || [ "$1" -eq 5 ]
}

# Runs the pytest suites (or what the arguments select): the tests marked
# heavy (one xdist worker each) beside the others (RL_TEST_JOBS workers),
# then the tests marked alone; returns non-zero when any run fails. The
# heavy ones have a run of their own because xdist hands each worker a share
# of the queue in advance, which would wait behind a heavy test.
run_pytest() {
	local rc=0 heavy_pid heavy=("$@") alone=("$@")
	# the whole suite: the runs of the marked tests collect only the modules
	# that have such tests (each xdist worker collects what it is given)
	if [ "$*" = sql_tests ]; then
		mapfile -t heavy < <(grep -l "pytest.mark.heavy" sql_tests/test_*.py)
		mapfile -t alone < <(grep -l "pytest.mark.alone" sql_tests/test_*.py)
	fi
	RL_TEST_RUN=heavy "${pytest[@]}" -n 5 --dist load -m "heavy and not alone" "${heavy[@]}" &
	heavy_pid=$!
	"${pytest[@]}" -n "$jobs" --dist loadgroup -m "not heavy and not alone" "$@"
	pytest_ok $? || rc=1
	wait "$heavy_pid"
	pytest_ok $? || rc=1
	"${pytest[@]}" -m alone "${alone[@]}"
	pytest_ok $? || rc=1
	return $rc
}

# Prints the 15 slowest test phases of both pytest runs.
print_slowest() {
	echo "== the 15 slowest tests (setup, call or teardown)"
	sort -t$'\t' -k1,1 -rn "$RL_DURATIONS_FILE" | head -15 |
		awk -F'\t' '{printf "%8.2fs %-8s %s\n", $1, $2, $3}'
}

# pg_regress (make installcheck) against the throwaway servers; returns
# non-zero (and shows the diffs) when a test fails.
run_regress() {
	local t=$SECONDS rc=0
	echo "== pg_regress (make installcheck)"
	if ! make -s installcheck; then
		rc=1
		[ -f regression.diffs ] && head -200 regression.diffs
	fi
	echo "== pg_regress took $((SECONDS - t)) s"
	return $rc
}

if [ $# -gt 0 ]; then
	rc=0
	if [ -n "${RL_TEST_REGRESS:-}" ]; then
		run_regress || rc=1
	fi
	run_pytest "$@" || rc=1
	print_slowest
	exit $rc
fi

failed=()

# The package check starts servers of its own; it runs while pg_regress does.
deb_log=$RL_DIR/test_deb.log
bash sql_tests/test_deb.sh >"$deb_log" 2>&1 &
deb_pid=$!

# one collection first fills the cache of rewritten test modules (above),
# while pg_regress runs, so that the pytest processes started together
# below do not each rewrite them
"${pytest[@]}" --collect-only sql_tests >/dev/null 2>&1 &
warm_pid=$!

run_regress || failed+=(installcheck)
wait "$warm_pid"

echo "== concurrency and fault tests (pytest, $jobs workers, then the tests marked alone)"
t=$SECONDS
run_pytest sql_tests || failed+=(pytest)
echo "== pytest took $((SECONDS - t)) s"

echo "== Debian package (sql_tests/test_deb.sh)"
wait "$deb_pid" || failed+=(deb)
cat "$deb_log"

print_slowest
echo "== make test took $((SECONDS - start)) s"
if [ ${#failed[@]} -gt 0 ]; then
	echo "FAILED suites: ${failed[*]}"
	exit 1
fi
echo "all suites passed"
