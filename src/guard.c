/*
 * guard.c
 *	  Trigger functions that rate-limit the writes to a table.
 *
 *	  rl_guard(limit, identity_columns [, cost_column])
 *		  AFTER INSERT OR UPDATE ... FOR EACH ROW: one decision per row
 *		  written (so rows that INSERT ... ON CONFLICT skips cost nothing,
 *		  and an upsert costs one unit per row).
 *	  rl_guard_statement(limit, identity_columns [, cost_column])
 *		  FOR EACH STATEMENT with REFERENCING NEW TABLE: each identity is
 *		  charged its rows (or the sum of its cost column) in one script call,
 *		  all or nothing for the statement.
 *
 * limit is a policy name (a row of rl_policy) or an explicit
 * "<algorithm>:<lim>/<window_ms>[/<burst>]". identity_columns names one
 * column or several separated by commas. With one column the identity is its
 * text value as is; with several, each value has '\' and ':' escaped with a
 * backslash and they are joined with ':'. Values of other types than
 * integers and text are rendered with fixed settings (DateStyle ISO,
 * TimeZone UTC, IntervalStyle postgres, extra_float_digits 1, bytea_output
 * hex), so that the session cannot change a row's identity; values that
 * compare equal give one identity where the type allows it (numeric without
 * trailing zeros, an interval as the days and microseconds it compares by,
 * -0 as 0, money as its integer). A column whose equal values can differ in
 * text otherwise (jsonb, citext, a nondeterministic collation) is refused. A denied write
 * raises SQLSTATE PT429 (which PostgREST answers with HTTP 429) with the
 * limit in DETAIL and the wait in HINT.
 */
#include "postgres.h"

#include <math.h>

#include "access/nbtree.h"
#include "access/relation.h"
#include "access/table.h"
#include "access/xact.h"
#include "catalog/pg_am.h"
#include "catalog/pg_trigger.h"
#include "catalog/pg_type.h"
#include "commands/defrem.h"
#include "commands/event_trigger.h"
#include "commands/trigger.h"
#include "common/hashfn.h"
#include "executor/executor.h"
#include "executor/spi.h"
#include "funcapi.h"
#include "mb/pg_wchar.h"
#include "miscadmin.h"
#include "pgtime.h"
#include "storage/lmgr.h"
#include "utils/builtins.h"
#include "utils/cash.h"
#include "utils/numeric.h"
#include "utils/timestamp.h"
#include "utils/bytea.h"
#include "utils/float.h"
#include "utils/guc.h"
#include "utils/lsyscache.h"
#include "utils/rel.h"
#include "utils/resowner.h"
#include "utils/tuplestore.h"

#include "rl_redis.h"

#define ERRCODE_RL_RATE_LIMITED MAKE_SQLSTATE('P','T','4','2','9')

/* How the value of an identity column is written into the identity. */
typedef enum RlColumnKind
{
	RL_COLUMN_INT2,
	RL_COLUMN_INT4,
	RL_COLUMN_INT8,
	RL_COLUMN_TEXT,				/* text, varchar: the bytes */
	RL_COLUMN_NUMERIC,			/* numeric without trailing zeros (7.0 is 7) */
	RL_COLUMN_MONEY,			/* money as its integer (its text follows
								 * lc_monetary) */
	RL_COLUMN_INTERVAL,			/* interval as days and microseconds, as it
								 * compares ('1 day' is '24 hours') */
	RL_COLUMN_FLOAT4,			/* float4 under fixed settings, -0 as 0 */
	RL_COLUMN_FLOAT8,			/* float8 likewise */
	RL_COLUMN_OUTPUT,			/* through the type's output function */
	RL_COLUMN_OUTPUT_FIXED		/* the same, under fixed settings */
} RlColumnKind;

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
	RlColumnKind *column_kinds;
	FmgrInfo   *column_output;	/* their output functions */
	bool		fixed_settings; /* some column's text depends on settings */
	AttrNumber	cost_column;	/* InvalidAttrNumber when none */
	char	   *cost_name;
	Oid			cost_type;
} RlGuard;

/* What a guard's limit argument looks like. */
typedef enum RlLimitSpec
{
	RL_SPEC_POLICY,				/* no "<algorithm>:" prefix: a policy name */
	RL_SPEC_LIMIT,				/* an explicit limit, parsed */
	RL_SPEC_MALFORMED			/* "<algorithm>:" and then not a limit */
} RlLimitSpec;

/*
 * Parses "<algorithm>:<lim>/<window_ms>[/<burst>]" into limit. Returns
 * whether arg has that form, is a policy name, or starts like a limit and
 * is not one (a policy's name may still read so).
 */
