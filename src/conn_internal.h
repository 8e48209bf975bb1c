/*
 * conn_internal.h
 *	  The connection (RlConn) as the files that make up the transport see
 *	  it: resp.c, queue.c, conn.c, io.c, connect.c, idle.c, xact_queue.c and
 *	  command.c include this; the rest of the extension sees RlConn as
 *	  opaque (rl_redis.h).
 */
#ifndef CONN_INTERNAL_H
#define CONN_INTERNAL_H

#include <signal.h>
#include <sys/socket.h>

#include "storage/latch.h"

/*
 * One connection to one Redis server, an entry of the per-backend cache
 * (conn_cache) keyed by the server's address. Everything that belongs to a
 * server is here: the socket and its wait-event set, the TLS state, the
 * circuit breaker and the transaction-end queue.
 *
 * The queue holds commands for the end of a transaction: encoded one after
 * another in queue; the end offset of each in queue_ends, and whether it
 * may be sent twice, and whether it gives units back, in queue_flags. What
 * a transaction end could not
 * write waits for the next command on the connection, which sends it first:
 * so the queue never holds more than the work of the transaction ends since
 * the last command that reached Redis (a charge needs such a command). It
 * belongs to its server: when the connection settings name another, it is
 * dropped with a warning. While the queue is being written,
 * queue_write_from and queue_write_done say which bytes went out, so that a
 * write cut short by an error or an interrupt is accounted for.
 */
struct RlConn
{
	/* the hash key (an RlConnKey): the address and the kind */
	char		address[RL_ADDRESS_LEN];	/* "host:port" or the socket path;
											 * also its name in messages */
	RlConnKind	kind;
	char		host[RL_ADDRESS_LEN];	/* host name, address or socket path */
	int			port;
	uint64		settings_seen;	/* settings_version when last compared */
	bool		library_loaded; /* the function library is known loaded on
								 * the server since this connection was made */
	TimestampTz load_refused_at;	/* when Redis last refused to load it
									 * (0: never, since the connection was
									 * made) */
	volatile sig_atomic_t shut; /* not to be used again: the idle timeout
								 * shut its socket down, or Redis closes it */
	bool		got_redirected; /* work moved here from another node's queue */
	pgsocket	sock;			/* PGINVALID_SOCKET when there is none */
	bool		fd_acquired;	/* we hold an external-FD slot for sock */
	WaitEventSet *wes;			/* MyLatch, postmaster death, sock */
	int			sock_pos;		/* position of sock in wes */
	uint32		sock_events;	/* what wes waits for on sock right now */
	redisReader *reader;
	RlTls		tls;			/* with rl_redis.tls */
	bool		ready;			/* connected, nothing unread but the pending
								 * replies: safe to send */
	bool		last_command_sent;	/* the last command was written whole,
									 * or handed to the worker (it may have
									 * run) */
	int			skip_replies;	/* of an interrupted call: read and dropped
								 * before the queue's */
	int			replies_due;	/* of the commands rl_pipeline_send wrote */
	TimestampTz replies_deadline;	/* when the next is due at the latest */
	int			replies_timeout_ms; /* of a pipeline: the wait for each */
	uint64		replies_read;	/* counts the replies read */
	TimestampTz stalled_since;	/* a wait for replies timed out then, and
								 * none came since (0: none timed out) */
	bool		wait_for_call;	/* Redis did not run queued work here
								 * (READONLY, LOADING ...): the transaction
								 * ends leave it to the next call */
	RlBreaker	breaker;
	StringInfoData settings;	/* the connection settings it was made with */

	/*
	 * The address list of a connect in progress: a cancel while connecting
	 * leaves it behind, and the next connect frees it.
	 */
	struct addrinfo *pending_addrs;

	/*
	 * The address the last connection was opened to (addrlen 0: none yet),
	 * which a transaction end connects to again without a name lookup.
	 */
	struct sockaddr_storage addr;
	socklen_t	addrlen;

