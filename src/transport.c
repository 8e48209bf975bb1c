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
	bool		ready;			/* connected and idle: safe to send */
	bool		interrupted;	/* an interrupt ended a wait on this server */
	char		server[300];	/* "host:port" or the socket path */
} RlConnection;

static RlConnection conn = {PGINVALID_SOCKET};

/* reused for every command, so that a call allocates nothing */
static StringInfoData out;

/*
 * The address list of a connect in progress: a cancel while connecting
 * leaves it behind, and the next connect frees it.
 */
static struct addrinfo *pending_addrs = NULL;

/* the connection settings the open connection was made with */
static StringInfoData conn_settings;
static char inbuf[16384];

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
}

/* Drops a connection whose command was interrupted by an error. */
static void
rl_xact_callback(XactEvent event, void *arg)
{
	if ((event == XACT_EVENT_ABORT || event == XACT_EVENT_PARALLEL_ABORT) &&
		conn.sock != PGINVALID_SOCKET && !conn.ready)
		rl_disconnect();
	if (event == XACT_EVENT_ABORT || event == XACT_EVENT_PARALLEL_ABORT ||
		event == XACT_EVENT_COMMIT || event == XACT_EVENT_PARALLEL_COMMIT ||
		event == XACT_EVENT_PREPARE)
		conn.interrupted = false;
}

/*
 * Registers the transaction callback; called once from _PG_init, before the
 * other modules register theirs, so that it runs after them.
 */
void
rl_transport_init(void)
{
	RegisterXactCallback(rl_xact_callback, NULL);
}

/*
 * True when a cancel or timeout ended a wait on Redis in the current
 * transaction; the clean-up at its end then does not wait on Redis again.
 */
bool
rl_transport_interrupted(void)
{
	return conn.interrupted;
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
			conn.interrupted = true;	/* stays set if this raises */
			CHECK_FOR_INTERRUPTS();
			conn.interrupted = false;
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

/* Sends all of out.data; false (with the failure filled in) on error. */
static bool
rl_send_all(TimestampTz deadline, RlFailure *failure)
{
	size_t		done = 0;
	char		errbuf[256];

	while (done < (size_t) out.len)
	{
		uint32		want = WL_SOCKET_WRITEABLE;
		ssize_t		n = rl_io_write(out.data + done, out.len - done, &want,
									errbuf, sizeof(errbuf));

		if (n > 0)
			done += n;
		else if (n == RL_IO_WAIT)
		{
			if (!rl_wait(want, deadline))
			{
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

/* Reads until one whole reply is parsed; NULL (failure filled in) on error. */
static redisReply *
rl_recv(TimestampTz deadline, RlFailure *failure)
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

/* Writes the current connection settings into buf, to compare. */
static void
rl_settings_signature(StringInfo buf)
{
	resetStringInfo(buf);
	appendStringInfo(buf, "%s%c%d%c%s%c%s%c%d%c%d%c%s%c%s%c%s%c%s",
					 rl_host, 0, rl_port, 0, rl_username, 0, rl_password, 0,
					 rl_database, 0, (int) rl_tls, 0, rl_tls_ca_file, 0,
					 rl_tls_cert_file, 0, rl_tls_key_file, 0, rl_tls_server_name);
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
	conn.interrupted = false;
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
		rl_breaker_reset();		/* settings were set: try at once */
		if (rl_settings_changed())
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
