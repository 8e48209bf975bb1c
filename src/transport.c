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
 * Work that belongs to the end of a (sub)transaction (slot releases,
 * refunds) is queued with rl_defer_command. The transaction callback here,
 * which runs after the other modules' ones, writes the queue to an open
 * connection within a fixed budget and reads the replies it can within it;
 * the rest are read before the next command. It never connects (no
 * host-name lookup at commit) and never raises. A queued command leaves the
 * queue when its reply is read. When the connection is lost first, a
 * command that is harmless to repeat (a slot release, a refund that drops a
 * record) is sent again on the next connection, and one that is not (a
 * refund that subtracts) is dropped, as it may have been applied: nothing
 * is applied twice.
 *
 * With rl_redis.tls, the bytes go through OpenSSL on the same non-blocking
 * socket (rl_io_read/rl_io_write): a TLS handshake, read or write that has
 * to wait says for what, and waits in rl_wait like the rest. Nothing outside
 * this file touches the socket.
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
#include <arpa/inet.h>

#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>

#include "access/xact.h"
#include "lib/stringinfo.h"
#include "miscadmin.h"
#include "pgstat.h"
#include "storage/fd.h"
#include "storage/ipc.h"
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
	SSL_CTX    *ssl_ctx;		/* with rl_redis.tls */
	SSL		   *ssl;
	bool		ready;			/* connected, nothing unread but the pending
								 * replies: safe to send */
	int			pending_replies;	/* the first commands of the queue that
									 * were written whole, their replies not
									 * read yet */
	size_t		queue_partial;	/* bytes written of the queue's next command */
	char		server[300];	/* "host:port" or the socket path */
} RlConnection;

static RlConnection conn = {PGINVALID_SOCKET};

/* reused for every command, so that a call allocates nothing */
static StringInfoData out;

/* a reused buffer larger than this is given back after use */
#define RL_KEEP_BUFFER (64 * 1024)

/*
 * Commands queued for the end of a transaction: encoded one after another in
 * queue; the end offset of each in queue_ends, and whether it may be sent
 * twice in queue_idempotent. What a transaction end could not write waits
 * for the next command, which sends it first: so the queue never holds more
 * than the work of the transaction ends since the last command that reached
 * Redis (a charge needs such a command). It belongs to one server: when the
 * connection settings name another, it is dropped with a warning. While the queue is being
 * written, queue_write_from and queue_write_done say which bytes went out,
 * so that a write cut short by an error or an interrupt is accounted for.
 */
static StringInfoData queue;
static int *queue_ends = NULL;
static bool *queue_idempotent = NULL;
static uint8 *queue_tries = NULL;	/* times written whole */
static int	queue_count = 0;
static int	queue_max = 0;
static int	queue_confirmed = 0;	/* the first commands, replies read */
static bool queue_writing = false;
static size_t queue_write_from = 0;
static size_t queue_write_done = 0;

/* a command written whole this often and never confirmed is dropped */
#define RL_QUEUE_TRIES 2

/*
 * What may wait in the queue: a command beyond it is dropped with a
 * warning. (The queue holds the work of the transaction ends since the last
 * command that reached Redis; this bounds a session whose Redis stays away
 * or hung while its transactions keep ending.)
 */
#define RL_MAX_QUEUE (64 * 1024 * 1024)

/* whether the last command was written whole (it may have run) */
static bool last_command_sent = false;

/* counts the changes of server (connection settings) */
static uint64 server_generation = 1;


/* the most a transaction end waits on Redis */
#define RL_XACT_END_BUDGET_MS 1000

/*
 * The address list of a connect in progress: a cancel while connecting
 * leaves it behind, and the next connect frees it.
 */
static struct addrinfo *pending_addrs = NULL;

/* the connection settings the open connection was made with */
static StringInfoData conn_settings;
static char inbuf[16384];

static void rl_transport_exit(int code, Datum arg);
static void rl_discard_queue(const char *why);
static void rl_queue_unconfirmed(void);

/* Closes the socket and frees everything that belongs to the connection. */
static void
rl_disconnect(void)
{
	if (conn.ssl)
		SSL_free(conn.ssl);
	conn.ssl = NULL;
	if (conn.ssl_ctx)
		SSL_CTX_free(conn.ssl_ctx);
	conn.ssl_ctx = NULL;
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
	rl_queue_unconfirmed();
}

