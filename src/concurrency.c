/*
 * concurrency.c
 *	  Concurrency limits: at most lim slots held at once per identity.
 *
 * rl_concurrency_acquire() takes a slot, a member of the identity's sorted
 * set named by a token unique to this backend and call, with a lease. The
 * backend remembers the slots it holds and gives them all back when the
 * transaction ends, committed or aborted (a transaction callback), or one
 * earlier with rl_concurrency_release(). A backend that dies without giving
 * a slot back loses it when its lease ends.
 */
#include "postgres.h"

#include "access/xact.h"
#include "common/pg_prng.h"
#include "miscadmin.h"
#include "utils/builtins.h"
#include "utils/memutils.h"

#include "rl_redis.h"

/* One slot this backend holds. */
typedef struct RlSlot
{
	char	   *key;			/* in TopMemoryContext */
	size_t		keylen;
	char		token[64];
} RlSlot;

static List *held_slots = NIL;	/* of RlSlot *, in TopMemoryContext */
static uint64 slot_counter = 0;

/* Gives one slot back (ZREM); true if Redis still had it. */
static bool
rl_release_slot(RlSlot *slot, RlFailure *failure, bool *failed)
{
	const char *argv[3] = {"ZREM", slot->key, slot->token};
	size_t		argvlen[3] = {4, slot->keylen, strlen(slot->token)};
	redisReply *reply = rl_command(3, argv, argvlen, failure);
	bool		released;

	*failed = false;
	if (reply == NULL)
	{
		*failed = true;
		return false;
	}
	if (reply->type == REDIS_REPLY_ERROR)
	{
		rl_error_reply(reply, failure);
		*failed = true;
		return false;
	}
	released = reply->type == REDIS_REPLY_INTEGER && reply->integer == 1;
	freeReplyObject(reply);
	return released;
}

/* Forgets a slot and frees it. */
static void
rl_forget_slot(RlSlot *slot)
{
	held_slots = list_delete_ptr(held_slots, slot);
	pfree(slot->key);
	pfree(slot);
}

/*
 * At the end of a transaction, gives back every slot it holds. Never
 * raises: a slot that cannot be given back now ends with its lease.
 */
static void
rl_concurrency_xact_callback(XactEvent event, void *arg)
{
	if (held_slots == NIL)
		return;
	if (event != XACT_EVENT_COMMIT && event != XACT_EVENT_ABORT &&
		event != XACT_EVENT_PARALLEL_COMMIT &&
		event != XACT_EVENT_PARALLEL_ABORT && event != XACT_EVENT_PREPARE)
		return;

	while (held_slots != NIL)
	{
		RlSlot	   *slot = (RlSlot *) linitial(held_slots);
		RlFailure	failure;
		bool		failed;

		/* after an interrupted wait on Redis, do not wait on it again */
		if (rl_transport_interrupted())
			ereport(WARNING,
					(errmsg("a concurrency slot was not given back"),
					 errdetail("A call to Redis at %s was interrupted; the slot is freed when its lease ends.",
							   rl_server_name())));
		else
		{
			rl_release_slot(slot, &failure, &failed);
			if (failed)
				ereport(WARNING,
						(errcode(failure.sqlerrcode),
						 errmsg_internal("%s", failure.message),
						 errdetail("A concurrency slot could not be given back; it is freed when its lease ends.")));
		}
		rl_forget_slot(slot);
	}
}

/* Registers the transaction callback; called once from _PG_init. */
void
rl_concurrency_init(void)
{
	RegisterXactCallback(rl_concurrency_xact_callback, NULL);
}

