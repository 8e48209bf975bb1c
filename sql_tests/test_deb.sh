#!/usr/bin/env bash
# The Debian package, built and tested end to end without touching the
# system's PostgreSQL: installs missing packages (sql_tests/install_deps.sh),
# builds postgresql-NN-rl-redis with dpkg-buildpackage from a clean copy of
# this checkout (its tracked and untracked, not ignored, files) in a temporary
# folder, checks the files and the dependencies of the .deb and META.json,
# then "installs it on a clean server": a copy of the system's PostgreSQL
# (bin, lib and share trees, with every rl_redis file removed) under the same
# temporary folder, into which the .deb is extracted (dpkg-deb -x). That copy
# runs a throwaway cluster and a throwaway Redis on free loopback ports
# (sql_tests/lib.sh, preloading rl_redis), where a smoke test decides with
# every algorithm, a policy and a concurrency slot and upgrades a 1.0
# installation (the full pg_regress run is make test's, once). It proves that
# the server mapped the packaged rl_redis.so from the temporary folder, stops
# everything it started, removes the folder, and exits
# non-zero on the first failed check.
#
# Usage: bash sql_tests/test_deb.sh   (as root or with sudo for the packages;
# the cluster then runs as the postgres user). KEEP=1 keeps the folder.
#
# PostgreSQL finds its share and lib directories relative to its binaries
# (pg_config and the server relocate every compiled-in path by the common
# prefix with the bin directory), so TMP/usr/lib/postgresql/NN/bin/postgres
# uses TMP/usr/lib/postgresql/NN/lib and TMP/usr/share/postgresql/NN. What
# the copy still takes from the system: shared libraries such as libpq and
# libssl (/usr/lib/<arch>), and time zones (built with --with-system-tzdata,
# /usr/share/zoneinfo); none of them is an rl_redis file.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
start=$SECONDS
passed=0

. sql_tests/lib.sh

ok() {
	passed=$((passed + 1))
	echo "ok $passed - $*"
}
fail() {
	echo "not ok - $*" >&2
	echo "test_deb: $passed passed, 1 failed"
	exit 1
}

WORK=$(mktemp -d "${TMPDIR:-/tmp}/rl_redis_deb.XXXXXX")
cleanup() {
	set +e
	rl_cluster_stop
	if [ -n "${KEEP:-}" ]; then
		echo "kept $WORK"
	else
		rm -rf "$WORK"
	fi
}
trap cleanup EXIT
# the cluster owner (postgres when root) walks through the folder to the copy
chmod 755 "$WORK"

echo "== packages"
bash sql_tests/install_deps.sh

echo "== clean copy of the checkout in $WORK/rl-redis"
SRC=$WORK/rl-redis
mkdir "$SRC"
git -C "$REPO" ls-files -z --cached --others --exclude-standard |
	while IFS= read -r -d '' f; do
		# a tracked file deleted in the work tree is not part of the checkout
		if [ -e "$f" ] || [ -L "$f" ]; then printf '%s\0' "$f"; fi
	done |
	tar -C "$REPO" --null -T - -cf - | tar -C "$SRC" -xf -
[ -f "$SRC/debian/control.in" ] && [ -f "$SRC/Makefile" ] ||
	fail "the copy has no debian/control.in or Makefile"
ok "clean copy: $(find "$SRC" -type f | wc -l) files"

# versions: debian/changelog (upstream part) = META.json = default_version
DEBVER=$(cd "$SRC" && dpkg-parsechangelog -S Version)
UPVER=${DEBVER%-*}
EXTVER=$(sed -n "s/^default_version *= *'\(.*\)'.*/\1/p" "$SRC/rl_redis.control")
case "$UPVER" in
"$EXTVER" | "$EXTVER".*) ;;
*) fail "debian/changelog says $DEBVER but rl_redis.control's default_version is '$EXTVER': add a changelog entry (dch -v $EXTVER.0)" ;;
esac
ok "debian/changelog $DEBVER matches default_version '$EXTVER'"

