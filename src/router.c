/*
 * router.c
 *	  Which connection a key goes to, by the topology rl_redis.mode names,
 *	  and calls that follow Redis Cluster's redirections and a Sentinel
 *	  failover.
 *
 * The topology says where a key goes (its RlRoutes: standalone.c,
 * cluster.c, sentinel.c) and what an error reply means (topology.c); the
 * calls here follow it. A
 * redirection (MOVED, or ASK with ASKING) sends the call to the node
 * named; TRYAGAIN and CLUSTERDOWN are retried with a growing pause within
 * rl_redis.command_timeout; a READONLY reply or a connection that failed
 * makes the route ask again (a fresh slot map, the sentinels), at most once
 * per call; a call is sent at most RL_MAX_REDIRECTS times but for those
 * pauses.
 *
 * A call is sent again only when it cannot have run: after a redirection
 * or a READONLY reply (Redis refused it before running it), or when it
 * never left (the connection could not be made) and the route now names
 * another node. A call whose connection was lost after it was written is
 * never repeated: it may have been applied.
 */
#include "postgres.h"

#include "miscadmin.h"
#include "storage/latch.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"
#include "utils/wait_event.h"

#include "rl_redis.h"

/* the most redirections, or retries, one call follows */
#define RL_MAX_REDIRECTS 8

/* the longest pause between two tries after TRYAGAIN or CLUSTERDOWN */
#define RL_MAX_BACKOFF_MS 200

/*
 * Whether the current rl_call may still fetch the slot map or ask the
 * sentinels (once per call, so that a call's waits stay bounded).
 */
static bool may_ask = true;

/* the last route failed: its next failure is no new outage (one warning) */
static bool route_outage = false;

/* how each topology routes a call, by rl_redis.mode */
static const RlRoutes *const routes[RL_NUM_MODES] = {
	[RL_MODE_STANDALONE] = &rl_standalone_routes,
	[RL_MODE_CLUSTER] = &rl_cluster_routes,
	[RL_MODE_SENTINEL] = &rl_sentinel_routes
};

/* the routing settings as last seen (see rl_router_settings) */
static uint64 settings_seen = 0;
static StringInfoData routing;

/* How the topology rl_redis.mode names routes a call. */
static const RlRoutes *
rl_routes(void)
{
	return routes[rl_topology()->mode];
}

/*
 * Takes in a change of the routing settings (mode, and the seeds outside
 * standalone mode): what every topology knew about the old servers is
 * forgotten and what their queues hold is dropped (rl_servers_changed). In
 * standalone mode rl_conn_get takes in a change of host or port itself.
 */
static void
rl_router_settings(void)
{
	const RlTopology *topology = rl_topology();
	StringInfoData now;
	int			i;

	if (settings_seen == rl_settings_version())
		return;
	settings_seen = rl_settings_version();
	initStringInfo(&now);
	appendStringInfoString(&now, topology->name);
	if (!topology->one_server && rl_nodes[0] != '\0')
		appendStringInfo(&now, "%c%s%c%s", 0, rl_nodes, 0, rl_sentinel_master);
	else if (!topology->one_server)
		appendStringInfo(&now, "%c%s%c%d%c%s", 0, rl_host, 0, rl_port, 0,
						 rl_sentinel_master);
	if (routing.data == NULL)
	{
		MemoryContext old = MemoryContextSwitchTo(TopMemoryContext);

		initStringInfo(&routing);
		appendBinaryStringInfo(&routing, now.data, now.len);
		MemoryContextSwitchTo(old);
	}
	else if (now.len != routing.len || memcmp(now.data, routing.data, now.len) != 0)
	{
		rl_servers_changed("the connection settings now name other Redis servers");
		for (i = 0; i < RL_NUM_MODES; i++)
			if (routes[i]->forget != NULL)
				routes[i]->forget();
		resetStringInfo(&routing);
		appendBinaryStringInfo(&routing, now.data, now.len);
	}
	pfree(now.data);
}

