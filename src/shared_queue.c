/*
 * shared_queue.c
 *	  The queue in shared memory between the sessions and the rl_redis
 *	  worker (rl_redis.transport = shared).
 *
 * The queue is a dynamic shared memory segment of rl_redis.shared_queue_size
 * entries, made by the worker as it starts: with the server when the
 * library is preloaded and the configuration files set rl_redis.transport
 * = shared, else when the first call under the shared transport asks the
 * postmaster to start it (that call, and the others until the worker runs,
 * use their session's own connection). Until then a server takes neither
 * (its main shared memory holds only the segment's handle).
 *
 * A session that makes a script call under rl_redis.transport = shared
 * claims a free entry, writes the call into it (the script's id, its
 * arguments), marks it queued and sets the worker's latch; then it waits on
 * its own latch for the reply, which the worker writes into the entry in the
 * Redis protocol. The worker (worker.c) takes every queued entry at once and
 * sends their calls in one pipeline per Redis node, so that the sessions
 * share its connections and its wake-ups.
 *
 * An entry's life, under its spinlock:
 *   FREE -> FILLING (a session writes the call) -> QUEUED -> TAKEN (the
 *   worker sends it) -> DONE (reply or failure in the entry) -> FREE (the
 *   session read it).
 * A session that stops waiting (cancel, statement_timeout, its own wait
 * bound) frees a QUEUED entry (the call never left), or marks a TAKEN one
 * ABANDONED, which the worker frees when the reply comes: a reply is only
 * ever read by the session that asked, and an entry it gave up is not its
 * own any more (only the worker frees it), so no later call of that
 * session can see the old reply.
 *
 * Work of a transaction end (refunds, slot releases) is handed over as
 * DEFERRED entries: the worker queues it on its own connection, sends it and
 * marks the entry DONE; the session waits for that within the transaction
 * end's budget (interrupts are held there: only the budget bounds it), so
 * that another session sees a released slot once COMMIT returns, as with
 * the session's own connection. An entry whose session stopped waiting is
 * freed by the worker.
 *
 * Which transport carries a call is decided here for every file: the
 * worker (rl_worker_takes) under rl_redis.transport = shared in standalone
 * mode, for the calls whose reply surely fits an entry and for the
 * transaction-end work of a session without a connection of its own open,
 * which is queued in calls of at most rl_worker_request_max bytes. A session
 * still uses its own connection instead (rl_shared_call says so) when that
 * connection has transaction-end work to send first, when the worker is
 * not running, when its connection settings differ from the worker's (a
 * session-level SET rl_redis.port, say), when the call would not fit an
 * entry, or when every entry is taken; the last two are logged once per
 * session. When the worker exits, the calls it had taken
 * fail (they may have run, so they are never sent again) and the calls
 * still queued go back to their sessions, which send them themselves.
 */
#include "postgres.h"

#include "miscadmin.h"
#include "common/hashfn.h"
#include "pgstat.h"
#include "postmaster/bgworker.h"
#include "storage/dsm.h"
#include "storage/ipc.h"
#include "storage/latch.h"
#include "storage/lwlock.h"
#include "storage/proc.h"
#include "storage/shmem.h"
#include "storage/spin.h"
#include "utils/timestamp.h"
#include "utils/wait_event.h"

#include "rl_redis.h"

/*
 * The most bytes of a call's arguments (or of deferred work) and of its
 * reply (in the Redis protocol) that an entry holds. Other files learn
 * them only through rl_worker_takes and rl_worker_request_max.
 */
#define RL_ENTRY_REQUEST 8192
#define RL_ENTRY_REPLY 4096

/*
 * The most keys of a several-limits call sent through the shared queue:
 * its reply of (6 + 2 * keys) numbers (23 bytes at most each) and a
 * verdict per key (0 or 1: 4 bytes) fits an entry.
 */
#define RL_SHARED_MANY_KEYS 64
StaticAssertDecl((6 + 2 * RL_SHARED_MANY_KEYS) * 23 + 4 * RL_SHARED_MANY_KEYS + 16 <=
				 RL_ENTRY_REPLY,
				 "the reply of a several-limits call fits the shared queue");

/* how often a waiting session checks that the worker still runs */
#define RL_WORKER_CHECK_MS 100

typedef enum RlEntryState
{
	RL_ENTRY_FREE,
	RL_ENTRY_FILLING,
	RL_ENTRY_QUEUED,
	RL_ENTRY_TAKEN,
	RL_ENTRY_DONE,
	RL_ENTRY_ABANDONED,
	RL_ENTRY_DEFERRED			/* transaction-end work, not taken yet */
} RlEntryState;

/* One call in the queue. */
typedef struct RlEntry
{
	slock_t		mutex;
	RlEntryState state;
	PGPROC	   *owner;			/* who waits for the reply */
	bool		deferred;		/* transaction-end work */
	bool		waiter;			/* of deferred work: its session waits */
	uint64		worker_gen;		/* the worker that took it */
	/* the call: a script (id) and its arguments after FCALL and its function */
	int			script_id;
	int			argc;			/* of the arguments here */
	int			keyarg;			/* the argument it routes by */
	/* deferred work: for the server at this address (see RlDeferred) */
	char		host[RL_ADDRESS_LEN];
	int			port;
	uint8		flags;
	size_t		script_len;
	uint64		script_hash;
	int			nargs;
	int			request_len;
	char		request[RL_ENTRY_REQUEST];	/* (uint32 length, bytes) each */
	/* the result */
	bool		failed;
	bool		sent;			/* of a failed call: it may have reached Redis */
	RlFailure	failure;
	int			reply_len;
	char		reply[RL_ENTRY_REPLY];	/* in the Redis protocol */
} RlEntry;

