/*
 * connect.c
 *	  Opening a connection to Redis: resolve, open, TLS, handshake (AUTH,
 *	  SELECT, and ROLE for the master a sentinel named), one step each.
 *
 * A connection is opened on first use and kept for the life of the
 * backend. It is discarded, never reused, after any failure, and after a
 * connection setting changed; the next call opens a new one. A transaction
 * end opens one again without a name lookup, to the address the last
 * connection was opened to.
 */
#include "postgres.h"

#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>
#include <arpa/inet.h>

#include "lib/stringinfo.h"
#include "miscadmin.h"
#include "storage/fd.h"
#include "storage/latch.h"
#include "utils/builtins.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"

#include "rl_redis.h"
#include "conn_internal.h"

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

/*
 * Fills failure from the error reply Redis gave to the set-up command what
 * and frees the reply. A refused AUTH, and any command refused for want of
 * one (NOAUTH: no password set, where the server wants one), is an
 * authentication failure whose hint names the password setting.
 */
static void
rl_setup_refused(RlConn *conn, const char *what, redisReply *reply,
				 RlFailure *failure)
{
	char		text[256];
	bool		auth = strcmp(what, "AUTH") == 0 ||
		rl_classify_error(reply->str, conn->host, NULL) == RL_REPLY_AUTH;

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
}

/* Sends one handshake command (AUTH, SELECT); false if Redis refuses it. */
static bool
rl_handshake(RlConn *conn, const char *what, int argc, const char **argv,
			 const size_t *argvlen, TimestampTz deadline, RlFailure *failure)
{
	redisReply *reply;

	resetStringInfo(&rl_out);
	rl_encode(&rl_out, argc, argv, argvlen);
	reply = rl_roundtrip(conn, deadline, failure);
	if (reply == NULL)
		return false;
	if (reply->type == REDIS_REPLY_ERROR)
	{
		rl_setup_refused(conn, what, reply, failure);
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

	resetStringInfo(&rl_out);
	rl_encode(&rl_out, 1, argv, argvlen);
	reply = rl_roundtrip(conn, deadline, failure);
	if (reply == NULL)
		return false;
	if (reply->type == REDIS_REPLY_ERROR)
	{
		rl_setup_refused(conn, "ROLE", reply, failure);
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
bool
rl_connect(RlConn *conn, TimestampTz deadline, bool resolve,
		   RlFailure *failure)
{
	struct sockaddr_un sun;

	rl_disconnect(conn);
	if (conn->pending_addrs != NULL)
	{
		freeaddrinfo(conn->pending_addrs);
		conn->pending_addrs = NULL;
	}
	conn->settings_seen = rl_settings_version();
	conn->library_loaded = false;	/* the server may be another process now */
	conn->load_refused_at = 0;
	if (conn->settings.data == NULL)
	{
		MemoryContext old = MemoryContextSwitchTo(TopMemoryContext);

		initStringInfo(&conn->settings);
		MemoryContextSwitchTo(old);
	}
	/* what was queued for the previous server must not reach this one */
	else if (rl_settings_differ(conn))
		rl_conn_other_server(conn);
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
