/*
 * router.c
 *	  Which connection a key goes to, by rl_redis.mode, and calls that follow
 *	  Redis Cluster's redirections and a Sentinel failover.
 *
 * standalone: every key goes to the configured server (rl_redis.host,
 * rl_redis.port), as before there were modes.
 *
 * cluster: the slot map (CLUSTER SLOTS) is learnt from the seeds
 * (rl_redis.nodes, else host:port) and the nodes already known, and a key
 * goes to the master of its hash slot (CRC16 of the key or of its hash tag,
 * as Redis computes it). A MOVED reply updates the hash slot and asks for
 * a fresh map; an ASK reply sends ASKING and the call to the node named, the map
 * unchanged; TRYAGAIN and CLUSTERDOWN are retried with a growing pause
 * within rl_redis.command_timeout; a READONLY reply or a connection that
 * failed asks for a fresh map. A fresh map is fetched at most every
 * rl_redis.slot_map_refresh_interval.
 *
 * sentinel: the sentinels (rl_redis.nodes, else host:port) are asked in
 * order for the address of rl_redis.sentinel_master; the connection to it
 * checks with ROLE that it is the master before any command (connect.c).
 * A READONLY reply, a failed connection or a ROLE that is not master makes
 * the next call ask the sentinels again, and so does a call more than
 * rl_redis.sentinel_recheck_interval after they were last asked: after a
 * failover, the old master may take a while to learn that it is one no
 * more, and would take writes meanwhile.
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

/*
 * The most keys of a several-limits call sent through the shared queue:
 * its reply of (6 + 2 * keys) numbers fits RL_SHARED_REPLY_MAX.
 */
#define RL_SHARED_MANY_KEYS 64
StaticAssertDecl((6 + 2 * RL_SHARED_MANY_KEYS) * 23 + 16 <= RL_SHARED_REPLY_MAX,
				 "the reply of a several-limits call fits the shared queue");

/* the most distinct nodes a backend keeps (a lying server names more) */
#define RL_MAX_NODES 1024

/* the longest pause between two tries after TRYAGAIN or CLUSTERDOWN */
#define RL_MAX_BACKOFF_MS 200

/* A cluster node or a seed. */
typedef struct RlNode
{
	char		host[RL_ADDRESS_LEN];
	int			port;
	RlConn	   *conn;
} RlNode;

/* the nodes the slot map names (grows; in TopMemoryContext) */
static RlNode *nodes = NULL;
static int	nnodes = 0;
static int	maxnodes = 0;

/* hash slot -> index in nodes + 1 (0: no node known); NULL until needed */
static uint16 *slot_node = NULL;
static bool map_loaded = false;
static bool map_stale = false;
static TimestampTz map_fetched_at = 0;

/* sentinel mode: the master the sentinels named last */
static RlConn *master_conn = NULL;
static bool master_stale = false;
static TimestampTz master_checked_at = 0;
static int	sentinel_first = 0;		/* the seed that answered last */

/*
 * Whether the current rl_call may still fetch the slot map or ask the
 * sentinels (once per call, so that a call's waits stay bounded).
 */
static bool may_ask = true;

/* the last route failed: its next failure is no new outage (one warning) */
static bool route_outage = false;

/* the routing settings as last seen (see rl_router_settings) */
static uint64 settings_seen = 0;
static StringInfoData routing;

/* CRC16 (XMODEM) of Redis Cluster's key slots, one byte at a time. */
static uint16
rl_crc16(const char *buf, size_t len)
{
	uint16		crc = 0;
	size_t		i;
	int			bit;

	for (i = 0; i < len; i++)
	{
		crc ^= (uint16) ((unsigned char) buf[i]) << 8;
		for (bit = 0; bit < 8; bit++)
			crc = (crc & 0x8000) ? (uint16) ((crc << 1) ^ 0x1021) : (uint16) (crc << 1);
	}
	return crc;
}

/*
 * The hash slot of key, as Redis Cluster computes it: of the part between
 * the first '{' and the next '}' when that part is not empty, else of the
 * whole key.
 */
int
rl_key_hash_slot(const char *key, size_t len)
{
	const char *open = memchr(key, '{', len);

	if (open != NULL)
	{
		const char *close = memchr(open + 1, '}', key + len - open - 1);

		if (close != NULL && close > open + 1)
			return rl_crc16(open + 1, close - open - 1) & (RL_HASH_SLOTS - 1);
	}
	return rl_crc16(key, len) & (RL_HASH_SLOTS - 1);
}

