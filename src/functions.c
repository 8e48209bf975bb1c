/*
 * functions.c
 *	  The SQL functions of explicit limits (rl_<algorithm>, rl_<algorithm>_allow,
 *	  rl_<algorithm>_refund, one set per line of algorithms.h) and the admin
 *	  functions rl_reset, rl_redis_ping, rl_redis_connections and
 *	  rl_redis_disconnect.
 */
#include "postgres.h"

#include "access/htup_details.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "mb/pg_wchar.h"
#include "utils/builtins.h"
#include "utils/timestamp.h"

#include "rl_redis.h"

/*
 * Reads the limit (lim, window [, burst]: arguments 1, 2 and 4) of the
 * explicit-limit SQL function being called into limit (rl_decide checks it);
 * the window is a bigint of milliseconds, an interval or a text
 * (rl_get_window_ms).
 */
static void
rl_limit_args(FunctionCallInfo fcinfo, int algorithm, RlLimit *limit)
{
	rl_check_not_null(fcinfo, 1, "lim");
	limit->algorithm = &rl_algorithms[algorithm];
	limit->lim = PG_GETARG_INT32(1);
	limit->window_ms = rl_get_window_ms(fcinfo, 2, "window_ms");
	limit->burst = 0;
	limit->shadow = false;		/* only a policy is ever shadow */
	/* burst: NULL means the same as lim */
	if (PG_NARGS() > 4 && !PG_ARGISNULL(4))
	{
		limit->burst = PG_GETARG_INT32(4);
		if (limit->burst <= 0)
			limit->burst = -1;	/* rejected by rl_check_limit */
	}
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
	RlCharge	charge = {&limit};
	RlRequest	req = {RL_DECIDE_ONE, &charge, 1, NULL, RL_BY_CALL, NULL};

	charge.identity = rl_get_identity(fcinfo, 0);
	rl_limit_args(fcinfo, algorithm, &limit);
	charge.cost = rl_get_cost(fcinfo, 3, refund ? "amount" : "cost");
	if (refund)
		charge.cost = -charge.cost;
	rl_decide(&req, d);
}

/*
 * Decides for the arguments (identities, lim, window_ms, cost [, burst]) of
 * the batch function being called: its rows (rl_batch_rows).
 */
static void
rl_decide_many_args(FunctionCallInfo fcinfo, int algorithm)
{
	RlLimit		limit;

	rl_limit_args(fcinfo, algorithm, &limit);
	rl_batch_rows(fcinfo, &limit, NULL, 0, rl_get_cost(fcinfo, 3, "cost"));
}

/*
 * For each algorithm, four SQL functions over rl_decide_args and
 * rl_decide_many_args:
 *   rl_<alg>(identity, lim, window_ms, cost [, burst])        -> rl_result
 *   rl_<alg>_allow(identity, lim, window_ms, cost [, burst])  -> boolean
 *   rl_<alg>_refund(identity, lim, window_ms, amount [, burst]) -> rl_result
 *   rl_<alg>_many(identities, lim, window_ms, cost [, burst])  -> rows
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
} \
PG_FUNCTION_INFO_V1(rl_##alg##_many); \
Datum \
rl_##alg##_many(PG_FUNCTION_ARGS) \
{ \
	rl_decide_many_args(fcinfo, index); \
	return (Datum) 0; \
}


#define RL_ALGORITHM(name, lua_file, key_kind, refund_subtracts, keeps_records, log, bucket) \
	RL_ALGORITHM_FUNCTIONS(name, RL_ALG_##name)
#include "algorithms.h"
#undef RL_ALGORITHM

/*
 * Sends a command on conn whose reply must not be an error and frees the reply;
 * raises on any failure, whatever on_error says.
 */
static void
rl_admin_command(RlConn *conn, int argc, const char **argv,
				 const size_t *argvlen)
{
	RlFailure	failure = {0};
	redisReply *reply = rl_command(conn, argc, argv, argvlen, &failure);

	rl_reply_or_raise(conn, reply, &failure);
	freeReplyObject(reply);
}

/*
 * Sends one SCAN step on conn for pattern from cursor and DELetes the keys it
 * returns that belong to the identity (tag, see rl_key_of); returns the
 * next cursor ("0" when done) in cursor.
 */