static RlLimitSpec
rl_parse_limit_spec(const char *arg, RlLimit *limit)
{
	int			i;

	for (i = 0; i < RL_NUM_ALGORITHMS; i++)
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
			return RL_SPEC_MALFORMED;
		if (arg[len + 1 + used] == '/')
		{
			int			more = 0;

			if (sscanf(arg + len + 1 + used + 1, "%lld%n", &burst, &more) != 1)
				return RL_SPEC_MALFORMED;
			used += 1 + more;
			if (burst <= 0)
				burst = -1;		/* rejected by rl_check_limit */
		}
		if (arg[len + 1 + used] != '\0')
			return RL_SPEC_MALFORMED;
		if (lim <= 0 || lim > PG_INT32_MAX || window <= 0 ||
			window > RL_MAX_WINDOW_MS || burst > PG_INT32_MAX)
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("invalid rate limit \"%s\"", arg),
					 errdetail("lim, window_ms and burst must be greater than zero, and window_ms at most 100 years.")));
		limit->algorithm = &rl_algorithms[i];
		limit->lim = (int32) lim;
		limit->window_ms = window;
		limit->burst = (int32) burst;
		limit->shadow = false;	/* only a policy is ever shadow */
		return RL_SPEC_LIMIT;
	}
	return RL_SPEC_POLICY;
}

/*
 * Sets guard->limit (and guard->policy) from its limit argument: an
 * explicit limit, checked as the functions check theirs, or a rate
 * policy's. Raises 22023 for a malformed limit that names no policy, 42704
 * for a missing policy. While the guard is being created, a missing policy
 * is only a warning (guard->limit is then left empty): a restore, parallel
 * ones above all, may create the trigger before rl_policy's rows arrive.
 */
static void
rl_guard_limit(FunctionCallInfo fcinfo, RlGuard *guard, bool creating)
{
	RlLimitSpec spec = rl_parse_limit_spec(guard->limit_arg, &guard->limit);

	if (spec == RL_SPEC_LIMIT)
	{
		rl_check_limit(&guard->limit);
		return;
	}
	if (rl_policy_find(fcinfo, guard->limit_arg, &guard->limit))
	{
		guard->policy = guard->limit_arg;
		return;
	}
	if (spec == RL_SPEC_MALFORMED)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("invalid rate limit \"%s\"", guard->limit_arg),
				 errdetail("An explicit limit is written <algorithm>:<lim>/<window_ms>[/<burst>], for example fixed:100/60000."),
				 errhint("Write the limit in that form, or name a policy (a row of rl_policy).")));
	if (creating)
	{
		rl_policy_missing(guard->limit_arg, WARNING,
						  "Every write to the table fails until the policy is inserted into rl_policy (rl_guard_check() lists such guards). Restores create triggers before rl_policy's rows, so this is not an error.");
		guard->policy = guard->limit_arg;
		return;
	}
	rl_policy_missing(guard->limit_arg, ERROR,
					  "Insert the policy into rl_policy first (INSERT INTO rl_policy (name, algorithm, lim, window_ms) VALUES (...)), or write an explicit limit such as 'fixed:100/60000'.");
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
 * Returns how a column of type typid is written into an identity: integers
 * and text (also under a domain) directly; the few types whose output
 * functions read no setting through those; all others through their output
 * functions under fixed settings (rl_guard_fixed_settings).
 */
static RlColumnKind
rl_guard_column_kind(Oid typid)
{
	switch (getBaseType(typid))
	{
		case INT2OID:
			return RL_COLUMN_INT2;
		case INT4OID:
			return RL_COLUMN_INT4;
		case INT8OID:
			return RL_COLUMN_INT8;
		case TEXTOID:
		case VARCHAROID:
			return RL_COLUMN_TEXT;
		case NUMERICOID:
			return RL_COLUMN_NUMERIC;
		case CASHOID:
			return RL_COLUMN_MONEY;
		case INTERVALOID:
			return RL_COLUMN_INTERVAL;
		case FLOAT4OID:
			return RL_COLUMN_FLOAT4;
		case FLOAT8OID:
			return RL_COLUMN_FLOAT8;
		case BOOLOID:
		case BPCHAROID:
		case CHAROID:
		case NAMEOID:
		case OIDOID:
		case UUIDOID:
			return RL_COLUMN_OUTPUT;
		default:
			return RL_COLUMN_OUTPUT_FIXED;
	}
}

/*
 * Raises 42804 unless equal values of column name (of type typid and
 * collation collation) always have the same text, so that one tenant is one
 * identity: true for the types written in a canonical form here (integers,
 * numeric, interval, floats) and for those whose default btree operator
 * class says equality is equality of the stored image (its "equalimage"
 * support function, as B-tree deduplication asks: text under a
 * deterministic collation, dates, timestamps, uuid, bytea ...); false for
 * citext, jsonb ('1' and '1.0'), text under a nondeterministic collation.
 */
