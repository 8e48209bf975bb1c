/*
 * rl_redis.h
 *	  Declarations shared by the files of the rl_redis extension.
 *
 * The files, each calling only files listed above it (no circle):
 *
 * src/algorithms.h   the table of algorithms, one line each, read by the C
 *                    files and by src/embed_lua.sh
 * src/registry.c     the algorithms (rl_algorithms) and the Lua scripts
 *                    compiled in, as scripts and as one function library;
 *                    found by id or text
 * src/guc.c          the rl_redis.* settings, and the seeds they name
 *                    (rl_seeds)
 * src/checks.c       the one argument checker: an identity's bound
 *                    (rl_check_identity), a limit's numbers
 *                    (rl_check_limit), a cost, a window, not null
 * src/keys.c         the one format of the keys in Redis: built, parsed,
 *                    matched (rl_build_key, rl_parse_key, rl_key_of)
 * src/stats.c        counters of the decisions per database and policy
 *                    (shared memory when preloaded) and their SQL functions
 * src/denycache.c    the local cache of denials (rl_redis.deny_cache)
 * src/failure.c      what a failed call reports: one filler (rl_fail), one
 *                    report (rl_report: DETAIL, HINT, the call's CONTEXT)
 * src/breaker.c      the circuit breaker of one connection
 * src/tls.c          TLS of one connection (OpenSSL, never waits itself)
 *
 * The transport: the connections to Redis. RlConn is opaque outside these
 * files; all but shared_queue.c (which needs no more) include
 * src/conn_internal.h, where struct RlConn is:
 * src/resp.c         the Redis protocol: a command encoded (RESP), the
 *                    ASKING command, and what an error reply means
 *                    (rl_classify_error, one table; the target of MOVED and
 *                    ASK); a reply's number
 * src/topology.c     the three topologies of rl_redis.mode as data any
 *                    file may read (RlTopology) and the one reader of the
 *                    mode (rl_topology); what each does with an error reply
 *                    (rl_reply_action, one table). How each routes a call
 *                    (RlRoutes) is in standalone.c, cluster.c and
 *                    sentinel.c below; only router.c calls it
 * src/queue.c        the transaction-end queue of one connection: what
 *                    waits, was written, is confirmed or dropped (no I/O)
 * src/conn.c         the per-backend cache of connections (RlConn, by
 *                    server address and kind), their settings and accessors
 * src/shared_queue.c the entries in shared memory between the sessions and
 *                    the worker (rl_redis.transport = shared); which
 *                    transport carries a call, the worker or the session's
 *                    own connection (rl_worker_takes), and the size of
 *                    transaction-end work it may carry
 *                    (rl_worker_request_max): no other file reads
 *                    rl_redis.transport or an entry's size
 * src/io.c           a connection's waits (latch and socket), socket and
 *                    TLS reads and writes, a reply parsed
 * src/connect.c      opening a connection: resolve, open, TLS, handshake
 * src/idle.c         closing idle connections (rl_redis.idle_timeout, the
 *                    worker's idle timeout)
 * src/xact_queue.c   sending the queues at a transaction end, before the
 *                    next command and at exit; redirections of queued work
 *                    (rl_reply_action); the hand-over to the worker
 * src/command.c      a command or a pipeline on one connection (after the
 *                    work its transaction ends left), ASKING, a Redis error
 *                    reply as a failure
 *
 * src/scripts.c      running a script on a connection (FCALL, the library
 *                    loaded when Redis lacks it; EVAL), the scripts'
 *                    shared arguments
 * src/standalone.c   the standalone topology's routes: the one configured
 *                    server
 * src/cluster.c      the cluster topology's routes: the slot map (CRC16,
 *                    CLUSTER SLOTS, the node table, its refresh), a
 *                    redirection's node
 * src/sentinel.c     the sentinel topology's routes: the master the
 *                    sentinels name
 * src/router.c       where a key goes, as the current topology says, and
 *                    the calls that follow what an error reply means there
 *                    (MOVED, ASK, TRYAGAIN, READONLY); batches of calls
 *                    pipelined per node
 * src/worker.c       the rl_redis worker: sends the calls and the
 *                    transaction-end work of the shared queue's entries
 * src/refund.c       giving back what an aborted (sub)transaction took
 * src/denials.c      who is being throttled: denials per identity and
 *                    minute in Redis (rl_redis.track_denials), rl_top_denied
 * src/decision.c     a script's decision reply read (rl_parse_decision),
 *                    and what rl_redis.on_error decides without one
 * src/slots.c        the concurrency slots a backend holds: taken, given
 *                    back early, or when their (sub)transaction ends
 * src/engine.c       the one entry point of every charge (rl_decide):
 *                    charges checked (checks.c), keys, script calls,
 *                    rl_result; a several-keys call is split per Cluster
 *                    hash slot; batch decisions; a slot taken (slots.c)
 * src/policy.c       named policies (rl_policy) and several limits at once
 * src/concurrency.c  the SQL functions of concurrency limits
 * src/guard.c        trigger functions that rate-limit writes
 * src/functions.c    the SQL functions of explicit limits, rl_reset and
 *                    rl_redis_ping
 * src/xact_end.c     the one transaction callback: at the end of a
 *                    (sub)transaction, refunds and slot releases are queued,
 *                    then the queues are sent, in that order
 * src/rl_redis.c     the module entry point
 */
