/*
 * policy.c
 *	  Named policies (the rl_policy table) and several limits at once.
 *
 * A policy names an algorithm and its numbers; rl_check(policy, identity)
 * decides with them, on a key of its own that carries the numbers its state
 * depends on (rl_build_key): a bucket's rate and burst, a count's window
 * alone. So a change of those numbers, or another database's policy of the
 * same name with others, counts on another key, while a count is kept
 * when only its lim changes.
 * Policies are read from rl_policy once and cached per backend. A trigger on
 * the table sends a relcache invalidation for it on every change. Every
 * lookup first takes in the invalidations that have arrived, and reads the
 * table with a fresh snapshot (not the transaction's, which in REPEATABLE
 * READ may predate the change), so the statement after a change commits uses
 * the new row in every session, at every isolation level.
 */
#include "postgres.h"

#include "access/htup_details.h"
#include "catalog/pg_type.h"
#include "commands/trigger.h"
#include "executor/spi.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/hsearch.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/snapmgr.h"

#include "rl_redis.h"

/* rl_policy.name is limited to this many bytes (a CHECK constraint) */
#define RL_POLICY_NAME_LEN 64

static HTAB *policy_cache = NULL;
static bool policy_cache_stale = true;
static uint64 policy_generation = 0;	/* counts invalidations */
static Oid	policy_schema = InvalidOid;
static Oid	policy_relid = InvalidOid;
static bool policy_has_mode = false;	/* rl_policy.mode exists (1.6) */

/* Marks the cache stale when rl_policy (or every relation) is invalidated. */
static void
rl_policy_invalidate(Datum arg, Oid relid)
{
	if (relid == InvalidOid || relid == policy_relid)
	{
		policy_cache_stale = true;
		policy_generation++;
	}
}

/* Registers the invalidation callback; called once from _PG_init. */
void
rl_policy_init(void)
{
	CacheRegisterRelcacheCallback(rl_policy_invalidate, (Datum) 0);
}

/*
 * Makes the cache empty and current when it is stale. The extension's
 * schema is found from the SQL function being called.
 */
static void
rl_policy_refresh(FunctionCallInfo fcinfo)
{
	HASHCTL		ctl;

	if (!policy_cache_stale && policy_cache != NULL)
		return;
	if (policy_cache != NULL)
		hash_destroy(policy_cache);

	ctl.keysize = RL_POLICY_NAME_LEN;
	ctl.entrysize = sizeof(RlPolicy);
	ctl.hcxt = TopMemoryContext;
	policy_cache = hash_create("rl_redis policies", 32, &ctl,
							   HASH_ELEM | HASH_STRINGS | HASH_CONTEXT);
	policy_schema = get_func_namespace(fcinfo->flinfo->fn_oid);
	policy_relid = get_relname_relid("rl_policy", policy_schema);
	policy_has_mode = OidIsValid(policy_relid) &&
		get_attnum(policy_relid, "mode") != InvalidAttrNumber;
	policy_cache_stale = false;
}

/* Returns the rl_policy table's schema-qualified name, for queries. */
static char *
rl_policy_table(void)
{
	return psprintf("%s.rl_policy",
					quote_identifier(get_namespace_name(policy_schema)));
}

/*
 * Returns the algorithm named name; NULL for "concurrency", which has no
 * script of its own here (see concurrency.c).
 */
static const RlAlgorithm *
rl_find_algorithm(const char *name)
{
	int			i;

	if (strcmp(name, "concurrency") == 0)
		return NULL;
	for (i = 0; i < RL_NUM_ALGORITHMS; i++)
		if (strcmp(rl_algorithms[i].name, name) == 0)
			return &rl_algorithms[i];
	ereport(ERROR,
			(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
			 errmsg("unknown rate-limit algorithm \"%s\"", name)));
	return NULL;				/* keep compiler quiet */
}

/*
 * Reads the policy named key from rl_policy into found with a fresh
 * snapshot; false when there is no such row. A schema of 1.5, not yet
 * updated, has no mode column: its policies enforce.
 */