/* Takes a slot for the arguments (identity, lim, lease_ms). */
static void
rl_acquire(FunctionCallInfo fcinfo, RlDecision *d)
{
	text	   *identity = rl_get_identity(fcinfo, 0);
	RlLimit		limit = {NULL, 0, 0, 0};
	StringInfo	key;
	char		token[64];
	char		lim_s[16],
				lease_s[24],
				now_s[24];
	const char *argv[8];
	size_t		argvlen[8];
	redisReply *reply;
	RlFailure	failure;

	if (PG_ARGISNULL(1))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("lim must not be null")));
	if (PG_ARGISNULL(2))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("lease_ms must not be null")));
	limit.lim = PG_GETARG_INT32(1);
	limit.window_ms = PG_GETARG_INT64(2);
	if (limit.lim <= 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("lim must be greater than zero")));
	if (limit.window_ms <= 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("lease_ms must be greater than zero")));
	if (limit.window_ms > RL_MAX_WINDOW_MS)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("lease_ms must be at most " INT64_FORMAT " (100 years)",
						RL_MAX_WINDOW_MS)));

	/* unique across backends, servers and calls */
	snprintf(token, sizeof(token), "%d:" INT64_FORMAT ":" UINT64_FORMAT ":%08x",
			 MyProcPid, (int64) MyStartTimestamp, ++slot_counter,
			 (unsigned int) pg_prng_uint32(&pg_global_prng_state));

	key = rl_build_key("concurrency", identity, NULL);
	argv[2] = "1";
	argvlen[2] = 1;
	argv[3] = key->data;
	argvlen[3] = key->len;
	argv[4] = lim_s;
	argvlen[4] = pg_ltoa(limit.lim, lim_s);
	argv[5] = lease_s;
	argvlen[5] = pg_lltoa(limit.window_ms, lease_s);
	argv[6] = token;
	argvlen[6] = strlen(token);
	argv[7] = now_s;
	argvlen[7] = rl_clock_arg(now_s);

	reply = rl_run_script(&rl_script_concurrency, 8, argv, argvlen, &failure);
	if (reply == NULL || !rl_parse_decision(reply, d, NULL, &failure))
	{
		rl_apply_on_error(&failure, limit.lim, 1, d);
		return;
	}
	if (d->allowed)
	{
		MemoryContext old = MemoryContextSwitchTo(TopMemoryContext);
		RlSlot	   *slot = palloc(sizeof(RlSlot));

		slot->key = pnstrdup(key->data, key->len);
		slot->keylen = key->len;
		strlcpy(slot->token, token, sizeof(slot->token));
		held_slots = lappend(held_slots, slot);
		MemoryContextSwitchTo(old);
	}
}

PG_FUNCTION_INFO_V1(rl_concurrency_acquire);

/* rl_concurrency_acquire(identity, lim, lease_ms): takes a slot, as rl_result. */
Datum
rl_concurrency_acquire(PG_FUNCTION_ARGS)
{
	RlDecision	d;

	rl_acquire(fcinfo, &d);
	return rl_result_datum(fcinfo, &d);
}

PG_FUNCTION_INFO_V1(rl_concurrency_acquire_allow);

/* rl_concurrency_acquire_allow(identity, lim, lease_ms): takes a slot, as boolean. */
Datum
rl_concurrency_acquire_allow(PG_FUNCTION_ARGS)
{
	RlDecision	d;

	rl_acquire(fcinfo, &d);
	PG_RETURN_BOOL(d.allowed);
}

PG_FUNCTION_INFO_V1(rl_concurrency_release);

/*
 * rl_concurrency_release(identity): gives back the slot this backend took
 * last for identity; false when it holds none (or its lease had ended).
 */
Datum
rl_concurrency_release(PG_FUNCTION_ARGS)
{
	text	   *identity = rl_get_identity(fcinfo, 0);
	StringInfo	key = rl_build_key("concurrency", identity, NULL);
	RlSlot	   *slot = NULL;
	ListCell   *lc;
	RlFailure	failure;
	bool		failed;
	bool		released;

	foreach(lc, held_slots)
	{
		RlSlot	   *s = (RlSlot *) lfirst(lc);

		if (s->keylen == (size_t) key->len &&
			memcmp(s->key, key->data, key->len) == 0)
			slot = s;
	}
	if (slot == NULL)
		PG_RETURN_BOOL(false);

	released = rl_release_slot(slot, &failure, &failed);
	rl_forget_slot(slot);
	if (failed)
	{
		if (rl_on_error == RL_ON_ERROR_ERROR)
			rl_raise(&failure);
		ereport(WARNING,
				(errcode(failure.sqlerrcode),
				 errmsg_internal("%s", failure.message),
				 errdetail("The slot is freed when its lease ends.")));
	}
	PG_RETURN_BOOL(released);
}
