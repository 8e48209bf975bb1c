/*
 * keys.c
 *	  The one format of rl_redis's keys in Redis: built, parsed and matched
 *	  here alone (the decisions, rl_reset, the statistics and the denial
 *	  counts all go through these functions).
 */
#include "postgres.h"

#include "utils/builtins.h"
#include "utils/memutils.h"

#include "rl_redis.h"

/* reused for every key, so that a call allocates nothing */
static StringInfoData keybuf;

/*
 * The one format of rl_redis's keys, built, parsed and matched here alone:
 *
 *   <key_prefix><kind>:{<identity>}:<lim>/<window_ms>[/<burst>]
 *   <key_prefix><kind>:{<identity>}:<policy>:<lim>/<window_ms>[/<burst>]
 *   <key_prefix><kind>:{<identity>}:<policy>:/<window_ms>
 *   <key_prefix>concurrency:{<identity>}:<policy>
 *
 * the first for explicit arguments, the others for a policy. kind is the
 * algorithm's key kind (algorithms.h: its name, with the layout of its
 * state when that changed, as in "fixed.2"), or "concurrency" (window_ms is
 * then the lease; no burst).
 *
 * A key carries the numbers its state means something under, so that no
 * two limits whose states mean different things count on one key: a
 * bucket's level (token_bucket, gcra) depends on the rate and the capacity,
 * the second form; a count over a window (fixed, sliding, sliding_counter)
 * depends on window_ms alone, lim being only the threshold each call
 * compares it with, the third form, where lim is left out; slots (a set of
 * absolute lease ends, compared with lim by their number) depend on none,
 * the fourth. So a policy's count or slots are kept when its lim (or lease)
 * changes, and are shared with another database's policy of the same name
 * (and window) whatever its lim, each call admitted only under its own: no
 * change of numbers lets more than lim through. Explicit arguments keep
 * their numbers: two explicit limits are two counters. The burst is written
 * only when it differs from lim: no burst and a burst of lim are one
 * capacity, so one key.
 *
 * The braces make every key of one identity hash to the same Redis Cluster
 * hash slot; inside them '%', '{' and '}' are percent-encoded, so that the
 * hash tag is never empty and never ends early, and two identities never
 * share a key. A policy name holds no '/' (rl_policy's CHECK), so a suffix with a
 * '/' ends in numbers, after its last ':', and one without is a
 * concurrency policy's name. Keys of earlier releases, which rl_reset still
 * deletes: <key_prefix><kind>:{<identity>}:<policy> (rate policies, 1.1 to
 * 1.5 as first released), <key_prefix><kind>:{<identity>} (1.2), and any
 * of these with the algorithm's name where its kind is now another (1.5 and
 * before: the state's earlier layout). The
 * denial counts are keyed by policy instead (rl_append_denials_key).
 */

/* Appends <key_prefix><kind>:{<encoded identity>} to buf. */
static void
rl_append_key_head(StringInfo buf, const char *kind, text *identity)
{
	const char *p = VARDATA_ANY(identity);
	const char *end = p + VARSIZE_ANY_EXHDR(identity);
	const char *run = p;

	appendStringInfoString(buf, rl_key_prefix);
	appendStringInfoString(buf, kind);
	appendBinaryStringInfo(buf, ":{", 2);
	for (; p < end; p++)
	{
		if (*p != '%' && *p != '{' && *p != '}')
			continue;
		appendBinaryStringInfo(buf, run, p - run);
		appendStringInfoString(buf, *p == '%' ? "%25" : *p == '{' ? "%7B" : "%7D");
		run = p + 1;
	}
	appendBinaryStringInfo(buf, run, end - run);
	appendStringInfoChar(buf, '}');
}

/*
 * Builds the key of limit (a concurrency limit when limit->algorithm is
 * NULL) for identity, of policy when not NULL, in a buffer that the next
 * call reuses.
 */
