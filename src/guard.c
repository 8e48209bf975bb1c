/*
 * guard.c
 *	  Trigger functions that rate-limit the writes to a table.
 *
 *	  rl_guard(limit, identity_columns [, cost_column])
 *		  FOR EACH ROW: one decision per row.
 *	  rl_guard_statement(limit, identity_columns [, cost_column])
 *		  FOR EACH STATEMENT with REFERENCING NEW TABLE: each identity is
 *		  charged its rows (or the sum of its cost column) in one script call,
 *		  all or nothing for the statement.
 *
 * limit is a policy name (a row of rl_policy) or an explicit
 * "<algorithm>:<lim>/<window_ms>[/<burst>]". identity_columns names one
 * column or several separated by commas; the identity is their text values
 * joined with ':'. A denied write raises SQLSTATE PT429 (which PostgREST
 * answers with HTTP 429) with the limit in DETAIL and the wait in HINT.
 */
#include "postgres.h"

#include <math.h>

#include "catalog/pg_type.h"
#include "commands/trigger.h"
#include "executor/spi.h"
#include "utils/builtins.h"
#include "utils/lsyscache.h"
#include "utils/rel.h"

#include "rl_redis.h"

#define ERRCODE_RL_RATE_LIMITED MAKE_SQLSTATE('P','T','4','2','9')

/* What a guard trigger's arguments say, resolved for its relation. */
typedef struct RlGuard
{
	Oid			tgoid;			/* the trigger this was built for */
	RlLimit		limit;
	char	   *policy;			/* policy name, or NULL for an explicit limit */
	char	   *limit_arg;		/* the argument as written, for messages */
	int			ncolumns;
	AttrNumber *columns;		/* identity columns */
	char	  **column_names;
	AttrNumber	cost_column;	/* InvalidAttrNumber when none */
	char	   *cost_name;
	Oid			cost_type;
} RlGuard;

/*
 * Parses "<algorithm>:<lim>/<window_ms>[/<burst>]" into limit; false when
 * arg does not have that form (it is then a policy name).
 */
static bool
rl_parse_limit_spec(const char *arg, RlLimit *limit)
{
	int			i;

	for (i = 0; i < rl_num_algorithms; i++)
	{
		const char *name = rl_algorithms[i].name;
		size_t		len = strlen(name);
		long long	lim,
					window,
					burst = 0;
		int			used = 0;

		if (strncmp(arg, name, len) != 0 || arg[len] != ':')
			continue;
		if (sscanf(arg + len + 1, "%lld/%lld%n", &lim, &window, &used) != 2)
			return false;
		if (arg[len + 1 + used] == '/')
		{
			int			more = 0;

			if (sscanf(arg + len + 1 + used + 1, "%lld%n", &burst, &more) != 1)
				return false;
			used += 1 + more;
		}
		if (arg[len + 1 + used] != '\0')
			return false;
		if (lim <= 0 || lim > PG_INT32_MAX || window <= 0 ||
			window > RL_MAX_WINDOW_MS || burst < 0 || burst > PG_INT32_MAX)
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("invalid rate limit \"%s\"", arg),
					 errdetail("lim, window_ms and burst must be greater than zero, and window_ms at most 100 years.")));
		limit->algorithm = &rl_algorithms[i];
		limit->lim = (int32) lim;
		limit->window_ms = window;
		limit->burst = (int32) burst;
		rl_check_limit(limit);
		return true;
	}
	return false;
}

/* Returns the attribute number of column name in rel, or raises 42703. */
static AttrNumber
rl_guard_column(Relation rel, const char *name)
{
	AttrNumber	attnum = SPI_fnumber(RelationGetDescr(rel), name);

	if (attnum <= 0)
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_COLUMN),
				 errmsg("column \"%s\" of relation \"%s\" does not exist",
						name, RelationGetRelationName(rel)),
				 errhint("The second argument of a rate-limit guard names the identity columns, separated by commas.")));
	return attnum;
}

/*
 * Resolves the trigger's arguments once per statement (cached in fn_extra)
 * and returns them.
 */