#ifndef RL_REDIS_H
#define RL_REDIS_H

#include "postgres.h"

#include <hiredis/hiredis.h>

#include "access/xact.h"
#include "fmgr.h"
#include "lib/stringinfo.h"
#include "miscadmin.h"
#include "nodes/pg_list.h"
#include "utils/memutils.h"
#include "utils/relcache.h"
#include "utils/timestamp.h"

#include "compat.h"

/* a reused buffer larger than this is given back after use */
#define RL_KEEP_BUFFER (64 * 1024)

/* rl_redis.on_error */
typedef enum RlOnError
{
	RL_ON_ERROR_ERROR,
	RL_ON_ERROR_ALLOW,
	RL_ON_ERROR_DENY
} RlOnError;

/* rl_redis.mode */
typedef enum RlMode
{
	RL_MODE_STANDALONE,
	RL_MODE_CLUSTER,
	RL_MODE_SENTINEL,
	RL_NUM_MODES
} RlMode;

/* rl_redis.transport */
typedef enum RlTransport
{
	RL_TRANSPORT_BACKEND,
	RL_TRANSPORT_SHARED
} RlTransport;

/* rl_redis.refund_on_abort */
typedef enum RlRefundOnAbort
{
	RL_REFUND_OFF,
	RL_REFUND_GUARDS,
	RL_REFUND_ALL
} RlRefundOnAbort;

/*
 * What to put back after catching an error at a transaction end, where
 * interrupts are held: raising an ERROR clears the hold-off counts and
 * leaves ErrorContext current. Used as
 *   rl_hold_save(&held); PG_TRY(); ... PG_CATCH(); rl_hold_restore(&held);
 */
typedef struct RlHold
{
	MemoryContext cxt;
	uint32		interrupt_holdoff;
	uint32		cancel_holdoff;
} RlHold;

/* Remembers the state rl_hold_restore puts back. */
static inline void
rl_hold_save(RlHold *hold)
{
	hold->cxt = CurrentMemoryContext;
	hold->interrupt_holdoff = InterruptHoldoffCount;
	hold->cancel_holdoff = QueryCancelHoldoffCount;
}

/* Forgets a caught error and puts the saved state back. */
static inline void
rl_hold_restore(const RlHold *hold)
{
	MemoryContextSwitchTo(hold->cxt);
	FlushErrorState();
	InterruptHoldoffCount = hold->interrupt_holdoff;
	QueryCancelHoldoffCount = hold->cancel_holdoff;
}

/* settings (guc.c) */
extern char *rl_host;
extern int	rl_port;
extern char *rl_username;
extern char *rl_password;
extern char *rl_password_file;
extern int	rl_database;
extern int	rl_connect_timeout;
extern int	rl_command_timeout;
extern int	rl_retry_interval;
extern int	rl_idle_timeout;
extern char *rl_key_prefix;
extern int	rl_on_error;
extern int	rl_refund_on_abort;
extern double rl_test_clock_ms;
extern int	rl_xact_end_budget;
extern int	rl_worker_restart_interval;
extern int	rl_sentinel_recheck_interval;
extern int	rl_slot_map_refresh_interval;
extern int	rl_max_lease;
extern int	rl_sliding_max_lim;
extern int	rl_max_identity_bytes;
extern bool rl_tls;
extern bool rl_stats;
extern bool rl_track_denials;
extern bool rl_deny_cache;
extern int	rl_transport;
extern int	rl_shared_queue_size;
extern char *rl_tls_ca_file;
extern char *rl_tls_cert_file;
extern char *rl_tls_key_file;
extern char *rl_tls_server_name;
extern int	rl_mode;
extern char *rl_nodes;
extern char *rl_sentinel_master;
extern char *rl_sentinel_password;
extern bool rl_connection_settings_changed;

/* the longest server address: "host:port" or a socket path */
#define RL_ADDRESS_LEN 300

/* the most host:port items rl_redis.nodes may name */
#define RL_MAX_SEEDS 64

/* the most distinct nodes a backend keeps (a lying server names more) */
#define RL_MAX_NODES 1024

/*
 * The most connections a backend keeps (rl_conn_at): every cluster node,
 * seed and sentinel, and 128 more for the configured server, the masters
 * the sentinels named and the nodes redirections named besides.
 */
#define RL_MAX_CONNECTIONS (RL_MAX_NODES + 2 * RL_MAX_SEEDS + 128)

/* the number of hash slots of Redis Cluster */
#define RL_HASH_SLOTS 16384

/* advice for the HINT of a failure (rl_failure_hint); 0: none */
typedef enum RlHint
{
	RL_HINT_NONE = 0,
	RL_HINT_PRELOAD,			/* a password setting needs preloading */
	RL_HINT_PRELOAD_OR_FILE,	/* the same, or rl_redis.password_file */
	RL_HINT_SERVER,				/* no server there: rl_redis.host, port */
	RL_HINT_PASSWORD,			/* Redis wants rl_redis.password */
	RL_HINT_SENTINEL_PASSWORD,	/* a sentinel wants its password */
	RL_HINT_CONNECT_TIMEOUT,	/* rl_redis.connect_timeout passed */
	RL_HINT_COMMAND_TIMEOUT,	/* rl_redis.command_timeout passed */
	RL_HINT_LIBRARY				/* Redis lacks the library, may not load it */
} RlHint;

