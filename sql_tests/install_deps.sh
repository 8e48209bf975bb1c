#!/usr/bin/env bash
# Installs the Debian 12 packages that building, testing and the demo need,
# when any of them is missing. Safe to run again: it does nothing when all
# are present.
set -euo pipefail

packages=(
	build-essential
	postgresql-15
	postgresql-server-dev-15
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
)

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
