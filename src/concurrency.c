/*
 * concurrency.c
 *	  The SQL functions of concurrency limits: rl_acquire, rl_release,
 *	  rl_concurrency_acquire, rl_concurrency_release, and
 *	  rl_concurrency_holders, which lists who holds a policy's slots.
 *
 * A slot is taken through rl_decide (engine.c), which checks the identity
 * and the limit (lim slots, a lease of at most rl_redis.max_lease) as it
 * checks every charge; the slots a backend holds are in slots.c.
 */
#include "postgres.h"

#include "funcapi.h"
#include "mb/pg_wchar.h"
#include "utils/builtins.h"
#include "utils/timestamp.h"

#include "rl_redis.h"

/* Takes a slot of limit for identity (policy: NULL, or the limit's). */
static void
rl_acquire_charge(const char *policy, text *identity, const RlLimit *limit,
				  RlDecision *d)
{
	RlCharge	charge = {limit, policy, identity, 1};
	RlRequest	req = {RL_DECIDE_SLOT, &charge, 1, NULL, RL_BY_CALL, NULL};

	rl_decide(&req, d);
}

/* Takes a slot for the arguments (identity, lim, lease): rl_get_window_ms. */
static void
rl_acquire_args(FunctionCallInfo fcinfo, RlDecision *d)
{
	text	   *identity = rl_get_identity(fcinfo, 0);
	RlLimit		limit = {NULL, 0, 0, 0};

	rl_check_not_null(fcinfo, 1, "lim");
	limit.lim = PG_GETARG_INT32(1);
	limit.window_ms = rl_get_window_ms(fcinfo, 2, "lease_ms");
	rl_acquire_charge(NULL, identity, &limit, d);
}

/* Returns the concurrency policy named by argument argno; 22023 for a rate one. */
static RlPolicy
rl_concurrency_policy_arg(FunctionCallInfo fcinfo, int argno)
{
	RlPolicy	policy = rl_policy_arg(fcinfo, argno);

	if (!policy.concurrency)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("policy \"%s\" is a rate limit, not a concurrency limit",
						policy.name),
				 errhint("Decide with rl_check().")));
	return policy;
}

/* Takes a slot for the arguments (policy, identity). */
static void
rl_acquire_policy(FunctionCallInfo fcinfo, RlDecision *d)
{
	RlPolicy	policy = rl_concurrency_policy_arg(fcinfo, 0);
	text	   *identity = rl_get_identity(fcinfo, 1);

	rl_acquire_charge(policy.name, identity, &policy.limit, d);
}

PG_FUNCTION_INFO_V1(rl_concurrency_acquire);

/* rl_concurrency_acquire(identity, lim, lease_ms): takes a slot, as rl_result. */
Datum
rl_concurrency_acquire(PG_FUNCTION_ARGS)
{
	RlDecision	d;

	rl_acquire_args(fcinfo, &d);
	return rl_result_datum(fcinfo, &d);
}

PG_FUNCTION_INFO_V1(rl_concurrency_acquire_allow);

/* rl_concurrency_acquire_allow(identity, lim, lease_ms): takes a slot, as boolean. */
Datum
rl_concurrency_acquire_allow(PG_FUNCTION_ARGS)
{
	RlDecision	d;

	rl_acquire_args(fcinfo, &d);
	PG_RETURN_BOOL(d.allowed);
}

PG_FUNCTION_INFO_V1(rl_concurrency_release);

/*
 * rl_concurrency_release(identity): gives back the slot this backend took
 * last for identity with rl_concurrency_acquire; false when it holds none.
 */
Datum
rl_concurrency_release(PG_FUNCTION_ARGS)
{
	PG_RETURN_BOOL(rl_release_slot(NULL, rl_get_identity(fcinfo, 0)));
}

PG_FUNCTION_INFO_V1(rl_acquire);

/* rl_acquire(policy, identity): takes a slot of a concurrency policy. */
Datum
rl_acquire(PG_FUNCTION_ARGS)
{
	RlDecision	d;

	rl_acquire_policy(fcinfo, &d);
	return rl_result_datum(fcinfo, &d);
}

PG_FUNCTION_INFO_V1(rl_acquire_allow);

/* rl_acquire_allow(policy, identity): the same, as boolean. */
Datum
rl_acquire_allow(PG_FUNCTION_ARGS)
{
	RlDecision	d;

	rl_acquire_policy(fcinfo, &d);
	PG_RETURN_BOOL(d.allowed);
}

PG_FUNCTION_INFO_V1(rl_release);

