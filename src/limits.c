/*
 * limits.c
 *	  Decisions by explicit arguments, refunds, reset and ping.
 *
 * A decision checks its arguments, builds the identity's key, runs the
 * algorithm's script in Redis and turns the reply into an rl_result (or a
 * boolean). When Redis cannot give an answer, rl_redis.on_error decides:
 * raise the error, or log a warning and allow or deny. The helpers here are
 * shared with policy.c and concurrency.c.
 */
#include "postgres.h"

#include "access/htup_details.h"
#include "funcapi.h"
#include "utils/builtins.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"

#include "rl_redis.h"

/* The algorithms; their names appear in keys, rl_policy and the scripts. */
const RlAlgorithm rl_algorithms[] = {
	{"fixed", &rl_script_fixed_window},
	{"sliding", &rl_script_sliding_window},
	{"token_bucket", &rl_script_token_bucket},
	{"gcra", &rl_script_gcra},
	{"sliding_counter", &rl_script_sliding_counter},
};
const int	rl_num_algorithms = lengthof(rl_algorithms);

enum
{
	RL_FIXED, RL_SLIDING, RL_TOKEN_BUCKET, RL_GCRA, RL_SLIDING_COUNTER
};

/* reused for every key, so that a call allocates nothing */
static StringInfoData keybuf;

/* what a fail-closed decision tells the caller to wait */
#define RL_DENY_RETRY_MS 1000

/* Raises 22004 when argument argno is NULL. */
static void
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

/* Raises 22023 when a limit's numbers are out of range. */
void
rl_check_limit(const RlLimit *limit)
{
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
	if (limit->algorithm == &rl_algorithms[RL_SLIDING] &&
		limit->lim > RL_MAX_SLIDING_LIM)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("lim of a sliding window log must be at most %d",
						RL_MAX_SLIDING_LIM),
				 errdetail("The log keeps one entry per unit in the window."),
				 errhint("Use rl_sliding_counter for larger limits.")));
	if (limit->burst < 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("burst must be greater than zero")));
}

/*
 * Builds <key_prefix><kind>:{<identity>}[:<suffix>] in a buffer that the
 * next call reuses. The braces make every key of one identity hash to the
 * same Redis Cluster slot.
 */
StringInfo
rl_build_key(const char *kind, text *identity, const char *suffix)
{
	if (keybuf.data == NULL)
	{
		MemoryContext old = MemoryContextSwitchTo(TopMemoryContext);

		initStringInfo(&keybuf);
		MemoryContextSwitchTo(old);
	}
	resetStringInfo(&keybuf);
	appendStringInfoString(&keybuf, rl_key_prefix);
	appendStringInfoString(&keybuf, kind);
	appendBinaryStringInfo(&keybuf, ":{", 2);
	appendBinaryStringInfo(&keybuf, VARDATA_ANY(identity),
						   VARSIZE_ANY_EXHDR(identity));
	appendStringInfoChar(&keybuf, '}');
	if (suffix != NULL)
	{
		appendStringInfoChar(&keybuf, ':');
		appendStringInfoString(&keybuf, suffix);
	}
	return &keybuf;
}

