/*
 * transport.c
 *	  The per-backend connections to Redis and the transaction-end queue.
 *
 * Each server has one RlConn in a per-backend cache keyed by its address
 * (like postgres_fdw's connection cache), with its own socket, wait-event
 * set, TLS state, circuit breaker and transaction-end queue; every helper
 * here takes the connection it works on. rl_conn_get returns the connection
 * of the configured server (rl_redis.host, rl_redis.port).
 *
 * We own the socket and use hiredis only to parse replies (redisReader); the
 * commands are encoded here. Every wait, for connect, write and read, goes
 * through one WaitEventSet holding MyLatch and the socket, so that
 * statement_timeout, pg_cancel_backend and pg_terminate_backend end a wait
 * on a hung Redis at once, and postmaster death ends the backend.
 *
 * A connection is opened on first use (resolve, open, TLS, handshake: one
 * step each) and kept for the life of the backend. It is discarded, never
 * reused, after any failure, and after a connection setting changed; the
 * next call opens a new one. A call an error cut short after it was written
 * keeps its connection: its replies are read and dropped first, so that
 * none reaches another caller.
 *
 * Work that belongs to the end of a (sub)transaction (slot releases,
 * refunds) is queued on a connection with rl_defer_command. The transaction
 * callback here, which runs after the other modules' ones, writes each queue
 * to its open connection within a fixed budget and reads the replies it can
 * within it; the rest are read before the next command. A connection Redis
 * closed, or that a failed call discarded, is opened again within that
 * budget, to the address it was last opened to (no host-name lookup at
 * commit); only what Redis did not take in time waits for the session's
 * next call. It never raises. A queued command leaves
 * the queue when its reply is read. When the connection is lost first, a
 * command that is harmless to repeat (a slot release, a refund that drops a
 * record) is sent again on the next connection, and one that is not (a
 * refund that subtracts) is dropped, as it may have been applied: nothing is
 * applied twice.
 *
 * With rl_redis.tls, the bytes go through OpenSSL (tls.c) on the same
 * non-blocking socket (rl_io_read/rl_io_write): a TLS handshake, read or write
 * that has to wait says for what, and waits in rl_wait like the rest.
 * Nothing outside this file and tls.c touches the socket.
 */
#include "postgres.h"

#include <errno.h>
#include <signal.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>
#include <arpa/inet.h>

#include "access/xact.h"
#include "common/hashfn.h"
#include "lib/stringinfo.h"
#include "miscadmin.h"
#include "pgstat.h"
#include "port/atomics.h"
#include "port/pg_bitutils.h"
#include "storage/fd.h"
#include "storage/ipc.h"
#include "storage/latch.h"
#include "utils/builtins.h"
#include "utils/hsearch.h"
#include "utils/memutils.h"
#include "utils/timeout.h"
#include "utils/timestamp.h"

#include "rl_redis.h"

/*
 * One connection to one Redis server, an entry of the per-backend cache
 * (conn_cache) keyed by the server's address. Everything that belongs to a
 * server is here: the socket and its wait-event set, the TLS state, the
 * circuit breaker and the transaction-end queue.
 *
 * The queue holds commands for the end of a transaction: encoded one after
 * another in queue; the end offset of each in queue_ends, and whether it
 * may be sent twice, and whether it gives units back, in queue_flags. What
 * a transaction end could not
 * write waits for the next command on the connection, which sends it first:
 * so the queue never holds more than the work of the transaction ends since
 * the last command that reached Redis (a charge needs such a command). It
 * belongs to its server: when the connection settings name another, it is
 * dropped with a warning. While the queue is being written,
 * queue_write_from and queue_write_done say which bytes went out, so that a
 * write cut short by an error or an interrupt is accounted for.
 */
struct RlConn
{
	/* the hash key (an RlConnKey): the address and the kind */
	char		address[RL_ADDRESS_LEN];	/* "host:port" or the socket path;
											 * also its name in messages */
	RlConnKind	kind;
	char		host[RL_ADDRESS_LEN];	/* host name, address or socket path */
	int			port;
	uint64		settings_seen;	/* settings_version when last compared */
	uint32		scripts_loaded; /* bit per RlScript.id: known loaded on the
								 * server since this connection was made */
	volatile sig_atomic_t shut; /* the idle timeout shut its socket down */
	bool		got_redirected; /* work moved here from another node's queue */
	pgsocket	sock;			/* PGINVALID_SOCKET when there is none */
	bool		fd_acquired;	/* we hold an external-FD slot for sock */
	WaitEventSet *wes;			/* MyLatch, postmaster death, sock */
	int			sock_pos;		/* position of sock in wes */
	uint32		sock_events;	/* what wes waits for on sock right now */
	redisReader *reader;
	RlTls		tls;			/* with rl_redis.tls */
	bool		ready;			/* connected, nothing unread but the pending
								 * replies: safe to send */
	bool		last_command_sent;	/* the last command was written whole,
									 * or handed to the worker (it may have
									 * run) */
	int			skip_replies;	/* of an interrupted call: read and dropped
								 * before the queue's */
	int			replies_due;	/* of the commands rl_pipeline_send wrote */
	TimestampTz replies_deadline;	/* when the next is due at the latest */
	int			replies_timeout_ms; /* of a pipeline: the wait for each */
	uint64		replies_read;	/* counts the replies read */
	TimestampTz stalled_since;	/* a wait for replies timed out then, and
								 * none came since (0: none timed out) */
	bool		wait_for_call;	/* Redis did not run queued work here
								 * (READONLY, LOADING ...): the transaction
								 * ends leave it to the next call */
	RlBreaker	breaker;
	StringInfoData settings;	/* the connection settings it was made with */

	/*
	 * The address list of a connect in progress: a cancel while connecting
	 * leaves it behind, and the next connect frees it.
	 */
	struct addrinfo *pending_addrs;

	/*
	 * The address the last connection was opened to (addrlen 0: none yet),
	 * which a transaction end connects to again without a name lookup.
	 */
	struct sockaddr_storage addr;
	socklen_t	addrlen;

	/* the transaction-end queue */
	StringInfoData queue;
	int		   *queue_ends;
	uint8	   *queue_flags;	/* RL_QUEUED_* of each command */
	uint8	   *queue_tries;	/* times written whole */
	int			queue_count;
	int			queue_max;
	int			queue_confirmed;	/* the first commands, replies read */
	int			pending_replies;	/* the first commands of the queue that
									 * were written whole, their replies not
									 * read yet */
	size_t		queue_partial;	/* bytes written of the queue's next command */
	bool		queue_writing;
	size_t		queue_write_from;
	size_t		queue_write_done;
	struct RlConn *next;		/* the next entry of conn_list */
};

/* The hash key of conn_cache: the first fields of RlConn. */
typedef struct RlConnKey
{
	char		address[RL_ADDRESS_LEN];
	RlConnKind	kind;
} RlConnKey;

StaticAssertDecl(offsetof(RlConn, kind) == offsetof(RlConnKey, kind) &&
				 offsetof(RlConn, host) >= sizeof(RlConnKey),
				 "RlConnKey must be the first fields of RlConn");

/* the connections of this backend, by address and kind (of RlConn) */
static HTAB *conn_cache = NULL;

/* the connection of the configured server, as of the last rl_conn_get */
static RlConn *current = NULL;

/* reused for every command, so that a call allocates nothing */
static StringInfoData out;

/* a reused buffer larger than this is given back after use */
#define RL_KEEP_BUFFER (64 * 1024)

/* a command written whole this often and never confirmed is dropped */
#define RL_QUEUE_TRIES 2

/* a queued command redirected or told to try again this often is dropped */
#define RL_MAX_REQUEUE 5

/*
 * What may wait in a queue: a command beyond it is dropped with a warning.
 * (The queue holds the work of the transaction ends since the last command
 * that reached Redis; this bounds a session whose Redis stays away or hung
 * while its transactions keep ending.)
 */
#define RL_MAX_QUEUE (64 * 1024 * 1024)

/* counts the changes of server (connection settings) */
static uint64 server_generation = 1;

/* counts the assignments of connection settings (see rl_settings_version) */
static uint64 settings_version = 1;

/* the settings_version of the last rl_conn_get */
static uint64 current_seen = 0;

static char inbuf[16384];

/* the timeout that closes idle connections (rl_redis.idle_timeout) */
static TimeoutId idle_timeout_id = MAX_TIMEOUTS;

/* a command was sent since the idle timeout was last armed */
static bool used_since_idle = false;


static void rl_transport_exit(int code, Datum arg);
static void rl_register_exit(void);
static void rl_idle_timeout_handler(void);
static void rl_discard_queue(RlConn *conn, const char *why);
static void rl_queue_unconfirmed(RlConn *conn);
static void rl_queue_account(RlConn *conn);
static void rl_queue_push(RlConn *conn, int argc, const char **argv,
						  const size_t *argvlen, const char *encoded,
						  size_t len, uint8 flags, uint8 tries);

/* Closes the socket and frees everything that belongs to the connection. */
static void
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
static RlConn *conn_list = NULL;

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
 * Fills failure from a Redis error reply and frees the reply. A refused
 * authentication is a connection failure (08001); anything else Redis
 * refuses (OOM, READONLY, WRONGTYPE, NOPERM ...) is reported with its text.
 */
void
rl_error_reply(RlConn *conn, redisReply *reply, RlFailure *failure)
{
	/* Redis 7 refuses commands of more than 10 words before AUTH */
	if (strncmp(reply->str, "NOAUTH", 6) == 0 ||
		strncmp(reply->str, "WRONGPASS", 9) == 0 ||
		strncmp(reply->str, "ERR Protocol error: unauthenticated", 35) == 0)
		rl_fail(failure, RL_FAILURE_AUTH,
				ERRCODE_SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION,
				conn->kind == RL_CONN_SENTINEL ? RL_HINT_SENTINEL_PASSWORD :
				RL_HINT_PASSWORD, reply->str,
				"could not authenticate to Redis at %s", rl_conn_name(conn));
	else
		rl_fail(failure, RL_FAILURE_REPLY, ERRCODE_CONNECTION_EXCEPTION,
				RL_HINT_NONE, reply->str, "Redis at %s returned an error",
				rl_conn_name(conn));
	freeReplyObject(reply);
}