static void
rl_guard_check_equality(Relation rel, const char *name, RlColumnKind kind,
						Oid typid, Oid collation)
{
	Oid			opclass;
	Oid			proc = InvalidOid;

	if (kind != RL_COLUMN_TEXT && kind != RL_COLUMN_OUTPUT &&
		kind != RL_COLUMN_OUTPUT_FIXED)
		return;
	opclass = GetDefaultOpClass(typid, BTREE_AM_OID);
	if (OidIsValid(opclass))
		proc = get_opfamily_proc(get_opclass_family(opclass),
								 get_opclass_input_type(opclass),
								 get_opclass_input_type(opclass),
								 BTEQUALIMAGE_PROC);
	if (OidIsValid(proc) &&
		DatumGetBool(OidFunctionCall1Coll(proc, collation,
										  ObjectIdGetDatum(get_opclass_input_type(opclass)))))
		return;
	ereport(ERROR,
			(errcode(ERRCODE_DATATYPE_MISMATCH),
			 errmsg("column \"%s\" of relation \"%s\" cannot be a rate-limit identity",
					name, RelationGetRelationName(rel)),
			 errdetail("Values of type %s%s can be equal with a different text, and would count as different identities.",
					   format_type_be(typid),
					   OidIsValid(collation) && !get_collation_isdeterministic(collation) ?
					   " under a nondeterministic collation" : ""),
			 errhint("Guard a column that holds one form of each value, for example a generated column lower(email).")));
}

/*
 * Raises sqlstate unless trigger is declared as its guard needs: rl_guard
 * AFTER INSERT and/or UPDATE ... FOR EACH ROW (a BEFORE trigger also sees
 * the rows that INSERT ... ON CONFLICT skips or turns into an UPDATE);
 * rl_guard_statement AFTER ... FOR EACH STATEMENT with REFERENCING NEW
 * TABLE (which PostgreSQL allows on INSERT or UPDATE only).
 */
static void
rl_guard_check_type(const Trigger *trigger, bool statement, int sqlstate)
{
	int16		type = trigger->tgtype;
	bool		after = !TRIGGER_FOR_BEFORE(type) && !TRIGGER_FOR_INSTEAD(type);

	if (!statement &&
		!(after && TRIGGER_FOR_ROW(type) && !TRIGGER_FOR_DELETE(type)))
		ereport(ERROR,
				(errcode(sqlstate),
				 errmsg("rl_guard must be fired AFTER INSERT OR UPDATE ... FOR EACH ROW"),
				 errdetail("The row guard charges each row written, once it is written."),
				 errhint("For example: CREATE TRIGGER t AFTER INSERT ON tbl FOR EACH ROW EXECUTE FUNCTION rl_guard('free', 'tenant_id').")));
	if (statement &&
		!(after && !TRIGGER_FOR_ROW(type) && trigger->tgnewtable != NULL))
		ereport(ERROR,
				(errcode(sqlstate),
				 errmsg("rl_guard_statement must be fired AFTER ... FOR EACH STATEMENT with REFERENCING NEW TABLE"),
				 errdetail("The statement guard reads the statement's new rows from its transition table."),
				 errhint("For example: CREATE TRIGGER t AFTER INSERT ON tbl REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION rl_guard_statement('free', 'tenant_id').")));
}

/*
 * Resolves the arguments of the guard trigger on rel into an RlGuard
 * allocated in cxt, raising the first problem: the one parser and checker
 * of a guard's arguments, when it fires and when it is created.
 */
static RlGuard *
rl_guard_build(FunctionCallInfo fcinfo, Relation rel, const Trigger *trigger,
			   bool statement, bool creating, MemoryContext cxt)
{
	const char *fname = statement ? "rl_guard_statement" : "rl_guard";
	RlGuard    *guard;
	MemoryContext old;
	char	   *list;
	char	   *tok;
	char	   *save;
	int			i;

	if (trigger->tgnargs < 2 || trigger->tgnargs > 3)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s takes a limit, the identity columns and an optional cost column", fname),
				 errhint("For example: EXECUTE FUNCTION %s('free', 'tenant_id').", fname)));

	old = MemoryContextSwitchTo(cxt);
	guard = palloc0(sizeof(RlGuard));
	guard->tgoid = trigger->tgoid;
	guard->limit_arg = pstrdup(trigger->tgargs[0]);
	rl_guard_limit(fcinfo, guard, creating);

	list = pstrdup(trigger->tgargs[1]);
	guard->columns = palloc(sizeof(AttrNumber) * (strlen(list) + 1));
	guard->column_names = palloc(sizeof(char *) * (strlen(list) + 1));
	guard->column_kinds = palloc(sizeof(RlColumnKind) * (strlen(list) + 1));
	guard->column_output = palloc(sizeof(FmgrInfo) * (strlen(list) + 1));
	for (tok = strtok_r(list, ",", &save); tok; tok = strtok_r(NULL, ",", &save))
	{
		Oid			typid;
		Oid			typoutput;
		bool		varlena;
		AttrNumber	attnum;

		while (*tok == ' ')
			tok++;
		for (i = strlen(tok); i > 0 && tok[i - 1] == ' '; i--)
			tok[i - 1] = '\0';
		attnum = rl_guard_column(rel, tok);
		guard->column_names[guard->ncolumns] = tok;
		guard->columns[guard->ncolumns] = attnum;
		typid = TupleDescAttr(RelationGetDescr(rel), attnum - 1)->atttypid;
		guard->column_kinds[guard->ncolumns] = rl_guard_column_kind(typid);
		rl_guard_check_equality(rel, tok, guard->column_kinds[guard->ncolumns],
								typid,
								TupleDescAttr(RelationGetDescr(rel), attnum - 1)->attcollation);
		if (guard->column_kinds[guard->ncolumns] == RL_COLUMN_OUTPUT_FIXED ||
			guard->column_kinds[guard->ncolumns] == RL_COLUMN_FLOAT4 ||
			guard->column_kinds[guard->ncolumns] == RL_COLUMN_FLOAT8)
			guard->fixed_settings = true;
		getTypeOutputInfo(typid, &typoutput, &varlena);
		fmgr_info_cxt(typoutput, &guard->column_output[guard->ncolumns],
					  cxt);
		guard->ncolumns++;
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
	return guard;
}

