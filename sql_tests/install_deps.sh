#!/usr/bin/env bash
# Installs the Debian 12 packages that building, testing and the demo need,
# when any of them is missing. Safe to run again: it does nothing when all
# are present. RL_PG_MAJOR (default 15) names the PostgreSQL major (17 in
# trixie, 18 in sid: sql_tests/test_matrix.sh sets it); RL_REDIS_SERVER=
# valkey-server adds Valkey's packages.
set -euo pipefail
pgv=${RL_PG_MAJOR:-15}

packages=(
	build-essential
	postgresql-$pgv
	postgresql-server-dev-$pgv
	libhiredis-dev
	libssl-dev
	# the Debian package (sql_tests/test_deb.sh, dpkg-buildpackage)
	debhelper
	postgresql-server-dev-all
	openssl
	redis-server
	redis-tools
	python3-psycopg
	python3-pytest
	python3-pytest-xdist
	pgbouncer
	# the postgres_exporter route of the metrics (sql_tests/test_exporter.py)
	prometheus-postgres-exporter
)
case ${RL_REDIS_SERVER:-} in
valkey*) packages+=(valkey-server valkey-tools) ;;
esac

missing=()
for p in "${packages[@]}"; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "installing: ${missing[*]}"
sudo=
[ "$(id -u)" = 0 ] || sudo=sudo
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq -o Dpkg::Options::=--force-confold "${missing[@]}" >/dev/null