/*
 * Returns the cache entry of the server at host and port for kind, creating
 * it (not connected) when there is none. Does no I/O.
 */
static RlConn *
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
		conn->next = conn_list;
		pg_compiler_barrier();	/* whole before the idle handler can see it */
		conn_list = conn;
	}
	return conn;
}

/*
 * Returns the connection to the server at host and port for kind (a
 * cluster node, a master a sentinel named, a sentinel), which may not be
 * open yet (rl_command opens it). Does no I/O.
 */
RlConn *
rl_conn_at(const char *host, int port, RlConnKind kind)
{
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

	for (conn = conn_list; conn != NULL && n > 0; conn = conn->next)
		n--;
	if (conn == NULL)
		return false;
	memset(info, 0, sizeof(*info));
	strlcpy(info->server, conn->address, sizeof(info->server));
	info->kind = conn->kind;
	info->open = conn->ready && conn->sock != PGINVALID_SOCKET && !conn->shut;
	info->queued = conn->queue_count;
	info->scripts_loaded = pg_popcount32(conn->scripts_loaded);
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

/* Notes that script id is loaded on conn's server (it just ran there). */
void
rl_conn_script_loaded(RlConn *conn, int id)
{
	conn->scripts_loaded |= (uint32) 1 << id;
}

/* Notes that script id is not loaded on conn's server (NOSCRIPT). */
void
rl_conn_script_forget(RlConn *conn, int id)
{
	conn->scripts_loaded &= ~((uint32) 1 << id);
}

/* True when script id is known loaded on conn's server. */
bool
rl_conn_script_known(RlConn *conn, int id)
{
	return (conn->scripts_loaded & ((uint32) 1 << id)) != 0;
}

/* The host name (or address, or socket path) conn was made for. */
const char *
rl_conn_host(RlConn *conn)
{
	return conn->host;
}

/*
 * Sends the work queued on the connections other than except (with a PING
 * after it, to read its replies): work that a transaction end could not
 * write, because that server had no open connection then, goes with the
 * session's next call wherever that call goes (unless that server's last
 * call failed). A failure is left to that connection's breaker and next
 * call.
 */
void
rl_send_queued(RlConn *except)
{
	int			pass;

	/* a reply may move work to another node (MOVED): that node next */
	for (pass = 0; pass < 3; pass++)
	{
		RlConn	   *conn;
		bool		sent = false;

		for (conn = conn_list; conn != NULL; conn = conn->next)
		{
			const char *argv[1] = {"PING"};
			size_t		argvlen[1] = {4};
			RlFailure	failure = {0};
			redisReply *reply;

			/* a server in an outage gets its work with its own next call */
			if (conn == except || conn->queue_count == 0 ||
				conn->kind == RL_CONN_SENTINEL || conn->breaker.outage_start != 0 ||
				(pass > 0 && !conn->got_redirected))
				continue;
			conn->got_redirected = false;
			reply = rl_command(conn, 1, argv, argvlen, &failure);
			if (reply != NULL)
				freeReplyObject(reply);
			sent = true;
		}
		if (!sent)
			break;
	}
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

	for (conn = conn_list; conn != NULL; conn = conn->next)
	{
		rl_disconnect(conn);
		rl_discard_queue(conn, why);
	}
	server_generation++;
	current = NULL;
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
		rl_discard_queue(current, "the connection settings now name another Redis server");
		server_generation++;
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

/* Fills in a failure (as rl_fail) and discards the connection. */
static void
rl_conn_fail(RlConn *conn, RlFailure *failure, RlFailureKind kind,
			 int sqlerrcode, RlHint hint, const char *detail,
			 const char *fmt,...) pg_attribute_printf(7, 8);

static void
rl_conn_fail(RlConn *conn, RlFailure *failure, RlFailureKind kind,
			 int sqlerrcode, RlHint hint, const char *detail,
			 const char *fmt,...)
{
	va_list		ap;

	va_start(ap, fmt);
	rl_vfail(failure, kind, sqlerrcode, hint, detail, fmt, ap);
	va_end(ap);
	rl_disconnect(conn);
}

/* The deadline timeout_ms from now, or 0 for none. */
static TimestampTz
rl_deadline(int timeout_ms)
{
	if (timeout_ms <= 0)
		return 0;
	return TimestampTzPlusMilliseconds(GetCurrentTimestamp(), timeout_ms);
}

/*
 * Waits until the socket is ready for events (WL_SOCKET_READABLE or
 * WL_SOCKET_WRITEABLE) or the deadline passes; false on timeout. Interrupts
 * are serviced while waiting, so a cancel raises its error from here.
 */
static bool
rl_wait(RlConn *conn, uint32 events, TimestampTz deadline)
{
	if (conn->sock_events != events)
	{
		ModifyWaitEvent(conn->wes, conn->sock_pos, events, NULL);
		conn->sock_events = events;
	}

	for (;;)
	{
		WaitEvent	event;
		long		timeout = -1;

		if (deadline != 0)
		{
			timeout = TimestampDifferenceMilliseconds(GetCurrentTimestamp(),
													  deadline);
			if (timeout <= 0)
				return false;
		}

		if (WaitEventSetWait(conn->wes, timeout, &event, 1,
							 PG_WAIT_EXTENSION) == 0)
			continue;			/* timed out: the deadline check decides */

		if (event.events & WL_LATCH_SET)
		{
			ResetLatch(MyLatch);
			CHECK_FOR_INTERRUPTS();
		}
		if (event.events & events)
			return true;
	}
}

/*
 * Writes up to len bytes: returns how many, RL_IO_WAIT (with *want), or -1
 * (with errbuf).
 */
static ssize_t
rl_io_write(RlConn *conn, const char *buf, size_t len, uint32 *want, char *errbuf,
			size_t errsize)
{
	ssize_t		n;

	if (conn->tls.ssl)
		return rl_tls_write(&conn->tls, buf, len, want, errbuf, errsize);
	n = send(conn->sock, buf, len, MSG_NOSIGNAL);
	if (n >= 0)
		return n;
	if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)
	{
		*want = WL_SOCKET_WRITEABLE;
		return RL_IO_WAIT;
	}
	snprintf(errbuf, errsize, "%s", strerror(errno));
	return -1;
}

/*
 * Reads up to len bytes: returns how many, 0 when the server closed the
 * connection, RL_IO_WAIT (with *want), or -1 (with errbuf).
 */
static ssize_t
rl_io_read(RlConn *conn, char *buf, size_t len, uint32 *want, char *errbuf,
		   size_t errsize)
{
	ssize_t		n;

	if (conn->tls.ssl)
		return rl_tls_read(&conn->tls, buf, len, want, errbuf, errsize);
	n = recv(conn->sock, buf, len, 0);
	if (n >= 0)
		return n;
	if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)
	{
		*want = WL_SOCKET_READABLE;
		return RL_IO_WAIT;
	}
	snprintf(errbuf, errsize, "%s", strerror(errno));
	return -1;
}

/*
 * Writes len bytes of buf, counting in *done how many went out; false (with
 * the failure filled in and the connection discarded) on error. With
 * patient, a deadline that passes is not an error: false with
 * failure->sqlerrcode 0 and the connection kept.
 */
static bool
rl_write(RlConn *conn, const char *buf, size_t len, size_t *done,
		 TimestampTz deadline, bool patient, RlFailure *failure)
{
	char		errbuf[256];

	*done = 0;
	while (*done < len)
	{
		uint32		want = WL_SOCKET_WRITEABLE;
		ssize_t		n = rl_io_write(conn, buf + *done, len - *done, &want,
									errbuf, sizeof(errbuf));

		if (n > 0)
			*done += n;
		else if (n == RL_IO_WAIT)
		{
			if (!rl_wait(conn, want, deadline))
			{
				if (patient)
				{
					failure->sqlerrcode = 0;
					return false;
				}
				rl_conn_fail(conn, failure, RL_FAILURE_TIMEOUT,
							 ERRCODE_CONNECTION_FAILURE, RL_HINT_COMMAND_TIMEOUT,
							 NULL, "timed out sending to Redis at %s",
							 conn->address);
				return false;
			}
		}
		else
		{
			rl_conn_fail(conn, failure, RL_FAILURE_CONNECTION,
						 ERRCODE_CONNECTION_FAILURE, RL_HINT_NONE, errbuf,
						 "could not send to Redis at %s", conn->address);
			return false;
		}
	}
	return true;
}

/*
 * Reads until one whole reply is parsed; NULL (failure filled in) on error.
 * What has come is read before any wait, so a deadline already passed
 * takes only that. With patient, a deadline that passes is not an error:
 * NULL with failure->sqlerrcode 0, the connection kept (a partial reply
 * stays in the reader, to be completed by the next read).
 */