static bool
rl_policy_read(text *name, const char *key, RlPolicy *found)
{
	Oid			argtypes[1] = {TEXTOID};
	Datum		args[1];
	bool		isnull;
	HeapTuple	tuple;
	TupleDesc	tupdesc;
	SPIPlanPtr	plan;
	char	   *algorithm;
	Snapshot	snapshot;

	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
	plan = SPI_prepare(psprintf("SELECT algorithm, lim, window_ms, burst, %s FROM %s WHERE name OPERATOR(pg_catalog.=) $1",
								policy_has_mode ?
								"mode OPERATOR(pg_catalog.=) 'shadow'" : "false",
								rl_policy_table()),
					   1, argtypes);
	if (plan == NULL)
		elog(ERROR, "could not prepare the query of rl_policy");
	args[0] = PointerGetDatum(name);
	snapshot = RegisterSnapshot(GetLatestSnapshot());
	if (SPI_execute_snapshot(plan, args, NULL, snapshot, InvalidSnapshot,
							 true, false, 1) != SPI_OK_SELECT)
		elog(ERROR, "could not read rl_policy");
	UnregisterSnapshot(snapshot);
	if (SPI_processed == 0)
	{
		SPI_finish();
		return false;
	}

	tuple = SPI_tuptable->vals[0];
	tupdesc = SPI_tuptable->tupdesc;
	memset(found, 0, sizeof(*found));
	strlcpy(found->name, key, sizeof(found->name));
	algorithm = SPI_getvalue(tuple, tupdesc, 1);
	found->limit.algorithm = rl_find_algorithm(algorithm);
	found->concurrency = found->limit.algorithm == NULL;
	found->limit.lim = DatumGetInt32(SPI_getbinval(tuple, tupdesc, 2, &isnull));
	found->limit.window_ms = DatumGetInt64(SPI_getbinval(tuple, tupdesc, 3, &isnull));
	found->limit.burst = DatumGetInt32(SPI_getbinval(tuple, tupdesc, 4, &isnull));
	if (isnull)
		found->limit.burst = 0;
	found->limit.shadow = DatumGetBool(SPI_getbinval(tuple, tupdesc, 5, &isnull));
	SPI_finish();
	return true;
}

/*
 * Reports 42704 at elevel: the policy named name does not exist. hint says
 * where to look or what to do.
 */
void
rl_policy_missing(const char *name, int elevel, const char *hint)
{
	ereport(elevel,
			(errcode(ERRCODE_UNDEFINED_OBJECT),
			 errmsg("rate-limit policy \"%s\" does not exist", name),
			 errhint("%s", hint)));
}

/*
 * Sets found to the policy named name (text), from the cache or from
 * rl_policy; false when there is none. found is a copy: the cache may be
 * dropped by the next invalidation.
 */
static bool
rl_policy_get(FunctionCallInfo fcinfo, text *name, RlPolicy *found)
{
	char		key[RL_POLICY_NAME_LEN];
	int			len = VARSIZE_ANY_EXHDR(name);
	RlPolicy   *entry;
	uint64		generation;

	if (len == 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("policy must not be empty")));
	if (len >= RL_POLICY_NAME_LEN)
		return false;
	memcpy(key, VARDATA_ANY(name), len);
	key[len] = '\0';

	/* a change committed by another session since our last statement */
	AcceptInvalidationMessages();
	rl_policy_refresh(fcinfo);
	entry = hash_search(policy_cache, key, HASH_FIND, NULL);
	if (entry != NULL)
	{
		*found = *entry;
		return true;
	}

	/*
	 * Read until no invalidation arrived during the read: one that did may
	 * belong to a change that the snapshot predates.
	 */
	do
	{
		generation = policy_generation;
		if (!rl_policy_read(name, key, found))
			return false;
		AcceptInvalidationMessages();
	} while (generation != policy_generation);

	rl_policy_refresh(fcinfo);
	entry = hash_search(policy_cache, key, HASH_ENTER, NULL);
	*entry = *found;
	return true;
}

/*
 * Returns the policy named name (text); raises 42704 when there is none.
 */