/* Forgets the slot map and the master (the servers changed). */
static void
rl_router_forget(void)
{
	nnodes = 0;
	if (slot_node != NULL)
		memset(slot_node, 0, sizeof(uint16) * RL_HASH_SLOTS);
	map_loaded = false;
	map_stale = false;
	map_fetched_at = 0;
	master_conn = NULL;
	master_stale = false;
}

/*
 * Takes in a change of the routing settings (mode, and the seeds outside
 * standalone mode): what was known about the old servers is forgotten and
 * what their queues hold is dropped (rl_servers_changed). In standalone
 * mode rl_conn_get takes in a change of host or port itself.
 */
static void
rl_router_settings(void)
{
	StringInfoData now;

	if (settings_seen == rl_settings_version())
		return;
	settings_seen = rl_settings_version();
	initStringInfo(&now);
	appendStringInfo(&now, "%d", rl_mode);
	if (rl_mode != RL_MODE_STANDALONE && rl_nodes[0] != '\0')
		appendStringInfo(&now, "%c%s%c%s", 0, rl_nodes, 0, rl_sentinel_master);
	else if (rl_mode != RL_MODE_STANDALONE)
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
		rl_router_forget();
		resetStringInfo(&routing);
		appendBinaryStringInfo(&routing, now.data, now.len);
	}
	pfree(now.data);
}

/*
 * Fills seeds (RL_MAX_SEEDS entries) with rl_redis.nodes, or host and port
 * when it is empty; returns how many. The check hook made sure they parse.
 */
static int
rl_seeds(RlNode *seeds)
{
	const char *p = rl_nodes;
	int			n = 0;

	if (p == NULL || p[0] == '\0')
	{
		strlcpy(seeds[0].host, rl_host, RL_ADDRESS_LEN);
		seeds[0].port = rl_port;
		return 1;
	}
	while (n < RL_MAX_SEEDS)
	{
		const char *comma = strchr(p, ',');
		size_t		len = comma ? (size_t) (comma - p) : strlen(p);

		if (rl_parse_node(p, len, seeds[n].host, &seeds[n].port))
			n++;
		if (comma == NULL)
			break;
		p = comma + 1;
	}
	return n;
}

/*
 * Returns the index in nodes of the node at host and port, adding it; -1
 * when RL_MAX_NODES are known already.
 */
static int
rl_node_index(const char *host, int port)
{
	int			i;

	for (i = 0; i < nnodes; i++)
		if (nodes[i].port == port && strcmp(nodes[i].host, host) == 0)
			return i;
	if (nnodes >= RL_MAX_NODES)
		return -1;
	if (nnodes == maxnodes)
	{
		int			newmax = Max(16, maxnodes * 2);

		if (nodes == NULL)
			nodes = MemoryContextAlloc(TopMemoryContext, sizeof(RlNode) * newmax);
		else
			nodes = repalloc(nodes, sizeof(RlNode) * newmax);
		maxnodes = newmax;
	}
	strlcpy(nodes[nnodes].host, host, RL_ADDRESS_LEN);
	nodes[nnodes].port = port;
	nodes[nnodes].conn = rl_conn_at(host, port, RL_CONN_SERVER);
	return nnodes++;
}

/* True when reply is a string (bulk or status) or an integer. */
static bool
rl_reply_scalar(const redisReply *reply)
{
	return reply->type == REDIS_REPLY_STRING ||
		reply->type == REDIS_REPLY_STATUS || reply->type == REDIS_REPLY_INTEGER;
}

/* Returns a reply that rl_reply_scalar accepts as a number (-1 if not one). */
static long long
rl_reply_number(const redisReply *reply)
{
	char		buf[24];
	char	   *end;
	long long	v;

	if (reply->type == REDIS_REPLY_INTEGER)
		return reply->integer;
	if (reply->len == 0 || reply->len >= sizeof(buf))
		return -1;
	memcpy(buf, reply->str, reply->len);
	buf[reply->len] = '\0';
	v = strtoll(buf, &end, 10);
	return *end == '\0' ? v : -1;
}

/*
 * Reads a CLUSTER SLOTS reply from the node at asked_host into the slot
 * map; false when it is not one (the map is then left as it was). The
 * nodes of the old map that the new one does not name any more (a master
 * that failed, was demoted or left) hand what their queues hold to the new
 * master of their first slot: a MOVED puts each command right from there.
 */
