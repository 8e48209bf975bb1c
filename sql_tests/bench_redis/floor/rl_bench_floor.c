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
 * reply. One connection per backend, kept; the wait goes through one
 * WaitEventSet with MyLatch, as rl_redis's does. Nothing else: no
 * arguments checked, no key kinds, no reply checked beyond its type, no
 * statistics, no transaction callbacks, no hiredis.
 */
#include "postgres.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include "fmgr.h"
#include "miscadmin.h"
#include "storage/latch.h"
#include "utils/builtins.h"
#include "utils/memutils.h"
#include "utils/wait_event.h"

PG_MODULE_MAGIC;

PG_FUNCTION_INFO_V1(rl_bench_floor);

static pgsocket sock = PGINVALID_SOCKET;
static WaitEventSet *wes;

/* Connects to 127.0.0.1:port, non-blocking, and makes the wait set. */
static void
floor_connect(int port)
{
	struct sockaddr_in addr;
	int			one = 1;

	memset(&addr, 0, sizeof(addr));
	addr.sin_family = AF_INET;
	addr.sin_port = htons(port);
	addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	sock = socket(AF_INET, SOCK_STREAM, 0);
	if (sock == PGINVALID_SOCKET ||
		connect(sock, (struct sockaddr *) &addr, sizeof(addr)) != 0 ||
		setsockopt(sock, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)) != 0 ||
		fcntl(sock, F_SETFL, O_NONBLOCK) != 0)
	{
		int			save_errno = errno;

		if (sock != PGINVALID_SOCKET)
			close(sock);
		sock = PGINVALID_SOCKET;
		errno = save_errno;
		ereport(ERROR,
				(errcode(ERRCODE_SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION),
				 errmsg("could not connect to Redis on port %d: %m", port)));
	}
	wes = CreateWaitEventSet(TopMemoryContext, 3);
	AddWaitEventToSet(wes, WL_LATCH_SET, PGINVALID_SOCKET, MyLatch, NULL);
	AddWaitEventToSet(wes, WL_EXIT_ON_PM_DEATH, PGINVALID_SOCKET, NULL, NULL);
	AddWaitEventToSet(wes, WL_SOCKET_READABLE, sock, NULL, NULL);
}

/* Drops the connection and raises err (a message with %m's errno kept). */
static void
floor_fail(const char *what)
{
	FreeWaitEventSet(wes);
	close(sock);
	sock = PGINVALID_SOCKET;
	ereport(ERROR,
			(errcode(ERRCODE_CONNECTION_FAILURE),
			 errmsg("%s", what)));
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
	char		key[96], slim[16], swin[24], out[512], in[512];
	int			len, got = 0;

	if (sock == PGINVALID_SOCKET)
		floor_connect(port);
	snprintf(key, sizeof(key), "rl:sliding:{bench:" INT64_FORMAT "}:%d/" INT64_FORMAT,
			 id, lim, window_ms);
	snprintf(slim, sizeof(slim), "%d", lim);
	snprintf(swin, sizeof(swin), INT64_FORMAT, window_ms);
	len = snprintf(out, sizeof(out),
				   "*6\r\n$7\r\nEVALSHA\r\n$%zu\r\n%s\r\n$1\r\n1\r\n$%zu\r\n%s\r\n"
				   "$%zu\r\n%s\r\n$%zu\r\n%s\r\n",
				   strlen(sha), sha, strlen(key), key, strlen(slim), slim,
				   strlen(swin), swin);
	if (len >= sizeof(out))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("script hash too long")));
	if (send(sock, out, len, MSG_NOSIGNAL) != len)
		floor_fail("could not send to Redis");

	/* a reply is one line, ":<n>\r\n" or "-<error>\r\n" */
	while (got < 2 || in[got - 1] != '\n')
	{
		WaitEvent	event;
		ssize_t		n;

		if (WaitEventSetWait(wes, -1, &event, 1, PG_WAIT_EXTENSION) == 0)
			continue;
		if (event.events & WL_LATCH_SET)
		{
			ResetLatch(MyLatch);
			CHECK_FOR_INTERRUPTS();
		}
		if (!(event.events & WL_SOCKET_READABLE))
			continue;
		n = recv(sock, in + got, sizeof(in) - 1 - got, 0);
		if (n <= 0)
		{
			if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
				continue;
			floor_fail("could not read from Redis");
		}
		got += n;
		if (got >= sizeof(in) - 1)
			floor_fail("Redis's reply is too long");
	}
	in[got] = '\0';
	if (in[0] != ':')
		ereport(ERROR,
				(errcode(ERRCODE_EXTERNAL_ROUTINE_EXCEPTION),
				 errmsg("Redis answered: %s", in)));
	PG_RETURN_INT64(strtoll(in + 1, NULL, 10));
}
