/*
 * refund.c
 *	  Gives back, when a transaction or subtransaction aborts, the units that
 *	  were taken in it and still count.
 *
 * rl_redis.refund_on_abort says whose units: "guards" (the default: the
 * units taken by rl_guard and rl_guard_statement), "all" (also the explicit
 * decision functions and rl_check/rl_check_all) or "off".
 *
 * Every (sub)transaction that charges is a refund scope with an id unique
 * across servers: "<tag>.<pid>.<n>" for a transaction, "<its id>/<n>" for a
 * savepoint. A charge is decided with the ids of its scope and of the
 * enclosing ones; the token bucket, GCRA and the sliding log record in
 * Redis what each scope took (see lua/common.lua), while for the fixed
 * window and the sliding counter it is enough to know how many units were
 * taken in which window of which life of the key. Here each scope keeps one
 * entry per key it charged (a hash table in a memory context of its own):
 * the bookkeeping costs O(distinct keys), not O(rows). A committed
 * subtransaction merges its entries into its parent's; an aborted one gives
 * back all of its keys in one script call, queued on the transport, which
 * sends it within a fixed budget at the end of the (sub)transaction and
 * otherwise before the session's next command. A committed transaction
 * queues the removal of its records from the token bucket's and GCRA's
 * keys.
 */
#include "postgres.h"

#include "access/xact.h"
#include "common/hashfn.h"
#include "common/pg_prng.h"
#include "miscadmin.h"
#include "utils/builtins.h"
#include "utils/hsearch.h"
#include "utils/memutils.h"

#include "rl_redis.h"

/* The hash key of a pending refund: a Redis key's bytes. */
typedef struct RlKeyRef
{
	const char *data;
	int			len;
} RlKeyRef;

/* What a scope took from one key. */
typedef struct RlPending
{
	RlKeyRef	key;			/* hash key; data in the scope's context */
	RlLimit		limit;
	int64		window;			/* number of the window of the newest charge */
	int64		units;			/* units taken in that window */
	int64		prev;			/* units taken in the window before it */
	int64		epoch;			/* the key's life they were taken from */
	int64		first;			/* clock of the first charge (µs) */
	uint64		server;			/* rl_server_generation() of the charges */
} RlPending;

/* One refund scope: a transaction or subtransaction that charged. */
typedef struct RlScope
{
	int			nestlevel;		/* GetCurrentTransactionNestLevel() */
	char		id[64];
	MemoryContext cxt;
	HTAB	   *keys;			/* of RlPending; NULL until the first charge */
	struct RlScope *parent;
} RlScope;

/* innermost scope of the current transaction; its memory is in scope->cxt */
static RlScope *innermost = NULL;
static uint64 scope_counter = 0;
static uint32 backend_tag = 0;

/*
 * A charge is recorded under the transaction's scope and at most this many
 * savepoints' less one (the innermost): the sliding log tags each unit with
 * them.
 */
#define RL_MAX_SCOPE_DEPTH 8

/*
 * The most work one refund or forget call carries, in keys of a fixed
 * window, a sliding counter or a sliding log; a key that keeps refund
 * records (a token bucket's or GCRA's) counts RL_REFUND_RECORDS_WEIGHT.
 * Either way a call holds Redis about 5 ms: 1 000 token-bucket keys held it
 * 18 ms, which a loaded machine stretched past a 100 ms command_timeout
 * twice, and their refund was lost.
 */
#define RL_REFUND_BATCH 1000
#define RL_REFUND_RECORDS_WEIGHT 4

/* the most bytes a refund call's encoding adds per key: nine numbers */
#define RL_REFUND_KEY_BYTES (9 * 28 + 16)

/* the scopes argument of the last call, "id1,id2,..." */
static StringInfoData scopes_arg;

/* True when refund_on_abort covers a charge made by whom. */
static bool
rl_refund_wanted(RlChargeBy by)
{
	return rl_refund_on_abort == RL_REFUND_ALL ||
		(by == RL_BY_GUARD && rl_refund_on_abort == RL_REFUND_GUARDS);
}

/* dynahash support for RlKeyRef keys */
static uint32
rl_keyref_hash(const void *key, Size keysize)
{
	const RlKeyRef *k = (const RlKeyRef *) key;

	return hash_bytes((const unsigned char *) k->data, k->len);
}