RlPolicy
rl_policy_lookup(FunctionCallInfo fcinfo, text *name)
{
	RlPolicy	found;

	if (!rl_policy_get(fcinfo, name, &found))
		rl_policy_missing(text_to_cstring(name), ERROR,
						  "Policies are rows of the rl_policy table.");
	return found;
}

/*
 * Sets limit to the limit of the rate policy named name (for guards); false
 * when there is none; raises 22023 for a concurrency policy.
 */
bool
rl_policy_find(FunctionCallInfo fcinfo, const char *name, RlLimit *limit)
{
	RlPolicy	policy;

	if (!rl_policy_get(fcinfo, cstring_to_text(name), &policy))
		return false;
	if (policy.concurrency)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("policy \"%s\" is a concurrency limit, not a rate limit", name)));
	*limit = policy.limit;
	return true;
}

/* Returns the policy named by argument argno, which must not be NULL. */
RlPolicy
rl_policy_arg(FunctionCallInfo fcinfo, int argno)
{
	if (PG_ARGISNULL(argno))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("policy must not be null")));
	return rl_policy_lookup(fcinfo, PG_GETARG_TEXT_PP(argno));
}

/* Returns the rate policy named by argument argno; 22023 for a concurrency one. */
static RlPolicy
rl_rate_policy_arg(FunctionCallInfo fcinfo, int argno)
{
	RlPolicy	policy = rl_policy_arg(fcinfo, argno);

	if (policy.concurrency)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("policy \"%s\" is a concurrency limit, not a rate limit",
						policy.name),
				 errhint("Take its slots with rl_acquire().")));
	return policy;
}

/*
 * rl_check(policy, identity, cost) and friends: one policy's decision. A
 * dry run (rl_inspect) takes a rate policy or a concurrency one (cost
 * slots), decides as a call would and writes nothing.
 */
static void
rl_check_policy(FunctionCallInfo fcinfo, bool refund, bool dry_run,
				RlDecision *d)
{
	RlPolicy	policy = dry_run ? rl_policy_arg(fcinfo, 0) : rl_rate_policy_arg(fcinfo, 0);
	RlCharge	charge = {&policy.limit, policy.name};
	RlRequest	req = {policy.concurrency ? RL_DECIDE_SLOT : RL_DECIDE_ONE,
	&charge, 1, NULL, RL_BY_CALL, NULL};

	charge.identity = rl_get_identity(fcinfo, 1);
	charge.cost = rl_get_cost(fcinfo, 2, refund ? "amount" : "cost");
	charge.dry_run = dry_run;
	if (refund)
		charge.cost = -charge.cost;
	rl_decide(&req, d);
}

PG_FUNCTION_INFO_V1(rl_check);

/* rl_check(policy, identity, cost): the policy's decision as rl_result. */
Datum
rl_check(PG_FUNCTION_ARGS)
{
	RlDecision	d;

	rl_check_policy(fcinfo, false, false, &d);
	return rl_result_datum(fcinfo, &d);
}

PG_FUNCTION_INFO_V1(rl_allow);

/* rl_allow(policy, identity, cost): the policy's decision as boolean. */
Datum
rl_allow(PG_FUNCTION_ARGS)
{
	RlDecision	d;

	rl_check_policy(fcinfo, false, false, &d);
	PG_RETURN_BOOL(d.allowed);
}

PG_FUNCTION_INFO_V1(rl_inspect);

/*
 * rl_inspect(policy, identity, cost): what rl_check (or, for a concurrency
 * policy, taking cost slots) would answer now, as rl_result; charges
 * nothing and writes nothing.
 */
Datum
rl_inspect(PG_FUNCTION_ARGS)
{
	RlDecision	d;

	rl_check_policy(fcinfo, false, true, &d);
	return rl_result_datum(fcinfo, &d);
}

PG_FUNCTION_INFO_V1(rl_refund);

/* rl_refund(policy, identity, amount): gives units back to the policy. */
Datum
rl_refund(PG_FUNCTION_ARGS)
{
	RlDecision	d;

	rl_check_policy(fcinfo, true, false, &d);
	return rl_result_datum(fcinfo, &d);
}

