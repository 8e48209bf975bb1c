/*
 * rl_redis.h
 *	  Declarations shared by the files of the rl_redis extension.
 *
 * src/guc.c        the rl_redis.* settings
 * src/transport.c  the per-backend Redis connection and its socket I/O
 * src/scripts.c    the Lua script registry (EVALSHA, reload on NOSCRIPT)
 * src/limits.c     the SQL-callable functions
 */
#ifndef RL_REDIS_H
#define RL_REDIS_H

#include "postgres.h"

#include <hiredis/hiredis.h>

/* rl_redis.on_error */
typedef enum RlOnError
{
	RL_ON_ERROR_ERROR,
	RL_ON_ERROR_ALLOW,
	RL_ON_ERROR_DENY
} RlOnError;

/* settings (guc.c) */
extern char *rl_host;
extern int	rl_port;
extern char *rl_username;
extern char *rl_password;
extern int	rl_database;
extern int	rl_connect_timeout;
extern int	rl_command_timeout;
extern char *rl_key_prefix;
extern int	rl_on_error;
extern double rl_test_clock_ms;
extern bool rl_connection_settings_changed;

extern void rl_define_gucs(void);

/*
 * Why a Redis call failed, for the caller to raise as an error or to log as
 * a warning under rl_redis.on_error. The connection has already been
 * discarded when one of these is filled in.
 */
typedef struct RlFailure
{
	int			sqlerrcode;
	char		message[512];
} RlFailure;

/* transport (transport.c) */
extern void rl_transport_init(void);
extern redisReply *rl_command(int argc, const char **argv,
							  const size_t *argvlen, RlFailure *failure);
extern const char *rl_server_name(void);

/* scripts (scripts.c) */
typedef struct RlScript
{
	const char *name;
	const char *body;
	const char *sha;
} RlScript;

extern const RlScript rl_script_fixed_window;
extern const RlScript rl_script_sliding_window;

extern redisReply *rl_run_script(const RlScript *script, const char *key,
								 size_t keylen, int nargs, const char **args,
								 const size_t *arglens, RlFailure *failure);

#endif							/* RL_REDIS_H */
