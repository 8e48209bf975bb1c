/*
 * stats.c
 *	  Counters of the decisions, per database and policy (explicit-argument
 *	  calls grouped per algorithm), and the functions that show them.
 *
 * With the library in shared_preload_libraries the counters live in shared
 * memory, in a hash table of at most RL_STATS_MAX entries that is never
 * shrunk (a reset zeroes the counters), so that each backend keeps pointers
 * to the entries it uses and counts under the entry's spinlock, without any
 * lock on the table. Without preloading each backend counts for itself,
 * and rl_redis_stats says so (scope 'backend').
 *
 * A call is counted by the key it decided on (rl_parse_key): by its kind,
 * the algorithm (or "concurrency"), and its policy's name ("" for explicit
 * arguments). calls = allowed + denied + errors; an error that
 * rl_redis.on_error turned into a decision is also counted in
 * fallback_allow or fallback_deny. Peeks (calls of cost 0 and rl_inspect)
 * that Redis answered are counted apart, in peeks, not in calls.
 */
#include "postgres.h"

#include "funcapi.h"
#include "miscadmin.h"
#include "storage/ipc.h"
#include "storage/lwlock.h"
#include "storage/shmem.h"
#include "storage/spin.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/float.h"
#include "utils/hsearch.h"
#include "utils/memutils.h"

#include "rl_redis.h"

/* the most (database, policy) rows kept in shared memory */
#define RL_STATS_MAX 4096

/* upper bounds of the round-trip buckets, in µs (the last is +Inf) */
static const int64 rtt_bounds_us[RL_RTT_BUCKETS - 1] = {
	100, 250, 500, 1000, 2500, 5000, 10000, 25000, 50000, 100000, 250000,
	500000, 1000000, 2500000
};

/* The hash key of a row. */
typedef struct RlStatsKey
{
	Oid			dbid;
	char		kind[24];		/* the algorithm, or "concurrency" */
	char		name[64];		/* the policy; "" for explicit arguments */
} RlStatsKey;

/* A row: its key and its counters. */
typedef struct RlStatsEntry
{
	RlStatsKey	key;
	slock_t		mutex;			/* guards counters (shared memory only) */
	RlCounters	counters;
} RlStatsEntry;

/* this backend's pointer to a shared row */
typedef struct RlStatsRef
{
	RlStatsKey	key;
	RlStatsEntry *row;
} RlStatsRef;

/* shared memory: the table and the lock taken to add a row */
typedef struct RlStatsShared
{
	LWLock	   *lock;
	bool		full_warned;
} RlStatsShared;

static RlStatsShared *shared = NULL;
static HTAB *shared_rows = NULL;

/* this backend's rows (without preloading), or its pointers to shared rows */
static HTAB *local_rows = NULL;

static shmem_request_hook_type prev_shmem_request_hook = NULL;
static shmem_startup_hook_type prev_shmem_startup_hook = NULL;

/* Asks the postmaster for the shared memory and the lock. */
static void
rl_stats_shmem_request(void)
{
	if (prev_shmem_request_hook)
		prev_shmem_request_hook();
	RequestAddinShmemSpace(MAXALIGN(sizeof(RlStatsShared)) +
						   hash_estimate_size(RL_STATS_MAX, sizeof(RlStatsEntry)));
	RequestNamedLWLockTranche("rl_redis", 1);
}

/* Makes (or attaches to) the shared table. */
static void
rl_stats_shmem_startup(void)
{
	HASHCTL		info;
	bool		found;

	if (prev_shmem_startup_hook)
		prev_shmem_startup_hook();
	LWLockAcquire(AddinShmemInitLock, LW_EXCLUSIVE);
	shared = ShmemInitStruct("rl_redis stats", sizeof(RlStatsShared), &found);
	if (!found)
	{
		shared->lock = &(GetNamedLWLockTranche("rl_redis"))->lock;
		shared->full_warned = false;
	}
	info.keysize = sizeof(RlStatsKey);
	info.entrysize = sizeof(RlStatsEntry);
	shared_rows = ShmemInitHash("rl_redis stats rows", RL_STATS_MAX, RL_STATS_MAX,
								&info, HASH_ELEM | HASH_BLOBS | HASH_FIXED_SIZE);
	LWLockRelease(AddinShmemInitLock);
}