	/* the transaction-end queue */
	StringInfoData queue;
	int		   *queue_ends;
	uint8	   *queue_flags;	/* RL_QUEUED_* of each command */
	uint8	   *queue_tries;	/* times written whole */
	int			queue_count;
	int			queue_max;
	int			queue_confirmed;	/* the first commands, replies read */
	int			pending_replies;	/* the first commands of the queue that
									 * were written whole, their replies not
									 * read yet */
	size_t		queue_partial;	/* bytes written of the queue's next command */
	bool		queue_writing;
	size_t		queue_write_from;
	size_t		queue_write_done;
	struct RlConn *next;		/* the next entry of rl_conn_list */
};

/* The hash key of conn_cache: the first fields of RlConn. */
typedef struct RlConnKey
{
	char		address[RL_ADDRESS_LEN];
	RlConnKind	kind;
} RlConnKey;

StaticAssertDecl(offsetof(RlConn, kind) == offsetof(RlConnKey, kind) &&
				 offsetof(RlConn, host) >= sizeof(RlConnKey),
				 "RlConnKey must be the first fields of RlConn");


/* the connections (conn.c) */
extern RlConn *rl_conn_list;
extern void rl_disconnect(RlConn *conn);
extern RlConn *rl_conn_lookup(const char *host, int port, RlConnKind kind);
extern void rl_settings_signature(StringInfo buf, RlConnKind kind);
extern bool rl_settings_differ(RlConn *conn);
extern bool rl_settings_changed(RlConn *conn);
extern void rl_conn_other_server(RlConn *conn);

/* the Redis protocol (resp.c) */
extern void rl_encode(StringInfo buf, int argc, const char **argv,
					  const size_t *argvlen);
extern void rl_encode_head(StringInfo buf, int argc, int n,
						   const char **argv, const size_t *argvlen);
extern int	rl_asking_argv(const char **argv, size_t *argvlen);
extern bool rl_split_eval(const char *cmd, size_t len, const char **body,
						  size_t *bodylen, const char **rest, size_t *restlen,
						  int *nargs);

/* the queue of one connection (queue.c) */
extern size_t rl_queue_offset(RlConn *conn, int k);
extern void rl_queue_remove(RlConn *conn, int k, int n);
extern void rl_queue_trim(RlConn *conn);
extern void rl_discard_queue(RlConn *conn, const char *why);
extern void rl_queue_unconfirmed(RlConn *conn);
extern void rl_queue_account(RlConn *conn);
extern void rl_queue_push(RlConn *conn, int argc, const char **argv,
						  const size_t *argvlen, const char *encoded,
						  size_t len, uint8 flags, uint8 tries);

/* socket I/O (io.c) */
extern StringInfoData rl_out;
extern void rl_conn_fail(RlConn *conn, RlFailure *failure, RlFailureKind kind,
						 int sqlerrcode, RlHint hint, const char *detail,
						 const char *fmt,...) pg_attribute_printf(7, 8);
extern TimestampTz rl_deadline(int timeout_ms);
extern bool rl_wait(RlConn *conn, uint32 events, TimestampTz deadline);
extern bool rl_write(RlConn *conn, const char *buf, size_t len, size_t *done,
					 TimestampTz deadline, bool patient, RlFailure *failure);
extern redisReply *rl_recv(RlConn *conn, TimestampTz deadline, bool patient,
						   RlFailure *failure);
extern redisReply *rl_roundtrip(RlConn *conn, TimestampTz deadline,
								RlFailure *failure);
extern bool rl_connection_alive(RlConn *conn);

/* connection set-up (connect.c) */
extern bool rl_connect(RlConn *conn, TimestampTz deadline, bool resolve,
					   RlFailure *failure);

/* idle connections (idle.c) */
extern void rl_idle_in_use(void);
extern void rl_arm_idle_timeout(void);

/* sending the queues (xact_queue.c) */
extern bool rl_send_queue(RlConn *conn, TimestampTz deadline,
						  RlFailure *failure);
extern bool rl_read_pending(RlConn *conn, TimestampTz deadline, bool patient,
							RlFailure *failure);
extern bool rl_conn_usable_now(RlConn *conn);
extern void rl_register_exit(void);

#endif							/* CONN_INTERNAL_H */
