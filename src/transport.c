/*
 * transport.c
 *	  The per-backend connection to Redis.
 *
 * We own the socket and use hiredis only to parse replies (redisReader); the
 * commands are encoded here. Every wait, for connect, write and read, goes
 * through one WaitEventSet holding MyLatch and the socket, so that
 * statement_timeout, pg_cancel_backend and pg_terminate_backend end a wait on
 * a hung Redis at once, and postmaster death ends the backend.
 *
 * The connection is opened on first use and kept for the life of the
 * backend. It is discarded, never reused, after any failure or interrupted
 * call (a reply might still be in flight), and after a connection setting
 * changed; the next call opens a new one.
 *
 * Encryption (TLS) and cluster routing would replace rl_send_all/rl_recv and
 * rl_open_socket; nothing outside this file touches the socket.
 */
#include "postgres.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "access/xact.h"
#include "lib/stringinfo.h"
#include "miscadmin.h"
#include "pgstat.h"
#include "storage/fd.h"
#include "storage/latch.h"
#include "utils/builtins.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"

#include "rl_redis.h"

typedef struct RlConnection
{
	pgsocket	sock;			/* PGINVALID_SOCKET when there is none */
	bool		fd_acquired;	/* we hold an external-FD slot for sock */
	WaitEventSet *wes;			/* MyLatch, postmaster death, sock */
	int			sock_pos;		/* position of sock in wes */
	uint32		sock_events;	/* what wes waits for on sock right now */
	redisReader *reader;
	bool		ready;			/* connected and idle: safe to send */
	char		server[300];	/* "host:port" or the socket path */
} RlConnection;

static RlConnection conn = {PGINVALID_SOCKET};

/* reused for every command, so that a call allocates nothing */
static StringInfoData out;
static char inbuf[16384];

/* Closes the socket and frees everything that belongs to the connection. */
static void
rl_disconnect(void)
{
	if (conn.wes)
		FreeWaitEventSet(conn.wes);
	conn.wes = NULL;
	if (conn.sock != PGINVALID_SOCKET)
		closesocket(conn.sock);
	conn.sock = PGINVALID_SOCKET;
	if (conn.fd_acquired)
		ReleaseExternalFD();
	conn.fd_acquired = false;
	if (conn.reader)
		redisReaderFree(conn.reader);
	conn.reader = NULL;
	conn.ready = false;
}

/* Drops a connection whose command was interrupted by an error. */
static void
rl_xact_callback(XactEvent event, void *arg)
{
	if ((event == XACT_EVENT_ABORT || event == XACT_EVENT_PARALLEL_ABORT) &&
		conn.sock != PGINVALID_SOCKET && !conn.ready)
		rl_disconnect();
}

/* Registers the transaction callback; called once from _PG_init. */
void
rl_transport_init(void)
{
	RegisterXactCallback(rl_xact_callback, NULL);
}

/* The server the current (or next) connection goes to, for messages. */
const char *
rl_server_name(void)
{
	if (rl_host[0] == '/')
		snprintf(conn.server, sizeof(conn.server), "%s", rl_host);
	else
		snprintf(conn.server, sizeof(conn.server), "%s:%d", rl_host, rl_port);
	return conn.server;
}

/* Fills in a failure and discards the connection. */
static void
rl_fail(RlFailure *failure, int sqlerrcode, const char *fmt,...)
	pg_attribute_printf(3, 4);

