/*
 * limits.c
 *	  The SQL-callable functions: rate-limit decisions, reset and ping.
 *
 * A decision checks its arguments, builds the identity's key, runs the
 * algorithm's script in Redis and turns the reply into an rl_result (or a
 * boolean). When Redis cannot give an answer, rl_redis.on_error decides:
 * raise the error, or log a warning and allow or deny.
 */
#include "postgres.h"

#include "access/htup_details.h"
#include "fmgr.h"
#include "funcapi.h"
#include "lib/stringinfo.h"
#include "utils/builtins.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"

#include "rl_redis.h"

PG_FUNCTION_INFO_V1(rl_fixed);
PG_FUNCTION_INFO_V1(rl_fixed_allow);
PG_FUNCTION_INFO_V1(rl_sliding);
PG_FUNCTION_INFO_V1(rl_sliding_allow);
PG_FUNCTION_INFO_V1(rl_reset);
PG_FUNCTION_INFO_V1(rl_redis_ping);

/* One decision, as the scripts return it. */
typedef struct RlDecision
{
	bool		allowed;
	int32		lim;
	int32		remaining;
	int64		reset_ms;
	int64		retry_after_ms;
} RlDecision;

/* The algorithm names used in keys; rl_reset deletes one key for each. */
static const char *const rl_algorithms[] = {"fixed", "sliding"};

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

/* Raises 22023 when the identity is empty. */
static void
rl_check_identity(text *identity)
{
	if (VARSIZE_ANY_EXHDR(identity) == 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("identity must not be empty")));
}

/*
 * Builds <key_prefix><algorithm>:{<identity>} in keybuf. The braces make
 * every key of one identity hash to the same Redis Cluster slot.
 */
static void
rl_build_key(const char *algorithm, text *identity)
{
	if (keybuf.data == NULL)
	{
		MemoryContext old = MemoryContextSwitchTo(TopMemoryContext);

		initStringInfo(&keybuf);
		MemoryContextSwitchTo(old);
	}
	resetStringInfo(&keybuf);
	appendStringInfoString(&keybuf, rl_key_prefix);
	appendStringInfoString(&keybuf, algorithm);
	appendBinaryStringInfo(&keybuf, ":{", 2);
	appendBinaryStringInfo(&keybuf, VARDATA_ANY(identity),
						   VARSIZE_ANY_EXHDR(identity));
	appendStringInfoChar(&keybuf, '}');
}

/*
 * Applies rl_redis.on_error to a failed call: raises the failure, or logs it
 * and fills d with the configured decision.
 */
static void
rl_apply_on_error(const RlFailure *failure, int32 lim, int32 cost,
				  RlDecision *d)
{
	if (rl_on_error == RL_ON_ERROR_ERROR)
		ereport(ERROR,
				(errcode(failure->sqlerrcode),
				 errmsg_internal("%s", failure->message)));

	d->allowed = (rl_on_error == RL_ON_ERROR_ALLOW);
	d->lim = lim;
	d->reset_ms = 0;
	if (d->allowed)
	{
		d->remaining = Max(lim - cost, 0);
		d->retry_after_ms = 0;
	}
	else
	{
		d->remaining = 0;
		d->retry_after_ms = RL_DENY_RETRY_MS;
	}
	ereport(WARNING,
			(errcode(failure->sqlerrcode),
			 errmsg_internal("%s", failure->message),
			 errdetail("The request was %s without a decision from Redis because rl_redis.on_error is \"%s\".",
					   d->allowed ? "allowed" : "denied",
					   d->allowed ? "allow" : "deny")));
}

/*
 * Fills failure from a Redis error reply and frees the reply. A refused
 * authentication is a connection failure (08001); anything else Redis
 * refuses (OOM, READONLY, WRONGTYPE, NOPERM ...) is reported with its text.
 */
