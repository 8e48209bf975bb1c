/*
 * xact_end.c
 *	  The one transaction callback of rl_redis. At the end of a transaction
 *	  or subtransaction the modules' work runs here, in this order:
 *
 *	  1. refund.c: an abort queues what its charges give back (a commit
 *	     queues the forgetting of their records);
 *	  2. slots.c: the concurrency slots the (sub)transaction held are
 *	     released (queued), and a slot request an error cut short is
 *	     given back;
 *	  3. xact_queue.c: the queues are sent within rl_redis.xact_end_budget.
 *
 *	  The order is stated here rather than left to the order in which the
 *	  modules would register callbacks of their own; the transport comes
 *	  last so that it sends what the others queued. Nothing here raises:
 *	  interrupts are held at a transaction end, where an ERROR is fatal.
 */
#include "postgres.h"

#include "access/xact.h"

#include "rl_redis.h"

/* At the end of a transaction: each module's part, in the stated order. */
static void
rl_xact_end_callback(XactEvent event, void *arg)
{
	rl_refund_xact_end(event);
	rl_slots_xact_end(event);
	rl_transport_xact_end(event);
}

/* At the end of a subtransaction: the same, in the same order. */
static void
rl_subxact_end_callback(SubXactEvent event, SubTransactionId mySubid,
						SubTransactionId parentSubid, void *arg)
{
	rl_refund_subxact_end(event);
	rl_slots_subxact_end(event);
	rl_transport_subxact_end(event);
}

/* Registers the transaction callbacks; called once from _PG_init. */
void
rl_xact_end_init(void)
{
	RegisterXactCallback(rl_xact_end_callback, NULL);
	RegisterSubXactCallback(rl_subxact_end_callback, NULL);
}
