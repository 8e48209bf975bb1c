/*
 * xact_queue.c
 *	  Sending the transaction-end queues: at the end of a (sub)transaction,
 *	  before the session's next command, and at backend exit; Cluster
 *	  redirections of queued work, and its hand-over to the worker.
 *
 * Work that belongs to the end of a (sub)transaction (slot releases,
 * refunds) is queued on a connection with rl_defer_command. The transaction
 * callback here, which runs after the other modules' ones, writes each queue
 * to its open connection within a fixed budget and reads the replies it can
 * within it; the rest are read before the next command. A connection Redis
 * closed, or that a failed call discarded, is opened again within that
 * budget, to the address it was last opened to (no host-name lookup at
 * commit); only what Redis did not take in time waits for the session's
 * next call. It never raises. What stays queued and what is dropped when a
 * connection is lost is queue.c's.
 */
#include "postgres.h"

#include "access/xact.h"
#include "common/hashfn.h"
#include "lib/stringinfo.h"
#include "miscadmin.h"
#include "storage/ipc.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"

#include "rl_redis.h"
#include "conn_internal.h"

static void rl_transport_exit(int code, Datum arg);

/* a queued command redirected or told to try again this often is dropped */
#define RL_MAX_REQUEUE 5

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
bool
rl_send_queue(RlConn *conn, TimestampTz deadline, RlFailure *failure)
{
	bool		ok;

	rl_queue_account(conn);
	rl_queue_trim(conn);
	if (conn->pending_replies == conn->queue_count)
		return true;
	if (conn->kind == RL_CONN_SERVER && !rl_shared_settled(deadline))
	{
		rl_fail(failure, RL_FAILURE_WORKER, 0, RL_HINT_NONE, NULL,
				"the rl_redis worker still has a call of this session for Redis at %s",
				conn->address);
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
 * (rl_error_not_run): a redirection that the topology follows
 * (rl_reply_action; Redis Cluster's "MOVED <hash slot> <host>:<port>" or
 * "ASK ..."; an empty host is conn's), after which it moves to the queue
 * of the node named, after ASKING for ASK; or another (TRYAGAIN,
 * CLUSTERDOWN, READONLY, LOADING, MASTERDOWN: a hash slot being moved, a
 * failover, a server that is a replica now or not ready), after which it
 * waits in conn's queue for the session's next call there (wait_for_call),
 * which resolves the server's name again. Either way it is sent at most
 * RL_MAX_REQUEUE times. False when the error is none of these (a
 * redirection the topology does not follow), or the command went round
 * too often.
 */
static bool
rl_queue_redirect(RlConn *conn, int k, const char *error)
{
	RlRedirect	to;
	RlReplyError what = rl_classify_error(error, conn->host, &to);
	RlReplyAction action = rl_reply_action(what);
	RlConn	   *target;
	size_t		from = rl_queue_offset(conn, k);
	size_t		len;
	char	   *copy;
	uint8		flags;
	uint8		tries;

	if (!rl_error_not_run(what) || conn->queue_tries[k] >= RL_MAX_REQUEUE)
		return false;
	if (action == RL_ACTION_MOVED || action == RL_ACTION_ASK)
	{
		target = rl_conn_at(to.host, to.port, conn->kind);
		if (target == NULL || target == conn)
			return false;
	}
	else if (what == RL_REPLY_MOVED || what == RL_REPLY_ASK)
		return false;
	else
	{
		target = conn;
		conn->wait_for_call = true;
	}
	if (action == RL_ACTION_ASK)
	{
		const char *argv[1];
		size_t		argvlen[1];
		int			argc = rl_asking_argv(argv, argvlen);

		rl_queue_push(target, argc, argv, argvlen, NULL, 0, true, 0);
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
bool
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
			RlFailure	refused;

			rl_fail(&refused, RL_FAILURE_REPLY, ERRCODE_CONNECTION_EXCEPTION,
					RL_HINT_NONE, reply->str,
					"Redis at %s refused a rate-limit command sent at the end of a transaction",
					conn->address);
			freeReplyObject(reply);
			rl_report(WARNING, &refused,
					  "A slot may stay taken until its lease ends, or units of a rolled-back transaction may not have been given back.");
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
bool
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
	rl_register_exit();
	rl_queue_push(conn, argc, argv, argvlen, NULL, 0, flags, 0);
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
 * When the worker takes transaction-end work (rl_worker_takes: the shared
 * transport) and the session has no connection of its own open: hands the
 * queue's commands not on their way yet to the worker,
 * which sends them on its connection (an EVAL as the hash of its script
 * and its arguments: the script is too large for the queue, and the worker
 * has it too), and waits until deadline for the worker to have sent them.
 * True when none is left. Never raises.
 */
static bool
rl_conn_hand_to_worker(RlConn *conn, TimestampTz deadline)
{
	uint64		settings;

	if (!rl_worker_takes(NULL, NULL) || conn->kind != RL_CONN_SERVER)
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
 * conn, as rl_defer_command does: head is NULL, or when the work was an
 * EVAL the RL_SCRIPT_ARGV_RESERVED arguments before work's, as
 * rl_script_argv fills them (EVAL and its script's text; the worker, which
 * finds the script, fills them, as scripts.c is above this file).
 */
void
rl_conn_defer_handed(RlConn *conn, const RlDeferred *work, const char **head,
					 const size_t *headlen)
{
	StringInfoData buf;

	rl_register_exit();
	if (head == NULL)
	{
		rl_queue_push(conn, 0, NULL, NULL, work->encoded, work->len,
					  work->flags, 0);
		return;
	}
	initStringInfo(&buf);
	rl_encode_head(&buf, RL_SCRIPT_ARGV_RESERVED + work->nargs,
				   RL_SCRIPT_ARGV_RESERVED, head, headlen);
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
				rl_report(WARNING, &failure,
						  "Rate-limit work of the transaction end (slot releases, refunds) is sent with the session's next call.");
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
	for (conn = rl_conn_list; conn != NULL; conn = conn->next)
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
void
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
	for (conn = rl_conn_list; conn != NULL; conn = conn->next)
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