static redisReply *
rl_recv(RlConn *conn, TimestampTz deadline, bool patient, RlFailure *failure)
{
	char		errbuf[256];

	for (;;)
	{
		void	   *reply = NULL;
		uint32		want = WL_SOCKET_READABLE;
		ssize_t		n;

		if (redisReaderGetReply(conn->reader, &reply) != REDIS_OK)
		{
			rl_conn_fail(conn, failure, RL_FAILURE_PROTOCOL,
						 ERRCODE_PROTOCOL_VIOLATION, RL_HINT_NONE,
						 conn->reader->errstr, "invalid reply from Redis at %s",
						 conn->address);
			return NULL;
		}
		if (reply != NULL)
		{
			conn->replies_read++;
			conn->stalled_since = 0;
			return (redisReply *) reply;
		}

		/* (TLS may hold decrypted bytes that the socket no longer shows) */
		n = rl_io_read(conn, inbuf, sizeof(inbuf), &want, errbuf, sizeof(errbuf));
		if (n > 0)
		{
			if (redisReaderFeed(conn->reader, inbuf, n) != REDIS_OK)
			{
				rl_conn_fail(conn, failure, RL_FAILURE_PROTOCOL,
							 ERRCODE_PROTOCOL_VIOLATION, RL_HINT_NONE,
							 conn->reader->errstr,
							 "invalid reply from Redis at %s", conn->address);
				return NULL;
			}
		}
		else if (n == 0)
		{
			rl_conn_fail(conn, failure, RL_FAILURE_CONNECTION,
						 ERRCODE_CONNECTION_FAILURE, RL_HINT_NONE, NULL,
						 "Redis at %s closed the connection", conn->address);
			return NULL;
		}
		else if (n != RL_IO_WAIT)
		{
			rl_conn_fail(conn, failure, RL_FAILURE_CONNECTION,
						 ERRCODE_CONNECTION_FAILURE, RL_HINT_NONE, errbuf,
						 "could not receive from Redis at %s", conn->address);
			return NULL;
		}
		else if (!rl_wait(conn, want, deadline))
		{
			if (patient)
			{
				failure->sqlerrcode = 0;
				return NULL;
			}
			rl_conn_fail(conn, failure, RL_FAILURE_TIMEOUT,
						 ERRCODE_CONNECTION_FAILURE, RL_HINT_COMMAND_TIMEOUT,
						 NULL, "timed out waiting for a reply from Redis at %s",
						 conn->address);
			return NULL;
		}
	}
}

/*
 * Set-up step 3: starts TLS on the connected socket and completes the
 * handshake (see rl_tls_setup for what is checked).
 */
static bool
rl_tls_start(RlConn *conn, TimestampTz deadline, RlFailure *failure)
{
	char		errbuf[256];

	if (!rl_tls_setup(&conn->tls, conn->sock, conn->host, conn->address,
					  failure))
	{
		rl_disconnect(conn);
		return false;
	}
	for (;;)
	{
		uint32		want;
		int			r = rl_tls_handshake(&conn->tls, &want, errbuf,
										 sizeof(errbuf));

		if (r == 1)
			return true;
		if (r != RL_IO_WAIT)
		{
			rl_conn_fail(conn, failure, RL_FAILURE_CONNECTION,
						 ERRCODE_SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION,
						 RL_HINT_NONE, errbuf,
						 "could not connect to Redis at %s: TLS handshake failed",
						 conn->address);
			return false;
		}
		if (!rl_wait(conn, want, deadline))
		{
			rl_conn_fail(conn, failure, RL_FAILURE_TIMEOUT,
						 ERRCODE_SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION,
						 RL_HINT_CONNECT_TIMEOUT, NULL,
						 "could not connect to Redis at %s: TLS handshake timed out after %d ms",
						 conn->address, rl_connect_timeout);
			return false;
		}
	}
}

/* Appends one command, encoded in the Redis protocol (RESP), to buf. */
static void
rl_encode(StringInfo buf, int argc, const char **argv, const size_t *argvlen)
{
	char		num[24];
	int			i;

	appendStringInfoChar(buf, '*');
	appendBinaryStringInfo(buf, num, pg_ulltoa_n((uint64) argc, num));
	appendBinaryStringInfo(buf, "\r\n", 2);
	for (i = 0; i < argc; i++)
	{
		appendStringInfoChar(buf, '$');
		appendBinaryStringInfo(buf, num, pg_ulltoa_n((uint64) argvlen[i], num));
		appendBinaryStringInfo(buf, "\r\n", 2);
		appendBinaryStringInfo(buf, argv[i], argvlen[i]);
		appendBinaryStringInfo(buf, "\r\n", 2);
	}
}

/*
 * Sends the command in out and reads its reply; the connection must be
 * open. For the set-up's commands (AUTH, SELECT, ROLE).
 */
static redisReply *
rl_roundtrip(RlConn *conn, TimestampTz deadline, RlFailure *failure)
{
	redisReply *reply;
	size_t		done;

	conn->ready = false;			/* a reply may be in flight from here on */
	if (!rl_write(conn, out.data, out.len, &done, deadline, false, failure))
		return NULL;
	reply = rl_recv(conn, deadline, false, failure);
	if (reply != NULL)
		conn->ready = true;
	return reply;
}

/*
 * Creates a non-blocking socket connected (or connecting) to addr, with the
 * wait-event set around it; false with failure filled in on error.
 */
static bool
rl_open_socket(RlConn *conn, const struct sockaddr *addr, socklen_t addrlen,
			   TimestampTz deadline, RlFailure *failure)
{
	int			err = 0;
	socklen_t	errlen = sizeof(err);

	if (!AcquireExternalFD())
	{
		rl_conn_fail(conn, failure, RL_FAILURE_CONNECTION,
					 ERRCODE_SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION,
					 RL_HINT_NONE, NULL,
					 "could not connect to Redis at %s: too many open files",
					 conn->address);
		return false;
	}
	conn->fd_acquired = true;

	conn->sock = socket(addr->sa_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (conn->sock == PGINVALID_SOCKET)
	{
		rl_conn_fail(conn, failure, RL_FAILURE_CONNECTION,
					 ERRCODE_SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION,
					 RL_HINT_NONE, strerror(errno),
					 "could not create socket for Redis at %s", conn->address);
		return false;
	}
	if (!pg_set_noblock(conn->sock))
	{
		rl_conn_fail(conn, failure, RL_FAILURE_CONNECTION,
					 ERRCODE_SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION,
					 RL_HINT_NONE, strerror(errno),
					 "could not set socket for Redis at %s to non-blocking mode",
					 conn->address);
		return false;
	}
	if (addr->sa_family != AF_UNIX)
	{
		int			on = 1;

		(void) setsockopt(conn->sock, IPPROTO_TCP, TCP_NODELAY, &on, sizeof(on));
	}

	conn->wes = rl_create_wait_event_set(3);
	AddWaitEventToSet(conn->wes, WL_LATCH_SET, PGINVALID_SOCKET, MyLatch, NULL);
	AddWaitEventToSet(conn->wes, WL_EXIT_ON_PM_DEATH, PGINVALID_SOCKET, NULL, NULL);
	conn->sock_pos = AddWaitEventToSet(conn->wes, WL_SOCKET_WRITEABLE, conn->sock,
									  NULL, NULL);
	conn->sock_events = WL_SOCKET_WRITEABLE;

	if (connect(conn->sock, addr, addrlen) == 0)
		return true;
	if (errno != EINPROGRESS && errno != EAGAIN && errno != EINTR)
	{
		rl_conn_fail(conn, failure, RL_FAILURE_CONNECTION,
					 ERRCODE_SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION,
					 RL_HINT_SERVER, strerror(errno),
					 "could not connect to Redis at %s", conn->address);
		return false;
	}
	if (!rl_wait(conn, WL_SOCKET_WRITEABLE, deadline))
	{
		rl_conn_fail(conn, failure, RL_FAILURE_TIMEOUT,
					 ERRCODE_SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION,
					 RL_HINT_CONNECT_TIMEOUT, NULL,
					 "could not connect to Redis at %s: timed out after %d ms",
					 conn->address, rl_connect_timeout);
		return false;
	}
	if (getsockopt(conn->sock, SOL_SOCKET, SO_ERROR, &err, &errlen) < 0)
		err = errno;
	if (err != 0)
	{
		errno = err;
		rl_conn_fail(conn, failure, RL_FAILURE_CONNECTION,
					 ERRCODE_SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION,
					 RL_HINT_SERVER, strerror(errno),
					 "could not connect to Redis at %s", conn->address);
		return false;
	}
	return true;
}

/* Sends one handshake command (AUTH, SELECT); false if Redis refuses it. */
static bool
rl_handshake(RlConn *conn, const char *what, int argc, const char **argv,
			 const size_t *argvlen, TimestampTz deadline, RlFailure *failure)
{
	redisReply *reply;

	resetStringInfo(&out);
	rl_encode(&out, argc, argv, argvlen);
	reply = rl_roundtrip(conn, deadline, failure);
	if (reply == NULL)
	{
		failure->sqlerrcode = ERRCODE_SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION;
		return false;
	}
	if (reply->type == REDIS_REPLY_ERROR)
	{
		char		text[256];
		bool		auth = strcmp(what, "AUTH") == 0;

		snprintf(text, sizeof(text), "%s", reply->str);
		freeReplyObject(reply);
		if (auth)
			rl_conn_fail(conn, failure, RL_FAILURE_AUTH,
						 ERRCODE_SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION,
						 conn->kind == RL_CONN_SENTINEL ?
						 RL_HINT_SENTINEL_PASSWORD : RL_HINT_PASSWORD, text,
						 "could not authenticate to Redis at %s", conn->address);
		else
			rl_conn_fail(conn, failure, RL_FAILURE_CONFIG,
						 ERRCODE_SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION,
						 RL_HINT_NONE, text,
						 "could not connect to Redis at %s: %s failed",
						 conn->address, what);
		return false;
	}
	freeReplyObject(reply);
	return true;
}

/*
 * Set-up step 4 for the master a sentinel named: ROLE must say "master", so
 * that a demoted server (a failover the sentinels have not told us about
 * yet) never gets a write.
 */
static bool
rl_check_master(RlConn *conn, TimestampTz deadline, RlFailure *failure)
{
	const char *argv[1] = {"ROLE"};
	size_t		argvlen[1] = {4};
	redisReply *reply;
	char		role[32] = "?";

	resetStringInfo(&out);
	rl_encode(&out, 1, argv, argvlen);
	reply = rl_roundtrip(conn, deadline, failure);
	if (reply == NULL)
	{
		failure->sqlerrcode = ERRCODE_SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION;
		return false;
	}
	if (reply->type == REDIS_REPLY_ARRAY && reply->elements > 0 &&
		(reply->element[0]->type == REDIS_REPLY_STRING ||
		 reply->element[0]->type == REDIS_REPLY_STATUS))
		snprintf(role, sizeof(role), "%.*s", (int) reply->element[0]->len,
				 reply->element[0]->str);
	freeReplyObject(reply);
	if (strcmp(role, "master") == 0)
		return true;
	rl_conn_fail(conn, failure, RL_FAILURE_TOPOLOGY,
				 ERRCODE_SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION,
				 RL_HINT_NONE, NULL,
				 "could not connect to Redis at %s: it is not the master (ROLE says \"%s\")",
				 conn->address, role);
	return false;
}

/*
 * Writes the current settings that a connection of kind is made with into
 * buf, to compare (the configured server's address for the one server of
 * standalone mode; where the others are is the router's business).
 */
static void
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
	if (rl_mode == RL_MODE_STANDALONE)
		appendStringInfo(buf, "%c%s%c%d", 0, rl_host, 0, rl_port);
}