/usr/bin/python3 - "$SRC" "$UPVER" <<-'EOF' || fail "META.json is not valid PGXN metadata"
	import json, os, re, sys
	src, version = sys.argv[1], sys.argv[2]
	meta = json.load(open(os.path.join(src, "META.json")))
	semver = re.compile(r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)$")
	for key in ("name", "version", "abstract", "maintainer", "license",
	            "provides", "meta-spec"):
	    assert key in meta, "missing " + key
	assert meta["name"] == "rl_redis", meta["name"]
	assert meta["meta-spec"]["version"] == "1.0.0", meta["meta-spec"]
	assert meta["version"] == version, (meta["version"], version)
	assert meta["license"] == "postgresql", meta["license"]
	assert meta["release_status"] in ("stable", "testing", "unstable")
	ext = meta["provides"]["rl_redis"]
	assert semver.match(ext["version"]) and ext["version"] == version, ext
	for f in (ext["file"], ext["docfile"]):
	    assert os.path.isfile(os.path.join(src, f)), f + " is not in the checkout"
	req = meta["prereqs"]["runtime"]["requires"]["PostgreSQL"]
	assert semver.match(req), req
	assert all(len(t) >= 2 and "/" not in t for t in meta["tags"])
	print("META.json: rl_redis", meta["version"], "requires PostgreSQL", req)
EOF
ok "META.json is valid JSON with the PGXN keys, version $UPVER"

echo "== dpkg-buildpackage -us -uc -b"
PGV=$(pg_config --version | sed -E 's/^PostgreSQL ([0-9]+).*/\1/')
PKG=postgresql-$PGV-rl-redis
# debian/control names the packages of Debian 12's PostgreSQL 15; on another
# major (17 in trixie, 18 in sid: make test-matrix) pg_buildext makes it anew
# from control.in, as Debian's own builds of extensions do
(cd "$SRC" && pg_buildext updatecontrol) >"$WORK/updatecontrol.log" 2>&1 ||
	{ cat "$WORK/updatecontrol.log" >&2; fail "pg_buildext updatecontrol failed"; }
(cd "$SRC" && dpkg-buildpackage -us -uc -b) >"$WORK/build.log" 2>&1 ||
	{ tail -40 "$WORK/build.log" >&2; fail "dpkg-buildpackage failed (log above)"; }
DEB=$(ls "$WORK/${PKG}_${DEBVER}"_*.deb 2>/dev/null | head -1)
[ -n "$DEB" ] || fail "no ${PKG}_${DEBVER}_*.deb in $WORK: $(ls "$WORK")"
ok "built $(basename "$DEB") ($(stat -c %s "$DEB") bytes) in $((SECONDS - start)) s"

echo "== contents (dpkg-deb -c)"
dpkg-deb -c "$DEB" | awk '{print $6}' | sed 's|^\./|/|' | grep -v '/$' | sort >"$WORK/files.actual"
cat "$WORK/files.actual"
# what the package must hold, and nothing more
mkvar() { make -s --no-print-directory -C "$SRC" --eval 'rl-print-%: ; @echo $($*)' "rl-print-$1"; }
{
	echo "/usr/lib/postgresql/$PGV/lib/rl_redis.so"
	echo "/usr/share/postgresql/$PGV/extension/rl_redis.control"
	for f in "$SRC"/sql/rl_redis--*.sql; do
		echo "/usr/share/postgresql/$PGV/extension/$(basename "$f")"
	done
	# JIT bitcode, installed by PGXS when the server was built with LLVM
	if [ "$(mkvar with_llvm)" = yes ]; then
		echo "/usr/lib/postgresql/$PGV/lib/bitcode/rl_redis.index.bc"
		for o in $(mkvar OBJS); do
			echo "/usr/lib/postgresql/$PGV/lib/bitcode/rl_redis/${o%.o}.bc"
		done
	fi
	for f in README.md.gz changelog.gz copyright; do
		echo "/usr/share/doc/$PKG/$f"
	done
} | sort >"$WORK/files.expected"
diff -u "$WORK/files.expected" "$WORK/files.actual" >&2 ||
	fail "the package's files differ from the expected list (- missing, + unexpected)"