extern void rl_define_gucs(void);
extern bool rl_read_password(bool sentinel, bool log, char *buf, size_t size,
							 char *err, size_t errsize, RlHint *hint);
extern bool rl_parse_node(const char *s, size_t len, char *host, int *port);
extern bool rl_parse_redirect_node(const char *s, const char *default_host,
								   char *host, int *port);

/* A seed: a server rl_redis.nodes (or host and port) names. */
typedef struct RlSeed
{
	char		host[RL_ADDRESS_LEN];
	int			port;
} RlSeed;

extern int	rl_seeds(RlSeed *seeds);

/* What went wrong in a failed Redis call, for operators and statistics. */
typedef enum RlFailureKind
{
	RL_FAILURE_CONNECTION,		/* could not connect, or the connection broke */
	RL_FAILURE_TIMEOUT,			/* no connection or no reply in time */
	RL_FAILURE_AUTH,			/* Redis refused or wants a password */
	RL_FAILURE_REPLY,			/* Redis answered with an error */
	RL_FAILURE_PROTOCOL,		/* a reply that is not what was asked for */
	RL_FAILURE_TOPOLOGY,		/* no cluster node or master for the key */
	RL_FAILURE_CONFIG,			/* a setting or file that cannot be used */
	RL_FAILURE_WORKER			/* the rl_redis worker (transport = shared) */
} RlFailureKind;

/*
 * Why a Redis call failed, for the caller to raise as an error or to log as
 * a warning under rl_redis.on_error (rl_report): filled in by rl_fail only
 * (rl_fail_as changes its SQLSTATE).
 * message is the primary message (ours), detail what Redis, the system or
 * OpenSSL said (or ""). Neither holds a secret or a file's path. The
 * connection has already been discarded when one of these is filled in.
 */
typedef struct RlFailure
{
	RlFailureKind kind;
	int			sqlerrcode;		/* 0: no failure (a reason in message) */
	bool		first_in_outage;	/* the failure that began an outage */
	bool		breaker_opened; /* it opened the circuit breaker */
	bool		held_back;		/* the breaker's: Redis was not asked */
	RlHint		hint;
	char		message[256];
	char		detail[512];
} RlFailure;

/* what a failed call reports (failure.c) */
extern void rl_fail(RlFailure *failure, RlFailureKind kind, int sqlerrcode,
					RlHint hint, const char *detail, const char *fmt,...)
			pg_attribute_printf(6, 7);
extern void rl_vfail(RlFailure *failure, RlFailureKind kind, int sqlerrcode,
					 RlHint hint, const char *detail, const char *fmt,
					 va_list ap) pg_attribute_printf(6, 0);
extern void rl_fail_as(RlFailure *failure, int sqlerrcode);
extern const char *rl_failure_text(const RlFailure *failure, char *buf,
								   size_t size);

extern int	rl_failure_hint(const RlFailure *failure);
extern void rl_report(int elevel, const RlFailure *failure,
					  const char *outcome);
extern void rl_raise(const RlFailure *failure);

/*
 * Which Redis call errors and warnings are about, for their CONTEXT: set
 * up by rl_context_push around the call and its report.
 */
typedef struct RlCallContext
{
	const char *what;			/* "decision", "refund", ... */
	const char *name;			/* the algorithm, or NULL */
	const char *key;			/* the call's (first) key */
	size_t		keylen;
	int			others;			/* how many more keys the call has */
	ErrorContextCallback callback;
} RlCallContext;

extern void rl_context_push(RlCallContext *ctx, const char *what,
							const char *name, const char *key, size_t keylen,
							int others);
extern void rl_context_pop(RlCallContext *ctx);

/* the circuit breaker of one connection (breaker.c) */
typedef struct RlBreaker
{
	TimestampTz outage_start;	/* 0: Redis answered last time */
	TimestampTz last_failure_at;
	RlFailure	last_failure;
} RlBreaker;

extern bool rl_breaker_open(RlBreaker *b, RlFailure *failure);
extern void rl_breaker_failed(RlBreaker *b, RlFailure *failure);
extern void rl_breaker_succeeded(RlBreaker *b, const char *server);
extern void rl_breaker_reset(RlBreaker *b);

/* TLS of one connection (tls.c) */
typedef struct RlTls
{
	struct ssl_ctx_st *ctx;
	struct ssl_st *ssl;			/* NULL without TLS */
} RlTls;

/* an I/O call that must wait for the socket (what for: *want) */
#define RL_IO_WAIT (-2)

extern bool rl_tls_setup(RlTls *tls, pgsocket sock, const char *host,
						 const char *server, RlFailure *failure);
extern int	rl_tls_handshake(RlTls *tls, uint32 *want, char *errbuf,
							 size_t errsize);
extern ssize_t rl_tls_write(RlTls *tls, const char *buf, size_t len,
							uint32 *want, char *errbuf, size_t errsize);
extern ssize_t rl_tls_read(RlTls *tls, char *buf, size_t len, uint32 *want,
						   char *errbuf, size_t errsize);
extern bool rl_tls_alive(RlTls *tls);
extern void rl_tls_free(RlTls *tls);

/* connections and the transaction-end queue (conn.c, command.c, xact_queue.c) */
typedef struct RlConn RlConn;