/*
 * Returns the connection a call on key goes to (not necessarily open yet:
 * rl_command opens it), or NULL with failure filled in when it cannot be
 * known: no node answered for the slot map, no sentinel named the master,
 * no node serves the hash slot.
 */
RlConn *
rl_route(const char *key, size_t keylen, RlFailure *failure)
{
	RlConn	   *conn;

	rl_router_settings();
	conn = rl_routes()->route(key, keylen, &may_ask, failure);
	/* one warning per outage (on_error allow or deny), not one per call */
	if (conn == NULL)
	{
		failure->first_in_outage = !route_outage;
		failure->breaker_opened = false;
	}
	route_outage = (conn == NULL);
	return conn;
}

/*
 * Returns the connection a call on key went to last, for work queued for
 * a transaction end (a refund, a slot release), or NULL when none is
 * known. Does no I/O and never raises but for lack of memory.
 */
RlConn *
rl_route_known(const char *key, size_t keylen)
{
	return rl_routes()->known(key, keylen);
}

/*
 * The hash slot of key when keys are placed by hash slot (cluster mode),
 * else 0: the keys of one call must share it.
 */
int
rl_route_hash_slot(const char *key, size_t keylen)
{
	return rl_topology()->hash_slots ? rl_key_hash_slot(key, keylen) : 0;
}

/*
 * Fills *conns (palloc'd) with every master a call may go to: in cluster
 * mode each node of the slot map, else the one route. Returns how many, or
 * -1 with failure filled in.
 */
int
rl_route_all(RlConn ***conns, RlFailure *failure)
{
	may_ask = true;
	if (rl_routes()->masters == NULL)
	{
		RlConn	   *conn = rl_route("", 0, failure);

		if (conn == NULL)
			return -1;
		*conns = palloc(sizeof(RlConn *));
		(*conns)[0] = conn;
		return 1;
	}
	rl_router_settings();
	return rl_routes()->masters(conns, failure);
}

/*
 * The connection conn failed or refused a write: the map or the master may
 * have changed, so the next route asks again.
 */
static void
rl_route_failed(RlConn *conn)
{
	if (rl_routes()->failed != NULL)
		rl_routes()->failed(conn);
}

/* Sleeps ms, or less when an interrupt comes (it is serviced). */
static void
rl_pause(long ms)
{
	(void) WaitLatch(MyLatch, WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
					 ms, PG_WAIT_EXTENSION);
	ResetLatch(MyLatch);
	CHECK_FOR_INTERRUPTS();
}

/*
 * Sends a call on key and returns its reply (the caller frees it; it may be
 * an error reply), with *connp the connection that answered; NULL with
 * failure filled in when no answer came. With script, runs it (argv[0] and
 * argv[1] left for rl_run_script), else sends argv as it is. Follows
 * redirections and failovers as the file's header says.
 */