/*
 * The queue. The worker's fields are read without a lock by every call:
 * worker_gen is 0 while no worker runs, else the number of the one
 * running; worker_proc and worker_settings are written before it.
 */
typedef struct RlQueue
{
	pg_atomic_uint64 worker_gen;	/* 0: no worker runs */
	pg_atomic_uint32 worker_claimed;	/* a worker process serves the queue */
	pg_atomic_uint64 workers_started;
	pg_atomic_uint64 worker_settings;	/* hash of its connection settings */
	PGPROC	   *worker_proc;
	int			nentries;
	RlEntry		entries[FLEXIBLE_ARRAY_MEMBER];
} RlQueue;

/*
 * What the main shared memory holds (the library preloaded): the handle of
 * the queue's segment, which the worker makes as it starts, and whether a
 * worker was registered; the lock is taken to change them.
 */
typedef struct RlQueueControl
{
	LWLock	   *lock;
	dsm_handle	handle;			/* DSM_HANDLE_INVALID: not made yet */
	bool		worker_registered;	/* the postmaster starts (or runs) one */
	TimestampTz register_failed;	/* when registering it last failed */
} RlQueueControl;

/* how long after a failed registration of the worker no call tries again */
#define RL_REGISTER_RETRY_MS 10000

/* the worker was registered with the server (set in the postmaster) */
static bool worker_at_start = false;

static RlQueueControl *control = NULL;

/* the queue, once this process mapped it (rl_queue_attach) */
static RlQueue *queue = NULL;

/* this process is the worker: its own calls never go through the queue */
static bool am_worker = false;

/* a call this session gave up was still with the worker (rl_shared_settled) */
static bool gave_up_taken = false;

/* the entry this session waits on, for its exit (a FATAL skips PG_CATCH) */
static RlEntry *waiting_entry = NULL;
static bool exit_registered = false;

/* what this session logged once */
static bool full_logged = false;
static bool no_worker_logged = false;
static bool large_logged = false;

static shmem_request_hook_type prev_shmem_request_hook = NULL;
static shmem_startup_hook_type prev_shmem_startup_hook = NULL;

/* The size of the queue's segment. */
static Size
rl_queue_size(void)
{
	return add_size(offsetof(RlQueue, entries),
					mul_size(sizeof(RlEntry), rl_shared_queue_size));
}

/* Asks the postmaster for the queue's handle and lock in shared memory. */
static void
rl_queue_shmem_request(void)
{
	if (prev_shmem_request_hook)
		prev_shmem_request_hook();
	RequestAddinShmemSpace(MAXALIGN(sizeof(RlQueueControl)));
	RequestNamedLWLockTranche("rl_redis shared queue", 1);
}

/*
 * Makes (or attaches to) the queue's handle, at server start and after a
 * crash; no queue is made yet.
 */
static void
rl_queue_shmem_startup(void)
{
	bool		found;

	if (prev_shmem_startup_hook)
		prev_shmem_startup_hook();
	LWLockAcquire(AddinShmemInitLock, LW_EXCLUSIVE);
	control = ShmemInitStruct("rl_redis shared queue", sizeof(RlQueueControl),
							  &found);
	if (!found)
	{
		control->lock = &(GetNamedLWLockTranche("rl_redis shared queue"))->lock;
		control->handle = DSM_HANDLE_INVALID;
		control->worker_registered = worker_at_start;
		control->register_failed = 0;
	}
	LWLockRelease(AddinShmemInitLock);
}

/*
 * Registers the worker with the postmaster: at server start (from
 * _PG_init), or later (dynamic) from a session; restarted
 * rl_redis.worker_restart_interval after it exits with an error. False when
 * no background worker slot is free (later only).
 */
static bool
rl_register_worker(bool at_start)
{
	BackgroundWorker worker;

	memset(&worker, 0, sizeof(worker));
	worker.bgw_flags = BGWORKER_SHMEM_ACCESS;
	worker.bgw_start_time = BgWorkerStart_PostmasterStart;
	worker.bgw_restart_time = rl_worker_restart_interval;
	snprintf(worker.bgw_library_name, BGW_MAXLEN, "rl_redis");
	snprintf(worker.bgw_function_name, BGW_MAXLEN, "rl_worker_main");
	snprintf(worker.bgw_name, BGW_MAXLEN, "rl_redis worker");
	snprintf(worker.bgw_type, BGW_MAXLEN, "rl_redis worker");
	if (!at_start)
		return RegisterDynamicBackgroundWorker(&worker, NULL);
	RegisterBackgroundWorker(&worker);
	return true;
}

/*
 * Installs the shared-memory hooks when the library is being preloaded,
 * and registers the worker, which makes the queue as it starts, when the
 * configuration files set rl_redis.transport = shared for the whole server
 * (in standalone mode: the only one the shared transport serves); else the
 * first call under the shared transport registers it (rl_queue_start_worker).
 */
void
rl_shared_queue_init(void)
{
	if (!process_shared_preload_libraries_in_progress)
		return;
	prev_shmem_request_hook = shmem_request_hook;
	shmem_request_hook = rl_queue_shmem_request;
	prev_shmem_startup_hook = shmem_startup_hook;
	shmem_startup_hook = rl_queue_shmem_startup;
	if (rl_transport == RL_TRANSPORT_SHARED && rl_mode == RL_MODE_STANDALONE)
		worker_at_start = rl_register_worker(true);
}