/* Installs the shared-memory hooks when the library is being preloaded. */
void
rl_stats_init(void)
{
	if (!process_shared_preload_libraries_in_progress)
		return;
	prev_shmem_request_hook = shmem_request_hook;
	shmem_request_hook = rl_stats_shmem_request;
	prev_shmem_startup_hook = shmem_startup_hook;
	shmem_startup_hook = rl_stats_shmem_startup;
}

/*
 * Fills k from a decision's key (rl_parse_key): false when the key is not
 * one of rl_redis's.
 */
static bool
rl_stats_key(const char *key, size_t len, RlStatsKey *k)
{
	RlKeyParts	parts;

	memset(k, 0, sizeof(*k));
	k->dbid = MyDatabaseId;
	if (!rl_parse_key(key, len, &parts))
		return false;
	strlcpy(k->kind, parts.kind, sizeof(k->kind));
	if (parts.policy != NULL && parts.policylen < sizeof(k->name))
		memcpy(k->name, parts.policy, parts.policylen);
	return true;
}

/*
 * Returns the counters of the row of key (made when new, if create), or
 * NULL when the statistics are off, the key is not one of ours, there is no
 * such row (and not create) or the shared table is full. The caller takes
 * the row's lock while counting (rl_stats_lock).
 */
static RlStatsEntry *
rl_stats_row(const char *key, size_t len, bool create)
{
	RlStatsKey	k;
	bool		found;
	bool		full = false;

	if (!rl_stats || !rl_stats_key(key, len, &k))
		return NULL;
	if (!create)
	{
		if (local_rows == NULL)
			return NULL;
		if (shared_rows == NULL)
			return hash_search(local_rows, &k, HASH_FIND, NULL);
		else
		{
			RlStatsRef *ref = hash_search(local_rows, &k, HASH_FIND, NULL);

			return ref ? ref->row : NULL;
		}
	}
	if (local_rows == NULL)
	{
		HASHCTL		ctl;

		ctl.keysize = sizeof(RlStatsKey);
		ctl.entrysize = shared_rows ? sizeof(RlStatsRef) : sizeof(RlStatsEntry);
		ctl.hcxt = TopMemoryContext;
		local_rows = hash_create("rl_redis stats", 64, &ctl,
								 HASH_ELEM | HASH_BLOBS | HASH_CONTEXT);
	}
	if (shared_rows == NULL)
	{
		RlStatsEntry *e = hash_search(local_rows, &k, HASH_ENTER, &found);

		if (!found)
			memset(&e->counters, 0, sizeof(e->counters));
		return e;
	}
	else
	{
		RlStatsRef *ref = hash_search(local_rows, &k, HASH_ENTER, &found);

		if (!found)
		{
			RlStatsEntry *e;

			ref->row = NULL;	/* until the shared row is known */
			LWLockAcquire(shared->lock, LW_EXCLUSIVE);
			e = hash_search(shared_rows, &k, HASH_ENTER_NULL, &found);
			if (e != NULL && !found)
			{
				SpinLockInit(&e->mutex);
				memset(&e->counters, 0, sizeof(e->counters));
			}
			if (e == NULL && !shared->full_warned)
				full = shared->full_warned = true;
			LWLockRelease(shared->lock);
			ref->row = e;
			if (full)
				ereport(WARNING,
						(errmsg("rl_redis statistics are full: %d rows of database and policy", RL_STATS_MAX),
						 errdetail("Calls of further policies are not counted until the server restarts.")));
		}
		return ref->row;
	}
}

/* Takes a row's lock (shared memory) so that its counters can be changed. */
static inline void
rl_stats_lock(RlStatsEntry *e)
{
	if (shared_rows != NULL)
		SpinLockAcquire(&e->mutex);
}

/* Releases what rl_stats_lock took. */
static inline void
rl_stats_unlock(RlStatsEntry *e)
{
	if (shared_rows != NULL)
		SpinLockRelease(&e->mutex);
}

/* The bucket of a round trip of rtt_us. */
static int
rl_rtt_bucket(int64 rtt_us)
{
	int			i;

	for (i = 0; i < RL_RTT_BUCKETS - 1; i++)
		if (rtt_us <= rtt_bounds_us[i])
			return i;
	return RL_RTT_BUCKETS - 1;
}