redisReply *
rl_call(const char *key, size_t keylen, const RlScript *script, int argc,
		const char **argv, size_t *argvlen, RlConn **connp,
		RlFailure *failure)
{
	const RlTopology *topology = rl_topology();
	RlConn	   *next = NULL;	/* where a redirection sends the call */
	bool		asking = false;
	int			tries = 0;
	long		backoff = 10;
	int			timeout = rl_command_timeout > 0 ? rl_command_timeout : 2000;
	TimestampTz deadline = TimestampTzPlusMilliseconds(GetCurrentTimestamp(),
													   timeout);

	may_ask = true;
	/* keys on several masters: what the others' queues hold goes first */
	if (topology->hash_slots)
		rl_send_queued(NULL);

	/* the shared worker, when it takes the call (shared_queue.c says) */
	if (script != NULL && rl_worker_takes(script, argv))
	{
		RlConn	   *own = rl_conn_get();
		bool		used;
		redisReply *reply;

		reply = rl_shared_call(own, script, argc, argv, argvlen,
							   RL_SCRIPT_ARGV_RESERVED + 1,
							   rl_settings_hash(), failure, &used);
		if (used)
		{
			*connp = own;
			return reply;
		}
	}
	for (;;)
	{
		RlConn	   *conn = next ? next : rl_route(key, keylen, failure);
		redisReply *reply;
		RlRedirect	to;
		RlReplyAction action;

		*connp = conn;
		if (conn == NULL)
			return NULL;
		if (asking && script != NULL)
			reply = rl_run_script_asking(conn, script, argc, argv, argvlen, failure);
		else if (asking)
		{
			if (rl_asking(conn, &reply, failure))
				reply = rl_command(conn, argc, argv, argvlen, failure);
		}
		else if (script != NULL)
			reply = rl_run_script(conn, script, argc, argv, argvlen, failure);
		else
			reply = rl_command(conn, argc, argv, argvlen, failure);
		next = NULL;
		asking = false;
		if (++tries > RL_MAX_REDIRECTS)
			return reply;

		if (reply == NULL)
		{
			RlFailure	again = {0};
			RlConn	   *other;

			rl_route_failed(conn);
			/* sent: it may have run, so never again; else try a new route */
			if (rl_command_was_sent(conn))
				return NULL;
			other = rl_route(key, keylen, &again);
			if (other == NULL || other == conn)
				return NULL;
			continue;
		}
		if (reply->type != REDIS_REPLY_ERROR)
			return reply;

		action = rl_reply_action(rl_classify_error(reply->str,
												   rl_conn_host(conn), &to));
		switch (action)
		{
			case RL_ACTION_GIVE_BACK:
				return reply;
			case RL_ACTION_MOVED:
			case RL_ACTION_ASK:
				next = rl_routes()->redirect(&to, action == RL_ACTION_MOVED);
				if (next == NULL)
					return reply;
				asking = (action == RL_ACTION_ASK);
				break;
			case RL_ACTION_LATER:
			case RL_ACTION_LATER_FRESH:
				{
					long		left = TimestampDifferenceMilliseconds(GetCurrentTimestamp(),
																	   deadline);

					if (left <= 0)
						return reply;
					if (action == RL_ACTION_LATER_FRESH)
						rl_route_failed(conn);
					freeReplyObject(reply);
					rl_pause(Min(backoff, left));
					backoff = Min(backoff * 2, RL_MAX_BACKOFF_MS);
					tries--;	/* bounded by the deadline instead */
					continue;
				}
			case RL_ACTION_FRESH:
				rl_route_failed(conn);
				break;
		}
		freeReplyObject(reply);
	}
}

/*
 * Sends the calls todo[i] of a batch, one pipeline per connection, all
 * written before any is read, and reads their replies in order. The calls
 * go by FCALL; with load, behind FUNCTION LOAD of the library on a
 * connection that may not know it (scripts.c). (Not on the first pass: a
 * connection that is not authenticated answers the first command and
 * drops the others, and Redis has the library at almost every call.) Fills
 * each call's reply or failure and
 * sets no_function[i] when Redis did not know the function after all (the
 * library was flushed: the call did not run; the connection forgets it) and
 * again[i] when the call did not run for another reason that a new route
 * may cure (an error reply that says so, rl_error_not_run: rl_call, which
 * sends it again, does what the topology makes of it; a connection that
 * could not be made, where another route may come: cluster, sentinel).
 * A connection's failure is
 * given to the first of its calls, and to the others without
 * first_in_outage and breaker_opened: warned of and counted once.
 */