/* Fills a new queue: every entry free, no worker. */
static void
rl_queue_fill(RlQueue *q)
{
	int			i;

	memset(q, 0, rl_queue_size());
	pg_atomic_init_u64(&q->worker_gen, 0);
	pg_atomic_init_u64(&q->workers_started, 0);
	pg_atomic_init_u64(&q->worker_settings, 0);
	pg_atomic_init_u32(&q->worker_claimed, 0);
	q->nentries = rl_shared_queue_size;
	for (i = 0; i < q->nentries; i++)
	{
		SpinLockInit(&q->entries[i].mutex);
		q->entries[i].state = RL_ENTRY_FREE;
	}
}

/*
 * Maps the queue into this process for the rest of its life; make is the
 * worker's: it makes the queue when none was made since the server started
 * (its segment stays until the server stops or restarts after a crash).
 * False when there is none (the library not preloaded, the queue not made
 * yet, or no segment left). Only a call and the worker's start come here: a
 * transaction end uses the queue only when its session mapped it before.
 * Raises when the segment cannot be made or mapped (no memory): a session
 * only maps a segment the worker made.
 */
static bool
rl_queue_attach(bool make)
{
	dsm_segment *seg = NULL;

	if (queue != NULL)
		return true;
	/* (read unlocked: a call does not wait on the lock while none is made) */
	if (control == NULL || (!make && control->handle == DSM_HANDLE_INVALID))
		return false;
	LWLockAcquire(control->lock, LW_EXCLUSIVE);
	if (control->handle != DSM_HANDLE_INVALID)
		seg = dsm_attach(control->handle);
	else if (make)
	{
		seg = dsm_create(rl_queue_size(), DSM_CREATE_NULL_IF_MAXSEGMENTS);
		if (seg != NULL)
		{
			rl_queue_fill(dsm_segment_address(seg));
			dsm_pin_segment(seg);
			control->handle = dsm_segment_handle(seg);
		}
	}
	if (seg != NULL)
	{
		dsm_pin_mapping(seg);
		queue = dsm_segment_address(seg);
	}
	LWLockRelease(control->lock);
	return queue != NULL;
}

/*
 * Asks the postmaster to start the worker, which makes the queue: the
 * first call under the shared transport of a server that did not start it
 * with itself (see rl_shared_queue_init) does; until it runs, calls use
 * their session's own connection. When no background worker slot is free,
 * says so with a hint, and no call tries again for RL_REGISTER_RETRY_MS.
 * True when this call asked (or tried).
 */
static bool
rl_queue_start_worker(void)
{
	TimestampTz now = GetCurrentTimestamp();
	bool		asked;

	/* (read unlocked first: the calls while it starts take no lock) */
	if (control->worker_registered)
		return false;
	LWLockAcquire(control->lock, LW_EXCLUSIVE);
	asked = control->worker_registered ||
		(control->register_failed != 0 &&
		 !TimestampDifferenceExceeds(control->register_failed, now,
									 RL_REGISTER_RETRY_MS));
	control->worker_registered = true;
	LWLockRelease(control->lock);
	if (asked)
		return false;

	if (rl_register_worker(false))
	{
		ereport(LOG,
				(errmsg("rl_redis: starting the rl_redis worker for rl_redis.transport = shared; this session's calls use its own connection until it runs")));
		return true;
	}

	LWLockAcquire(control->lock, LW_EXCLUSIVE);
	control->worker_registered = false;
	control->register_failed = now;
	LWLockRelease(control->lock);
	ereport(LOG,
			(errmsg("rl_redis: could not start the rl_redis worker: no background worker slot is free; this session's calls use its own connection"),
			 errhint("Raise max_worker_processes.")));
	return true;
}

/*
 * The worker running now (*gen its number, *settings the hash of its
 * connection settings, *proc its process): false when none runs.
 */
static bool
rl_worker_running(uint64 *gen, uint64 *settings, PGPROC **proc)
{
	*gen = pg_atomic_read_u64(&queue->worker_gen);
	if (*gen == 0)
		return false;
	pg_read_barrier();
	*settings = pg_atomic_read_u64(&queue->worker_settings);
	*proc = queue->worker_proc;
	return true;
}

/* Claims a free entry (state FILLING, owner this session), or NULL. */
static RlEntry *
rl_claim_entry(void)
{
	int			start = rl_my_proc_number() % queue->nentries;
	int			i;

	for (i = 0; i < queue->nentries; i++)
	{
		RlEntry	   *entry = &queue->entries[(start + i) % queue->nentries];

		/* a racy look first, the lock only for a likely one */
		if (entry->state != RL_ENTRY_FREE)
			continue;
		SpinLockAcquire(&entry->mutex);
		if (entry->state == RL_ENTRY_FREE)
		{
			entry->state = RL_ENTRY_FILLING;
			entry->owner = MyProc;
			entry->deferred = false;
			entry->waiter = false;
			SpinLockRelease(&entry->mutex);
			return entry;
		}
		SpinLockRelease(&entry->mutex);
	}
	return NULL;
}

/*
 * The session stops waiting on entry: a call not taken yet, or a result
 * nobody will read, frees it; a call on its way is left to the worker,
 * which frees it when its reply comes. True when the worker had taken the
 * call (it may have reached Redis).
 */
static bool
rl_give_up_entry(RlEntry *entry)
{
	RlEntryState state;

	SpinLockAcquire(&entry->mutex);
	state = entry->state;
	if (state == RL_ENTRY_QUEUED || state == RL_ENTRY_DONE ||
		state == RL_ENTRY_FILLING)
		entry->state = RL_ENTRY_FREE;
	else if (state == RL_ENTRY_TAKEN)
	{
		entry->state = RL_ENTRY_ABANDONED;
		gave_up_taken = true;
	}
	SpinLockRelease(&entry->mutex);
	waiting_entry = NULL;
	return state == RL_ENTRY_TAKEN || state == RL_ENTRY_DONE;
}