/*
 * True when the current connection settings differ from what conn's last
 * connection was made with (conn->settings, which must be set).
 */
static bool
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
static bool
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
	appendStringInfo(&buf, "%c%d", 0, rl_mode);
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

/*
 * Closes the connections that have nothing queued or on the way (the
 * worker's idle timeout); their next call opens them again.
 */
void
rl_close_idle(void)
{
	RlConn	   *conn;

	for (conn = conn_list; conn != NULL; conn = conn->next)
	{
		rl_queue_account(conn);
		if (conn->sock != PGINVALID_SOCKET && conn->ready &&
			conn->queue_count == 0 && conn->pending_replies == 0 &&
			conn->skip_replies == 0)
			rl_disconnect(conn);
	}
}

/*
 * Set-up step 1: resolves conn's server, a Unix socket path into
 * *sun or a host name into conn->pending_addrs (freed by rl_open, or by the
 * next connect when a cancel cut the connect short).
 */
static bool
rl_resolve(RlConn *conn, struct sockaddr_un *sun, RlFailure *failure)
{
	struct addrinfo hints;
	char		port[16];
	int			rc;

	if (conn->host[0] == '/')
	{
		if (rl_tls)
		{
			rl_conn_fail(conn, failure, RL_FAILURE_CONFIG,
						 ERRCODE_SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION,
						 RL_HINT_NONE, NULL,
						 "could not connect to Redis at %s: TLS needs a TCP host, not a Unix socket",
						 conn->address);
			return false;
		}
		if (strlen(conn->host) >= sizeof(sun->sun_path))
		{
			rl_conn_fail(conn, failure, RL_FAILURE_CONFIG,
						 ERRCODE_SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION,
						 RL_HINT_NONE, NULL,
						 "could not connect to Redis at %s: socket path is too long",
						 conn->address);
			return false;
		}
		memset(sun, 0, sizeof(*sun));
		sun->sun_family = AF_UNIX;
		strcpy(sun->sun_path, conn->host);
		return true;
	}

	memset(&hints, 0, sizeof(hints));
	hints.ai_family = AF_UNSPEC;
	hints.ai_socktype = SOCK_STREAM;
	snprintf(port, sizeof(port), "%d", conn->port);
	rc = getaddrinfo(conn->host, port, &hints, &conn->pending_addrs);
	if (rc != 0)
	{
		conn->pending_addrs = NULL;
		rl_conn_fail(conn, failure, RL_FAILURE_CONNECTION,
					 ERRCODE_SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION,
					 RL_HINT_SERVER, gai_strerror(rc),
					 "could not resolve Redis host \"%s\"", conn->host);
		return false;
	}
	return true;
}

/*
 * Set-up step 2: opens a socket to the resolved server, trying each address
 * in turn within the one connect deadline.
 */
static bool
rl_open(RlConn *conn, struct sockaddr_un *sun, TimestampTz deadline,
		RlFailure *failure)
{
	struct addrinfo *ai;

	if (conn->host[0] == '/')
		return rl_open_socket(conn, (struct sockaddr *) sun, sizeof(*sun),
							  deadline, failure);
	for (ai = conn->pending_addrs; ai != NULL; ai = ai->ai_next)
	{
		if (rl_open_socket(conn, ai->ai_addr, ai->ai_addrlen, deadline, failure))
			break;
	}
	if (ai != NULL && ai->ai_addrlen <= sizeof(conn->addr))
	{
		memcpy(&conn->addr, ai->ai_addr, ai->ai_addrlen);
		conn->addrlen = ai->ai_addrlen;
	}
	freeaddrinfo(conn->pending_addrs);
	conn->pending_addrs = NULL;
	return ai != NULL;
}

/*
 * Set-up step 4: makes the connection ready for commands and sends the
 * handshake commands: to a sentinel, AUTH with rl_redis.sentinel_password
 * when set; to a Redis server, AUTH (with rl_redis.password or
 * password_file) and SELECT (rl_redis.database), and to the master a
 * sentinel named, ROLE, which must say it is the master.
 */
static bool
rl_authenticate(RlConn *conn, TimestampTz deadline, RlFailure *failure)
{
	conn->reader = redisReaderCreate();
	if (conn->reader == NULL)
	{
		rl_conn_fail(conn, failure, RL_FAILURE_CONNECTION,
					 ERRCODE_OUT_OF_MEMORY, RL_HINT_NONE, NULL, "out of memory");
		return false;
	}
	conn->ready = true;

	{
		char		password[1024];
		char		err[256];
		const char *argv[3];
		size_t		argvlen[3];
		int			argc = 0;
		bool		ok;
		bool		sentinel = conn->kind == RL_CONN_SENTINEL;

		RlHint		hint;

		/* logged when it starts an outage (rl_breaker_failed) */
		if (!rl_read_password(sentinel, conn->breaker.outage_start == 0,
							  password, sizeof(password), err, sizeof(err),
							  &hint))
		{
			rl_conn_fail(conn, failure, RL_FAILURE_CONFIG,
						 ERRCODE_SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION,
						 hint, err, "could not connect to Redis at %s",
						 conn->address);
			return false;
		}
		if (password[0] != '\0')
		{
			argv[argc] = "AUTH";
			argvlen[argc++] = 4;
			if (!sentinel && rl_username[0] != '\0')
			{
				argv[argc] = rl_username;
				argvlen[argc++] = strlen(rl_username);
			}
			argv[argc] = password;
			argvlen[argc++] = strlen(password);
			ok = rl_handshake(conn, "AUTH", argc, argv, argvlen, deadline, failure);
			explicit_bzero(password, sizeof(password));
			if (!ok)
				return false;
		}
	}
	if (conn->kind == RL_CONN_SENTINEL)
		return true;
	if (rl_database != 0)
	{
		char		db[16];
		const char *argv[2] = {"SELECT", db};
		size_t		argvlen[2] = {6, 0};

		argvlen[1] = pg_ulltoa_n((uint64) rl_database, db);
		if (!rl_handshake(conn, "SELECT", 2, argv, argvlen, deadline, failure))
			return false;
	}
	if (conn->kind == RL_CONN_MASTER)
		return rl_check_master(conn, deadline, failure);
	return true;
}

/*
 * Opens a new connection to conn's server from the current settings:
 * resolve, open, TLS (with rl_redis.tls), handshake, before deadline.
 * Without resolve (a transaction end), a host name is not looked up: the
 * socket is opened to the address the last connection was opened to.
 */
static bool
rl_connect(RlConn *conn, TimestampTz deadline, bool resolve,
		   RlFailure *failure)
{
	struct sockaddr_un sun;

	rl_register_exit();
	rl_disconnect(conn);
	if (conn->pending_addrs != NULL)
	{
		freeaddrinfo(conn->pending_addrs);
		conn->pending_addrs = NULL;
	}
	conn->settings_seen = rl_settings_version();
	conn->scripts_loaded = 0;	/* the server may be another process now */
	if (conn->settings.data == NULL)
	{
		MemoryContext old = MemoryContextSwitchTo(TopMemoryContext);

		initStringInfo(&conn->settings);
		MemoryContextSwitchTo(old);
	}
	/* what was queued for the previous server must not reach this one */
	else if (rl_settings_differ(conn))
	{
		server_generation++;
		rl_discard_queue(conn, "the connection settings now name another Redis server");
	}
	rl_settings_signature(&conn->settings, conn->kind);

	if (!resolve && conn->host[0] != '/')
		return rl_open_socket(conn, (struct sockaddr *) &conn->addr,
							  conn->addrlen, deadline, failure) &&
			(!rl_tls || rl_tls_start(conn, deadline, failure)) &&
			rl_authenticate(conn, deadline, failure);
	return rl_resolve(conn, &sun, failure) &&
		rl_open(conn, &sun, deadline, failure) &&
		(!rl_tls || rl_tls_start(conn, deadline, failure)) &&
		rl_authenticate(conn, deadline, failure);
}

/*
 * True when an idle connection is still usable: the server has not closed
 * it (a restart, CLIENT KILL, idle timeout) and sent nothing unasked.
 */
static bool
rl_connection_alive(RlConn *conn)
{
	char		c;
	ssize_t		n;

	if (conn->tls.ssl)
		return rl_tls_alive(&conn->tls);
	n = recv(conn->sock, &c, 1, MSG_PEEK | MSG_DONTWAIT);
	return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
}

