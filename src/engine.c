/*
 * engine.c
 *	  The decision engine: arguments, keys, the script call, its reply and
 *	  rl_result, and rl_redis.on_error.
 *
 * A decision checks its arguments, builds the identity's key, runs the
 * algorithm's script in Redis on the connection the key routes to and
 * turns the reply into an rl_result (or a boolean). When Redis cannot give
 * an answer, rl_redis.on_error decides: raise the error, or log a warning
 * and allow or deny. The SQL functions (functions.c, policy.c,
 * concurrency.c, guard.c) call it; it calls only refund.c, scripts.c and
 * transport.c.
 */
#include "postgres.h"

#include "access/htup_details.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "utils/builtins.h"
#include "utils/memutils.h"

#include "rl_redis.h"

/* reused for every key, so that a call allocates nothing */
static StringInfoData keybuf;

/* a reused buffer larger than this is given back after use */
#define RL_KEEP_BUFFER (64 * 1024)

/* what a fail-closed decision tells the caller to wait */
#define RL_DENY_RETRY_MS 1000

/* Raises 22004 when argument argno is NULL. */
void
rl_check_not_null(FunctionCallInfo fcinfo, int argno, const char *name)
{
	if (PG_ARGISNULL(argno))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("%s must not be null", name)));
}

/* Returns argument argno as a non-empty, non-null identity. */
text *
rl_get_identity(FunctionCallInfo fcinfo, int argno)
{
	text	   *identity;

	rl_check_not_null(fcinfo, argno, "identity");
	identity = PG_GETARG_TEXT_PP(argno);
	if (VARSIZE_ANY_EXHDR(identity) == 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("identity must not be empty")));
	return identity;
}

/* Returns argument argno as a cost (or amount): not null, not negative. */
int32
rl_get_cost(FunctionCallInfo fcinfo, int argno, const char *name)
{
	int32		cost;

	rl_check_not_null(fcinfo, argno, name);
	cost = PG_GETARG_INT32(argno);
	if (cost < 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s must not be negative", name)));
	return cost;
}

/*
 * Raises 22023 when a limit's numbers are out of range: lim and window_ms
 * positive, window_ms at most 100 years, the whole burst refilled within
 * 100 years (so that every time the scripts compute is exact in a double
 * and every expiry fits), a sliding log no longer than
 * rl_redis.sliding_max_lim.
 */
void
rl_check_limit(const RlLimit *limit)
{
	int32		cap = limit->burst > 0 ? limit->burst : limit->lim;

	if (limit->lim <= 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("lim must be greater than zero")));
	if (limit->window_ms <= 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("window_ms must be greater than zero")));
	if (limit->window_ms > RL_MAX_WINDOW_MS)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("window_ms must be at most " INT64_FORMAT " (100 years)",
						RL_MAX_WINDOW_MS)));
	if (limit->burst < 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("burst must be greater than zero")));
	/* cap * window_ms / lim <= 100 years, without overflow */
	if ((double) cap * (double) limit->window_ms >
		(double) limit->lim * (double) RL_MAX_WINDOW_MS)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("burst %d is too large for a rate of %d per " INT64_FORMAT " ms",
						cap, limit->lim, limit->window_ms),
				 errdetail("Refilling the whole burst must take at most 100 years (burst * window_ms / lim <= " INT64_FORMAT ").",
						   RL_MAX_WINDOW_MS)));
	if (limit->algorithm->log && limit->lim > rl_sliding_max_lim)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("lim of a sliding window log must be at most %d",
						rl_sliding_max_lim),
				 errdetail("The log keeps one entry per unit in the window; rl_redis.sliding_max_lim bounds it."),
				 errhint("Use rl_sliding_counter for larger limits.")));
}

/*
 * Builds <key_prefix><kind>:{<identity>}[:<suffix>] in a buffer that the
 * next call reuses. The braces make every key of one identity hash to the
 * same Redis Cluster slot; inside them '%', '{' and '}' are percent-encoded,
 * so that the hash tag is never empty and never ends early, and two
 * identities never share a key.
 */