/*
 * Waits until no call this session gave up is still on its way through the
 * worker (an entry ABANDONED, which the worker frees when the call is done),
 * or deadline passes (0: none); true when none is. What undoes such a call
 * (a slot release) and goes on another connection must not overtake it.
 * Interrupts are served here, unless held (a transaction end: the deadline
 * bounds it then).
 */
bool
rl_shared_settled(TimestampTz deadline)
{
	while (gave_up_taken)
	{
		bool		busy = false;
		long		left = RL_WORKER_CHECK_MS;
		int			i;

		for (i = 0; i < queue->nentries && !busy; i++)
		{
			RlEntry	   *entry = &queue->entries[i];

			SpinLockAcquire(&entry->mutex);
			busy = entry->owner == MyProc && entry->state == RL_ENTRY_ABANDONED;
			SpinLockRelease(&entry->mutex);
		}
		if (!busy)
		{
			gave_up_taken = false;
			break;
		}
		if (deadline != 0)
		{
			left = TimestampDifferenceMilliseconds(GetCurrentTimestamp(), deadline);
			if (left <= 0)
				return false;
		}
		(void) WaitLatch(MyLatch, WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
						 Min(left, RL_WORKER_CHECK_MS), PG_WAIT_EXTENSION);
		ResetLatch(MyLatch);
		CHECK_FOR_INTERRUPTS();
	}
	return true;
}

/* Frees a deferred entry (under its lock): no session's any more. */
static void
rl_free_deferred(RlEntry *entry)
{
	entry->state = RL_ENTRY_FREE;
	entry->deferred = false;
	entry->waiter = false;
	entry->owner = NULL;
}

/*
 * The session stops waiting for its deferred work: done entries are freed,
 * the others the worker frees when it is done with them.
 */
static void
rl_give_up_deferred(void)
{
	int			i;

	if (queue == NULL)
		return;
	for (i = 0; i < queue->nentries; i++)
	{
		RlEntry	   *entry = &queue->entries[i];

		if (entry->owner != MyProc || !entry->deferred)
			continue;
		SpinLockAcquire(&entry->mutex);
		if (entry->owner == MyProc && entry->deferred && entry->waiter)
		{
			if (entry->state == RL_ENTRY_DONE)
				rl_free_deferred(entry);
			else
				entry->waiter = false;
		}
		SpinLockRelease(&entry->mutex);
	}
}

/* At the session's exit: the entries it waited on are given up. */
static void
rl_shared_session_exit(int code, Datum arg)
{
	if (waiting_entry != NULL)
		rl_give_up_entry(waiting_entry);
	rl_give_up_deferred();
}

/* Makes the session's exit give up its entries (once per session). */
static void
rl_register_session_exit(void)
{
	if (exit_registered)
		return;
	before_shmem_exit(rl_shared_session_exit, (Datum) 0);
	exit_registered = true;
}

/* Gives a claimed entry back unused. */
static void
rl_release_entry(RlEntry *entry)
{
	SpinLockAcquire(&entry->mutex);
	entry->state = RL_ENTRY_FREE;
	SpinLockRelease(&entry->mutex);
	if (entry == waiting_entry)
		waiting_entry = NULL;
}

/* Marks a filled entry queued (or deferred) and wakes the worker. */
static void
rl_enqueue(RlEntry *entry, RlEntryState state, PGPROC *worker)
{
	SpinLockAcquire(&entry->mutex);
	entry->failed = false;
	entry->reply_len = 0;
	entry->state = state;
	SpinLockRelease(&entry->mutex);
	SetLatch(&worker->procLatch);
}

/*
 * True when the worker serves this session's calls: rl_redis.transport is
 * shared, in standalone mode (the only one it serves).
 */
static bool
rl_worker_serves(void)
{
	return rl_transport == RL_TRANSPORT_SHARED && rl_topology()->one_server;
}

/*
 * Which transport carries a call, decided here for every caller: true when
 * the shared worker does, false when the session's own connection does.
 * With script, for that call with argv (argv[RL_SCRIPT_ARGV_RESERVED..]:
 * numkeys, keys, arguments), whose reply must surely fit an entry, which
 * the worker can only learn once the call has run: the scripts of one
 * decision, of a concurrency slot and of a denial count, and the
 * several-limits script of at most RL_SHARED_MANY_KEYS keys. The others (a
 * statement guard over many keys, rl_top_denied) go on the session's own
 * connection. Without script (NULL), for the transaction-end work of a
 * session that has no connection of its own open. The worker may still
 * turn a call back (rl_shared_call, rl_shared_defer): see the file's
 * header. Does no I/O.
 */
bool
rl_worker_takes(const RlScript *script, const char **argv)
{
	if (!rl_worker_serves())
		return false;
	if (script == NULL || script->id < RL_NUM_ALGORITHMS ||
		script == &rl_script_concurrency || script == &rl_script_denial_note)
		return true;
	return script == &rl_script_check_all &&
		atoi(argv[RL_SCRIPT_ARGV_RESERVED]) <= RL_SHARED_MANY_KEYS;
}

/*
 * The most bytes a call queued now for a transaction end on conn (the
 * connection its key routes to, NULL when none is known yet) may take, so
 * that the worker can carry it when the session has no connection of its
 * own open then (a call too large for an entry would wait for a connection
 * the session may never open); 0 when there is no such bound, as when the
 * worker never carries transaction-end work (rl_worker_serves: Cluster and
 * Sentinel modes). Does no I/O.
 */