/*
 * Resolves the trigger's arguments once per statement (cached in fn_extra)
 * and returns them; raises 39P01 for a trigger of the wrong kind.
 */
static RlGuard *
rl_guard_setup(FunctionCallInfo fcinfo, bool statement)
{
	TriggerData *trigdata = (TriggerData *) fcinfo->context;
	RlGuard    *guard = (RlGuard *) fcinfo->flinfo->fn_extra;

	if (!CALLED_AS_TRIGGER(fcinfo))
		ereport(ERROR,
				(errcode(ERRCODE_E_R_I_E_TRIGGER_PROTOCOL_VIOLATED),
				 errmsg("%s must be called as a trigger",
						statement ? "rl_guard_statement" : "rl_guard")));
	if (guard != NULL && guard->tgoid == trigdata->tg_trigger->tgoid)
		return guard;
	rl_guard_check_type(trigdata->tg_trigger, statement,
						ERRCODE_E_R_I_E_TRIGGER_PROTOCOL_VIOLATED);
	guard = rl_guard_build(fcinfo, trigdata->tg_relation, trigdata->tg_trigger,
						   statement, false, fcinfo->flinfo->fn_mcxt);
	fcinfo->flinfo->fn_extra = guard;
	return guard;
}

/*
 * Raises the rate-limit error (PT429) for identity; or, when the denial is
 * rl_redis.on_error's ("deny") and not Redis's, 08006 saying so, so that
 * neither an application nor PostgREST (class 08: HTTP 503) takes an outage
 * for a caller over its quota.
 */
