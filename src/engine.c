/*
 * engine.c
 *	  The decision engine: the one entry point of every charge (rl_decide),
 *	  the keys, the script calls and rl_result.
 *
 * Every SQL function that charges an identity (functions.c, policy.c,
 * concurrency.c, guard.c, the batches here) hands its charges to
 * rl_decide, which checks each one (checks.c), builds its key, runs the
 * algorithm's script in Redis on the connection the key routes to (or
 * takes a concurrency slot, slots.c) and reads the reply (decision.c);
 * when Redis cannot give an answer, rl_redis.on_error decides
 * (decision.c). It calls only the files listed above it in rl_redis.h.
 */
#include "postgres.h"

#include "access/htup_details.h"
#include "catalog/pg_type.h"
#include "funcapi.h"
#include "mb/pg_wchar.h"
#include "miscadmin.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/timestamp.h"
#include "utils/memutils.h"
#include "utils/rel.h"

#include "rl_redis.h"

/*
 * Fills call with the script call that decides n charges sharing one
 * hash slot (run_all.lua: applied to all or to none), made under the
 * refund scopes given ("" for none). Its arguments are palloc'd.
 */
static void
rl_group_call(RlCharge *charges, int n, const char *scopes, RlCall *call)
{
	int			argc = RL_SCRIPT_ARGV_RESERVED + 1 + n + 2 + 6 * n;
	const char **argv = palloc(sizeof(char *) * argc);
	size_t	   *argvlen = palloc(sizeof(size_t) * argc);
	char	   *numbers = palloc(n * 4 * 24 + 48);
	char	   *num = numbers;
	int			i = RL_SCRIPT_ARGV_RESERVED;
	int			j;

	argv[i] = num;
	argvlen[i++] = pg_ltoa(n, num);
	num += 24;
	for (j = 0; j < n; j++)
	{
		argv[i] = charges[j].key->data;
		argvlen[i++] = charges[j].key->len;
	}
	argv[i] = num;
	argvlen[i++] = rl_clock_arg(num);
	num += 24;
	argv[i] = scopes;
	argvlen[i++] = strlen(scopes);
	for (j = 0; j < n; j++)
	{
		const RlLimit *limit = charges[j].limit;

		argv[i] = limit->algorithm->name;
		argvlen[i++] = strlen(limit->algorithm->name);
		argv[i] = num;
		argvlen[i++] = pg_ltoa(limit->lim, num);
		num += 24;
		argv[i] = num;
		argvlen[i++] = pg_lltoa(limit->window_ms, num);
		num += 24;
		argv[i] = num;
		argvlen[i++] = pg_ltoa(limit->burst, num);
		num += 24;
		argv[i] = num;
		argvlen[i++] = pg_ltoa(charges[j].cost, num);
		num += 24;
		argv[i] = limit->shadow ? "1" : "0";
		argvlen[i++] = 1;
	}
	Assert(i == argc);
	memset(call, 0, sizeof(RlCall));
	call->key = charges[0].key->data;
	call->keylen = charges[0].key->len;
	call->script = &rl_script_check_all;
	call->argc = argc;
	call->argv = argv;
	call->argvlen = argvlen;
}

/*
 * Takes the reply (or failure) of a group's call (rl_group_call) of n
 * charges into d, *index and the charges, counts it, and frees the reply
 * and the call's arguments; rtt_us: how long it took. False, with failure
 * filled in, when Redis gave no decision.
 */
static bool
rl_group_result(RlCall *call, RlCharge *charges, int n, int64 rtt_us,
				RlDecision *d, int *index, RlFailure *failure)
{
	bool		ok;
	int			j;

	*failure = call->failure;
	ok = call->reply != NULL &&
		rl_parse_decision(call->conn, call->reply, NULL, d, charges, n, index,
						  failure);
	call->reply = NULL;
	pfree(call->argv);
	pfree(call->argvlen);
	for (j = 0; j < n; j++)
	{
		if (ok)
		{
			/* the call's decision, with this charge's own shadow verdict */
			RlDecision	cd = *d;

			cd.shadow_denied = charges[j].shadow_denied;
			rl_stats_decided(charges[j].key->data, charges[j].key->len, &cd,
							 charges[j].cost, rtt_us);
		}
		else
		{
			/* one outage is counted once, on the first key */
			rl_stats_failed(charges[j].key->data, charges[j].key->len, failure,
							j == 0);
			charges[j].failed = true;
		}
	}
	return ok;
}

/*
 * Decides n charges that share one hash slot in one script call: applied
 * to all or to none. Fills d with the most restrictive result and *index
 * with its charge (and each charge's clock and epoch). The charges are made
 * under the refund scopes given ("" for none). False, with failure filled
 * in, when Redis gave no decision.
 */
static bool
rl_decide_group(RlCharge *charges, int n, const char *scopes, RlDecision *d,
				int *index, RlFailure *failure)
{
	RlCall		call;
	TimestampTz start = rl_stats ? GetCurrentTimestamp() : 0;

	rl_group_call(charges, n, scopes, &call);
	call.reply = rl_call(call.key, call.keylen, call.script, call.argc,
						 call.argv, call.argvlen, &call.conn, &call.failure);
	return rl_group_result(&call, charges, n,
						   rl_stats ? GetCurrentTimestamp() - start : 0,
						   d, index, failure);
}

/*
 * Remembers n allowed charges for a refund on abort (by: who made them);
 * a shadow policy's that would deny took nothing.
 */
