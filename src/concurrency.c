/*
 * concurrency.c
 *	  Concurrency limits: at most lim slots held at once per identity.
 *
 * rl_acquire(policy, identity) (a policy of algorithm 'concurrency': lim
 * slots, each with a lease of window_ms) and rl_concurrency_acquire(identity,
 * lim, lease_ms) take a slot: a member of the identity's sorted set named by
 * a token unique to this backend and call, with a lease of at most
 * rl_redis.max_lease. The backend remembers the slots it holds with the
 * subtransaction that took them, and gives them back when that ends: all of
 * them when the transaction commits, aborts or is prepared, those of a
 * rolled-back savepoint or exception block at once; or one earlier with
 * rl_release / rl_concurrency_release. Releases at a transaction end are
 * queued on the transport, which sends them within a fixed budget or with
 * the session's next command. A backend that dies without giving a slot
 * back loses it when its lease ends.
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
	char	   *owner;			/* "<policy>" or "" (explicit) + identity */
	size_t		ownerlen;
	int			nestlevel;		/* of the subtransaction that took it */
	char		token[64];
} RlSlot;

static List *held_slots = NIL;	/* of RlSlot *, in TopMemoryContext */
static uint64 slot_counter = 0;

/*
 * The slot being asked for while its call is in flight: if the call fails or
 * an interrupt ends it, Redis may have given it, so it is given back
 * (rl_release_asking, the one place that decides).
 */
static RlSlot *asking = NULL;

/* Writes "<policy>\0<identity>" (policy "" when explicit) into buf. */
static void
rl_slot_owner(StringInfo buf, const char *policy, text *identity)
{
	resetStringInfo(buf);
	appendStringInfoString(buf, policy ? policy : "");
	appendStringInfoChar(buf, '\0');
	appendBinaryStringInfo(buf, VARDATA_ANY(identity), VARSIZE_ANY_EXHDR(identity));
}

/* Frees a slot (already taken off held_slots). */
static void
rl_free_slot(RlSlot *slot)
{
	pfree(slot->key);
	pfree(slot->owner);
	pfree(slot);
}

/* Queues the ZREM that gives slot back. */
static void
rl_queue_release(RlSlot *slot)
{
	const char *argv[3] = {"ZREM", slot->key, slot->token};
	size_t		argvlen[3] = {4, slot->keylen, strlen(slot->token)};
	RlConn	   *conn = rl_route_known(slot->key, slot->keylen);

	if (conn == NULL)
		ereport(WARNING,
				(errmsg("a concurrency slot could not be given back: the Redis node of its key is not known"),
				 errdetail("It is freed when its lease ends.")));
	else
		rl_defer_command(conn, 3, argv, argvlen, RL_QUEUED_IDEMPOTENT);
}

/*
 * Queues the release of every slot taken at nesting level nestlevel or
 * deeper (all of them for level 1) and forgets them. Never raises: a slot
 * whose release cannot be queued ends with its lease.
 */
static void
rl_release_from_level(int nestlevel)
{
	ListCell   *lc;
	volatile bool lost = false;
	RlHold		hold;

	foreach(lc, held_slots)
	{
		RlSlot	   *slot = (RlSlot *) lfirst(lc);

		if (slot->nestlevel < nestlevel)
			continue;
		rl_hold_save(&hold);
		PG_TRY();
		{
			rl_queue_release(slot);
		}
		PG_CATCH();
		{
			rl_hold_restore(&hold);
			lost = true;
		}
		PG_END_TRY();
		held_slots = foreach_delete_current(held_slots, lc);
		rl_free_slot(slot);
	}
	if (lost)
		ereport(WARNING,
				(errmsg("a concurrency slot could not be given back"),
				 errdetail("It is freed when its lease ends.")));
}

/*
 * Queues the release of the slot whose call failed or an interrupt ended
 * when the call may have reached Redis (rl_command_was_sent, on either
 * transport), which may have given it; forgets the slot. Never raises.
 */
static void
rl_release_asking(void)
{
	RlHold		hold;
	RlConn	   *conn;

	if (asking == NULL)
		return;
	conn = rl_route_known(asking->key, asking->keylen);
	if (conn == NULL || !rl_command_was_sent(conn))
	{
		/* the request never reached Redis whole: there is no slot */
		rl_free_slot(asking);
		asking = NULL;
		return;
	}
	rl_hold_save(&hold);
	PG_TRY();
	{
		rl_queue_release(asking);
	}
	PG_CATCH();
	{
		rl_hold_restore(&hold);
	}
	PG_END_TRY();
	rl_free_slot(asking);
	asking = NULL;
}

