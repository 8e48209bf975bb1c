/*
 * denycache.c
 *	  The local cache of denials (rl_redis.deny_cache).
 *
 * A call that Redis denied is remembered in this backend, by its key and
 * limit, until its retry_after_ms has passed (counted from
 * when the call was sent, so never beyond the moment Redis named). Until
 * then a call on the same key and limit that asks for at least as many
 * units is denied here, without Redis: it would be denied there too, unless
 * units came back meanwhile. Only a false denial is possible, never a false
 * admit.
 *
 * Units come back by a refund or a reset. Those made through the extension
 * on this server (rl_refund, rl_<algorithm>_refund, a refund on abort,
 * rl_reset) bump a counter in shared memory, and every backend drops its
 * entries when it sees the counter moved. Those made on another server are
 * not seen: a caller may then be denied until the cached retry time. The
 * cache needs the counter, so it works only when the library is preloaded
 * (shared_preload_libraries); without, the setting is ignored with a
 * warning.
 *
 * An entry holds its key and limit, compared on a lookup (two keys of one
 * hash never answer for each other); keys longer than RL_DENY_CACHE_KEY are
 * not remembered. Memory: at most RL_DENY_CACHE_MAX entries per backend,
 * in a memory context of their own; when full, expired entries are
 * dropped, and if none is, all of them.
 */
#include "postgres.h"

#include "common/hashfn.h"
#include "miscadmin.h"
#include "port/atomics.h"
#include "storage/ipc.h"
#include "storage/lwlock.h"
#include "storage/shmem.h"
#include "utils/hsearch.h"
#include "utils/timestamp.h"

#include "rl_redis.h"

/* the most denials one backend remembers */
#define RL_DENY_CACHE_MAX 10000

/* the longest key remembered (a longer one is not: memory stays bounded) */
#define RL_DENY_CACHE_KEY 512

/* One remembered denial. */
typedef struct RlDenial
{
	uint64		hash;			/* hash key: of the Redis key and the limit */
	char	   *key;			/* the key and limit, compared on a lookup */
	int			keylen;
	int64		until_ms;		/* on rl_deny_cache_now's clock */
	int64		reset_at_ms;	/* when the key's state resets, or 0 */
	int32		cost;			/* the units the denied call asked for */
	int32		lim;
	int32		remaining;
} RlDenial;

/* the counter of refunds and resets on this server, in shared memory */
static pg_atomic_uint64 *refunds = NULL;

/* this backend's denials (in denials_cxt), the counter they were made under */
static MemoryContext denials_cxt = NULL;
static HTAB *denials = NULL;
static uint64 denials_refunds = 0;

/* whether the warning that the cache is off was given */
static bool unusable_warned = false;

static shmem_request_hook_type prev_shmem_request_hook = NULL;
static shmem_startup_hook_type prev_shmem_startup_hook = NULL;

/* Asks the postmaster for the counter's shared memory. */
static void
rl_deny_cache_shmem_request(void)
{
	if (prev_shmem_request_hook)
		prev_shmem_request_hook();
	RequestAddinShmemSpace(MAXALIGN(sizeof(pg_atomic_uint64)));
}

/* Makes (or attaches to) the shared counter. */
static void
rl_deny_cache_shmem_startup(void)
{
	bool		found;

	if (prev_shmem_startup_hook)
		prev_shmem_startup_hook();
	LWLockAcquire(AddinShmemInitLock, LW_EXCLUSIVE);
	refunds = ShmemInitStruct("rl_redis deny cache", sizeof(pg_atomic_uint64),
							  &found);
	if (!found)
		pg_atomic_init_u64(refunds, 0);
	LWLockRelease(AddinShmemInitLock);
}

/* Installs the shared-memory hooks when the library is being preloaded. */
void
rl_deny_cache_init(void)
{
	if (!process_shared_preload_libraries_in_progress)
		return;
	prev_shmem_request_hook = shmem_request_hook;
	shmem_request_hook = rl_deny_cache_shmem_request;
	prev_shmem_startup_hook = shmem_startup_hook;
	shmem_startup_hook = rl_deny_cache_shmem_startup;
}

