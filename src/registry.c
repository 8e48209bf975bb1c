/*
 * registry.c
 *	  The algorithms of algorithms.h and the Lua scripts compiled into the
 *	  library, and how to find a script by its id or its text.
 *
 * Each script is compiled into the library twice (src/embed_lua.sh): as a
 * function of the Redis function library, and as a script of its own for
 * EVAL. An algorithm's script decides one charge, the shared scripts serve
 * several algorithms. This is data and its lookups: running a script is
 * scripts.c's.
 */
#include "postgres.h"

#include "common/hashfn.h"

#include "rl_redis.h"
#include "lua_scripts.h"

/* The algorithms of algorithms.h, in its order (RL_ALG_<name>). */
const RlAlgorithm rl_algorithms[RL_NUM_ALGORITHMS] = {
#define RL_ALGORITHM(name, lua_file, key_kind, refund_subtracts, keeps_records, log, bucket) \
	{#name, key_kind, {RL_LUA_ALG_##name, RL_LUA_ALG_##name##_FUNCTION, RL_ALG_##name}, \
	 refund_subtracts, keeps_records, log, bucket},
#include "algorithms.h"
#undef RL_ALGORITHM
};

const RlScript rl_script_check_all = {RL_LUA_CHECK_ALL, RL_LUA_CHECK_ALL_FUNCTION, RL_NUM_ALGORITHMS};
const RlScript rl_script_refund = {RL_LUA_REFUND, RL_LUA_REFUND_FUNCTION, RL_NUM_ALGORITHMS + 1};
const RlScript rl_script_forget = {RL_LUA_FORGET, RL_LUA_FORGET_FUNCTION, RL_NUM_ALGORITHMS + 2};
const RlScript rl_script_concurrency = {RL_LUA_CONCURRENCY, RL_LUA_CONCURRENCY_FUNCTION, RL_NUM_ALGORITHMS + 3};
const RlScript rl_script_denial_note = {RL_LUA_DENIAL_NOTE, RL_LUA_DENIAL_NOTE_FUNCTION, RL_NUM_ALGORITHMS + 4};
const RlScript rl_script_denial_top = {RL_LUA_DENIAL_TOP, RL_LUA_DENIAL_TOP_FUNCTION, RL_NUM_ALGORITHMS + 5};
const RlScript rl_script_check_many = {RL_LUA_CHECK_MANY, RL_LUA_CHECK_MANY_FUNCTION, RL_NUM_ALGORITHMS + 6};

/* The library of Redis functions that holds every script, and its name. */
const char *const rl_library = RL_LUA_LIBRARY;
const char *const rl_library_name = RL_LUA_LIBRARY_NAME;

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