static bool
rl_read_slots(redisReply *reply, const char *asked_host)
{
	uint16	   *map;
	int		   *first_slot;
	size_t		i;
	int			pass;
	int			old_nodes = nnodes;

	if (reply->type != REDIS_REPLY_ARRAY || reply->elements > RL_HASH_SLOTS)
		return false;
	map = palloc0(sizeof(uint16) * RL_HASH_SLOTS);
	/* pass 0 checks the whole reply, pass 1 adds its nodes */
	for (pass = 0; pass < 2; pass++)
		for (i = 0; i < reply->elements; i++)
		{
			redisReply *range = reply->element[i];
			redisReply *master;
			long long	from,
						to,
						port;
			char		host[RL_ADDRESS_LEN];
			int			index;

			if (range->type != REDIS_REPLY_ARRAY || range->elements < 3 ||
				range->element[0]->type != REDIS_REPLY_INTEGER ||
				range->element[1]->type != REDIS_REPLY_INTEGER ||
				range->element[2]->type != REDIS_REPLY_ARRAY ||
				range->element[2]->elements < 2)
				goto bad;
			master = range->element[2];
			if ((master->element[0]->type != REDIS_REPLY_STRING &&
				 master->element[0]->type != REDIS_REPLY_STATUS) ||
				!rl_reply_scalar(master->element[1]))
				goto bad;
			from = range->element[0]->integer;
			to = range->element[1]->integer;
			port = rl_reply_number(master->element[1]);
			if (from < 0 || to >= RL_HASH_SLOTS || from > to || port < 1 ||
				port > 65535 || master->element[0]->len >= RL_ADDRESS_LEN - 8)
				goto bad;
			/* an empty host is the node asked; "?" an unknown endpoint */
			if (master->element[0]->len == 0)
				strlcpy(host, asked_host, sizeof(host));
			else
				snprintf(host, sizeof(host), "%.*s", (int) master->element[0]->len,
						 master->element[0]->str);
			if (host[0] == '/')
				goto bad;		/* no socket of this machine */
			if (pass == 0 || strcmp(host, "?") == 0)
				continue;
			index = rl_node_index(host, (int) port);
			if (index < 0)
				goto bad;
			for (; from <= to; from++)
				map[from] = (uint16) (index + 1);
		}

	/* where the nodes that leave the map hand their queues */
	first_slot = palloc(sizeof(int) * Max(old_nodes, 1));
	for (i = 0; i < (size_t) old_nodes; i++)
		first_slot[i] = -1;
	for (i = RL_HASH_SLOTS; i-- > 0;)
		if (slot_node[i] != 0 && slot_node[i] <= old_nodes)
			first_slot[slot_node[i] - 1] = (int) i;
	for (i = 0; i < (size_t) old_nodes; i++)
	{
		int			slot = first_slot[i];

		if (slot >= 0 && map[slot] != 0 && map[slot] != i + 1)
		{
			int			k;

			for (k = 0; k < RL_HASH_SLOTS && map[k] != i + 1; k++)
				;
			if (k == RL_HASH_SLOTS)	/* no master any more */
				rl_conn_hand_over(nodes[i].conn, nodes[map[slot] - 1].conn);
		}
	}
	pfree(first_slot);

	/* keep only the nodes of the new map, in the order of their slots */
	{
		int		   *remap = palloc(sizeof(int) * nnodes);
		RlNode	   *kept = palloc(sizeof(RlNode) * Max(nnodes, 1));
		int			count = 0;

		for (i = 0; i < (size_t) nnodes; i++)
			remap[i] = -1;
		for (i = 0; i < RL_HASH_SLOTS; i++)
		{
			int			index = map[i] - 1;

			if (index < 0)
				continue;
			if (remap[index] < 0)
			{
				remap[index] = count;
				kept[count++] = nodes[index];
			}
			slot_node[i] = (uint16) (remap[index] + 1);
		}
		for (i = 0; i < RL_HASH_SLOTS; i++)
			if (map[i] == 0)
				slot_node[i] = 0;
		memcpy(nodes, kept, sizeof(RlNode) * count);
		nnodes = count;
		pfree(remap);
		pfree(kept);
	}
	pfree(map);
	return true;

bad:
	/* the nodes this reply added go with it */
	nnodes = old_nodes;
	pfree(map);
	return false;
}

