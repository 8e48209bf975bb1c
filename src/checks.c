/*
 * checks.c
 *	  The one argument checker: every argument of the SQL functions that
 *	  names an identity, a cost, a window or a limit is read or checked
 *	  here, before anything is sent to Redis.
 *
 * rl_decide (engine.c) checks each charge's limit and identity here; the
 * SQL functions read their arguments here (not null, a cost not negative,
 * a window in milliseconds). Nothing here does I/O.
 */
#include "postgres.h"

#include "catalog/pg_type.h"
#include "utils/builtins.h"
#include "utils/lsyscache.h"
#include "utils/rel.h"
#include "utils/timestamp.h"

#include "rl_redis.h"

/* Raises 22004 when argument argno is NULL. */
void
rl_check_not_null(FunctionCallInfo fcinfo, int argno, const char *name)
{
	if (PG_ARGISNULL(argno))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("%s must not be null", name)));
}

/* the longest identity's key, escaped, is far from MaxAllocSize */
StaticAssertDecl(3 * (Size) RL_MAX_IDENTITY_BYTES + 1024 < MaxAllocSize,
				 "rl_redis.max_identity_bytes allows keys too long to be made");

/*
 * Raises 22023 for an empty identity and 54000 for one longer than its
 * bound: every identity, whichever way it came (an argument, an element of
 * a batch, a guarded row), passes here before anything is sent to Redis.
 * The bound is rl_redis.max_identity_bytes where the identity can make
 * state (a decision, a slot, a guard); existing: the identity only names
 * state that exists (a release, a refund, rl_reset), which a bound lowered
 * since it was made must not keep, so the bound is the setting's largest
 * value, past which no state can exist (a refund of a key that does not
 * exist makes none, see the scripts' decide with a negative cost). rel:
 * the guarded table the identity comes from, named in the error, or NULL;
 * a guard stops building its identity once it is too long, so len is then
 * a lower bound.
 */
void
rl_check_identity(size_t len, Relation rel, bool existing)
{
	int			bound = existing ? RL_MAX_IDENTITY_BYTES : rl_max_identity_bytes;

	if (len == 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("identity must not be empty"),
				 rel ? errtable(rel) : 0));
	if (len > (size_t) bound)
		ereport(ERROR,
				(errcode(ERRCODE_PROGRAM_LIMIT_EXCEEDED),
				 errmsg("identity is too long"),
				 rel ?
				 errdetail("The identity is at least %zu bytes long; the limit is %d bytes.",
						   len, bound) :
				 errdetail("The identity is %zu bytes long; the limit is %d bytes.",
						   len, bound),
				 existing ?
				 errhint("No state exists for an identity longer than the largest rl_redis.max_identity_bytes.") :
				 errhint("Use a shorter identity, or raise rl_redis.max_identity_bytes."),
				 rel ? errtable(rel) : 0));
}

/*
 * Returns argument argno as an identity, not null; its bounds are checked
 * where it is used (rl_check_identity).
 */
text *
rl_get_identity(FunctionCallInfo fcinfo, int argno)
{
	rl_check_not_null(fcinfo, argno, "identity");
	return PG_GETARG_TEXT_PP(argno);
}

