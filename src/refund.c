/*
 * refund.c
 *	  Gives back, when a transaction or subtransaction aborts, the units that
 *	  were taken in it.
 *
 * rl_redis.refund_on_abort says whose units: "guards" (the default: the
 * units taken by rl_guard and rl_guard_statement), "all" (also the explicit
 * decision functions and rl_check/rl_check_all) or "off". Every charge is
 * remembered with the subtransaction that made it; an aborting
 * subtransaction gives back its own charges (and those of its committed
 * children), an aborting transaction all of them, in one script call. A
 * commit forgets them.
 */
#include "postgres.h"

#include "access/xact.h"
#include "utils/memutils.h"

#include "rl_redis.h"

/* One charge that an abort gives back. */
typedef struct RlTaken
{
	SubTransactionId subid;
	RlLimit		limit;
	StringInfo	key;
	int32		cost;
} RlTaken;

/* of RlTaken *, in TopTransactionContext; NIL outside a transaction */
static List *taken = NIL;

/* True when refund_on_abort covers charges made by a guard (or not). */
bool
rl_refund_wanted(bool by_guard)
{
	return rl_refund_on_abort == RL_REFUND_ALL ||
		(by_guard && rl_refund_on_abort == RL_REFUND_GUARDS);
}

/*
 * Remembers that cost units were taken from key under limit in the current
 * subtransaction, when refund_on_abort covers this kind of call.
 */
void
rl_remember_charge(const RlLimit *limit, StringInfo key, int32 cost,
				   bool by_guard)
{
	MemoryContext old;
	RlTaken    *t;

	if (cost <= 0 || !rl_refund_wanted(by_guard))
		return;

	old = MemoryContextSwitchTo(TopTransactionContext);
	t = palloc(sizeof(RlTaken));
	t->subid = GetCurrentSubTransactionId();
	t->limit = *limit;
	t->key = rl_copy_key(key);
	t->cost = cost;
	taken = lappend(taken, t);
	MemoryContextSwitchTo(old);
}

/*
 * Gives back the remembered charges of subtransaction subid, or all of them
 * when subid is InvalidSubTransactionId, in one script call, and forgets
 * them. Never raises: a refund that fails is logged.
 */
static void
rl_give_back(SubTransactionId subid)
{
	RlCharge   *charges;
	List	   *kept = NIL;
	ListCell   *lc;
	int			n = 0;
	RlDecision	d;
	int			index;
	RlFailure	failure;

	if (taken == NIL)
		return;
	charges = palloc(sizeof(RlCharge) * list_length(taken));
	foreach(lc, taken)
	{
		RlTaken    *t = (RlTaken *) lfirst(lc);

		if (subid != InvalidSubTransactionId && t->subid != subid)
		{
			MemoryContext old = MemoryContextSwitchTo(TopTransactionContext);

			kept = lappend(kept, t);
			MemoryContextSwitchTo(old);
			continue;
		}
		charges[n].limit = &t->limit;
		charges[n].key = t->key;
		charges[n].cost = -t->cost;
		n++;
	}
	/* after an interrupted wait on Redis, do not wait on it again */
	if (n > 0 && rl_transport_interrupted())
		ereport(WARNING,
				(errmsg("rate-limit units taken in the aborted transaction were not given back"),
				 errdetail("A call to Redis at %s was interrupted.", rl_server_name())));
	else if (n > 0 && !rl_decide_many(charges, n, &d, &index, &failure))
		ereport(WARNING,
				(errcode(failure.sqlerrcode),
				 errmsg_internal("%s", failure.message),
				 errdetail("Rate-limit units taken in the aborted transaction could not be given back.")));
	pfree(charges);
	taken = kept;
}

/* Gives back or forgets the charges at the end of a transaction. */
static void
rl_refund_xact_callback(XactEvent event, void *arg)
{
	switch (event)
	{
		case XACT_EVENT_ABORT:
		case XACT_EVENT_PARALLEL_ABORT:
			rl_give_back(InvalidSubTransactionId);
			taken = NIL;
			break;
		case XACT_EVENT_COMMIT:
		case XACT_EVENT_PARALLEL_COMMIT:
		case XACT_EVENT_PREPARE:
			taken = NIL;
			break;
		default:
			break;
	}
}

/*
 * Gives back the charges of an aborted subtransaction; hands those of a
 * committed one to its parent.
 */
static void
rl_refund_subxact_callback(SubXactEvent event, SubTransactionId mySubid,
						   SubTransactionId parentSubid, void *arg)
{
	ListCell   *lc;

	if (event == SUBXACT_EVENT_ABORT_SUB)
		rl_give_back(mySubid);
	else if (event == SUBXACT_EVENT_COMMIT_SUB)
	{
		foreach(lc, taken)
		{
			RlTaken    *t = (RlTaken *) lfirst(lc);

			if (t->subid == mySubid)
				t->subid = parentSubid;
		}
	}
}

/* Registers the callbacks; called once from _PG_init. */
void
rl_refund_init(void)
{
	RegisterXactCallback(rl_refund_xact_callback, NULL);
	RegisterSubXactCallback(rl_refund_subxact_callback, NULL);
}
