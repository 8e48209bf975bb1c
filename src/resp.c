/*
 * resp.c
 *	  The Redis protocol (RESP) as the connections write it: a command
 *	  encoded, the ASKING command, and an encoded EVAL taken apart again; a
 *	  reply's number; and what an error reply means, from one table.
 *
 * We use hiredis only to parse replies (redisReader); the commands are
 * encoded here. Nothing here knows a connection.
 */
#include "postgres.h"

#include "lib/stringinfo.h"
#include "utils/builtins.h"

#include "rl_redis.h"
#include "conn_internal.h"

/* Appends one command, encoded in the Redis protocol (RESP), to buf. */
void
rl_encode(StringInfo buf, int argc, const char **argv, const size_t *argvlen)
{
	rl_encode_head(buf, argc, argc, argv, argvlen);
}

/*
 * Appends the head of a command of argc arguments, encoded in the Redis
 * protocol, to buf: their number and the first n, argv[0..n-1]; the caller
 * appends the other argc - n, encoded.
 */
void
rl_encode_head(StringInfo buf, int argc, int n, const char **argv,
			   const size_t *argvlen)
{
	char		num[24];
	int			i;

	appendStringInfoChar(buf, '*');
	appendBinaryStringInfo(buf, num, pg_ulltoa_n((uint64) argc, num));
	appendBinaryStringInfo(buf, "\r\n", 2);
	for (i = 0; i < n; i++)
	{
		appendStringInfoChar(buf, '$');
		appendBinaryStringInfo(buf, num, pg_ulltoa_n((uint64) argvlen[i], num));
		appendBinaryStringInfo(buf, "\r\n", 2);
		appendBinaryStringInfo(buf, argv[i], argvlen[i]);
		appendBinaryStringInfo(buf, "\r\n", 2);
	}
}

/*
 * Fills argv and argvlen (one element) with ASKING, which lets the next
 * command on a connection touch a key that Redis Cluster is moving there
 * (an ASK redirection): sent at once by rl_asking, queued ahead of a
 * redirected command by rl_queue_redirect. Returns argc, 1.
 */
int
rl_asking_argv(const char **argv, size_t *argvlen)
{
	argv[0] = "ASKING";
	argvlen[0] = strlen(argv[0]);
	return 1;
}

/*
 * When the encoded command cmd (len bytes) is "EVAL <script> <args...>",
 * sets *body and *bodylen to the script's text and *rest and *restlen to
 * the encoded arguments after it, *nargs to their number, and returns
 * true.
 */
bool
rl_split_eval(const char *cmd, size_t len, const char **body, size_t *bodylen,
			  const char **rest, size_t *restlen, int *nargs)
{
	const char *p = cmd;
	const char *end = cmd + len;
	char	   *next;
	long		n;
	long		l;

	if (len < 16 || *p != '*')
		return false;
	n = strtol(p + 1, &next, 10);
	p = next;
	if (n < 2 || end - p < 13 || memcmp(p, "\r\n$4\r\nEVAL\r\n$", 13) != 0)
		return false;
	l = strtol(p + 13, &next, 10);
	p = next;
	if (l < 0 || end - p < 2 + l + 2 || memcmp(p, "\r\n", 2) != 0 ||
		memcmp(p + 2 + l, "\r\n", 2) != 0)
		return false;
	*body = p + 2;
	*bodylen = (size_t) l;
	*rest = p + 2 + l + 2;
	*restlen = end - *rest;
	*nargs = (int) n - 2;
	return true;
}

/* True when reply is a string (bulk or status) or an integer. */
bool
rl_reply_scalar(const redisReply *reply)
{
	return reply->type == REDIS_REPLY_STRING ||
		reply->type == REDIS_REPLY_STATUS || reply->type == REDIS_REPLY_INTEGER;
}

/* Returns a reply that rl_reply_scalar accepts as a number (-1 if not one). */
long long
rl_reply_number(const redisReply *reply)
{
	char		buf[24];
	char	   *end;
	long long	v;

	if (reply->type == REDIS_REPLY_INTEGER)
		return reply->integer;
	if (reply->len == 0 || reply->len >= sizeof(buf))
		return -1;
	memcpy(buf, reply->str, reply->len);
	buf[reply->len] = '\0';
	v = strtoll(buf, &end, 10);
	return *end == '\0' ? v : -1;
}