static void
rl_remember_charges(RlCharge *charges, int n, RlChargeBy by)
{
	int			j;

	for (j = 0; j < n; j++)
		if (!charges[j].shadow_denied)
			rl_remember_charge(charges[j].limit, charges[j].key, charges[j].cost,
						   charges[j].stamp_us, charges[j].epoch, by);
}

/* A charge and its place in the caller's array, to sort by hash slot. */
typedef struct RlHashSlotCharge
{
	int			hash_slot;
	int			index;
} RlHashSlotCharge;

/* qsort order of RlHashSlotCharge: by hash slot, then as the caller gave them */
static int
rl_hash_slot_charge_cmp(const void *a, const void *b)
{
	const RlHashSlotCharge *x = (const RlHashSlotCharge *) a;
	const RlHashSlotCharge *y = (const RlHashSlotCharge *) b;

	if (x->hash_slot != y->hash_slot)
		return (x->hash_slot > y->hash_slot) - (x->hash_slot < y->hash_slot);
	return (x->index > y->index) - (x->index < y->index);
}

/* True when decision a is more restrictive than b (as run_all.lua says). */
static bool
rl_tighter(const RlDecision *a, const RlDecision *b)
{
	if (a->allowed != b->allowed)
		return !a->allowed;
	if (!a->allowed)
	{
		if (a->retry_after_ms == -1 || b->retry_after_ms == -1)
			return a->retry_after_ms == -1 && b->retry_after_ms != -1;
		return a->retry_after_ms > b->retry_after_ms;
	}
	if (a->remaining != b->remaining)
		return a->remaining < b->remaining;
	return a->reset_ms > b->reset_ms;
}

/* A decision over several hash slots while its calls are out. */
typedef struct RlSplit
{
	RlCharge   *charges;		/* the caller's */
	RlHashSlotCharge *order;	/* charges by hash slot */
	RlCharge   *group;			/* the charges in that order */
	RlCall	   *calls;			/* one per hash slot */
	int		   *first;			/* a call's first charge in group */
	int		   *size;			/* and how many */
	int			ncalls;
	RlChargeBy	by;
	bool		covered;		/* refund_on_abort covers the charges */
	char		callscope[64];	/* else the refund scope of the call's own */
} RlSplit;

/*
 * Takes in the replies of a decision over several hash slots (interrupted:
 * an interrupt ended rl_call_many, and some calls have no reply): fills d,
 * *index and failure as rl_decide_charges says and gives back or remembers
 * the charges of each hash slot. Frees the replies; raises only when out of memory.
 */
static bool
rl_split_results(RlSplit *sp, bool interrupted, int64 rtt, RlDecision *d,
				 int *index, RlFailure *failure)
{
	RlCharge   *decided = palloc(sizeof(RlCharge) * Max(sp->first[sp->ncalls - 1] + sp->size[sp->ncalls - 1], 1));
	int			ndecided = 0;
	bool		found = false;
	bool		ok = !interrupted;
	int			g;
	int			k;

	for (g = 0; g < sp->ncalls; g++)
	{
		RlDecision	gd;
		RlFailure	gf = {0};
		int			gi;
		RlCharge   *gc = sp->group + sp->first[g];

		if (interrupted && sp->calls[g].reply == NULL)
		{
			pfree(sp->calls[g].argv);
			pfree(sp->calls[g].argvlen);
			continue;
		}
		if (!rl_group_result(&sp->calls[g], gc, sp->size[g], rtt, &gd, &gi, &gf))
		{
			if (ok)
				*failure = gf;
			ok = false;
			continue;
		}
		for (k = 0; k < sp->size[g]; k++)
		{
			sp->charges[sp->order[sp->first[g] + k].index].stamp_us = gc[k].stamp_us;
			sp->charges[sp->order[sp->first[g] + k].index].epoch = gc[k].epoch;
			sp->charges[sp->order[sp->first[g] + k].index].shadow_denied = gc[k].shadow_denied;
		}
		if (!found || rl_tighter(&gd, d))
		{
			*d = gd;
			*index = sp->order[sp->first[g] + gi].index;
			found = true;
		}
		if (!gd.allowed)
			continue;
		/* covered: an abort gives them back; else below when needed */
		if (sp->covered)
			rl_remember_charges(gc, sp->size[g], sp->by);
		else
		{
			/* a shadow policy's that would deny took nothing */
			for (k = 0; k < sp->size[g]; k++)
				if (!gc[k].shadow_denied)
					decided[ndecided++] = gc[k];
		}
	}
	for (k = 0; k < sp->first[sp->ncalls - 1] + sp->size[sp->ncalls - 1]; k++)
		if (sp->group[k].failed)
			sp->charges[sp->order[k].index].failed = true;

	/* a hash slot denied or failed, or an interrupt: the others' units go back */
	if (!sp->covered)
		rl_refund_call_end(sp->callscope, decided, ndecided,
						   !ok || !found || !d->allowed);
	pfree(decided);
	return ok;
}

/*
 * Decides n charges (a limit, a key and a cost each; cost < 0 gives back):
 * applied to all or to none. Fills d with the most restrictive result and
 * *index with its charge, and remembers the charges for a refund on abort
 * (by: who made them). False, with failure filled in, when Redis
 * gave no decision.
 *
 * Keys of one hash slot go in one script call, which is atomic. Keys in
 * several hash slots (a statement guard over many identities, in cluster
 * mode) go in one call per hash slot, all pipelined (rl_call_many): one
 * round trip per node. When one hash slot denies or fails, or an interrupt
 * ends the wait, the units the other hash slots took are given back: by the abort that follows
 * (the callers raise on a denial) when refund_on_abort covers them, else at
 * once. Meanwhile another caller may see them taken.
 */
