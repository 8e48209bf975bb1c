/*
 * queue.c
 *	  The transaction-end queue of one connection: what is queued, written
 *	  and confirmed (the sending is xact_queue.c's).
 *
 * The queue holds commands for the end of a transaction, encoded one after
 * another (see struct RlConn). A queued command leaves the queue when its
 * reply is read. When the connection is lost first, a command that is
 * harmless to repeat (a slot release, a refund that drops a record) is sent
 * again on the next connection, and one that is not (a refund that
 * subtracts) is dropped, as it may have been applied: nothing is applied
 * twice. Nothing here does I/O.
 */
#include "postgres.h"

#include "lib/stringinfo.h"
#include "utils/memutils.h"

#include "rl_redis.h"
#include "conn_internal.h"

/* a command written whole this often and never confirmed is dropped */
#define RL_QUEUE_TRIES 2

/*
 * What may wait in a queue: a command beyond it is dropped with a warning.
 * (The queue holds the work of the transaction ends since the last command
 * that reached Redis; this bounds a session whose Redis stays away or hung
 * while its transactions keep ending.)
 */
#define RL_MAX_QUEUE (64 * 1024 * 1024)

/* The offset in queue at which command k begins. */
size_t
rl_queue_offset(RlConn *conn, int k)
{
	return k == 0 ? 0 : (size_t) conn->queue_ends[k - 1];
}

/*
 * Takes n commands off the queue from command k on, with one move: the
 * commands are only ever dropped in runs.
 */
void
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
void
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
void
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
void
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
 * Appends one command to conn's queue: argv encoded, or (argv NULL) the
 * len bytes at encoded, already encoded; flags as rl_defer_command's;
 * tries: the times it was written whole (to another connection) already. Beyond RL_MAX_QUEUE bytes waiting
 * the command is dropped with a warning. Raises only when out of memory.
 */
void
rl_queue_push(RlConn *conn, int argc, const char **argv,
			  const size_t *argvlen, const char *encoded, size_t len,
			  uint8 flags, uint8 tries)
{
	MemoryContext old;

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
			palloc(sizeof(uint8) * conn->queue_max);
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
 * Drops everything queued that is not on its way (written, its reply not
 * read yet), with a warning that says why.
 */
void
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
