/*
 * slots.c
 *	  The concurrency slots a backend holds: taken (rl_take_slot, for
 *	  rl_decide), given back early (rl_release_slot) or when the
 *	  (sub)transaction that took them ends.
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
rl_slots_xact_end(XactEvent event)
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
rl_slots_subxact_end(SubXactEvent event)
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
 * Takes a slot of charge c's limit (lim slots, a lease of window_ms) for
 * its identity, on the key of its policy (NULL: the explicit limit's), and
 * fills d. A dry run (c->dry_run) takes none: d says whether c->cost more
 * slots fit now, and it is counted as a peek (see concurrency.lua). For
 * rl_decide, which has checked the charge.
 */
void
rl_take_slot(const RlCharge *c, RlDecision *d)
{
	const char *policy = c->policy;
	text	   *identity = c->identity;
	const RlLimit *limit = c->limit;
	StringInfo	key;
	StringInfoData owner;
	char		token[64];
	char		lim_s[16],
				lease_s[24],
				now_s[24],
				cost_s[16];
	const char *argv[9];
	size_t		argvlen[9];
	RlConn	   *conn;
	redisReply *reply;
	RlFailure	failure = {0};
	RlCallContext ctx;
	RlSlot	   *slot;
	MemoryContext old;
	TimestampTz start;

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
	argv[8] = cost_s;
	argvlen[8] = c->dry_run ? pg_ltoa(c->cost, cost_s) : 0;

	/*
	 * The slot as it will be held, kept aside while the call is in flight
	 * (a dry run holds none).
	 */
	if (asking != NULL)
		rl_free_slot(asking);
	asking = NULL;
	if (!c->dry_run)
	{
		old = MemoryContextSwitchTo(TopMemoryContext);
		asking = palloc(sizeof(RlSlot));
		asking->key = pnstrdup(key->data, key->len);
		asking->keylen = key->len;
		initStringInfo(&owner);
		rl_slot_owner(&owner, policy, identity);
		asking->owner = owner.data;
		asking->ownerlen = owner.len;
		asking->nestlevel = GetCurrentTransactionNestLevel();
		strlcpy(asking->token, token, sizeof(asking->token));
		MemoryContextSwitchTo(old);
	}
	slot = asking;
	start = rl_stats ? GetCurrentTimestamp() : 0;
	rl_context_push(&ctx, c->dry_run ? "concurrency inspection" : "concurrency acquire",
					NULL, key->data, key->len, 0);
	reply = rl_call(key->data, key->len, &rl_script_concurrency, 9, argv,
					argvlen, &conn, &failure);
	if (reply == NULL ||
		!rl_parse_decision(conn, reply, limit, d, NULL, 0, NULL, &failure))
	{
		/* Redis may have given the slot before the call failed: give it back */
		rl_release_asking();
		rl_stats_failed(key->data, key->len, &failure, true);
		rl_apply_on_error(&failure, limit, c->cost, d);
		rl_context_pop(&ctx);
		rl_stats_decided(key->data, key->len, d, c->dry_run ? 0 : 1, 0);
		return;
	}
	rl_context_pop(&ctx);
	asking = NULL;
	rl_stats_decided(key->data, key->len, d, c->dry_run ? 0 : 1,
					 rl_stats ? GetCurrentTimestamp() - start : 0);
	if (c->dry_run)
		return;
	/* a shadow policy's denial holds no slot, and counts as a denial */
	if (!d->allowed || d->shadow_denied)
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

/*
 * Gives back the slot this backend took last for policy (NULL: explicit
 * limits) and identity; false when it holds none (or its lease had ended).
 */
bool
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