/*
 * rl_release(policy, identity): gives back the slot this backend took last
 * for the policy and identity; false when it holds none.
 */
Datum
rl_release(PG_FUNCTION_ARGS)
{
	RlPolicy	policy = rl_policy_arg(fcinfo, 0);

	PG_RETURN_BOOL(rl_release_slot(policy.name, rl_get_identity(fcinfo, 1)));
}

/*
 * Sends a command on the connection key routes to and returns its reply,
 * an array of an even number of strings, or raises: a failure, an error
 * reply or another reply (freed first).
 */
static redisReply *
rl_holders_command(StringInfo key, int argc, const char **argv,
				   size_t *argvlen)
{
	RlFailure	failure = {0};
	RlConn	   *conn;
	redisReply *reply = rl_call(key->data, key->len, NULL, argc, argv, argvlen,
								&conn, &failure);
	size_t		i;

	rl_reply_or_raise(conn, reply, &failure);
	if (reply->type != REDIS_REPLY_ARRAY || reply->elements % 2 != 0)
		goto bad;
	for (i = 0; i < reply->elements; i++)
		if (reply->element[i]->type != REDIS_REPLY_STRING)
			goto bad;
	return reply;

bad:
	freeReplyObject(reply);
	ereport(ERROR,
			(errcode(ERRCODE_PROTOCOL_VIOLATION),
			 errmsg("unexpected reply to %s from Redis at %s", argv[0],
					rl_conn_name(conn))));
	return NULL;				/* keep compiler quiet */
}

/*
 * Fills now_s ("(<microseconds>", the bound that leaves out the leases that
 * end then: the scripts free those) with the clock of the scripts: the
 * test clock, or Redis's TIME on the connection key routes to.
 */
static void
rl_holders_now(StringInfo key, char *now_s, size_t size)
{
	const char *argv[1] = {"TIME"};
	size_t		argvlen[1] = {4};
	redisReply *reply;
	long long	sec,
				usec;

	now_s[0] = '(';
	if (rl_clock_arg(now_s + 1) != 0)
		return;
	reply = rl_holders_command(key, 1, argv, argvlen);
	sec = reply->elements == 2 ? rl_reply_number(reply->element[0]) : -1;
	usec = reply->elements == 2 ? rl_reply_number(reply->element[1]) : -1;
	freeReplyObject(reply);
	if (sec < 0 || sec >= 100000000000LL || usec < 0 || usec >= 1000000)
		ereport(ERROR,
				(errcode(ERRCODE_PROTOCOL_VIOLATION),
				 errmsg("unexpected reply to TIME from Redis")));
	snprintf(now_s + 1, size - 1, INT64_FORMAT,
			 (int64) sec * 1000000 + (int64) usec);
}

/*
 * Adds to the result one row per holder of key, identity's slots, whose
 * lease ends after now_s, the lease ending first first: the identity, the
 * slot's token (the holder), the pid of the backend that took it (the
 * token's first field; NULL for a token that carries none) and when its
 * lease ends.
 */
static void
rl_put_holders(ReturnSetInfo *rsinfo, StringInfo key, text *identity,
			   const char *now_s)
{
	const char *argv[6] = {"ZRANGE", key->data, now_s, "+inf", "BYSCORE",
	"WITHSCORES"};
	size_t		argvlen[6] = {6, key->len, strlen(now_s), 4, 7, 10};
	redisReply *reply = rl_holders_command(key, 6, argv, argvlen);
	size_t		i;

	for (i = 0; i < reply->elements; i += 2)
	{
		redisReply *member = reply->element[i];
		long long	ends = rl_reply_number(reply->element[i + 1]);
		Datum		values[4];
		bool		nulls[4] = {false, false, false, false};
		char	   *colon;
		char	   *end;
		long		pid;

		/* a lease beyond what a timestamp holds is no slot of ours */
		if (!pg_verifymbstr(member->str, member->len, true) ||
			ends < 0 || ends >= 100000000000000000LL)
			continue;
		values[0] = PointerGetDatum(identity);
		values[1] = PointerGetDatum(cstring_to_text_with_len(member->str,
															 member->len));
		/* the pid, as rl_take_slot writes it: "<pid>:..." */
		colon = memchr(member->str, ':', member->len);
		pid = colon ? strtol(member->str, &end, 10) : 0;
		if (colon && end == colon && end > member->str && pid > 0 && pid <= PG_INT32_MAX)
			values[2] = Int32GetDatum((int32) pid);
		else
			nulls[2] = true;
		values[3] = TimestampTzGetDatum((TimestampTz) ends -
										(POSTGRES_EPOCH_JDATE - UNIX_EPOCH_JDATE) * USECS_PER_DAY);
		tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values, nulls);
	}
	freeReplyObject(reply);
}