StringInfo
rl_build_key(const char *kind, text *identity, const char *suffix)
{
	const char *p = VARDATA_ANY(identity);
	const char *end = p + VARSIZE_ANY_EXHDR(identity);
	const char *run = p;

	if (keybuf.data == NULL)
	{
		MemoryContext old = MemoryContextSwitchTo(TopMemoryContext);

		initStringInfo(&keybuf);
		MemoryContextSwitchTo(old);
	}
	else if (keybuf.maxlen > RL_KEEP_BUFFER)
	{
		/* a huge identity does not keep its buffer for the backend's life */
		pfree(keybuf.data);
		keybuf.data = MemoryContextAlloc(TopMemoryContext, 1024);
		keybuf.maxlen = 1024;
	}
	resetStringInfo(&keybuf);
	appendStringInfoString(&keybuf, rl_key_prefix);
	appendStringInfoString(&keybuf, kind);
	appendBinaryStringInfo(&keybuf, ":{", 2);
	for (; p < end; p++)
	{
		if (*p != '%' && *p != '{' && *p != '}')
			continue;
		appendBinaryStringInfo(&keybuf, run, p - run);
		appendStringInfoString(&keybuf, *p == '%' ? "%25" : *p == '{' ? "%7B" : "%7D");
		run = p + 1;
	}
	appendBinaryStringInfo(&keybuf, run, end - run);
	appendStringInfoChar(&keybuf, '}');
	if (suffix != NULL)
	{
		appendStringInfoChar(&keybuf, ':');
		appendStringInfoString(&keybuf, suffix);
	}
	return &keybuf;
}

/*
 * Writes the key suffix of an explicit limit, "<lim>/<window_ms>[/<burst>]",
 * into buf (at least 64 bytes) and returns it: two limits on one identity
 * are two counters.
 */
const char *
rl_limit_suffix(const RlLimit *limit, char *buf)
{
	if (limit->burst > 0)
		snprintf(buf, 64, "%d/" INT64_FORMAT "/%d", limit->lim,
				 limit->window_ms, limit->burst);
	else
		snprintf(buf, 64, "%d/" INT64_FORMAT, limit->lim, limit->window_ms);
	return buf;
}
/* Raises a failure as an error. */
void
rl_raise(const RlFailure *failure)
{
	ereport(ERROR,
			(errcode(failure->sqlerrcode),
			 errmsg_internal("%s", failure->message)));
}

/*
 * Applies rl_redis.on_error to a failed call: raises the failure, or logs it
 * and fills d with the configured decision.
 */
void
rl_apply_on_error(const RlFailure *failure, int32 lim, int32 cost,
				  RlDecision *d)
{
	if (rl_on_error == RL_ON_ERROR_ERROR)
		rl_raise(failure);

	d->allowed = (rl_on_error == RL_ON_ERROR_ALLOW);
	d->from_redis = false;
	d->lim = lim;
	d->reset_ms = 0;
	if (d->allowed)
	{
		d->remaining = Max(lim - Max(cost, 0), 0);
		d->retry_after_ms = 0;
	}
	else
	{
		d->remaining = 0;
		d->retry_after_ms = RL_DENY_RETRY_MS;
	}
	/* one warning per outage, not one per call */
	if (failure->first_in_outage)
		ereport(WARNING,
				(errcode(failure->sqlerrcode),
				 errmsg_internal("%s", failure->message),
				 errdetail("Requests are %s without a decision from Redis because rl_redis.on_error is \"%s\".",
						   d->allowed ? "allowed" : "denied",
						   d->allowed ? "allow" : "deny")));
}

