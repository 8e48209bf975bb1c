#!/usr/bin/env bash
# The version matrix (`make test-matrix`): builds, installs and tests rl_redis
# on the newer PostgreSQL, Redis and Valkey that Debian carries, each in a
# root filesystem of its own (debootstrap + chroot), on loopback:
#
#   trixie: PostgreSQL 17, Redis 8.0, Valkey 8.1
#   sid:    PostgreSQL 18, Redis 8.0, Valkey 9.x
#
# The root filesystems are made once and cached outside the checkout
# ($RL_MATRIX_CACHE, default /var/cache/rl_redis-matrix/<distro>); a marker
# file (.rl_matrix_complete, holding the package list) says that one is
# complete; one without it, or made with another package list, is made anew.
#
# In each root filesystem: a copy of this checkout (its tracked and untracked,
# not ignored, files, as sql_tests/test_deb.sh copies it) is built without
# warnings (-Werror), installed, and tested by sql_tests/run_tests.sh on
# throwaway servers: once against redis-server, once against valkey-server
# (RL_REDIS_SERVER / RL_REDIS_CLI): pg_regress and the pytest modules listed
# in PYTEST_MODULES below; Redis Cluster and Sentinel (test_cluster,
# test_sentinel) run in the cells listed in RL_MATRIX_TOPOLOGY (default
# sid-redis); then sql_tests/test_deb.sh builds and checks the Debian package
# for that root filesystem's PostgreSQL major. At the end a table says what
# each cell ran, its passed/failed counts and its wall time; the exit status
# is non-zero when any cell failed.
#
# Usage (as root): bash sql_tests/test_matrix.sh
#   RL_MATRIX_DISTROS="trixie"       only these root filesystems
#   RL_MATRIX_SERVERS="valkey"       only these servers (redis valkey; empty: build only)
#   RL_MATRIX_TOPOLOGY="sid-redis"   cells that run test_cluster, test_sentinel
#   RL_MATRIX_NO_DEB=1               no Debian package check
#   RL_MATRIX_PREPARE_ONLY=1         only make the root filesystems
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
start=$SECONDS

CACHE=${RL_MATRIX_CACHE:-/var/cache/rl_redis-matrix}
DISTROS=${RL_MATRIX_DISTROS:-trixie sid}
SERVERS=${RL_MATRIX_SERVERS-redis valkey}
TOPOLOGY=${RL_MATRIX_TOPOLOGY-sid-redis}
LOGS=${RL_MATRIX_LOGS:-$CACHE/logs}

# the PostgreSQL major that each distribution carries
pg_major() {
	case $1 in
	trixie) echo 17 ;;
	sid) echo 18 ;;
	*) echo "no PostgreSQL major known for $1" >&2; return 1 ;;
	esac
}

PYTEST_MODULES=(
	test_algorithms test_concurrency test_integrity_model test_integrity_xact
	test_guard_identity test_faults test_fault_matrix test_breaker test_shared
	test_batch test_deny_cache test_stats test_policy_keys test_identity_size test_reports test_decide
	test_inspect test_shadow test_guard_check test_window_text test_exporter test_functions
)
TOPOLOGY_MODULES=(test_cluster test_sentinel)

packages() {
	local pgv=$1
	echo postgresql-"$pgv" postgresql-server-dev-"$pgv" postgresql-server-dev-all \
		build-essential libhiredis-dev libssl-dev redis-server redis-tools \
		valkey-server valkey-tools python3 python3-psycopg python3-pytest \
		python3-pytest-xdist debhelper openssl git pgbouncer ca-certificates \
		prometheus-postgres-exporter
}

if [ "$(id -u)" != 0 ]; then
	echo "test_matrix.sh runs as root (debootstrap, chroot)" >&2
	exit 1
fi

# ------------------------------------------------------------ the chroots