static bool
rl_decide_charges(RlCharge *charges, int n, RlChargeBy by, RlDecision *d,
				  int *index, RlFailure *failure)
{
	RlSplit		sp;
	const char *scopes;
	MemoryContext cxt = CurrentMemoryContext;
	bool		hold = rl_command_timeout > 0;
	TimestampTz start;
	bool		ok;
	int			j;

	for (j = 0; j < n; j++)
	{
		charges[j].failed = false;
		charges[j].shadow_denied = false;
	}
	for (j = 1; j < n; j++)
		if (rl_route_hash_slot(charges[j].key->data, charges[j].key->len) !=
			rl_route_hash_slot(charges[0].key->data, charges[0].key->len))
			break;
	if (j >= n)
	{
		if (!rl_decide_group(charges, n, rl_refund_scopes(by), d, index, failure))
			return false;
		if (d->allowed)
			rl_remember_charges(charges, n, by);
		return true;
	}

	/*
	 * Several hash slots. When refund_on_abort covers the charges, they are
	 * made under the transaction's scopes as usual, and remembered as each
	 * hash slot allows (the abort that follows a denial, or an interrupt,
	 * gives them back); else under a scope of the call's own, which is
	 * given back at once when a hash slot denies or fails, or an interrupt
	 * ends the call.
	 */
	sp.charges = charges;
	sp.by = by;
	sp.covered = rl_refund_covers(sp.by);
	scopes = sp.covered ? rl_refund_scopes(sp.by) : rl_refund_call_scope(sp.callscope);
	scopes = pstrdup(scopes);
	sp.order = palloc(sizeof(RlHashSlotCharge) * n);
	for (j = 0; j < n; j++)
	{
		sp.order[j].hash_slot = rl_route_hash_slot(charges[j].key->data, charges[j].key->len);
		sp.order[j].index = j;
	}
	qsort(sp.order, n, sizeof(RlHashSlotCharge), rl_hash_slot_charge_cmp);
	sp.group = palloc(sizeof(RlCharge) * n);
	sp.first = palloc(sizeof(int) * n);
	sp.size = palloc(sizeof(int) * n);
	sp.calls = palloc(sizeof(RlCall) * n);
	sp.ncalls = 0;
	for (j = 0; j < n; j++)
		sp.group[j] = charges[sp.order[j].index];
	for (j = 0; j < n; j += sp.size[sp.ncalls++])
	{
		sp.first[sp.ncalls] = j;
		for (sp.size[sp.ncalls] = 1;
			 j + sp.size[sp.ncalls] < n &&
			 sp.order[j + sp.size[sp.ncalls]].hash_slot == sp.order[j].hash_slot;
			 sp.size[sp.ncalls]++)
			;
		rl_group_call(sp.group + j, sp.size[sp.ncalls], scopes, &sp.calls[sp.ncalls]);
	}

	/*
	 * A cancel while the calls are out would leave the charges of the calls
	 * whose reply was not read taken, unknowably: with command_timeout
	 * bounding each wait, the replies are read first and a cancel (or
	 * statement_timeout) served after. A terminate is not held back.
	 */
	start = GetCurrentTimestamp();
	if (hold)
		HOLD_CANCEL_INTERRUPTS();
	PG_TRY();
	{
		rl_call_many(sp.calls, sp.ncalls);
	}
	PG_CATCH();
	{
		RlFailure	ignored = {0};

		/* what came in is taken in (and given back) before the error goes on */
		MemoryContextSwitchTo(cxt);
		(void) rl_split_results(&sp, true, 0, d, index, &ignored);
		PG_RE_THROW();
	}
	PG_END_TRY();
	ok = rl_split_results(&sp, false,
						  rl_stats ? GetCurrentTimestamp() - start : 0,
						  d, index, failure);
	if (hold)
	{
		RESUME_CANCEL_INTERRUPTS();
		CHECK_FOR_INTERRUPTS();
	}
	pfree(sp.order);
	pfree(sp.group);
	pfree(sp.first);
	pfree(sp.size);
	pfree(sp.calls);
	pfree((char *) scopes);
	return ok;
}

/*
 * Counts, for the statistics, a several-keys call that rl_redis.on_error
 * decided (d) after rl_decide_charges failed: on the charges that failed.
 */
static void
rl_count_fallback(RlCharge *charges, int n, const RlDecision *d)
{
	int			j;

	for (j = 0; j < n; j++)
		if (charges[j].failed)
			rl_stats_decided(charges[j].key->data, charges[j].key->len, d,
							 charges[j].cost, 0);
}

/*
 * Decides n charges as rl_decide_charges does. When Redis gives no
 * decision, rl_redis.on_error decides d (as for the first charge, shadow
 * when every charge's policy is), and *index is 0.
 */
static void
rl_decide_all(RlCharge *charges, int n, RlChargeBy by, RlDecision *d,
			  int *index)
{
	RlFailure	failure = {0};
	RlCallContext ctx;
	RlLimit		fallback = *charges[0].limit;
	int			j;

	for (j = 1; j < n; j++)
		fallback.shadow = fallback.shadow && charges[j].limit->shadow;

	rl_context_push(&ctx, "decision", charges[0].limit->algorithm->name,
					charges[0].key->data, charges[0].key->len, n - 1);
	if (!rl_decide_charges(charges, n, by, d, index, &failure))
	{
		rl_apply_on_error(&failure, &fallback, charges[0].cost, d);
		rl_count_fallback(charges, n, d);
		*index = 0;
	}
	rl_context_pop(&ctx);
}