/* What a connection is to: what its set-up sends and checks. */
typedef enum RlConnKind
{
	RL_CONN_SERVER,				/* a Redis server or cluster node: AUTH,
								 * SELECT */
	RL_CONN_MASTER,				/* the master a sentinel named: AUTH,
								 * SELECT, and ROLE must say master */
	RL_CONN_SENTINEL			/* a sentinel: AUTH with sentinel_password */
} RlConnKind;

/* What rl_redis_connections shows of a connection. */
typedef struct RlConnInfo
{
	char		server[RL_ADDRESS_LEN];
	RlConnKind	kind;
	bool		open;
	int			queued;			/* commands of transaction ends waiting */
	TimestampTz failing_since;	/* 0: its last call reached Redis */
	int64		retry_in_ms;	/* while the breaker holds calls back */
	char		last_error[512];
	int			scripts_loaded; /* of the registry's, known loaded there (all
								 * or none: they are one library) */
} RlConnInfo;

extern void rl_transport_xact_end(XactEvent event);
extern void rl_transport_subxact_end(SubXactEvent event);
extern bool rl_conn_info(int n, RlConnInfo *info);
extern RlConn *rl_conn_get(void);
extern RlConn *rl_conn_at(const char *host, int port, RlConnKind kind);
extern void rl_servers_changed(const char *why);
extern void rl_conn_hand_over(RlConn *from, RlConn *to);
extern void rl_conn_close(RlConn *conn);
extern void rl_conn_library_loaded(RlConn *conn);
extern void rl_send_queued(RlConn *except);
extern const char *rl_conn_host(RlConn *conn);
extern RlConn *rl_conn_current(void);
extern const char *rl_conn_name(RlConn *conn);
extern void rl_conn_reset_breaker(RlConn *conn);
extern bool rl_asking(RlConn *conn, redisReply **reply, RlFailure *failure);
extern redisReply *rl_command(RlConn *conn, int argc, const char **argv,
							  const size_t *argvlen, RlFailure *failure);
/* One command of a pipeline: its arguments. */
typedef struct RlCommand
{
	int			argc;
	const char **argv;
	const size_t *argvlen;
} RlCommand;

extern bool rl_pipeline_send(RlConn *conn, int n, const RlCommand *cmds,
							 int limit_ms, RlFailure *failure);
extern redisReply *rl_pipeline_recv(RlConn *conn, RlFailure *failure);
extern bool rl_conn_library_known(RlConn *conn);
extern void rl_conn_library_forget(RlConn *conn);
extern void rl_conn_library_refused(RlConn *conn);
extern bool rl_conn_library_may_load(RlConn *conn);

/* how long a connection whose server refused the library for good
 * (rl_error_lasts: NOPERM, FUNCTION unknown) sends it no more */
#define RL_LOAD_RETRY_MS 1000
extern redisReply *rl_command_share(RlConn *conn, int argc,
									const char **argv, const size_t *argvlen,
									TimestampTz deadline, int shares,
									RlFailure *failure);
extern void rl_defer_command(RlConn *conn, int argc, const char **argv,
							 const size_t *argvlen, uint8 flags);

/* what a command queued for a transaction end is (rl_defer_command) */
#define RL_QUEUED_IDEMPOTENT 0x01	/* it may be sent twice */
#define RL_QUEUED_GIVES_BACK 0x02	/* it gives units back (a refund) */
extern uint64 rl_server_generation(void);
extern uint64 rl_settings_version(void);
extern bool rl_command_was_sent(RlConn *conn);
extern void rl_conn_note_sent(RlConn *conn, bool sent);
extern uint64 rl_settings_hash(void);
extern bool rl_conn_has_queued(RlConn *conn);
extern bool rl_conn_ready(RlConn *conn);

/* Work of a transaction end a session hands to the worker. */
typedef struct RlDeferred
{
	const char *host;			/* the server it is for */
	int			port;
	uint8		flags;			/* RL_QUEUED_* */
	size_t		script_len;		/* an EVAL: its script's length, else 0 */
	uint64		script_hash;	/* and hash_bytes_extended of its text */
	int			nargs;			/* an EVAL: the arguments after the script */
	const char *encoded;		/* the command, or those arguments, encoded */
	size_t		len;
} RlDeferred;

extern void rl_conn_defer_handed(RlConn *conn, const RlDeferred *work,
								 const char **head, const size_t *headlen);
extern int	rl_close_idle(bool close);
extern bool rl_idle_used_in_xact(void);

/* the Redis protocol (resp.c) */

/*
 * What an error reply of Redis says (rl_classify_error): every class but
 * RL_REPLY_OTHER and RL_REPLY_AUTH says that Redis did not run the command
 * (rl_error_not_run).
 */
typedef enum RlReplyError
{
	RL_REPLY_OTHER,				/* refused for a reason of its own (OOM,
								 * WRONGTYPE, NOPERM ...), or run and failed */
	RL_REPLY_NO_FUNCTION,		/* the function is not there: no library */
	RL_REPLY_MOVED,				/* the hash slot is another node's now */
	RL_REPLY_ASK,				/* the key is moving to another node: ask it
								 * once, after ASKING */
	RL_REPLY_TRYAGAIN,			/* keys of a hash slot on the move: later */
	RL_REPLY_CLUSTERDOWN,		/* the cluster cannot serve: later, with a
								 * fresh slot map */
	RL_REPLY_READONLY,			/* a replica now: find the master */
	RL_REPLY_NOT_READY,			/* LOADING, MASTERDOWN: later */
	RL_REPLY_AUTH				/* not authenticated (NOAUTH, WRONGPASS ...) */
} RlReplyError;