static void
rl_pipeline_pass(RlCall *calls, int n, const bool *todo, bool load,
				 bool *no_function, bool *again)
{
	RlConn	  **conns = palloc(sizeof(RlConn *) * Max(n, 1));
	int		   *group = palloc(sizeof(int) * Max(n, 1));
	RlCommand  *cmds = palloc(sizeof(RlCommand) * (n + 1));
	int		   *members = palloc(sizeof(int) * (n + 1));
	bool	   *loading = palloc(sizeof(bool) * Max(n, 1));
	const char *load_argv[3];
	size_t		load_argvlen[3];
	int			load_argc = rl_library_load_argv(load_argv, load_argvlen);
	int			nconns = 0;
	int			c;
	int			i;

	/* the route of each call, and the distinct connections */
	for (i = 0; i < n; i++)
	{
		RlConn	   *conn;

		group[i] = -1;
		if (!todo[i])
			continue;
		calls[i].reply = NULL;
		calls[i].sent = false;
		memset(&calls[i].failure, 0, sizeof(RlFailure));
		conn = rl_route(calls[i].key, calls[i].keylen, &calls[i].failure);
		calls[i].conn = conn;
		if (conn == NULL)
			continue;
		for (c = 0; c < nconns && conns[c] != conn; c++)
			;
		if (c == nconns)
			conns[nconns++] = conn;
		group[i] = c;
	}

	for (c = 0; c < nconns; c++)
	{
		int			k = 0;
		RlFailure	failure = {0};

		loading[c] = load && !rl_conn_library_known(conns[c]) &&
			rl_conn_library_may_load(conns[c]);
		if (loading[c])
		{
			cmds[k].argc = load_argc;
			cmds[k].argv = load_argv;
			cmds[k].argvlen = load_argvlen;
			members[k++] = -1;
		}
		for (i = 0; i < n; i++)
		{
			RlCall	   *call = &calls[i];

			if (group[i] != c)
				continue;
			rl_script_argv(call->script, false, call->argv, call->argvlen);
			cmds[k].argc = call->argc;
			cmds[k].argv = call->argv;
			cmds[k].argvlen = call->argvlen;
			members[k++] = i;
		}
		if (rl_pipeline_send(conns[c], k, cmds, -1, &failure))
		{
			for (i = 0; i < k; i++)
				if (members[i] >= 0)
					calls[members[i]].sent = true;
			continue;
		}
		rl_route_failed(conns[c]);
		loading[c] = false;
		for (i = 0; i < k; i++)
		{
			if (members[i] < 0)
				continue;
			calls[members[i]].failure = failure;
			calls[members[i]].sent = rl_command_was_sent(conns[c]);
			again[members[i]] = !rl_command_was_sent(conns[c]) &&
				!rl_topology()->one_server;
			group[members[i]] = -1;
			failure.first_in_outage = false;
			failure.breaker_opened = false;
		}
	}

	for (c = 0; c < nconns; c++)
	{
		bool		lost = false;
		RlFailure	failure = {0};

		/* the library's load, when it was sent */
		if (loading[c])
		{
			redisReply *load = rl_pipeline_recv(conns[c], &failure);

			if (load == NULL)
			{
				rl_route_failed(conns[c]);
				lost = true;
			}
			else
			{
				(void) rl_library_load_noted(conns[c], load);
				freeReplyObject(load);
			}
		}
		for (i = 0; i < n; i++)
		{
			redisReply *reply;
			RlReplyError what;

			if (group[i] != c)
				continue;
			if (!lost)
				calls[i].reply = rl_pipeline_recv(conns[c], &failure);
			reply = calls[i].reply;
			if (reply == NULL)
			{
				/* written: it may have run, so it is never sent again */
				if (!lost)
					rl_route_failed(conns[c]);
				lost = true;
				calls[i].failure = failure;
				failure.first_in_outage = false;
				failure.breaker_opened = false;
				continue;
			}
			if (reply->type != REDIS_REPLY_ERROR)
				rl_conn_library_loaded(conns[c]);
			else if ((what = rl_classify_error(reply->str, rl_conn_host(conns[c]),
												NULL)) == RL_REPLY_NO_FUNCTION)
			{
				rl_conn_library_forget(conns[c]);
				no_function[i] = true;
			}
			else if (rl_error_not_run(what))
				again[i] = true;
		}
	}
	pfree(conns);
	pfree(group);
	pfree(cmds);
	pfree(members);
	pfree(loading);
}

