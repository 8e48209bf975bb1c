/*
 * scripts.c
 *	  The Lua script registry.
 *
 * Each algorithm is one script in lua/, compiled into the library together
 * with its SHA1 (src/embed_lua.sh). Scripts run by EVALSHA; when Redis does
 * not know the script (NOSCRIPT: a restart, SCRIPT FLUSH, a failover) the
 * same call is sent once more as EVAL with the script's text, which also
 * loads it for the calls after.
 */
#include "postgres.h"

#include "rl_redis.h"
#include "lua_scripts.h"

const RlScript rl_script_fixed_window = {
	"fixed_window", RL_LUA_FIXED_WINDOW, RL_LUA_FIXED_WINDOW_SHA
};

const RlScript rl_script_sliding_window = {
	"sliding_window", RL_LUA_SLIDING_WINDOW, RL_LUA_SLIDING_WINDOW_SHA
};

#define RL_MAX_SCRIPT_ARGS 8

/*
 * Runs script on one key with nargs arguments and returns Redis's reply
 * (which may be an error reply), or NULL with failure filled in when Redis
 * could not be reached. The caller frees the reply.
 */
redisReply *
rl_run_script(const RlScript *script, const char *key, size_t keylen,
			  int nargs, const char **args, const size_t *arglens,
			  RlFailure *failure)
{
	const char *argv[RL_MAX_SCRIPT_ARGS + 4];
	size_t		argvlen[RL_MAX_SCRIPT_ARGS + 4];
	redisReply *reply;
	int			i;

	Assert(nargs <= RL_MAX_SCRIPT_ARGS);

	argv[0] = "EVALSHA";
	argvlen[0] = 7;
	argv[1] = script->sha;
	argvlen[1] = 40;
	argv[2] = "1";
	argvlen[2] = 1;
	argv[3] = key;
	argvlen[3] = keylen;
	for (i = 0; i < nargs; i++)
	{
		argv[4 + i] = args[i];
		argvlen[4 + i] = arglens[i];
	}

	reply = rl_command(4 + nargs, argv, argvlen, failure);
	if (reply == NULL || reply->type != REDIS_REPLY_ERROR ||
		strncmp(reply->str, "NOSCRIPT", 8) != 0)
		return reply;

	freeReplyObject(reply);
	argv[0] = "EVAL";
	argvlen[0] = 4;
	argv[1] = script->body;
	argvlen[1] = strlen(script->body);
	return rl_command(4 + nargs, argv, argvlen, failure);
}
