/*
 * sentinel.c
 *	  Redis Sentinel (rl_redis.mode = sentinel): the master the sentinels
 *	  name.
 *
 * The sentinels (rl_redis.nodes, else host:port) are asked in order for the
 * address of rl_redis.sentinel_master; the connection to it checks with
 * ROLE that it is the master before any command (connect.c). A READONLY
 * reply, a failed connection or a ROLE that is not master makes the next
 * call ask the sentinels again (rl_sentinel_failed), and so does a call
 * more than rl_redis.sentinel_recheck_interval after they were last asked:
 * after a failover, the old master may take a while to learn that it is
 * one no more, and would take writes meanwhile. The sentinels are asked at
 * most once per call.
 */
#include "postgres.h"

#include "utils/timestamp.h"

#include "rl_redis.h"

/* the master the sentinels named last */
static RlConn *master_conn = NULL;
static bool master_stale = false;
static TimestampTz master_checked_at = 0;
static int	sentinel_first = 0;		/* the seed that answered last */

/*
 * Asks the sentinels, in order (first the one that answered last), for the
 * address of rl_redis.sentinel_master and makes its connection the
 * master's, all within connect_timeout. What the previous master's
 * queue still holds goes to the new one. False, with the last failure,
 * when no sentinel names it.
 */
static bool
rl_sentinel_discover(RlFailure *failure)
{
	RlSeed		seeds[RL_MAX_SEEDS];
	int			nseeds = rl_seeds(seeds);
	TimestampTz deadline = TimestampTzPlusMilliseconds(GetCurrentTimestamp(),
													   rl_connect_timeout);
	int			n;

	master_checked_at = GetCurrentTimestamp();
	if (rl_sentinel_master[0] == '\0')
	{
		rl_fail(failure, RL_FAILURE_CONFIG,
				ERRCODE_SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION,
				RL_HINT_NONE, NULL, "rl_redis.sentinel_master is not set");
		return false;
	}
	rl_fail(failure, RL_FAILURE_TOPOLOGY,
			ERRCODE_SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION, RL_HINT_NONE,
			NULL, "no sentinel named the master \"%s\"", rl_sentinel_master);
	for (n = 0; n < nseeds && GetCurrentTimestamp() < deadline; n++)
	{
		int			i = (sentinel_first + n) % nseeds;
		const char *argv[3] = {"SENTINEL", "get-master-addr-by-name",
		rl_sentinel_master};
		size_t		argvlen[3] = {8, 23, strlen(rl_sentinel_master)};
		RlConn	   *conn = rl_conn_at(seeds[i].host, seeds[i].port,
									  RL_CONN_SENTINEL);
		redisReply *reply;
		char		host[RL_ADDRESS_LEN];
		long long	port;
		RlConn	   *found;

		if (conn == NULL)
			continue;

		/* each sentinel left gets an equal share of what is left */
		reply = rl_command_share(conn, 3, argv, argvlen, deadline,
								 nseeds - n, failure);
		if (reply == NULL)
			continue;
		if (reply->type != REDIS_REPLY_ARRAY || reply->elements != 2 ||
			reply->element[0]->type != REDIS_REPLY_STRING ||
			reply->element[0]->len == 0 ||
			reply->element[0]->len >= RL_ADDRESS_LEN - 8 ||
			reply->element[0]->str[0] == '/' ||
			!rl_reply_scalar(reply->element[1]) ||
			(port = rl_reply_number(reply->element[1])) < 1 || port > 65535)
		{
			rl_fail(failure, RL_FAILURE_TOPOLOGY,
					ERRCODE_SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION,
					RL_HINT_NONE, NULL,
					"the sentinel at %s does not know the master \"%s\"",
					rl_conn_name(conn), rl_sentinel_master);
			freeReplyObject(reply);
			continue;
		}
		snprintf(host, sizeof(host), "%.*s", (int) reply->element[0]->len,
				 reply->element[0]->str);
		freeReplyObject(reply);
		found = rl_conn_at(host, (int) port, RL_CONN_MASTER);
		if (found == NULL)
		{
			rl_fail(failure, RL_FAILURE_TOPOLOGY, ERRCODE_CONNECTION_FAILURE,
					RL_HINT_NONE, NULL,
					"the sentinel at %s named a master at %s:%lld beyond the %d servers a session keeps",
					rl_conn_name(conn), host, port, RL_MAX_CONNECTIONS);
			continue;
		}
		if (master_conn != NULL && master_conn != found)
			rl_conn_hand_over(master_conn, found);
		master_conn = found;
		master_stale = false;
		sentinel_first = i;
		return true;
	}
	/* none answered: the next round begins with the next one */
	sentinel_first = (sentinel_first + 1) % Max(nseeds, 1);
	return false;
}


/*
 * Returns the master's connection, asking the sentinels first when none is
 * known, it failed, or they were asked more than
 * rl_redis.sentinel_recheck_interval ago, and *may_ask (which it then
 * clears); NULL with failure filled in when no sentinel named a master.
 */
static RlConn *
rl_sentinel_route(const char *key, size_t keylen, bool *may_ask,
				  RlFailure *failure)
{
	/* a master not failed but not checked lately stays when none answers */
	if (*may_ask &&
		(master_conn == NULL || master_stale ||
		 TimestampDifferenceExceeds(master_checked_at, GetCurrentTimestamp(),
									rl_sentinel_recheck_interval)))
	{
		*may_ask = false;
		(void) rl_sentinel_discover(failure);
	}
	else if (master_conn == NULL || master_stale)
	{
		rl_fail(failure, RL_FAILURE_TOPOLOGY,
				ERRCODE_SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION,
				RL_HINT_NONE, NULL,
				"no sentinel named the master \"%s\" lately",
				rl_sentinel_master);
	}
	if (master_conn != NULL && !master_stale)
		return master_conn;
	return NULL;
}

/* The master the sentinels named last (NULL: none); no I/O. */
static RlConn *
rl_sentinel_known(const char *key, size_t keylen)
{
	return master_conn;
}

/*
 * A connection failed or refused a write: when it is the master's, the
 * next route asks the sentinels again, and its next connection checks
 * ROLE again.
 */
static void
rl_sentinel_failed(RlConn *conn)
{
	if (conn != master_conn)
		return;
	master_stale = true;
	rl_conn_close(conn);
}

/* Forgets the master (the servers changed). */
static void
rl_sentinel_forget(void)
{
	master_conn = NULL;
	master_stale = false;
}

/* How this topology routes a call (router.c). */
const RlRoutes rl_sentinel_routes = {
	.route = rl_sentinel_route,
	.known = rl_sentinel_known,
	.failed = rl_sentinel_failed,
	.forget = rl_sentinel_forget
};