/* Where a MOVED or ASK reply sends a command. */
typedef struct RlRedirect
{
	int			hash_slot;
	char		host[RL_ADDRESS_LEN];
	int			port;
} RlRedirect;

extern RlReplyError rl_classify_error(const char *error, const char *from_host,
									  RlRedirect *to);
extern bool rl_error_not_run(RlReplyError what);
extern bool rl_error_lasts(const char *error);
extern bool rl_reply_scalar(const redisReply *reply);
extern long long rl_reply_number(const redisReply *reply);

/* the topologies of rl_redis.mode (topology.c) */

/* the classes of RlReplyError */
#define RL_REPLY_CLASSES (RL_REPLY_AUTH + 1)

/* What a call does after an error reply of Redis (rl_reply_action). */
typedef enum RlReplyAction
{
	RL_ACTION_GIVE_BACK,		/* the error is the call's reply */
	RL_ACTION_LATER,			/* routed and sent again after a pause, within
								 * command_timeout (TRYAGAIN) */
	RL_ACTION_LATER_FRESH,		/* the same, with a fresh route
								 * (CLUSTERDOWN) */
	RL_ACTION_MOVED,			/* sent to the node named, which has the hash
								 * slot now */
	RL_ACTION_ASK,				/* sent once to the node named, after ASKING */
	RL_ACTION_FRESH				/* a fresh route, and sent again (READONLY) */
} RlReplyAction;

/*
 * A topology, as any file may read it: its name, how keys are placed, and
 * what an error reply means there. How it routes a call is its RlRoutes.
 */
typedef struct RlTopology
{
	const char *name;			/* as rl_redis.mode says it */
	RlMode		mode;			/* its index in rl_topologies */
	bool		hash_slots;		/* keys go to the master of their hash slot */
	bool		one_server;		/* every key goes to rl_redis.host:port: no
								 * other route; the shared worker may serve it */
	RlReplyAction on_error[RL_REPLY_CLASSES];	/* what a class means */
} RlTopology;

extern const RlTopology rl_topologies[RL_NUM_MODES];
extern const RlTopology *rl_topology(void);
extern RlReplyAction rl_reply_action(RlReplyError what);

/* the algorithms and the scripts compiled in (registry.c) */
typedef struct RlScript
{
	const char *body;			/* its text, for EVAL */
	const char *function;		/* its function in rl_library, for FCALL */
	int			id;				/* 0 .. RL_NUM_SCRIPTS - 1 */
} RlScript;

/* One line of algorithms.h. */
typedef struct RlAlgorithm
{
	const char *name;			/* in rl_policy.algorithm and in Lua */
	const char *key_kind;		/* in keys (see algorithms.h) */
	RlScript	script;			/* its one-algorithm script */
	bool		refund_subtracts;	/* a refund must not be sent twice */
	bool		keeps_records;	/* the forget call cleans its keys */
	bool		log;			/* lim bounded by rl_redis.sliding_max_lim */
	bool		bucket;			/* takes a burst; keys carry lim and burst */
} RlAlgorithm;

/* RL_ALG_<name>: an algorithm's index in rl_algorithms */
enum
{
#define RL_ALGORITHM(name, lua_file, key_kind, refund_subtracts, keeps_records, log, bucket) \
	RL_ALG_##name,
#include "algorithms.h"
#undef RL_ALGORITHM
	RL_NUM_ALGORITHMS
};

extern const RlAlgorithm rl_algorithms[RL_NUM_ALGORITHMS];

/* the scripts: one per algorithm, then the seven that serve several */
#define RL_NUM_SCRIPTS (RL_NUM_ALGORITHMS + 7)

extern const RlScript rl_script_check_all;
extern const RlScript rl_script_refund;
extern const RlScript rl_script_forget;
extern const RlScript rl_script_concurrency;
extern const RlScript rl_script_denial_note;
extern const RlScript rl_script_denial_top;
extern const RlScript rl_script_check_many;
extern const RlScript *rl_script_by_id(int id);
extern const RlScript *rl_script_by_text(size_t len, uint64 hash);
extern const char *const rl_library;
extern const char *const rl_library_name;

/*
 * running a script (scripts.c): argv[0] and argv[1] of a script call are
 * left for rl_script_argv to fill in
 */
#define RL_SCRIPT_ARGV_RESERVED 2

extern void rl_script_argv(const RlScript *script, bool eval,
						   const char **argv, size_t *argvlen);
extern int	rl_library_load_argv(const char **argv, size_t *argvlen);
extern bool rl_library_load_noted(RlConn *conn, const redisReply *reply);
extern redisReply *rl_run_script(RlConn *conn, const RlScript *script,
								 int argc, const char **argv, size_t *argvlen,
								 RlFailure *failure);
extern redisReply *rl_run_script_asking(RlConn *conn, const RlScript *script,
										int argc, const char **argv,
										size_t *argvlen, RlFailure *failure);
extern size_t rl_clock_arg(char *buf);

/*
 * How a topology routes a call: one of these per topology, in its own file
 * (standalone.c, cluster.c, sentinel.c), called by router.c only; a NULL
 * function has nothing to do.
 */
