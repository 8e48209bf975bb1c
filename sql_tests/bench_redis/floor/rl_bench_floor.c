/*
 * rl_bench_floor.c
 *	  Benchmark fixture (sql_tests/bench_redis.sh), not part of rl_redis: the
 *	  floor of E8, what any PostgreSQL function pays that asks Redis one
 *	  thing per call and waits for the answer as PostgreSQL requires.
 *
 * rl_bench_floor(port, sha, id, lim, window_ms) sends one EVALSHA of the
 * plain sliding script (sql_tests/bench_redis/sliding.lua, loaded as sha) on
 * the key the benchmark's plain runs use, rl:sliding:{bench:<id>}:<lim>/
 * <window_ms>, to the Redis on 127.0.0.1:port, and returns its integer
 * reply. One connection per backend, kept; every wait (connect, reply) goes
 * through one WaitEventSet with MyLatch, as rl_redis's do, and ends after
 * FLOOR_TIMEOUT_MS. Nothing else: no arguments checked, no key kinds, no
 * reply checked beyond its type, no statistics, no transaction callbacks,
 * no hiredis. A call that ends in an error (a cancel too) drops the
 * connection, so that no later call reads an earlier one's reply.
 */
#include "postgres.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include "fmgr.h"
#include "miscadmin.h"
#include "storage/fd.h"
#include "storage/latch.h"
#include "utils/builtins.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"
#include "utils/wait_event.h"

PG_MODULE_MAGIC;

PG_FUNCTION_INFO_V1(rl_bench_floor);

/* the longest wait for a connection or a reply */
#define FLOOR_TIMEOUT_MS 10000

static pgsocket sock = PGINVALID_SOCKET;
static WaitEventSet *wes = NULL;
static int	sock_pos;

/* Closes the connection, if any, and frees its wait set. */
static void
floor_drop(void)
{
	if (wes != NULL)
		FreeWaitEventSet(wes);
	wes = NULL;
	if (sock != PGINVALID_SOCKET)
	{
		close(sock);
		ReleaseExternalFD();
	}
	sock = PGINVALID_SOCKET;
}

/* Raises a connection failure: what, and strerror(err) when err != 0. */
static void
floor_fail(const char *what, int err)
{
	floor_drop();
	ereport(ERROR,
			(errcode(ERRCODE_CONNECTION_FAILURE),
			 errmsg("%s%s%s", what, err != 0 ? ": " : "",
					err != 0 ? strerror(err) : "")));
}

/*
 * Waits until the socket is ready for events or the deadline passes (an
 * error). Interrupts are serviced; one that raises an error drops the
 * connection first (PG_CATCH).
 */
static void
floor_wait(uint32 events, TimestampTz deadline)
{
	ModifyWaitEvent(wes, sock_pos, events, NULL);
	for (;;)
	{
		WaitEvent	event;
		long		timeout;

		timeout = TimestampDifferenceMilliseconds(GetCurrentTimestamp(), deadline);
		if (timeout <= 0)
			floor_fail("timed out waiting for Redis", 0);
		if (WaitEventSetWait(wes, timeout, &event, 1, PG_WAIT_EXTENSION) == 0)
			continue;
		if (event.events & WL_LATCH_SET)
		{
			ResetLatch(MyLatch);
			PG_TRY();
			{
				CHECK_FOR_INTERRUPTS();
			}
			PG_CATCH();
			{
				floor_drop();
				PG_RE_THROW();
			}
			PG_END_TRY();
		}
		if (event.events & events)
			return;
	}
}