static void
rl_error_reply(redisReply *reply, RlFailure *failure)
{
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
 */
static bool
rl_parse_decision(redisReply *reply, RlDecision *d, RlFailure *failure)
{
	int			i;

	if (reply->type == REDIS_REPLY_ERROR)
	{
		rl_error_reply(reply, failure);
		return false;
	}
	if (reply->type != REDIS_REPLY_ARRAY || reply->elements != 5)
		goto bad;
	for (i = 0; i < 5; i++)
		if (reply->element[i]->type != REDIS_REPLY_INTEGER)
			goto bad;

	d->allowed = reply->element[0]->integer != 0;
	d->lim = (int32) reply->element[1]->integer;
	d->remaining = (int32) reply->element[2]->integer;
	d->reset_ms = reply->element[3]->integer;
	d->retry_after_ms = reply->element[4]->integer;
	freeReplyObject(reply);
	return true;

bad:
	freeReplyObject(reply);
	failure->sqlerrcode = ERRCODE_PROTOCOL_VIOLATION;
	snprintf(failure->message, sizeof(failure->message),
			 "unexpected reply from the rate-limit script at Redis %s",
			 rl_server_name());
	return false;
}

/*
 * Checks the (identity, lim, window_ms, cost) arguments, runs script for
 * them and fills d with the decision, applying on_error when Redis fails.
 */
static void
rl_decide(FunctionCallInfo fcinfo, const RlScript *script,
		  const char *algorithm, RlDecision *d)
{
	text	   *identity;
	int32		lim;
	int64		window_ms;
	int32		cost;
	char		lim_s[16],
				window_s[24],
				cost_s[16],
				now_s[24];
	const char *args[4] = {lim_s, window_s, cost_s, now_s};
	size_t		arglens[4];
	int			nargs = 3;
	redisReply *reply;
	RlFailure	failure;

	rl_check_not_null(fcinfo, 0, "identity");
	rl_check_not_null(fcinfo, 1, "lim");
	rl_check_not_null(fcinfo, 2, "window_ms");
	rl_check_not_null(fcinfo, 3, "cost");

	identity = PG_GETARG_TEXT_PP(0);
	lim = PG_GETARG_INT32(1);
	window_ms = PG_GETARG_INT64(2);
	cost = PG_GETARG_INT32(3);

	rl_check_identity(identity);
	if (lim <= 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("lim must be greater than zero")));
	if (window_ms <= 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("window_ms must be greater than zero")));
	if (cost < 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("cost must not be negative")));

	rl_build_key(algorithm, identity);
	arglens[0] = pg_ltoa(lim, lim_s);
	arglens[1] = pg_lltoa(window_ms, window_s);
	arglens[2] = pg_ltoa(cost, cost_s);
	if (rl_test_clock_ms > 0)
		arglens[nargs++] = pg_lltoa((int64) (rl_test_clock_ms * 1000.0), now_s);

	reply = rl_run_script(script, keybuf.data, keybuf.len, nargs, args,
						  arglens, &failure);
	if (reply == NULL || !rl_parse_decision(reply, d, &failure))
		rl_apply_on_error(&failure, lim, cost, d);
}

/* Returns d as an rl_result datum. */
static Datum
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

/* rl_fixed(identity, lim, window_ms, cost): fixed-window decision. */
Datum
rl_fixed(PG_FUNCTION_ARGS)
{
	RlDecision	d;

	rl_decide(fcinfo, &rl_script_fixed_window, "fixed", &d);
	return rl_result_datum(fcinfo, &d);
}

/* rl_fixed_allow(identity, lim, window_ms, cost): allowed or not. */
Datum
rl_fixed_allow(PG_FUNCTION_ARGS)
{
	RlDecision	d;

	rl_decide(fcinfo, &rl_script_fixed_window, "fixed", &d);
	PG_RETURN_BOOL(d.allowed);
}

/* rl_sliding(identity, lim, window_ms, cost): sliding-log decision. */
Datum
rl_sliding(PG_FUNCTION_ARGS)
{
	RlDecision	d;

	rl_decide(fcinfo, &rl_script_sliding_window, "sliding", &d);
	return rl_result_datum(fcinfo, &d);
}

/* rl_sliding_allow(identity, lim, window_ms, cost): allowed or not. */
Datum
rl_sliding_allow(PG_FUNCTION_ARGS)
{
	RlDecision	d;

	rl_decide(fcinfo, &rl_script_sliding_window, "sliding", &d);
	PG_RETURN_BOOL(d.allowed);
}

/* Raises a failed administrative call as an error, whatever on_error says. */
static void
rl_raise(const RlFailure *failure)
{
	ereport(ERROR,
			(errcode(failure->sqlerrcode),
			 errmsg_internal("%s", failure->message)));
}

/*
 * Sends a command whose reply must not be an error and frees the reply;
 * raises on any failure.
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

/* rl_reset(identity): deletes the identity's state of every algorithm. */
Datum
rl_reset(PG_FUNCTION_ARGS)
{
	const char *argv[1 + lengthof(rl_algorithms)];
	size_t		argvlen[1 + lengthof(rl_algorithms)];
	char	   *keys[lengthof(rl_algorithms)];
	text	   *identity;
	int			i;

	rl_check_not_null(fcinfo, 0, "identity");
	identity = PG_GETARG_TEXT_PP(0);
	rl_check_identity(identity);

	argv[0] = "DEL";
	argvlen[0] = 3;
	for (i = 0; i < lengthof(rl_algorithms); i++)
	{
		rl_build_key(rl_algorithms[i], identity);
		keys[i] = pnstrdup(keybuf.data, keybuf.len);
		argv[i + 1] = keys[i];
		argvlen[i + 1] = keybuf.len;
	}
	rl_admin_command(1 + lengthof(rl_algorithms), argv, argvlen);
	PG_RETURN_VOID();
}

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

	rl_admin_command(1, argv, argvlen); /* connects if needed */
	start = GetCurrentTimestamp();
	rl_admin_command(1, argv, argvlen);

	values[0] = CStringGetTextDatum(rl_server_name());
	values[1] = Float8GetDatum((GetCurrentTimestamp() - start) / 1000.0);
	PG_RETURN_DATUM(HeapTupleGetDatum(heap_form_tuple(tupdesc, values, nulls)));
}