typedef struct RlRoutes
{
	/* the connection of key's master, or NULL with failure filled in; it
	 * may ask the servers (slot map, sentinels) only when *may_ask, which
	 * it then clears */
	RlConn	   *(*route) (const char *key, size_t keylen, bool *may_ask,
						  RlFailure *failure);
	/* the connection a call on key went to last, else NULL; no I/O */
	RlConn	   *(*known) (const char *key, size_t keylen);
	/* every master, as rl_route_all (NULL: the route of any key) */
	int			(*masters) (RlConn ***conns, RlFailure *failure);
	/* conn failed or refused a write: the next route asks again */
	void		(*failed) (RlConn *conn);
	/* the node a MOVED (moved) or ASK reply names, else NULL */
	RlConn	   *(*redirect) (const RlRedirect *to, bool moved);
	/* forgets what was learnt of the servers (they changed) */
	void		(*forget) (void);
} RlRoutes;

/* the one configured server (standalone.c) */
extern const RlRoutes rl_standalone_routes;

/* Redis Cluster's slot map (cluster.c) */
extern int	rl_key_hash_slot(const char *key, size_t len);
extern const RlRoutes rl_cluster_routes;

/* the master the sentinels name (sentinel.c) */
extern const RlRoutes rl_sentinel_routes;

/* where a key goes, by the current topology (router.c) */
extern RlConn *rl_route(const char *key, size_t keylen, RlFailure *failure);
extern RlConn *rl_route_known(const char *key, size_t keylen);
extern int	rl_route_hash_slot(const char *key, size_t keylen);
extern int	rl_route_all(RlConn ***conns, RlFailure *failure);
extern redisReply *rl_call(const char *key, size_t keylen,
						   const RlScript *script, int argc, const char **argv,
						   size_t *argvlen, RlConn **connp,
						   RlFailure *failure);

/* One call of a batch (rl_call_many). */
typedef struct RlCall
{
	const char *key;			/* the key it routes by */
	size_t		keylen;
	const RlScript *script;
	int			argc;			/* argv[0] and argv[1] are filled in */
	const char **argv;
	size_t	   *argvlen;
	redisReply *reply;			/* filled in: the reply, or NULL */
	RlConn	   *conn;			/* filled in: where it went */
	RlFailure	failure;		/* filled in when reply is NULL */
	bool		sent;			/* filled in: it may have reached Redis */
} RlCall;

extern void rl_call_many(RlCall *calls, int n);

/* the shared queue of rl_redis.transport = shared (shared_queue.c) */

extern void rl_shared_queue_init(void);
extern bool rl_worker_takes(const RlScript *script, const char **argv);
extern size_t rl_worker_request_max(RlConn *conn);
extern redisReply *rl_shared_call(RlConn *own, const RlScript *script,
								  int argc, const char **argv,
								  const size_t *argvlen, int keyarg,
								  uint64 settings, RlFailure *failure,
								  bool *used);
extern bool rl_shared_defer(const RlDeferred *work, uint64 settings);
extern bool rl_shared_worker_start(uint64 settings);
extern void rl_shared_worker_settings(uint64 settings);
extern void rl_shared_worker_stop(void);
extern int	rl_shared_entries(void);
extern void rl_shared_defer_wait(TimestampTz deadline);
extern bool rl_shared_settled(TimestampTz deadline);
extern int	rl_shared_take(int i, RlCall *call, int *script_id,
						   RlDeferred *work);
extern void rl_shared_deferred_done(int i);
extern void rl_shared_complete(int i, const redisReply *reply,
							   const RlFailure *failure, bool sent);

/* the rl_redis worker (worker.c) */

/* who is being throttled (denials.c) */
extern void rl_note_denial(const char *policy, text *identity);
extern void rl_note_denials(const char *policy, text **identities, int n);
extern redisReply *rl_denials_top(const char *policy, int minutes, int32 n,
								  RlConn **connp, RlFailure *failure);

/* the decision engine (engine.c) */
/* One decision, as the scripts return it. */
typedef struct RlDecision
{
	bool		allowed;
	int32		lim;
	int32		remaining;
	int64		reset_ms;
	int64		retry_after_ms;
	int64		stamp_us;		/* the clock Redis decided on */
	int64		epoch;			/* the key's epoch (fixed, sliding_counter) */
	bool		from_redis;		/* false: rl_redis.on_error decided */
	bool		from_cache;		/* a denial the local cache remembered */
	bool		shadow_denied;	/* a shadow policy would deny it: allowed, and
								 * nothing taken (rl_shadow_allow) */
} RlDecision;

/* statistics (stats.c) */

/* the buckets of the round-trip histogram (bounds in stats.c) */
#define RL_RTT_BUCKETS 15

/* The counters of one database and policy. */
typedef struct RlCounters
{
	int64		calls;			/* allowed + denied + errors */
	int64		allowed;
	int64		denied;
	int64		units_taken;
	int64		units_refunded;
	int64		errors;
	int64		errors_connection;
	int64		errors_timeout;
	int64		errors_reply;
	int64		errors_protocol;
	int64		fallback_allow;
	int64		fallback_deny;
	int64		outages;		/* failures that began an outage */
	int64		peeks;			/* answered calls of cost 0 and dry runs,
								 * not in calls */
	int64		rtt[RL_RTT_BUCKETS];
	int64		rtt_sum_us;
	int64		shadow_denied;	/* calls a shadow policy would have denied */
} RlCounters;

