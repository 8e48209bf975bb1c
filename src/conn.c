/*
 * conn.c
 *	  The per-backend cache of connections to Redis (RlConn) and what
 *	  belongs to one: its settings, its accessors, its closing.
 *
 * Each server has one RlConn in a per-backend cache keyed by its address
 * (like postgres_fdw's connection cache), with its own socket, wait-event
 * set, TLS state, circuit breaker and transaction-end queue; every helper
 * takes the connection it works on. rl_conn_get returns the connection
 * of the configured server (rl_redis.host, rl_redis.port). Nothing here
 * does I/O but closing a socket.
 */
#include "postgres.h"

#include "common/hashfn.h"
#include "lib/stringinfo.h"
#include "port/pg_bitutils.h"
#include "storage/fd.h"
#include "storage/latch.h"
#include "utils/hsearch.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"

#include "rl_redis.h"
#include "conn_internal.h"

/* the connections of this backend, by address and kind (of RlConn) */
static HTAB *conn_cache = NULL;

/* the connection of the configured server, as of the last rl_conn_get */
static RlConn *current = NULL;

/* counts the changes of server (connection settings) */
static uint64 server_generation = 1;

/* counts the assignments of connection settings (see rl_settings_version) */
static uint64 settings_version = 1;

/* the settings_version of the last rl_conn_get */
static uint64 current_seen = 0;

/* Closes the socket and frees everything that belongs to the connection. */
void
rl_disconnect(RlConn *conn)
{
	pgsocket	sock = conn->sock;

	/* first out of the idle handler's sight (rl_idle_timeout_handler) */
	conn->ready = false;
	conn->sock = PGINVALID_SOCKET;
	pg_compiler_barrier();
	conn->shut = false;
	rl_tls_free(&conn->tls);
	if (conn->wes)
		FreeWaitEventSet(conn->wes);
	conn->wes = NULL;
	if (sock != PGINVALID_SOCKET)
		closesocket(sock);
	if (conn->fd_acquired)
		ReleaseExternalFD();
	conn->fd_acquired = false;
	if (conn->reader)
		redisReaderFree(conn->reader);
	conn->reader = NULL;
	conn->ready = false;
	conn->skip_replies = 0;
	conn->stalled_since = 0;
	rl_queue_unconfirmed(conn);
}

/*
 * True when the last call on conn (rl_command, or a call of the shared
 * transport accounted to it, rl_conn_note_sent), failed, interrupted or
 * not, may have reached Redis, which may then have run it; false when it
 * never left (breaker open, no connection, a write cut short, a call the
 * worker never took). What a call may have done in Redis is undone (a slot
 * given back) by this answer alone, whatever way the call went.
 */
bool
rl_command_was_sent(RlConn *conn)
{
	return conn->last_command_sent;
}

/*
 * Notes whether the last call accounted to conn, which went through the
 * worker of the shared transport instead, may have reached Redis (see
 * rl_command_was_sent).
 */
void
rl_conn_note_sent(RlConn *conn, bool sent)
{
	conn->last_command_sent = sent;
}

/*
 * A number that changes whenever the connection settings name another
 * server: state kept for one server (pending refunds) is not sent to
 * another.
 */
uint64
rl_server_generation(void)
{
	return server_generation;
}

/*
 * A number that changes whenever a connection setting was assigned (the
 * value may be the same): each connection, and the router, compare the
 * settings again when it changed since they last looked.
 */
uint64
rl_settings_version(void)
{
	if (rl_connection_settings_changed)
	{
		rl_connection_settings_changed = false;
		settings_version++;
	}
	return settings_version;
}

/* The server of a connection, for messages: "host:port" or the socket path. */
const char *
rl_conn_name(RlConn *conn)
{
	return conn->address;
}

/*
 * Every entry of conn_cache, linked: the transaction-end callbacks walk
 * this list, as a hash_seq scan there could raise.
 */
RlConn *rl_conn_list = NULL;

/* Writes the address of host and port into buf: "host:port" or the path. */
static void
rl_format_address(char *buf, const char *host, int port)
{
	if (host[0] == '/')
		snprintf(buf, RL_ADDRESS_LEN, "%s", host);
	else
		snprintf(buf, RL_ADDRESS_LEN, "%s:%d", host, port);
}

/*
 * Returns the cache entry of the server at host and port for kind, creating
 * it (not connected) when there is none. Does no I/O.
 */