size_t
rl_worker_request_max(RlConn *conn)
{
	if (rl_worker_serves() && (conn == NULL || !rl_conn_ready(conn)))
		return RL_ENTRY_REQUEST;
	return 0;
}

/*
 * True when a call may go through the worker now: it serves this session
 * (rl_worker_serves), the queue exists, a worker runs with the same
 * connection settings as this session (settings: their hash,
 * rl_settings_hash).
 */
static bool
rl_shared_usable(uint64 settings, uint64 *gen, PGPROC **worker)
{
	uint64		worker_settings;

	if (!rl_worker_serves() || queue == NULL || am_worker)
		return false;
	if (!rl_worker_running(gen, &worker_settings, worker))
		return false;
	return worker_settings == settings;
}

/*
 * Writes the arguments argv[from..argc-1] into entry as (length, bytes)
 * each; false when they do not fit.
 */
static bool
rl_entry_write_args(RlEntry *entry, int from, int argc, const char **argv,
				   const size_t *argvlen)
{
	size_t		len = 0;
	int			i;

	for (i = from; i < argc; i++)
	{
		uint32		n = (uint32) argvlen[i];

		if (len + sizeof(uint32) + argvlen[i] > RL_ENTRY_REQUEST)
			return false;
		memcpy(entry->request + len, &n, sizeof(uint32));
		memcpy(entry->request + len + sizeof(uint32), argv[i], argvlen[i]);
		len += sizeof(uint32) + argvlen[i];
	}
	entry->request_len = (int) len;
	entry->argc = argc - from;
	return true;
}

/* How a session's wait for its entry ended. */
typedef enum RlWaitEnd
{
	RL_WAIT_DONE,				/* the entry holds the result */
	RL_WAIT_NOT_SENT,			/* the worker left: the session sends it */
	RL_WAIT_TIMED_OUT,			/* the entry was given up, the call taken */
	RL_WAIT_TIMED_OUT_UNSENT	/* the entry was given up, never taken */
} RlWaitEnd;

/*
 * Waits until the worker (number gen) has put the result of the call in
 * entry, or the deadline passes, or the worker is gone before taking it.
 * Interrupts are served (and raise) here.
 */
static RlWaitEnd
rl_shared_wait(RlEntry *entry, uint64 gen, TimestampTz deadline)
{
	for (;;)
	{
		RlEntryState state;
		uint64		now_gen;
		uint64		now_settings;
		PGPROC	   *now_worker;
		long		left;

		SpinLockAcquire(&entry->mutex);
		state = entry->state;
		SpinLockRelease(&entry->mutex);
		if (state == RL_ENTRY_DONE)
			return RL_WAIT_DONE;

		/*
		 * The worker that was to send it is gone: not taken yet, the
		 * session sends it itself; taken, the exiting worker fails it (or
		 * a new one took it), and the wait goes on.
		 */
		if (!rl_worker_running(&now_gen, &now_settings, &now_worker) ||
			now_gen != gen)
		{
			SpinLockAcquire(&entry->mutex);
			state = entry->state;
			if (state == RL_ENTRY_QUEUED)
				entry->state = RL_ENTRY_FREE;
			SpinLockRelease(&entry->mutex);
			if (state == RL_ENTRY_QUEUED)
				return RL_WAIT_NOT_SENT;
			if (state == RL_ENTRY_DONE)
				return RL_WAIT_DONE;
			if (now_gen != 0)
				gen = now_gen;
		}

		left = TimestampDifferenceMilliseconds(GetCurrentTimestamp(), deadline);
		if (left <= 0)
		{
			SpinLockAcquire(&entry->mutex);
			state = entry->state;
			SpinLockRelease(&entry->mutex);
			if (state == RL_ENTRY_DONE)
				return RL_WAIT_DONE;
			return rl_give_up_entry(entry) ? RL_WAIT_TIMED_OUT :
				RL_WAIT_TIMED_OUT_UNSENT;
		}
		(void) WaitLatch(MyLatch, WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
						 Min(left, RL_WORKER_CHECK_MS), PG_WAIT_EXTENSION);
		ResetLatch(MyLatch);
		CHECK_FOR_INTERRUPTS();
	}
}

/*
 * Sends a script call through the worker and returns its reply (the caller
 * frees it with freeReplyObject; it may be an error reply), or NULL with
 * failure filled in. argv[RL_SCRIPT_ARGV_RESERVED..argc-1] are the
 * script's numkeys, keys and arguments; argv[keyarg] the key it routes by.
 * *used is false (and nothing sent) when the call must go on the session's
 * own connection instead: see the file's header; settings is the hash of
 * this session's connection settings. The call is accounted to own, the
 * session's connection to the server: whether it may have reached Redis
 * (the worker took it, and did not report that it never sent it) is noted
 * there (rl_conn_note_sent), also when an error ends the wait. The wait ends at the latest after connect_timeout
 * plus command_timeout; an interrupt (cancel, statement_timeout) raises its
 * error from inside, and the reply of that call is then dropped by the
 * worker.
 */