/*
 * Counts a call on key that Redis answered (d->from_redis) in rtt_us, or
 * that rl_redis.on_error decided after failure (counted by
 * rl_stats_failed): allowed or denied, the units taken (cost > 0, allowed
 * and not a shadow policy's denial) or given back (cost < 0), and whether
 * a shadow policy would have denied it; an answered call of cost 0 (a peek,
 * also a dry run's, whose callers pass 0) only as a peek.
 */
void
rl_stats_decided(const char *key, size_t len, const RlDecision *d,
				 int32 cost, int64 rtt_us)
{
	RlStatsEntry *e = rl_stats_row(key, len, true);
	int			bucket = rl_rtt_bucket(rtt_us);

	if (e == NULL)
		return;
	rl_stats_lock(e);
	if (!d->from_redis)
	{
		if (d->allowed)
			e->counters.fallback_allow++;
		else
			e->counters.fallback_deny++;
	}
	else if (cost == 0)
		e->counters.peeks++;
	else
	{
		e->counters.calls++;
		if (d->allowed)
		{
			e->counters.allowed++;
			if (cost > 0 && !d->shadow_denied)
				e->counters.units_taken += cost;
		}
		else
			e->counters.denied++;
		if (cost < 0)
			e->counters.units_refunded -= cost;
		/* a remembered denial made no round trip */
		if (!d->from_cache)
		{
			e->counters.rtt[bucket]++;
			e->counters.rtt_sum_us += rtt_us;
		}
	}
	/* a peek is no call, whatever a shadow policy would say of its cost */
	if (d->shadow_denied && !(d->from_redis && cost == 0))
		e->counters.shadow_denied++;
	rl_stats_unlock(e);
}

/*
 * Counts a call on key that failed, by the kind of failure: a timeout, an
 * error reply of Redis, a reply that is not what the script returns, and
 * all the others as no connection; and an outage that began with it (it
 * opened the circuit breaker).
 */
void
rl_stats_failed(const char *key, size_t len, const RlFailure *failure,
				bool count_outage)
{
	RlStatsEntry *e = rl_stats_row(key, len, true);

	if (e == NULL)
		return;
	rl_stats_lock(e);
	e->counters.calls++;
	e->counters.errors++;
	if (failure->kind == RL_FAILURE_REPLY)
		e->counters.errors_reply++;
	else if (failure->kind == RL_FAILURE_PROTOCOL)
		e->counters.errors_protocol++;
	else if (failure->kind == RL_FAILURE_TIMEOUT)
		e->counters.errors_timeout++;
	else
		e->counters.errors_connection++;
	if (failure->breaker_opened && count_outage)
		e->counters.outages++;
	rl_stats_unlock(e);
}

/*
 * Counts units of key that a rolled-back transaction gives back, in the
 * row its charges made (none is made here: this runs at abort).
 */
void
rl_stats_refunded(const char *key, size_t len, int64 units)
{
	RlStatsEntry *e = rl_stats_row(key, len, false);

	if (e == NULL || units <= 0)
		return;
	rl_stats_lock(e);
	e->counters.units_refunded += units;
	rl_stats_unlock(e);
}

PG_FUNCTION_INFO_V1(rl_redis_stats_rows);

/*
 * rl_redis_stats_rows(): the rows of the rl_redis_stats view: every
 * database and policy of the server (shared memory), or of this backend
 * without preloading, and the bounds of the round-trip buckets. It serves
 * the declaration of 1.5 and before (18 columns) and that of 1.6, which
 * adds peeks and shadow_denied, by the columns of the result type it is
 * called with, so that a database not yet updated keeps working with this
 * library.
 */
