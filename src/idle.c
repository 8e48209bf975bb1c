/*
 * idle.c
 *	  Closing idle connections: rl_redis.idle_timeout in a session, and the
 *	  worker's idle timeout.
 */
#include "postgres.h"

#include <sys/socket.h>

#include "utils/timeout.h"

#include "rl_redis.h"
#include "conn_internal.h"

/* the timeout that closes idle connections (rl_redis.idle_timeout) */
static TimeoutId idle_timeout_id = MAX_TIMEOUTS;

/* a command was sent since the idle timeout was last armed */
static bool used_since_idle = false;

/* a command was sent in the current top-level transaction */
static bool used_in_xact = false;

/*
 * Closes, when close is true, the connections that have nothing queued or
 * on the way (the worker's idle timeout, rl_redis_disconnect); their next
 * call opens them again. Returns how many stay open (as rl_conn_info
 * counts them).
 */
int
rl_close_idle(bool close)
{
	RlConn	   *conn;
	int			open = 0;

	for (conn = rl_conn_list; conn != NULL; conn = conn->next)
	{
		rl_queue_account(conn);
		if (close && conn->sock != PGINVALID_SOCKET && conn->ready &&
			conn->queue_count == 0 && conn->pending_replies == 0 &&
			conn->skip_replies == 0)
			rl_disconnect(conn);
		if (conn->ready && conn->sock != PGINVALID_SOCKET && !conn->shut)
			open++;
	}
	return open;
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
	for (conn = rl_conn_list; conn != NULL; conn = conn->next)
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
 * it when rl_redis.idle_timeout is 0 now. The next transaction has sent
 * nothing yet.
 */
void
rl_arm_idle_timeout(void)
{
	RlConn	   *conn;

	used_in_xact = false;
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
	for (conn = rl_conn_list; conn != NULL; conn = conn->next)
		if (conn->sock != PGINVALID_SOCKET && conn->ready)
			break;
	if (conn == NULL)
		return;
	used_since_idle = false;
	enable_timeout_after(idle_timeout_id, rl_idle_timeout);
}

/*
 * A command is about to be sent: the connections are in use again, so the
 * idle timeout stops (it is registered on first use with
 * rl_redis.idle_timeout set).
 */
void
rl_idle_in_use(void)
{
	if (idle_timeout_id != MAX_TIMEOUTS && get_timeout_active(idle_timeout_id))
		disable_timeout(idle_timeout_id, false);
	else if (idle_timeout_id == MAX_TIMEOUTS && rl_idle_timeout > 0)
		idle_timeout_id = RegisterTimeout(USER_TIMEOUT, rl_idle_timeout_handler);
	used_since_idle = true;
	used_in_xact = true;
}

/*
 * Whether the current top-level transaction sent a command: its end may
 * have work (a slot release, a refund) for the connections.
 */
bool
rl_idle_used_in_xact(void)
{
	return used_in_xact;
}