/*
 * Runs n script calls, each on its key's node: the calls that go to one
 * connection are written in one pipeline and their replies read in order,
 * one connection after another, so that the batch costs about one round
 * trip per node. Each call's reply (the caller frees it; it may be an error
 * reply) or failure, and the connection it went to, are filled in.
 *
 * Calls that Redis did not run because it did not have the library (the
 * first calls on a server, a FUNCTION FLUSH, a restart) go again in one
 * more pipeline, the library sent first. Those it still did not run go as
 * the others below (their error is then the load's), unless the server
 * refused the library for good (rl_error_lasts): their "Function not
 * found" is their reply. Calls that it did not run for another reason (a
 * redirection, TRYAGAIN, READONLY) or that never left because their
 * connection could not be made (cluster and sentinel modes, where the
 * route may change) are sent once more one by one by rl_call, which
 * follows redirections, until command_timeout (2 s when none) after the
 * pipelines; after that they fail, with one warning. A call whose
 * connection was lost after it was written is never sent again.
 *
 * An interrupt raises its error from inside; the replies read until then
 * are in calls[], for the caller to free.
 */
void
rl_call_many(RlCall *calls, int n)
{
	int			timeout = rl_command_timeout > 0 ? rl_command_timeout : 2000;
	bool	   *todo = palloc(sizeof(bool) * Max(n, 1));
	bool	   *no_function = palloc0(sizeof(bool) * Max(n, 1));
	bool	   *again = palloc0(sizeof(bool) * Max(n, 1));
	bool		more = false;
	bool		warned = false;
	TimestampTz deadline;
	int			i;

	may_ask = true;
	/* keys on several masters: what the others' queues hold goes first */
	if (rl_topology()->hash_slots)
		rl_send_queued(NULL);
	for (i = 0; i < n; i++)
	{
		todo[i] = true;
		calls[i].reply = NULL;
	}
	rl_pipeline_pass(calls, n, todo, false, no_function, again);

	/* no library there: those calls once more, pipelined, behind it */
	for (i = 0; i < n; i++)
	{
		todo[i] = no_function[i] && rl_conn_library_may_load(calls[i].conn);
		if (todo[i])
		{
			freeReplyObject(calls[i].reply);
			calls[i].reply = NULL;
			more = true;
		}
		no_function[i] = false;
	}
	if (more)
		rl_pipeline_pass(calls, n, todo, true, no_function, again);
	/*
	 * still not found, the library not loaded for a reason that may pass (a
	 * replica, LOADING, OOM): one by one below, where the load's error is
	 * the reply; refused for good (an ACL without FUNCTION LOAD): "Function
	 * not found" is their reply
	 */
	for (i = 0; i < n; i++)
		again[i] = again[i] ||
			(no_function[i] && rl_conn_library_may_load(calls[i].conn));

	/* what did not run goes once more, one call at a time, while there is time */
	deadline = TimestampTzPlusMilliseconds(GetCurrentTimestamp(), timeout);
	for (i = 0; i < n; i++)
	{
		if (!again[i])
			continue;
		if (calls[i].reply != NULL)
		{
			freeReplyObject(calls[i].reply);
			calls[i].reply = NULL;
		}
		if (GetCurrentTimestamp() >= deadline)
		{
			rl_fail(&calls[i].failure, RL_FAILURE_TIMEOUT,
					ERRCODE_CONNECTION_FAILURE, RL_HINT_COMMAND_TIMEOUT, NULL,
					"timed out: Redis did not run a call of a batch within %d ms",
					timeout);
			calls[i].failure.first_in_outage = !warned;
			warned = true;
			continue;
		}
		calls[i].reply = rl_call(calls[i].key, calls[i].keylen, calls[i].script,
								 calls[i].argc, calls[i].argv, calls[i].argvlen,
								 &calls[i].conn, &calls[i].failure);
		calls[i].sent = calls[i].reply != NULL ||
			(calls[i].conn != NULL && rl_command_was_sent(calls[i].conn));
	}
	pfree(todo);
	pfree(no_function);
	pfree(again);
}