/* One line of the table of error replies: its text and what it means. */
typedef struct RlErrorText
{
	const char *text;
	bool		anywhere;		/* found anywhere, else at the start */
	RlReplyError what;
} RlErrorText;

/*
 * The error replies rl_redis acts on. "READONLY You can't write" is also
 * found inside the error of a script that wrote on a replica (Redis 6 and
 * older: "ERR Error running script ... -READONLY You can't write ...").
 * Redis 7 refuses a command of more than 10 words before AUTH with
 * "ERR Protocol error: unauthenticated". "ERR Function not found" is
 * FCALL's: the server lacks the library (scripts.c).
 */
static const RlErrorText rl_error_texts[] = {
	{"ERR Function not found", false, RL_REPLY_NO_FUNCTION},
	{"MOVED ", false, RL_REPLY_MOVED},
	{"ASK ", false, RL_REPLY_ASK},
	{"TRYAGAIN", false, RL_REPLY_TRYAGAIN},
	{"CLUSTERDOWN", false, RL_REPLY_CLUSTERDOWN},
	{"READONLY", false, RL_REPLY_READONLY},
	{"READONLY You can't write", true, RL_REPLY_READONLY},
	{"LOADING", false, RL_REPLY_NOT_READY},
	{"MASTERDOWN", false, RL_REPLY_NOT_READY},
	{"NOAUTH", false, RL_REPLY_AUTH},
	{"WRONGPASS", false, RL_REPLY_AUTH},
	{"ERR Protocol error: unauthenticated", false, RL_REPLY_AUTH}
};

/*
 * Parses a redirection's "<hash slot> <host>:<port>" (after "MOVED " or
 * "ASK "; an empty host is from_host); false when it is not of that form.
 */
static bool
rl_parse_redirect(const char *s, const char *from_host, RlRedirect *to)
{
	char	   *end;
	long		v = strtol(s, &end, 10);

	if (end == s || *end != ' ' || v < 0 || v >= RL_HASH_SLOTS)
		return false;
	to->hash_slot = (int) v;
	return rl_parse_redirect_node(end + 1, from_host, to->host, &to->port);
}

/*
 * What the text of an error reply says (see RlReplyError). For MOVED and
 * ASK, fills *to (when not NULL) with where the command goes, an empty host
 * being from_host, the node that answered; a redirection whose target does
 * not parse is RL_REPLY_OTHER, an error like any other.
 */
RlReplyError
rl_classify_error(const char *error, const char *from_host, RlRedirect *to)
{
	RlRedirect	unused;
	int			i;

	for (i = 0; i < lengthof(rl_error_texts); i++)
	{
		const RlErrorText *e = &rl_error_texts[i];

		if (e->anywhere ? strstr(error, e->text) != NULL :
			strncmp(error, e->text, strlen(e->text)) == 0)
			break;
	}
	if (i == lengthof(rl_error_texts))
		return RL_REPLY_OTHER;
	if ((rl_error_texts[i].what == RL_REPLY_MOVED ||
		 rl_error_texts[i].what == RL_REPLY_ASK) &&
		!rl_parse_redirect(error + strlen(rl_error_texts[i].text), from_host,
						   to != NULL ? to : &unused))
		return RL_REPLY_OTHER;
	return rl_error_texts[i].what;
}

/*
 * True when error, an error reply, is a refusal that lasts (NOPERM, an
 * unknown or renamed command, a proxy that does not pass it on): not one
 * that passes, out of memory (OOM), a busy script (BUSY), or one that says
 * the command did not run for now (rl_error_not_run: a replica, LOADING,
 * a cluster on the move) or was not authenticated.
 */
bool
rl_error_lasts(const char *error)
{
	return rl_classify_error(error, "", NULL) == RL_REPLY_OTHER &&
		strncmp(error, "OOM ", 4) != 0 && strncmp(error, "BUSY ", 5) != 0;
}

/*
 * True when an error reply of that class says that Redis did not run the
 * command and it may be sent again: the script was not loaded, or the
 * cluster sent it elsewhere or asked to try again, or the server is a
 * replica now, is still loading its data, or lost its master.
 */
bool
rl_error_not_run(RlReplyError what)
{
	return what != RL_REPLY_OTHER && what != RL_REPLY_AUTH;
}