/*
 * Runs the script of charge c's limit for its identity and fills d; a
 * negative cost gives units back. An allowed charge is remembered for a
 * refund on abort (by: who made it). Applies on_error when Redis fails.
 * A dry run (c->dry_run) is decided by Redis alone (not the deny cache),
 * writes nothing, is remembered nowhere and is counted as a peek.
 */
static void
rl_decide_one(RlCharge *c, RlChargeBy by, RlDecision *d)
{
	const char *argv[12];
	size_t		argvlen[12];
	int			argc;
	char		lim_s[16],
				window_s[24],
				cost_s[16],
				burst_s[16],
				now_s[24];
	const RlLimit *limit = c->limit;
	int32		cost = c->cost;
	int32		counted = c->dry_run ? 0 : cost;	/* for the statistics */
	StringInfo	key = rl_build_key(c->identity, c->policy, limit);
	const char *scopes = cost > 0 && !c->dry_run ? rl_refund_scopes(by) : "";
	TimestampTz start;
	int64		sent_ms;
	uint64		mark;
	RlConn	   *conn;
	redisReply *reply;
	RlFailure	failure = {0};
	RlCallContext ctx;

	/* a denial remembered here answers without Redis (deny_cache) */
	if (!c->dry_run &&
		rl_deny_cache_lookup(key->data, key->len, limit, rl_server_generation(),
							 cost, d))
	{
		rl_stats_decided(key->data, key->len, d, cost, 0);
		return;
	}
	if (cost < 0)
		rl_deny_cache_forget();

	argv[2] = "1";
	argvlen[2] = 1;
	argv[3] = key->data;
	argvlen[3] = key->len;
	argv[4] = limit->algorithm->name;
	argvlen[4] = strlen(limit->algorithm->name);
	argv[5] = lim_s;
	argvlen[5] = pg_ltoa(limit->lim, lim_s);
	argv[6] = window_s;
	argvlen[6] = pg_lltoa(limit->window_ms, window_s);
	argv[7] = cost_s;
	argvlen[7] = pg_ltoa(cost, cost_s);
	argv[8] = burst_s;
	argvlen[8] = pg_ltoa(limit->burst, burst_s);
	argv[9] = now_s;
	argvlen[9] = rl_clock_arg(now_s);
	argv[10] = scopes;
	argvlen[10] = strlen(scopes);
	argv[11] = c->dry_run ? "1" : "";
	argvlen[11] = strlen(argv[11]);
	/* empty arguments at the end are left off: run_one.lua reads them as '' */
	argc = 12;
	while (argc > 9 && argvlen[argc - 1] == 0)
		argc--;

	start = rl_stats ? GetCurrentTimestamp() : 0;
	sent_ms = rl_deny_cache ? rl_deny_cache_now() : 0;
	mark = rl_deny_cache_mark();
	rl_context_push(&ctx, cost < 0 ? "refund" : "decision",
					limit->algorithm->name, key->data, key->len, 0);
	reply = rl_call(key->data, key->len, &limit->algorithm->script, argc, argv,
					argvlen, &conn, &failure);
	if (reply == NULL ||
		!rl_parse_decision(conn, reply, limit, d, NULL, 0, NULL, &failure))
	{
		rl_stats_failed(key->data, key->len, &failure, true);
		rl_apply_on_error(&failure, limit, cost, d);
		rl_context_pop(&ctx);
		rl_stats_decided(key->data, key->len, d, counted, 0);
		return;
	}
	rl_context_pop(&ctx);
	rl_stats_decided(key->data, key->len, d, counted,
					 rl_stats ? GetCurrentTimestamp() - start : 0);
	if (c->dry_run)
		return;
	if (cost < 0)
		rl_deny_cache_forget(); /* the units are back now */
	rl_deny_cache_store(key->data, key->len, limit, rl_server_generation(),
						cost, d, sent_ms, mark);
	/* a shadow policy's denial took nothing, and counts as a denial */
	if (d->allowed && !d->shadow_denied && cost > 0)
		rl_remember_charge(limit, key, cost, d->stamp_us, d->epoch, by);
	else if (cost > 0 && c->policy != NULL && rl_track_denials)
		rl_note_denial(c->policy, c->identity);
}

/* the most keys one batch script call decides (it holds Redis meanwhile) */
#define RL_BATCH_KEYS 500

/*
 * About the most keys (and key bytes) whose calls go in one pipeline round:
 * their keys and replies (about 700 bytes of hiredis memory per key) are
 * all held until the round is read.
 */
#define RL_BATCH_ROUND 10000
#define RL_BATCH_ROUND_BYTES (16 * 1024 * 1024)

/* about the most key bytes of one script call (it holds Redis meanwhile) */
#define RL_BATCH_CALL_BYTES (1024 * 1024)

/* A key of a batch: its hash slot and its place in the caller's array. */
typedef RlHashSlotCharge RlBatchKey;