redisReply *
rl_shared_call(RlConn *own, const RlScript *script, int argc,
			   const char **argv, const size_t *argvlen, int keyarg,
			   uint64 settings, RlFailure *failure, bool *used)
{
	RlEntry	   *entry;
	PGPROC	   *worker;
	uint64		gen;
	int			wait_ms = rl_connect_timeout +
		(rl_command_timeout > 0 ? rl_command_timeout : 60000);
	TimestampTz deadline;
	volatile RlWaitEnd end = RL_WAIT_TIMED_OUT;
	redisReader *reader;
	void	   *reply = NULL;

	*used = false;
	/* own's transaction-end work goes first, on own */
	if (rl_conn_has_queued(own))
		return NULL;
	if (rl_worker_serves() && !am_worker)
		(void) rl_queue_attach(false);
	if (!rl_shared_usable(settings, &gen, &worker))
	{
		/* the first call starts the worker; one that should run and does
		 * not is said once per session */
		if (rl_worker_serves() && control != NULL && !am_worker &&
			(queue == NULL || pg_atomic_read_u64(&queue->worker_gen) == 0) &&
			rl_queue_start_worker())
			no_worker_logged = true;
		else if (rl_transport == RL_TRANSPORT_SHARED && queue != NULL && !am_worker &&
				 pg_atomic_read_u64(&queue->worker_gen) == 0 && !no_worker_logged)
		{
			ereport(LOG,
					(errmsg("rl_redis: the rl_redis worker is not running; this session's calls use its own connection meanwhile")));
			no_worker_logged = true;
		}
		return NULL;
	}
	no_worker_logged = false;
	rl_register_session_exit();
	entry = rl_claim_entry();
	waiting_entry = entry;
	if (entry == NULL)
	{
		if (!full_logged)
			ereport(LOG,
					(errmsg("rl_redis: the shared queue is full; this session's calls use its own connection meanwhile"),
					 errhint("Raise rl_redis.shared_queue_size (now %d).",
							 rl_shared_queue_size)));
		full_logged = true;
		return NULL;
	}
	entry->script_id = script->id;
	entry->keyarg = keyarg - RL_SCRIPT_ARGV_RESERVED;
	if (!rl_entry_write_args(entry, RL_SCRIPT_ARGV_RESERVED, argc, argv, argvlen))
	{
		rl_release_entry(entry);
		if (!large_logged)
			ereport(LOG,
					(errmsg("rl_redis: a call larger than %d bytes uses the session's own connection",
							RL_ENTRY_REQUEST)));
		large_logged = true;
		return NULL;
	}
	rl_enqueue(entry, RL_ENTRY_QUEUED, worker);
	/* the worker may take it from here on (a FATAL leaves this standing) */
	rl_conn_note_sent(own, true);

	deadline = TimestampTzPlusMilliseconds(GetCurrentTimestamp(), wait_ms);
	PG_TRY();
	{
		end = rl_shared_wait(entry, gen, deadline);
	}
	PG_CATCH();
	{
		/* an interrupt: the reply, if it comes, is not ours to read */
		rl_conn_note_sent(own, rl_give_up_entry(entry));
		PG_RE_THROW();
	}
	PG_END_TRY();

	if (end == RL_WAIT_NOT_SENT)
	{
		waiting_entry = NULL;	/* freed by rl_shared_wait */
		rl_conn_note_sent(own, false);
		return NULL;			/* *used false: the session sends it */
	}
	*used = true;
	if (end != RL_WAIT_DONE)
	{
		/* given up by rl_shared_wait */
		rl_conn_note_sent(own, end == RL_WAIT_TIMED_OUT);
		rl_fail(failure, RL_FAILURE_TIMEOUT, ERRCODE_CONNECTION_FAILURE,
				RL_HINT_COMMAND_TIMEOUT, NULL,
				"timed out after %d ms waiting for the rl_redis worker's reply from Redis",
				wait_ms);
		return NULL;
	}

	/* DONE: the entry is ours until it is freed */
	if (entry->failed)
	{
		/* whether the worker sent it (not when it could not connect) */
		rl_conn_note_sent(own, entry->sent);
		*failure = entry->failure;
		rl_release_entry(entry);
		return NULL;
	}
	reader = redisReaderCreate();
	if (reader == NULL ||
		redisReaderFeed(reader, entry->reply, entry->reply_len) != REDIS_OK ||
		redisReaderGetReply(reader, &reply) != REDIS_OK || reply == NULL)
	{
		if (reply != NULL)
			freeReplyObject(reply);
		reply = NULL;
		rl_fail(failure, RL_FAILURE_PROTOCOL, ERRCODE_PROTOCOL_VIOLATION,
				RL_HINT_NONE, NULL, "invalid reply from the rl_redis worker");
	}
	if (reader != NULL)
		redisReaderFree(reader);
	rl_release_entry(entry);
	return (redisReply *) reply;
}

/*
 * Hands work of a transaction end (one command, for the server at
 * work->host:port) to the worker, which sends it on its own connection;
 * true when it was taken (rl_shared_defer_wait then waits for it). Never
 * waits and never raises: for transaction ends.
 */
bool
rl_shared_defer(const RlDeferred *work, uint64 settings)
{
	RlEntry	   *entry;
	PGPROC	   *worker;
	uint64		gen;

	if (!rl_shared_usable(settings, &gen, &worker) ||
		work->len > RL_ENTRY_REQUEST || strlen(work->host) >= RL_ADDRESS_LEN)
		return false;
	rl_register_session_exit();
	entry = rl_claim_entry();
	if (entry == NULL)
		return false;
	entry->deferred = true;
	entry->waiter = true;
	strlcpy(entry->host, work->host, RL_ADDRESS_LEN);
	entry->port = work->port;
	entry->flags = work->flags;
	entry->script_len = work->script_len;
	entry->script_hash = work->script_hash;
	entry->nargs = work->nargs;
	memcpy(entry->request, work->encoded, work->len);
	entry->request_len = (int) work->len;
	entry->argc = 0;
	rl_enqueue(entry, RL_ENTRY_DEFERRED, worker);
	return true;
}

/*
 * Waits until the worker has sent the work this session handed over
 * (rl_shared_defer) and read its replies, or the deadline passes (then the
 * worker finishes it alone). For transaction ends: interrupts may be held,
 * so the deadline is the only bound; never raises.
 */