static void
rl_guard_denied(RlGuard *guard, Relation rel, const char *identity,
				const RlDecision *d)
{
	if (!d->from_redis)
		ereport(ERROR,
				(errcode(ERRCODE_CONNECTION_FAILURE),
				 errmsg("rate limit \"%s\" could not be checked for \"%s\"",
						guard->limit_arg, identity),
				 errdetail("Redis could not be reached or failed; rl_redis.on_error is \"deny\"."),
				 errhint("Retry after " INT64_FORMAT " s.",
						 (int64) ceil(d->retry_after_ms / 1000.0)),
				 errtable(rel)));
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

/*
 * Sets DateStyle, TimeZone, IntervalStyle, extra_float_digits and
 * bytea_output to fixed values for the output functions, as postgres_fdw's
 * set_transmission_modes() does, where the session has others. Returns the
 * GUC nest level to hand to AtEOXact_GUC(true, ...) afterwards, or -1 when
 * nothing needed a change.
 */
static int
rl_guard_fixed_settings(void)
{
	bool		datestyle = DateStyle != USE_ISO_DATES;
	bool		timezone = strcmp(pg_get_timezone_name(session_timezone), "UTC") != 0;
	bool		intervalstyle = IntervalStyle != INTSTYLE_POSTGRES;
	bool		floatdigits = extra_float_digits <= 0;
	bool		byteaoutput = bytea_output != BYTEA_OUTPUT_HEX;
	int			nestlevel;

	if (!datestyle && !timezone && !intervalstyle && !floatdigits &&
		!byteaoutput)
		return -1;

	nestlevel = NewGUCNestLevel();
	if (datestyle)
		(void) set_config_option("datestyle", "ISO",
								 PGC_USERSET, PGC_S_SESSION,
								 GUC_ACTION_SAVE, true, 0, false);
	if (timezone)
		(void) set_config_option("timezone", "UTC",
								 PGC_USERSET, PGC_S_SESSION,
								 GUC_ACTION_SAVE, true, 0, false);
	if (intervalstyle)
		(void) set_config_option("intervalstyle", "postgres",
								 PGC_USERSET, PGC_S_SESSION,
								 GUC_ACTION_SAVE, true, 0, false);

	/*
	 * Every extra_float_digits above zero writes the same shortest exact
	 * text, so only a session that asks for rounding needs 1.
	 */
	if (floatdigits)
		(void) set_config_option("extra_float_digits", "1",
								 PGC_USERSET, PGC_S_SESSION,
								 GUC_ACTION_SAVE, true, 0, false);
	if (byteaoutput)
		(void) set_config_option("bytea_output", "hex",
								 PGC_USERSET, PGC_S_SESSION,
								 GUC_ACTION_SAVE, true, 0, false);
	return nestlevel;
}

/*
 * Appends len bytes of value to buf, with a '\' before each '\' and ':'
 * when escape is set.
 */
static void
rl_guard_append(StringInfo buf, const char *value, int len, bool escape)
{
	int			start = 0;
	int			i;

	if (escape)
	{
		for (i = 0; i < len; i++)
		{
			if (value[i] != '\\' && value[i] != ':')
				continue;
			appendBinaryStringInfo(buf, value + start, i - start);
			appendStringInfoChar(buf, '\\');
			start = i;
		}
	}
	appendBinaryStringInfo(buf, value + start, len - start);
}

/*
 * Writes the identity of the row in slot into buf: the text of its one
 * identity column as is, or the texts of several, each with '\' and ':'
 * escaped, joined with ':'. Integers and text are written directly, other
 * types through their output functions, under fixed settings when the
 * guard has a column whose text depends on them. Once the identity is
 * longer than rl_redis.max_identity_bytes, it is cut a few bytes past the
 * bound (at a character's end) and the columns after it are not written
 * (nor their output functions run): rl_decide refuses it, and a statement
 * guard keeps no more of it. A text column's detoasted copy is freed.
 */
static void
rl_guard_identity(RlGuard *guard, Relation rel, TupleTableSlot *slot,
				  StringInfo buf)
{
	bool		escape = guard->ncolumns > 1;
	int			nestlevel = -1;
	int			i;

	resetStringInfo(buf);
	if (guard->fixed_settings)
		nestlevel = rl_guard_fixed_settings();
	for (i = 0; i < guard->ncolumns; i++)
	{
		bool		isnull;
		Datum		value = slot_getattr(slot, guard->columns[i], &isnull);
		char		num[24];

		if (isnull)
			ereport(ERROR,
					(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
					 errmsg("identity column \"%s\" must not be null",
							guard->column_names[i]),
					 errdetail("Rows of \"%s\" are rate-limited by \"%s\" per %s.",
							   RelationGetRelationName(rel), guard->limit_arg,
							   quote_identifier(guard->column_names[i])),
					 errtable(rel)));
		if (i > 0)
			appendStringInfoChar(buf, ':');
		switch (guard->column_kinds[i])
		{
			case RL_COLUMN_INT2:
				appendBinaryStringInfo(buf, num, pg_ltoa(DatumGetInt16(value), num));
				break;
			case RL_COLUMN_INT4:
				appendBinaryStringInfo(buf, num, pg_ltoa(DatumGetInt32(value), num));
				break;
			case RL_COLUMN_INT8:
				appendBinaryStringInfo(buf, num, pg_lltoa(DatumGetInt64(value), num));
				break;
			case RL_COLUMN_TEXT:
				{
					text	   *t = DatumGetTextPP(value);

					rl_guard_append(buf, VARDATA_ANY(t), VARSIZE_ANY_EXHDR(t),
									escape);
					if ((Pointer) t != DatumGetPointer(value))
						pfree(t);	/* detoasted: a statement reads many */
					break;
				}
			case RL_COLUMN_NUMERIC:
				{
					char	   *out = numeric_normalize(DatumGetNumeric(value));

					rl_guard_append(buf, out, strlen(out), escape);
					pfree(out);
					break;
				}
			case RL_COLUMN_MONEY:
				appendBinaryStringInfo(buf, num, pg_lltoa(DatumGetCash(value), num));
				break;
			case RL_COLUMN_INTERVAL:
				{
					Interval   *iv = DatumGetIntervalP(value);
					int64		days = (int64) iv->month * DAYS_PER_MONTH + iv->day;
					int64		usecs = iv->time % USECS_PER_DAY;

					days += iv->time / USECS_PER_DAY;
					if (usecs < 0)
					{
						usecs += USECS_PER_DAY;
						days--;
					}
					appendStringInfo(buf, INT64_FORMAT " days " INT64_FORMAT " us",
									 days, usecs);
					break;
				}
			case RL_COLUMN_FLOAT4:
			case RL_COLUMN_FLOAT8:
				{
					double		f = guard->column_kinds[i] == RL_COLUMN_FLOAT4 ?
						DatumGetFloat4(value) : DatumGetFloat8(value);
					char	   *out;

					if (f == 0)
					{
						appendStringInfoChar(buf, '0');	/* -0 = 0 */
						break;
					}
					out = OutputFunctionCall(&guard->column_output[i], value);
					rl_guard_append(buf, out, strlen(out), escape);
					pfree(out);
					break;
				}
			case RL_COLUMN_OUTPUT:
			case RL_COLUMN_OUTPUT_FIXED:
				{
					char	   *out = OutputFunctionCall(&guard->column_output[i],
														 value);

					rl_guard_append(buf, out, strlen(out), escape);
					pfree(out);
					break;
				}
		}
		if (buf->len > rl_max_identity_bytes)
		{
			/* too long: keep no more than a few bytes past the bound */
			buf->len = pg_mbcliplen(buf->data, buf->len,
									rl_max_identity_bytes + MAX_MULTIBYTE_CHAR_LEN);
			buf->data[buf->len] = '\0';
			break;
		}
	}
	if (nestlevel >= 0)
		AtEOXact_GUC(true, nestlevel);
}

/*
 * Returns the cost of the row in slot: its cost column (not NULL, not
 * negative, fits an integer), or 1 without one.
 */
static int32
rl_guard_cost(RlGuard *guard, Relation rel, TupleTableSlot *slot)
{
	bool		isnull;
	Datum		value;
	int64		cost;

	if (guard->cost_column == InvalidAttrNumber)
		return 1;
	value = slot_getattr(slot, guard->cost_column, &isnull);
	if (isnull)
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("cost column \"%s\" must not be null", guard->cost_name),
				 errtable(rel)));
	cost = guard->cost_type == INT2OID ? DatumGetInt16(value) :
		guard->cost_type == INT4OID ? DatumGetInt32(value) :
		DatumGetInt64(value);
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
 * Row guard: charges the identity of a row written (for an UPDATE, of the
 * new row) one unit (or its cost column) and raises PT429 when the limit
 * denies it. It must fire AFTER the write: a BEFORE trigger also sees the
 * rows that INSERT ... ON CONFLICT skips or turns into an UPDATE.
 */