/* Gives back every slot of a transaction that ends (src/xact_end.c). */
void
rl_concurrency_xact_end(XactEvent event)
{
	if (event == XACT_EVENT_COMMIT || event == XACT_EVENT_ABORT ||
		event == XACT_EVENT_PARALLEL_COMMIT ||
		event == XACT_EVENT_PARALLEL_ABORT || event == XACT_EVENT_PREPARE)
	{
		rl_release_asking();
		rl_release_from_level(1);
	}
}

/*
 * Gives back the slots of a rolled-back subtransaction; those of a committed
 * one now belong to its parent (src/xact_end.c).
 */
void
rl_concurrency_subxact_end(SubXactEvent event)
{
	int			level = GetCurrentTransactionNestLevel();
	ListCell   *lc;

	if (event == SUBXACT_EVENT_ABORT_SUB)
	{
		rl_release_asking();
		rl_release_from_level(level);
	}
	else if (event == SUBXACT_EVENT_COMMIT_SUB)
	{
		foreach(lc, held_slots)
		{
			RlSlot	   *slot = (RlSlot *) lfirst(lc);

			if (slot->nestlevel >= level)
				slot->nestlevel = level - 1;
		}
	}
}

/*
 * Takes a slot of limit (lim slots, a lease of window_ms) for identity, on
 * the key of policy (NULL: the explicit limit's), and fills d.
 */
static void
rl_take_slot(const char *policy, text *identity, const RlLimit *limit,
			 RlDecision *d)
{
	StringInfo	key;
	StringInfoData owner;
	char		token[64];
	char		lim_s[16],
				lease_s[24],
				now_s[24];
	const char *argv[8];
	size_t		argvlen[8];
	RlConn	   *conn;
	redisReply *reply;
	RlFailure	failure = {0};
	RlCallContext ctx;
	RlSlot	   *slot;
	MemoryContext old;
	TimestampTz start;

	rl_check_identity(VARSIZE_ANY_EXHDR(identity), NULL, false);
	rl_check_limit(limit);

	/* unique across backends, servers and calls */
	snprintf(token, sizeof(token), "%d:" INT64_FORMAT ":" UINT64_FORMAT ":%08x",
			 MyProcPid, (int64) MyStartTimestamp, ++slot_counter,
			 (unsigned int) pg_prng_uint32(&pg_global_prng_state));
	key = rl_build_key(identity, policy, limit);
	argv[2] = "1";
	argvlen[2] = 1;
	argv[3] = key->data;
	argvlen[3] = key->len;
	argv[4] = lim_s;
	argvlen[4] = pg_ltoa(limit->lim, lim_s);
	argv[5] = lease_s;
	argvlen[5] = pg_lltoa(limit->window_ms, lease_s);
	argv[6] = token;
	argvlen[6] = strlen(token);
	argv[7] = now_s;
	argvlen[7] = rl_clock_arg(now_s);

	/* the slot as it will be held, kept aside while the call is in flight */
	old = MemoryContextSwitchTo(TopMemoryContext);
	slot = palloc(sizeof(RlSlot));
	slot->key = pnstrdup(key->data, key->len);
	slot->keylen = key->len;
	initStringInfo(&owner);
	rl_slot_owner(&owner, policy, identity);
	slot->owner = owner.data;
	slot->ownerlen = owner.len;
	slot->nestlevel = GetCurrentTransactionNestLevel();
	strlcpy(slot->token, token, sizeof(slot->token));
	MemoryContextSwitchTo(old);
	if (asking != NULL)
		rl_free_slot(asking);
	asking = slot;
	start = rl_stats ? GetCurrentTimestamp() : 0;
	rl_context_push(&ctx, "concurrency acquire", NULL, key->data, key->len, 0);
	reply = rl_call(key->data, key->len, &rl_script_concurrency, 8, argv,
					argvlen, &conn, &failure);
	if (reply == NULL ||
		!rl_parse_decision(conn, reply, d, NULL, 0, NULL, &failure))
	{
		/* Redis may have given the slot before the call failed: give it back */
		rl_release_asking();
		rl_stats_failed(key->data, key->len, &failure, true);
		rl_apply_on_error(&failure, limit, 1, d);
		rl_context_pop(&ctx);
		rl_stats_decided(key->data, key->len, d, 1, 0);
		return;
	}
	rl_context_pop(&ctx);
	asking = NULL;
	rl_stats_decided(key->data, key->len, d, 1,
					 rl_stats ? GetCurrentTimestamp() - start : 0);
	if (!d->allowed)
	{
		rl_free_slot(slot);
		if (policy != NULL && rl_track_denials)
			rl_note_denial(policy, identity);
		return;
	}
	old = MemoryContextSwitchTo(TopMemoryContext);
	held_slots = lappend(held_slots, slot);
	MemoryContextSwitchTo(old);
}