void
rl_shared_defer_wait(TimestampTz deadline)
{
	if (queue == NULL)
		return;
	for (;;)
	{
		int			pending = 0;
		int			i;
		long		left;

		for (i = 0; i < queue->nentries; i++)
		{
			RlEntry	   *entry = &queue->entries[i];

			if (entry->owner != MyProc || !entry->deferred)
				continue;
			SpinLockAcquire(&entry->mutex);
			if (entry->owner == MyProc && entry->deferred && entry->waiter &&
				entry->state != RL_ENTRY_FREE)
			{
				if (entry->state == RL_ENTRY_DONE)
					rl_free_deferred(entry);
				else
					pending++;
			}
			SpinLockRelease(&entry->mutex);
		}
		if (pending == 0)
			return;
		left = TimestampDifferenceMilliseconds(GetCurrentTimestamp(), deadline);
		if (left <= 0)
		{
			rl_give_up_deferred();
			return;
		}
		(void) WaitLatch(MyLatch, WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
						 left, PG_WAIT_EXTENSION);
		ResetLatch(MyLatch);
	}
}

/*
 * The worker starts: maps the queue (making it, the first time after a
 * server start or crash), records its process and connection settings
 * (rl_settings_hash), then its number, which tells the sessions it runs.
 * False when another worker serves the queue already (after a crash, the
 * postmaster restarts a worker that a session registered, and a session
 * may have registered another meanwhile).
 */
bool
rl_shared_worker_start(uint64 settings)
{
	uint32		unclaimed = 0;

	if (!rl_queue_attach(true))
		ereport(ERROR,
				(errcode(ERRCODE_INSUFFICIENT_RESOURCES),
				 errmsg("could not make the rl_redis shared queue: too many dynamic shared memory segments")));
	LWLockAcquire(control->lock, LW_EXCLUSIVE);
	control->worker_registered = true;
	LWLockRelease(control->lock);
	if (!pg_atomic_compare_exchange_u32(&queue->worker_claimed, &unclaimed, 1))
		return false;
	am_worker = true;
	queue->worker_proc = MyProc;
	pg_atomic_write_u64(&queue->worker_settings, settings);
	pg_write_barrier();
	pg_atomic_write_u64(&queue->worker_gen,
						pg_atomic_add_fetch_u64(&queue->workers_started, 1));
	return true;
}

/* The worker's connection settings changed (a reload). */
void
rl_shared_worker_settings(uint64 settings)
{
	pg_atomic_write_u64(&queue->worker_settings, settings);
}

/*
 * The worker exits: no session sends it more, and the calls it took fail
 * (they may have run: never sent again). Runs from an exit callback.
 */
void
rl_shared_worker_stop(void)
{
	int			i;

	if (!am_worker)
		return;
	pg_atomic_write_u64(&queue->worker_gen, 0);
	for (i = 0; i < queue->nentries; i++)
	{
		RlEntry	   *entry = &queue->entries[i];
		PGPROC	   *owner = NULL;

		SpinLockAcquire(&entry->mutex);
		if (entry->state == RL_ENTRY_TAKEN && entry->deferred)
		{
			/* its work is in the worker's queue, sent as the worker exits */
			if (entry->waiter)
			{
				entry->state = RL_ENTRY_DONE;
				owner = entry->owner;
			}
			else
				rl_free_deferred(entry);
		}
		else if (entry->state == RL_ENTRY_TAKEN)
		{
			entry->failed = true;
			entry->sent = true;
			rl_fail(&entry->failure, RL_FAILURE_WORKER,
					ERRCODE_CONNECTION_FAILURE, RL_HINT_NONE, NULL,
					"the rl_redis worker exited while a call to Redis was on its way; it may have been applied");
			entry->state = RL_ENTRY_DONE;
			owner = entry->owner;
		}
		else if (entry->state == RL_ENTRY_ABANDONED)
		{
			entry->state = RL_ENTRY_FREE;
			owner = entry->owner;	/* it may wait in rl_shared_settled */
		}
		SpinLockRelease(&entry->mutex);
		if (owner != NULL)
			SetLatch(&owner->procLatch);
	}
	pg_atomic_write_u32(&queue->worker_claimed, 0);
}

/* The number of entries, for the worker's arrays. */
int
rl_shared_entries(void)
{
	return queue ? queue->nentries : 0;
}

/*
 * The worker takes the entry i when it is queued or deferred (state TAKEN):
 * a call is copied into *call (its arguments palloc'd, argv[0..1] left for
 * the script, whose id is put in *script_id) and 1 returned; deferred work
 * is copied into *work (host and encoded palloc'd) and 2 returned (the
 * worker calls rl_shared_deferred_done once it is sent); 0 when there is
 * nothing to take.
 */