/* Writes the scripts' clock argument into buf: the test clock, or "". */
size_t
rl_clock_arg(char *buf)
{
	if (rl_test_clock_ms > 0)
		return pg_lltoa((int64) (rl_test_clock_ms * 1000.0), buf);
	buf[0] = '\0';
	return 0;
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
 * Fills failure from a Redis error reply and frees the reply. A refused
 * authentication is a connection failure (08001); anything else Redis
 * refuses (OOM, READONLY, WRONGTYPE, NOPERM ...) is reported with its text.
 */
void
rl_error_reply(redisReply *reply, RlFailure *failure)
{
	failure->first_in_outage = true;
	if (strncmp(reply->str, "NOAUTH", 6) == 0 ||
		strncmp(reply->str, "WRONGPASS", 9) == 0)
	{
		failure->sqlerrcode = ERRCODE_SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION;
		snprintf(failure->message, sizeof(failure->message),
				 "could not authenticate to Redis at %s: %s",
				 rl_server_name(), reply->str);
	}
	else
	{
		failure->sqlerrcode = ERRCODE_CONNECTION_EXCEPTION;
		snprintf(failure->message, sizeof(failure->message),
				 "Redis at %s returned an error: %s",
				 rl_server_name(), reply->str);
	}
	freeReplyObject(reply);
}

/*
 * Turns a script's reply into d and frees it; false, with failure filled in,
 * when the reply is an error or not the five integers the scripts return.
 * With index, the reply has a sixth integer, stored there (as 0-based).
 */
bool
rl_parse_decision(redisReply *reply, RlDecision *d, int *index,
				  RlFailure *failure)
{
	size_t		n = index ? 6 : 5;
	size_t		i;

	if (reply->type == REDIS_REPLY_ERROR)
	{
		rl_error_reply(reply, failure);
		return false;
	}
	if (reply->type != REDIS_REPLY_ARRAY || reply->elements != n)
		goto bad;
	for (i = 0; i < n; i++)
		if (reply->element[i]->type != REDIS_REPLY_INTEGER)
			goto bad;

	d->allowed = reply->element[0]->integer != 0;
	d->from_redis = true;
	d->lim = (int32) reply->element[1]->integer;
	d->remaining = (int32) reply->element[2]->integer;
	d->reset_ms = reply->element[3]->integer;
	d->retry_after_ms = reply->element[4]->integer;
	if (index)
		*index = (int) reply->element[5]->integer - 1;
	freeReplyObject(reply);
	return true;

bad:
	freeReplyObject(reply);
	failure->first_in_outage = true;
	failure->sqlerrcode = ERRCODE_PROTOCOL_VIOLATION;
	snprintf(failure->message, sizeof(failure->message),
			 "unexpected reply from the rate-limit script at Redis %s",
			 rl_server_name());
	return false;
}

/*
 * Decides n charges (a limit, a key and a cost each; cost < 0 gives back) in
 * one script call: applied to all or to none. Fills d with the most
 * restrictive result and *index with its charge. False, with failure filled
 * in, when Redis gave no decision.
 */
bool
rl_decide_many(const RlCharge *charges, int n, RlDecision *d, int *index,
			   RlFailure *failure)
{
	int			argc = RL_SCRIPT_ARGV_RESERVED + 1 + n + 1 + 5 * n;
	const char **argv = palloc(sizeof(char *) * argc);
	size_t	   *argvlen = palloc(sizeof(size_t) * argc);
	char	   *numbers = palloc(n * 4 * 24 + 24);
	char	   *num = numbers;
	char		now_s[24];
	redisReply *reply;
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

	reply = rl_run_script(&rl_script_check_all, argc, argv, argvlen, failure);
	pfree(argv);
	pfree(argvlen);
	pfree(numbers);
	return reply != NULL && rl_parse_decision(reply, d, index, failure);
}

/*
 * Runs limit's script for identity (key suffix: a policy name, or NULL) and
 * fills d; cost < 0 gives units back. Applies on_error when Redis fails.
 */
void
rl_decide_limit(const RlLimit *limit, text *identity, const char *suffix,
				int32 cost, RlDecision *d)
{
	const char *argv[10];
	size_t		argvlen[10];
	char		lim_s[16],
				window_s[24],
				cost_s[16],
				burst_s[16],
				now_s[24];
	StringInfo	key = rl_build_key(limit->algorithm->name, identity, suffix);
	redisReply *reply;
	RlFailure	failure;

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

	reply = rl_run_script(limit->algorithm->script, 10, argv, argvlen,
						  &failure);
	if (reply == NULL || !rl_parse_decision(reply, d, NULL, &failure))
		rl_apply_on_error(&failure, limit->burst > 0 ? limit->burst : limit->lim,
						  cost, d);
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

/*
 * Decides (or refunds) for the arguments (identity, lim, window_ms,
 * cost-or-amount [, burst]) of the SQL function being called.
 */
static void
rl_decide_args(FunctionCallInfo fcinfo, int algorithm, bool refund,
			   RlDecision *d)
{
	RlLimit		limit;
	text	   *identity;
	int32		cost;

	identity = rl_get_identity(fcinfo, 0);
	rl_check_not_null(fcinfo, 1, "lim");
	rl_check_not_null(fcinfo, 2, "window_ms");
	limit.algorithm = &rl_algorithms[algorithm];
	limit.lim = PG_GETARG_INT32(1);
	limit.window_ms = PG_GETARG_INT64(2);
	limit.burst = 0;
	/* burst: NULL means the same as lim */
	if (PG_NARGS() > 4 && !PG_ARGISNULL(4))
	{
		limit.burst = PG_GETARG_INT32(4);
		if (limit.burst <= 0)
			limit.burst = -1;	/* rejected by rl_check_limit */
	}
	rl_check_limit(&limit);
	cost = rl_get_cost(fcinfo, 3, refund ? "amount" : "cost");

	rl_decide_limit(&limit, identity, NULL, refund ? -cost : cost, d);
	/* the key is built again only when a refund may need it */
	if (!refund && d->allowed && d->from_redis && rl_refund_wanted(false))
		rl_remember_charge(&limit, rl_build_key(limit.algorithm->name, identity, NULL),
						   cost, false);
}

/*
 * For each algorithm, three SQL functions over rl_decide_args:
 *   rl_<alg>(identity, lim, window_ms, cost [, burst])        -> rl_result
 *   rl_<alg>_allow(identity, lim, window_ms, cost [, burst])  -> boolean
 *   rl_<alg>_refund(identity, lim, window_ms, amount [, burst]) -> rl_result
 */
#define RL_ALGORITHM_FUNCTIONS(alg, index) \
PG_FUNCTION_INFO_V1(rl_##alg); \
Datum \
rl_##alg(PG_FUNCTION_ARGS) \
{ \
	RlDecision	d; \
	rl_decide_args(fcinfo, index, false, &d); \
	return rl_result_datum(fcinfo, &d); \
} \
PG_FUNCTION_INFO_V1(rl_##alg##_allow); \
Datum \
rl_##alg##_allow(PG_FUNCTION_ARGS) \
{ \
	RlDecision	d; \
	rl_decide_args(fcinfo, index, false, &d); \
	PG_RETURN_BOOL(d.allowed); \
} \
PG_FUNCTION_INFO_V1(rl_##alg##_refund); \
Datum \
rl_##alg##_refund(PG_FUNCTION_ARGS) \
{ \
	RlDecision	d; \
	rl_decide_args(fcinfo, index, true, &d); \
	return rl_result_datum(fcinfo, &d); \
}

RL_ALGORITHM_FUNCTIONS(fixed, RL_FIXED)
RL_ALGORITHM_FUNCTIONS(sliding, RL_SLIDING)
RL_ALGORITHM_FUNCTIONS(token_bucket, RL_TOKEN_BUCKET)
RL_ALGORITHM_FUNCTIONS(gcra, RL_GCRA)
RL_ALGORITHM_FUNCTIONS(sliding_counter, RL_SLIDING_COUNTER)

/*
 * Sends a command whose reply must not be an error and frees the reply;
 * raises on any failure, whatever on_error says.
 */
static void
rl_admin_command(int argc, const char **argv, const size_t *argvlen)
{
	RlFailure	failure;
	redisReply *reply = rl_command(argc, argv, argvlen, &failure);

	if (reply == NULL)
		rl_raise(&failure);
	if (reply->type == REDIS_REPLY_ERROR)
	{
		rl_error_reply(reply, &failure);
		rl_raise(&failure);
	}
	freeReplyObject(reply);
}

/* Returns a copy of key (from rl_build_key) that the next key leaves alone. */
StringInfo
rl_copy_key(StringInfo key)
{
	StringInfo	copy = makeStringInfo();

	appendBinaryStringInfo(copy, key->data, key->len);
	return copy;
}

PG_FUNCTION_INFO_V1(rl_reset);

/*
 * rl_reset(identity): deletes the identity's state of every algorithm, of
 * every named policy and of its concurrency slots.
 */
Datum
rl_reset(PG_FUNCTION_ARGS)
{
	text	   *identity = rl_get_identity(fcinfo, 0);
	List	   *keys = NIL;
	const char **argv;
	size_t	   *argvlen;
	ListCell   *lc;
	int			i;

	for (i = 0; i < rl_num_algorithms; i++)
		keys = lappend(keys, rl_copy_key(rl_build_key(rl_algorithms[i].name, identity, NULL)));
	keys = lappend(keys, rl_copy_key(rl_build_key("concurrency", identity, NULL)));
	rl_policy_reset_keys(fcinfo, identity, &keys);

	argv = palloc(sizeof(char *) * (list_length(keys) + 1));
	argvlen = palloc(sizeof(size_t) * (list_length(keys) + 1));
	argv[0] = "DEL";
	argvlen[0] = 3;
	i = 1;
	foreach(lc, keys)
	{
		StringInfo	key = (StringInfo) lfirst(lc);

		argv[i] = key->data;
		argvlen[i++] = key->len;
	}
	rl_admin_command(i, argv, argvlen);
	PG_RETURN_VOID();
}

PG_FUNCTION_INFO_V1(rl_redis_ping);

/*
 * rl_redis_ping(): checks the connection and returns the server and the
 * round-trip time of one PING on the (already open) connection.
 */
Datum
rl_redis_ping(PG_FUNCTION_ARGS)
{
	const char *argv[1] = {"PING"};
	size_t		argvlen[1] = {4};
	TimestampTz start;
	TupleDesc	tupdesc;
	Datum		values[2];
	bool		nulls[2] = {false, false};

	if (get_call_result_type(fcinfo, NULL, &tupdesc) != TYPEFUNC_COMPOSITE)
		elog(ERROR, "return type must be a row type");
	tupdesc = BlessTupleDesc(tupdesc);

	rl_breaker_reset();			/* an explicit check always tries */
	rl_admin_command(1, argv, argvlen); /* connects if needed */
	start = GetCurrentTimestamp();
	rl_admin_command(1, argv, argvlen);

	values[0] = CStringGetTextDatum(rl_server_name());
	values[1] = Float8GetDatum((GetCurrentTimestamp() - start) / 1000.0);
	PG_RETURN_DATUM(HeapTupleGetDatum(heap_form_tuple(tupdesc, values, nulls)));
}