Datum
rl_guard(PG_FUNCTION_ARGS)
{
	TriggerData *trigdata = (TriggerData *) fcinfo->context;
	RlGuard    *guard;
	Relation	rel;
	TupleTableSlot *slot;
	StringInfoData identity;
	int32		cost;
	RlDecision	d;

	guard = rl_guard_setup(fcinfo, false);
	rel = trigdata->tg_relation;

	slot = TRIGGER_FIRED_BY_UPDATE(trigdata->tg_event) ?
		trigdata->tg_newslot : trigdata->tg_trigslot;

	cost = rl_guard_cost(guard, rel, slot);
	initStringInfo(&identity);
	rl_guard_identity(guard, rel, slot, &identity);
	if (cost > 0)
	{
		RlCharge	charge = {&guard->limit, guard->policy,
			cstring_to_text_with_len(identity.data, identity.len), cost};
		RlRequest	req = {RL_DECIDE_ONE, &charge, 1, NULL, RL_BY_GUARD, rel};

		rl_decide(&req, &d);
		if (!d.allowed)
			rl_guard_denied(guard, rel, identity.data, &d);
	}
	/* the result of an AFTER trigger is ignored */
	return PointerGetDatum(NULL);
}

/* One identity of a statement and the units its rows cost. */
typedef struct RlGroup
{
	uint64		hash;			/* hash key: of the identity's bytes */
	char	   *identity;
	int			len;
	int64		units;
	struct RlGroup *next;		/* another identity with the same hash */
} RlGroup;

PG_FUNCTION_INFO_V1(rl_guard_statement);

/*
 * Statement guard: reads the statement's new rows from its transition
 * table, adds up each identity's units, charges every identity in one
 * script call, all or nothing, and raises PT429 when any is denied.
 */
Datum
rl_guard_statement(PG_FUNCTION_ARGS)
{
	TriggerData *trigdata = (TriggerData *) fcinfo->context;
	RlGuard    *guard = rl_guard_setup(fcinfo, true);
	Relation	rel = trigdata->tg_relation;
	Tuplestorestate *rows = trigdata->tg_newtable;
	TupleTableSlot *slot;
	StringInfoData identity;
	HASHCTL		ctl;
	HTAB	   *groups;
	HASH_SEQ_STATUS seq;
	RlGroup    *group;
	RlGroup   **list;
	RlCharge   *charges;
	int			n = 0;
	int			readptr;
	int			worst;
	RlRequest	req = {RL_DECIDE_ALL, NULL, 0, NULL, RL_BY_GUARD, rel};
	RlDecision	d;

	/* a trigger declared with NEW TABLE on a statement that wrote none */
	if (rows == NULL)
		return PointerGetDatum(NULL);

	ctl.keysize = sizeof(uint64);
	ctl.entrysize = sizeof(RlGroup);
	ctl.hcxt = CurrentMemoryContext;
	groups = hash_create("rl_guard_statement identities", 256, &ctl,
						 HASH_ELEM | HASH_BLOBS | HASH_CONTEXT);

	/* a read pointer of our own, as other readers may share the rows */
	slot = MakeSingleTupleTableSlot(RelationGetDescr(rel), &TTSOpsMinimalTuple);
	readptr = tuplestore_alloc_read_pointer(rows, EXEC_FLAG_REWIND);
	tuplestore_select_read_pointer(rows, readptr);
	tuplestore_rescan(rows);
	initStringInfo(&identity);
	while (tuplestore_gettupleslot(rows, true, false, slot))
	{
		int32		cost = rl_guard_cost(guard, rel, slot);
		uint64		hash;
		bool		found;
		RlGroup    *head;

		rl_guard_identity(guard, rel, slot, &identity);
		hash = hash_bytes_extended((const unsigned char *) identity.data,
								   identity.len, 0);
		head = hash_search(groups, &hash, HASH_ENTER, &found);
		if (!found)
		{
			head->identity = pnstrdup(identity.data, identity.len);
			head->len = identity.len;
			head->units = 0;
			head->next = NULL;
			n++;
		}
		/* identities whose hashes collide hang off the entry */
		for (group = head; group; group = group->next)
			if (group->len == identity.len &&
				memcmp(group->identity, identity.data, identity.len) == 0)
				break;
		if (group == NULL)
		{
			group = palloc(sizeof(RlGroup));
			group->identity = pnstrdup(identity.data, identity.len);
			group->len = identity.len;
			group->units = 0;
			group->next = head->next;
			head->next = group;
			n++;
		}
		group->units += cost;
		if (group->units > PG_INT32_MAX)
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("the rows of \"%s\" cost more than %d units in one statement",
							group->identity, PG_INT32_MAX),
					 errtable(rel)));
	}
	tuplestore_select_read_pointer(rows, 0);
	ExecDropSingleTupleTableSlot(slot);

	/* identities of zero units are not charged */
	list = palloc(sizeof(RlGroup *) * (n > 0 ? n : 1));
	charges = palloc0(sizeof(RlCharge) * (n > 0 ? n : 1));
	n = 0;
	hash_seq_init(&seq, groups);
	while ((group = hash_seq_search(&seq)) != NULL)
	{
		for (; group; group = group->next)
		{
			if (group->units == 0)
				continue;
			list[n] = group;
			charges[n].limit = &guard->limit;
			charges[n].policy = guard->policy;
			charges[n].identity = cstring_to_text_with_len(group->identity,
														   group->len);
			charges[n].cost = (int32) group->units;
			n++;
		}
	}
	if (n == 0)
		return PointerGetDatum(NULL);

	req.charges = charges;
	req.n = n;
	worst = rl_decide(&req, &d);
	if (!d.allowed)
		rl_guard_denied(guard, rel, list[worst]->identity, &d);
	return PointerGetDatum(NULL);
}