static void
rl_reset_step(RlConn *conn, StringInfo pattern, StringInfo tag,
			  char *cursor, size_t cursorsize)
{
	int			ndel = 1;
	redisReply *reply = rl_scan_step(conn, pattern, cursor, cursorsize);
	redisReply *keys = reply->element[1];
	const char **del;
	size_t	   *dellen;
	size_t		i;

	if (keys->elements > 0)
	{
		del = palloc(sizeof(char *) * (keys->elements + 1));
		dellen = palloc(sizeof(size_t) * (keys->elements + 1));
		del[0] = "DEL";
		dellen[0] = 3;
		for (i = 0; i < keys->elements; i++)
		{
			redisReply *k = keys->element[i];

			if (!rl_key_of(k->str, k->len, tag))
				continue;
			del[ndel] = k->str;
			dellen[ndel++] = k->len;
		}
		PG_TRY();
		{
			if (ndel > 1)
				rl_admin_command(conn, ndel, del, dellen);
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
	RlFailure	failure = {0};
	RlConn	  **conns;
	int			n;
	int			i;
	StringInfoData pattern;
	StringInfoData tag;
	char		cursor[32] = "0";

	rl_check_identity(VARSIZE_ANY_EXHDR(identity), NULL, true);

	/*
	 * In cluster mode every master is scanned: the keys of the identity
	 * share a hash slot, but while it migrates they are on two nodes.
	 */
	/* the identity's remembered denials go, now and once its keys are gone */
	rl_deny_cache_forget();
	n = rl_route_all(&conns, &failure);
	if (n < 0)
		rl_raise(&failure);
	initStringInfo(&pattern);
	initStringInfo(&tag);
	rl_identity_keys(identity, &pattern, &tag);
	for (i = 0; i < n; i++)
	{
		strcpy(cursor, "0");
		do
		{
			CHECK_FOR_INTERRUPTS();
			rl_reset_step(conns[i], &pattern, &tag, cursor, sizeof(cursor));
		} while (strcmp(cursor, "0") != 0);
	}
	rl_deny_cache_forget();
	pfree(pattern.data);
	pfree(tag.data);
	PG_RETURN_VOID();
}

PG_FUNCTION_INFO_V1(rl_redis_ping);

/*
 * rl_redis_ping(): checks the connections and returns the servers (in
 * cluster mode every master, joined with ", "; in sentinel mode the
 * master) and the longest round-trip time of one PING on an (already open)
 * connection.
 */
Datum
rl_redis_ping(PG_FUNCTION_ARGS)
{
	const char *argv[1] = {"PING"};
	size_t		argvlen[1] = {4};
	RlConn	  **conns;
	RlFailure	failure = {0};
	int			n;
	int			i;
	double		worst = 0;
	StringInfoData servers;
	TupleDesc	tupdesc;
	Datum		values[2];
	bool		nulls[2] = {false, false};

	if (get_call_result_type(fcinfo, NULL, &tupdesc) != TYPEFUNC_COMPOSITE)
		elog(ERROR, "return type must be a row type");
	tupdesc = BlessTupleDesc(tupdesc);

	n = rl_route_all(&conns, &failure);
	if (n < 0)
		rl_raise(&failure);
	initStringInfo(&servers);
	for (i = 0; i < n; i++)
	{
		TimestampTz start;

		rl_conn_reset_breaker(conns[i]);	/* an explicit check always tries */
		rl_admin_command(conns[i], 1, argv, argvlen);	/* connects if needed */
		start = GetCurrentTimestamp();
		rl_admin_command(conns[i], 1, argv, argvlen);
		worst = Max(worst, (GetCurrentTimestamp() - start) / 1000.0);
		appendStringInfo(&servers, "%s%s", i > 0 ? ", " : "",
						 rl_conn_name(conns[i]));
	}

	values[0] = CStringGetTextDatum(servers.data);
	values[1] = Float8GetDatum(worst);
	PG_RETURN_DATUM(HeapTupleGetDatum(heap_form_tuple(tupdesc, values, nulls)));
}

PG_FUNCTION_INFO_V1(rl_redis_disconnect);

/*
 * rl_redis_disconnect(): closes this session's connections to Redis that
 * have nothing queued or on the way, as rl_redis.idle_timeout does (a
 * pooler's reset query, a password changed in Redis); the next call opens
 * them again. Returns how many stay open: those that still carry work (a
 * slot release or refund not yet sent), and in a transaction that sent a
 * command (a statement, function or block that took a slot or charged)
 * every open one, as its end may have work for them (closing them would
 * make that end connect again, its interrupts held). 0: no connection of
 * the session is open now. Connections the shared transport's worker
 * holds are not the session's.
 */
Datum
rl_redis_disconnect(PG_FUNCTION_ARGS)
{
	PG_RETURN_INT32(rl_close_idle(!rl_idle_used_in_xact()));
}

PG_FUNCTION_INFO_V1(rl_redis_connections);

/*
 * rl_redis_connections(): this backend's Redis connections: server, kind
 * (server, master, sentinel), open or closed, the commands of transaction
 * ends waiting, while calls fail: since when, the last error and how long
 * the circuit breaker still holds calls back; the mode (rl_redis.mode), and
 * how many of the registry's scripts are known loaded there (they ran since
 * the connection was made).
 */
Datum
rl_redis_connections(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	static const char *const kinds[] = {"server", "master", "sentinel"};
	RlConnInfo	info;
	int			n;

	InitMaterializedSRF(fcinfo, 0);
	for (n = 0; rl_conn_info(n, &info); n++)
	{
		Datum		values[10];
		bool		nulls[10] = {0};

		values[0] = CStringGetTextDatum(info.server);
		values[1] = CStringGetTextDatum(kinds[info.kind]);
		values[2] = CStringGetTextDatum(info.open ? "open" : "closed");
		values[3] = Int32GetDatum(info.queued);
		if (info.failing_since != 0)
		{
			values[4] = TimestampTzGetDatum(info.failing_since);
			values[5] = CStringGetTextDatum(info.last_error);
			values[6] = Int64GetDatum(info.retry_in_ms);
		}
		else
			nulls[4] = nulls[5] = nulls[6] = true;
		values[7] = CStringGetTextDatum(rl_topology()->name);
		values[8] = Int32GetDatum(info.scripts_loaded);
		values[9] = Int32GetDatum(RL_NUM_SCRIPTS);
		tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values, nulls);
	}
	return (Datum) 0;
}

/* the most minutes rl_top_denied looks back (the buckets are kept a day) */
#define RL_DENIAL_MINUTES 1441

/* the most identities rl_top_denied returns */
#define RL_DENIAL_TOP_MAX 10000

PG_FUNCTION_INFO_V1(rl_top_denied);

/*
 * rl_top_denied(policy, since, n): the n identities most denied under
 * policy since the minute since ago (at most a day), with their denials,
 * most denied first, across every server sharing the Redis (counted with
 * rl_redis.track_denials; a NOTICE says when that is off here).
 */
Datum
rl_top_denied(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	RlPolicy	policy;
	Interval   *since;
	double		since_us;
	int32		n;
	int			minutes;
	RlConn	   *conn;
	RlFailure	failure = {0};
	redisReply *reply;

	policy = rl_policy_arg(fcinfo, 0);
	rl_check_not_null(fcinfo, 1, "since");
	rl_check_not_null(fcinfo, 2, "n");
	since = PG_GETARG_INTERVAL_P(1);
	n = PG_GETARG_INT32(2);
	if (n < 1 || n > RL_DENIAL_TOP_MAX)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("n must be between 1 and %d", RL_DENIAL_TOP_MAX)));
	since_us = (double) since->month * DAYS_PER_MONTH * USECS_PER_DAY +
		(double) since->day * USECS_PER_DAY + (double) since->time;
	if (since_us < 0 || since_us > (double) USECS_PER_DAY)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("since must be between 0 and 1 day"),
				 errdetail("The denials of each minute are kept a day.")));
	/* the minutes that began since then, and the current one */
	minutes = (int) (since_us / (60.0 * USECS_PER_SEC)) + 1;
	minutes = Min(minutes, RL_DENIAL_MINUTES);
	if (!rl_track_denials)
		ereport(NOTICE,
				(errmsg("denials are not being counted"),
				 errdetail("rl_redis.track_denials is off in this session."),
				 errhint("A superuser sets rl_redis.track_denials = on to count them.")));

	InitMaterializedSRF(fcinfo, 0);
	reply = rl_denials_top(policy.name, minutes, n, &conn, &failure);
	rl_reply_or_raise(conn, reply, &failure);
	PG_TRY();
	{
		size_t		i;

		if (reply->type != REDIS_REPLY_ARRAY || reply->elements % 2 != 0)
			ereport(ERROR,
					(errcode(ERRCODE_PROTOCOL_VIOLATION),
					 errmsg("unexpected reply from the top-denials script at Redis %s",
							rl_conn_name(conn))));
		for (i = 0; i < reply->elements; i += 2)
		{
			redisReply *who = reply->element[i];
			redisReply *count = reply->element[i + 1];
			Datum		values[2];
			bool		nulls[2] = {false, false};
			char		num[32];
			char	   *end;
			double		v;

			if (who->type != REDIS_REPLY_STRING || count->type != REDIS_REPLY_STRING ||
				count->len == 0 || count->len >= sizeof(num) ||
				!pg_verifymbstr(who->str, who->len, true))
				continue;
			memcpy(num, count->str, count->len);
			num[count->len] = '\0';
			v = strtod(num, &end);
			if (*end != '\0' || !(v >= 0 && v < 9.0e15))
				continue;
			values[0] = PointerGetDatum(cstring_to_text_with_len(who->str, who->len));
			values[1] = Int64GetDatum((int64) v);
			tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values, nulls);
		}
	}
	PG_FINALLY();
	{
		freeReplyObject(reply);
	}
	PG_END_TRY();
	return (Datum) 0;
}
