# Shared shell helpers for the test runner, the benchmark and the demo:
# start a throwaway Redis and a throwaway PostgreSQL cluster on free loopback
# ports inside one temporary folder, and stop them again.
#
# Usage (from bash):
#   . sql_tests/lib.sh
#   rl_build_install [DIR]      # packages, build, install (of the source in DIR)
#   rl_cluster_start            # sets RL_DIR, RL_PGPORT, RL_REDIS_PORT, PG* vars
#   ...                         # psql works, Redis answers on $RL_REDIS_PORT
#   rl_cluster_stop             # also registered as an EXIT trap
#
# PostgreSQL refuses to run as root, so when this runs as root the cluster is
# owned by, and started as, the unprivileged "postgres" user.
#
# The cluster preloads the library (shared_preload_libraries = 'rl_redis',
# as the README's install steps do), so the installed rl_redis.so must exist
# before rl_cluster_start; RL_PRELOAD=<list> overrides the setting (an empty
# list starts the cluster without preloading).
#
# RL_REDIS_SERVER / RL_REDIS_CLI name the server and its client (default
# redis-server / redis-cli; valkey-server / valkey-cli for Valkey); the
# Python tests (conftest.py) read the same variables.
RL_REDIS_SERVER=${RL_REDIS_SERVER:-redis-server}
RL_REDIS_CLI=${RL_REDIS_CLI:-redis-cli}

# Installs the packages that are missing (sql_tests/install_deps.sh), then
# builds and installs the extension whose source is in DIR (default: this
# one); sudo for the install when not root.
rl_build_install() {
	local sudo= dir=${1:-.}
	[ "$(id -u)" = 0 ] || sudo=sudo
	bash sql_tests/install_deps.sh || return 1
	make -s -C "$dir" -j"$(nproc)" >/dev/null || return 1
	$sudo make -s -C "$dir" install >/dev/null || return 1
}

# Prints a TCP port on 127.0.0.1 that nothing listens on right now.
rl_free_port() {
	/usr/bin/python3 -c 'import socket
s = socket.socket()
s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])'
}

# Runs a command as the cluster owner (postgres when we are root).
rl_as_owner() {
	if [ "$(id -u)" = 0 ]; then
		runuser -u postgres -- "$@"
	else
		"$@"
	fi
}

# Waits until redis-server answers PING on the given port (about 10 s at most).
rl_wait_redis() {
	local port=$1 i
	for i in $(seq 1 100); do
		[ "$("$RL_REDIS_CLI" -p "$port" ping 2>/dev/null)" = PONG ] && return 0
		sleep 0.1
	done
	echo "$RL_REDIS_SERVER on port $port did not start" >&2
	return 1
}

# Starts Redis and PostgreSQL in a new temporary folder and exports the
# variables that psql, pg_regress and the Python tests read.
rl_cluster_start() {
	RL_PGBIN=${RL_PGBIN:-$(pg_config --bindir)}
	RL_DIR=$(mktemp -d "${TMPDIR:-/tmp}/rl_redis_test.XXXXXX")
	chmod 755 "$RL_DIR"
	[ "$(id -u)" = 0 ] && chown postgres "$RL_DIR"
	RL_REDIS_PORT=$(rl_free_port)
	RL_PGPORT=$(rl_free_port)
	export RL_DIR RL_REDIS_PORT RL_PGPORT
	trap rl_cluster_stop EXIT

	"$RL_REDIS_SERVER" --port "$RL_REDIS_PORT" --bind 127.0.0.1 --save '' \
		--appendonly no --dir "$RL_DIR" --logfile "$RL_DIR/redis.log" \
		--pidfile "$RL_DIR/redis.pid" --daemonize yes >/dev/null
	rl_wait_redis "$RL_REDIS_PORT" || return 1

	rl_as_owner "$RL_PGBIN/initdb" -D "$RL_DIR/pgdata" -U postgres \
		--auth=trust --no-sync -E UTF8 --locale=C >"$RL_DIR/initdb.log" 2>&1 ||
		{ cat "$RL_DIR/initdb.log" >&2; return 1; }
	cat >>"$RL_DIR/pgdata/postgresql.conf" <<-EOF
		port = $RL_PGPORT
		listen_addresses = '127.0.0.1'
		unix_socket_directories = '$RL_DIR'
		fsync = off
		max_connections = 130
		max_prepared_transactions = 10
		wal_level = replica
		max_wal_senders = 4
		hot_standby = on
		shared_preload_libraries = '${RL_PRELOAD-rl_redis}'
		rl_redis.host = '127.0.0.1'
		rl_redis.port = $RL_REDIS_PORT
	EOF
	echo "host replication all 127.0.0.1/32 trust" >>"$RL_DIR/pgdata/pg_hba.conf"
	rl_as_owner "$RL_PGBIN/pg_ctl" -D "$RL_DIR/pgdata" -l "$RL_DIR/postgres.log" \
		-w -t 60 start >/dev/null || { cat "$RL_DIR/postgres.log" >&2; return 1; }

	export PGHOST=127.0.0.1 PGPORT=$RL_PGPORT PGUSER=postgres PGDATABASE=postgres
}

# Stops whatever rl_cluster_start started and removes its folder.
rl_cluster_stop() {
	[ -n "${RL_DIR:-}" ] && [ -d "$RL_DIR" ] || return 0
	if [ -f "$RL_DIR/pgdata/postmaster.pid" ]; then
		rl_as_owner "$RL_PGBIN/pg_ctl" -D "$RL_DIR/pgdata" -m immediate -w stop >/dev/null 2>&1
	fi
	if [ -f "$RL_DIR/redis.pid" ]; then
		kill "$(cat "$RL_DIR/redis.pid")" 2>/dev/null
	fi
	sleep 0.2
	rm -rf "$RL_DIR"
	RL_DIR=
}
