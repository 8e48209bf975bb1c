/*
 * decision.c
 *	  A script's decision: its reply read into an RlDecision, and the
 *	  decision rl_redis.on_error makes when Redis gives none.
 *
 * Every decision (engine.c) and every concurrency slot (slots.c) reads its
 * reply with the functions here, a batch its decisions one by one
 * (rl_read_decision), so that what a script may answer is checked in one
 * place.
 */
#include "postgres.h"

#include "rl_redis.h"

/* what a fail-closed decision tells the caller to wait */
#define RL_DENY_RETRY_MS 1000

/*
 * Applies rl_redis.on_error to a failed call of cost units under limit:
 * raises the failure, or logs it and fills d with the configured decision
 * (its lim is the limit's capacity, as Redis would have said).
 */
void
rl_apply_on_error(const RlFailure *failure, const RlLimit *limit, int32 cost,
				  RlDecision *d)
{
	int32		lim = rl_limit_capacity(limit);

	if (rl_on_error == RL_ON_ERROR_ERROR)
		rl_raise(failure);

	d->allowed = (rl_on_error == RL_ON_ERROR_ALLOW);
	d->from_redis = false;
	d->from_cache = false;
	d->lim = lim;
	d->reset_ms = 0;
	if (d->allowed)
	{
		d->remaining = Max(lim - Max(cost, 0), 0);
		d->retry_after_ms = 0;
	}
	else
	{
		d->remaining = 0;
		d->retry_after_ms = RL_DENY_RETRY_MS;
	}
	/* one warning per outage, not one per call */
	if (failure->first_in_outage)
	{
		char	   *outcome = psprintf("Requests are %s without a decision from Redis because rl_redis.on_error is \"%s\".",
									   d->allowed ? "allowed" : "denied",
									   d->allowed ? "allow" : "deny");

		rl_report(WARNING, failure, outcome);
		pfree(outcome);
	}
	rl_shadow_allow(limit, d);
}

/*
 * Applies the mode of d's limit: when it is a shadow policy's and d denies,
 * d becomes allowed with shadow_denied set, its numbers (remaining,
 * reset_ms, retry_after_ms) those enforcing gives; nothing was taken, as a
 * denial writes nothing. Every decision of one limit passes here (its
 * reply, its on_error decision); several limits' are decided in
 * run_all.lua, which knows which are shadow.
 */
void
rl_shadow_allow(const RlLimit *limit, RlDecision *d)
{
	d->shadow_denied = limit->shadow && !d->allowed;
	if (d->shadow_denied)
		d->allowed = true;
}

/*
 * Frees a reply that is not what the scripts return and fills in its
 * failure; returns false, for the parser to return.
 */
bool
rl_unexpected_reply(RlConn *conn, redisReply *reply, RlFailure *failure)
{
	freeReplyObject(reply);
	rl_fail(failure, RL_FAILURE_PROTOCOL, ERRCODE_PROTOCOL_VIOLATION,
			RL_HINT_NONE, NULL,
			"unexpected reply from the rate-limit script at Redis %s",
			rl_conn_name(conn));
	return false;
}

/* the bytes of one decision as lua/common.lua:packed writes it */
#define RL_PACKED_DECISION (7 * 8)

/*
 * The longest wait a script can answer, in ms: two of the longest times a
 * script computes (2^53 µs, lua/common.lua: MAX_US), each rounded up to a
 * ms, a window and a state stamped that far ahead of the clock; far from
 * overflowing when added to a clock.
 */
#define RL_MAX_WAIT_MS (2 * (INT64CONST(9007199254740992) / 1000 + 1))

/*
 * Fills d with the seven numbers v of a decision of limit (allowed, lim,
 * remaining, reset_ms, retry_after_ms, the clock it was decided on and the
 * key's epoch); false, with d untouched, when they are not what a script
 * of that limit answers: lim is its capacity (rl_limit_capacity),
 * remaining within it, the waits within RL_MAX_WAIT_MS (retry_after_ms -1:
 * never), the clock and epoch not negative. Every decision's numbers pass
 * here.
 */