extern void rl_stats_init(void);
extern void rl_stats_decided(const char *key, size_t len, const RlDecision *d,
							 int32 cost, int64 rtt_us);
extern void rl_stats_failed(const char *key, size_t len,
							const RlFailure *failure, bool count_outage);
extern void rl_stats_refunded(const char *key, size_t len, int64 units);

/* the local cache of denials (denycache.c) */
typedef struct RlLimit RlLimit;
extern void rl_deny_cache_init(void);
extern int64 rl_deny_cache_now(void);
extern bool rl_deny_cache_lookup(const char *key, size_t len,
								 const RlLimit *limit, uint64 server,
								 int32 cost, RlDecision *d);
extern uint64 rl_deny_cache_mark(void);
extern void rl_deny_cache_store(const char *key, size_t len,
								const RlLimit *limit, uint64 server,
								int32 cost, const RlDecision *d,
								int64 sent_ms, uint64 mark);
extern void rl_deny_cache_forget(void);

/*
 * The longest window (and lease): 100 years. Longer ones would push the
 * scripts' microsecond times past what a double holds exactly.
 */
#define RL_MAX_WINDOW_MS INT64CONST(3153600000000)

/*
 * The largest lim of the sliding window log, which keeps one sorted-set
 * entry per unit: 100 000 entries are about 11 MB, and a call that takes
 * them all holds Redis for about 0.15 s.
 */
#define RL_MAX_SLIDING_LIM 100000

/*
 * The default and the largest rl_redis.max_identity_bytes: an identity is
 * part of every key it has in Redis (three times its bytes at most, as
 * escaped), and a call's key must stay far below MaxAllocSize.
 */
#define RL_DEFAULT_IDENTITY_BYTES 1024
#define RL_MAX_IDENTITY_BYTES (1024 * 1024)

/*
 * The latest test clock: 2100-01-01. With it and the 100-year limits every
 * time the scripts compute stays below 2^53 microseconds.
 */
#define RL_MAX_TEST_CLOCK_MS 4102444800000.0

/*
 * The production values of the timers that tests may shorten (each is also
 * the most its setting allows, so that no setting makes anything wait
 * longer): the most a transaction end waits on Redis
 * (rl_redis.xact_end_budget), how soon the postmaster starts a worker that
 * exited (rl_redis.worker_restart_interval), how often the sentinels are
 * asked again while calls go to the master
 * (rl_redis.sentinel_recheck_interval), and the least time between two
 * fetches of a Redis Cluster's slot map
 * (rl_redis.slot_map_refresh_interval).
 */
#define RL_XACT_END_BUDGET_MS 1000
#define RL_WORKER_RESTART_S 1
#define RL_SENTINEL_RECHECK_MS 1000
#define RL_SLOT_MAP_REFRESH_MS 100

/* The arguments of one limit. */
struct RlLimit
{
	const RlAlgorithm *algorithm;
	int32		lim;
	int64		window_ms;
	int32		burst;			/* 0 when none */
	bool		shadow;			/* a shadow policy's: its denials are allowed
								 * (rl_shadow_allow) */
};

/*
 * The units a limit holds at most: a bucket's burst, or lim when it has
 * none (a burst means nothing to the other algorithms and to a concurrency
 * limit, whose algorithm is NULL).
 */
static inline int32
rl_limit_capacity(const RlLimit *limit)
{
	return limit->algorithm != NULL && limit->algorithm->bucket &&
		limit->burst > 0 ? limit->burst : limit->lim;
}

/* Who made a charge, for rl_redis.refund_on_abort. */
typedef enum RlChargeBy
{
	RL_BY_CALL,					/* a decision function */
	RL_BY_GUARD					/* rl_guard or rl_guard_statement */
} RlChargeBy;

/* the key format (keys.c): what rl_parse_key finds in a key (pointers) */
typedef struct RlKeyParts
{
	const char *kind;			/* the algorithm or "concurrency" */
	const char *tag;			/* "{<encoded identity>}" */
	size_t		taglen;
	const char *policy;			/* NULL for explicit arguments */
	size_t		policylen;
} RlKeyParts;

extern StringInfo rl_build_key(text *identity, const char *policy,
							   const RlLimit *limit);
extern bool rl_parse_key(const char *key, size_t len, RlKeyParts *parts);

/* the minute of rl_append_denials_key's merged key */
#define RL_DENIALS_TOP (-1)
extern void rl_append_denials_key(StringInfo buf, const char *policy,
								  int64 minute);
extern void rl_identity_keys(text *identity, StringInfo pattern,
							 StringInfo tag);
extern bool rl_key_of(const char *key, size_t len, StringInfo tag);
extern void rl_slot_keys_pattern(const char *policy, StringInfo pattern);
extern text *rl_slot_key_identity(const char *key, size_t len,
								  const char *policy, const RlLimit *limit);
extern StringInfo rl_copy_key(StringInfo key);

/* the one argument checker (checks.c) */
extern void rl_check_not_null(FunctionCallInfo fcinfo, int argno,
							  const char *name);
extern void rl_check_identity(size_t len, Relation rel, bool existing);
extern text *rl_get_identity(FunctionCallInfo fcinfo, int argno);
extern int32 rl_get_cost(FunctionCallInfo fcinfo, int argno, const char *name);
extern int64 rl_get_window_ms(FunctionCallInfo fcinfo, int argno,
							  const char *name);
