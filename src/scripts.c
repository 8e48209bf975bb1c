/*
 * scripts.c
 *	  The Lua script registry: the algorithms of algorithms.h and the
 *	  scripts that serve several, and the arguments all scripts share.
 *
 * Each script is compiled into the library together with its SHA1
 * (src/embed_lua.sh). Scripts run by EVALSHA; when Redis does not know the
 * script (NOSCRIPT: a restart, SCRIPT FLUSH, a failover) the same call is
 * sent once more as EVAL with the script's text, which also loads it for the
 * calls after.
 */
#include "postgres.h"

#include "common/hashfn.h"
#include "utils/builtins.h"

#include "rl_redis.h"
#include "lua_scripts.h"

/* The algorithms of algorithms.h, in its order (RL_ALG_<name>). */
const RlAlgorithm rl_algorithms[RL_NUM_ALGORITHMS] = {
#define RL_ALGORITHM(name, lua_file, key_kind, refund_subtracts, keeps_records, log, bucket) \
	{#name, key_kind, {RL_LUA_ALG_##name, RL_LUA_ALG_##name##_SHA, RL_ALG_##name}, \
	 refund_subtracts, keeps_records, log, bucket},
#include "algorithms.h"
#undef RL_ALGORITHM
};

const RlScript rl_script_check_all = {RL_LUA_CHECK_ALL, RL_LUA_CHECK_ALL_SHA, RL_NUM_ALGORITHMS};
const RlScript rl_script_refund = {RL_LUA_REFUND, RL_LUA_REFUND_SHA, RL_NUM_ALGORITHMS + 1};
const RlScript rl_script_forget = {RL_LUA_FORGET, RL_LUA_FORGET_SHA, RL_NUM_ALGORITHMS + 2};
const RlScript rl_script_concurrency = {RL_LUA_CONCURRENCY, RL_LUA_CONCURRENCY_SHA, RL_NUM_ALGORITHMS + 3};
const RlScript rl_script_denial_note = {RL_LUA_DENIAL_NOTE, RL_LUA_DENIAL_NOTE_SHA, RL_NUM_ALGORITHMS + 4};
const RlScript rl_script_denial_top = {RL_LUA_DENIAL_TOP, RL_LUA_DENIAL_TOP_SHA, RL_NUM_ALGORITHMS + 5};
const RlScript rl_script_check_many = {RL_LUA_CHECK_MANY, RL_LUA_CHECK_MANY_SHA, RL_NUM_ALGORITHMS + 6};

/* The script of id (RlScript.id), or NULL. */
const RlScript *
rl_script_by_id(int id)
{
	static const RlScript *const shared[] = {
		&rl_script_check_all, &rl_script_refund, &rl_script_forget,
		&rl_script_concurrency, &rl_script_denial_note, &rl_script_denial_top,
		&rl_script_check_many
	};

	StaticAssertStmt(lengthof(shared) == RL_NUM_SCRIPTS - RL_NUM_ALGORITHMS,
					 "every shared script is listed");
	if (id >= 0 && id < RL_NUM_ALGORITHMS)
		return &rl_algorithms[id].script;
	if (id >= RL_NUM_ALGORITHMS && id < RL_NUM_SCRIPTS)
		return shared[id - RL_NUM_ALGORITHMS];
	return NULL;
}

/*
 * The script whose text is len bytes with that hash_bytes_extended (seed
 * 0), or NULL: how the worker finds the script of an EVAL a session handed
 * over.
 */
const RlScript *
rl_script_by_text(size_t len, uint64 hash)
{
	int			id;

	for (id = 0; id < RL_NUM_SCRIPTS; id++)
	{
		const RlScript *script = rl_script_by_id(id);

		if (strlen(script->body) == len &&
			hash_bytes_extended((const unsigned char *) script->body, len, 0) == hash)
			return script;
	}
	return NULL;
}

StaticAssertDecl(RL_NUM_SCRIPTS <= 32, "a connection keeps its loaded scripts in 32 bits");

/*
 * Sends the call in argv as EVAL with script's text, which also loads the
 * script on conn's server. Returns as rl_run_script.
 */
static redisReply *
rl_eval(RlConn *conn, const RlScript *script, int argc, const char **argv,
		size_t *argvlen, RlFailure *failure)
{
	redisReply *reply;

	argv[0] = "EVAL";
	argvlen[0] = 4;
	argv[1] = script->body;
	argvlen[1] = strlen(script->body);
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

	argv[0] = "EVALSHA";
	argvlen[0] = 7;
	argv[1] = script->sha;
	argvlen[1] = 40;
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