static int
rl_keyref_match(const void *key1, const void *key2, Size keysize)
{
	const RlKeyRef *a = (const RlKeyRef *) key1;
	const RlKeyRef *b = (const RlKeyRef *) key2;

	return a->len == b->len && memcmp(a->data, b->data, a->len) == 0 ? 0 : 1;
}

/* Opens a scope for the current nesting level inside parent. */
static RlScope *
rl_scope_open(int nestlevel, RlScope *parent)
{
	MemoryContext cxt = AllocSetContextCreate(TopTransactionContext,
											  "rl_redis refund scope",
											  ALLOCSET_SMALL_SIZES);
	RlScope    *scope = MemoryContextAllocZero(cxt, sizeof(RlScope));
	RlScope    *top;

	if (backend_tag == 0)
		backend_tag = pg_prng_uint32(&pg_global_prng_state) | 1;
	scope->nestlevel = nestlevel;
	scope->cxt = cxt;
	scope->parent = parent;
	++scope_counter;
	if (parent == NULL)
		snprintf(scope->id, sizeof(scope->id), "%x.%x.%llx",
				 backend_tag, (unsigned int) MyProcPid,
				 (unsigned long long) scope_counter);
	else
	{
		for (top = parent; top->parent != NULL; top = top->parent)
			;
		snprintf(scope->id, sizeof(scope->id), "%s/%llx", top->id,
				 (unsigned long long) scope_counter);
	}
	return scope;
}

/* Makes sure every nesting level up to the current one has a scope. */
static void
rl_scopes_ensure(void)
{
	int			level = GetCurrentTransactionNestLevel();
	int			want;

	if (innermost != NULL && innermost->nestlevel == level)
		return;
	/* the levels missing between the innermost scope and the current one */
	for (want = innermost ? innermost->nestlevel + 1 : 1; want <= level; want++)
		innermost = rl_scope_open(want, innermost);
}

/*
 * Returns the refund scopes argument of a charge that refund_on_abort
 * covers: the ids of the transaction's scope and of the innermost
 * RL_MAX_SCOPE_DEPTH - 1 enclosing savepoints (deeper ones give back
 * nothing), outermost first, joined with ','; "" when the charge is not to
 * be refunded.
 */
const char *
rl_refund_scopes(RlChargeBy by)
{
	RlScope    *s;
	int			n = 0;
	const char *ids[RL_MAX_SCOPE_DEPTH];

	if (!rl_refund_wanted(by) || !IsTransactionState())
		return "";
	rl_scopes_ensure();
	if (scopes_arg.data == NULL)
	{
		MemoryContext old = MemoryContextSwitchTo(TopMemoryContext);

		initStringInfo(&scopes_arg);
		MemoryContextSwitchTo(old);
	}
	resetStringInfo(&scopes_arg);
	for (s = innermost; s->parent != NULL && n < RL_MAX_SCOPE_DEPTH - 1; s = s->parent)
		ids[n++] = s->id;
	while (s->parent != NULL)
		s = s->parent;
	ids[n++] = s->id;			/* the transaction's */
	while (n-- > 0)
	{
		appendStringInfoString(&scopes_arg, ids[n]);
		if (n > 0)
			appendStringInfoChar(&scopes_arg, ',');
	}
	return scopes_arg.data;
}

/*
 * Adds units taken in window number window of the key's life epoch, first
 * at clock first, to a pending entry. Units of an earlier life (the key was
 * deleted and made again) or of a window before the previous one can never
 * be given back: they are dropped.
 */
static void
rl_pending_add(RlPending *p, int64 window, int64 units, int64 prev,
			   int64 epoch, int64 first)
{
	if (epoch != p->epoch)
	{
		p->window = window;
		p->units = 0;
		p->prev = 0;
		p->epoch = epoch;
	}
	if (first < p->first)
		p->first = first;
	if (window == p->window)
	{
		p->units += units;
		p->prev += prev;
	}
	else if (window == p->window + 1)
	{
		p->prev = p->units + prev;
		p->units = units;
		p->window = window;
	}
	else if (window > p->window)
	{
		p->prev = prev;
		p->units = units;
		p->window = window;
	}
	else if (window == p->window - 1)
		p->prev += units;
}

