/*
 * concurrency.c
 *	  The SQL functions of concurrency limits: rl_acquire, rl_release,
 *	  rl_concurrency_acquire, rl_concurrency_release.
 *
 * A slot is taken through rl_decide (engine.c), which checks the identity
 * and the limit (lim slots, a lease of at most rl_redis.max_lease) as it
 * checks every charge; the slots a backend holds are in slots.c.
 */
#include "postgres.h"

#include "utils/builtins.h"

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
