/*
 * denials.c
 *	  Who is being throttled: with rl_redis.track_denials, every denial of a
 *	  policy is counted per identity in Redis, in one sorted set per policy
 *	  and minute (<prefix>denials:{<policy>}:<minute>, built by
 *	  rl_append_denials_key in keys.c; kept a day, at most 10 000
 *	  identities each), so that every server sharing that Redis adds to the
 *	  same counts; rl_top_denied (functions.c) reads them back.
 *
 * The count is written only when a call is denied: one more Redis call on
 * that path, none on the others. A failure to count is not an error of the
 * decision: it is logged once per outage and the decision stands. The
 * minute is this server's (or the test clock's); an identity longer than
 * RL_DENIAL_IDENTITY bytes is counted as its beginning and a hash of it.
 */
#include "postgres.h"

#include "common/hashfn.h"
#include "mb/pg_wchar.h"
#include "utils/builtins.h"
#include "utils/timestamp.h"

#include "rl_redis.h"

/* the longest identity counted as it is */
#define RL_DENIAL_IDENTITY 128

/* the most identities one script call counts (about 1 ms of Redis) */
#define RL_DENIAL_CALL 500

/* whether the last failure to count a denial was logged */
static bool note_failed = false;

/* The current minute since the epoch: of the test clock, or of this server. */
static int64
rl_denial_minute(void)
{
	if (rl_test_clock_ms > 0)
		return (int64) (rl_test_clock_ms / 60000.0);
	return (GetCurrentTimestamp() +
			(int64) (POSTGRES_EPOCH_JDATE - UNIX_EPOCH_JDATE) * USECS_PER_DAY) /
		(60 * USECS_PER_SEC);
}

/* A member of a denial count: its bytes in a shared buffer. */
typedef struct RlDenialMember
{
	int			off;
	int			len;
} RlDenialMember;

/* the buffer RlDenialMember offsets point into, for the qsort comparator */
static const char *members_data;

/* qsort order of RlDenialMember: by bytes, then length */
static int
rl_member_cmp(const void *a, const void *b)
{
	const RlDenialMember *x = (const RlDenialMember *) a;
	const RlDenialMember *y = (const RlDenialMember *) b;
	int			c = memcmp(members_data + x->off, members_data + y->off,
						   Min(x->len, y->len));

	return c != 0 ? c : (x->len > y->len) - (x->len < y->len);
}

/*
 * Counts a denial of each of n identities under policy
 * (rl_redis.track_denials): the same identity given several times is
 * counted as many, in one increment; at most RL_DENIAL_CALL identities go
 * in one script call, so that none holds Redis long. Never raises for
 * Redis's sake (an interrupt still ends the wait).
 */