/* Finds or makes scope's entry for key, with limit. */
static RlPending *
rl_pending_entry(RlScope *scope, const char *key, int keylen,
				 const RlLimit *limit)
{
	RlKeyRef	ref = {key, keylen};
	RlPending  *p;
	bool		found;

	if (scope->keys == NULL)
	{
		HASHCTL		ctl;

		ctl.keysize = sizeof(RlKeyRef);
		ctl.entrysize = sizeof(RlPending);
		ctl.hash = rl_keyref_hash;
		ctl.match = rl_keyref_match;
		ctl.hcxt = scope->cxt;
		scope->keys = hash_create("rl_redis pending refunds", 16, &ctl,
								  HASH_ELEM | HASH_FUNCTION | HASH_COMPARE |
								  HASH_CONTEXT);
	}
	p = hash_search(scope->keys, &ref, HASH_ENTER, &found);
	if (!found)
	{
		char	   *copy = MemoryContextAlloc(scope->cxt, keylen);

		memcpy(copy, key, keylen);
		p->key.data = copy;
		p->key.len = keylen;
		p->window = PG_INT64_MIN / 2;
		p->units = 0;
		p->prev = 0;
		p->epoch = 0;
		p->first = PG_INT64_MAX;
		p->server = rl_server_generation();
	}
	else if (p->server != rl_server_generation())
	{
		/* the older charges went to another server: forget them */
		p->window = PG_INT64_MIN / 2;
		p->units = 0;
		p->prev = 0;
		p->first = PG_INT64_MAX;
		p->server = rl_server_generation();
	}
	p->limit = *limit;
	return p;
}

/*
 * Remembers that cost units were taken from key (in its life epoch) under
 * limit on the clock stamp_us (Redis's), in the current scope, when
 * refund_on_abort covers this kind of call.
 */
void
rl_remember_charge(const RlLimit *limit, StringInfo key, int32 cost,
				   int64 stamp_us, int64 epoch, RlChargeBy by)
{
	RlPending  *p;

	if (cost <= 0 || !rl_refund_wanted(by) || !IsTransactionState())
		return;
	rl_scopes_ensure();
	p = rl_pending_entry(innermost, key->data, key->len, limit);
	rl_pending_add(p, stamp_us / (limit->window_ms * 1000), cost, 0, epoch,
				   stamp_us);
}

/* True for the algorithms whose refund may be sent twice harmlessly. */
static bool
rl_refund_idempotent(const RlAlgorithm *algorithm)
{
	/* the others drop a record or tags */
	return !algorithm->refund_subtracts;
}

/*
 * True when scope entry p goes into a call: charged on the current server,
 * of the kind asked for (refunds that may or may not be sent twice; for the
 * forget call, the keys that keep records).
 */
static bool
rl_scope_wants(const RlPending *p, bool refund, bool idempotent)
{
	if (p->server != rl_server_generation())
		return false;
	if (!refund)
		return p->limit.algorithm->keeps_records;
	return rl_refund_idempotent(p->limit.algorithm) == idempotent;
}

/*
 * Queues one script call for n scope entries: KEYS their keys; ARGV for a
 * refund (run_refund.lua) the clock, the scope, its parents and nine
 * numbers per key, for the forget call (run_forget.lua) the scope.
 */