static void
rl_fail(RlFailure *failure, int sqlerrcode, const char *fmt,...)
{
	va_list		ap;

	failure->sqlerrcode = sqlerrcode;
	va_start(ap, fmt);
	vsnprintf(failure->message, sizeof(failure->message), fmt, ap);
	va_end(ap);
	rl_disconnect();
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
rl_wait(uint32 events, TimestampTz deadline)
{
	if (conn.sock_events != events)
	{
		ModifyWaitEvent(conn.wes, conn.sock_pos, events, NULL);
		conn.sock_events = events;
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

		if (WaitEventSetWait(conn.wes, timeout, &event, 1,
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

/* Sends all of out.data; false (with the failure filled in) on error. */
static bool
rl_send_all(TimestampTz deadline, RlFailure *failure)
{
	size_t		done = 0;

	while (done < (size_t) out.len)
	{
		ssize_t		n = send(conn.sock, out.data + done, out.len - done,
							 MSG_NOSIGNAL);

		if (n > 0)
			done += n;
		else if (n < 0 && errno == EINTR)
			continue;
		else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
		{
			if (!rl_wait(WL_SOCKET_WRITEABLE, deadline))
			{
				rl_fail(failure, ERRCODE_CONNECTION_FAILURE,
						"timed out sending to Redis at %s", conn.server);
				return false;
			}
		}
		else
		{
			rl_fail(failure, ERRCODE_CONNECTION_FAILURE,
					"could not send to Redis at %s: %m", conn.server);
			return false;
		}
	}
	return true;
}

/* Reads until one whole reply is parsed; NULL (failure filled in) on error. */
static redisReply *
rl_recv(TimestampTz deadline, RlFailure *failure)
{
	for (;;)
	{
		void	   *reply = NULL;
		ssize_t		n;

		if (redisReaderGetReply(conn.reader, &reply) != REDIS_OK)
		{
			rl_fail(failure, ERRCODE_PROTOCOL_VIOLATION,
					"invalid reply from Redis at %s: %s",
					conn.server, conn.reader->errstr);
			return NULL;
		}
		if (reply != NULL)
			return (redisReply *) reply;

		if (!rl_wait(WL_SOCKET_READABLE, deadline))
		{
			rl_fail(failure, ERRCODE_CONNECTION_FAILURE,
					"timed out waiting for a reply from Redis at %s", conn.server);
			return NULL;
		}

		n = recv(conn.sock, inbuf, sizeof(inbuf), 0);
		if (n > 0)
		{
			if (redisReaderFeed(conn.reader, inbuf, n) != REDIS_OK)
			{
				rl_fail(failure, ERRCODE_PROTOCOL_VIOLATION,
						"invalid reply from Redis at %s: %s",
						conn.server, conn.reader->errstr);
				return NULL;
			}
		}
		else if (n == 0)
		{
			rl_fail(failure, ERRCODE_CONNECTION_FAILURE,
					"Redis at %s closed the connection", conn.server);
			return NULL;
		}
		else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
		{
			rl_fail(failure, ERRCODE_CONNECTION_FAILURE,
					"could not receive from Redis at %s: %m", conn.server);
			return NULL;
		}
	}
}

/* Encodes one command in the Redis protocol (RESP) into out. */
static void
rl_encode(int argc, const char **argv, const size_t *argvlen)
{
	char		num[24];
	int			i;

	resetStringInfo(&out);
	appendStringInfoChar(&out, '*');
	appendBinaryStringInfo(&out, num, pg_ulltoa_n((uint64) argc, num));
	appendBinaryStringInfo(&out, "\r\n", 2);
	for (i = 0; i < argc; i++)
	{
		appendStringInfoChar(&out, '$');
		appendBinaryStringInfo(&out, num, pg_ulltoa_n((uint64) argvlen[i], num));
		appendBinaryStringInfo(&out, "\r\n", 2);
		appendBinaryStringInfo(&out, argv[i], argvlen[i]);
		appendBinaryStringInfo(&out, "\r\n", 2);
	}
}

/* Sends the command in out and reads its reply; the connection must be open. */
static redisReply *
rl_roundtrip(TimestampTz deadline, RlFailure *failure)
{
	redisReply *reply;

	conn.ready = false;			/* a reply may be in flight from here on */
	if (!rl_send_all(deadline, failure))
		return NULL;
	reply = rl_recv(deadline, failure);
	if (reply != NULL)
		conn.ready = true;
	return reply;
}

/*
 * Creates a non-blocking socket connected (or connecting) to addr, with the
 * wait-event set around it; false with failure filled in on error.
 */
static bool
rl_open_socket(const struct sockaddr *addr, socklen_t addrlen,
			   TimestampTz deadline, RlFailure *failure)
{
	int			err = 0;
	socklen_t	errlen = sizeof(err);

	if (!AcquireExternalFD())
	{
		rl_fail(failure, ERRCODE_SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION,
				"could not connect to Redis at %s: too many open files",
				conn.server);
		return false;
	}
	conn.fd_acquired = true;

	conn.sock = socket(addr->sa_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (conn.sock == PGINVALID_SOCKET)
	{
		rl_fail(failure, ERRCODE_SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION,
				"could not create socket for Redis at %s: %m", conn.server);
		return false;
	}
	if (!pg_set_noblock(conn.sock))
	{
		rl_fail(failure, ERRCODE_SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION,
				"could not set socket for Redis at %s to non-blocking mode: %m",
				conn.server);
		return false;
	}
	if (addr->sa_family != AF_UNIX)
	{
		int			on = 1;

		(void) setsockopt(conn.sock, IPPROTO_TCP, TCP_NODELAY, &on, sizeof(on));
	}

	conn.wes = CreateWaitEventSet(TopMemoryContext, 3);
	AddWaitEventToSet(conn.wes, WL_LATCH_SET, PGINVALID_SOCKET, MyLatch, NULL);
	AddWaitEventToSet(conn.wes, WL_EXIT_ON_PM_DEATH, PGINVALID_SOCKET, NULL, NULL);
	conn.sock_pos = AddWaitEventToSet(conn.wes, WL_SOCKET_WRITEABLE, conn.sock,
									  NULL, NULL);
	conn.sock_events = WL_SOCKET_WRITEABLE;

	if (connect(conn.sock, addr, addrlen) == 0)
		return true;
	if (errno != EINPROGRESS && errno != EAGAIN && errno != EINTR)
	{
		rl_fail(failure, ERRCODE_SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION,
				"could not connect to Redis at %s: %m", conn.server);
		return false;
	}
	if (!rl_wait(WL_SOCKET_WRITEABLE, deadline))
	{
		rl_fail(failure, ERRCODE_SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION,
				"could not connect to Redis at %s: timed out after %d ms",
				conn.server, rl_connect_timeout);
		return false;
	}
	if (getsockopt(conn.sock, SOL_SOCKET, SO_ERROR, &err, &errlen) < 0)
		err = errno;
	if (err != 0)
	{
		errno = err;
		rl_fail(failure, ERRCODE_SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION,
				"could not connect to Redis at %s: %m", conn.server);
		return false;
	}
	return true;
}

/* Sends one handshake command (AUTH, SELECT); false if Redis refuses it. */
static bool
rl_handshake(const char *what, int argc, const char **argv,
			 const size_t *argvlen, TimestampTz deadline, RlFailure *failure)
{
	redisReply *reply;

	rl_encode(argc, argv, argvlen);
	reply = rl_roundtrip(deadline, failure);
	if (reply == NULL)
	{
		failure->sqlerrcode = ERRCODE_SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION;
		return false;
	}
	if (reply->type == REDIS_REPLY_ERROR)
	{
		char		text[256];

		snprintf(text, sizeof(text), "%s", reply->str);
		freeReplyObject(reply);
		rl_fail(failure, ERRCODE_SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION,
				"could not connect to Redis at %s: %s failed: %s",
				conn.server, what, text);
		return false;
	}
	freeReplyObject(reply);
	return true;
}

/* Opens a new connection from the current settings, with AUTH and SELECT. */
static bool
rl_connect(RlFailure *failure)
{
	TimestampTz deadline = rl_deadline(rl_connect_timeout);

	rl_disconnect();
	rl_connection_settings_changed = false;
	rl_server_name();

	if (rl_host[0] == '/')
	{
		struct sockaddr_un sun;

		if (strlen(rl_host) >= sizeof(sun.sun_path))
		{
			rl_fail(failure, ERRCODE_SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION,
					"could not connect to Redis at %s: socket path is too long",
					conn.server);
			return false;
		}
		memset(&sun, 0, sizeof(sun));
		sun.sun_family = AF_UNIX;
		strcpy(sun.sun_path, rl_host);
		if (!rl_open_socket((struct sockaddr *) &sun, sizeof(sun), deadline,
							failure))
			return false;
	}
	else
	{
		struct addrinfo hints;
		struct addrinfo *addrs;
		struct addrinfo *ai;
		char		port[16];
		int			rc;

		memset(&hints, 0, sizeof(hints));
		hints.ai_family = AF_UNSPEC;
		hints.ai_socktype = SOCK_STREAM;
		snprintf(port, sizeof(port), "%d", rl_port);
		rc = getaddrinfo(rl_host, port, &hints, &addrs);
		if (rc != 0)
		{
			rl_fail(failure, ERRCODE_SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION,
					"could not resolve Redis host \"%s\": %s",
					rl_host, gai_strerror(rc));
			return false;
		}
		/* try each address in turn, within the one connect deadline */
		for (ai = addrs; ai != NULL; ai = ai->ai_next)
		{
			if (rl_open_socket(ai->ai_addr, ai->ai_addrlen, deadline, failure))
				break;
		}
		freeaddrinfo(addrs);
		if (ai == NULL)
			return false;
	}

	conn.reader = redisReaderCreate();
	if (conn.reader == NULL)
	{
		rl_fail(failure, ERRCODE_OUT_OF_MEMORY, "out of memory");
		return false;
	}
	conn.ready = true;

	if (rl_password[0] != '\0')
	{
		const char *argv[3];
		size_t		argvlen[3];
		int			argc = 0;

		argv[argc] = "AUTH";
		argvlen[argc++] = 4;
		if (rl_username[0] != '\0')
		{
			argv[argc] = rl_username;
			argvlen[argc++] = strlen(rl_username);
		}
		argv[argc] = rl_password;
		argvlen[argc++] = strlen(rl_password);
		if (!rl_handshake("AUTH", argc, argv, argvlen, deadline, failure))
			return false;
	}
	if (rl_database != 0)
	{
		char		db[16];
		const char *argv[2] = {"SELECT", db};
		size_t		argvlen[2] = {6, 0};

		argvlen[1] = pg_ulltoa_n((uint64) rl_database, db);
		if (!rl_handshake("SELECT", 2, argv, argvlen, deadline, failure))
			return false;
	}
	return true;
}

/*
 * True when an idle connection is still usable: the server has not closed
 * it (a restart, CLIENT KILL, idle timeout) and sent nothing unasked.
 */
static bool
rl_connection_alive(void)
{
	char		c;
	ssize_t		n = recv(conn.sock, &c, 1, MSG_PEEK | MSG_DONTWAIT);

	return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
}

/*
 * Sends one command and returns its reply, which the caller must free with
 * freeReplyObject. Opens the connection when needed. On failure returns NULL
 * with failure filled in; the connection is then already discarded. While
 * the circuit breaker is open, fails at once without touching the network.
 * An interrupt (cancel, statement_timeout) raises its error from inside.
 */
redisReply *
rl_command(int argc, const char **argv, const size_t *argvlen,
		   RlFailure *failure)
{
	redisReply *reply;

	if (out.data == NULL)
	{
		MemoryContext old = MemoryContextSwitchTo(TopMemoryContext);

		initStringInfo(&out);
		MemoryContextSwitchTo(old);
	}

	if (rl_connection_settings_changed)
	{
		rl_breaker_reset();		/* another server: try it at once */
		conn.ready = false;
	}
	else if (rl_breaker_open(failure))
		return NULL;

	if (!conn.ready || !rl_connection_alive())
	{
		if (!rl_connect(failure))
		{
			rl_breaker_failed(failure);
			return NULL;
		}
	}

	rl_encode(argc, argv, argvlen);
	reply = rl_roundtrip(rl_deadline(rl_command_timeout), failure);
	if (reply == NULL)
		rl_breaker_failed(failure);
	else
		rl_breaker_succeeded();
	return reply;
}