static RlGuard *
rl_guard_setup(FunctionCallInfo fcinfo, const char *fname)
{
	TriggerData *trigdata = (TriggerData *) fcinfo->context;
	Trigger    *trigger;
	Relation	rel;
	RlGuard    *guard = (RlGuard *) fcinfo->flinfo->fn_extra;
	MemoryContext old;
	char	   *list;
	char	   *tok;
	char	   *save;
	int			i;

	if (!CALLED_AS_TRIGGER(fcinfo))
		ereport(ERROR,
				(errcode(ERRCODE_E_R_I_E_TRIGGER_PROTOCOL_VIOLATED),
				 errmsg("%s must be called as a trigger", fname)));
	trigger = trigdata->tg_trigger;
	rel = trigdata->tg_relation;
	if (guard != NULL && guard->tgoid == trigger->tgoid)
		return guard;

	if (trigger->tgnargs < 2 || trigger->tgnargs > 3)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s takes a limit, the identity columns and an optional cost column", fname),
				 errhint("For example: EXECUTE FUNCTION %s('free', 'tenant_id').", fname)));

	old = MemoryContextSwitchTo(fcinfo->flinfo->fn_mcxt);
	guard = palloc0(sizeof(RlGuard));
	guard->tgoid = trigger->tgoid;
	guard->limit_arg = pstrdup(trigger->tgargs[0]);
	if (!rl_parse_limit_spec(guard->limit_arg, &guard->limit))
	{
		guard->limit = rl_policy_find(fcinfo, guard->limit_arg);
		guard->policy = guard->limit_arg;
	}

	list = pstrdup(trigger->tgargs[1]);
	guard->columns = palloc(sizeof(AttrNumber) * (strlen(list) + 1));
	guard->column_names = palloc(sizeof(char *) * (strlen(list) + 1));
	for (tok = strtok_r(list, ",", &save); tok; tok = strtok_r(NULL, ",", &save))
	{
		while (*tok == ' ')
			tok++;
		for (i = strlen(tok); i > 0 && tok[i - 1] == ' '; i--)
			tok[i - 1] = '\0';
		guard->column_names[guard->ncolumns] = tok;
		guard->columns[guard->ncolumns++] = rl_guard_column(rel, tok);
	}
	if (guard->ncolumns == 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s needs at least one identity column", fname)));

	guard->cost_column = InvalidAttrNumber;
	if (trigger->tgnargs == 3)
	{
		guard->cost_name = pstrdup(trigger->tgargs[2]);
		guard->cost_column = rl_guard_column(rel, guard->cost_name);
		guard->cost_type = TupleDescAttr(RelationGetDescr(rel),
										 guard->cost_column - 1)->atttypid;
		if (guard->cost_type != INT2OID && guard->cost_type != INT4OID &&
			guard->cost_type != INT8OID)
			ereport(ERROR,
					(errcode(ERRCODE_DATATYPE_MISMATCH),
					 errmsg("cost column \"%s\" must be of an integer type",
							guard->cost_name)));
	}
	MemoryContextSwitchTo(old);
	fcinfo->flinfo->fn_extra = guard;
	return guard;
}

/* Raises the rate-limit error (PT429) for identity. */
static void
rl_guard_denied(RlGuard *guard, Relation rel, const char *identity,
				const RlDecision *d)
{
	if (d->retry_after_ms < 0)
		ereport(ERROR,
				(errcode(ERRCODE_RL_RATE_LIMITED),
				 errmsg("rate limit \"%s\" exceeded for \"%s\"",
						guard->limit_arg, identity),
				 errdetail("Limit: %d; remaining: %d.", d->lim, d->remaining),
				 errhint("The write costs more than the limit allows at once; it can never pass."),
				 errtable(rel)));
	ereport(ERROR,
			(errcode(ERRCODE_RL_RATE_LIMITED),
			 errmsg("rate limit \"%s\" exceeded for \"%s\"",
					guard->limit_arg, identity),
			 errdetail("Limit: %d; remaining: %d.", d->lim, d->remaining),
			 errhint("Retry after " INT64_FORMAT " s.",
					 (int64) ceil(d->retry_after_ms / 1000.0)),
			 errtable(rel)));
}