/* A batch decision (rl_decide_each) while it is sent. */
typedef struct RlBatch
{
	const RlLimit *limit;
	int32		cost;
	RlBatchKey *keys;			/* by hash slot in cluster mode, else in order */
	const char *policy;			/* of every key, NULL for the limit's */
	/* the keys of the round being sent: keys[round_from + j] is round_key[j] */
	int			round_from;
	StringInfoData round_buf;
	const char **round_key;
	int		   *round_len;
	int		   *first;			/* a call's first key in keys */
	int		   *size;			/* and how many */
	RlCall	   *calls;			/* one per run of keys of one hash slot */
	RlFailure  *failures;		/* of each call; sqlerrcode 0: none */
	int			ncalls;
	RlDecision *d;				/* the decisions, in the caller's order */
	bool	   *bad;			/* no decision from Redis for that one */
	text	  **identities;		/* the caller's */
	text	  **denied;			/* denied identities, or NULL: not wanted */
	int			ndenied;
	/* the arguments after the keys, the same for every call */
	const char *args[7];
	size_t		argslen[7];
	char		numbers[4][24];
	char		clock[24];
} RlBatch;

/*
 * Turns the reply of a batch script call of n keys of limit into
 * d[keys[j].index] and frees it. A key Redis could not decide (its value
 * is of another type: run_many.lua returns its error in place of its
 * decision) gets bad[keys[j].index] set and, the first such, its error in
 * *failure. False, with failure filled in, when the reply is an error or
 * not what run_many.lua returns: then no key was decided.
 */
static bool
rl_parse_batch(RlConn *conn, redisReply *reply, const RlLimit *limit,
			   const RlBatchKey *keys, int n, RlDecision *d, bool *bad,
			   RlFailure *failure)
{
	RlDecision	checked;
	int			j;

	if (reply->type == REDIS_REPLY_ERROR)
	{
		rl_error_reply(conn, reply, failure);
		return false;
	}
	if (reply->type != REDIS_REPLY_ARRAY || reply->elements != (size_t) n)
		goto bad;
	/* every key's answer is read before any decision is taken from them */
	for (j = 0; j < n; j++)
		if (reply->element[j]->type != REDIS_REPLY_ERROR &&
			!rl_read_decision(reply->element[j], limit, &checked))
			goto bad;
	for (j = 0; j < n; j++)
	{
		redisReply *e = reply->element[j];

		if (e->type == REDIS_REPLY_ERROR)
		{
			if (failure->sqlerrcode == 0)
				rl_fail(failure, RL_FAILURE_REPLY, ERRCODE_CONNECTION_EXCEPTION,
						RL_HINT_NONE, e->str,
						"Redis at %s returned an error", rl_conn_name(conn));
			bad[keys[j].index] = true;
		}
		else
			rl_read_decision(e, limit, &d[keys[j].index]);
	}
	freeReplyObject(reply);
	return true;

bad:
	return rl_unexpected_reply(conn, reply, failure);
}

/* A key as a StringInfo (not to be appended to), for the callees. */
static StringInfoData
rl_key_info(const char *data, int len)
{
	StringInfoData info;

	info.data = (char *) data;
	info.len = len;
	info.maxlen = len + 1;
	info.cursor = 0;
	return info;
}

/*
 * Takes in the replies of the calls from..from+n-1 of a batch: fills the
 * decisions of the keys that got one, counts them, remembers allowed
 * charges for a refund on abort and notes the denied identities; frees
 * the replies and the calls' arguments. With interrupted (an interrupt
 * ended rl_call_many), the calls with no reply are passed over; else
 * bad[] is set for each key Redis gave no decision and failures[] filled
 * in. Raises only when out of memory.
 */
static void
rl_batch_results(RlBatch *b, int from, int n, int64 rtt, bool interrupted)
{
	int			c;
	int			j;

	for (c = from; c < from + n; c++)
	{
		RlCall	   *call = &b->calls[c];
		RlFailure	failure = {0};
		bool		ok;

		if (call->argv != NULL)
		{
			pfree((char *) call->argv[RL_SCRIPT_ARGV_RESERVED]);	/* numkeys */
			pfree(call->argv);
			pfree(call->argvlen);
			call->argv = NULL;
		}
		if (interrupted && call->reply == NULL)
			continue;
		/* the call's failure, if it got no reply */
		if (call->reply == NULL)
			failure = call->failure;
		ok = call->reply != NULL &&
			rl_parse_batch(call->conn, call->reply, b->limit,
						   b->keys + b->first[c], b->size[c], b->d, b->bad,
						   &failure);
		call->reply = NULL;
		if (!ok && failure.sqlerrcode == 0)
			rl_fail(&failure, RL_FAILURE_CONNECTION, ERRCODE_CONNECTION_FAILURE,
					RL_HINT_NONE, NULL,
					"no reply from Redis to a call of a batch");
		b->failures[c] = failure;
		for (j = b->first[c]; j < b->first[c] + b->size[c]; j++)
		{
			const RlBatchKey *k = &b->keys[j];
			RlDecision *r = &b->d[k->index];
			const char *kd = b->round_key[j - b->round_from];
			int			kl = b->round_len[j - b->round_from];

			if (!ok)
				b->bad[k->index] = true;
			if (b->bad[k->index])
				continue;
			rl_shadow_allow(b->limit, r);
			rl_stats_decided(kd, kl, r, b->cost, rtt);
			/* a shadow policy's denial took nothing, and counts as a denial */
			if (r->allowed && !r->shadow_denied && b->cost > 0)
			{
				StringInfoData key = rl_key_info(kd, kl);

				rl_remember_charge(b->limit, &key, b->cost, r->stamp_us,
								   r->epoch, RL_BY_CALL);
			}
			else if (b->cost > 0 && b->denied != NULL)
				b->denied[b->ndenied++] = b->identities[k->index];
		}
	}
}