/* A guard trigger found in the catalogs. */
typedef struct RlGuardTrigger
{
	Oid			tgoid;
	Oid			relid;
	bool		statement;		/* calls rl_guard_statement */
	NameData	tgname;
} RlGuardTrigger;

/*
 * Returns the guard triggers (those that call this extension's rl_guard or
 * rl_guard_statement) that the current DDL command created, or with
 * created false every guard in the database; *n is their number.
 */
static RlGuardTrigger *
rl_guard_triggers(FunctionCallInfo fcinfo, bool created, int *n)
{
	Oid			argtypes[1] = {OIDOID};
	Datum		args[1];
	RlGuardTrigger *found;
	uint64		i;

	args[0] = ObjectIdGetDatum(get_func_namespace(fcinfo->flinfo->fn_oid));
	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
	if (SPI_execute_with_args(psprintf("SELECT t.oid, t.tgrelid, p.proname OPERATOR(pg_catalog.=) 'rl_guard_statement', t.tgname"
									   "  FROM pg_catalog.pg_trigger t"
									   "  JOIN pg_catalog.pg_proc p ON p.oid OPERATOR(pg_catalog.=) t.tgfoid"
									   " WHERE p.pronamespace OPERATOR(pg_catalog.=) $1"
									   "   AND p.proname OPERATOR(pg_catalog.=) ANY ('{rl_guard,rl_guard_statement}'::pg_catalog.name[])"
									   "%s ORDER BY t.tgrelid, t.tgname",
									   created ?
									   "   AND t.oid OPERATOR(pg_catalog.=) ANY (SELECT c.objid FROM pg_catalog.pg_event_trigger_ddl_commands() c"
									   " WHERE c.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_trigger'::pg_catalog.regclass)" : ""),
							  1, argtypes, args, NULL, false, 0) != SPI_OK_SELECT)
		elog(ERROR, "could not read the guard triggers");
	*n = (int) SPI_processed;
	found = SPI_palloc(sizeof(RlGuardTrigger) * (SPI_processed + 1));
	for (i = 0; i < SPI_processed; i++)
	{
		bool		isnull;
		HeapTuple	tuple = SPI_tuptable->vals[i];
		TupleDesc	tupdesc = SPI_tuptable->tupdesc;

		found[i].tgoid = DatumGetObjectId(SPI_getbinval(tuple, tupdesc, 1, &isnull));
		found[i].relid = DatumGetObjectId(SPI_getbinval(tuple, tupdesc, 2, &isnull));
		found[i].statement = DatumGetBool(SPI_getbinval(tuple, tupdesc, 3, &isnull));
		namestrcpy(&found[i].tgname,
				   NameStr(*DatumGetName(SPI_getbinval(tuple, tupdesc, 4, &isnull))));
	}
	SPI_finish();
	return found;
}

/* Returns rel's trigger tgoid, or NULL when it has none such. */
static const Trigger *
rl_guard_trigger(Relation rel, Oid tgoid)
{
	int			i;

	for (i = 0; rel->trigdesc != NULL && i < rel->trigdesc->numtriggers; i++)
		if (rel->trigdesc->triggers[i].tgoid == tgoid)
			return &rel->trigdesc->triggers[i];
	return NULL;
}

PG_FUNCTION_INFO_V1(rl_guard_created);

/*
 * Event trigger on CREATE TRIGGER (ddl_command_end): checks every guard the
 * command created as it is checked when it fires, and refuses it (42P17
 * for a trigger of the wrong kind, otherwise the argument's own error)
 * rather than let every write to the table fail. Other triggers cost one
 * catalog query. pg_upgrade's restore of the schema is not checked.
 */
