/*
 * failure.c
 *	  What a failed Redis call reports, filled in and reported in one place.
 *
 * Whoever finds a failure (a connection, the router, TLS, the worker, the
 * engine) fills in an RlFailure with rl_fail: its kind, SQLSTATE, primary
 * message, what Redis or the system said (the DETAIL) and the advice for
 * the HINT. rl_report raises or logs it the way postgres_fdw reports a
 * remote error, with the CONTEXT of the call that an entry point set with
 * rl_context_push. Nothing here does I/O.
 */
#include "postgres.h"

#include "mb/pg_wchar.h"

#include "rl_redis.h"

/* the most bytes of a key the CONTEXT of a report shows */
#define RL_CONTEXT_KEY_BYTES 100

/*
 * Fills in failure: its kind, SQLSTATE (0: nothing was tried, message says
 * why), the advice for its HINT, detail (what Redis, the system or OpenSSL
 * said; NULL for none) and the primary message, from fmt. Does no I/O and
 * never raises.
 */
void
rl_fail(RlFailure *failure, RlFailureKind kind, int sqlerrcode, RlHint hint,
		const char *detail, const char *fmt,...)
{
	va_list		ap;

	va_start(ap, fmt);
	rl_vfail(failure, kind, sqlerrcode, hint, detail, fmt, ap);
	va_end(ap);
}

/* rl_fail with a va_list. */
void
rl_vfail(RlFailure *failure, RlFailureKind kind, int sqlerrcode, RlHint hint,
		 const char *detail, const char *fmt, va_list ap)
{
	failure->kind = kind;
	failure->sqlerrcode = sqlerrcode;
	failure->first_in_outage = true;
	failure->breaker_opened = false;
	failure->held_back = false;
	failure->hint = hint;
	vsnprintf(failure->message, sizeof(failure->message), fmt, ap);
	strlcpy(failure->detail, detail != NULL ? detail : "",
			sizeof(failure->detail));
}

/*
 * Gives failure the SQLSTATE sqlerrcode, keeping what it says: a failed
 * step that its caller reports as its own kind of failure (a set-up
 * command's is a connection that could not be established). Does no I/O
 * and never raises.
 */
void
rl_fail_as(RlFailure *failure, int sqlerrcode)
{
	failure->sqlerrcode = sqlerrcode;
}

/*
 * Appends the text s to buf valid in the server encoding: what Redis,
 * OpenSSL or a lying server said is bytes, so a byte that begins no valid
 * character is shown as \xNN, and a character cut short at the end (a text
 * truncated to its buffer) is left out.
 */
static void
rl_append_valid(StringInfo buf, const char *s)
{
	int			encoding = GetDatabaseEncoding();
	int			left = (int) strlen(s);

	while (left > 0)
	{
		int			len = pg_encoding_mblen(encoding, s);

		if (len > left)
			break;
		if (pg_encoding_verifymbchar(encoding, s, len) != len)
		{
			appendStringInfo(buf, "\\x%02x", (unsigned char) *s);
			len = 1;
		}
		else
			appendBinaryStringInfo(buf, s, len);
		s += len;
		left -= len;
	}
}

/*
 * Writes failure's message and detail on one line into buf (size bytes),
 * valid in the server encoding, for rl_redis_connections and for reports
 * that have a detail of their own; returns buf.
 */
const char *
rl_failure_text(const RlFailure *failure, char *buf, size_t size)
{
	StringInfoData text;

	initStringInfo(&text);
	rl_append_valid(&text, failure->message);
	if (failure->detail[0] != '\0')
	{
		appendStringInfoString(&text, ": ");
		rl_append_valid(&text, failure->detail);
	}
	strlcpy(buf, text.data, pg_mbcliplen(text.data, text.len, size - 1) + 1);
	pfree(text.data);
	return buf;
}