StringInfo
rl_build_key(text *identity, const char *policy, const RlLimit *limit)
{
	if (keybuf.data == NULL)
	{
		MemoryContext old = MemoryContextSwitchTo(TopMemoryContext);

		initStringInfo(&keybuf);
		MemoryContextSwitchTo(old);
	}
	else if (keybuf.maxlen > RL_KEEP_BUFFER)
	{
		/* a huge identity does not keep its buffer for the backend's life */
		pfree(keybuf.data);
		keybuf.data = MemoryContextAlloc(TopMemoryContext, 1024);
		keybuf.maxlen = 1024;
	}
	resetStringInfo(&keybuf);
	rl_append_key_head(&keybuf, limit->algorithm ? limit->algorithm->key_kind :
					   "concurrency", identity);
	appendStringInfoChar(&keybuf, ':');
	if (policy != NULL)
	{
		appendStringInfoString(&keybuf, policy);
		if (limit->algorithm == NULL)
			return &keybuf;		/* slots mean the same under any numbers */
		appendStringInfoChar(&keybuf, ':');
	}
	if (policy == NULL || limit->algorithm->bucket)
		appendStringInfo(&keybuf, "%d", limit->lim);
	appendStringInfo(&keybuf, "/" INT64_FORMAT, limit->window_ms);
	if (limit->burst > 0 && limit->burst != limit->lim)
		appendStringInfo(&keybuf, "/%d", limit->burst);
	return &keybuf;
}

/*
 * Appends to buf the key of policy's denial counts (rl_redis.track_denials)
 * of minute, <key_prefix>denials:{<policy>}:<minute>, or, for minute
 * RL_DENIALS_TOP, the scratch key that merges them,
 * <key_prefix>denials:{<policy>}:top. The braces hash every key of one
 * policy to one Redis Cluster hash slot; a policy name holds none.
 */
void
rl_append_denials_key(StringInfo buf, const char *policy, int64 minute)
{
	appendStringInfo(buf, "%sdenials:{%s}:", rl_key_prefix, policy);
	if (minute == RL_DENIALS_TOP)
		appendStringInfoString(buf, "top");
	else
		appendStringInfo(buf, INT64_FORMAT, minute);
}

/*
 * Fills parts from key, one of rl_redis's keys under rl_redis.key_prefix,
 * of this version or an earlier one; false when key is not one (another
 * application's, or under a longer prefix). parts->policy is NULL for
 * explicit arguments; a suffix without numbers (a concurrency policy's key,
 * or a rate policy's of an earlier version) is the policy's whole name.
 */
bool
rl_parse_key(const char *key, size_t len, RlKeyParts *parts)
{
	size_t		prefix_len = strlen(rl_key_prefix);
	const char *p;
	const char *end = key + len;
	const char *close;
	const char *last_colon = NULL;
	bool		numbers = false;
	int			i;

	if (len < prefix_len || memcmp(key, rl_key_prefix, prefix_len) != 0)
		return false;
	p = key + prefix_len;
	parts->kind = NULL;
	for (i = -1; i < 2 * RL_NUM_ALGORITHMS && parts->kind == NULL; i++)
	{
		/* the algorithms' kinds, then their names (earlier layouts) */
		const RlAlgorithm *alg = i < 0 ? NULL : &rl_algorithms[i % RL_NUM_ALGORITHMS];
		const char *kind = alg == NULL ? "concurrency" :
			i < RL_NUM_ALGORITHMS ? alg->key_kind : alg->name;
		size_t		kindlen = strlen(kind);

		if ((size_t) (end - p) > kindlen + 1 && memcmp(p, kind, kindlen) == 0 &&
			p[kindlen] == ':' && p[kindlen + 1] == '{')
		{
			parts->kind = alg == NULL ? kind : alg->name;
			p += kindlen + 1;
		}
	}
	if (parts->kind == NULL)
		return false;
	close = memchr(p, '}', end - p);
	if (close == NULL)
		return false;
	parts->tag = p;
	parts->taglen = close + 1 - p;
	parts->policy = NULL;
	parts->policylen = 0;
	if (close + 1 == end)
		return true;			/* 1.2 */
	if (close[1] != ':')
		return false;
	for (p = close + 2; p < end; p++)
	{
		if (*p == ':')
			last_colon = p;
		else if (*p == '/')
			numbers = true;
	}
	if (!numbers)
	{
		parts->policy = close + 2;	/* a policy's key without numbers */
		parts->policylen = end - parts->policy;
	}
	else if (last_colon != NULL)
	{
		parts->policy = close + 2;
		parts->policylen = last_colon - parts->policy;
	}
	return true;
}