/* The offset in queue at which command k begins. */
static size_t
rl_queue_offset(RlConn *conn, int k)
{
	return k == 0 ? 0 : (size_t) conn->queue_ends[k - 1];
}

/*
 * Takes n commands off the queue from command k on, with one move: the
 * commands are only ever dropped in runs.
 */
static void
rl_queue_remove(RlConn *conn, int k, int n)
{
	size_t		from = rl_queue_offset(conn, k);
	size_t		len = rl_queue_offset(conn, k + n) - from;
	int			i;

	if (n <= 0)
		return;
	memmove(conn->queue.data + from, conn->queue.data + from + len,
			conn->queue.len - from - len);
	conn->queue.len -= len;
	conn->queue.data[conn->queue.len] = '\0';
	for (i = k + n; i < conn->queue_count; i++)
	{
		conn->queue_ends[i - n] = conn->queue_ends[i] - len;
		conn->queue_flags[i - n] = conn->queue_flags[i];
		conn->queue_tries[i - n] = conn->queue_tries[i];
	}
	conn->queue_count -= n;
	if (conn->queue_count == 0 && conn->queue.maxlen > RL_KEEP_BUFFER)
	{
		pfree(conn->queue.data);
		conn->queue.data = NULL;
	}
}

/* Takes the commands whose replies were read off the queue. */
static void
rl_queue_trim(RlConn *conn)
{
	rl_queue_remove(conn, 0, conn->queue_confirmed);
	conn->queue_confirmed = 0;
}

/*
 * Accounts for a write of the queue that ended (also by an error or an
 * interrupt, which leave queue_writing set): the commands it wrote whole
 * now wait for their replies; the bytes it wrote of the next one are
 * remembered, so that the next write goes on from there.
 */
static void
rl_queue_account(RlConn *conn)
{
	size_t		end;
	int			k;

	if (!conn->queue_writing)
		return;
	conn->queue_writing = false;
	end = conn->queue_write_from + conn->queue_write_done;
	k = conn->queue_confirmed + conn->pending_replies;
	while (k < conn->queue_count && (size_t) conn->queue_ends[k] <= end)
	{
		conn->queue_tries[k++]++;
		conn->pending_replies++;
	}
	conn->queue_partial = k < conn->queue_count ? end - rl_queue_offset(conn, k) : 0;
}

/*
 * The connection is going: of the queued commands written whole whose
 * replies were not read (they may have been applied), keeps those that may
 * be sent again, once, and drops the others. A command written in part was
 * not applied (Redis runs only whole commands) and is sent again whole.
 */
static void
rl_queue_unconfirmed(RlConn *conn)
{
	int			written;
	int			dropped = 0;
	int			k;

	rl_queue_account(conn);
	rl_queue_trim(conn);
	written = conn->pending_replies;
	for (k = written - 1; k >= 0; k--)
	{
		if ((conn->queue_flags[k] & RL_QUEUED_IDEMPOTENT) &&
			conn->queue_tries[k] < RL_QUEUE_TRIES)
			continue;
		if (conn->queue_flags[k] & RL_QUEUED_IDEMPOTENT)
			dropped++;
		/* a refund that may have run: no remembered denial outlives it */
		if (conn->queue_flags[k] & RL_QUEUED_GIVES_BACK)
			rl_deny_cache_forget();
		rl_queue_remove(conn, k, 1);
	}
	conn->pending_replies = 0;
	conn->queue_partial = 0;
	if (dropped > 0)
		ereport(WARNING,
				(errmsg("%d rate-limit commands of transaction ends (slot releases, refunds) were dropped after %d tries",
						dropped, RL_QUEUE_TRIES),
				 errdetail("Slots end with their lease; units of rolled-back transactions were not given back.")));
}

/*
 * Writes the queued commands not written yet to the open connection, going
 * on where an earlier write stopped, before deadline; their replies are
 * read by rl_read_pending. A call of the session that the worker of the
 * shared transport still has (an acquire the session gave up waiting for)
 * is waited for first: the release that undoes it must not overtake it.
 * False on failure (the connection discarded), or when the deadline passed
 * first (failure->sqlerrcode 0; the connection kept, and the next write
 * goes on from there).
 */
static bool
rl_send_queue(RlConn *conn, TimestampTz deadline, RlFailure *failure)
{
	bool		ok;

	rl_queue_account(conn);
	rl_queue_trim(conn);
	if (conn->pending_replies == conn->queue_count)
		return true;
	if (conn->kind == RL_CONN_SERVER && !rl_shared_settled(deadline))
	{
		failure->sqlerrcode = 0;
		return false;
	}
	conn->queue_write_from = rl_queue_offset(conn, conn->pending_replies) +
		conn->queue_partial;
	conn->queue_write_done = 0;
	conn->queue_writing = true;
	ok = rl_write(conn, conn->queue.data + conn->queue_write_from,
				  conn->queue.len - conn->queue_write_from,
				  &conn->queue_write_done, deadline, true, failure);
	rl_queue_account(conn);	/* after a failure rl_disconnect did it */
	return ok;
}

/*
 * A queued command k of conn got an error reply that says it was not run
 * (rl_error_not_run): a redirection of Redis Cluster ("MOVED <slot>
 * <host>:<port>" or "ASK ..."; an empty host is conn's), after which it
 * moves to the queue of the node named, after ASKING for ASK; or another
 * (TRYAGAIN, CLUSTERDOWN, READONLY, LOADING, MASTERDOWN: a slot being
 * moved, a failover, a server that is a replica now or not ready), after
 * which it waits in conn's queue for the session's next call there
 * (wait_for_call), which resolves the server's name again. Either way it
 * is sent at most RL_MAX_REQUEUE times. False when the error is none of
 * these, or the command went round too often.
 */
static bool
rl_queue_redirect(RlConn *conn, int k, const char *error)
{
	bool		ask = strncmp(error, "ASK ", 4) == 0;
	const char *node;
	char		host[RL_ADDRESS_LEN];
	int			port;
	RlConn	   *target;
	size_t		from = rl_queue_offset(conn, k);
	size_t		len;
	char	   *copy;
	uint8		flags;
	uint8		tries;

	if (!rl_error_not_run(error) || conn->queue_tries[k] >= RL_MAX_REQUEUE)
		return false;
	if (!ask && strncmp(error, "MOVED ", 6) != 0)
	{
		target = conn;
		conn->wait_for_call = true;
	}
	else
	{
		if (rl_mode != RL_MODE_CLUSTER)
			return false;
		node = strchr(error + (ask ? 4 : 6), ' ');
		if (node == NULL || !rl_parse_redirect_node(node + 1, conn->host, host, &port))
			return false;
		target = rl_conn_lookup(host, port, conn->kind);
		if (target == conn)
			return false;
	}
	if (ask)
	{
		const char *argv[1] = {"ASKING"};
		size_t		argvlen[1] = {6};

		rl_queue_push(target, 1, argv, argvlen, NULL, 0, true, 0);
	}
	/* a copy: pushing trims conn's queue when target is conn */
	len = conn->queue_ends[k] - from;
	copy = palloc(len);
	memcpy(copy, conn->queue.data + from, len);
	flags = conn->queue_flags[k];
	tries = conn->queue_tries[k];
	rl_queue_push(target, 0, NULL, NULL, copy, len, flags, tries);
	pfree(copy);
	if (target != conn)
		target->got_redirected = true;
	return true;
}

/*
 * Reads and drops the replies of an interrupted call (rl_conn_interrupted)
 * before deadline; as rl_recv, false with failure->sqlerrcode 0 when the
 * deadline passed first.
 */
static bool
rl_read_skipped(RlConn *conn, TimestampTz deadline, bool patient,
				RlFailure *failure)
{
	while (conn->skip_replies > 0)
	{
		redisReply *reply = rl_recv(conn, deadline, patient, failure);

		if (reply == NULL)
			return false;
		freeReplyObject(reply);
		conn->skip_replies--;
	}
	return true;
}

/*
 * A patient wait for replies on conn ended early (failure filled in): when
 * it timed out, the connection is not kept waiting for ever. It is dropped
 * (the failure says so) when no queued command waits for its reply there
 * (only an interrupted call's are due, which nobody needs: nothing is
 * lost), or when no reply came for longer than command_timeout
 * (xact_end_budget without one) since a wait first timed out (its queued
 * commands are then kept or dropped as after a lost connection). Returns
 * false.
 */
static bool
rl_read_stalled(RlConn *conn, RlFailure *failure)
{
	TimestampTz now;

	if (failure->sqlerrcode != 0)
		return false;
	now = GetCurrentTimestamp();
	if (conn->stalled_since == 0)
		conn->stalled_since = now;
	if (conn->pending_replies == 0 ||
		TimestampDifferenceExceeds(conn->stalled_since, now,
								   rl_command_timeout > 0 ? rl_command_timeout :
								   rl_xact_end_budget))
		rl_conn_fail(conn, failure, RL_FAILURE_TIMEOUT,
					 ERRCODE_CONNECTION_FAILURE, RL_HINT_COMMAND_TIMEOUT, NULL,
					 "timed out waiting for a reply from Redis at %s",
					 conn->address);
	return false;
}

/*
 * Reads the replies of the queued commands written to the connection (after
 * those of an interrupted call, which are dropped) and takes those commands
 * off the queue; an error reply is logged, unless it says that the command
 * was not run (rl_queue_redirect keeps it queued). False (with the failure
 * filled in) when the connection failed, or, with patient, when the
 * deadline passed first (failure->sqlerrcode 0; the rest of the replies are
 * read later, unless rl_read_stalled drops the connection).
 */