int
rl_shared_take(int i, RlCall *call, int *script_id, RlDeferred *work)
{
	RlEntry	   *entry = &queue->entries[i];
	RlEntryState state = entry->state;
	int			argc;
	const char **argv;
	size_t	   *argvlen;
	char	   *copy;
	size_t		off = 0;
	int			k;

	/* a racy look first */
	if (state != RL_ENTRY_QUEUED && state != RL_ENTRY_DEFERRED)
		return 0;
	SpinLockAcquire(&entry->mutex);
	state = entry->state;
	if (state == RL_ENTRY_QUEUED || state == RL_ENTRY_DEFERRED)
		entry->state = RL_ENTRY_TAKEN;
	SpinLockRelease(&entry->mutex);

	/* TAKEN: the session no longer writes it */
	if (state == RL_ENTRY_DEFERRED)
	{
		work->host = pstrdup(entry->host);
		work->port = entry->port;
		work->flags = entry->flags;
		work->script_len = entry->script_len;
		work->script_hash = entry->script_hash;
		work->nargs = entry->nargs;
		work->len = entry->request_len;
		copy = palloc(Max(work->len, 1));
		memcpy(copy, entry->request, work->len);
		work->encoded = copy;
		return 2;
	}
	if (state != RL_ENTRY_QUEUED)
		return 0;

	argc = RL_SCRIPT_ARGV_RESERVED + entry->argc;
	argv = palloc(sizeof(char *) * argc);
	argvlen = palloc(sizeof(size_t) * argc);
	copy = palloc(Max(entry->request_len, 1));
	memcpy(copy, entry->request, entry->request_len);
	for (k = RL_SCRIPT_ARGV_RESERVED; k < argc; k++)
	{
		uint32		n;

		memcpy(&n, copy + off, sizeof(uint32));
		argv[k] = copy + off + sizeof(uint32);
		argvlen[k] = n;
		off += sizeof(uint32) + n;
	}
	memset(call, 0, sizeof(RlCall));
	*script_id = entry->script_id;
	call->argc = argc;
	call->argv = argv;
	call->argvlen = argvlen;
	call->key = argv[RL_SCRIPT_ARGV_RESERVED + entry->keyarg];
	call->keylen = argvlen[RL_SCRIPT_ARGV_RESERVED + entry->keyarg];
	return 1;
}

/*
 * The worker sent the deferred work it took from entry i (and read its
 * replies, when Redis answered): its session, if it still waits, is told.
 */
void
rl_shared_deferred_done(int i)
{
	RlEntry	   *entry = &queue->entries[i];
	PGPROC	   *owner = NULL;

	SpinLockAcquire(&entry->mutex);
	if (entry->state == RL_ENTRY_TAKEN && entry->waiter)
	{
		entry->state = RL_ENTRY_DONE;
		owner = entry->owner;
	}
	else if (entry->state == RL_ENTRY_TAKEN)
		rl_free_deferred(entry);
	SpinLockRelease(&entry->mutex);
	if (owner != NULL)
		SetLatch(&owner->procLatch);
}

/* Appends reply, encoded in the Redis protocol, to buf. */
static void
rl_encode_reply(StringInfo buf, const redisReply *reply)
{
	size_t		i;

	switch (reply->type)
	{
		case REDIS_REPLY_INTEGER:
			appendStringInfo(buf, ":%lld\r\n", (long long) reply->integer);
			break;
		case REDIS_REPLY_STRING:
			appendStringInfo(buf, "$%zu\r\n", reply->len);
			appendBinaryStringInfo(buf, reply->str, reply->len);
			appendBinaryStringInfo(buf, "\r\n", 2);
			break;
		case REDIS_REPLY_STATUS:
		case REDIS_REPLY_ERROR:
			/* one line: a CR or LF inside would end it early */
			appendStringInfoChar(buf, reply->type == REDIS_REPLY_ERROR ? '-' : '+');
			for (i = 0; i < reply->len; i++)
				appendStringInfoChar(buf, (reply->str[i] == '\r' || reply->str[i] == '\n') ?
									 ' ' : reply->str[i]);
			appendBinaryStringInfo(buf, "\r\n", 2);
			break;
		case REDIS_REPLY_ARRAY:
			appendStringInfo(buf, "*%zu\r\n", reply->elements);
			for (i = 0; i < reply->elements; i++)
				rl_encode_reply(buf, reply->element[i]);
			break;
		default:
			appendStringInfoString(buf, "$-1\r\n");
			break;
	}
}

/*
 * The worker hands back the result of the call it took from entry i: the
 * reply (not freed here), or the failure when reply is NULL, and whether
 * the call may have reached Redis (sent); the session is woken. A session
 * that stopped waiting gets nothing: the entry is freed.
 */
void
rl_shared_complete(int i, const redisReply *reply, const RlFailure *failure,
				   bool sent)
{
	RlEntry	   *entry = &queue->entries[i];
	StringInfoData buf;
	PGPROC	   *owner = NULL;

	/*
	 * A TAKEN or ABANDONED entry's result is the worker's to write: the
	 * session reads it only once it is DONE, and frees an ABANDONED one
	 * never.
	 */
	initStringInfo(&buf);
	if (reply != NULL)
		rl_encode_reply(&buf, reply);
	entry->failed = reply == NULL || buf.len > RL_ENTRY_REPLY;
	entry->sent = reply != NULL || sent;
	if (reply == NULL)
		entry->failure = *failure;
	else if (buf.len > RL_ENTRY_REPLY)
	{
		rl_fail(&entry->failure, RL_FAILURE_PROTOCOL,
				ERRCODE_PROTOCOL_VIOLATION, RL_HINT_NONE, NULL,
				"a reply of %d bytes from Redis does not fit the shared queue (%d)",
				buf.len, RL_ENTRY_REPLY);
	}
	else
	{
		memcpy(entry->reply, buf.data, buf.len);
		entry->reply_len = buf.len;
	}
	pfree(buf.data);

	SpinLockAcquire(&entry->mutex);
	if (entry->state == RL_ENTRY_ABANDONED)
	{
		entry->state = RL_ENTRY_FREE;
		owner = entry->owner;	/* it may wait in rl_shared_settled */
	}
	else if (entry->state == RL_ENTRY_TAKEN)
	{
		entry->state = RL_ENTRY_DONE;
		owner = entry->owner;
	}
	SpinLockRelease(&entry->mutex);
	if (owner != NULL)
		SetLatch(&owner->procLatch);
}