/* Orders identities (text) by their bytes. */
static int
rl_identity_cmp(const ListCell *a, const ListCell *b)
{
	text	   *ia = lfirst(a);
	text	   *ib = lfirst(b);
	int			la = VARSIZE(ia) - VARHDRSZ;
	int			lb = VARSIZE(ib) - VARHDRSZ;
	int			c = memcmp(VARDATA(ia), VARDATA(ib), Min(la, lb));

	return c != 0 ? c : (la > lb) - (la < lb);
}

/*
 * Every identity that holds slots of the concurrency policy, each once, in
 * the order of their bytes: SCAN steps of COUNT 1000 over every master (in
 * cluster mode a key that migrates is on two), keeping only the keys
 * rl_slot_key_identity reads, whose identity is valid in the server
 * encoding. Keeps the identities, not the keys (a StringInfo of 1 KB or
 * more each), as it walks: what a walk of many keys holds until it ends.
 */
static List *
rl_policy_slot_identities(const RlPolicy *policy)
{
	RlFailure	failure = {0};
	RlConn	  **conns;
	int			n = rl_route_all(&conns, &failure);
	StringInfoData pattern;
	List	   *found = NIL;
	List	   *unique = NIL;
	ListCell   *lc;
	int			i;

	if (n < 0)
		rl_raise(&failure);
	initStringInfo(&pattern);
	rl_slot_keys_pattern(policy->name, &pattern);
	for (i = 0; i < n; i++)
	{
		char		cursor[32] = "0";

		do
		{
			redisReply *reply;
			size_t		j;

			CHECK_FOR_INTERRUPTS();
			reply = rl_scan_step(conns[i], &pattern, cursor, sizeof(cursor));
			for (j = 0; j < reply->element[1]->elements; j++)
			{
				redisReply *k = reply->element[1]->element[j];
				text	   *identity = rl_slot_key_identity(k->str, k->len,
															policy->name,
															&policy->limit);

				if (identity == NULL)
					continue;
				if (!pg_verifymbstr(VARDATA(identity),
									VARSIZE(identity) - VARHDRSZ, true))
				{
					pfree(identity);
					continue;
				}
				found = lappend(found, identity);
			}
			freeReplyObject(reply);
		} while (strcmp(cursor, "0") != 0);
	}
	list_sort(found, rl_identity_cmp);
	foreach(lc, found)
	{
		if (unique == NIL || rl_identity_cmp(lc, list_tail(unique)) != 0)
			unique = lappend(unique, lfirst(lc));
	}
	list_free(found);
	pfree(pattern.data);
	return unique;
}

PG_FUNCTION_INFO_V1(rl_concurrency_holders);

/*
 * rl_concurrency_holders(policy, identity DEFAULT NULL): who holds the
 * slots of a concurrency policy now (their leases have not ended on the
 * clock of the scripts: Redis's, or the test clock), the identity's, or
 * with identity NULL every identity's (found with SCAN over the policy's
 * keys, one identity after another), one row each (rl_put_holders).
 */
Datum
rl_concurrency_holders(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	RlPolicy	policy = rl_concurrency_policy_arg(fcinfo, 0);
	char		now_s[40];
	bool		have_now = false;
	List	   *identities;
	StringInfoData slot_key;
	ListCell   *lc;

	InitMaterializedSRF(fcinfo, 0);
	if (!PG_ARGISNULL(1))
	{
		text	   *identity = rl_get_identity(fcinfo, 1);
		StringInfo	key;

		rl_check_identity(VARSIZE_ANY_EXHDR(identity), NULL, true);
		key = rl_build_key(identity, policy.name, &policy.limit);
		rl_holders_now(key, now_s, sizeof(now_s));
		rl_put_holders(rsinfo, key, identity, now_s);
		return (Datum) 0;
	}
	identities = rl_policy_slot_identities(&policy);
	initStringInfo(&slot_key);
	foreach(lc, identities)
	{
		text	   *identity = lfirst(lc);
		StringInfo	built = rl_build_key(identity, policy.name, &policy.limit);

		/* a copy: rl_build_key's buffer is the next call's */
		resetStringInfo(&slot_key);
		appendBinaryStringInfo(&slot_key, built->data, built->len);
		if (!have_now)
			rl_holders_now(&slot_key, now_s, sizeof(now_s));
		have_now = true;
		rl_put_holders(rsinfo, &slot_key, identity, now_s);
	}
	return (Datum) 0;
}