MOUNTED=()
# Mounts what PostgreSQL and Redis need in the root filesystem $1.
chroot_mount() {
	local root=$1
	mount -t proc proc "$root/proc" && MOUNTED+=("$root/proc") || return 1
	mount -t sysfs sysfs "$root/sys" && MOUNTED+=("$root/sys") || return 1
	mount --bind /dev "$root/dev" && MOUNTED+=("$root/dev") || return 1
	# a /dev/shm of its own (PostgreSQL's dynamic shared memory)
	mount -t tmpfs -o mode=1777,size=1g shm "$root/dev/shm" && MOUNTED+=("$root/dev/shm") || return 1
	cp /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true
}
# Unmounts what chroot_mount mounted, the last mounted first.
chroot_umount() {
	local i
	for ((i = ${#MOUNTED[@]} - 1; i >= 0; i--)); do
		umount "${MOUNTED[i]}" 2>/dev/null || umount -l "${MOUNTED[i]}" 2>/dev/null ||
			echo "could not unmount ${MOUNTED[i]}" >&2
	done
	MOUNTED=()
}
# Kills every process whose root is $1 (servers a failed run left behind).
chroot_kill() {
	local root p
	root=$(readlink -f "$1")
	for p in /proc/[0-9]*; do
		[ "$(readlink "$p/root" 2>/dev/null)" = "$root" ] && kill -9 "${p#/proc/}" 2>/dev/null
	done
	return 0
}
cleanup() {
	local d
	for d in $DISTROS; do chroot_kill "$CACHE/$d"; done
	chroot_umount
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Runs a command in the root filesystem $1 with a clean environment (plus
# the VAR=value arguments given before it). In the background and waited
# for, so that an INT or TERM reaches the trap (and its cleanup) at once.
in_chroot() {
	local root=$1
	shift
	chroot "$root" /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
		HOME=/root LANG=C.UTF-8 DEBIAN_FRONTEND=noninteractive "$@" &
	wait $!
}

# Makes (or keeps) the root filesystem of distribution $1.
prepare_root() {
	local distro=$1 pgv root marker want t
	pgv=$(pg_major "$distro") || return 1
	root=$CACHE/$distro
	marker=$root/.rl_matrix_complete
	want="$distro $(packages "$pgv")"
	if [ -f "$marker" ] && [ "$(cat "$marker")" = "$want" ]; then
		echo "== $distro: root filesystem cached in $root"
		return 0
	fi
	t=$SECONDS
	echo "== $distro: making the root filesystem in $root (debootstrap, then apt-get)"
	command -v debootstrap >/dev/null || apt-get install -y -qq debootstrap >/dev/null || return 1
	if [ -e "$root" ]; then
		if findmnt -rn -o TARGET | grep -q "^$root/"; then
			echo "$root has mounts: not removing it" >&2
			return 1
		fi
		rm -rf --one-file-system "$root"
	fi
	mkdir -p "$CACHE"
	debootstrap --variant=minbase "$distro" "$root" >"$CACHE/$distro.debootstrap.log" 2>&1 ||
		{ tail -20 "$CACHE/$distro.debootstrap.log" >&2; return 1; }
	# no service starts in the chroot, and no default cluster is made
	printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d"
	chmod 755 "$root/usr/sbin/policy-rc.d"
	mkdir -p "$root/etc/postgresql-common"
	echo "create_main_cluster = false" >"$root/etc/postgresql-common/createcluster.conf"
	# the archive may be a snapshot whose Release files look expired to this clock
	echo 'Acquire::Check-Valid-Until "false";' >"$root/etc/apt/apt.conf.d/99rl-matrix"
	chroot_mount "$root" || return 1
	{
		in_chroot "$root" apt-get update -qq &&
			in_chroot "$root" apt-get install -y -qq --no-install-recommends $(packages "$pgv")
	} >"$CACHE/$distro.apt.log" 2>&1
	local rc=$?
	chroot_kill "$root"
	chroot_umount
	[ $rc -eq 0 ] || { tail -20 "$CACHE/$distro.apt.log" >&2; return 1; }
	in_chroot "$root" apt-get clean
	echo "$want" >"$marker"
	echo "== $distro: root filesystem made in $((SECONDS - t)) s ($(du -sm --one-file-system "$root" | cut -f1) MB)"
}

mkdir -p "$CACHE"
for d in $DISTROS; do
	prepare_root "$d" || { echo "== $d: could not make the root filesystem" >&2; exit 1; }
done
[ -n "${RL_MATRIX_PREPARE_ONLY:-}" ] && exit 0

# ------------------------------------------------------------- the cells

mkdir -p "$LOGS"
ROWS=()           # "cell|versions|ran|passed|failed|skipped|seconds|result"
TOTAL_PASSED=0
TOTAL_FAILED=0

# Counts the results in a log: prints "passed failed skipped" summed over
# pg_regress's closing line, pytest's closing lines and test_deb.sh's.
count_results() {
	/usr/bin/python3 - "$1" <<-'PY'
	import re, sys
	passed = failed = skipped = 0
	for line in open(sys.argv[1], errors="replace"):
	    line = line.strip().strip("=# ").strip()
	    m = re.match(r"All (\d+) tests passed", line)
	    if m:
	        passed += int(m.group(1))
	        continue
	    m = re.match(r"(\d+) of (\d+) tests (failed|passed)", line)
	    if m:
	        n, total = int(m.group(1)), int(m.group(2))
	        bad = n if m.group(3) == "failed" else total - n
	        passed += total - bad
	        failed += bad
	        continue
	    m = re.match(r"test_deb: (\d+) passed, (\d+) failed", line)
	    if m:
	        passed += int(m.group(1))
	        failed += int(m.group(2))
	        continue
	    if re.search(r" in [0-9.]+s( \([0-9:]+\))?$", line) and re.match(r"\d+ (passed|failed|skipped|errors?|deselected)", line):
	        for n, what in re.findall(r"(\d+) (passed|failed|skipped|errors?)", line):
	            if what == "passed":
	                passed += int(n)
	            elif what == "skipped":
	                skipped += int(n)
	            else:
	                failed += int(n)
	print(passed, failed, skipped)
	PY
}

# Records one row of the table: cell, versions, what ran, log, exit status,
# seconds.
record() {
	local cell=$1 versions=$2 ran=$3 log=$4 rc=$5 secs=$6 p f s result
	read -r p f s < <(count_results "$log")
	result=passed
	# a step without counted tests (the build) counts as one
	[ "$rc" != 0 ] || [ $((p + f)) -gt 0 ] || p=1
	if [ "$rc" != 0 ]; then
		result=FAILED
		# a suite that failed without a failed test (crash, no server): one failure
		[ "$f" -gt 0 ] || f=1
	fi
	TOTAL_PASSED=$((TOTAL_PASSED + p))
	TOTAL_FAILED=$((TOTAL_FAILED + f))
	ROWS+=("$cell|$versions|$ran|$p|$f|$s|$secs|$result")
	printf '== %s: %s (%s passed, %s failed, %s skipped) in %s s; log %s\n' \
		"$cell" "$result" "$p" "$f" "$s" "$secs" "$log"
	[ "$rc" = 0 ] || tail -n 60 "$log"
}

run_distro() {
	local distro=$1 pgv root src pgver rc t server cell ver log args m
	pgv=$(pg_major "$distro")
	root=$CACHE/$distro
	src=/build/rl_redis
	chroot_mount "$root" || return 1

	echo "== $distro: copy of the checkout in $root$src"
	rm -rf --one-file-system "$root/build"
	mkdir -p "$root$src"
	chmod 755 "$root/build" "$root$src"
	git -C "$REPO" ls-files -z --cached --others --exclude-standard |
		while IFS= read -r -d '' f; do
			if [ -e "$f" ] || [ -L "$f" ]; then printf '%s\0' "$f"; fi
		done |
		tar -C "$REPO" --null -T - -cf - | tar -C "$root$src" -xf -
	# test_deb.sh copies the checkout by git ls-files: an index of its own
	in_chroot "$root" sh -c "cd $src && git init -q && git add -A" || return 1
	pgver=$(in_chroot "$root" pg_config --version | sed 's/^PostgreSQL //; s/ .*//')

	echo "== $distro: build with PostgreSQL $pgver (-Werror), make install"
	log=$LOGS/$distro-build.log
	t=$SECONDS
	in_chroot "$root" sh -c "cd $src && make -s clean && make -s COPT=-Werror && make -s install" >"$log" 2>&1
	rc=$?
	record "$distro build" "PostgreSQL $pgver" "make COPT=-Werror, make install" "$log" $rc $((SECONDS - t))
	[ $rc = 0 ] || return 0

	for server in $SERVERS; do
		cell=$distro-$server
		ver=$(in_chroot "$root" "$server-server" --version | grep -oE 'v=[0-9.]+' | cut -c3-)
		args=()
		for m in "${PYTEST_MODULES[@]}"; do args+=("sql_tests/$m.py"); done
		ran="pg_regress, ${#PYTEST_MODULES[@]} pytest modules"
		case " $TOPOLOGY " in
		*" $cell "*)
			for m in "${TOPOLOGY_MODULES[@]}"; do args+=("sql_tests/$m.py"); done
			ran="$ran + ${TOPOLOGY_MODULES[*]}"
			;;
		esac
		echo "== $cell: PostgreSQL $pgver, $server $ver: $ran"
		log=$LOGS/$cell.log
		t=$SECONDS
		in_chroot "$root" RL_PG_MAJOR="$pgv" RL_REDIS_SERVER="$server-server" \
			RL_REDIS_CLI="$server-cli" RL_NO_BUILD=1 RL_TEST_REGRESS=1 \
			${RL_TEST_JOBS:+RL_TEST_JOBS=$RL_TEST_JOBS} \
			bash "$src/sql_tests/run_tests.sh" "${args[@]}" >"$log" 2>&1
		rc=$?
		chroot_kill "$root"
		record "$cell" "PostgreSQL $pgver, ${server^} $ver" "$ran" "$log" $rc $((SECONDS - t))
	done

	if [ -z "${RL_MATRIX_NO_DEB:-}" ]; then
		log=$LOGS/$distro-deb.log
		t=$SECONDS
		in_chroot "$root" RL_PG_MAJOR="$pgv" bash "$src/sql_tests/test_deb.sh" >"$log" 2>&1
		rc=$?
		chroot_kill "$root"
		record "$distro deb" "PostgreSQL $pgver, Redis" "sql_tests/test_deb.sh (postgresql-$pgv-rl-redis)" "$log" $rc $((SECONDS - t))
	fi
}

for d in $DISTROS; do
	run_distro "$d" || record "$d" "" "setting up the chroot" /dev/null 1 0
	chroot_kill "$CACHE/$d"
	chroot_umount
done

echo
echo "== the matrix (logs in $LOGS)"
{
	echo "cell|versions|ran|passed|failed|skipped|seconds|result"
	printf '%s\n' "${ROWS[@]}"
} | column -t -s'|'
echo "== make test-matrix took $((SECONDS - start)) s"
echo "test_matrix: $TOTAL_PASSED passed, $TOTAL_FAILED failed"
[ "$TOTAL_FAILED" = 0 ]