/*
 * Turns a script's reply into d and frees it; false, with failure filled in,
 * when the reply is an error or not the integers the scripts return: the
 * decision, its clock and the key's epoch, or, with charges (a
 * several-limits call of n charges), the most restrictive decision, its
 * index (stored in *index, 0-based), and the clock and epoch of every
 * charge (stored in charges[i]).
 */
bool
rl_parse_decision(RlConn *conn, redisReply *reply, RlDecision *d,
				  RlCharge *charges, int n, int *index, RlFailure *failure)
{
	size_t		expected = charges ? 6 + 2 * n : 7;
	size_t		i;

	if (reply->type == REDIS_REPLY_ERROR)
	{
		rl_error_reply(conn, reply, failure);
		return false;
	}
	if (reply->type != REDIS_REPLY_ARRAY || reply->elements != expected)
		goto bad;
	for (i = 0; i < expected; i++)
		if (reply->element[i]->type != REDIS_REPLY_INTEGER)
			goto bad;
	if (reply->element[1]->integer <= 0 || reply->element[1]->integer > PG_INT32_MAX ||
		reply->element[2]->integer < 0 || reply->element[2]->integer > PG_INT32_MAX)
		goto bad;
	if (charges && (reply->element[5]->integer < 1 || reply->element[5]->integer > n))
		goto bad;

	d->allowed = reply->element[0]->integer != 0;
	d->from_redis = true;
	d->lim = (int32) reply->element[1]->integer;
	d->remaining = (int32) reply->element[2]->integer;
	d->reset_ms = reply->element[3]->integer;
	d->retry_after_ms = reply->element[4]->integer;
	if (charges)
	{
		*index = (int) reply->element[5]->integer - 1;
		for (i = 0; i < (size_t) n; i++)
		{
			charges[i].stamp_us = reply->element[6 + i]->integer;
			charges[i].epoch = reply->element[6 + n + i]->integer;
		}
		d->stamp_us = charges[*index].stamp_us;
		d->epoch = charges[*index].epoch;
	}
	else
	{
		d->stamp_us = reply->element[5]->integer;
		d->epoch = reply->element[6]->integer;
	}
	freeReplyObject(reply);
	return true;

bad:
	freeReplyObject(reply);
	failure->first_in_outage = true;
	failure->breaker_opened = false;
	failure->sqlerrcode = ERRCODE_PROTOCOL_VIOLATION;
	snprintf(failure->message, sizeof(failure->message),
			 "unexpected reply from the rate-limit script at Redis %s",
			 rl_conn_name(conn));
	return false;
}

/*
 * Decides n charges that share one cluster slot in one script call: applied
 * to all or to none. Fills d with the most restrictive result and *index
 * with its charge (and each charge's clock and epoch). The charges are made
 * under the refund scopes given ("" for none). False, with failure filled
 * in, when Redis gave no decision.
 */
