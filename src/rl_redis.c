/*
 * rl_redis.c
 *	  Module entry point: defines the settings and registers the callbacks.
 */
#include "postgres.h"

#include "fmgr.h"

#include "rl_redis.h"

PG_MODULE_MAGIC;

void		_PG_init(void);

/* Called when the library is loaded into a backend. */
void
_PG_init(void)
{
	rl_define_gucs();
	rl_stats_init();
	rl_deny_cache_init();
	rl_shared_queue_init();
	rl_policy_init();
	rl_xact_end_init();
}