static bool
rl_read_pending(RlConn *conn, TimestampTz deadline, bool patient, RlFailure *failure)
{
	if (!rl_read_skipped(conn, deadline, patient, failure))
		return rl_read_stalled(conn, failure);
	while (conn->pending_replies > 0)
	{
		redisReply *reply;

		reply = rl_recv(conn, deadline, patient, failure);
		if (reply == NULL)
		{
			rl_queue_trim(conn);
			return rl_read_stalled(conn, failure);
		}
		conn->pending_replies--;
		conn->queue_confirmed++;
		/* a refund gave units back: no remembered denial stays */
		if (conn->queue_flags[conn->queue_confirmed - 1] & RL_QUEUED_GIVES_BACK)
			rl_deny_cache_forget();
		if (reply->type == REDIS_REPLY_ERROR &&
			rl_queue_redirect(conn, conn->queue_confirmed - 1, reply->str))
			freeReplyObject(reply);
		else if (reply->type == REDIS_REPLY_ERROR)
		{
			char		text[256];

			snprintf(text, sizeof(text), "%s", reply->str);
			freeReplyObject(reply);
			ereport(WARNING,
					(errcode(ERRCODE_CONNECTION_EXCEPTION),
					 errmsg("Redis at %s refused a rate-limit command sent at the end of a transaction: %s",
							conn->address, text),
					 errdetail("A slot may stay taken until its lease ends, or units of a rolled-back transaction may not have been given back.")));
		}
		else
			freeReplyObject(reply);
	}
	rl_queue_trim(conn);
	return true;
}

/*
 * True when conn's socket may take a command now: connected and, when
 * nothing but the replies of an interrupted call is due, once those that
 * came are read and dropped (without waiting), not closed by the server (a
 * restart, CLIENT KILL, its timeout). Replies still due make the liveness
 * check useless: reading them checks.
 */
static bool
rl_conn_usable_now(RlConn *conn)
{
	RlFailure	failure;

	rl_queue_account(conn);
	if (!conn->ready || conn->sock == PGINVALID_SOCKET || conn->shut)
		return false;
	if (conn->pending_replies > 0 || conn->queue_partial > 0)
		return true;
	if (!rl_read_skipped(conn, GetCurrentTimestamp(), true, &failure))
		return failure.sqlerrcode == 0;
	return rl_connection_alive(conn);
}

/*
 * Queues a command on conn to be sent at the end of the current
 * (sub)transaction, or with the session's next command on conn. flags:
 * RL_QUEUED_IDEMPOTENT, it may be sent again (once, after a lost
 * connection) without harm; RL_QUEUED_GIVES_BACK, it gives units back (a
 * refund: remembered denials are forgotten once it ran). Beyond
 * RL_MAX_QUEUE bytes waiting the command is dropped with a warning. Raises
 * only when out of memory.
 */
void
rl_defer_command(RlConn *conn, int argc, const char **argv,
				 const size_t *argvlen, uint8 flags)
{
	rl_queue_push(conn, argc, argv, argvlen, NULL, 0, flags, 0);
}

/*
 * Appends one command to conn's queue: argv encoded, or (argv NULL) the
 * len bytes at encoded, already encoded; flags as rl_defer_command's;
 * tries: the times it was written whole (to another connection) already. Beyond RL_MAX_QUEUE bytes waiting
 * the command is dropped with a warning. Raises only when out of memory.
 */
static void
rl_queue_push(RlConn *conn, int argc, const char **argv,
			  const size_t *argvlen, const char *encoded, size_t len,
			  uint8 flags, uint8 tries)
{
	MemoryContext old;

	rl_register_exit();
	rl_queue_trim(conn);
	if (conn->queue.len > RL_MAX_QUEUE)
	{
		ereport(WARNING,
				(errmsg("a rate-limit command of a transaction end (slot release, refund) was dropped: %d MB wait for Redis at %s already",
						RL_MAX_QUEUE / (1024 * 1024), conn->address),
				 errdetail("A slot ends with its lease; units of a rolled-back transaction were not given back.")));
		return;
	}
	old = MemoryContextSwitchTo(TopMemoryContext);
	if (conn->queue.data == NULL)
		initStringInfo(&conn->queue);
	if (conn->queue_count == conn->queue_max)
	{
		conn->queue_max = Max(16, conn->queue_max * 2);
		conn->queue_ends = conn->queue_ends ?
			repalloc(conn->queue_ends, sizeof(int) * conn->queue_max) :
			palloc(sizeof(int) * conn->queue_max);
		conn->queue_flags = conn->queue_flags ?
			repalloc(conn->queue_flags, sizeof(uint8) * conn->queue_max) :
			palloc(sizeof(bool) * conn->queue_max);
		conn->queue_tries = conn->queue_tries ?
			repalloc(conn->queue_tries, sizeof(uint8) * conn->queue_max) :
			palloc(sizeof(uint8) * conn->queue_max);
	}
	if (argv != NULL)
		rl_encode(&conn->queue, argc, argv, argvlen);
	else
		appendBinaryStringInfo(&conn->queue, encoded, len);
	conn->queue_flags[conn->queue_count] = flags;
	conn->queue_tries[conn->queue_count] = tries;
	conn->queue_ends[conn->queue_count++] = conn->queue.len;
	MemoryContextSwitchTo(old);
}

/*
 * The sentinels named another master than from: closes from and moves what
 * its queue holds to the queue of to, the new master, where the data is
 * now. (Closing keeps, of the commands written whose replies were not read,
 * only those that may be sent twice.)
 */
void
rl_conn_hand_over(RlConn *from, RlConn *to)
{
	int			k;

	rl_disconnect(from);
	for (k = 0; k < from->queue_count; k++)
	{
		size_t		off = rl_queue_offset(from, k);

		rl_queue_push(to, 0, NULL, NULL, from->queue.data + off,
					  from->queue_ends[k] - off, from->queue_flags[k],
					  from->queue_tries[k]);
	}
	rl_queue_remove(from, 0, from->queue_count);
}

/*
 * Drops everything queued that is not on its way (written, its reply not
 * read yet), with a warning that says why.
 */
static void
rl_discard_queue(RlConn *conn, const char *why)
{
	int			dropped;

	rl_queue_trim(conn);
	dropped = conn->queue_count - conn->pending_replies;
	if (dropped <= 0)
		return;
	ereport(WARNING,
			(errmsg("%d rate-limit commands of transaction ends (slot releases, refunds) were dropped: %s",
					dropped, why),
			 errdetail("Slots end with their lease; units of rolled-back transactions were not given back.")));
	rl_queue_remove(conn, conn->pending_replies,
					conn->queue_count - conn->pending_replies);
}

/*
 * When the encoded command cmd (len bytes) is "EVAL <script> <args...>",
 * sets *body and *bodylen to the script's text and *rest and *restlen to
 * the encoded arguments after it, *nargs to their number, and returns
 * true.
 */
static bool
rl_split_eval(const char *cmd, size_t len, const char **body, size_t *bodylen,
			  const char **rest, size_t *restlen, int *nargs)
{
	const char *p = cmd;
	const char *end = cmd + len;
	char	   *next;
	long		n;
	long		l;

	if (len < 16 || *p != '*')
		return false;
	n = strtol(p + 1, &next, 10);
	p = next;
	if (n < 2 || end - p < 13 || memcmp(p, "\r\n$4\r\nEVAL\r\n$", 13) != 0)
		return false;
	l = strtol(p + 13, &next, 10);
	p = next;
	if (l < 0 || end - p < 2 + l + 2 || memcmp(p, "\r\n", 2) != 0 ||
		memcmp(p + 2 + l, "\r\n", 2) != 0)
		return false;
	*body = p + 2;
	*bodylen = (size_t) l;
	*rest = p + 2 + l + 2;
	*restlen = end - *rest;
	*nargs = (int) n - 2;
	return true;
}

/*
 * With rl_redis.transport = shared and no connection of the session's own
 * open: hands the queue's commands not on their way yet to the worker,
 * which sends them on its connection (an EVAL as the hash of its script
 * and its arguments: the script is too large for the queue, and the worker
 * has it too), and waits until deadline for the worker to have sent them.
 * True when none is left. Never raises.
 */
static bool
rl_conn_hand_to_worker(RlConn *conn, TimestampTz deadline)
{
	uint64		settings;

	if (rl_transport != RL_TRANSPORT_SHARED || conn->kind != RL_CONN_SERVER ||
		rl_mode != RL_MODE_STANDALONE)
		return false;
	rl_queue_account(conn);
	rl_queue_trim(conn);
	if (conn->pending_replies > 0 || conn->queue_partial > 0)
		return false;
	settings = rl_settings_hash();
	while (conn->queue_count > 0)
	{
		size_t		off = rl_queue_offset(conn, 0);
		const char *cmd = conn->queue.data + off;
		size_t		len = conn->queue_ends[0] - off;
		RlDeferred	work;
		const char *body;
		size_t		bodylen;

		work.host = conn->host;
		work.port = conn->port;
		work.flags = conn->queue_flags[0];
		work.encoded = cmd;
		work.len = len;
		work.script_len = 0;
		work.script_hash = 0;
		work.nargs = 0;
		if (rl_split_eval(cmd, len, &body, &bodylen, &work.encoded, &work.len,
						  &work.nargs))
		{
			work.script_len = bodylen;
			work.script_hash = hash_bytes_extended((const unsigned char *) body,
												   bodylen, 0);
		}
		if (!rl_shared_defer(&work, settings))
		{
			/* the queue is full: what was handed over goes first */
			rl_shared_defer_wait(deadline);
			if (!rl_shared_defer(&work, settings))
				break;
		}
		rl_queue_remove(conn, 0, 1);
	}
	rl_shared_defer_wait(deadline);
	return conn->queue_count == 0;
}

/*
 * Queues deferred work a session handed over (rl_conn_hand_to_worker) on
 * conn, as rl_defer_command does: body is the text of its script when it
 * was an EVAL (else NULL).
 */