/* True when some slot of the map is served by node index i. */
static bool
rl_node_serves(int i)
{
	int			slot;

	for (slot = 0; slot < RL_HASH_SLOTS; slot++)
		if (slot_node[slot] == i + 1)
			return true;
	return false;
}

/*
 * Fetches the slot map: asks the masters of the map known, then the seeds,
 * then the other nodes known, in turn, until one answers CLUSTER SLOTS, all
 * within connect_timeout. False, with the last failure, when
 * none does.
 */
static bool
rl_cluster_refresh(RlFailure *failure)
{
	RlNode		seeds[RL_MAX_SEEDS];
	int			nseeds = rl_seeds(seeds);
	int			known = nnodes;
	TimestampTz deadline = TimestampTzPlusMilliseconds(GetCurrentTimestamp(),
													   rl_connect_timeout);
	int			left;
	int			pass;
	int			i;

	if (slot_node == NULL)
		slot_node = MemoryContextAllocZero(TopMemoryContext,
										   sizeof(uint16) * RL_HASH_SLOTS);
	rl_fail(failure, RL_FAILURE_TOPOLOGY,
			ERRCODE_SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION, RL_HINT_NONE,
			NULL, "no Redis Cluster node to ask for the slot map");
	/* pass 0: masters known; 1: seeds; 2: the other nodes known */
	left = known + nseeds;
	for (pass = 0; pass < 3; pass++)
		for (i = 0; i < (pass == 1 ? nseeds : known); i++)
		{
			const char *argv[2] = {"CLUSTER", "SLOTS"};
			size_t		argvlen[2] = {7, 5};
			char		host[RL_ADDRESS_LEN];
			RlConn	   *conn;
			redisReply *reply;

			if (pass != 1 && rl_node_serves(i) != (pass == 0))
				continue;
			if (GetCurrentTimestamp() >= deadline)
				goto out;
			left--;
			if (pass == 1)
			{
				strlcpy(host, seeds[i].host, sizeof(host));
				conn = rl_conn_at(host, seeds[i].port, RL_CONN_SERVER);
			}
			else
			{
				strlcpy(host, nodes[i].host, sizeof(host));
				conn = nodes[i].conn;
			}
			/* each node left gets an equal share of what is left */
			reply = rl_command_within(conn, 2, argv, argvlen,
									  (int) Max(TimestampDifferenceMilliseconds(GetCurrentTimestamp(),
																				deadline) / (left + 1), 1),
									  failure);
			if (reply == NULL)
				continue;
			if (reply->type == REDIS_REPLY_ERROR)
			{
				rl_error_reply(conn, reply, failure);
				continue;
			}
			if (!rl_read_slots(reply, host))
			{
				freeReplyObject(reply);
				rl_fail(failure, RL_FAILURE_PROTOCOL, ERRCODE_PROTOCOL_VIOLATION,
						RL_HINT_NONE, NULL,
						"unexpected reply to CLUSTER SLOTS from Redis at %s",
						rl_conn_name(conn));
				continue;
			}
			freeReplyObject(reply);
			map_loaded = true;
			map_stale = false;
			map_fetched_at = GetCurrentTimestamp();
			return true;
		}
out:
	/* the next try waits as long as the breaker would */
	map_fetched_at = TimestampTzPlusMilliseconds(GetCurrentTimestamp(),
												 Max(rl_retry_interval, rl_slot_map_refresh_interval) -
												 rl_slot_map_refresh_interval);
	return false;
}

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
	RlNode		seeds[RL_MAX_SEEDS];
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

		/* each sentinel left gets an equal share of what is left */
		reply = rl_command_within(conn, 3, argv, argvlen,
								  (int) Max(TimestampDifferenceMilliseconds(GetCurrentTimestamp(),
																			deadline) / (nseeds - n), 1),
								  failure);
		if (reply == NULL)
			continue;
		if (reply->type == REDIS_REPLY_ERROR)
		{
			rl_error_reply(conn, reply, failure);
			continue;
		}
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
 * Returns the connection a call on key goes to (not necessarily open yet:
 * rl_command opens it), or NULL with failure filled in when it cannot be
 * known: no node answered for the slot map, no sentinel named the master,
 * no node serves the hash slot.
 */