/* Appends len bytes of s to the SCAN pattern buf, glob characters escaped. */
static void
rl_append_glob(StringInfo buf, const char *s, size_t len)
{
	size_t		i;

	for (i = 0; i < len; i++)
	{
		if (strchr("*?[]\\", s[i]) != NULL)
			appendStringInfoChar(buf, '\\');
		appendStringInfoChar(buf, s[i]);
	}
}

/*
 * Fills pattern with the SCAN pattern of every key of identity
 * (<key_prefix>*:{<identity>}*, its own glob characters escaped; it also
 * matches other applications' keys and longer prefixes) and tag with the
 * identity's braces part, "{<encoded identity>}", for rl_key_of.
 */
void
rl_identity_keys(text *identity, StringInfo pattern, StringInfo tag)
{
	StringInfoData head;
	int			prefix_len = strlen(rl_key_prefix);

	initStringInfo(&head);
	rl_append_key_head(&head, "", identity);
	rl_append_glob(pattern, head.data, prefix_len);
	appendStringInfoChar(pattern, '*');
	rl_append_glob(pattern, head.data + prefix_len, head.len - prefix_len);
	appendStringInfoChar(pattern, '*');
	appendBinaryStringInfo(tag, head.data + prefix_len + 1,
						   head.len - prefix_len - 1);
	pfree(head.data);
}

/*
 * True when key is one of rl_redis's keys (rl_parse_key), of any version,
 * of the identity whose braces part is tag (rl_identity_keys).
 */
bool
rl_key_of(const char *key, size_t len, StringInfo tag)
{
	RlKeyParts	parts;

	return rl_parse_key(key, len, &parts) && parts.taglen == (size_t) tag->len &&
		memcmp(parts.tag, tag->data, tag->len) == 0;
}

/*
 * Fills pattern with the SCAN pattern of the slots' keys of every identity
 * of the concurrency policy (<key_prefix>concurrency:{*}:<policy>, the glob
 * characters of the prefix and the name escaped).
 */
void
rl_slot_keys_pattern(const char *policy, StringInfo pattern)
{
	rl_append_glob(pattern, rl_key_prefix, strlen(rl_key_prefix));
	appendStringInfoString(pattern, "concurrency:{*}:");
	rl_append_glob(pattern, policy, strlen(policy));
}

/*
 * The identity whose slots of the concurrency policy (its name and limit)
 * key holds, decoded; NULL when key is not exactly the key rl_build_key
 * makes for an identity (another application's, or one empty or longer
 * than any identity may be). Does no I/O.
 */
text *
rl_slot_key_identity(const char *key, size_t len, const char *policy,
					 const RlLimit *limit)
{
	RlKeyParts	parts;
	StringInfoData identity;
	const char *p;
	const char *end;
	text	   *result;
	StringInfo	rebuilt;

	if (!rl_parse_key(key, len, &parts) ||
		strcmp(parts.kind, "concurrency") != 0 ||
		parts.taglen - 2 > RL_MAX_IDENTITY_BYTES * 3)
		return NULL;
	initStringInfo(&identity);
	end = parts.tag + parts.taglen - 1;
	for (p = parts.tag + 1; p < end; p++)
	{
		if (*p == '%' && end - p >= 3 && (memcmp(p, "%25", 3) == 0 ||
										  memcmp(p, "%7B", 3) == 0 ||
										  memcmp(p, "%7D", 3) == 0))
		{
			appendStringInfoChar(&identity, p[1] == '2' ? '%' :
								 p[2] == 'B' ? '{' : '}');
			p += 2;
		}
		else
			appendStringInfoChar(&identity, *p);
	}
	/* no call takes a slot for an empty identity (rl_check_identity) */
	if (identity.len == 0 || identity.len > RL_MAX_IDENTITY_BYTES)
	{
		pfree(identity.data);
		return NULL;
	}
	result = cstring_to_text_with_len(identity.data, identity.len);
	pfree(identity.data);
	/* what the encoding does not make (a '%' alone) is not an identity's key */
	rebuilt = rl_build_key(result, policy, limit);
	if ((size_t) rebuilt->len != len || memcmp(rebuilt->data, key, len) != 0)
	{
		pfree(result);
		return NULL;
	}
	return result;
}