RlConn *
rl_conn_lookup(const char *host, int port, RlConnKind kind)
{
	RlConnKey	key;
	RlConn	   *conn;
	bool		found;

	if (conn_cache == NULL)
	{
		HASHCTL		ctl;

		ctl.keysize = sizeof(RlConnKey);
		ctl.entrysize = sizeof(RlConn);
		ctl.hcxt = TopMemoryContext;
		conn_cache = hash_create("rl_redis connections", 8, &ctl,
								 HASH_ELEM | HASH_BLOBS | HASH_CONTEXT);
	}
	memset(&key, 0, sizeof(key));
	rl_format_address(key.address, host, port);
	key.kind = kind;
	conn = hash_search(conn_cache, &key, HASH_ENTER, &found);
	if (!found)
	{
		/* everything but the key starts zeroed */
		memset((char *) conn + sizeof(RlConnKey), 0,
			   sizeof(RlConn) - sizeof(RlConnKey));
		strlcpy(conn->host, host, RL_ADDRESS_LEN);
		conn->port = port;
		conn->sock = PGINVALID_SOCKET;
		conn->next = rl_conn_list;
		pg_compiler_barrier();	/* whole before the idle handler can see it */
		rl_conn_list = conn;
	}
	return conn;
}

/*
 * Returns the connection to the server at host and port for kind (a
 * cluster node, a master a sentinel named, a sentinel, where a redirection
 * sends queued work), which may not be open yet (rl_command opens it); NULL
 * when it is a new one and the cache holds RL_MAX_CONNECTIONS already, so
 * that no server's answers can make it grow without bound. Does no I/O.
 */
RlConn *
rl_conn_at(const char *host, int port, RlConnKind kind)
{
	if (conn_cache != NULL &&
		hash_get_num_entries(conn_cache) >= RL_MAX_CONNECTIONS)
	{
		RlConnKey	key;

		memset(&key, 0, sizeof(key));
		rl_format_address(key.address, host, port);
		key.kind = kind;
		return hash_search(conn_cache, &key, HASH_FIND, NULL);
	}
	return rl_conn_lookup(host, port, kind);
}

/*
 * Fills info with the state of this backend's n-th connection (0-based);
 * false when there are not that many.
 */
bool
rl_conn_info(int n, RlConnInfo *info)
{
	RlConn	   *conn;

	for (conn = rl_conn_list; conn != NULL && n > 0; conn = conn->next)
		n--;
	if (conn == NULL)
		return false;
	memset(info, 0, sizeof(*info));
	strlcpy(info->server, conn->address, sizeof(info->server));
	info->kind = conn->kind;
	info->open = conn->ready && conn->sock != PGINVALID_SOCKET && !conn->shut;
	info->queued = conn->queue_count;
	info->scripts_loaded = conn->library_loaded ? RL_NUM_SCRIPTS : 0;
	if (conn->breaker.outage_start != 0)
	{
		info->failing_since = conn->breaker.outage_start;
		rl_failure_text(&conn->breaker.last_failure, info->last_error,
						sizeof(info->last_error));
		if (rl_retry_interval > 0)
			info->retry_in_ms =
				Max(TimestampDifferenceMilliseconds(GetCurrentTimestamp(),
													TimestampTzPlusMilliseconds(conn->breaker.last_failure_at,
																				rl_retry_interval)), 0);
	}
	return true;
}

/*
 * Notes that the function library is loaded on conn's server (it was
 * loaded, or one of its functions just ran there).
 */
void
rl_conn_library_loaded(RlConn *conn)
{
	conn->library_loaded = true;
	conn->load_refused_at = 0;
}

/*
 * Notes that conn's server refused to load the library for good (an ACL
 * user without FUNCTION LOAD, the command renamed: rl_error_lasts).
 */
void
rl_conn_library_refused(RlConn *conn)
{
	conn->load_refused_at = GetCurrentTimestamp();
}

/*
 * Whether the library may be sent to conn's server: not within
 * RL_LOAD_RETRY_MS of a refusal, so that a server that refuses it is not
 * sent a copy of it with every call.
 */
bool
rl_conn_library_may_load(RlConn *conn)
{
	TimestampTz now = GetCurrentTimestamp();

	/* (a clock that stepped back ends the wait) */
	return conn->load_refused_at == 0 || now < conn->load_refused_at ||
		now >= TimestampTzPlusMilliseconds(conn->load_refused_at,
										   RL_LOAD_RETRY_MS);
}

/* Notes that the library is not loaded on conn's server ("not found"). */
void
rl_conn_library_forget(RlConn *conn)
{
	conn->library_loaded = false;
}

/* True when the library is known loaded on conn's server. */
bool
rl_conn_library_known(RlConn *conn)
{
	return conn->library_loaded;
}

/* The host name (or address, or socket path) conn was made for. */
const char *
rl_conn_host(RlConn *conn)
{
	return conn->host;
}

/*
 * Closes conn (the next command opens it again, with its checks); what its
 * queue holds stays.
 */
void
rl_conn_close(RlConn *conn)
{
	rl_disconnect(conn);
}

