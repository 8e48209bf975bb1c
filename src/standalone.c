/*
 * standalone.c
 *	  One Redis server (rl_redis.mode = standalone): every key goes to the
 *	  configured server (rl_redis.host, rl_redis.port), as before there
 *	  were modes.
 *
 * There is no other route: a call whose connection failed is not sent
 * again, and every error reply is the call's reply (topology.c).
 */
#include "postgres.h"

#include "rl_redis.h"

/* The connection of the configured server; never NULL. */
static RlConn *
rl_standalone_route(const char *key, size_t keylen, bool *may_ask,
					RlFailure *failure)
{
	return rl_conn_get();
}

/* The connection of the configured server; no I/O. */
static RlConn *
rl_standalone_known(const char *key, size_t keylen)
{
	return rl_conn_current();
}

/* How this topology routes a call (router.c). */
const RlRoutes rl_standalone_routes = {
	.route = rl_standalone_route,
	.known = rl_standalone_known
};