void
rl_conn_defer_handed(RlConn *conn, const RlDeferred *work, const char *body)
{
	StringInfoData buf;

	if (body == NULL)
	{
		rl_queue_push(conn, 0, NULL, NULL, work->encoded, work->len,
					  work->flags, 0);
		return;
	}
	initStringInfo(&buf);
	appendStringInfo(&buf, "*%d\r\n$4\r\nEVAL\r\n$%zu\r\n", work->nargs + 2,
					 work->script_len);
	appendBinaryStringInfo(&buf, body, work->script_len);
	appendBinaryStringInfo(&buf, "\r\n", 2);
	appendBinaryStringInfo(&buf, work->encoded, work->len);
	rl_queue_push(conn, 0, NULL, NULL, buf.data, buf.len, work->flags, 0);
	pfree(buf.data);
}

/*
 * At a transaction end, for a connection without a usable socket (Redis
 * closed it, a call failed or was cut short): connects again before
 * deadline, to the address the last connection was opened to (no name
 * lookup), with the settings it was made with. False, with failure filled
 * in, when it cannot: never connected, the settings name another server now
 * (the next call sorts that out; failure->sqlerrcode 0, as nothing was
 * tried), or Redis could not be reached in time. Never raises.
 */
static bool
rl_reconnect_at_xact_end(RlConn *conn, TimestampTz deadline,
						 RlFailure *failure)
{
	RlHold		hold;
	volatile bool ok = false;

	if (conn->settings.data == NULL ||
		(conn->host[0] != '/' && conn->addrlen == 0))
	{
		rl_fail(failure, RL_FAILURE_CONNECTION, 0, RL_HINT_NONE, NULL,
				"no connection was made to Redis at %s in this session yet",
				conn->address);
		return false;
	}
	rl_hold_save(&hold);
	PG_TRY();
	{
		if (rl_settings_differ(conn))
			rl_fail(failure, RL_FAILURE_CONFIG, 0, RL_HINT_NONE, NULL,
					"the connection settings name another Redis server now");
		else
			ok = rl_connect(conn, deadline, false, failure);
	}
	PG_CATCH();
	{
		rl_hold_restore(&hold);
		rl_disconnect(conn);
		rl_fail(failure, RL_FAILURE_CONNECTION, ERRCODE_CONNECTION_FAILURE,
				RL_HINT_NONE, NULL, "could not connect to Redis at %s",
				conn->address);
		ok = false;
	}
	PG_END_TRY();
	return ok;
}

/*
 * At the end of a (sub)transaction: writes the queue within
 * rl_redis.xact_end_budget (less when command_timeout is smaller) to the
 * open connection, or hands it to the worker of the shared transport, or
 * connects again (rl_reconnect_at_xact_end) when Redis closed the
 * connection or a call of the transaction failed; only when Redis cannot be
 * reached in that time does the work wait for the session's next call.
 * The connection's circuit breaker rules here as for the calls: while it
 * is open (a failure within rl_redis.retry_interval) since before the
 * transaction began, nothing is tried and the work waits for the next
 * call (one a call of this transaction opened gets one more try here),
 * and a failure here, or a wait for
 * replies in which none came, opens it. Work Redis did not run here
 * (READONLY ...: wait_for_call) waits for the next call too, on a new
 * connection. Interrupts are held here, so the budget is the only bound;
 * nothing here raises or looks a name up.
 */
static void
rl_flush_queue(RlConn *conn, TimestampTz deadline)
{
	RlFailure	failure = {0};
	char		text[sizeof(failure.message) + sizeof(failure.detail)];
	RlHold		hold;
	uint64		replies_before = conn->replies_read;

	if (conn->queue_count == 0 || conn->wait_for_call)
		return;

	/*
	 * The breaker holds back the transaction ends of an outage that began
	 * before this transaction; when a call of this transaction opened it,
	 * the transaction end tries once more, so that what the transaction
	 * took goes back at once if Redis answers again.
	 */
	if (rl_breaker_open(&conn->breaker, &failure) &&
		conn->breaker.last_failure_at < GetCurrentTransactionStartTimestamp())
		return;
	memset(&failure, 0, sizeof(failure));
	rl_hold_save(&hold);
	PG_TRY();
	{
		bool		connected = true;

		/* a connection the server closed while idle would swallow the queue */
		if (!rl_conn_usable_now(conn))
		{
			rl_disconnect(conn);
			if (rl_conn_hand_to_worker(conn, deadline))
				connected = false;
			else if (!rl_reconnect_at_xact_end(conn, deadline, &failure))
			{
				connected = false;
				ereport(WARNING,
						(errmsg("rate-limit work of the transaction end (slot releases, refunds) waits for the session's next call"),
						 errdetail("Redis at %s could not be reached within rl_redis.xact_end_budget: %s.",
								   conn->address,
								   rl_failure_text(&failure, text, sizeof(text)))));
				if (failure.sqlerrcode != 0)
					rl_breaker_failed(&conn->breaker, &failure);
			}
		}
		/* written, then confirmed, so that other sessions see it at once */
		if (connected)
		{
			if (rl_send_queue(conn, deadline, &failure) &&
				rl_read_pending(conn, deadline, true, &failure))
			{
				rl_breaker_succeeded(&conn->breaker, conn->address);
				/* the next call connects again, resolving the name */
				if (conn->wait_for_call)
					rl_disconnect(conn);
			}
			else if (failure.sqlerrcode != 0)
			{
				ereport(WARNING,
						(errcode(failure.sqlerrcode),
						 errmsg_internal("%s", failure.message),
						 failure.detail[0] != '\0' ?
						 errdetail_internal("%s\nRate-limit work of the transaction end (slot releases, refunds) is sent with the session's next call.",
											failure.detail) :
						 errdetail("Rate-limit work of the transaction end (slot releases, refunds) is sent with the session's next call.")));
				rl_breaker_failed(&conn->breaker, &failure);
			}
			else if (conn->replies_read == replies_before)
			{
				/* Redis did not answer at all: hung */
				rl_fail(&failure, RL_FAILURE_TIMEOUT, ERRCODE_CONNECTION_FAILURE,
						RL_HINT_COMMAND_TIMEOUT, NULL,
						"timed out waiting for a reply from Redis at %s",
						conn->address);
				rl_breaker_failed(&conn->breaker, &failure);
			}
		}
	}
	PG_CATCH();
	{
		rl_hold_restore(&hold);
		rl_disconnect(conn);
	}
	PG_END_TRY();
}

/*
 * rl_redis.idle_timeout passed since the end of the last transaction that
 * used Redis (the timeout is stopped by the next command): shuts down the
 * sockets of the connections with nothing on the way, so that Redis closes
 * them. This runs in a signal handler: shutdown is async-signal-safe, and
 * the socket stays allocated, so no other file can take its number; the
 * next command finds it closed (the liveness check) and connects again.
 */
static void
rl_idle_timeout_handler(void)
{
	RlConn	   *conn;

	/*
	 * The main code makes an entry whole before it links it (a barrier in
	 * rl_conn_lookup) and takes a socket out of sight before it closes it
	 * (rl_disconnect); only connections with nothing queued or in flight
	 * are shut down, and whoever uses one next checks it first.
	 */
	for (conn = conn_list; conn != NULL; conn = conn->next)
	{
		pgsocket	sock = conn->sock;

		if (sock != PGINVALID_SOCKET && conn->ready &&
			conn->queue_count == 0 && conn->pending_replies == 0 &&
			conn->skip_replies == 0)
		{
			(void) shutdown(sock, SHUT_RDWR);
			conn->shut = true;
		}
	}
}

/*
 * At the end of a top-level transaction: starts the idle timeout when a
 * command was sent since it last started and a connection is open; stops
 * it when rl_redis.idle_timeout is 0 now.
 */
static void
rl_arm_idle_timeout(void)
{
	RlConn	   *conn;

	if (idle_timeout_id == MAX_TIMEOUTS)
		return;
	if (rl_idle_timeout <= 0)
	{
		if (get_timeout_active(idle_timeout_id))
			disable_timeout(idle_timeout_id, false);
		return;
	}
	if (!used_since_idle)
		return;
	for (conn = conn_list; conn != NULL; conn = conn->next)
		if (conn->sock != PGINVALID_SOCKET && conn->ready)
			break;
	if (conn == NULL)
		return;
	used_since_idle = false;
	enable_timeout_after(idle_timeout_id, rl_idle_timeout);
}

/*
 * At an abort, for a connection whose call an error cut short: when the
 * call's commands were written whole and only their replies are due, the
 * connection is kept, and those replies are read and dropped before any
 * other (rl_read_pending), so that what the transaction end queues reaches
 * Redis after them, in order, and no reply reaches another caller; else (a
 * connect or a write cut short, which Redis never ran) it is dropped.
 */
static void
rl_conn_interrupted(RlConn *conn)
{
	if (conn->replies_due > 0 && conn->reader != NULL)
	{
		conn->skip_replies += conn->replies_due;
		conn->replies_due = 0;
		conn->ready = true;
	}
	else
		rl_disconnect(conn);
}

/*
 * At the end of a (sub)transaction, for each connection: takes in a call an
 * error cut short (abort only, rl_conn_interrupted), then sends its queue.
 */
static void
rl_xact_end(bool abort)
{
	RlConn	   *conn;
	int			budget = rl_xact_end_budget;
	TimestampTz deadline;

	/* one budget for the whole transaction end */
	if (rl_command_timeout > 0)
		budget = Min(budget, rl_command_timeout);
	deadline = rl_deadline(budget);
	for (conn = conn_list; conn != NULL; conn = conn->next)
	{
		if (abort && conn->sock != PGINVALID_SOCKET && !conn->ready)
			rl_conn_interrupted(conn);
		rl_flush_queue(conn, deadline);
	}
	/* idle from here on, until the next command */
	if (GetCurrentTransactionNestLevel() <= 1)
		rl_arm_idle_timeout();
}