Datum
rl_redis_stats_rows(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	HASH_SEQ_STATUS seq;
	RlStatsEntry *e;
	HTAB	   *rows = shared_rows ? shared_rows : local_rows;

	InitMaterializedSRF(fcinfo, 0);
	if (rsinfo->setDesc->natts != 18 && rsinfo->setDesc->natts != 20)
		elog(ERROR, "rl_redis_stats_rows must return 18 or 20 columns");
	if (rows == NULL)
		return (Datum) 0;
	if (shared_rows != NULL)
		LWLockAcquire(shared->lock, LW_SHARED);
	hash_seq_init(&seq, rows);
	while ((e = hash_seq_search(&seq)) != NULL)
	{
		RlCounters	c;
		Datum		values[20];
		bool		nulls[20] = {0};
		Datum		buckets[RL_RTT_BUCKETS];
		int			i = 0;
		int			b;

		rl_stats_lock(e);
		c = e->counters;
		rl_stats_unlock(e);
		for (b = 0; b < RL_RTT_BUCKETS; b++)
			buckets[b] = Int64GetDatum(c.rtt[b]);

		values[i++] = ObjectIdGetDatum(e->key.dbid);
		if (e->key.name[0] == '\0')
			nulls[i++] = true;
		else
			values[i++] = CStringGetTextDatum(e->key.name);
		values[i++] = CStringGetTextDatum(e->key.kind);
		values[i++] = Int64GetDatum(c.calls);
		values[i++] = Int64GetDatum(c.allowed);
		values[i++] = Int64GetDatum(c.denied);
		values[i++] = Int64GetDatum(c.units_taken);
		values[i++] = Int64GetDatum(c.units_refunded);
		values[i++] = Int64GetDatum(c.errors);
		values[i++] = Int64GetDatum(c.errors_connection);
		values[i++] = Int64GetDatum(c.errors_timeout);
		values[i++] = Int64GetDatum(c.errors_reply);
		values[i++] = Int64GetDatum(c.errors_protocol);
		values[i++] = Int64GetDatum(c.fallback_allow);
		values[i++] = Int64GetDatum(c.fallback_deny);
		values[i++] = Int64GetDatum(c.outages);
		values[i++] = PointerGetDatum(construct_array(buckets, RL_RTT_BUCKETS, INT8OID,
													  8, FLOAT8PASSBYVAL, TYPALIGN_DOUBLE));
		values[i++] = Float8GetDatum(c.rtt_sum_us / 1000.0);
		if (rsinfo->setDesc->natts > i)
		{
			/* 1.6 */
			values[i++] = Int64GetDatum(c.peeks);
			values[i++] = Int64GetDatum(c.shadow_denied);
		}
		tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values, nulls);
	}
	if (shared_rows != NULL)
		LWLockRelease(shared->lock);
	return (Datum) 0;
}

PG_FUNCTION_INFO_V1(rl_redis_stats_scope);

/* rl_redis_stats_scope(): 'server' (shared memory) or 'backend'. */
Datum
rl_redis_stats_scope(PG_FUNCTION_ARGS)
{
	PG_RETURN_TEXT_P(cstring_to_text(shared_rows ? "server" : "backend"));
}

PG_FUNCTION_INFO_V1(rl_redis_rtt_bounds);

/* rl_redis_rtt_bounds(): the upper bounds of the round-trip buckets (ms). */
Datum
rl_redis_rtt_bounds(PG_FUNCTION_ARGS)
{
	Datum		bounds[RL_RTT_BUCKETS];
	int			b;

	for (b = 0; b < RL_RTT_BUCKETS - 1; b++)
		bounds[b] = Float8GetDatum(rtt_bounds_us[b] / 1000.0);
	bounds[RL_RTT_BUCKETS - 1] = Float8GetDatum(get_float8_infinity());
	PG_RETURN_ARRAYTYPE_P(construct_array(bounds, RL_RTT_BUCKETS, FLOAT8OID, 8,
										  FLOAT8PASSBYVAL, TYPALIGN_DOUBLE));
}

PG_FUNCTION_INFO_V1(rl_redis_stats_reset);

/* rl_redis_stats_reset(): zeroes every counter (the rows stay). */
Datum
rl_redis_stats_reset(PG_FUNCTION_ARGS)
{
	HASH_SEQ_STATUS seq;
	RlStatsEntry *e;
	HTAB	   *rows = shared_rows ? shared_rows : local_rows;

	if (rows == NULL)
		PG_RETURN_VOID();
	if (shared_rows != NULL)
		LWLockAcquire(shared->lock, LW_SHARED);
	hash_seq_init(&seq, rows);
	while ((e = hash_seq_search(&seq)) != NULL)
	{
		rl_stats_lock(e);
		memset(&e->counters, 0, sizeof(e->counters));
		rl_stats_unlock(e);
	}
	if (shared_rows != NULL)
		LWLockRelease(shared->lock);
	PG_RETURN_VOID();
}