ok "the .deb holds exactly the $(wc -l <"$WORK/files.expected") expected files"

echo "== control (dpkg-deb -I)"
dpkg-deb -I "$DEB" control
depends=$(dpkg-deb -f "$DEB" Depends)
[ "$(dpkg-deb -f "$DEB" Package)" = "$PKG" ] || fail "Package is not $PKG"
[ "$(dpkg-deb -f "$DEB" Version)" = "$DEBVER" ] || fail "Version is not $DEBVER"
# libssl3t64 on trixie and sid (Debian's 64-bit time_t transition)
for dep in "postgresql-$PGV\b" 'libhiredis[0-9.]+ ' 'libssl[0-9.]+(t64)? ' 'libc6 '; do
	grep -Eq "(^|, )$dep" <<<"$depends" || fail "Depends lacks ${dep%% *}: $depends"
done
ok "Depends: $depends"

echo "== clean server: a copy of PostgreSQL $PGV without rl_redis, plus the .deb"
ROOT=$WORK/root
mkdir -p "$ROOT/usr/lib/postgresql" "$ROOT/usr/share/postgresql"
cp -a "/usr/lib/postgresql/$PGV" "$ROOT/usr/lib/postgresql/"
cp -a "/usr/share/postgresql/$PGV" "$ROOT/usr/share/postgresql/"
find "$ROOT" -name 'rl_redis*' -prune -exec rm -rf {} +
[ -z "$(find "$ROOT" -name '*rl_redis*')" ] || fail "rl_redis files left in the copy"
dpkg-deb -x "$DEB" "$ROOT"
PGBIN=$ROOT/usr/lib/postgresql/$PGV/bin
PKGLIBDIR=$("$PGBIN/pg_config" --pkglibdir)
SHAREDIR=$("$PGBIN/pg_config" --sharedir)
echo "copy's pg_config: PKGLIBDIR = $PKGLIBDIR, SHAREDIR = $SHAREDIR"
[ "$PKGLIBDIR" = "$ROOT/usr/lib/postgresql/$PGV/lib" ] &&
	[ "$SHAREDIR" = "$ROOT/usr/share/postgresql/$PGV" ] ||
	fail "the copied PostgreSQL does not relocate to $ROOT"
[ -f "$PKGLIBDIR/rl_redis.so" ] && [ -f "$SHAREDIR/extension/rl_redis.control" ] ||
	fail "the .deb's files are not where the copy looks for them"
ok "PostgreSQL copied to $ROOT ($(du -sm "$ROOT" | cut -f1) MB), rl_redis only from the .deb"

echo "== throwaway Redis and PostgreSQL (sql_tests/lib.sh) from the copy"
export RL_PGBIN=$PGBIN
if ! TMPDIR=$WORK rl_cluster_start; then
	trap cleanup EXIT
	fail "the cluster did not start"
fi
# rl_cluster_start registers rl_cluster_stop alone; ours also removes $WORK
trap cleanup EXIT
ok "cluster on port $RL_PGPORT (preloading rl_redis), Redis on $RL_REDIS_PORT"

echo "== proof: the server runs the packaged library from $ROOT"
"$PGBIN/psql" -X -v ON_ERROR_STOP=1 -q <<-'EOF' >"$WORK/proof.txt" 2>&1 ||
	SELECT name, setting FROM pg_settings
	 WHERE name IN ('dynamic_library_path', 'shared_preload_libraries', 'rl_redis.port')
	 ORDER BY name;
	SELECT name, setting FROM pg_config WHERE name IN ('BINDIR', 'PKGLIBDIR', 'SHAREDIR');
	SELECT name, default_version FROM pg_available_extensions WHERE name = 'rl_redis';
	SELECT pg_backend_pid() AS pid \gset
	\setenv BACKEND_PID :pid
	\! echo "backend $BACKEND_PID maps:"; grep rl_redis.so /proc/$BACKEND_PID/maps | awk '{print $6}' | sort -u
	EOF
	{ cat "$WORK/proof.txt" >&2; fail "psql failed"; }
