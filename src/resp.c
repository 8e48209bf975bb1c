/*
 * resp.c
 *	  The Redis protocol (RESP) as the connections write it: a command
 *	  encoded, and an encoded EVAL taken apart again.
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
	char		num[24];
	int			i;

	appendStringInfoChar(buf, '*');
	appendBinaryStringInfo(buf, num, pg_ulltoa_n((uint64) argc, num));
	appendBinaryStringInfo(buf, "\r\n", 2);
	for (i = 0; i < argc; i++)
	{
		appendStringInfoChar(buf, '$');
		appendBinaryStringInfo(buf, num, pg_ulltoa_n((uint64) argvlen[i], num));
		appendBinaryStringInfo(buf, "\r\n", 2);
		appendBinaryStringInfo(buf, argv[i], argvlen[i]);
		appendBinaryStringInfo(buf, "\r\n", 2);
	}
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