PG_FUNCTION_INFO_V1(rl_check_many);

/*
 * rl_check_many(policy, identities, cost): the policy's decision for each
 * identity on its own, one row each, in one round trip per Redis node.
 */
Datum
rl_check_many(PG_FUNCTION_ARGS)
{
	RlPolicy	policy = rl_rate_policy_arg(fcinfo, 0);
	int32		cost = rl_get_cost(fcinfo, 2, "cost");

	rl_batch_rows(fcinfo, &policy.limit, policy.name, 1, cost);
	return (Datum) 0;
}

/*
 * Decides every policy in the array for one identity in one script call:
 * the cost is taken from all of them or from none. d is the most
 * restrictive policy's result.
 */
static void
rl_check_policies(FunctionCallInfo fcinfo, RlDecision *d)
{
	ArrayType  *array;
	Datum	   *names;
	bool	   *nulls;
	int			n;
	text	   *identity;
	int32		cost;
	RlPolicy   *policies;
	int			npolicies = 0;
	RlCharge   *charges;
	RlRequest	req = {RL_DECIDE_ALL, NULL, 0, NULL, RL_BY_CALL, NULL};
	int			i,
				j;

	if (PG_ARGISNULL(0))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("policies must not be null")));
	array = PG_GETARG_ARRAYTYPE_P(0);
	deconstruct_array(array, TEXTOID, -1, false, TYPALIGN_INT,
					  &names, &nulls, &n);
	if (n == 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("policies must not be empty")));
	identity = rl_get_identity(fcinfo, 1);
	cost = rl_get_cost(fcinfo, 2, "cost");

	/* look every policy up, once each */
	policies = palloc(sizeof(RlPolicy) * n);
	for (i = 0; i < n; i++)
	{
		RlPolicy	p;

		if (nulls[i])
			ereport(ERROR,
					(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
					 errmsg("policies must not contain null")));
		p = rl_policy_lookup(fcinfo, DatumGetTextPP(names[i]));
		if (p.concurrency)
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("policy \"%s\" is a concurrency limit, not a rate limit",
							p.name)));
		for (j = 0; j < npolicies; j++)
			if (strcmp(policies[j].name, p.name) == 0)
				break;
		if (j == npolicies)
			policies[npolicies++] = p;
	}

	charges = palloc0(sizeof(RlCharge) * npolicies);
	for (j = 0; j < npolicies; j++)
	{
		charges[j].limit = &policies[j].limit;
		charges[j].policy = policies[j].name;
		charges[j].identity = identity;
		charges[j].cost = cost;
	}
	req.charges = charges;
	req.n = npolicies;
	(void) rl_decide(&req, d);
}

PG_FUNCTION_INFO_V1(rl_check_all);

/* rl_check_all(policies, identity, cost): all limits or none, as rl_result. */
Datum
rl_check_all(PG_FUNCTION_ARGS)
{
	RlDecision	d;

	rl_check_policies(fcinfo, &d);
	return rl_result_datum(fcinfo, &d);
}

PG_FUNCTION_INFO_V1(rl_allow_all);

/* rl_allow_all(policies, identity, cost): all limits or none, as boolean. */
Datum
rl_allow_all(PG_FUNCTION_ARGS)
{
	RlDecision	d;

	rl_check_policies(fcinfo, &d);
	PG_RETURN_BOOL(d.allowed);
}

PG_FUNCTION_INFO_V1(rl_policy_changed);

/*
 * Statement trigger on rl_policy: invalidates the table's relcache entry, so
 * that every backend drops its cached policies (at commit).
 */
Datum
rl_policy_changed(PG_FUNCTION_ARGS)
{
	TriggerData *trigdata = (TriggerData *) fcinfo->context;

	if (!CALLED_AS_TRIGGER(fcinfo))
		ereport(ERROR,
				(errcode(ERRCODE_E_R_I_E_TRIGGER_PROTOCOL_VIOLATED),
				 errmsg("rl_policy_changed must be called as a trigger")));
	CacheInvalidateRelcache(trigdata->tg_relation);
	PG_RETURN_POINTER(NULL);
}