/*
 * Sends the calls from..from+n-1 of a batch, one pipeline round
 * (rl_call_many), their arguments built here, and takes their replies in.
 * An interrupt takes in the replies read until then (their charges
 * remembered) before its error goes on.
 */
static void
rl_batch_round(RlBatch *b, int from, int n)
{
	MemoryContext cxt = CurrentMemoryContext;
	TimestampTz start;
	int			nkeys = b->first[from + n - 1] + b->size[from + n - 1] - b->first[from];
	int		   *offsets = palloc(sizeof(int) * nkeys);
	int			c;
	int			j;

	/* the round's keys, one after another in one buffer */
	b->round_from = b->first[from];
	b->round_key = palloc(sizeof(char *) * nkeys);
	b->round_len = palloc(sizeof(int) * nkeys);
	resetStringInfo(&b->round_buf);
	for (j = 0; j < nkeys; j++)
	{
		StringInfo	key = rl_build_key(b->identities[b->keys[b->round_from + j].index],
									   b->policy, b->limit);

		offsets[j] = b->round_buf.len;
		b->round_len[j] = key->len;
		appendBinaryStringInfo(&b->round_buf, key->data, key->len);
	}
	for (j = 0; j < nkeys; j++)
		b->round_key[j] = b->round_buf.data + offsets[j];
	pfree(offsets);

	for (c = from; c < from + n; c++)
	{
		RlCall	   *call = &b->calls[c];
		int			argc = RL_SCRIPT_ARGV_RESERVED + 1 + b->size[c] + 7;
		const char **argv = palloc(sizeof(char *) * argc);
		size_t	   *argvlen = palloc(sizeof(size_t) * argc);
		char	   *nkeys = palloc(16);
		int			a = RL_SCRIPT_ARGV_RESERVED;

		argv[a] = nkeys;
		argvlen[a++] = pg_ltoa(b->size[c], nkeys);
		for (j = b->first[c]; j < b->first[c] + b->size[c]; j++)
		{
			argv[a] = b->round_key[j - b->round_from];
			argvlen[a++] = b->round_len[j - b->round_from];
		}
		for (j = 0; j < 7; j++)
		{
			argv[a] = b->args[j];
			argvlen[a++] = b->argslen[j];
		}
		memset(call, 0, sizeof(RlCall));
		call->key = b->round_key[b->first[c] - b->round_from];
		call->keylen = b->round_len[b->first[c] - b->round_from];
		call->script = &rl_script_check_many;
		call->argc = argc;
		call->argv = argv;
		call->argvlen = argvlen;
	}

	start = GetCurrentTimestamp();
	PG_TRY();
	{
		rl_call_many(b->calls + from, n);
	}
	PG_CATCH();
	{
		MemoryContextSwitchTo(cxt);
		rl_batch_results(b, from, n, 0, true);
		PG_RE_THROW();
	}
	PG_END_TRY();
	rl_batch_results(b, from, n, rl_stats ? GetCurrentTimestamp() - start : 0,
					 false);
	pfree(b->round_key);
	pfree(b->round_len);
}

/* About the bytes the key of keys[i] of a batch takes: at most this. */
static size_t
rl_batch_key_bytes(const RlBatch *b, int i)
{
	/* the identity escaped (at most three bytes each) and the rest of the key */
	return 3 * (size_t) VARSIZE_ANY_EXHDR(b->identities[b->keys[i].index]) +
		strlen(rl_key_prefix) + (b->policy ? strlen(b->policy) : 0) + 96;
}

/* About the bytes the keys of call c of a batch take: at most this. */
static size_t
rl_batch_call_bytes(const RlBatch *b, int c)
{
	size_t		bytes = 0;
	int			i;

	for (i = b->first[c]; i < b->first[c] + b->size[c]; i++)
		bytes += rl_batch_key_bytes(b, i);
	return bytes;
}

/*
 * Decides, for each of req's n identities on its own, the limit of its
 * first charge, that charge's cost units each (not all or nothing: each
 * identity gets its own decision, in d[i]), on the policy's keys (policy
 * not NULL) or the explicit limit's. The keys of one
 * hash slot go in script calls of at most RL_BATCH_KEYS keys, and the
 * calls are pipelined (rl_call_many) in rounds of about RL_BATCH_ROUND
 * keys: one round trip per Redis node and round. The same identity given
 * twice is decided twice, in order. Allowed charges are remembered for a
 * refund on abort, denials of a policy counted for rl_top_denied; the keys
 * Redis gave no decision get rl_redis.on_error, after every reply is in.
 * Besides the caller's arrays it holds about 20 bytes per identity and
 * about 1 kB per script call, and the keys, arguments and replies of one
 * round.
 */