static void
rl_scope_queue_batch(RlScope *scope, const RlScript *script, bool refund,
					 bool idempotent, RlPending **list, int n,
					 const char *parents)
{
	int			argc = RL_SCRIPT_ARGV_RESERVED + 1 + n + (refund ? 3 + 9 * n : 1);
	const char **argv = palloc(sizeof(char *) * argc);
	size_t	   *argvlen = palloc(sizeof(size_t) * argc);
	char	   *numbers = palloc(n * 8 * 24 + 24);
	char	   *num = numbers;
	char		now_s[24];
	int			i = RL_SCRIPT_ARGV_RESERVED;
	int			j;
	RlConn	   *conn;

	/* units come back: no backend may deny from a remembered denial */
	if (refund)
		rl_deny_cache_forget();

	argv[i] = num;
	argvlen[i++] = pg_ltoa(n, num);
	num += 24;
	for (j = 0; j < n; j++)
	{
		argv[i] = list[j]->key.data;
		argvlen[i++] = list[j]->key.len;
	}
	if (refund)
	{
		argv[i] = now_s;
		argvlen[i++] = rl_clock_arg(now_s);
	}
	argv[i] = scope->id;
	argvlen[i++] = strlen(scope->id);
	if (refund)
	{
		argv[i] = parents;
		argvlen[i++] = strlen(parents);
		for (j = 0; j < n; j++)
		{
			RlPending  *p = list[j];
			int64		values[8];
			int			k;


			argv[i] = p->limit.algorithm->name;
			argvlen[i++] = strlen(p->limit.algorithm->name);
			values[0] = p->limit.lim;
			values[1] = p->limit.window_ms;
			values[2] = p->limit.burst;
			values[3] = p->window;
			values[4] = p->units;
			values[5] = p->prev;
			values[6] = p->epoch;
			values[7] = p->first;
			for (k = 0; k < 8; k++)
			{
				argv[i] = num;
				argvlen[i++] = pg_lltoa(values[k], num);
				num += 24;
			}
		}
	}
	Assert(i == argc);

	/*
	 * sent as EVAL, which needs no loaded library: it may reach a Redis that
	 * lost it (a restart), and a transaction's end has no round trip to spare
	 */
	rl_script_argv(script, true, argv, argvlen);
	conn = rl_route_known(list[0]->key.data, list[0]->key.len);
	if (conn != NULL)
	{
		rl_defer_command(conn, argc, argv, argvlen,
						 (idempotent ? RL_QUEUED_IDEMPOTENT : 0) |
						 (refund ? RL_QUEUED_GIVES_BACK : 0));
		for (j = 0; refund && j < n; j++)
			rl_stats_refunded(list[j]->key.data, list[j]->key.len,
							  list[j]->units + list[j]->prev);
	}
	else
		ereport(WARNING,
				(errmsg("rate-limit units of a rolled-back transaction could not be given back: the Redis node of their keys is not known")));
	pfree(argv);
	pfree(argvlen);
	pfree(numbers);
}

/* One scope entry and the hash slot of its key, to sort by hash slot. */
typedef struct RlHashSlotted
{
	int			hash_slot;
	RlPending  *p;
} RlHashSlotted;

/* What the key of p weighs in a refund or forget call (RL_REFUND_BATCH). */
static int
rl_refund_weight(const RlPending *p)
{
	return p->limit.algorithm != NULL && p->limit.algorithm->keeps_records ?
		RL_REFUND_RECORDS_WEIGHT : 1;
}

/* qsort order of RlHashSlotted: by hash slot */
static int
rl_hash_slotted_cmp(const void *a, const void *b)
{
	int			x = ((const RlHashSlotted *) a)->hash_slot;
	int			y = ((const RlHashSlotted *) b)->hash_slot;

	return (x > y) - (x < y);
}

/*
 * Queues the script calls for the n entries of slotted (palloc'd; sorted
 * here) of scope, weighing at most RL_REFUND_BATCH each, so that no one call
 * holds Redis long, and in cluster mode the keys of one hash slot each (a
 * script's keys must share one), on the connection their charges went to.
 * parents: the ids of the enclosing scopes, joined with ','.
 */
static void
rl_queue_entries(RlScope *scope, const RlScript *script, bool refund,
				 bool idempotent, RlHashSlotted *slotted, long n,
				 const char *parents)
{
	RlPending **list;
	long		j;
	long		batch;

	if (n > 1)
		qsort(slotted, n, sizeof(RlHashSlotted), rl_hash_slotted_cmp);
	list = palloc(sizeof(RlPending *) * (n + 1));
	for (j = 0; j < n; j++)
		list[j] = slotted[j].p;
	for (j = 0; j < n; j += batch)
	{
		/*
		 * The run of keys of one hash slot, weighing at most
		 * RL_REFUND_BATCH. When the worker of the shared transport may
		 * carry the call (rl_worker_request_max says how large it may be),
		 * at most that besides the scope ids and the script's other
		 * arguments.
		 */
		RlConn	   *conn = rl_route_known(list[j]->key.data, list[j]->key.len);
		size_t		max = rl_worker_request_max(conn);
		bool		cut = max > 0;
		size_t		budget = max - 1024 - strlen(parents) - strlen(scope->id);
		size_t		bytes = list[j]->key.len + RL_REFUND_KEY_BYTES;
		int			weight = rl_refund_weight(list[j]);

		for (batch = 1; j + batch < n &&
			 slotted[j + batch].hash_slot == slotted[j].hash_slot; batch++)
		{
			weight += rl_refund_weight(list[j + batch]);
			bytes += list[j + batch]->key.len + RL_REFUND_KEY_BYTES;
			if (weight > RL_REFUND_BATCH || (cut && bytes > budget))
				break;
		}
		rl_scope_queue_batch(scope, script, refund, idempotent, list + j,
							 (int) batch, parents);
	}
	pfree(list);
}