RlConn *
rl_route(const char *key, size_t keylen, RlFailure *failure)
{
	RlConn	   *conn = NULL;

	rl_router_settings();
	if (rl_mode == RL_MODE_STANDALONE)
		return rl_conn_get();
	if (rl_mode == RL_MODE_SENTINEL)
	{
		/* a master not failed but not checked lately stays when none answers */
		if (may_ask &&
			(master_conn == NULL || master_stale ||
			 TimestampDifferenceExceeds(master_checked_at, GetCurrentTimestamp(),
										rl_sentinel_recheck_interval)))
		{
			may_ask = false;
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
			conn = master_conn;
	}
	else
	{
		if (may_ask && (!map_loaded || map_stale) &&
			GetCurrentTimestamp() >= TimestampTzPlusMilliseconds(map_fetched_at,
																 rl_slot_map_refresh_interval))
		{
			may_ask = false;
			(void) rl_cluster_refresh(failure);
		}
		if (!map_loaded)
		{
			rl_fail(failure, RL_FAILURE_TOPOLOGY,
					ERRCODE_SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION,
					RL_HINT_NONE, NULL,
					"the slot map of the Redis Cluster is not known");
		}
		else
		{
			int			slot = rl_key_hash_slot(key, keylen);

			if (slot_node[slot] != 0)
				conn = nodes[slot_node[slot] - 1].conn;
			else
			{
				map_stale = true;
				rl_fail(failure, RL_FAILURE_TOPOLOGY,
						ERRCODE_CONNECTION_FAILURE, RL_HINT_NONE, NULL,
						"no Redis Cluster node serves hash slot %d", slot);
			}
		}
	}
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
	if (rl_mode == RL_MODE_STANDALONE)
		return rl_conn_current();
	if (rl_mode == RL_MODE_SENTINEL)
		return master_conn;
	if (slot_node == NULL || slot_node[rl_key_hash_slot(key, keylen)] == 0)
		return NULL;
	return nodes[slot_node[rl_key_hash_slot(key, keylen)] - 1].conn;
}

/*
 * The hash slot of key in cluster mode, else 0: the keys of one call must
 * share it.
 */
int
rl_route_hash_slot(const char *key, size_t keylen)
{
	return rl_mode == RL_MODE_CLUSTER ? rl_key_hash_slot(key, keylen) : 0;
}

/*
 * Fills *conns (palloc'd) with every master a call may go to: in cluster
 * mode each node of the slot map, else the one route. Returns how many, or
 * -1 with failure filled in.
 */
int
rl_route_all(RlConn ***conns, RlFailure *failure)
{
	int			n = 0;
	int			i;

	may_ask = true;
	if (rl_mode != RL_MODE_CLUSTER)
	{
		RlConn	   *conn = rl_route("", 0, failure);

		if (conn == NULL)
			return -1;
		*conns = palloc(sizeof(RlConn *));
		(*conns)[0] = conn;
		return 1;
	}
	rl_router_settings();
	if (!rl_cluster_refresh(failure) && !map_loaded)
		return -1;
	*conns = palloc(sizeof(RlConn *) * Max(nnodes, 1));
	for (i = 0; i < nnodes; i++)
		if (rl_node_serves(i))
			(*conns)[n++] = nodes[i].conn;
	if (n == 0)
	{
		rl_fail(failure, RL_FAILURE_TOPOLOGY, ERRCODE_CONNECTION_FAILURE,
				RL_HINT_NONE, NULL,
				"no Redis Cluster node serves any hash slot");
		return -1;
	}
	return n;
}

/*
 * The connection conn failed or refused a write: the map or the master may
 * have changed, so the next route asks again.
 */
static void
rl_route_failed(RlConn *conn)
{
	if (rl_mode == RL_MODE_CLUSTER)
		map_stale = true;
	else if (rl_mode == RL_MODE_SENTINEL && conn == master_conn)
	{
		master_stale = true;
		rl_conn_close(conn);	/* its next connection checks ROLE again */
	}
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
 * True when the reply of script, called with argv, surely fits an entry of
 * the shared queue (RL_SHARED_REPLY_MAX bytes), which the worker can only
 * learn once the call has run: the scripts of one decision, of a
 * concurrency slot and of a denial count, and the several-limits script of
 * at most RL_SHARED_MANY_KEYS keys (6 + 2 numbers per key, 23 bytes at
 * most each). The others (a statement guard over many keys,
 * rl_top_denied) go on the session's own connection.
 */
static bool
rl_shared_reply_fits(const RlScript *script, const char **argv)
{
	if (script->id < RL_NUM_ALGORITHMS || script == &rl_script_concurrency ||
		script == &rl_script_denial_note)
		return true;
	return script == &rl_script_check_all &&
		atoi(argv[RL_SCRIPT_ARGV_RESERVED]) <= RL_SHARED_MANY_KEYS;
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
	RlConn	   *ask = NULL;
	RlConn	   *moved = NULL;
	int			tries = 0;
	long		backoff = 10;
	int			timeout = rl_command_timeout > 0 ? rl_command_timeout : 2000;
	TimestampTz deadline = TimestampTzPlusMilliseconds(GetCurrentTimestamp(),
													   timeout);

	may_ask = true;
	if (rl_mode == RL_MODE_CLUSTER)
		rl_send_queued(NULL);

	/*
	 * rl_redis.transport = shared: through the worker, unless this
	 * session's own connection has transaction-end work to send first.
	 */
	if (script != NULL && rl_transport == RL_TRANSPORT_SHARED &&
		rl_mode == RL_MODE_STANDALONE && rl_shared_reply_fits(script, argv))
	{
		RlConn	   *own = rl_conn_get();
		bool		used = false;
		redisReply *reply = NULL;

		if (!rl_conn_has_queued(own))
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
		RlConn	   *conn = ask ? ask : moved ? moved : rl_route(key, keylen, failure);
		redisReply *reply;
		RlRedirect	to;
		RlReplyError what;
		int			index;

		*connp = conn;
		if (conn == NULL)
			return NULL;
		if (ask != NULL && script != NULL)
			reply = rl_run_script_asking(conn, script, argc, argv, argvlen, failure);
		else if (ask != NULL)
		{
			if (rl_asking(conn, &reply, failure))
				reply = rl_command(conn, argc, argv, argvlen, failure);
		}
		else if (script != NULL)
			reply = rl_run_script(conn, script, argc, argv, argvlen, failure);
		else
			reply = rl_command(conn, argc, argv, argvlen, failure);
		ask = NULL;
		moved = NULL;
		if (rl_mode == RL_MODE_STANDALONE || ++tries > RL_MAX_REDIRECTS)
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

		what = rl_classify_error(reply->str, rl_conn_host(conn), &to);
		if (rl_mode == RL_MODE_CLUSTER && what == RL_REPLY_MOVED &&
			(index = rl_node_index(to.host, to.port)) >= 0)
		{
			slot_node[to.hash_slot] = (uint16) (index + 1);
			moved = nodes[index].conn;
			map_stale = true;
		}
		else if (rl_mode == RL_MODE_CLUSTER && what == RL_REPLY_ASK &&
				 (index = rl_node_index(to.host, to.port)) >= 0)
			ask = nodes[index].conn;
		else if (rl_mode == RL_MODE_CLUSTER &&
				 (what == RL_REPLY_TRYAGAIN || what == RL_REPLY_CLUSTERDOWN))
		{
			long		left = TimestampDifferenceMilliseconds(GetCurrentTimestamp(),
															   deadline);

			if (left <= 0)
				return reply;
			if (what == RL_REPLY_CLUSTERDOWN)
				map_stale = true;
			freeReplyObject(reply);
			rl_pause(Min(backoff, left));
			backoff = Min(backoff * 2, RL_MAX_BACKOFF_MS);
			tries--;			/* bounded by the deadline instead */
			continue;
		}
		else if (what == RL_REPLY_READONLY)
			rl_route_failed(conn);
		else
			return reply;
		freeReplyObject(reply);
	}
}

/*
 * Sends the calls todo[i] of a batch, one pipeline per connection, all
 * written before any is read, and reads their replies in order. The first
 * call of each script the connection may not know goes as EVAL (which
 * loads it), the others as EVALSHA. Fills each call's reply or failure and
 * sets noscript[i] when Redis did not know the script after all (it was
 * flushed: the call did not run; the connection forgets the script) and
 * again[i] when the call did not run for another reason that a new route
 * may cure (a redirection, TRYAGAIN, READONLY, a connection that could
 * not be made in cluster or sentinel mode). A connection's failure is
 * given to the first of its calls, and to the others without
 * first_in_outage and breaker_opened: warned of and counted once.
 */
static void
rl_pipeline_pass(RlCall *calls, int n, const bool *todo, bool *noscript,
				 bool *again)
{
	RlConn	  **conns = palloc(sizeof(RlConn *) * Max(n, 1));
	int		   *group = palloc(sizeof(int) * Max(n, 1));
	RlCommand  *cmds = palloc(sizeof(RlCommand) * Max(n, 1));
	int		   *members = palloc(sizeof(int) * Max(n, 1));
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
		uint32		evaled = 0;
		int			k = 0;
		RlFailure	failure = {0};

		for (i = 0; i < n; i++)
		{
			RlCall	   *call = &calls[i];
			uint32		bit = (uint32) 1 << call->script->id;

			if (group[i] != c)
				continue;
			if (!(evaled & bit) && !rl_conn_script_known(conns[c], call->script->id))
			{
				call->argv[0] = "EVAL";
				call->argvlen[0] = 4;
				call->argv[1] = call->script->body;
				call->argvlen[1] = strlen(call->script->body);
				evaled |= bit;
			}
			else
			{
				call->argv[0] = "EVALSHA";
				call->argvlen[0] = 7;
				call->argv[1] = call->script->sha;
				call->argvlen[1] = 40;
			}
			cmds[k].argc = call->argc;
			cmds[k].argv = call->argv;
			cmds[k].argvlen = call->argvlen;
			members[k++] = i;
		}
		if (rl_pipeline_send(conns[c], k, cmds, -1, &failure))
		{
			for (i = 0; i < k; i++)
				calls[members[i]].sent = true;
			continue;
		}
		if (rl_mode != RL_MODE_STANDALONE)
			rl_route_failed(conns[c]);
		for (i = 0; i < k; i++)
		{
			calls[members[i]].failure = failure;
			calls[members[i]].sent = rl_command_was_sent(conns[c]);
			again[members[i]] = !rl_command_was_sent(conns[c]) &&
				rl_mode != RL_MODE_STANDALONE;
			group[members[i]] = -1;
			failure.first_in_outage = false;
			failure.breaker_opened = false;
		}
	}

	for (c = 0; c < nconns; c++)
	{
		bool		lost = false;
		RlFailure	failure = {0};

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
				if (!lost && rl_mode != RL_MODE_STANDALONE)
					rl_route_failed(conns[c]);
				lost = true;
				calls[i].failure = failure;
				failure.first_in_outage = false;
				failure.breaker_opened = false;
				continue;
			}
			if (reply->type != REDIS_REPLY_ERROR)
				rl_conn_script_loaded(conns[c], calls[i].script->id);
			else if ((what = rl_classify_error(reply->str, rl_conn_host(conns[c]),
												NULL)) == RL_REPLY_NOSCRIPT)
			{
				rl_conn_script_forget(conns[c], calls[i].script->id);
				noscript[i] = true;
			}
			else if (rl_error_not_run(what))
				again[i] = true;
		}
	}
	pfree(conns);
	pfree(group);
	pfree(cmds);
	pfree(members);
}