static void
rl_decide_each(const RlRequest *req, RlDecision *d)
{
	const RlLimit *limit = req->charges[0].limit;
	const char *policy = req->charges[0].policy;
	int32		cost = req->charges[0].cost;
	text	  **identities = req->identities;
	int			n = req->n;
	RlBatch		b;
	const char *scopes = cost > 0 ? rl_refund_scopes(RL_BY_CALL) : "";
	int			i,
				j,
				c;

	memset(&b, 0, sizeof(b));
	b.limit = limit;
	b.cost = cost;
	b.d = d;
	b.identities = identities;
	b.policy = policy;
	b.keys = palloc(sizeof(RlBatchKey) * Max(n, 1));
	b.bad = palloc0(sizeof(bool) * Max(n, 1));
	if (policy != NULL && rl_track_denials && cost > 0)
		b.denied = palloc(sizeof(text *) * Max(n, 1));
	initStringInfo(&b.round_buf);

	/* the keys are made round by round; in cluster mode sorted by hash slot */
	for (i = 0; i < n; i++)
	{
		b.keys[i].index = i;
		b.keys[i].hash_slot = 0;
		if (rl_topology()->hash_slots)
		{
			StringInfo	key = rl_build_key(identities[i], policy, limit);

			b.keys[i].hash_slot = rl_route_hash_slot(key->data, key->len);
		}
	}
	if (rl_topology()->hash_slots)
		qsort(b.keys, n, sizeof(RlBatchKey), rl_hash_slot_charge_cmp);

	/*
	 * One call per run of keys of one hash slot, at most RL_BATCH_KEYS keys
	 * and about RL_BATCH_CALL_BYTES.
	 */
	b.first = palloc(sizeof(int) * Max(n, 1));
	b.size = palloc(sizeof(int) * Max(n, 1));
	for (i = 0; i < n; i += b.size[b.ncalls++])
	{
		size_t		bytes = rl_batch_key_bytes(&b, i);

		b.first[b.ncalls] = i;
		for (b.size[b.ncalls] = 1;
			 i + b.size[b.ncalls] < n && b.size[b.ncalls] < RL_BATCH_KEYS &&
			 b.keys[i + b.size[b.ncalls]].hash_slot == b.keys[i].hash_slot &&
			 bytes + rl_batch_key_bytes(&b, i + b.size[b.ncalls]) <= RL_BATCH_CALL_BYTES;
			 b.size[b.ncalls]++)
			bytes += rl_batch_key_bytes(&b, i + b.size[b.ncalls]);
	}
	b.first = repalloc(b.first, sizeof(int) * Max(b.ncalls, 1));
	b.size = repalloc(b.size, sizeof(int) * Max(b.ncalls, 1));
	b.calls = palloc0(sizeof(RlCall) * Max(b.ncalls, 1));
	b.failures = palloc0(sizeof(RlFailure) * Max(b.ncalls, 1));

	/* algorithm, lim, window_ms, burst, cost, clock, scopes */
	b.args[0] = limit->algorithm->name;
	b.argslen[0] = strlen(limit->algorithm->name);
	b.args[1] = b.numbers[0];
	b.argslen[1] = pg_ltoa(limit->lim, b.numbers[0]);
	b.args[2] = b.numbers[1];
	b.argslen[2] = pg_lltoa(limit->window_ms, b.numbers[1]);
	b.args[3] = b.numbers[2];
	b.argslen[3] = pg_ltoa(limit->burst, b.numbers[2]);
	b.args[4] = b.numbers[3];
	b.argslen[4] = pg_ltoa(cost, b.numbers[3]);
	b.args[5] = b.clock;
	b.argslen[5] = rl_clock_arg(b.clock);
	b.args[6] = pstrdup(scopes);
	b.argslen[6] = strlen(scopes);

	/*
	 * Rounds of about RL_BATCH_ROUND keys and RL_BATCH_ROUND_BYTES: their
	 * keys and replies are held at once.
	 */
	for (c = 0; c < b.ncalls; c += j)
	{
		int			nkeys = b.size[c];
		size_t		bytes = rl_batch_call_bytes(&b, c);

		for (j = 1; c + j < b.ncalls && nkeys + b.size[c + j] <= RL_BATCH_ROUND &&
			 bytes + rl_batch_call_bytes(&b, c + j) <= RL_BATCH_ROUND_BYTES; j++)
		{
			nkeys += b.size[c + j];
			bytes += rl_batch_call_bytes(&b, c + j);
		}
		rl_batch_round(&b, c, j);
	}
	if (b.ndenied > 0)
		rl_note_denials(policy, b.denied, b.ndenied);

	/*
	 * The keys Redis gave no decision get on_error. A failure is counted
	 * (and warned of) once: rl_call_many gives the failure of a connection
	 * to the first of its calls, and copies without those flags to the
	 * others.
	 */
	for (c = 0; c < b.ncalls; c++)
	{
		bool		first_key = true;

		if (b.failures[c].sqlerrcode == 0)
			continue;
		for (j = b.first[c]; j < b.first[c] + b.size[c]; j++)
		{
			const RlBatchKey *k = &b.keys[j];
			StringInfo	key;
			RlCallContext ctx;

			if (!b.bad[k->index])
				continue;
			key = rl_build_key(identities[k->index], policy, limit);
			rl_stats_failed(key->data, key->len, &b.failures[c], first_key);
			rl_context_push(&ctx, cost < 0 ? "refund" : "decision",
							limit->algorithm->name, key->data, key->len, 0);
			rl_apply_on_error(&b.failures[c], limit, cost, &d[k->index]);
			rl_context_pop(&ctx);
			rl_stats_decided(key->data, key->len, &d[k->index], cost, 0);
			/* one warning per failure */
			b.failures[c].first_in_outage = false;
			first_key = false;
		}
	}
}

/*
 * Checks every charge of req before anything is sent: its limit
 * (rl_check_limit) and its identity (rl_check_identity: the bound of
 * rl_redis.max_identity_bytes where the charge can make state, the largest
 * one for a refund, which only touches state that exists).
 */
static void
rl_check_request(const RlRequest *req)
{
	int			nlimits = req->kind == RL_DECIDE_EACH ? 1 : req->n;
	int			i;

	for (i = 0; i < nlimits; i++)
		rl_check_limit(req->charges[i].limit);
	for (i = 0; i < req->n; i++)
	{
		text	   *identity = req->kind == RL_DECIDE_EACH ?
			req->identities[i] : req->charges[i].identity;

		rl_check_identity(VARSIZE_ANY_EXHDR(identity), req->rel,
						  req->charges[req->kind == RL_DECIDE_EACH ? 0 : i].cost < 0);
	}
}

