/*
 * scripts.c
 *	  Running a script of the registry (registry.c) on a connection, and
 *	  the arguments all scripts share.
 *
 * Scripts run as functions of one library (rl_library) by FCALL: Redis
 * keeps the library's Lua state, so a call runs only its own part (a
 * script sent by EVALSHA runs its whole text each time, making every
 * helper function anew). When Redis does not have the library (the first
 * call after a restart, FUNCTION FLUSH, a server that never had it) it
 * answers "Function not found" (RL_REPLY_NO_FUNCTION), and the call goes once
 * more behind FUNCTION LOAD of the library, the two in one round trip. The
 * calls that must not depend on a loaded library go as EVAL with the
 * script's text: an ASK redirection's, and the work queued for a
 * transaction's end (refund.c, worker.c), which must take one round trip.
 */
#include "postgres.h"

#include "utils/builtins.h"

#include "rl_redis.h"

/*
 * Fills the head of a call of script, argv[0] and argv[1], before the
 * numkeys, keys and arguments the caller put in argv[2..]: EVAL and the
 * script's text when eval, else FCALL and its function. Every script call
 * is headed here.
 */
void
rl_script_argv(const RlScript *script, bool eval, const char **argv,
			   size_t *argvlen)
{
	argv[0] = eval ? "EVAL" : "FCALL";
	argvlen[0] = strlen(argv[0]);
	argv[1] = eval ? script->body : script->function;
	argvlen[1] = strlen(argv[1]);
}

/* Fills argv with FUNCTION LOAD of the library; returns its 3 words. */
int
rl_library_load_argv(const char **argv, size_t *argvlen)
{
	argv[0] = "FUNCTION";
	argv[1] = "LOAD";
	argv[2] = rl_library;
	argvlen[0] = strlen(argv[0]);
	argvlen[1] = strlen(argv[1]);
	argvlen[2] = strlen(argv[2]);
	return 3;
}

/*
 * Notes on conn what reply, Redis's answer to FUNCTION LOAD of the library,
 * says, and returns whether the server has the library now: the library's
 * name (it was loaded) or the error "ERR Library '<name>' already exists"
 * for this library's name (which says its text) note it loaded; an error
 * that lasts (rl_error_lasts: NOPERM, FUNCTION renamed) notes it refused.
 */
bool
rl_library_load_noted(RlConn *conn, const redisReply *reply)
{
	size_t		len = strlen(rl_library_name);

	if (reply->type != REDIS_REPLY_ERROR ||
		(strncmp(reply->str, "ERR Library '", 13) == 0 &&
		 strncmp(reply->str + 13, rl_library_name, len) == 0 &&
		 strcmp(reply->str + 13 + len, "' already exists") == 0))
	{
		rl_conn_library_loaded(conn);
		return true;
	}
	if (rl_error_lasts(reply->str))
		rl_conn_library_refused(conn);
	return false;
}

/* Whether reply is an error reply that says Redis lacks the function. */
static bool
rl_not_found(RlConn *conn, const redisReply *reply)
{
	return reply != NULL && reply->type == REDIS_REPLY_ERROR &&
		rl_classify_error(reply->str, rl_conn_host(conn), NULL) == RL_REPLY_NO_FUNCTION;
}

/*
 * Sends FUNCTION LOAD of the library and then the FCALL in argv on conn, in
 * one round trip, and returns the FCALL's reply. When the FCALL found no
 * function because the library could not be loaded (an ACL without
 * FUNCTION LOAD, OOM, a replica), returns the load's error reply instead,
 * which says why; the FCALL's reply is given back whenever the call ran
 * (the library may have come from elsewhere meanwhile). Returns as
 * rl_run_script.
 */
static redisReply *
rl_load_and_run(RlConn *conn, int argc, const char **argv, size_t *argvlen,
				RlFailure *failure)
{
	const char *load_argv[3];
	size_t		load_argvlen[3];
	RlCommand	cmds[2];
	redisReply *volatile load;
	redisReply *reply;

	cmds[0].argc = rl_library_load_argv(load_argv, load_argvlen);
	cmds[0].argv = load_argv;
	cmds[0].argvlen = load_argvlen;
	cmds[1].argc = argc;
	cmds[1].argv = argv;
	cmds[1].argvlen = argvlen;
	if (!rl_pipeline_send(conn, 2, cmds, -1, failure))
		return NULL;
	load = rl_pipeline_recv(conn, failure);
	if (load == NULL)
		return NULL;
	if (rl_library_load_noted(conn, load))
	{
		freeReplyObject(load);
		return rl_pipeline_recv(conn, failure);
	}
	/* an interrupt while the FCALL's reply is awaited must free the load's */
	PG_TRY();
	{
		reply = rl_pipeline_recv(conn, failure);
	}
	PG_CATCH();
	{
		freeReplyObject(load);
		PG_RE_THROW();
	}
	PG_END_TRY();
	if (!rl_not_found(conn, reply))
	{
		freeReplyObject(load);
		if (reply != NULL && reply->type != REDIS_REPLY_ERROR)
			rl_conn_library_loaded(conn);
		return reply;
	}
	freeReplyObject(reply);
	return load;
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
	if (!rl_not_found(conn, reply))
	{
		if (reply != NULL && reply->type != REDIS_REPLY_ERROR)
			rl_conn_library_loaded(conn);
		return reply;
	}

	rl_conn_library_forget(conn);
	/*
	 * refused for good within RL_LOAD_RETRY_MS (an ACL without FUNCTION
	 * LOAD): "Function not found" is the reply, so that a server that will
	 * not load the library is not sent it with every call
	 */
	if (!rl_conn_library_may_load(conn))
		return reply;
	freeReplyObject(reply);
	return rl_load_and_run(conn, argc, argv, argvlen, failure);
}

/*
 * Runs script on conn for a key that Redis Cluster is moving there (an ASK
 * redirection): ASKING, then the call as EVAL, which needs no loaded
 * library (after a "Function not found" the ASKING would be spent).
 * Returns as rl_run_script.
 */
redisReply *
rl_run_script_asking(RlConn *conn, const RlScript *script, int argc,
					 const char **argv, size_t *argvlen, RlFailure *failure)
{
	redisReply *reply;

	if (!rl_asking(conn, &reply, failure))
		return reply;
	rl_script_argv(script, true, argv, argvlen);
	return rl_command(conn, argc, argv, argvlen, failure);
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
