/*
 * worker.c
 *	  The rl_redis worker: one background process per database cluster that
 *	  sends the sessions' script calls on its own connection, pipelined
 *	  (rl_redis.transport = shared).
 *
 * Started with the server when the configuration files set
 * rl_redis.transport = shared, else by the first call under the shared
 * transport (shared_queue.c); it opens no connection until a session hands
 * it a call. Each round it takes every call queued in shared
 * memory (shared_queue.c) and sends them with rl_call_many, one pipeline
 * per Redis node, so that the calls of many sessions share one write, one
 * read and one wake-up of Redis, and the server holds one connection per
 * Redis node whatever the number of sessions. Work of the sessions'
 * transaction ends is queued on its connection and goes with its next
 * write. It reads rl_redis.* from the configuration files (a reload is
 * taken at once); a session whose settings differ uses its own connection.
 * rl_redis.idle_timeout closes its idle connections.
 *
 * If it exits, the calls it had taken fail (on_error applies in their
 * sessions), those still queued are sent by their sessions, and the
 * postmaster starts it again after rl_redis.worker_restart_interval. One
 * that finds nothing to serve (see rl_shared_worker_start) exits with code
 * 0, which the postmaster takes for good.
 */
#include "postgres.h"

#include "miscadmin.h"
#include "pgstat.h"
#include "postmaster/bgworker.h"
#include "postmaster/interrupt.h"
#include "storage/ipc.h"
#include "storage/latch.h"
#include "tcop/tcopprot.h"
#include "utils/guc.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"
#include "utils/wait_event.h"

#include "rl_redis.h"

/* how long the worker sleeps with nothing to do (its idle check) */
#define RL_WORKER_NAP_MS 1000

PGDLLEXPORT void rl_worker_main(Datum arg);

/* On exit: the calls taken fail, no session sends more. */
static void
rl_worker_exit(int code, Datum arg)
{
	rl_shared_worker_stop();
}

/*
 * Takes every queued call and transaction-end work from the queue, sends
 * the calls (pipelined) and hands their results back, then sends the
 * transaction-end work on the same connections, after the calls (a slot
 * release handed over after its session gave up waiting for the acquire
 * goes after that acquire), and tells the sessions that handed work over
 * that it was sent. Returns how many entries it took. calls and entries have
 * room for every entry of the queue.
 */
static int
rl_worker_round(RlCall *calls, int *entries)
{
	int			nentries = rl_shared_entries();
	int		   *done = palloc(sizeof(int) * Max(nentries, 1));
	RlDeferred *works = palloc(sizeof(RlDeferred) * Max(nentries, 1));
	int			ndone = 0;
	int			n = 0;
	int			i;

	for (i = 0; i < nentries; i++)
	{
		int			script_id;

		switch (rl_shared_take(i, &calls[n], &script_id, &works[ndone]))
		{
			case 1:
				calls[n].script = rl_script_by_id(script_id);
				if (calls[n].script == NULL)
				{
					RlFailure	failure;

					rl_fail(&failure, RL_FAILURE_WORKER, ERRCODE_INTERNAL_ERROR,
							RL_HINT_NONE, NULL,
							"the rl_redis worker does not know the script of a call");
					rl_shared_complete(i, NULL, &failure, false);
					break;
				}
				entries[n++] = i;
				break;
			case 2:
				done[ndone++] = i;
				break;
			default:
				break;
		}
	}
	if (n > 0)
	{
		/* each connection sends the work queued in earlier rounds first */
		rl_call_many(calls, n);
		for (i = 0; i < n; i++)
		{
			rl_shared_complete(entries[i], calls[i].reply, &calls[i].failure,
							   calls[i].sent);
			if (calls[i].reply != NULL)
				freeReplyObject(calls[i].reply);
			calls[i].reply = NULL;
		}
	}
	if (ndone > 0)
	{
		for (i = 0; i < ndone; i++)
		{
			const RlScript *script = NULL;
			RlConn	   *conn;

			if (works[i].script_len > 0 &&
				(script = rl_script_by_text(works[i].script_len,
											works[i].script_hash)) == NULL)
				ereport(LOG,
						(errmsg("rl_redis worker: dropped transaction-end work for an unknown script")));
			else if ((conn = rl_conn_at(works[i].host, works[i].port,
										RL_CONN_SERVER)) == NULL)
				ereport(LOG,
						(errmsg("rl_redis worker: dropped transaction-end work for %s:%d beyond the %d servers it keeps",
								works[i].host, works[i].port, RL_MAX_CONNECTIONS)));
			else if (script == NULL)
				rl_conn_defer_handed(conn, &works[i], NULL, NULL);
			else
			{
				/* it was an EVAL, and goes as one */
				const char *head[RL_SCRIPT_ARGV_RESERVED];
				size_t		headlen[RL_SCRIPT_ARGV_RESERVED];

				rl_script_argv(script, true, head, headlen);
				rl_conn_defer_handed(conn, &works[i], head, headlen);
			}
		}
		/* sent now (and its replies are read) */
		rl_send_queued(NULL);
		for (i = 0; i < ndone; i++)
			rl_shared_deferred_done(done[i]);
	}
	return n + ndone;
}

/* The worker's main loop. */
void
rl_worker_main(Datum arg)
{
	MemoryContext round_cxt;
	RlCall	   *calls;
	int		   *entries;
	TimestampTz last_used = 0;

	pqsignal(SIGHUP, SignalHandlerForConfigReload);
	pqsignal(SIGTERM, die);
	BackgroundWorkerUnblockSignals();
	pgstat_report_appname("rl_redis worker");

	before_shmem_exit(rl_worker_exit, (Datum) 0);
	if (!rl_shared_worker_start(rl_settings_hash()))
	{
		ereport(LOG,
				(errmsg("rl_redis worker exits: another one serves the shared queue")));
		proc_exit(0);
	}
	ereport(LOG,
			(errmsg("rl_redis worker started with %d queue entries",
					rl_shared_entries())));

	calls = MemoryContextAlloc(TopMemoryContext, sizeof(RlCall) * Max(rl_shared_entries(), 1));
	entries = MemoryContextAlloc(TopMemoryContext, sizeof(int) * Max(rl_shared_entries(), 1));
	round_cxt = AllocSetContextCreate(TopMemoryContext, "rl_redis worker round",
									  ALLOCSET_DEFAULT_SIZES);
	for (;;)
	{
		MemoryContext old;
		int			taken;

		/* reset first: a call queued from here on sets it again */
		ResetLatch(MyLatch);
		CHECK_FOR_INTERRUPTS();
		if (ConfigReloadPending)
		{
			ConfigReloadPending = false;
			ProcessConfigFile(PGC_SIGHUP);
			rl_shared_worker_settings(rl_settings_hash());
		}

		MemoryContextReset(round_cxt);
		old = MemoryContextSwitchTo(round_cxt);
		taken = rl_worker_round(calls, entries);
		MemoryContextSwitchTo(old);
		if (taken > 0)
		{
			last_used = GetCurrentTimestamp();
			continue;			/* more may have come meanwhile */
		}

		if (rl_idle_timeout > 0 && last_used != 0 &&
			TimestampDifferenceExceeds(last_used, GetCurrentTimestamp(),
									   rl_idle_timeout))
		{
			(void) rl_close_idle(true);
			last_used = 0;
		}
		(void) WaitLatch(MyLatch, WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
						 rl_idle_timeout > 0 ? Min(RL_WORKER_NAP_MS, rl_idle_timeout) :
						 RL_WORKER_NAP_MS,
						 PG_WAIT_EXTENSION);
	}
}