/* The identity of one row: its identity columns' text joined with ':'. */
static char *
rl_guard_identity(RlGuard *guard, Relation rel, HeapTuple tuple)
{
	TupleDesc	tupdesc = RelationGetDescr(rel);
	StringInfoData buf;
	int			i;

	initStringInfo(&buf);
	for (i = 0; i < guard->ncolumns; i++)
	{
		bool		isnull;
		Datum		value = heap_getattr(tuple, guard->columns[i], tupdesc, &isnull);
		Oid			typoutput;
		bool		varlena;

		if (isnull)
			ereport(ERROR,
					(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
					 errmsg("identity column \"%s\" must not be null",
							guard->column_names[i]),
					 errdetail("Rows of \"%s\" are rate-limited by \"%s\" per %s.",
							   RelationGetRelationName(rel), guard->limit_arg,
							   quote_identifier(guard->column_names[i])),
					 errtable(rel)));
		getTypeOutputInfo(TupleDescAttr(tupdesc, guard->columns[i] - 1)->atttypid,
						  &typoutput, &varlena);
		if (i > 0)
			appendStringInfoChar(&buf, ':');
		appendStringInfoString(&buf, OidOutputFunctionCall(typoutput, value));
	}
	if (buf.len == 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("identity must not be empty"),
				 errtable(rel)));
	return buf.data;
}

/* Checks a cost value: not NULL, not negative, fits an integer. */
static int32
rl_guard_cost(RlGuard *guard, Relation rel, bool isnull, int64 cost)
{
	if (isnull)
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("cost column \"%s\" must not be null", guard->cost_name),
				 errtable(rel)));
	if (cost < 0 || cost > PG_INT32_MAX)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("cost column \"%s\" is out of range: " INT64_FORMAT,
						guard->cost_name, cost),
				 errtable(rel)));
	return (int32) cost;
}

PG_FUNCTION_INFO_V1(rl_guard);

/*
 * Row guard: charges the row's identity one unit (or its cost column) and
 * raises PT429 when the limit denies it.
 */
Datum
rl_guard(PG_FUNCTION_ARGS)
{
	TriggerData *trigdata = (TriggerData *) fcinfo->context;
	RlGuard    *guard = rl_guard_setup(fcinfo, "rl_guard");
	Relation	rel = trigdata->tg_relation;
	HeapTuple	tuple;
	char	   *identity;
	text	   *identity_text;
	int32		cost = 1;
	RlDecision	d;

	if (!TRIGGER_FIRED_FOR_ROW(trigdata->tg_event) ||
		!(TRIGGER_FIRED_BY_INSERT(trigdata->tg_event) ||
		  TRIGGER_FIRED_BY_UPDATE(trigdata->tg_event)))
		ereport(ERROR,
				(errcode(ERRCODE_E_R_I_E_TRIGGER_PROTOCOL_VIOLATED),
				 errmsg("rl_guard must be fired FOR EACH ROW on INSERT or UPDATE")));

	tuple = TRIGGER_FIRED_BY_UPDATE(trigdata->tg_event) ?
		trigdata->tg_newtuple : trigdata->tg_trigtuple;

	if (guard->cost_column != InvalidAttrNumber)
	{
		bool		isnull;
		Datum		value = heap_getattr(tuple, guard->cost_column,
										 RelationGetDescr(rel), &isnull);
		int64		raw = 0;

		if (!isnull)
			raw = guard->cost_type == INT2OID ? DatumGetInt16(value) :
				guard->cost_type == INT4OID ? DatumGetInt32(value) :
				DatumGetInt64(value);
		cost = rl_guard_cost(guard, rel, isnull, raw);
	}
	identity = rl_guard_identity(guard, rel, tuple);
	if (cost > 0)
	{
		identity_text = cstring_to_text(identity);
		rl_decide_limit(&guard->limit, identity_text, guard->policy, cost, &d);
		if (!d.allowed)
			rl_guard_denied(guard, rel, identity, &d);
		if (d.from_redis)
			rl_remember_charge(&guard->limit,
							   rl_build_key(guard->limit.algorithm->name,
											identity_text, guard->policy),
							   cost, true);
	}
	return PointerGetDatum(tuple);
}

PG_FUNCTION_INFO_V1(rl_guard_statement);

/*
 * Statement guard: reads the statement's new rows from its transition
 * table, charges each identity its rows (or their cost) in one script call,
 * all or nothing, and raises PT429 when any identity is denied.
 */