/*
 * True when the last command (rl_command), failed or not, was written whole
 * to Redis, which may then have run it; false when it never left (breaker
 * open, no connection, a write cut short).
 */
bool
rl_command_was_sent(void)
{
	return last_command_sent;
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

#define RL_IO_WAIT (-2)

/* Describes the last OpenSSL error (or the certificate check's) in buf. */
static void
rl_tls_error(char *buf, size_t size)
{
	unsigned long code = ERR_get_error();

	if (conn.ssl && SSL_get_verify_result(conn.ssl) != X509_V_OK)
		snprintf(buf, size, "certificate verify failed: %s",
				 X509_verify_cert_error_string(SSL_get_verify_result(conn.ssl)));
	else if (code != 0)
		ERR_error_string_n(code, buf, size);
	else
		snprintf(buf, size, "%s", errno ? strerror(errno) : "connection closed");
	ERR_clear_error();
}

/*
 * Turns an OpenSSL result r of an I/O call into RL_IO_WAIT (with *want set
 * to what to wait for), 0 for a closed connection, or -1 (with errbuf).
 */
static ssize_t
rl_tls_result(int r, uint32 *want, char *errbuf, size_t errsize)
{
	switch (SSL_get_error(conn.ssl, r))
	{
		case SSL_ERROR_WANT_READ:
			*want = WL_SOCKET_READABLE;
			return RL_IO_WAIT;
		case SSL_ERROR_WANT_WRITE:
			*want = WL_SOCKET_WRITEABLE;
			return RL_IO_WAIT;
		case SSL_ERROR_ZERO_RETURN:
			return 0;
		case SSL_ERROR_SYSCALL:
			if (ERR_peek_error() == 0 && errno == 0)
				return 0;		/* EOF without close_notify */
			/* FALLTHROUGH */
		default:
			rl_tls_error(errbuf, errsize);
			return -1;
	}
}

/*
 * Writes up to len bytes: returns how many, RL_IO_WAIT (with *want), or -1
 * (with errbuf).
 */
static ssize_t
rl_io_write(const char *buf, size_t len, uint32 *want, char *errbuf,
			size_t errsize)
{
	ssize_t		n;

	if (conn.ssl)
	{
		int			r;

		ERR_clear_error();
		errno = 0;
		r = SSL_write(conn.ssl, buf, (int) Min(len, (size_t) INT_MAX));
		if (r > 0)
			return r;
		n = rl_tls_result(r, want, errbuf, errsize);
		if (n == 0)
			snprintf(errbuf, errsize, "the server closed the connection");
		return n == 0 ? -1 : n;
	}
	n = send(conn.sock, buf, len, MSG_NOSIGNAL);
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
rl_io_read(char *buf, size_t len, uint32 *want, char *errbuf, size_t errsize)
{
	ssize_t		n;

	if (conn.ssl)
	{
		int			r;

		ERR_clear_error();
		errno = 0;
		r = SSL_read(conn.ssl, buf, (int) Min(len, (size_t) INT_MAX));
		if (r > 0)
			return r;
		return rl_tls_result(r, want, errbuf, errsize);
	}
	n = recv(conn.sock, buf, len, 0);
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
rl_write(const char *buf, size_t len, size_t *done, TimestampTz deadline,
		 bool patient, RlFailure *failure)
{
	char		errbuf[256];

	*done = 0;
	while (*done < len)
	{
		uint32		want = WL_SOCKET_WRITEABLE;
		ssize_t		n = rl_io_write(buf + *done, len - *done, &want,
									errbuf, sizeof(errbuf));

		if (n > 0)
			*done += n;
		else if (n == RL_IO_WAIT)
		{
			if (!rl_wait(want, deadline))
			{
				if (patient)
				{
					failure->sqlerrcode = 0;
					return false;
				}
				rl_fail(failure, ERRCODE_CONNECTION_FAILURE,
						"timed out sending to Redis at %s", conn.server);
				return false;
			}
		}
		else
		{
			rl_fail(failure, ERRCODE_CONNECTION_FAILURE,
					"could not send to Redis at %s: %s", conn.server, errbuf);
			return false;
		}
	}
	return true;
}

/*
 * Reads until one whole reply is parsed; NULL (failure filled in) on error.
 * With patient, a deadline that passes is not an error: NULL with
 * failure->sqlerrcode 0, the connection kept (a partial reply stays in the
 * reader, to be completed by the next read).
 */
static redisReply *
rl_recv(TimestampTz deadline, bool patient, RlFailure *failure)
{
	uint32		want = WL_SOCKET_READABLE;
	char		errbuf[256];

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

		/* TLS may hold decrypted bytes that the socket no longer shows */
		if (!(conn.ssl && SSL_pending(conn.ssl) > 0) &&
			!rl_wait(want, deadline))
		{
			if (patient)
			{
				failure->sqlerrcode = 0;
				return NULL;
			}
			rl_fail(failure, ERRCODE_CONNECTION_FAILURE,
					"timed out waiting for a reply from Redis at %s", conn.server);
			return NULL;
		}

		n = rl_io_read(inbuf, sizeof(inbuf), &want, errbuf, sizeof(errbuf));
		if (n > 0)
		{
			want = WL_SOCKET_READABLE;
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
		else if (n != RL_IO_WAIT)
		{
			rl_fail(failure, ERRCODE_CONNECTION_FAILURE,
					"could not receive from Redis at %s: %s", conn.server, errbuf);
			return NULL;
		}
	}
}

/*
 * Starts TLS on the connected socket and completes the handshake, checking
 * the server's certificate against rl_redis.tls_ca_file (or the system's
 * CAs) and its name against rl_redis.tls_server_name (or the host).
 */
static bool
rl_tls_start(TimestampTz deadline, RlFailure *failure)
{
	const char *name = rl_tls_server_name[0] ? rl_tls_server_name : rl_host;
	unsigned char addr[sizeof(struct in6_addr)];
	bool		is_ip = inet_pton(AF_INET, name, addr) == 1 ||
		inet_pton(AF_INET6, name, addr) == 1;
	char		errbuf[256];

	ERR_clear_error();
	conn.ssl_ctx = SSL_CTX_new(TLS_client_method());
	if (conn.ssl_ctx == NULL)
		goto fail;
	SSL_CTX_set_min_proto_version(conn.ssl_ctx, TLS1_2_VERSION);
	SSL_CTX_set_mode(conn.ssl_ctx, SSL_MODE_ENABLE_PARTIAL_WRITE |
					 SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
	SSL_CTX_set_verify(conn.ssl_ctx, SSL_VERIFY_PEER, NULL);
	if (rl_tls_ca_file[0] != '\0')
	{
		if (SSL_CTX_load_verify_locations(conn.ssl_ctx, rl_tls_ca_file, NULL) != 1)
		{
			rl_tls_error(errbuf, sizeof(errbuf));
			rl_fail(failure, ERRCODE_CONFIG_FILE_ERROR,
					"could not load rl_redis.tls_ca_file: %s", errbuf);
			return false;
		}
	}
	else if (SSL_CTX_set_default_verify_paths(conn.ssl_ctx) != 1)
		goto fail;
	if (rl_tls_cert_file[0] != '\0')
	{
		if (SSL_CTX_use_certificate_chain_file(conn.ssl_ctx, rl_tls_cert_file) != 1 ||
			SSL_CTX_use_PrivateKey_file(conn.ssl_ctx,
										rl_tls_key_file[0] ? rl_tls_key_file : rl_tls_cert_file,
										SSL_FILETYPE_PEM) != 1 ||
			SSL_CTX_check_private_key(conn.ssl_ctx) != 1)
		{
			rl_tls_error(errbuf, sizeof(errbuf));
			rl_fail(failure, ERRCODE_CONFIG_FILE_ERROR,
					"could not load the client certificate (rl_redis.tls_cert_file, rl_redis.tls_key_file): %s",
					errbuf);
			return false;
		}
	}

	conn.ssl = SSL_new(conn.ssl_ctx);
	if (conn.ssl == NULL || SSL_set_fd(conn.ssl, conn.sock) != 1)
		goto fail;
	if (!is_ip)
		SSL_set_tlsext_host_name(conn.ssl, name);
	if (is_ip ?
		X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(conn.ssl), name) != 1 :
		SSL_set1_host(conn.ssl, name) != 1)
		goto fail;

	for (;;)
	{
		uint32		want;
		ssize_t		n;
		int			r;

		ERR_clear_error();
		errno = 0;
		r = SSL_connect(conn.ssl);
		if (r == 1)
			return true;
		n = rl_tls_result(r, &want, errbuf, sizeof(errbuf));
		if (n != RL_IO_WAIT)
		{
			if (n == 0)
				snprintf(errbuf, sizeof(errbuf), "the server closed the connection");
			rl_fail(failure, ERRCODE_SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION,
					"could not connect to Redis at %s: TLS handshake failed: %s",
					conn.server, errbuf);
			return false;
		}
		if (!rl_wait(want, deadline))
		{
			rl_fail(failure, ERRCODE_SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION,
					"could not connect to Redis at %s: TLS handshake timed out after %d ms",
					conn.server, rl_connect_timeout);
			return false;
		}
	}

fail:
	rl_tls_error(errbuf, sizeof(errbuf));
	rl_fail(failure, ERRCODE_SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION,
			"could not set up TLS for Redis at %s: %s", conn.server, errbuf);
	return false;
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

/* Sends the command in out and reads its reply; the connection must be open. */
static redisReply *
rl_roundtrip(TimestampTz deadline, RlFailure *failure)
{
	redisReply *reply;
	size_t		done;

	conn.ready = false;			/* a reply may be in flight from here on */
	if (!rl_write(out.data, out.len, &done, deadline, false, failure))
		return NULL;
	last_command_sent = true;
	reply = rl_recv(deadline, false, failure);
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

	resetStringInfo(&out);
	rl_encode(&out, argc, argv, argvlen);
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

/* Writes the current connection settings into buf, to compare. */
static void
rl_settings_signature(StringInfo buf)
{
	resetStringInfo(buf);
	appendStringInfo(buf, "%s%c%d%c%s%c%s%c%s%c%d%c%d%c%s%c%s%c%s%c%s",
					 rl_host, 0, rl_port, 0, rl_username, 0, rl_password, 0,
					 rl_password_file, 0, rl_database, 0, (int) rl_tls, 0,
					 rl_tls_ca_file, 0, rl_tls_cert_file, 0, rl_tls_key_file, 0,
					 rl_tls_server_name);
}

/*
 * True when a connection setting was assigned a value that differs from
 * what the open connection was made with (a reload that assigns the same
 * values again keeps the connection).
 */
static bool
rl_settings_changed(void)
{
	StringInfoData now;
	bool		changed;

	rl_connection_settings_changed = false;
	if (!conn.ready)
		return true;
	initStringInfo(&now);
	rl_settings_signature(&now);
	changed = now.len != conn_settings.len ||
		memcmp(now.data, conn_settings.data, now.len) != 0;
	pfree(now.data);
	return changed;
}

/* Opens a new connection from the current settings, with AUTH and SELECT. */
static bool
rl_connect(RlFailure *failure)
{
	TimestampTz deadline = rl_deadline(rl_connect_timeout);
	static bool exit_callback_registered = false;

	/* here, not in _PG_init: a preloaded library's _PG_init runs in the postmaster */
	if (!exit_callback_registered)
	{
		before_shmem_exit(rl_transport_exit, (Datum) 0);
		exit_callback_registered = true;
	}

	rl_disconnect();
	if (pending_addrs != NULL)
	{
		freeaddrinfo(pending_addrs);
		pending_addrs = NULL;
	}
	rl_connection_settings_changed = false;
	rl_server_name();
	if (conn_settings.data == NULL)
	{
		MemoryContext old = MemoryContextSwitchTo(TopMemoryContext);

		initStringInfo(&conn_settings);
		MemoryContextSwitchTo(old);
	}
	else
	{
		StringInfoData now;

		/* what was queued for the previous server must not reach this one */
		initStringInfo(&now);
		rl_settings_signature(&now);
		if (now.len != conn_settings.len ||
			memcmp(now.data, conn_settings.data, now.len) != 0)
		{
			server_generation++;
			rl_discard_queue("the connection settings now name another Redis server");
		}
		pfree(now.data);
	}
	rl_settings_signature(&conn_settings);

	if (rl_host[0] == '/')
	{
		struct sockaddr_un sun;

		if (rl_tls)
		{
			rl_fail(failure, ERRCODE_SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION,
					"could not connect to Redis at %s: TLS needs a TCP host, not a Unix socket",
					conn.server);
			return false;
		}

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
		pending_addrs = addrs;	/* freed here, or by the next connect */
		/* try each address in turn, within the one connect deadline */
		for (ai = addrs; ai != NULL; ai = ai->ai_next)
		{
			if (rl_open_socket(ai->ai_addr, ai->ai_addrlen, deadline, failure))
				break;
		}
		freeaddrinfo(addrs);
		pending_addrs = NULL;
		if (ai == NULL)
			return false;
		if (rl_tls && !rl_tls_start(deadline, failure))
			return false;
	}

	conn.reader = redisReaderCreate();
	if (conn.reader == NULL)
	{
		rl_fail(failure, ERRCODE_OUT_OF_MEMORY, "out of memory");
		return false;
	}
	conn.ready = true;

	{
		char		password[1024];
		char		err[256];
		const char *argv[3];
		size_t		argvlen[3];
		int			argc = 0;
		bool		ok;

		if (!rl_read_password(password, sizeof(password), err, sizeof(err)))
		{
			rl_fail(failure, ERRCODE_SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION,
					"could not connect to Redis at %s: %s", conn.server, err);
			return false;
		}
		if (password[0] != '\0')
		{
			argv[argc] = "AUTH";
			argvlen[argc++] = 4;
			if (rl_username[0] != '\0')
			{
				argv[argc] = rl_username;
				argvlen[argc++] = strlen(rl_username);
			}
			argv[argc] = password;
			argvlen[argc++] = strlen(password);
			ok = rl_handshake("AUTH", argc, argv, argvlen, deadline, failure);
			explicit_bzero(password, sizeof(password));
			if (!ok)
				return false;
		}
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
	ssize_t		n;

	if (conn.ssl)
	{
		/* TLS records such as session tickets may arrive unasked */
		ERR_clear_error();
		n = SSL_peek(conn.ssl, &c, 1);
		if (n <= 0 && SSL_get_error(conn.ssl, (int) n) == SSL_ERROR_WANT_READ)
		{
			ERR_clear_error();
			return true;
		}
		ERR_clear_error();
		return false;
	}
	n = recv(conn.sock, &c, 1, MSG_PEEK | MSG_DONTWAIT);
	return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
}

/* The offset in queue at which command k begins. */
static size_t
rl_queue_offset(int k)
{
	return k == 0 ? 0 : (size_t) queue_ends[k - 1];
}

/*
 * Takes n commands off the queue from command k on, with one move: the
 * commands are only ever dropped in runs.
 */
static void
rl_queue_remove(int k, int n)
{
	size_t		from = rl_queue_offset(k);
	size_t		len = rl_queue_offset(k + n) - from;
	int			i;

	if (n <= 0)
		return;
	memmove(queue.data + from, queue.data + from + len, queue.len - from - len);
	queue.len -= len;
	queue.data[queue.len] = '\0';
	for (i = k + n; i < queue_count; i++)
	{
		queue_ends[i - n] = queue_ends[i] - len;
		queue_idempotent[i - n] = queue_idempotent[i];
		queue_tries[i - n] = queue_tries[i];
	}
	queue_count -= n;
	if (queue_count == 0 && queue.maxlen > RL_KEEP_BUFFER)
	{
		pfree(queue.data);
		queue.data = NULL;
	}
}

/* Takes the commands whose replies were read off the queue. */
static void
rl_queue_trim(void)
{
	rl_queue_remove(0, queue_confirmed);
	queue_confirmed = 0;
}

/*
 * Accounts for a write of the queue that ended (also by an error or an
 * interrupt, which leave queue_writing set): the commands it wrote whole
 * now wait for their replies; the bytes it wrote of the next one are
 * remembered, so that the next write goes on from there.
 */
static void
rl_queue_account(void)
{
	size_t		end;
	int			k;

	if (!queue_writing)
		return;
	queue_writing = false;
	end = queue_write_from + queue_write_done;
	k = queue_confirmed + conn.pending_replies;
	while (k < queue_count && (size_t) queue_ends[k] <= end)
	{
		queue_tries[k++]++;
		conn.pending_replies++;
	}
	conn.queue_partial = k < queue_count ? end - rl_queue_offset(k) : 0;
}

/*
 * The connection is going: of the queued commands written whole whose
 * replies were not read (they may have been applied), keeps those that may
 * be sent again, once, and drops the others. A command written in part was
 * not applied (Redis runs only whole commands) and is sent again whole.
 */
static void
rl_queue_unconfirmed(void)
{
	int			written;
	int			dropped = 0;
	int			k;

	rl_queue_account();
	rl_queue_trim();
	written = conn.pending_replies;
	for (k = written - 1; k >= 0; k--)
	{
		if (queue_idempotent[k] && queue_tries[k] < RL_QUEUE_TRIES)
			continue;
		if (queue_idempotent[k])
			dropped++;
		rl_queue_remove(k, 1);
	}
	conn.pending_replies = 0;
	conn.queue_partial = 0;
	if (dropped > 0)
		ereport(WARNING,
				(errmsg("%d rate-limit commands of transaction ends (slot releases, refunds) were dropped after %d tries",
						dropped, RL_QUEUE_TRIES),
				 errdetail("Slots end with their lease; units of rolled-back transactions were not given back.")));
}

/*
 * Writes the queued commands not written yet to the open connection, going
 * on where an earlier write stopped, before deadline; their replies are
 * read by rl_read_pending. False on failure (the connection discarded), or
 * when the deadline passed first (failure->sqlerrcode 0; the connection
 * kept, and the next write goes on from there).
 */
static bool
rl_send_queue(TimestampTz deadline, RlFailure *failure)
{
	bool		ok;

	rl_queue_account();
	rl_queue_trim();
	if (conn.pending_replies == queue_count)
		return true;
	queue_write_from = rl_queue_offset(conn.pending_replies) + conn.queue_partial;
	queue_write_done = 0;
	queue_writing = true;
	ok = rl_write(queue.data + queue_write_from, queue.len - queue_write_from,
				  &queue_write_done, deadline, true, failure);
	rl_queue_account();			/* after a failure rl_disconnect did it */
	return ok;
}

/*
 * Reads the replies of the queued commands written to the connection and
 * takes those commands off the queue; an error reply is logged. False (with
 * the failure filled in) when the connection failed, or, with patient,
 * when the deadline passed first (failure->sqlerrcode 0; the rest of the
 * replies are read later).
 */
static bool
rl_read_pending(TimestampTz deadline, bool patient, RlFailure *failure)
{
	while (conn.pending_replies > 0)
	{
		redisReply *reply;

		reply = rl_recv(deadline, patient, failure);
		if (reply == NULL)
		{
			rl_queue_trim();
			return false;
		}
		conn.pending_replies--;
		queue_confirmed++;
		if (reply->type == REDIS_REPLY_ERROR)
		{
			char		text[256];

			snprintf(text, sizeof(text), "%s", reply->str);
			freeReplyObject(reply);
			ereport(WARNING,
					(errcode(ERRCODE_CONNECTION_EXCEPTION),
					 errmsg("Redis at %s refused a rate-limit command sent at the end of a transaction: %s",
							conn.server, text),
					 errdetail("A slot may stay taken until its lease ends, or units of a rolled-back transaction may not have been given back.")));
		}
		else
			freeReplyObject(reply);
	}
	rl_queue_trim();
	return true;
}

/*
 * Queues a command to be sent at the end of the current (sub)transaction,
 * or with the session's next command; idempotent: it may be sent again
 * (once, after a lost connection) without harm. Beyond RL_MAX_QUEUE bytes
 * waiting the command is dropped with a warning. Raises only when out of
 * memory.
 */
void
rl_defer_command(int argc, const char **argv, const size_t *argvlen,
				 bool idempotent)
{
	MemoryContext old;

	rl_queue_trim();
	if (queue.len > RL_MAX_QUEUE)
	{
		ereport(WARNING,
				(errmsg("a rate-limit command of a transaction end (slot release, refund) was dropped: %d MB wait for Redis at %s already",
						RL_MAX_QUEUE / (1024 * 1024), rl_server_name()),
				 errdetail("A slot ends with its lease; units of a rolled-back transaction were not given back.")));
		return;
	}
	old = MemoryContextSwitchTo(TopMemoryContext);
	if (queue.data == NULL)
		initStringInfo(&queue);
	if (queue_count == queue_max)
	{
		queue_max = Max(16, queue_max * 2);
		queue_ends = queue_ends ? repalloc(queue_ends, sizeof(int) * queue_max) :
			palloc(sizeof(int) * queue_max);
		queue_idempotent = queue_idempotent ?
			repalloc(queue_idempotent, sizeof(bool) * queue_max) :
			palloc(sizeof(bool) * queue_max);
		queue_tries = queue_tries ?
			repalloc(queue_tries, sizeof(uint8) * queue_max) :
			palloc(sizeof(uint8) * queue_max);
	}
	rl_encode(&queue, argc, argv, argvlen);
	queue_idempotent[queue_count] = idempotent;
	queue_tries[queue_count] = 0;
	queue_ends[queue_count++] = queue.len;
	MemoryContextSwitchTo(old);
}

/*
 * Drops everything queued that is not on its way (written, its reply not
 * read yet), with a warning that says why.
 */
static void
rl_discard_queue(const char *why)
{
	int			dropped;

	rl_queue_trim();
	dropped = queue_count - conn.pending_replies;
	if (dropped <= 0)
		return;
	ereport(WARNING,
			(errmsg("%d rate-limit commands of transaction ends (slot releases, refunds) were dropped: %s",
					dropped, why),
			 errdetail("Slots end with their lease; units of rolled-back transactions were not given back.")));
	rl_queue_remove(conn.pending_replies, queue_count - conn.pending_replies);
}

/*
 * At the end of a (sub)transaction: writes the queue to an open connection
 * within RL_XACT_END_BUDGET_MS (less when command_timeout is smaller).
 * Interrupts are held here, so the budget is the only bound; nothing here
 * raises or connects.
 */
static void
rl_flush_queue(void)
{
	RlFailure	failure;
	int			budget = RL_XACT_END_BUDGET_MS;
	TimestampTz deadline;
	RlHold		hold;

	if (queue_count == 0)
		return;
	/* a connection the server closed while idle would swallow the queue */
	rl_queue_account();
	if (conn.ready && conn.pending_replies == 0 && conn.queue_partial == 0 &&
		!rl_connection_alive())
		rl_disconnect();
	if (!conn.ready || conn.sock == PGINVALID_SOCKET)
	{
		ereport(WARNING,
				(errmsg("rate-limit work of the transaction end (slot releases, refunds) waits for the session's next call"),
				 errdetail("There is no usable connection to Redis at %s now.",
						   rl_server_name())));
		return;
	}
	if (rl_command_timeout > 0)
		budget = Min(budget, rl_command_timeout);
	deadline = rl_deadline(budget);
	rl_hold_save(&hold);
	PG_TRY();
	{
		/* written, then confirmed, so that other sessions see it at once */
		if (!rl_send_queue(deadline, &failure) ||
			!rl_read_pending(deadline, true, &failure))
		{
			if (failure.sqlerrcode != 0)
				ereport(WARNING,
						(errcode(failure.sqlerrcode),
						 errmsg_internal("%s", failure.message),
						 errdetail("Rate-limit work of the transaction end (slot releases, refunds) is sent with the session's next call.")));
		}
	}
	PG_CATCH();
	{
		rl_hold_restore(&hold);
		rl_disconnect();
	}
	PG_END_TRY();
}

/*
 * At the end of a transaction: drops a connection whose command was
 * interrupted by an error (a reply may be in flight), then sends the queue.
 */
static void
rl_xact_callback(XactEvent event, void *arg)
{
	if ((event == XACT_EVENT_ABORT || event == XACT_EVENT_PARALLEL_ABORT) &&
		conn.sock != PGINVALID_SOCKET && !conn.ready)
		rl_disconnect();
	if (event == XACT_EVENT_ABORT || event == XACT_EVENT_PARALLEL_ABORT ||
		event == XACT_EVENT_COMMIT || event == XACT_EVENT_PARALLEL_COMMIT ||
		event == XACT_EVENT_PREPARE)
		rl_flush_queue();
}

/* At the end of a subtransaction: the same, for a rolled-back one. */
static void
rl_subxact_callback(SubXactEvent event, SubTransactionId mySubid,
					SubTransactionId parentSubid, void *arg)
{
	if (event != SUBXACT_EVENT_ABORT_SUB)
		return;
	if (conn.sock != PGINVALID_SOCKET && !conn.ready)
		rl_disconnect();
	rl_flush_queue();
}

/*
 * When the backend exits: sends what is queued and reads the replies still
 * due, within RL_XACT_END_BUDGET_MS, so that closing the socket with unread
 * replies (which resets the connection) cannot make Redis drop commands it
 * had not read yet.
 */
static void
rl_transport_exit(int code, Datum arg)
{
	RlFailure	failure;
	RlHold		hold;
	TimestampTz deadline;

	if (!conn.ready || conn.sock == PGINVALID_SOCKET ||
		(queue_count == 0 && conn.pending_replies == 0))
		return;
	HOLD_INTERRUPTS();
	deadline = rl_deadline(RL_XACT_END_BUDGET_MS);
	rl_hold_save(&hold);
	PG_TRY();
	{
		if (rl_send_queue(deadline, &failure) &&
			rl_read_pending(deadline, true, &failure))
			rl_disconnect();
	}
	PG_CATCH();
	{
		rl_hold_restore(&hold);
	}
	PG_END_TRY();
	RESUME_INTERRUPTS();
}

/*
 * Registers the transaction callbacks; called once from _PG_init, before
 * the other modules register theirs, so that they run after them (and send
 * what those queued).
 */
void
rl_transport_init(void)
{
	RegisterXactCallback(rl_xact_callback, NULL);
	RegisterSubXactCallback(rl_subxact_callback, NULL);
}

/*
 * Sends one command and returns its reply, which the caller must free with
 * freeReplyObject. Opens the connection when needed, and first sends what
 * a transaction end left queued and reads what it left unread. On failure
 * returns NULL with failure filled in; the connection is then already
 * discarded. While the circuit breaker is open, fails at once without
 * touching the network. An interrupt (cancel, statement_timeout) raises its
 * error from inside.
 */
redisReply *
rl_command(int argc, const char **argv, const size_t *argvlen,
		   RlFailure *failure)
{
	redisReply *reply = NULL;
	TimestampTz deadline;

	last_command_sent = false;
	if (out.data == NULL)
	{
		MemoryContext old = MemoryContextSwitchTo(TopMemoryContext);

		initStringInfo(&out);
		MemoryContextSwitchTo(old);
	}
	if (rl_connection_settings_changed)
	{
		rl_breaker_reset();		/* settings were set: try at once */
		if (rl_settings_changed())
			conn.ready = false;
	}
	else if (rl_breaker_open(failure))
		return NULL;

	/* unread replies make the liveness peek useless; reading them checks */
	rl_queue_account();
	if (!conn.ready ||
		(conn.pending_replies == 0 && conn.queue_partial == 0 &&
		 !rl_connection_alive()))
	{
		if (!rl_connect(failure))
		{
			rl_breaker_failed(failure);
			return NULL;
		}
	}

	/*
	 * First the work queued by transaction ends, then the command. Redis may
	 * still be busy with that work when the deadline comes: the call fails
	 * then, but the connection is kept, and the next call goes on with it
	 * (never losing or repeating it).
	 */
	deadline = rl_deadline(rl_command_timeout);
	if (!rl_send_queue(deadline, failure) ||
		!rl_read_pending(deadline, true, failure))
	{
		if (failure->sqlerrcode == 0)
		{
			failure->sqlerrcode = ERRCODE_CONNECTION_FAILURE;
			snprintf(failure->message, sizeof(failure->message),
					 "timed out: Redis at %s is still busy with rate-limit work of earlier transaction ends",
					 conn.server);
		}
	}
	else
	{
		resetStringInfo(&out);
		rl_encode(&out, argc, argv, argvlen);
		reply = rl_roundtrip(deadline, failure);
		if (out.maxlen > RL_KEEP_BUFFER)
		{
			/* a huge command does not keep its buffer for the backend's life */
			pfree(out.data);
			out.data = MemoryContextAlloc(TopMemoryContext, 1024);
			out.maxlen = 1024;
			resetStringInfo(&out);
		}
	}
	if (reply == NULL)
		rl_breaker_failed(failure);
	else
		rl_breaker_succeeded(rl_server_name());
	return reply;
}