/*
 * Decides the charges of req: the one entry point of every decision, refund
 * and batch (the SQL functions, policies, several limits, guards). Checks
 * every charge, makes its key (rl_build_key: the one key format, which
 * carries the numbers the state is counted under), sends the algorithms'
 * scripts (one call, a call per hash slot, or a batch's pipelined calls),
 * remembers what was taken for a refund on abort and applies
 * rl_redis.on_error when Redis gives no decision. d: the decision (ONE),
 * the most restrictive one (ALL), or one per identity (EACH). Returns the
 * index of the charge that decided d (ALL), else 0.
 */
int
rl_decide(const RlRequest *req, RlDecision *d)
{
	int			worst = 0;
	int			i;

	Assert(req->kind == RL_DECIDE_EACH ? req->n >= 0 :
		   req->n > 0 && (req->n == 1 || req->kind == RL_DECIDE_ALL));
	rl_check_request(req);
	switch (req->kind)
	{
		case RL_DECIDE_ONE:
			rl_decide_one(&req->charges[0], req->by, d);
			break;
		case RL_DECIDE_ALL:
			for (i = 0; i < req->n; i++)
				req->charges[i].key =
					rl_copy_key(rl_build_key(req->charges[i].identity,
											 req->charges[i].policy,
											 req->charges[i].limit));
			rl_decide_all(req->charges, req->n, req->by, d, &worst);
			break;
		case RL_DECIDE_EACH:
			if (req->n > 0)
				rl_decide_each(req, d);
			break;
		case RL_DECIDE_SLOT:
			rl_take_slot(&req->charges[0], d);
			break;
	}
	return worst;
}

/*
 * The rows of a batch function (rl_check_many, rl_<algorithm>_many): decides
 * limit (on the policy's keys when policy is not NULL) for each identity of
 * the text array argument argno, cost units each, and returns one row per
 * element, in the array's order: (identity, allowed, lim, remaining,
 * reset_ms, retry_after_ms). Every element is checked (rl_decide) before
 * Redis is asked anything.
 */
void
rl_batch_rows(FunctionCallInfo fcinfo, const RlLimit *limit,
			  const char *policy, int argno, int32 cost)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	ArrayType  *array;
	Datum	   *elems;
	bool	   *nulls;
	text	  **identities;
	RlDecision *d;
	int			n;
	int			i;

	if (PG_ARGISNULL(argno))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("identities must not be null")));
	array = PG_GETARG_ARRAYTYPE_P(argno);
	deconstruct_array(array, TEXTOID, -1, false, TYPALIGN_INT,
					  &elems, &nulls, &n);
	identities = palloc(sizeof(text *) * Max(n, 1));
	for (i = 0; i < n; i++)
	{
		if (nulls[i])
			ereport(ERROR,
					(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
					 errmsg("identities must not contain null")));
		identities[i] = DatumGetTextPP(elems[i]);
	}

	InitMaterializedSRF(fcinfo, 0);
	d = palloc(sizeof(RlDecision) * Max(n, 1));
	{
		RlCharge	charge = {limit, policy, NULL, cost};
		RlRequest	req = {RL_DECIDE_EACH, &charge, n, identities, RL_BY_CALL, NULL};

		rl_decide(&req, d);
	}
	for (i = 0; i < n; i++)
	{
		Datum		values[6];
		bool		rnulls[6] = {false, false, false, false, false, false};

		values[0] = PointerGetDatum(identities[i]);
		values[1] = BoolGetDatum(d[i].allowed);
		values[2] = Int32GetDatum(d[i].lim);
		values[3] = Int32GetDatum(d[i].remaining);
		values[4] = Int64GetDatum(d[i].reset_ms);
		values[5] = Int64GetDatum(d[i].retry_after_ms);
		tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values, rnulls);
	}
}

/* Returns d as an rl_result datum. */
Datum
rl_result_datum(FunctionCallInfo fcinfo, const RlDecision *d)
{
	TupleDesc	tupdesc = (TupleDesc) fcinfo->flinfo->fn_extra;
	Datum		values[5];
	bool		nulls[5] = {false, false, false, false, false};

	if (tupdesc == NULL)
	{
		MemoryContext old = MemoryContextSwitchTo(fcinfo->flinfo->fn_mcxt);

		if (get_call_result_type(fcinfo, NULL, &tupdesc) != TYPEFUNC_COMPOSITE)
			elog(ERROR, "return type must be a row type");
		tupdesc = BlessTupleDesc(CreateTupleDescCopy(tupdesc));
		fcinfo->flinfo->fn_extra = tupdesc;
		MemoryContextSwitchTo(old);
	}

	values[0] = BoolGetDatum(d->allowed);
	values[1] = Int32GetDatum(d->lim);
	values[2] = Int32GetDatum(d->remaining);
	values[3] = Int64GetDatum(d->reset_ms);
	values[4] = Int64GetDatum(d->retry_after_ms);
	return HeapTupleGetDatum(heap_form_tuple(tupdesc, values, nulls));
}

/* Returns a copy of key (from rl_build_key) that the next key leaves alone. */
StringInfo
rl_copy_key(StringInfo key)
{
	StringInfo	copy = makeStringInfo();

	appendBinaryStringInfo(copy, key->data, key->len);
	return copy;
}
