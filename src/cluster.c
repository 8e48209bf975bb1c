/*
 * cluster.c
 *	  Redis Cluster (rl_redis.mode = cluster): the slot map and where a key
 *	  goes in it.
 *
 * The slot map (CLUSTER SLOTS) is learnt from the seeds (rl_redis.nodes,
 * else host:port) and the nodes already known, and a key goes to the
 * master of its hash slot (CRC16 of the key or of its hash tag, as Redis
 * computes it). A MOVED reply updates the hash slot and asks for a fresh
 * map; an ASK reply sends ASKING and the call to the node named, the map
 * unchanged (rl_cluster_redirect); a CLUSTERDOWN or READONLY reply or a
 * connection that failed asks for a fresh map (rl_cluster_failed). A fresh
 * map is fetched at most every rl_redis.slot_map_refresh_interval, and at
 * most once per call. What each error reply means here is topology.c's
 * table; router.c follows it.
 */
#include "postgres.h"

#include "utils/memutils.h"
#include "utils/timestamp.h"

#include "rl_redis.h"


/* A cluster node. */
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

/*
 * Returns the index in nodes of the node at host and port, adding it; -1
 * when RL_MAX_NODES are known already (or RL_MAX_CONNECTIONS).
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
	nodes[nnodes].conn = rl_conn_at(host, port, RL_CONN_SERVER);
	if (nodes[nnodes].conn == NULL)
		return -1;
	strlcpy(nodes[nnodes].host, host, RL_ADDRESS_LEN);
	nodes[nnodes].port = port;
	return nnodes++;
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
	RlSeed		seeds[RL_MAX_SEEDS];
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
				if (conn == NULL)
					continue;
			}
			else
			{
				strlcpy(host, nodes[i].host, sizeof(host));
				conn = nodes[i].conn;
			}
			/* each node left gets an equal share of what is left */
			reply = rl_command_share(conn, 2, argv, argvlen, deadline,
									 left + 1, failure);
			if (reply == NULL)
				continue;
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
 * Returns the master of key's hash slot, fetching the slot map first when
 * it is not known or stale and *may_ask (which it then clears); NULL with
 * failure filled in when the map is not known or names no node for the
 * slot.
 */
static RlConn *
rl_cluster_route(const char *key, size_t keylen, bool *may_ask,
				 RlFailure *failure)
{
	int			slot;

	if (*may_ask && (!map_loaded || map_stale) &&
		GetCurrentTimestamp() >= TimestampTzPlusMilliseconds(map_fetched_at,
															 rl_slot_map_refresh_interval))
	{
		*may_ask = false;
		(void) rl_cluster_refresh(failure);
	}
	if (!map_loaded)
	{
		rl_fail(failure, RL_FAILURE_TOPOLOGY,
				ERRCODE_SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION,
				RL_HINT_NONE, NULL,
				"the slot map of the Redis Cluster is not known");
		return NULL;
	}
	slot = rl_key_hash_slot(key, keylen);
	if (slot_node[slot] != 0)
		return nodes[slot_node[slot] - 1].conn;
	map_stale = true;
	rl_fail(failure, RL_FAILURE_TOPOLOGY,
			ERRCODE_CONNECTION_FAILURE, RL_HINT_NONE, NULL,
			"no Redis Cluster node serves hash slot %d", slot);
	return NULL;
}

/* The master of key's hash slot in the map known, else NULL; no I/O. */
static RlConn *
rl_cluster_known(const char *key, size_t keylen)
{
	if (slot_node == NULL || slot_node[rl_key_hash_slot(key, keylen)] == 0)
		return NULL;
	return nodes[slot_node[rl_key_hash_slot(key, keylen)] - 1].conn;
}

/*
 * Fetches the slot map and fills *conns (palloc'd) with each node that
 * serves a hash slot in it. Returns how many, or -1 with failure filled
 * in.
 */
static int
rl_cluster_masters(RlConn ***conns, RlFailure *failure)
{
	int			n = 0;
	int			i;

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

/* A connection failed, or a node refused: the next route fetches the map. */
static void
rl_cluster_failed(RlConn *conn)
{
	map_stale = true;
}

/*
 * Returns the connection of the node a MOVED (moved) or ASK reply names,
 * or NULL when RL_MAX_NODES are known already. MOVED also gives the hash
 * slot to that node and asks for a fresh map.
 */
static RlConn *
rl_cluster_redirect(const RlRedirect *to, bool moved)
{
	int			index = rl_node_index(to->host, to->port);

	if (index < 0)
		return NULL;
	if (moved)
	{
		slot_node[to->hash_slot] = (uint16) (index + 1);
		map_stale = true;
	}
	return nodes[index].conn;
}

/* Forgets the slot map (the servers changed). */
static void
rl_cluster_forget(void)
{
	nnodes = 0;
	if (slot_node != NULL)
		memset(slot_node, 0, sizeof(uint16) * RL_HASH_SLOTS);
	map_loaded = false;
	map_stale = false;
	map_fetched_at = 0;
}

/* How this topology routes a call (router.c). */
const RlRoutes rl_cluster_routes = {
	.route = rl_cluster_route,
	.known = rl_cluster_known,
	.masters = rl_cluster_masters,
	.failed = rl_cluster_failed,
	.redirect = rl_cluster_redirect,
	.forget = rl_cluster_forget
};
