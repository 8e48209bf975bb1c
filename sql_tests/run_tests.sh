#!/usr/bin/env bash
# The one test command (`make test`): installs missing packages, builds and
# installs the extension, starts a throwaway Redis and PostgreSQL on free
# loopback ports, runs every suite, stops both, and exits non-zero when any
# suite fails.
set -uo pipefail
cd "$(dirname "$0")/.."

. sql_tests/lib.sh
make -s clean >/dev/null 2>&1
rl_build_install || exit 1
rl_cluster_start || exit 1

failed=()

echo "== pg_regress (make installcheck)"
if ! make -s installcheck; then
	failed+=(installcheck)
	[ -f regression.diffs ] && head -200 regression.diffs
fi

echo "== concurrency and fault tests (pytest)"
/usr/bin/python3 -m pytest -q -p no:cacheprovider sql_tests || failed+=(pytest)

echo "== Debian package (sql_tests/test_deb.sh)"
bash sql_tests/test_deb.sh || failed+=(deb)

if [ ${#failed[@]} -gt 0 ]; then
	echo "FAILED suites: ${failed[*]}"
	exit 1
fi
echo "all suites passed"