/* Takes a slot for the arguments (identity, lim, lease_ms). */
static void
rl_acquire_args(FunctionCallInfo fcinfo, RlDecision *d)
{
	text	   *identity = rl_get_identity(fcinfo, 0);
	RlLimit		limit = {NULL, 0, 0, 0};

	rl_check_not_null(fcinfo, 1, "lim");
	rl_check_not_null(fcinfo, 2, "lease_ms");
	limit.lim = PG_GETARG_INT32(1);
	limit.window_ms = PG_GETARG_INT64(2);
	rl_take_slot(NULL, identity, &limit, d);
}

/* Takes a slot for the arguments (policy, identity). */
static void
rl_acquire_policy(FunctionCallInfo fcinfo, RlDecision *d)
{
	RlPolicy	policy = rl_policy_arg(fcinfo, 0);
	text	   *identity = rl_get_identity(fcinfo, 1);

	if (!policy.concurrency)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("policy \"%s\" is a rate limit, not a concurrency limit",
						policy.name),
				 errhint("Decide with rl_check().")));
	rl_take_slot(policy.name, identity, &policy.limit, d);
}

/*
 * Gives back the slot this backend took last for policy (NULL: explicit
 * limits) and identity; false when it holds none (or its lease had ended).
 */
static bool
rl_release_slot(const char *policy, text *identity)
{
	StringInfoData owner;
	RlSlot	   *slot = NULL;
	ListCell   *lc;
	const char *argv[3];
	size_t		argvlen[3];
	RlConn	   *conn;
	redisReply *reply;
	RlFailure	failure = {0};
	RlCallContext ctx;
	bool		released;

	rl_check_identity(VARSIZE_ANY_EXHDR(identity), NULL, true);
	initStringInfo(&owner);
	rl_slot_owner(&owner, policy, identity);
	foreach(lc, held_slots)
	{
		RlSlot	   *s = (RlSlot *) lfirst(lc);

		if (s->ownerlen == (size_t) owner.len &&
			memcmp(s->owner, owner.data, owner.len) == 0)
			slot = s;
	}
	pfree(owner.data);
	if (slot == NULL)
		return false;

	argv[0] = "ZREM";
	argvlen[0] = 4;
	argv[1] = slot->key;
	argvlen[1] = slot->keylen;
	argv[2] = slot->token;
	argvlen[2] = strlen(slot->token);
	rl_context_push(&ctx, "concurrency release", NULL, slot->key,
					slot->keylen, 0);
	reply = rl_call(slot->key, slot->keylen, NULL, 3, argv, argvlen, &conn,
					&failure);
	if (reply != NULL && reply->type == REDIS_REPLY_ERROR)
	{
		rl_error_reply(conn, reply, &failure);
		reply = NULL;
	}
	if (reply == NULL)
	{
		/* sent again with the next command, or freed by its lease */
		rl_queue_release(slot);
		held_slots = list_delete_ptr(held_slots, slot);
		ctx.key = pnstrdup(slot->key, slot->keylen);	/* for the report */
		rl_free_slot(slot);
		if (rl_on_error == RL_ON_ERROR_ERROR)
			rl_raise(&failure);
		rl_report(WARNING, &failure,
				  "The slot is given back with the next call that reaches Redis, or when its lease ends.");
		rl_context_pop(&ctx);
		return false;
	}
	rl_context_pop(&ctx);
	released = reply->type == REDIS_REPLY_INTEGER && reply->integer == 1;
	freeReplyObject(reply);
	held_slots = list_delete_ptr(held_slots, slot);
	rl_free_slot(slot);
	return released;
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