/* The cache's clock in ms: the test clock when set, else this server's. */
int64
rl_deny_cache_now(void)
{
	if (rl_test_clock_ms > 0)
		return (int64) rl_test_clock_ms;
	return GetCurrentTimestamp() / 1000;
}

/*
 * True when the cache may be used now: the setting is on and the counter
 * exists (else a warning, once per backend).
 */
static bool
rl_deny_cache_usable(void)
{
	if (!rl_deny_cache)
		return false;
	if (refunds == NULL)
	{
		if (!unusable_warned)
			ereport(WARNING,
					(errmsg("rl_redis.deny_cache is ignored: rl_redis is not in shared_preload_libraries"),
					 errdetail("The cache must learn of refunds and resets made by other sessions of this server through shared memory.")));
		unusable_warned = true;
		return false;
	}
	return true;
}

/*
 * Writes what an entry is for into buf: the key, its limit and the server
 * (a number that changes when the connection settings name another).
 * Returns its length, or -1 when it is longer than RL_DENY_CACHE_KEY.
 */
static int
rl_denial_name(char *buf, const char *key, size_t len, const RlLimit *limit,
			   uint64 server)
{
	char		sig[96];
	int			siglen;

	siglen = snprintf(sig, sizeof(sig), "|%s/%d/" INT64_FORMAT "/%d/" UINT64_FORMAT,
					  limit->algorithm->name, limit->lim, limit->window_ms,
					  limit->burst, server);
	if (len + siglen > RL_DENY_CACHE_KEY)
		return -1;
	memcpy(buf, key, len);
	memcpy(buf + len, sig, siglen);
	return (int) len + siglen;
}

/* Makes the table empty (and creates it), its keys too. */
static void
rl_denials_clear(void)
{
	HASHCTL		info;

	if (denials_cxt == NULL)
		denials_cxt = AllocSetContextCreate(TopMemoryContext, "rl_redis denials",
											ALLOCSET_DEFAULT_SIZES);
	else
		MemoryContextReset(denials_cxt);
	info.keysize = sizeof(uint64);
	info.entrysize = sizeof(RlDenial);
	info.hcxt = denials_cxt;
	denials = hash_create("rl_redis denials", 256, &info,
						  HASH_ELEM | HASH_BLOBS | HASH_CONTEXT);
}

/*
 * The table, empty when units came back on this server since its entries
 * were made; NULL when the cache is not in use.
 */
static HTAB *
rl_denials(void)
{
	uint64		now_refunds;

	if (!rl_deny_cache_usable())
		return NULL;
	now_refunds = pg_atomic_read_u64(refunds);
	if (denials == NULL || now_refunds != denials_refunds)
	{
		rl_denials_clear();
		denials_refunds = now_refunds;
	}
	return denials;
}

/*
 * When a call on key under limit (on server) asking for cost units (> 0)
 * would be denied because a denial is remembered: fills d with that
 * denial, its times counted down to now, and returns true. A cost above
 * what the limit holds at once is left to Redis, which says it can never
 * pass (retry_after_ms -1), and so is every call of a shadow policy, which
 * a remembered denial must never deny.
 */
bool
rl_deny_cache_lookup(const char *key, size_t len, const RlLimit *limit,
					 uint64 server, int32 cost, RlDecision *d)
{
	HTAB	   *table = rl_denials();
	char		name[RL_DENY_CACHE_KEY];
	int			namelen;
	uint64		hash;
	RlDenial   *e;
	int64		now;

	if (table == NULL || cost <= 0 || limit->shadow ||
		cost > rl_limit_capacity(limit))
		return false;
	namelen = rl_denial_name(name, key, len, limit, server);
	if (namelen < 0)
		return false;
	hash = hash_bytes_extended((const unsigned char *) name, namelen, 0);
	e = hash_search(table, &hash, HASH_FIND, NULL);
	/* another key of the same hash is a miss */
	if (e == NULL || e->keylen != namelen || memcmp(e->key, name, namelen) != 0)
		return false;
	now = rl_deny_cache_now();
	if (now >= e->until_ms)
	{
		pfree(e->key);
		(void) hash_search(table, &hash, HASH_REMOVE, NULL);
		return false;
	}
	if (cost < e->cost)
		return false;
	d->allowed = false;
	d->from_redis = true;
	d->from_cache = true;
	d->shadow_denied = false;
	d->lim = e->lim;
	d->remaining = e->remaining;
	d->reset_ms = e->reset_at_ms > 0 ? Max(e->reset_at_ms - now, 1) : 0;
	d->retry_after_ms = e->until_ms - now;
	d->stamp_us = 0;
	d->epoch = 0;
	return true;
}