void
rl_note_denials(const char *policy, text **identities, int n)
{
	StringInfoData key;
	StringInfoData members;
	RlDenialMember *m = palloc(sizeof(RlDenialMember) * Max(n, 1));
	int		   *counts = palloc(sizeof(int) * Max(n, 1));
	int			nm = 0;
	int64		minute = rl_denial_minute();
	char		minute_s[24],
				now_s[24];
	char	   *count_s = palloc(16 * Max(Min(n, RL_DENIAL_CALL), 1));
	int			argmax = RL_SCRIPT_ARGV_RESERVED + 4 + 2 * Min(n, RL_DENIAL_CALL);
	const char **argv = palloc(sizeof(char *) * argmax);
	size_t	   *argvlen = palloc(sizeof(size_t) * argmax);
	int			i;
	int			from;

	initStringInfo(&key);
	rl_append_denials_key(&key, policy, minute);
	/* the members, one after another in one buffer */
	initStringInfo(&members);
	for (i = 0; i < n; i++)
	{
		const char *id = VARDATA_ANY(identities[i]);
		int			len = VARSIZE_ANY_EXHDR(identities[i]);

		m[i].off = members.len;
		if (len <= RL_DENIAL_IDENTITY)
			appendBinaryStringInfo(&members, id, len);
		else
		{
			/* its beginning, cut at a character, and a hash of the whole */
			appendBinaryStringInfo(&members, id, pg_mbcliplen(id, len, 100));
			appendStringInfo(&members, "...#%016llx",
							 (unsigned long long) hash_bytes_extended((const unsigned char *) id,
																	  len, 0));
		}
		m[i].len = members.len - m[i].off;
	}
	/* each identity once, with its count */
	members_data = members.data;
	qsort(m, n, sizeof(RlDenialMember), rl_member_cmp);
	for (i = 0; i < n; i++)
	{
		if (nm > 0 && rl_member_cmp(&m[nm - 1], &m[i]) == 0)
			counts[nm - 1]++;
		else
		{
			m[nm] = m[i];
			counts[nm++] = 1;
		}
	}

	for (from = 0; from < nm; from += RL_DENIAL_CALL)
	{
		int			k = Min(nm - from, RL_DENIAL_CALL);
		int			argc = RL_SCRIPT_ARGV_RESERVED + 4 + 2 * k;
		RlConn	   *conn;
		RlFailure	failure = {0};
		char		text[sizeof(failure.message) + sizeof(failure.detail)];
		redisReply *reply;

		argv[2] = "1";
		argvlen[2] = 1;
		argv[3] = key.data;
		argvlen[3] = key.len;
		argv[4] = minute_s;
		argvlen[4] = pg_lltoa(minute, minute_s);
		argv[5] = now_s;
		argvlen[5] = rl_clock_arg(now_s);
		for (i = 0; i < k; i++)
		{
			argv[6 + 2 * i] = members.data + m[from + i].off;
			argvlen[6 + 2 * i] = m[from + i].len;
			argv[7 + 2 * i] = count_s + 16 * i;
			argvlen[7 + 2 * i] = pg_ltoa(counts[from + i], count_s + 16 * i);
		}
		reply = rl_call(key.data, key.len, &rl_script_denial_note, argc, argv,
						argvlen, &conn, &failure);
		if (reply != NULL && reply->type == REDIS_REPLY_ERROR)
		{
			rl_error_reply(conn, reply, &failure);
			reply = NULL;
		}
		if (reply == NULL)
		{
			if (!note_failed)
				ereport(WARNING,
						(errcode(failure.sqlerrcode),
						 errmsg("could not count a denial of policy \"%s\" for rl_top_denied", policy),
						 errdetail_internal("%s", rl_failure_text(&failure, text, sizeof(text)))));
			note_failed = true;
			break;
		}
		note_failed = false;
		freeReplyObject(reply);
	}
	pfree(key.data);
	pfree(members.data);
	pfree(m);
	pfree(counts);
	pfree(count_s);
	pfree(argv);
	pfree(argvlen);
}

/* Counts a denial of identity under policy: rl_note_denials for one. */
void
rl_note_denial(const char *policy, text *identity)
{
	rl_note_denials(policy, &identity, 1);
}

/*
 * Asks Redis for the n identities most denied under policy in the last
 * minutes (the current one included): returns the reply (identity, count,
 * identity, count ...; the caller frees it) with *connp the connection that
 * answered, or NULL with failure filled in.
 */
redisReply *
rl_denials_top(const char *policy, int minutes, int32 n, RlConn **connp,
			   RlFailure *failure)
{
	int64		minute = rl_denial_minute();
	int			nkeys = minutes + 1;
	int			argc = RL_SCRIPT_ARGV_RESERVED + 1 + nkeys + 1;
	const char **argv = palloc(sizeof(char *) * argc);
	size_t	   *argvlen = palloc(sizeof(size_t) * argc);
	StringInfoData keys;
	int		   *ends = palloc(sizeof(int) * nkeys);
	char		nkeys_s[16],
				n_s[16];
	redisReply *reply;
	int			i;

	/* the keys, one after another in one buffer */
	initStringInfo(&keys);
	for (i = 0; i < minutes; i++)
	{
		rl_append_denials_key(&keys, policy, minute - minutes + 1 + i);
		ends[i] = keys.len;
	}
	rl_append_denials_key(&keys, policy, RL_DENIALS_TOP);
	ends[minutes] = keys.len;

	argv[2] = nkeys_s;
	argvlen[2] = pg_ltoa(nkeys, nkeys_s);
	for (i = 0; i < nkeys; i++)
	{
		int			from = i == 0 ? 0 : ends[i - 1];

		argv[3 + i] = keys.data + from;
		argvlen[3 + i] = ends[i] - from;
	}
	argv[3 + nkeys] = n_s;
	argvlen[3 + nkeys] = pg_ltoa(n, n_s);
	reply = rl_call(argv[3], argvlen[3], &rl_script_denial_top, argc, argv,
					argvlen, connp, failure);
	pfree(argv);
	pfree(argvlen);
	pfree(ends);
	pfree(keys.data);
	return reply;
}