/*
 * Runs n script calls, each on its key's node: the calls that go to one
 * connection are written in one pipeline and their replies read in order,
 * one connection after another, so that the batch costs about one round
 * trip per node. Each call's reply (the caller frees it; it may be an error
 * reply) or failure, and the connection it went to, are filled in.
 *
 * Calls that Redis did not run because it did not know their script (a
 * SCRIPT FLUSH, a restart) go again in one more pipeline, their scripts
 * sent first. Calls that it did not run for another reason (a
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
	bool	   *noscript = palloc0(sizeof(bool) * Max(n, 1));
	bool	   *again = palloc0(sizeof(bool) * Max(n, 1));
	bool		more = false;
	bool		warned = false;
	TimestampTz deadline;
	int			i;

	may_ask = true;
	if (rl_mode == RL_MODE_CLUSTER)
		rl_send_queued(NULL);
	for (i = 0; i < n; i++)
	{
		todo[i] = true;
		calls[i].reply = NULL;
	}
	rl_pipeline_pass(calls, n, todo, noscript, again);

	/* scripts flushed meanwhile: those calls once more, pipelined */
	for (i = 0; i < n; i++)
	{
		todo[i] = noscript[i];
		if (noscript[i])
		{
			freeReplyObject(calls[i].reply);
			calls[i].reply = NULL;
			more = true;
		}
		noscript[i] = false;
	}
	if (more)
		rl_pipeline_pass(calls, n, todo, noscript, again);

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
	pfree(noscript);
	pfree(again);
}