/*
 * The refund counter before a call is sent: rl_deny_cache_store remembers
 * its denial only when no refund or reset came between (a denial decided
 * before a refund must not outlive it).
 */
uint64
rl_deny_cache_mark(void)
{
	return refunds != NULL ? pg_atomic_read_u64(refunds) : 0;
}

/*
 * Remembers the denial d of a call on key under limit (on server) asking
 * for cost units, sent at sent_ms (rl_deny_cache_now) when the refund
 * counter was mark (rl_deny_cache_mark); a wait of -1 (never: more than the
 * limit holds) or 0 is not remembered. An allowed call (or a peek) on a
 * remembered key brings the entry's remaining up to date.
 */
void
rl_deny_cache_store(const char *key, size_t len, const RlLimit *limit,
					uint64 server, int32 cost, const RlDecision *d,
					int64 sent_ms, uint64 mark)
{
	HTAB	   *table = rl_denials();
	char		name[RL_DENY_CACHE_KEY];
	int			namelen;
	uint64		hash;
	RlDenial   *e;
	bool		found;

	if (table == NULL || cost < 0 || !d->from_redis)
		return;
	namelen = rl_denial_name(name, key, len, limit, server);
	if (namelen < 0)
		return;
	hash = hash_bytes_extended((const unsigned char *) name, namelen, 0);
	if (d->allowed)
	{
		e = hash_search(table, &hash, HASH_FIND, NULL);
		if (e != NULL && e->keylen == namelen && memcmp(e->key, name, namelen) == 0)
			e->remaining = d->remaining;
		return;
	}
	if (cost == 0 || d->retry_after_ms <= 0 || mark != denials_refunds)
		return;
	if (hash_get_num_entries(table) >= RL_DENY_CACHE_MAX)
	{
		HASH_SEQ_STATUS status;
		RlDenial   *old;
		int64		now = rl_deny_cache_now();

		hash_seq_init(&status, table);
		while ((old = hash_seq_search(&status)) != NULL)
			if (now >= old->until_ms)
			{
				pfree(old->key);
				(void) hash_search(table, &old->hash, HASH_REMOVE, NULL);
			}
		if (hash_get_num_entries(table) >= RL_DENY_CACHE_MAX)
			rl_denials_clear();
		table = denials;
	}
	e = hash_search(table, &hash, HASH_ENTER, &found);
	if (found)
		pfree(e->key);
	e->key = MemoryContextAlloc(denials_cxt, namelen);
	memcpy(e->key, name, namelen);
	e->keylen = namelen;
	e->until_ms = sent_ms + d->retry_after_ms;
	e->reset_at_ms = d->reset_ms > 0 ? sent_ms + d->reset_ms : 0;
	e->cost = cost;
	e->lim = d->lim;
	e->remaining = d->remaining;
}

/*
 * Units come back, or keys are reset, through this server: every backend's
 * denials are forgotten. Called before the refund is sent and again once
 * its reply came, so that a denial decided in between (on the state before
 * the refund) is not kept either. Only an atomic add: safe in a
 * transaction callback.
 */
void
rl_deny_cache_forget(void)
{
	/* each backend, this one too, empties its table at its next lookup */
	if (refunds != NULL)
		pg_atomic_fetch_add_u64(refunds, 1);
}