/*
 * At the end of a transaction, after the other modules queued their work
 * (src/xact_end.c): sends the queues.
 */
void
rl_transport_xact_end(XactEvent event)
{
	if (event == XACT_EVENT_ABORT || event == XACT_EVENT_PARALLEL_ABORT)
		rl_xact_end(true);
	else if (event == XACT_EVENT_COMMIT || event == XACT_EVENT_PARALLEL_COMMIT ||
			 event == XACT_EVENT_PREPARE)
		rl_xact_end(false);
}

/* At the end of a subtransaction: the same, for a rolled-back one. */
void
rl_transport_subxact_end(SubXactEvent event)
{
	if (event == SUBXACT_EVENT_ABORT_SUB)
		rl_xact_end(true);
}

/*
 * Makes the backend's exit send what is queued (rl_transport_exit); once,
 * when a connection is first made or work first queued (not in _PG_init: a
 * preloaded library's _PG_init runs in the postmaster).
 */
static void
rl_register_exit(void)
{
	static bool registered = false;

	if (registered)
		return;
	before_shmem_exit(rl_transport_exit, (Datum) 0);
	registered = true;
}

/*
 * When the backend exits: sends what each connection has queued and reads
 * the replies still due (or hands the queue of one not open to the worker
 * of the shared transport), all within rl_redis.xact_end_budget, so that
 * closing a socket with unread replies (which resets the connection) cannot
 * make Redis drop commands it had not read yet.
 */
static void
rl_transport_exit(int code, Datum arg)
{
	RlConn	   *conn;
	TimestampTz deadline = rl_deadline(rl_xact_end_budget);

	HOLD_INTERRUPTS();
	for (conn = conn_list; conn != NULL; conn = conn->next)
	{
		RlFailure	failure = {0};
		RlHold		hold;

		if (conn->queue_count == 0 && conn->pending_replies == 0)
			continue;
		/* no connection of its own: the worker of the shared transport */
		if (!conn->ready || conn->sock == PGINVALID_SOCKET)
		{
			(void) rl_conn_hand_to_worker(conn, deadline);
			continue;
		}
		rl_hold_save(&hold);
		PG_TRY();
		{
			if (rl_send_queue(conn, deadline, &failure) &&
				rl_read_pending(conn, deadline, true, &failure))
				rl_disconnect(conn);
		}
		PG_CATCH();
		{
			rl_hold_restore(&hold);
		}
		PG_END_TRY();
	}
	RESUME_INTERRUPTS();
}

/*
 * Sends one command and returns its reply, which the caller must free with
 * freeReplyObject: rl_command_within with connect_timeout and
 * command_timeout.
 */
redisReply *
rl_command(RlConn *conn, int argc, const char **argv, const size_t *argvlen,
		   RlFailure *failure)
{
	return rl_command_within(conn, argc, argv, argvlen, -1, failure);
}

/*
 * Sends n commands on conn in one write; their replies, which the caller
 * must read with rl_pipeline_recv (all n, or the connection is dropped
 * before its next use), come in order. Opens the connection when needed,
 * and first sends what a transaction end left queued and reads what it
 * left unread; the connection may take connect_timeout and one command
 * command_timeout, or, with limit_ms >= 0, each at most limit_ms. Of
 * several commands, each wait (for Redis to take more of them, or for the
 * next reply) may take command_timeout. False on
 * failure, with failure filled in and the connection already discarded;
 * rl_command_was_sent then says whether any command may have reached
 * Redis. While the circuit breaker is open, fails at once without touching
 * the network. An interrupt (cancel, statement_timeout) raises its error
 * from inside.
 */
bool
rl_pipeline_send(RlConn *conn, int n, const RlCommand *cmds, int limit_ms,
				 RlFailure *failure)
{
	TimestampTz deadline;
	int			connect_ms = rl_connect_timeout;
	int			command_ms = rl_command_timeout;
	size_t		done = 0;
	bool		ok;
	int			i;

	/* the connections are in use again */
	if (idle_timeout_id != MAX_TIMEOUTS && get_timeout_active(idle_timeout_id))
		disable_timeout(idle_timeout_id, false);
	else if (idle_timeout_id == MAX_TIMEOUTS && rl_idle_timeout > 0)
		idle_timeout_id = RegisterTimeout(USER_TIMEOUT, rl_idle_timeout_handler);
	used_since_idle = true;

	if (limit_ms >= 0)
	{
		limit_ms = Max(limit_ms, 1);
		connect_ms = Min(connect_ms, limit_ms);
		command_ms = command_ms > 0 ? Min(command_ms, limit_ms) : limit_ms;
	}

	conn->last_command_sent = false;
	conn->replies_due = 0;
	if (out.data == NULL)
	{
		MemoryContext old = MemoryContextSwitchTo(TopMemoryContext);

		initStringInfo(&out);
		MemoryContextSwitchTo(old);
	}
	if (conn->settings_seen != rl_settings_version())
	{
		conn->settings_seen = rl_settings_version();
		rl_breaker_reset(&conn->breaker);	/* settings were set: try at once */
		if (rl_settings_changed(conn))
			conn->ready = false;
	}
	else if (rl_breaker_open(&conn->breaker, failure))
		return false;

	conn->wait_for_call = false;
	if (!rl_conn_usable_now(conn))
	{
		bool		connected = rl_connect(conn, rl_deadline(connect_ms), true,
											   failure);

		/* AUTH, SELECT and ROLE were sent, not the command */
		conn->last_command_sent = false;
		if (!connected)
		{
			rl_breaker_failed(&conn->breaker, failure);
			return false;
		}
	}

	/*
	 * First the work queued by transaction ends, then the commands. Redis
	 * may still be busy with that work when the deadline comes: the call
	 * fails then, but the connection is kept, and the next call goes on with
	 * it (never losing or repeating it).
	 */
	deadline = rl_deadline(command_ms);
	if (!rl_send_queue(conn, deadline, failure) ||
		!rl_read_pending(conn, deadline, true, failure))
	{
		if (failure->sqlerrcode == 0)
			rl_fail(failure, RL_FAILURE_TIMEOUT, ERRCODE_CONNECTION_FAILURE,
					RL_HINT_COMMAND_TIMEOUT, NULL,
					"timed out: Redis at %s is still busy with rate-limit work of earlier transaction ends",
					conn->address);
		rl_breaker_failed(&conn->breaker, failure);
		return false;
	}

	resetStringInfo(&out);
	for (i = 0; i < n; i++)
		rl_encode(&out, cmds[i].argc, cmds[i].argv, cmds[i].argvlen);
	conn->ready = false;		/* replies may be in flight from here on */
	if (n == 1)
		ok = rl_write(conn, out.data, out.len, &done, deadline, false, failure);
	else
	{
		/*
		 * A pipeline goes out as fast as Redis runs it: command_timeout
		 * bounds each wait for Redis to take more of it, not the whole.
		 */
		size_t		part;

		do
		{
			ok = rl_write(conn, out.data + done, out.len - done, &part,
						  deadline, true, failure);
			done += part;
			deadline = rl_deadline(command_ms);
		} while (!ok && failure->sqlerrcode == 0 && part > 0);
		if (!ok && failure->sqlerrcode == 0)
			rl_conn_fail(conn, failure, RL_FAILURE_TIMEOUT,
						 ERRCODE_CONNECTION_FAILURE, RL_HINT_COMMAND_TIMEOUT,
						 NULL, "timed out sending to Redis at %s",
						 conn->address);
	}
	/* Redis runs only whole commands: the first is whole once all of it went */
	conn->last_command_sent = ok || (n > 1 && done > 0);
	if (out.maxlen > RL_KEEP_BUFFER)
	{
		/* a huge command does not keep its buffer for the backend's life */
		char	   *small = MemoryContextAlloc(TopMemoryContext, 1024);

		pfree(out.data);
		out.data = small;
		out.maxlen = 1024;
		resetStringInfo(&out);
	}
	if (!ok)
	{
		rl_breaker_failed(&conn->breaker, failure);
		return false;
	}
	conn->replies_due = n;
	conn->replies_deadline = deadline;
	conn->replies_timeout_ms = n > 1 ? command_ms : 0;
	return true;
}

/*
 * Reads the next reply of the commands rl_pipeline_send wrote on conn; the
 * caller frees it with freeReplyObject. NULL on failure, with failure
 * filled in and the connection discarded (the replies still due are lost).
 */
redisReply *
rl_pipeline_recv(RlConn *conn, RlFailure *failure)
{
	redisReply *reply;

	Assert(conn->replies_due > 0);
	reply = rl_recv(conn, conn->replies_deadline, false, failure);
	if (reply == NULL)
	{
		conn->replies_due = 0;
		rl_breaker_failed(&conn->breaker, failure);
		return NULL;
	}
	if (--conn->replies_due == 0)
	{
		conn->ready = true;
		rl_breaker_succeeded(&conn->breaker, conn->address);
	}
	else if (conn->replies_timeout_ms > 0)
		conn->replies_deadline = rl_deadline(conn->replies_timeout_ms);
	return reply;
}

/*
 * Sends one command and returns its reply, which the caller must free with
 * freeReplyObject; as rl_pipeline_send and rl_pipeline_recv, for one.
 * NULL on failure, with failure filled in and the connection discarded.
 */
redisReply *
rl_command_within(RlConn *conn, int argc, const char **argv,
				  const size_t *argvlen, int limit_ms, RlFailure *failure)
{
	RlCommand	cmd = {argc, argv, argvlen};

	if (!rl_pipeline_send(conn, 1, &cmd, limit_ms, failure))
		return NULL;
	return rl_pipeline_recv(conn, failure);
}