/* Connects to 127.0.0.1:port (non-blocking, waiting in floor_wait). */
static void
floor_connect(int port)
{
	struct sockaddr_in addr;
	int			one = 1;
	int			err = 0;
	socklen_t	errlen = sizeof(err);

	if (!AcquireExternalFD())
		ereport(ERROR,
				(errcode(ERRCODE_SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION),
				 errmsg("could not connect to Redis: too many open files")));
	sock = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
	if (sock == PGINVALID_SOCKET)
	{
		err = errno;
		ReleaseExternalFD();
		floor_fail("could not create a socket", err);
	}
#if PG_VERSION_NUM >= 170000
	wes = CreateWaitEventSet(NULL, 3);
#else
	wes = CreateWaitEventSet(TopMemoryContext, 3);
#endif
	AddWaitEventToSet(wes, WL_LATCH_SET, PGINVALID_SOCKET, MyLatch, NULL);
	AddWaitEventToSet(wes, WL_EXIT_ON_PM_DEATH, PGINVALID_SOCKET, NULL, NULL);
	sock_pos = AddWaitEventToSet(wes, WL_SOCKET_WRITEABLE, sock, NULL, NULL);

	memset(&addr, 0, sizeof(addr));
	addr.sin_family = AF_INET;
	addr.sin_port = htons(port);
	addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	if (connect(sock, (struct sockaddr *) &addr, sizeof(addr)) != 0)
	{
		if (errno != EINPROGRESS)
			floor_fail("could not connect to Redis", errno);
		floor_wait(WL_SOCKET_WRITEABLE,
				   TimestampTzPlusMilliseconds(GetCurrentTimestamp(), FLOOR_TIMEOUT_MS));
		if (getsockopt(sock, SOL_SOCKET, SO_ERROR, &err, &errlen) != 0)
			err = errno;
		if (err != 0)
			floor_fail("could not connect to Redis", err);
	}
	if (setsockopt(sock, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)) != 0)
		floor_fail("could not set TCP_NODELAY", errno);
}

/* One EVALSHA of the plain sliding script; its integer reply. */
Datum
rl_bench_floor(PG_FUNCTION_ARGS)
{
	int			port = PG_GETARG_INT32(0);
	char	   *sha = text_to_cstring(PG_GETARG_TEXT_PP(1));
	int64		id = PG_GETARG_INT64(2);
	int32		lim = PG_GETARG_INT32(3);
	int64		window_ms = PG_GETARG_INT64(4);
	char		key[96],
				slim[16],
				swin[24],
				out[512],
				in[512];
	int			len;
	int			got = 0;
	TimestampTz deadline;

	snprintf(key, sizeof(key), "rl:sliding:{bench:" INT64_FORMAT "}:%d/" INT64_FORMAT,
			 id, lim, window_ms);
	snprintf(slim, sizeof(slim), "%d", lim);
	snprintf(swin, sizeof(swin), INT64_FORMAT, window_ms);
	len = snprintf(out, sizeof(out),
				   "*6\r\n$7\r\nEVALSHA\r\n$%zu\r\n%s\r\n$1\r\n1\r\n$%zu\r\n%s\r\n"
				   "$%zu\r\n%s\r\n$%zu\r\n%s\r\n",
				   strlen(sha), sha, strlen(key), key, strlen(slim), slim,
				   strlen(swin), swin);
	if (len >= (int) sizeof(out))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("script hash too long")));

	if (sock == PGINVALID_SOCKET)
		floor_connect(port);
	if (send(sock, out, len, MSG_NOSIGNAL) != len)
		floor_fail("could not send to Redis", errno);

	/* a reply is one line, ":<n>\r\n" or "-<error>\r\n" */
	deadline = TimestampTzPlusMilliseconds(GetCurrentTimestamp(), FLOOR_TIMEOUT_MS);
	while (got < 2 || in[got - 1] != '\n')
	{
		ssize_t		n;

		floor_wait(WL_SOCKET_READABLE, deadline);
		n = recv(sock, in + got, sizeof(in) - 1 - got, 0);
		if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
			continue;
		if (n < 0)
			floor_fail("could not read from Redis", errno);
		if (n == 0)
			floor_fail("Redis closed the connection", 0);
		got += n;
		if (got >= (int) sizeof(in) - 1)
			floor_fail("the reply of Redis is too long", 0);
	}
	in[got - 2] = '\0';			/* without its CR LF */
	if (in[0] != ':')
	{
		/* (an unread rest of a longer reply must not reach the next call) */
		floor_drop();
		ereport(ERROR,
				(errcode(ERRCODE_EXTERNAL_ROUTINE_EXCEPTION),
				 errmsg("unexpected reply from Redis: %s", in)));
	}
	PG_RETURN_INT64(strtoll(in + 1, NULL, 10));
}