static bool
rl_decide_group(RlCharge *charges, int n, const char *scopes, RlDecision *d,
				int *index, RlFailure *failure)
{
	int			argc = RL_SCRIPT_ARGV_RESERVED + 1 + n + 2 + 5 * n;
	const char **argv = palloc(sizeof(char *) * argc);
	size_t	   *argvlen = palloc(sizeof(size_t) * argc);
	char	   *numbers = palloc(n * 4 * 24 + 24);
	char	   *num = numbers;
	char		now_s[24];
	TimestampTz start;
	RlConn	   *conn;
	redisReply *reply;
	bool		ok;
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
	argv[i] = now_s;
	argvlen[i++] = rl_clock_arg(now_s);
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
	}
	Assert(i == argc);

	start = rl_stats ? GetCurrentTimestamp() : 0;
	reply = rl_call(charges[0].key->data, charges[0].key->len,
					&rl_script_check_all, argc, argv, argvlen, &conn, failure);
	pfree(argv);
	pfree(argvlen);
	pfree(numbers);
	ok = reply != NULL &&
		rl_parse_decision(conn, reply, d, charges, n, index, failure);
	for (j = 0; j < n; j++)
	{
		if (ok)
			rl_stats_decided(charges[j].key->data, charges[j].key->len, d,
							 charges[j].cost,
							 rl_stats ? GetCurrentTimestamp() - start : 0);
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

/* Remembers n allowed charges for a refund on abort (by: who made them). */
static void
rl_remember_charges(RlCharge *charges, int n, RlChargeBy by)
{
	int			j;

	for (j = 0; j < n; j++)
		rl_remember_charge(charges[j].limit, charges[j].key, charges[j].cost,
						   charges[j].stamp_us, charges[j].epoch, by);
}

/* A charge and its place in the caller's array, to sort by slot. */
typedef struct RlSlotCharge
{
	int			slot;
	int			index;
} RlSlotCharge;

/* qsort order of RlSlotCharge: by slot, then as the caller gave them */
static int
rl_slot_charge_cmp(const void *a, const void *b)
{
	const RlSlotCharge *x = (const RlSlotCharge *) a;
	const RlSlotCharge *y = (const RlSlotCharge *) b;

	if (x->slot != y->slot)
		return (x->slot > y->slot) - (x->slot < y->slot);
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

/*
 * Decides n charges (a limit, a key and a cost each; cost < 0 gives back):
 * applied to all or to none. Fills d with the most restrictive result and
 * *index with its charge, and remembers the charges for a refund on abort
 * (by_guard: made by a guard). False, with failure filled in, when Redis
 * gave no decision.
 *
 * Keys of one cluster slot go in one script call, which is atomic. Keys in
 * several slots (a statement guard over many identities, in cluster mode)
 * are decided one slot after another, until one denies or fails; the units
 * taken in the slots before it are then given back: by the abort that
 * follows (the callers raise on a denial) when refund_on_abort covers them,
 * else at once. Meanwhile another caller may see them taken.
 */
bool
rl_decide_many(RlCharge *charges, int n, bool by_guard, RlDecision *d,
			   int *index, RlFailure *failure)
{
	RlChargeBy	by = by_guard ? RL_BY_GUARD : RL_BY_CALL;
	RlSlotCharge *order;
	RlCharge   *group;
	RlCharge   *decided;
	volatile int ndecided = 0;
	bool		covered;
	const char *scopes;
	char		callscope[64];
	volatile bool found = false;
	volatile bool ok = true;
	volatile int j;
	volatile int size = 1;
	int			k;

	for (j = 0; j < n; j++)
		charges[j].failed = false;
	for (j = 1; j < n; j++)
		if (rl_route_slot(charges[j].key->data, charges[j].key->len) !=
			rl_route_slot(charges[0].key->data, charges[0].key->len))
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
	 * Several slots. When refund_on_abort covers the charges, they are made
	 * under the transaction's scopes as usual, and remembered as each slot
	 * allows (the abort that follows a denial, or an interrupt, gives them
	 * back); else under a scope of the call's own, which is given back at
	 * once when a slot denies or fails, or an interrupt ends the call.
	 */
	covered = rl_refund_covers(by);
	scopes = covered ? rl_refund_scopes(by) : rl_refund_call_scope(callscope);
	scopes = pstrdup(scopes);

	order = palloc(sizeof(RlSlotCharge) * n);
	for (j = 0; j < n; j++)
	{
		order[j].slot = rl_route_slot(charges[j].key->data, charges[j].key->len);
		order[j].index = j;
	}
	qsort(order, n, sizeof(RlSlotCharge), rl_slot_charge_cmp);
	group = palloc(sizeof(RlCharge) * n);
	decided = palloc(sizeof(RlCharge) * n);
	PG_TRY();
	{
		for (j = 0; j < n; j += size)
		{
			RlDecision	gd;
			int			gi;

			for (size = 1; j + size < n && order[j + size].slot == order[j].slot; size++)
				;
			for (k = 0; k < size; k++)
				group[k] = charges[order[j + k].index];
			ok = rl_decide_group(group, size, scopes, &gd, &gi, failure);
			if (!ok)
				break;
			for (k = 0; k < size; k++)
			{
				charges[order[j + k].index].stamp_us = group[k].stamp_us;
				charges[order[j + k].index].epoch = group[k].epoch;
			}
			if (!found || rl_tighter(&gd, d))
			{
				*d = gd;
				*index = order[j + gi].index;
				found = true;
			}
			if (!gd.allowed)
				break;
			if (covered)
				rl_remember_charges(group, size, by);
			else
				memcpy(decided + ndecided, group, sizeof(RlCharge) * size);
			ndecided += size;
		}
	}
	PG_CATCH();
	{
		/* an interrupt: what the slots before took goes back */
		if (!covered)
			rl_refund_call_end(callscope, decided, ndecided, true);
		PG_RE_THROW();
	}
	PG_END_TRY();

	/* a failure: the group that failed and those not tried are its charges */
	for (k = j; !ok && k < n; k++)
	{
		charges[order[k].index].failed = true;
		if (k >= j + size)
			rl_stats_failed(charges[order[k].index].key->data,
							charges[order[k].index].key->len, failure, false);
	}
	if (!covered)
		rl_refund_call_end(callscope, decided, ndecided, j < n);
	pfree(order);
	pfree(group);
	pfree(decided);
	pfree((char *) scopes);
	return ok;
}

/*
 * Runs limit's script for identity and fills d; cost < 0 gives units back.
 * The key is the policy's (policy not NULL) or the explicit limit's. An
 * allowed charge is remembered for a refund on abort (by_guard: made by a
 * guard). Applies on_error when Redis fails.
 */
void
rl_decide_limit(const RlLimit *limit, text *identity, const char *policy,
				int32 cost, bool by_guard, RlDecision *d)
{
	const char *argv[11];
	size_t		argvlen[11];
	char		lim_s[16],
				window_s[24],
				cost_s[16],
				burst_s[16],
				now_s[24],
				suffix[64];
	StringInfo	key = rl_build_key(limit->algorithm->name, identity,
								   policy ? policy : rl_limit_suffix(limit, suffix));
	RlChargeBy	by = by_guard ? RL_BY_GUARD : RL_BY_CALL;
	const char *scopes = cost > 0 ? rl_refund_scopes(by) : "";
	TimestampTz start;
	RlConn	   *conn;
	redisReply *reply;
	RlFailure	failure = {0};

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

	start = rl_stats ? GetCurrentTimestamp() : 0;
	reply = rl_call(key->data, key->len, &limit->algorithm->script, 11, argv,
					argvlen, &conn, &failure);
	if (reply == NULL ||
		!rl_parse_decision(conn, reply, d, NULL, 0, NULL, &failure))
	{
		rl_stats_failed(key->data, key->len, &failure, true);
		rl_apply_on_error(&failure, limit->burst > 0 ? limit->burst : limit->lim,
						  cost, d);
		rl_stats_decided(key->data, key->len, d, cost, 0);
		return;
	}
	rl_stats_decided(key->data, key->len, d, cost,
					 rl_stats ? GetCurrentTimestamp() - start : 0);
	if (d->allowed && cost > 0)
		rl_remember_charge(limit, key, cost, d->stamp_us, d->epoch, by);
	else if (!d->allowed && cost > 0 && policy != NULL && rl_track_denials)
		rl_note_denial(policy, identity);
}

/*
 * Counts, for the statistics, a several-keys call that rl_redis.on_error
 * decided (d) after rl_decide_many failed: on the charges that failed.
 */
void
rl_count_fallback(RlCharge *charges, int n, const RlDecision *d)
{
	int			j;

	for (j = 0; j < n; j++)
		if (charges[j].failed)
			rl_stats_decided(charges[j].key->data, charges[j].key->len, d,
							 charges[j].cost, 0);
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