Datum
rl_guard_statement(PG_FUNCTION_ARGS)
{
	TriggerData *trigdata = (TriggerData *) fcinfo->context;
	RlGuard    *guard = rl_guard_setup(fcinfo, "rl_guard_statement");
	Relation	rel = trigdata->tg_relation;
	StringInfoData query;
	RlCharge   *charges;
	char	  **identities;
	uint64		n,
				i;
	int			worst;
	RlDecision	d;
	RlFailure	failure;
	int			c;

	if (!TRIGGER_FIRED_FOR_STATEMENT(trigdata->tg_event) ||
		!TRIGGER_FIRED_AFTER(trigdata->tg_event) ||
		trigdata->tg_trigger->tgnewtable == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_E_R_I_E_TRIGGER_PROTOCOL_VIOLATED),
				 errmsg("rl_guard_statement must be fired AFTER ... FOR EACH STATEMENT with REFERENCING NEW TABLE"),
				 errhint("For example: CREATE TRIGGER t AFTER INSERT ON tbl REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION rl_guard_statement('free', 'tenant_id').")));

	/*
	 * Units per identity, grouped by the executor on the raw columns (so
	 * only one value per group is turned into text), with the NULL checks.
	 */
	initStringInfo(&query);
	appendStringInfoString(&query, "SELECT concat_ws(':'");
	for (c = 0; c < guard->ncolumns; c++)
		appendStringInfo(&query, ", %s::text", quote_identifier(guard->column_names[c]));
	if (guard->cost_column != InvalidAttrNumber)
		appendStringInfo(&query, "), sum(%s)::bigint, bool_or(%s IS NULL), min(%s)::bigint",
						 quote_identifier(guard->cost_name),
						 quote_identifier(guard->cost_name),
						 quote_identifier(guard->cost_name));
	else
		appendStringInfoString(&query, "), count(*)::bigint, false, 0::bigint");
	appendStringInfoString(&query, ", ");
	for (c = 0; c < guard->ncolumns; c++)
		appendStringInfo(&query, "%s%s IS NULL", c > 0 ? " OR " : "",
						 quote_identifier(guard->column_names[c]));
	appendStringInfo(&query, " FROM %s GROUP BY ",
					 quote_identifier(trigdata->tg_trigger->tgnewtable));
	for (c = 0; c < guard->ncolumns; c++)
		appendStringInfo(&query, "%s%s", c > 0 ? ", " : "",
						 quote_identifier(guard->column_names[c]));

	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
	if (SPI_register_trigger_data(trigdata) != SPI_OK_TD_REGISTER)
		elog(ERROR, "SPI_register_trigger_data failed");
	if (SPI_execute(query.data, true, 0) != SPI_OK_SELECT)
		elog(ERROR, "could not read the new rows of \"%s\"", RelationGetRelationName(rel));

	n = SPI_processed;
	charges = palloc(sizeof(RlCharge) * (n > 0 ? n : 1));
	identities = palloc(sizeof(char *) * (n > 0 ? n : 1));
	for (i = 0; i < n; i++)
	{
		HeapTuple	tuple = SPI_tuptable->vals[i];
		TupleDesc	tupdesc = SPI_tuptable->tupdesc;
		bool		isnull;
		bool		cost_null = DatumGetBool(SPI_getbinval(tuple, tupdesc, 3, &isnull));
		int64		cost_min = DatumGetInt64(SPI_getbinval(tuple, tupdesc, 4, &isnull));
		int64		units;

		if (DatumGetBool(SPI_getbinval(tuple, tupdesc, 5, &isnull)))
			ereport(ERROR,
					(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
					 errmsg("identity columns \"%s\" must not be null",
							trigdata->tg_trigger->tgargs[1]),
					 errtable(rel)));
		identities[i] = SPI_getvalue(tuple, tupdesc, 1);
		if (identities[i] == NULL || identities[i][0] == '\0')
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("identity must not be empty"),
					 errtable(rel)));
		units = DatumGetInt64(SPI_getbinval(tuple, tupdesc, 2, &isnull));
		rl_guard_cost(guard, rel, cost_null, cost_min < 0 ? cost_min : units);
		charges[i].limit = &guard->limit;
		charges[i].key = rl_copy_key(rl_build_key(guard->limit.algorithm->name,
												  cstring_to_text(identities[i]),
												  guard->policy));
		charges[i].cost = (int32) units;
	}

	if (n > 0)
	{
		if (!rl_decide_many(charges, (int) n, &d, &worst, &failure))
		{
			rl_apply_on_error(&failure, guard->limit.lim, 0, &d);
			worst = 0;
		}
		if (!d.allowed)
			rl_guard_denied(guard, rel, identities[worst], &d);
		if (d.from_redis)
			for (i = 0; i < n; i++)
				rl_remember_charge(&guard->limit, charges[i].key,
								   charges[i].cost, true);
	}
	SPI_finish();
	return PointerGetDatum(NULL);
}