/*
 * The servers the settings name are others now (rl_redis.mode, nodes or
 * sentinel_master changed): closes every connection and drops what their
 * queues hold, with a warning that says why (see rl_server_generation).
 */
void
rl_servers_changed(const char *why)
{
	RlConn	   *conn;

	for (conn = rl_conn_list; conn != NULL; conn = conn->next)
	{
		rl_disconnect(conn);
		rl_discard_queue(conn, why);
	}
	server_generation++;
	current = NULL;
}

/*
 * The settings name another server than the one conn's queued work is for:
 * drops that work, with a warning, and counts a change of server (see
 * rl_server_generation).
 */
void
rl_conn_other_server(RlConn *conn)
{
	rl_discard_queue(conn, "the connection settings now name another Redis server");
	server_generation++;
}

/*
 * Returns the connection of the configured server, which may not be open
 * yet (rl_command opens it). When the settings now name another server
 * than the last call's, the previous server's connection is closed and what
 * its queue holds is dropped with a warning: state kept for one server is
 * not sent to another (see rl_server_generation).
 */
RlConn *
rl_conn_get(void)
{
	RlConn	   *conn;

	if (current != NULL && current_seen == rl_settings_version())
		return current;
	current_seen = rl_settings_version();
	conn = rl_conn_lookup(rl_host, rl_port, RL_CONN_SERVER);
	if (current != NULL && current != conn)
	{
		rl_disconnect(current);
		rl_conn_other_server(current);
	}
	current = conn;
	return conn;
}

/*
 * Returns the connection the last calls went to, where the work of a
 * transaction end that undoes them is queued (the configured server's when
 * there was no call yet).
 */
RlConn *
rl_conn_current(void)
{
	return current != NULL ? current : rl_conn_get();
}

/* Forgets conn's outage, so that its next call tries the network. */
void
rl_conn_reset_breaker(RlConn *conn)
{
	rl_breaker_reset(&conn->breaker);
}

/*
 * Writes the current settings that a connection of kind is made with into
 * buf, to compare (the configured server's address for the one server of
 * standalone mode; where the others are is the router's business).
 */
void
rl_settings_signature(StringInfo buf, RlConnKind kind)
{
	resetStringInfo(buf);
	appendStringInfo(buf, "%d%c%s%c%s%c%s%c%s", (int) rl_tls, 0,
					 rl_tls_ca_file, 0, rl_tls_cert_file, 0, rl_tls_key_file, 0,
					 rl_tls_server_name);
	if (kind == RL_CONN_SENTINEL)
		appendStringInfo(buf, "%c%s", 0, rl_sentinel_password);
	else
		appendStringInfo(buf, "%c%s%c%s%c%s%c%d", 0, rl_username, 0,
						 rl_password, 0, rl_password_file, 0, rl_database);
	if (rl_topology()->one_server)
		appendStringInfo(buf, "%c%s%c%d", 0, rl_host, 0, rl_port);
}

/*
 * True when the current connection settings differ from what conn's last
 * connection was made with (conn->settings, which must be set).
 */
bool
rl_settings_differ(RlConn *conn)
{
	StringInfoData now;
	bool		differ;

	initStringInfo(&now);
	rl_settings_signature(&now, conn->kind);
	differ = now.len != conn->settings.len ||
		memcmp(now.data, conn->settings.data, now.len) != 0;
	pfree(now.data);
	return differ;
}

/*
 * True when a connection setting was assigned a value that differs from
 * what the open connection was made with (a reload that assigns the same
 * values again keeps the connection).
 */
bool
rl_settings_changed(RlConn *conn)
{
	return !conn->ready || rl_settings_differ(conn);
}

/*
 * A hash of the connection settings of a standalone server (and the mode):
 * two processes with the same hash talk to the same server the same way,
 * so one may send the other's calls (rl_redis.transport = shared).
 */
uint64
rl_settings_hash(void)
{
	static StringInfoData buf;
	uint64		h;

	if (buf.data == NULL)
	{
		MemoryContext old = MemoryContextSwitchTo(TopMemoryContext);

		initStringInfo(&buf);
		MemoryContextSwitchTo(old);
	}
	rl_settings_signature(&buf, RL_CONN_SERVER);
	appendStringInfo(&buf, "%c%s", 0, rl_topology()->name);
	h = hash_bytes_extended((const unsigned char *) buf.data, buf.len, 0);
	resetStringInfo(&buf);
	return h;
}

/* True when conn is connected and usable (not to be opened first). */
bool
rl_conn_ready(RlConn *conn)
{
	return conn->ready && conn->sock != PGINVALID_SOCKET && !conn->shut;
}

/* True when conn holds work of transaction ends not yet sent or confirmed. */
bool
rl_conn_has_queued(RlConn *conn)
{
	return conn->queue_count > 0;
}