/* Returns argument argno as a cost (or amount): not null, not negative. */
int32
rl_get_cost(FunctionCallInfo fcinfo, int argno, const char *name)
{
	int32		cost;

	rl_check_not_null(fcinfo, argno, name);
	cost = PG_GETARG_INT32(argno);
	if (cost < 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s must not be negative", name)));
	return cost;
}

/*
 * Whether s is a number alone: white space around, a sign, digits and
 * points. interval_in would read it as seconds; the text form of a window
 * reads it as the bigint form does.
 */
static bool
rl_is_number(const char *s)
{
	const char *p = s;
	const char *end;

	while (isspace((unsigned char) *p))
		p++;
	if (*p == '+' || *p == '-')
		p++;
	end = p + strspn(p, "0123456789.");
	if (end == p)
		return false;
	while (isspace((unsigned char) *end))
		end++;
	return *end == '\0';
}

/*
 * Returns argument argno, a window or a lease, in milliseconds, not null.
 * The explicit-limit functions take it as a bigint (milliseconds), an
 * interval, or a text: a number alone is milliseconds, read as the bigint
 * (and 1.5, where such a literal resolved to the bigint) reads it, so that
 * ' +60000 ' is 60000 ms and '60.5' is refused; any other text is read as
 * an interval ('1 minute'). An interval must be a whole number of
 * milliseconds and hold no months or years, whose length varies (a day is
 * 86 400 000 ms); an infinite one is beyond any range. The range is
 * rl_check_limit's.
 */
int64
rl_get_window_ms(FunctionCallInfo fcinfo, int argno, const char *name)
{
	Oid			type = get_fn_expr_argtype(fcinfo->flinfo, argno);
	Interval   *span;

	rl_check_not_null(fcinfo, argno, name);
	if (!OidIsValid(type))
	{
		/* called without an expression: the function's declared type */
		Oid		   *argtypes;
		int			nargs;

		get_func_signature(fcinfo->flinfo->fn_oid, &argtypes, &nargs);
		type = argno < nargs ? argtypes[argno] : INT8OID;
	}
	if (type == TEXTOID)
	{
		char	   *s = text_to_cstring(PG_GETARG_TEXT_PP(argno));

		if (rl_is_number(s))
			return DatumGetInt64(DirectFunctionCall1(int8in, CStringGetDatum(s)));
		span = DatumGetIntervalP(DirectFunctionCall3(interval_in, CStringGetDatum(s),
													 ObjectIdGetDatum(InvalidOid),
													 Int32GetDatum(-1)));
	}
	else if (type == INTERVALOID)
		span = PG_GETARG_INTERVAL_P(argno);
	else
		return PG_GETARG_INT64(argno);

	if (rl_interval_infinity(span) != 0)
		return rl_interval_infinity(span) > 0 ? PG_INT64_MAX : PG_INT64_MIN;
	if (span->month != 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s must not be given in months or years", name),
				 errdetail("The length of a month or a year varies."),
				 errhint("Give it in days, for example interval '30 days'.")));
	if (span->time % 1000 != 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s must be a whole number of milliseconds", name)));
	return (int64) span->day * 86400000 + span->time / 1000;
}

/*
 * Raises 22023 when a limit's numbers are out of range: lim and window_ms
 * positive, window_ms at most 100 years, a burst (non-zero) only for a
 * bucket and then positive, the whole burst refilled within 100 years (so
 * that every time the scripts compute is exact in a double and every
 * expiry fits), a sliding log no longer than rl_redis.sliding_max_lim. A
 * concurrency limit (no algorithm): lim slots, positive, and a lease
 * (window_ms) positive and at most rl_redis.max_lease.
 */
void
rl_check_limit(const RlLimit *limit)
{
	int32		cap = rl_limit_capacity(limit);

	if (limit->lim <= 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("lim must be greater than zero")));
	if (limit->window_ms <= 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s must be greater than zero",
						limit->algorithm ? "window_ms" : "lease_ms")));
	if (limit->algorithm == NULL)
	{
		if (limit->window_ms > rl_max_lease)
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("lease_ms " INT64_FORMAT " is longer than rl_redis.max_lease (%d ms)",
							limit->window_ms, rl_max_lease),
					 errdetail("A slot whose holder never gives it back stays taken for its whole lease.")));
		return;
	}
	if (limit->window_ms > RL_MAX_WINDOW_MS)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("window_ms must be at most " INT64_FORMAT " (100 years)",
						RL_MAX_WINDOW_MS)));
	if (limit->burst != 0 && !limit->algorithm->bucket)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("algorithm %s takes no burst", limit->algorithm->name),
				 errdetail("A burst is the capacity of a token_bucket or gcra limit.")));
	if (limit->burst < 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("burst must be greater than zero")));
	/* cap * window_ms / lim <= 100 years, without overflow */
	if ((double) cap * (double) limit->window_ms >
		(double) limit->lim * (double) RL_MAX_WINDOW_MS)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("burst %d is too large for a rate of %d per " INT64_FORMAT " ms",
						cap, limit->lim, limit->window_ms),
				 errdetail("Refilling the whole burst must take at most 100 years (burst * window_ms / lim <= " INT64_FORMAT ").",
						   RL_MAX_WINDOW_MS)));
	if (limit->algorithm->log && limit->lim > rl_sliding_max_lim)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("lim of a sliding window log must be at most %d",
						rl_sliding_max_lim),
				 errdetail("The log keeps one entry per unit in the window; rl_redis.sliding_max_lim bounds it."),
				 errhint("Use rl_sliding_counter for larger limits.")));
}