/*
 * Queues the script calls for the scope's entries that rl_scope_wants
 * (see rl_queue_entries).
 */
static void
rl_scope_queue(RlScope *scope, const RlScript *script, bool refund,
			   bool idempotent)
{
	HASH_SEQ_STATUS seq;
	RlPending  *p;
	RlHashSlotted  *slotted;
	long		n = 0;
	StringInfoData parents;
	RlScope    *s;
	MemoryContext old;

	if (scope->keys == NULL)
		return;
	old = MemoryContextSwitchTo(scope->cxt);
	slotted = palloc(sizeof(RlHashSlotted) * (hash_get_num_entries(scope->keys) + 1));
	hash_seq_init(&seq, scope->keys);
	while ((p = hash_seq_search(&seq)) != NULL)
		if (rl_scope_wants(p, refund, idempotent))
		{
			slotted[n].hash_slot = rl_route_hash_slot(p->key.data, p->key.len);
			slotted[n++].p = p;
		}
	initStringInfo(&parents);
	for (s = scope->parent; s != NULL; s = s->parent)
	{
		if (parents.len > 0)
			appendStringInfoChar(&parents, ',');
		appendStringInfoString(&parents, s->id);
	}
	rl_queue_entries(scope, script, refund, idempotent, slotted, n, parents.data);
	pfree(slotted);
	pfree(parents.data);
	MemoryContextSwitchTo(old);
}

/*
 * True when refund_on_abort gives back, on abort, a charge made now by
 * whom.
 */
bool
rl_refund_covers(RlChargeBy by)
{
	return rl_refund_wanted(by) && IsTransactionState();
}

/*
 * Writes into buf (64 bytes) and returns a refund scope id of its own for
 * one call split across hash slots whose charges refund_on_abort does
 * not cover ("<tag>.<pid>.<n>", like a transaction's), so that the records
 * its charges leave in Redis are its own.
 */
const char *
rl_refund_call_scope(char *buf)
{
	if (backend_tag == 0)
		backend_tag = pg_prng_uint32(&pg_global_prng_state) | 1;
	snprintf(buf, 64, "%x.%x.%llx", backend_tag, (unsigned int) MyProcPid,
			 (unsigned long long) ++scope_counter);
	return buf;
}

/*
 * Queues, for the n charges that a split call made under its own scope id
 * (rl_refund_call_scope), their refund (give_back: another hash slot's
 * call denied, so the call takes nothing) or the removal of their records (the call was
 * allowed and nothing will give them back).
 */
void
rl_refund_call_end(const char *id, RlCharge *charges, int n, bool give_back)
{
	RlScope		scope;
	RlPending  *entries = palloc0(sizeof(RlPending) * Max(n, 1));
	RlHashSlotted  *slotted = palloc(sizeof(RlHashSlotted) * Max(n, 1));
	int			pass;
	int			j;

	memset(&scope, 0, sizeof(scope));
	strlcpy(scope.id, id, sizeof(scope.id));
	scope.cxt = CurrentMemoryContext;
	for (j = 0; j < n; j++)
	{
		RlPending  *p = &entries[j];

		p->key.data = charges[j].key->data;
		p->key.len = charges[j].key->len;
		p->limit = *charges[j].limit;
		p->window = charges[j].stamp_us / (p->limit.window_ms * 1000);
		p->units = charges[j].cost;
		p->epoch = charges[j].epoch;
		p->first = charges[j].stamp_us;
		p->server = rl_server_generation();
	}
	/* a refund in two calls (may or may not be sent twice), or the forget */
	for (pass = 0; pass < (give_back ? 2 : 1); pass++)
	{
		long		count = 0;

		for (j = 0; j < n; j++)
			if (entries[j].units > 0 &&
				rl_scope_wants(&entries[j], give_back, pass == 0))
			{
				slotted[count].hash_slot = rl_route_hash_slot(entries[j].key.data,
														 entries[j].key.len);
				slotted[count++].p = &entries[j];
			}
		rl_queue_entries(&scope, give_back ? &rl_script_refund : &rl_script_forget,
						 give_back, give_back ? pass == 0 : true, slotted,
						 count, "");
	}
	pfree(entries);
	pfree(slotted);
}