static bool
rl_decision_numbers(const int64 *v, const RlLimit *limit, RlDecision *d)
{
	if ((v[0] != 0 && v[0] != 1) ||
		v[1] != rl_limit_capacity(limit) ||
		v[2] < 0 || v[2] > v[1] ||
		v[3] < 0 || v[3] > RL_MAX_WAIT_MS ||
		v[4] < -1 || v[4] > RL_MAX_WAIT_MS ||
		v[5] < 0 || v[6] < 0)
		return false;
	d->allowed = v[0] == 1;
	d->from_redis = true;
	d->from_cache = false;
	d->lim = (int32) v[1];
	d->remaining = (int32) v[2];
	d->reset_ms = v[3];
	d->retry_after_ms = v[4];
	d->stamp_us = v[5];
	d->epoch = v[6];
	return true;
}

/*
 * Reads into d the decision of limit packed in e (lua/common.lua:packed:
 * the seven numbers of rl_decision_numbers, little-endian signed 8-byte
 * integers); false, with d untouched, when e is not such a string or its
 * numbers are not a decision of limit. The decision of one key
 * (run_one.lua, concurrency.lua) and each of a batch's (run_many.lua) are
 * read here.
 */
bool
rl_read_decision(const redisReply *e, const RlLimit *limit, RlDecision *d)
{
	int64		v[7];
	int			i,
				b;

	if (e->type != REDIS_REPLY_STRING || e->len != RL_PACKED_DECISION)
		return false;
	for (i = 0; i < 7; i++)
	{
		uint64		u = 0;

		for (b = 7; b >= 0; b--)
			u = (u << 8) | (unsigned char) e->str[i * 8 + b];
		v[i] = (int64) u;
	}
	return rl_decision_numbers(v, limit, d);
}

/*
 * Turns a script's reply into d and frees it; false, with failure filled in,
 * when the reply is an error or not what the scripts return: the decision
 * of limit, packed (rl_read_decision; rl_shadow_allow applies the limit's
 * mode), or, with charges (a several-limits call of n charges, integers;
 * limit NULL), the most restrictive decision, its index (stored in *index,
 * 0-based), and the clock, epoch and own verdict of every charge (stored
 * in charges[i]: shadow_denied when its shadow policy would deny).
 */
bool
rl_parse_decision(RlConn *conn, redisReply *reply, const RlLimit *limit,
				  RlDecision *d, RlCharge *charges, int n, int *index,
				  RlFailure *failure)
{
	size_t		expected = 6 + 3 * n;
	size_t		i;
	int64		v[7];
	int			k;

	if (reply->type == REDIS_REPLY_ERROR)
	{
		rl_error_reply(conn, reply, failure);
		return false;
	}
	if (charges == NULL)
	{
		if (!rl_read_decision(reply, limit, d))
			goto bad;
		rl_shadow_allow(limit, d);
		freeReplyObject(reply);
		return true;
	}
	if (reply->type != REDIS_REPLY_ARRAY || reply->elements != expected)
		goto bad;
	for (i = 0; i < expected; i++)
		if (reply->element[i]->type != REDIS_REPLY_INTEGER)
			goto bad;
	if (reply->element[5]->integer < 1 || reply->element[5]->integer > n)
		goto bad;
	for (i = 0; i < (size_t) n; i++)
		if (reply->element[6 + i]->integer < 0 ||
			reply->element[6 + n + i]->integer < 0 ||
			(reply->element[6 + 2 * n + i]->integer != 0 &&
			 reply->element[6 + 2 * n + i]->integer != 1))
			goto bad;
	/* the numbers are those of the deciding limit k */
	k = (int) reply->element[5]->integer - 1;
	for (i = 0; i < 5; i++)
		v[i] = reply->element[i]->integer;
	v[5] = reply->element[6 + k]->integer;
	v[6] = reply->element[6 + n + k]->integer;
	if (!rl_decision_numbers(v, charges[k].limit, d))
		goto bad;
	*index = k;
	for (i = 0; i < (size_t) n; i++)
	{
		charges[i].stamp_us = reply->element[6 + i]->integer;
		charges[i].epoch = reply->element[6 + n + i]->integer;
		charges[i].shadow_denied = charges[i].limit->shadow &&
			reply->element[6 + 2 * n + i]->integer == 0;
	}
	d->stamp_us = charges[*index].stamp_us;
	d->epoch = charges[*index].epoch;
	d->shadow_denied = d->allowed && charges[*index].shadow_denied;
	freeReplyObject(reply);
	return true;

bad:
	return rl_unexpected_reply(conn, reply, failure);
}