extern void rl_check_limit(const RlLimit *limit);

/* a batch: identities decided each under one limit (engine.c) */
extern void rl_batch_rows(FunctionCallInfo fcinfo, const RlLimit *limit,
						  const char *policy, int argno, int32 cost);

/*
 * One charge: cost units of an identity under a limit (a policy's, or
 * explicit numbers). rl_decide fills in the rest.
 */
typedef struct RlCharge
{
	const RlLimit *limit;
	const char *policy;			/* the limit's policy; NULL: explicit numbers */
	text	   *identity;
	int32		cost;			/* < 0 gives units back */
	bool		dry_run;		/* decide (ONE, SLOT) and write nothing:
								 * rl_inspect */
	StringInfo	key;			/* filled in: the key (rl_build_key) */
	int64		stamp_us;		/* filled in: the clock it was decided on */
	int64		epoch;			/* filled in: the key's epoch */
	bool		failed;			/* filled in: Redis gave it no decision */
	bool		shadow_denied;	/* filled in: its shadow policy would deny it */
} RlCharge;

/* How rl_decide decides the charges of a request. */
typedef enum RlRequestKind
{
	RL_DECIDE_ONE,				/* charges[0] (n = 1) */
	RL_DECIDE_ALL,				/* charges[0..n-1], applied to all or to none */
	RL_DECIDE_EACH,				/* identities[0..n-1], each on its own, under
								 * charges[0]'s limit, policy and cost (its
								 * identity unused): a batch, maybe empty (the
								 * limit is still checked) */
	RL_DECIDE_SLOT				/* charges[0] (n = 1): a concurrency slot of
								 * its limit (no algorithm: lim slots, a lease
								 * of window_ms), cost 1 */
} RlRequestKind;

/*
 * What every SQL entry point that charges an identity hands to rl_decide,
 * the one place where charges are checked, keyed, sent and remembered.
 */
typedef struct RlRequest
{
	RlRequestKind kind;
	RlCharge   *charges;
	int			n;				/* charges (ONE, ALL) or identities (EACH) */
	text	  **identities;		/* EACH */
	RlChargeBy	by;				/* who charges, for refund_on_abort */
	Relation	rel;			/* the guarded table the identities come
								 * from (named in errors), or NULL */
} RlRequest;

extern int	rl_decide(const RlRequest *req, RlDecision *d);

/* a script's decision reply and on_error (decision.c) */
extern bool rl_read_decision(const redisReply *e, const RlLimit *limit,
							 RlDecision *d);
extern bool rl_parse_decision(RlConn *conn, redisReply *reply,
							  const RlLimit *limit, RlDecision *d,
							  RlCharge *charges, int n, int *index,
							  RlFailure *failure);
extern bool rl_unexpected_reply(RlConn *conn, redisReply *reply,
								RlFailure *failure);
extern void rl_apply_on_error(const RlFailure *failure, const RlLimit *limit,
							  int32 cost, RlDecision *d);
extern void rl_shadow_allow(const RlLimit *limit, RlDecision *d);
extern void rl_error_reply(RlConn *conn, redisReply *reply,
						   RlFailure *failure);
extern redisReply *rl_reply_or_raise(RlConn *conn, redisReply *reply,
									 RlFailure *failure);
extern redisReply *rl_scan_step(RlConn *conn, StringInfo pattern,
								char *cursor, size_t cursorsize);
extern Datum rl_result_datum(FunctionCallInfo fcinfo, const RlDecision *d);

/* named policies (policy.c) */
typedef struct RlPolicy
{
	char		name[64];		/* hash key; rl_policy.name is shorter */
	RlLimit		limit;
	bool		concurrency;	/* a concurrency limit: lim slots, lease window_ms */
} RlPolicy;

extern void rl_policy_init(void);
extern RlPolicy rl_policy_lookup(FunctionCallInfo fcinfo, text *name);
extern RlPolicy rl_policy_arg(FunctionCallInfo fcinfo, int argno);
extern bool rl_policy_find(FunctionCallInfo fcinfo, const char *name,
						   RlLimit *limit);
extern void rl_policy_missing(const char *name, int elevel, const char *hint);

/* refunds on abort (refund.c) */

extern void rl_refund_xact_end(XactEvent event);
extern void rl_refund_subxact_end(SubXactEvent event);
extern const char *rl_refund_scopes(RlChargeBy by);
extern bool rl_refund_covers(RlChargeBy by);
extern const char *rl_refund_call_scope(char *buf);
extern void rl_remember_charge(const RlLimit *limit, StringInfo key,
							   int32 cost, int64 stamp_us, int64 epoch,
							   RlChargeBy by);
extern void rl_refund_call_end(const char *id, RlCharge *charges, int n,
							   bool give_back);

/* the concurrency slots a backend holds (slots.c) */
extern void rl_slots_xact_end(XactEvent event);
extern void rl_slots_subxact_end(SubXactEvent event);
extern void rl_take_slot(const RlCharge *c, RlDecision *d);
extern bool rl_release_slot(const char *policy, text *identity);

/* the transaction-end dispatcher (xact_end.c) */
extern void rl_xact_end_init(void);

#endif							/* RL_REDIS_H */
