/*
 * io.c
 *	  The socket I/O of one connection: waits, reads and writes (through
 *	  TLS with rl_redis.tls), and a reply parsed.
 *
 * We own the socket and use hiredis only to parse replies (redisReader).
 * Every wait, for connect, write and read, goes through one WaitEventSet
 * holding MyLatch and the socket, so that statement_timeout,
 * pg_cancel_backend and pg_terminate_backend end a wait on a hung Redis at
 * once, and postmaster death ends the backend.
 *
 * With rl_redis.tls, the bytes go through OpenSSL (tls.c) on the same
 * non-blocking socket (rl_io_read/rl_io_write): a TLS handshake, read or write
 * that has to wait says for what, and waits in rl_wait like the rest.
 * Nothing outside the connection files and tls.c touches the socket.
 */
#include "postgres.h"

#include <errno.h>
#include <sys/socket.h>

#include "lib/stringinfo.h"
#include "miscadmin.h"
#include "pgstat.h"
#include "storage/latch.h"
#include "utils/timestamp.h"
#include "utils/wait_event.h"

#include "rl_redis.h"
#include "conn_internal.h"

/* reused for every command, so that a call allocates nothing */
StringInfoData rl_out;

static char inbuf[16384];

/* Fills in a failure (as rl_fail) and discards the connection. */
void
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
TimestampTz
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
bool
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
 * Waits for the socket events in want until deadline (rl_wait); true when
 * they came. When the deadline passed: with patient, false with
 * failure->sqlerrcode 0 and the connection kept; else false with a timeout
 * failure (message: a format taking the server's address) and the
 * connection discarded.
 */
static bool
rl_wait_or_time_out(RlConn *conn, uint32 want, TimestampTz deadline,
					bool patient, RlFailure *failure, const char *message)
{
	if (rl_wait(conn, want, deadline))
		return true;
	if (patient)
		rl_fail(failure, RL_FAILURE_TIMEOUT, 0, RL_HINT_NONE, NULL, message,
				conn->address);
	else
		rl_conn_fail(conn, failure, RL_FAILURE_TIMEOUT,
					 ERRCODE_CONNECTION_FAILURE, RL_HINT_COMMAND_TIMEOUT,
					 NULL, message, conn->address);
	return false;
}

/*
 * Writes len bytes of buf, counting in *done how many went out; false (with
 * the failure filled in and the connection discarded) on error. With
 * patient, a deadline that passes is not an error: false with
 * failure->sqlerrcode 0 and the connection kept.
 */
bool
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
			if (!rl_wait_or_time_out(conn, want, deadline, patient, failure,
									 "timed out sending to Redis at %s"))
				return false;
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
 * stays in the reader, to be completed by the next read). Redis closes the
 * connection after the error reply "ERR Protocol error" (Valkey a moment
 * after it): the connection that read it is not counted on any more, its
 * next call opens a new one.
 */
redisReply *
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
			redisReply *r = (redisReply *) reply;

			conn->replies_read++;
			conn->stalled_since = 0;
			if (r->type == REDIS_REPLY_ERROR &&
				strncmp(r->str, "ERR Protocol error", 18) == 0)
				conn->shut = true;
			return r;
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
		else if (!rl_wait_or_time_out(conn, want, deadline, patient, failure,
									  "timed out waiting for a reply from Redis at %s"))
			return NULL;
	}
}

/*
 * Sends the command in rl_out and reads its reply; the connection must be
 * open. For the set-up's commands (AUTH, SELECT, ROLE): NULL with failure
 * filled in as one to establish the connection (08001).
 */
redisReply *
rl_roundtrip(RlConn *conn, TimestampTz deadline, RlFailure *failure)
{
	redisReply *reply;
	size_t		done;

	conn->ready = false;			/* a reply may be in flight from here on */
	if (!rl_write(conn, rl_out.data, rl_out.len, &done, deadline, false, failure))
		reply = NULL;
	else
		reply = rl_recv(conn, deadline, false, failure);
	if (reply == NULL)
	{
		rl_fail_as(failure, ERRCODE_SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION);
		return NULL;
	}
	conn->ready = true;
	return reply;
}

/*
 * True when an idle connection is still usable: the server has not closed
 * it (a restart, CLIENT KILL, idle timeout) and sent nothing unasked.
 */
bool
rl_connection_alive(RlConn *conn)
{
	char		c;
	ssize_t		n;

	if (conn->tls.ssl)
		return rl_tls_alive(&conn->tls);
	n = recv(conn->sock, &c, 1, MSG_PEEK | MSG_DONTWAIT);
	return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
}
