/*
 * scripts.c
 *	  Running a script of the registry (registry.c) on a connection, and
 *	  the arguments all scripts share.
 *
 * Scripts run by EVALSHA; when Redis does not know the script (NOSCRIPT: a
 * restart, SCRIPT FLUSH, a failover) the same call is sent once more as
 * EVAL with the script's text, which also loads it for the calls after.
 */
#include "postgres.h"

#include "utils/builtins.h"

#include "rl_redis.h"

StaticAssertDecl(RL_NUM_SCRIPTS <= 32, "a connection keeps its loaded scripts in 32 bits");

/*
 * Fills the head of a call of script, argv[0] and argv[1], before the
 * numkeys, keys and arguments the caller put in argv[2..]: EVAL and the
 * script's text when eval (which also loads the script on the server),
 * else EVALSHA and its SHA1. Every script call is headed here.
 */
void
rl_script_argv(const RlScript *script, bool eval, const char **argv,
			   size_t *argvlen)
{
	argv[0] = eval ? "EVAL" : "EVALSHA";
	argvlen[0] = strlen(argv[0]);
	argv[1] = eval ? script->body : script->sha;
	argvlen[1] = strlen(argv[1]);
}

/*
 * Sends the call in argv as EVAL with script's text, which also loads the
 * script on conn's server. Returns as rl_run_script.
 */
static redisReply *
rl_eval(RlConn *conn, const RlScript *script, int argc, const char **argv,
		size_t *argvlen, RlFailure *failure)
{
	redisReply *reply;

	rl_script_argv(script, true, argv, argvlen);
	reply = rl_command(conn, argc, argv, argvlen, failure);
	if (reply != NULL)
		rl_conn_script_loaded(conn, script->id);
	return reply;
}

/*
 * Runs script on conn with the arguments in argv[2..argc-1] (numkeys, keys, args)
 * and returns Redis's reply, which may be an error reply, or NULL with
 * failure filled in when Redis could not be reached. argv[0] and argv[1]
 * are filled in here. The caller frees the reply.
 */
redisReply *
rl_run_script(RlConn *conn, const RlScript *script, int argc,
			  const char **argv, size_t *argvlen, RlFailure *failure)
{
	redisReply *reply;

	rl_script_argv(script, false, argv, argvlen);
	reply = rl_command(conn, argc, argv, argvlen, failure);
	if (reply == NULL || reply->type != REDIS_REPLY_ERROR ||
		rl_classify_error(reply->str, rl_conn_host(conn), NULL) != RL_REPLY_NOSCRIPT)
	{
		if (reply != NULL)
			rl_conn_script_loaded(conn, script->id);
		return reply;
	}

	freeReplyObject(reply);
	return rl_eval(conn, script, argc, argv, argvlen, failure);
}

/*
 * Runs script on conn for a key that Redis Cluster is moving there (an ASK
 * redirection): ASKING, then the call as EVAL, which needs no loaded script
 * (after a NOSCRIPT the ASKING would be spent). Returns as rl_run_script.
 */
redisReply *
rl_run_script_asking(RlConn *conn, const RlScript *script, int argc,
					 const char **argv, size_t *argvlen, RlFailure *failure)
{
	redisReply *reply;

	if (!rl_asking(conn, &reply, failure))
		return reply;
	return rl_eval(conn, script, argc, argv, argvlen, failure);
}

/* Writes the scripts' clock argument into buf: the test clock, or "". */
size_t
rl_clock_arg(char *buf)
{
	if (rl_test_clock_ms > 0)
		return pg_lltoa((int64) (rl_test_clock_ms * 1000.0), buf);
	buf[0] = '\0';
	return 0;
}