Datum
rl_guard_created(PG_FUNCTION_ARGS)
{
	RlGuardTrigger *guards;
	int			n;
	int			i;

	if (!CALLED_AS_EVENT_TRIGGER(fcinfo))
		ereport(ERROR,
				(errcode(ERRCODE_E_R_I_E_TRIGGER_PROTOCOL_VIOLATED),
				 errmsg("rl_guard_created must be called as an event trigger")));
	/* pg_upgrade creates the schema before rl_policy's rows are there */
	if (IsBinaryUpgrade)
		PG_RETURN_VOID();
	guards = rl_guard_triggers(fcinfo, true, &n);
	for (i = 0; i < n; i++)
	{
		Relation	rel = table_open(guards[i].relid, AccessShareLock);
		const Trigger *trigger = rl_guard_trigger(rel, guards[i].tgoid);

		if (trigger != NULL)
		{
			rl_guard_check_type(trigger, guards[i].statement,
								ERRCODE_INVALID_OBJECT_DEFINITION);
			(void) rl_guard_build(fcinfo, rel, trigger, guards[i].statement,
								  true, CurrentMemoryContext);
		}
		table_close(rel, AccessShareLock);
	}
	PG_RETURN_VOID();
}

/*
 * Returns the message of the first problem of guard trigger on rel (its
 * kind when kind is set, else its arguments), or NULL when there is none.
 * The check runs in a subtransaction, so that its error is caught; an
 * error that is not about the guard's definition (classes 22 and 42: a
 * cancel, a failure to read a catalog) is raised again.
 */
static char *
rl_guard_problem(FunctionCallInfo fcinfo, Relation rel,
				 const Trigger *trigger, bool statement, bool kind)
{
	MemoryContext cxt = CurrentMemoryContext;
	ResourceOwner owner = CurrentResourceOwner;
	char	   *volatile problem = NULL;

	BeginInternalSubTransaction(NULL);
	MemoryContextSwitchTo(cxt);
	PG_TRY();
	{
		if (kind)
			rl_guard_check_type(trigger, statement,
								ERRCODE_INVALID_OBJECT_DEFINITION);
		else
			(void) rl_guard_build(fcinfo, rel, trigger, statement, false, cxt);
		ReleaseCurrentSubTransaction();
	}
	PG_CATCH();
	{
		ErrorData  *edata;

		MemoryContextSwitchTo(cxt);
		edata = CopyErrorData();
		FlushErrorState();
		RollbackAndReleaseCurrentSubTransaction();
		if (ERRCODE_TO_CATEGORY(edata->sqlerrcode) != ERRCODE_DATA_EXCEPTION &&
			ERRCODE_TO_CATEGORY(edata->sqlerrcode) != ERRCODE_SYNTAX_ERROR_OR_ACCESS_RULE_VIOLATION)
			ReThrowError(edata);
		problem = edata->message;
	}
	PG_END_TRY();
	MemoryContextSwitchTo(cxt);
	CurrentResourceOwner = owner;
	return problem;
}

PG_FUNCTION_INFO_V1(rl_guard_check);

/* Adds rl_guard_check()'s row (table, trigger, problem) to rsinfo. */
static void
rl_guard_check_row(ReturnSetInfo *rsinfo, const RlGuardTrigger *guard,
				   const char *problem)
{
	Datum		values[3];
	bool		nulls[3] = {false, false, false};

	values[0] = ObjectIdGetDatum(guard->relid);
	values[1] = NameGetDatum(&guard->tgname);
	values[2] = CStringGetTextDatum(problem);
	tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values, nulls);
}

/*
 * rl_guard_check(): one row (table, trigger, problem) per problem of every
 * guard in the database: its kind, then the first problem of its
 * arguments (a policy deleted since, a column dropped, ...). Each table is
 * locked only while its guards are checked, and never waited for: a table
 * another session holds locked (ACCESS EXCLUSIVE) gets the row "not
 * checked", since every role may call this.
 */
Datum
rl_guard_check(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	RlGuardTrigger *guards;
	int			n;
	int			i;

	InitMaterializedSRF(fcinfo, 0);
	guards = rl_guard_triggers(fcinfo, false, &n);
	for (i = 0; i < n; i++)
	{
		Relation	rel;
		const Trigger *trigger;
		int			kind;

		if (!ConditionalLockRelationOid(guards[i].relid, AccessShareLock))
		{
			rl_guard_check_row(rsinfo, &guards[i],
							   "not checked: another session holds a lock on the table");
			continue;
		}
		rel = try_relation_open(guards[i].relid, NoLock);
		if (rel == NULL)
		{
			UnlockRelationOid(guards[i].relid, AccessShareLock);
			continue;			/* dropped since */
		}
		trigger = rl_guard_trigger(rel, guards[i].tgoid);
		for (kind = 1; trigger != NULL && kind >= 0; kind--)
		{
			char	   *problem = rl_guard_problem(fcinfo, rel, trigger,
												   guards[i].statement,
												   kind == 1);

			if (problem != NULL)
				rl_guard_check_row(rsinfo, &guards[i], problem);
		}
		relation_close(rel, AccessShareLock);
	}
	return (Datum) 0;
}