cat "$WORK/proof.txt"
postmaster=$(head -1 "$RL_DIR/pgdata/postmaster.pid")
mapped=$(grep rl_redis.so "/proc/$postmaster/maps" | awk '{print $6}' | sort -u)
echo "postmaster $postmaster maps: $mapped"
[ "$mapped" = "$PKGLIBDIR/rl_redis.so" ] || fail "the postmaster maps '$mapped', not $PKGLIBDIR/rl_redis.so"
grep -qx "$PKGLIBDIR/rl_redis.so" "$WORK/proof.txt" || fail "the backend does not map $PKGLIBDIR/rl_redis.so"
grep -q "$SHAREDIR" "$WORK/proof.txt" || fail "the server's SHAREDIR is not $SHAREDIR"
ok "postmaster and backend map $PKGLIBDIR/rl_redis.so"

echo "== smoke test of the packaged extension (the full pg_regress run is make test's)"
# every algorithm, a policy and a concurrency slot decide on a frozen clock
# (exact rows), the keys land in Redis, and the packaged upgrade scripts take
# a 1.0 installation to the default version
"$PGBIN/psql" -X -q -A -t -v ON_ERROR_STOP=1 <<-EOF >"$WORK/smoke.out" 2>&1 ||
	CREATE EXTENSION rl_redis;
	SELECT extversion = '$EXTVER' FROM pg_extension WHERE extname = 'rl_redis';
	SET rl_redis.key_prefix = 'debsmoke:';
	SET rl_redis.test_clock_ms = 1000000000000;
	SELECT (r).allowed, (r).remaining FROM rl_fixed('a', 1, 60000) r;
	SELECT (r).allowed, (r).remaining, (r).retry_after_ms FROM rl_fixed('a', 1, 60000) r;
	SELECT rl_sliding_allow('a', 1, 60000), rl_sliding_allow('a', 1, 60000);
	SELECT rl_token_bucket_allow('a', 1, 60000), rl_token_bucket_allow('a', 1, 60000);
	SELECT rl_gcra_allow('a', 1, 60000), rl_gcra_allow('a', 1, 60000);
	SELECT rl_sliding_counter_allow('a', 1, 60000), rl_sliding_counter_allow('a', 1, 60000);
	INSERT INTO rl_policy (name, algorithm, lim, window_ms) VALUES ('smoke', 'fixed', 2, 60000);
	SELECT rl_allow('smoke', 'a'), rl_allow('smoke', 'a'), rl_allow('smoke', 'a');
	BEGIN;
	SELECT (r).allowed FROM rl_concurrency_acquire('a', 1, 60000) r;
	SELECT (r).allowed FROM rl_concurrency_acquire('a', 1, 60000) r;
	COMMIT;
	SELECT (r).allowed FROM rl_concurrency_acquire('a', 1, 60000) r;
	CREATE DATABASE debsmoke_upgrade;
	\\c debsmoke_upgrade
	CREATE EXTENSION rl_redis VERSION '1.0';
	ALTER EXTENSION rl_redis UPDATE;
	SELECT extversion = '$EXTVER' FROM pg_extension WHERE extname = 'rl_redis';
	EOF
	{ cat "$WORK/smoke.out" >&2; fail "psql failed against the packaged extension"; }
cat >"$WORK/smoke.expected" <<-'EOF'
	t
	t|0
	f|0|20000
	t|f
	t|f
	t|f
	t|f
	t|t|f
	t
	f
	t
	t
	EOF
diff -u "$WORK/smoke.expected" "$WORK/smoke.out" >&2 ||
	fail "the packaged extension decided otherwise (- expected, + got)"
keys=$("$RL_REDIS_CLI" -p "$RL_REDIS_PORT" --scan --pattern 'debsmoke:*' | wc -l)
[ "$keys" -ge 6 ] || fail "only $keys debsmoke:* keys in Redis"
ok "smoke test: every algorithm, a policy, a concurrency slot and the 1.0 upgrade, $keys keys in Redis"

echo "test_deb: $PKG $DEBVER in $((SECONDS - start)) s"
echo "test_deb: $passed passed, 0 failed"