/*
 * Queues the refund of everything scope took, with the ids of its enclosing
 * scopes (whose records in Redis shrink by what it gives back): one call for
 * the refunds that may be sent again after a lost connection, one for those
 * that may not.
 */
static void
rl_scope_give_back(RlScope *scope)
{
	rl_scope_queue(scope, &rl_script_refund, true, true);
	rl_scope_queue(scope, &rl_script_refund, true, false);
}

/* Hands scope's entries to its parent (a subtransaction committed). */
static void
rl_scope_merge_up(RlScope *scope)
{
	HASH_SEQ_STATUS seq;
	RlPending  *p;

	if (scope->keys == NULL)
		return;
	hash_seq_init(&seq, scope->keys);
	while ((p = hash_seq_search(&seq)) != NULL)
	{
		RlPending  *q;

		if (p->server != rl_server_generation())
			continue;			/* charged on another server */
		q = rl_pending_entry(scope->parent, p->key.data, p->key.len,
							 &p->limit);

		rl_pending_add(q, p->window - 1, p->prev, 0, p->epoch, p->first);
		rl_pending_add(q, p->window, p->units, 0, p->epoch, p->first);
	}
}

/* Closes the innermost scope (its memory goes with it). */
static void
rl_scope_close(void)
{
	RlScope    *scope = innermost;

	innermost = scope->parent;
	MemoryContextDelete(scope->cxt);
}

/*
 * Gives back or forgets the charges at the end of a transaction
 * (src/xact_end.c).
 */
void
rl_refund_xact_end(XactEvent event)
{
	RlHold		hold;

	switch (event)
	{
		case XACT_EVENT_ABORT:
		case XACT_EVENT_PARALLEL_ABORT:
			/* never raise here: a refund that cannot be queued is lost */
			rl_hold_save(&hold);
			PG_TRY();
			{
				while (innermost != NULL)
				{
					rl_scope_give_back(innermost);
					innermost = innermost->parent;
				}
			}
			PG_CATCH();
			{
				rl_hold_restore(&hold);
				ereport(WARNING,
						(errmsg("rate-limit units taken in the aborted transaction could not be given back")));
			}
			PG_END_TRY();
			innermost = NULL;	/* memory goes with TopTransactionContext */
			break;
		case XACT_EVENT_COMMIT:
		case XACT_EVENT_PARALLEL_COMMIT:
		case XACT_EVENT_PREPARE:
			/* the records of the transaction will never be used */
			if (innermost != NULL)
			{
				RlScope    *top = innermost;

				while (top->parent != NULL)
					top = top->parent;
				rl_hold_save(&hold);
				PG_TRY();
				{
					rl_scope_queue(top, &rl_script_forget, false, true);
				}
				PG_CATCH();
				{
					rl_hold_restore(&hold);
				}
				PG_END_TRY();
			}
			innermost = NULL;
			break;
		default:
			break;
	}
}

/*
 * Gives back the charges of an aborted subtransaction; hands those of a
 * committed one to its parent (src/xact_end.c). Costs O(the
 * subtransaction's own keys).
 */
void
rl_refund_subxact_end(SubXactEvent event)
{
	RlHold		hold;

	if (innermost == NULL ||
		innermost->nestlevel != GetCurrentTransactionNestLevel())
		return;
	if (event == SUBXACT_EVENT_ABORT_SUB)
	{
		rl_hold_save(&hold);
		PG_TRY();
		{
			rl_scope_give_back(innermost);
		}
		PG_CATCH();
		{
			rl_hold_restore(&hold);
			ereport(WARNING,
					(errmsg("rate-limit units taken in the aborted subtransaction could not be given back")));
		}
		PG_END_TRY();
		rl_scope_close();
	}
	else if (event == SUBXACT_EVENT_COMMIT_SUB)
	{
		rl_scope_merge_up(innermost);
		rl_scope_close();
	}
}