/* errhint() with the advice of a failure, or 0 when it has none. */
int
rl_failure_hint(const RlFailure *failure)
{
	switch (failure->hint)
	{
		case RL_HINT_PRELOAD:
			return errhint("Add rl_redis to shared_preload_libraries.");
		case RL_HINT_PRELOAD_OR_FILE:
			return errhint("Add rl_redis to shared_preload_libraries, or use rl_redis.password_file (without preloading, every role can read its path, not the password).");
		case RL_HINT_SERVER:
			return errhint("Check rl_redis.host and rl_redis.port (rl_redis.nodes in cluster and sentinel mode); while Redis cannot be reached, rl_redis.on_error decides.");
		case RL_HINT_PASSWORD:
			return errhint("Set rl_redis.password or rl_redis.password_file to the password Redis expects.");
		case RL_HINT_SENTINEL_PASSWORD:
			return errhint("Set rl_redis.sentinel_password to the password the sentinels expect.");
		case RL_HINT_CONNECT_TIMEOUT:
			return errhint("Check that Redis is reachable, or raise rl_redis.connect_timeout.");
		case RL_HINT_COMMAND_TIMEOUT:
			return errhint("Check that Redis is not overloaded or stopped, or raise rl_redis.command_timeout.");
		case RL_HINT_LIBRARY:
			return errhint("rl_redis could not load its library of Redis functions: allow the Redis user of rl_redis.username FUNCTION LOAD and FCALL, and do not rename or disable the FUNCTION command.");
		default:
			return 0;
	}
}

/*
 * Reports failure at elevel (ERROR raises): its SQLSTATE, message, hint,
 * and as detail what Redis or the system said, that the breaker held the
 * call back, and outcome (a sentence, or NULL); message and detail valid
 * in the server encoding (rl_append_valid). The CONTEXT is the call's
 * (rl_context_push).
 */
void
rl_report(int elevel, const RlFailure *failure, const char *outcome)
{
	StringInfoData message;
	StringInfoData detail;

	initStringInfo(&message);
	rl_append_valid(&message, failure->message);
	initStringInfo(&detail);
	rl_append_valid(&detail, failure->detail);
	if (failure->held_back)
		appendStringInfo(&detail, "%sRedis is not retried for rl_redis.retry_interval after a failure.",
						 detail.len > 0 ? "\n" : "");
	if (outcome != NULL)
		appendStringInfo(&detail, "%s%s", detail.len > 0 ? "\n" : "", outcome);
	ereport(elevel,
			(errcode(failure->sqlerrcode),
			 errmsg_internal("%s", message.data),
			 detail.len > 0 ? errdetail_internal("%s", detail.data) : 0,
			 rl_failure_hint(failure)));
	pfree(message.data);
	pfree(detail.data);
}

/* Raises a failure as an error. */
void
rl_raise(const RlFailure *failure)
{
	rl_report(ERROR, failure, NULL);
}

/* Adds the CONTEXT of a Redis call (arg: its RlCallContext) to a report. */
static void
rl_context_callback(void *arg)
{
	RlCallContext *ctx = (RlCallContext *) arg;
	int			shown = pg_mbcliplen(ctx->key, (int) ctx->keylen,
									 RL_CONTEXT_KEY_BYTES);
	const char *more = (size_t) shown < ctx->keylen ? "..." : "";

	if (ctx->others > 0)
		errcontext("rl_redis %s on %d keys, the first \"%.*s%s\"",
				   ctx->what, ctx->others + 1, shown, ctx->key, more);
	else if (ctx->name != NULL)
		errcontext("rl_redis %s \"%s\" on key \"%.*s%s\"",
				   ctx->what, ctx->name, shown, ctx->key, more);
	else
		errcontext("rl_redis %s on key \"%.*s%s\"",
				   ctx->what, shown, ctx->key, more);
}

/*
 * Makes ctx the CONTEXT of the errors and warnings reported until
 * rl_context_pop: a call (what: "decision", "refund" ...) of the algorithm
 * name (or NULL) on key and others more keys.
 */
void
rl_context_push(RlCallContext *ctx, const char *what, const char *name,
				const char *key, size_t keylen, int others)
{
	ctx->what = what;
	ctx->name = name;
	ctx->key = key;
	ctx->keylen = keylen;
	ctx->others = others;
	ctx->callback.callback = rl_context_callback;
	ctx->callback.arg = ctx;
	ctx->callback.previous = error_context_stack;
	error_context_stack = &ctx->callback;
}

/* Ends what rl_context_push began. */
void
rl_context_pop(RlCallContext *ctx)
{
	error_context_stack = ctx->callback.previous;
}
