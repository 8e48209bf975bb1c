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
#include "miscadmin.h"
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

/* a reused buffer larger than this is given back after use */
#define RL_KEEP_BUFFER (64 * 1024)

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
	if (limit->algorithm == &rl_algorithms[RL_SLIDING] &&
		limit->lim > rl_sliding_max_lim)
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
	/* Redis 7 refuses commands of more than 10 words before AUTH */
	if (strncmp(reply->str, "NOAUTH", 6) == 0 ||
		strncmp(reply->str, "WRONGPASS", 9) == 0 ||
		strncmp(reply->str, "ERR Protocol error: unauthenticated", 35) == 0)
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
 * when the reply is an error or not the integers the scripts return: the
 * decision, its clock and the key's epoch, or, with charges (a
 * several-limits call of n charges), the most restrictive decision, its
 * index (stored in *index, 0-based), and the clock and epoch of every
 * charge (stored in charges[i]).
 */
bool
rl_parse_decision(redisReply *reply, RlDecision *d, RlCharge *charges, int n,
				  int *index, RlFailure *failure)
{
	size_t		expected = charges ? 6 + 2 * n : 7;
	size_t		i;

	if (reply->type == REDIS_REPLY_ERROR)
	{
		rl_error_reply(reply, failure);
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
	failure->sqlerrcode = ERRCODE_PROTOCOL_VIOLATION;
	snprintf(failure->message, sizeof(failure->message),
			 "unexpected reply from the rate-limit script at Redis %s",
			 rl_server_name());
	return false;
}

/*
 * Decides n charges (a limit, a key and a cost each; cost < 0 gives back) in
 * one script call: applied to all or to none. Fills d with the most
 * restrictive result and *index with its charge, and remembers the charges
 * for a refund on abort (by_guard: made by a guard). False, with failure
 * filled in, when Redis gave no decision.
 */
bool
rl_decide_many(RlCharge *charges, int n, bool by_guard, RlDecision *d,
			   int *index, RlFailure *failure)
{
	int			argc = RL_SCRIPT_ARGV_RESERVED + 1 + n + 2 + 5 * n;
	const char **argv = palloc(sizeof(char *) * argc);
	size_t	   *argvlen = palloc(sizeof(size_t) * argc);
	char	   *numbers = palloc(n * 4 * 24 + 24);
	char	   *num = numbers;
	char		now_s[24];
	const char *scopes = rl_refund_scopes(by_guard);
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

	reply = rl_run_script(&rl_script_check_all, argc, argv, argvlen, failure);
	pfree(argv);
	pfree(argvlen);
	pfree(numbers);
	ok = reply != NULL && rl_parse_decision(reply, d, charges, n, index, failure);
	if (ok && d->allowed)
		for (j = 0; j < n; j++)
			rl_remember_charge(charges[j].limit, charges[j].key, charges[j].cost,
							   charges[j].stamp_us, charges[j].epoch, by_guard);
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
	const char *scopes = cost > 0 ? rl_refund_scopes(by_guard) : "";
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
	argv[10] = scopes;
	argvlen[10] = strlen(scopes);

	reply = rl_run_script(limit->algorithm->script, 11, argv, argvlen,
						  &failure);
	if (reply == NULL || !rl_parse_decision(reply, d, NULL, 0, NULL, &failure))
	{
		rl_apply_on_error(&failure, limit->burst > 0 ? limit->burst : limit->lim,
						  cost, d);
		return;
	}
	if (d->allowed && cost > 0)
		rl_remember_charge(limit, key, cost, d->stamp_us, d->epoch, by_guard);
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

	rl_decide_limit(&limit, identity, NULL, refund ? -cost : cost, false, d);
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

/* Appends s (len bytes) to buf with the glob characters of SCAN escaped. */
static void
rl_append_glob_escaped(StringInfo buf, const char *s, int len)
{
	int			i;

	for (i = 0; i < len; i++)
	{
		if (strchr("*?[]\\", s[i]) != NULL)
			appendStringInfoChar(buf, '\\');
		appendStringInfoChar(buf, s[i]);
	}
}

/*
 * True when key is one of rl_redis's keys of the identity whose braces part
 * is tag ("{<encoded identity>}"): <prefix><kind>:<tag> or
 * <prefix><kind>:<tag>:<suffix>, kind an algorithm or "concurrency". (SCAN's
 * pattern also matches other applications' keys and longer prefixes.)
 */
static bool
rl_reset_owns(const char *key, size_t len, const char *tag, size_t taglen)
{
	size_t		prefix_len = strlen(rl_key_prefix);
	int			i;

	if (len < prefix_len || memcmp(key, rl_key_prefix, prefix_len) != 0)
		return false;
	key += prefix_len;
	len -= prefix_len;
	for (i = -1; i < rl_num_algorithms; i++)
	{
		const char *kind = i < 0 ? "concurrency" : rl_algorithms[i].name;
		size_t		kindlen = strlen(kind);

		if (len >= kindlen + 1 + taglen &&
			memcmp(key, kind, kindlen) == 0 && key[kindlen] == ':' &&
			memcmp(key + kindlen + 1, tag, taglen) == 0 &&
			(len == kindlen + 1 + taglen || key[kindlen + 1 + taglen] == ':'))
			return true;
	}
	return false;
}

/*
 * Sends one SCAN step for pattern from cursor and DELetes the keys it
 * returns that belong to the identity (tag, see rl_reset_owns); returns the
 * next cursor ("0" when done) in cursor.
 */
static void
rl_reset_step(StringInfo pattern, const char *tag, size_t taglen,
			  char *cursor, size_t cursorsize)
{
	int			ndel = 1;
	const char *argv[6] = {"SCAN", cursor, "MATCH", pattern->data, "COUNT", "1000"};
	size_t		argvlen[6] = {4, strlen(cursor), 5, pattern->len, 5, 4};
	RlFailure	failure;
	redisReply *reply = rl_command(6, argv, argvlen, &failure);
	redisReply *keys;
	const char **del;
	size_t	   *dellen;
	size_t		i;

	if (reply == NULL)
		rl_raise(&failure);
	if (reply->type == REDIS_REPLY_ERROR)
	{
		rl_error_reply(reply, &failure);
		rl_raise(&failure);
	}
	if (reply->type != REDIS_REPLY_ARRAY || reply->elements != 2 ||
		reply->element[0]->type != REDIS_REPLY_STRING ||
		reply->element[0]->len >= cursorsize ||
		reply->element[1]->type != REDIS_REPLY_ARRAY)
	{
		freeReplyObject(reply);
		ereport(ERROR,
				(errcode(ERRCODE_PROTOCOL_VIOLATION),
				 errmsg("unexpected reply to SCAN from Redis at %s",
						rl_server_name())));
	}
	keys = reply->element[1];
	memcpy(cursor, reply->element[0]->str, reply->element[0]->len);
	cursor[reply->element[0]->len] = '\0';
	if (keys->elements > 0)
	{
		del = palloc(sizeof(char *) * (keys->elements + 1));
		dellen = palloc(sizeof(size_t) * (keys->elements + 1));
		del[0] = "DEL";
		dellen[0] = 3;
		for (i = 0; i < keys->elements; i++)
		{
			redisReply *k = keys->element[i];

			if (k->type != REDIS_REPLY_STRING)
			{
				freeReplyObject(reply);
				ereport(ERROR,
						(errcode(ERRCODE_PROTOCOL_VIOLATION),
						 errmsg("unexpected reply to SCAN from Redis at %s",
								rl_server_name())));
			}
			if (!rl_reset_owns(k->str, k->len, tag, taglen))
				continue;
			del[ndel] = k->str;
			dellen[ndel++] = k->len;
		}
		PG_TRY();
		{
			if (ndel > 1)
				rl_admin_command(ndel, del, dellen);
		}
		PG_FINALLY();
		{
			freeReplyObject(reply);
		}
		PG_END_TRY();
		pfree(del);
		pfree(dellen);
		return;
	}
	freeReplyObject(reply);
}

PG_FUNCTION_INFO_V1(rl_reset);

/*
 * rl_reset(identity): deletes every key of the identity under
 * rl_redis.key_prefix: the state of every algorithm, explicit limit and
 * policy (also of policies deleted since) and its concurrency slots, and no
 * other key. It walks the key space with SCAN, so it takes longer on a
 * large Redis.
 */
Datum
rl_reset(PG_FUNCTION_ARGS)
{
	text	   *identity = rl_get_identity(fcinfo, 0);
	StringInfo	key = rl_copy_key(rl_build_key("", identity, NULL));
	StringInfoData pattern;
	char		cursor[32] = "0";
	int			prefix_len = strlen(rl_key_prefix);

	/* <prefix>*:{<identity>}* with the key's own bytes escaped */
	initStringInfo(&pattern);
	rl_append_glob_escaped(&pattern, key->data, prefix_len);
	appendStringInfoString(&pattern, "*:");
	rl_append_glob_escaped(&pattern, key->data + prefix_len + 1,
						   key->len - prefix_len - 1);
	appendStringInfoChar(&pattern, '*');
	do
	{
		CHECK_FOR_INTERRUPTS();
		rl_reset_step(&pattern, key->data + prefix_len + 1,
					  key->len - prefix_len - 1, cursor, sizeof(cursor));
	} while (strcmp(cursor, "0") != 0);
	pfree(pattern.data);
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
