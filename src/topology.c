/*
 * topology.c
 *	  The three topologies of rl_redis.mode (standalone, cluster, sentinel)
 *	  as data (RlTopology), and what each makes of an error reply, in one
 *	  table.
 *
 * rl_topology is the one reader of rl_redis.mode. A topology here is data
 * that any file may read: whether keys are placed by hash slot, whether
 * the one configured server serves every key (then the shared worker may
 * serve it too), and what an error reply means for a call
 * (rl_reply_action): rl_classify_error (resp.c) names the error, this
 * table says what follows. Where a key goes, every master, what to do when
 * a connection failed and where a redirection sends a call are each
 * topology's RlRoutes, in standalone.c, cluster.c and sentinel.c, listed
 * below this file in rl_redis.h; only router.c calls them.
 */
#include "postgres.h"

#include "rl_redis.h"

/*
 * The topologies, by rl_redis.mode. A class of error reply that a
 * topology does not name here is given back as the call's reply.
 */
const RlTopology rl_topologies[RL_NUM_MODES] = {
	[RL_MODE_STANDALONE] = {
		.name = "standalone",
		.mode = RL_MODE_STANDALONE,
		.one_server = true
	},
	[RL_MODE_CLUSTER] = {
		.name = "cluster",
		.mode = RL_MODE_CLUSTER,
		.hash_slots = true,
		.on_error = {
			[RL_REPLY_MOVED] = RL_ACTION_MOVED,
			[RL_REPLY_ASK] = RL_ACTION_ASK,
			[RL_REPLY_TRYAGAIN] = RL_ACTION_LATER,
			[RL_REPLY_CLUSTERDOWN] = RL_ACTION_LATER_FRESH,
			[RL_REPLY_READONLY] = RL_ACTION_FRESH
		}
	},
	[RL_MODE_SENTINEL] = {
		.name = "sentinel",
		.mode = RL_MODE_SENTINEL,
		.on_error = {
			[RL_REPLY_READONLY] = RL_ACTION_FRESH
		}
	}
};

/* The topology rl_redis.mode names. */
const RlTopology *
rl_topology(void)
{
	return &rl_topologies[rl_mode];
}

/* What the current topology does with an error reply of class what. */
RlReplyAction
rl_reply_action(RlReplyError what)
{
	return rl_topology()->on_error[what];
}
