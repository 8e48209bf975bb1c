/*
 * command.c
 *	  Sending commands to Redis and reading their replies: one command, or
 *	  a pipeline of several, on one connection.
 *
 * A call opens its connection when needed, and first sends what a
 * transaction end left queued there and reads what it left unread. A call
 * an error cut short after it was written keeps its connection: its
 * replies are read and dropped first, so that none reaches another caller.
 */
#include "postgres.h"

#include "lib/stringinfo.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"

#include "rl_redis.h"
#include "conn_internal.h"

/*
 * Fills failure from a Redis error reply and frees the reply. A refused
 * authentication is a connection failure (08001); anything else Redis
 * refuses (OOM, READONLY, WRONGTYPE, NOPERM ...) is reported with its text.
 */
void
rl_error_reply(RlConn *conn, redisReply *reply, RlFailure *failure)
{
	if (rl_classify_error(reply->str, conn->host, NULL) == RL_REPLY_AUTH)
		rl_fail(failure, RL_FAILURE_AUTH,
				ERRCODE_SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION,
				conn->kind == RL_CONN_SENTINEL ? RL_HINT_SENTINEL_PASSWORD :
				RL_HINT_PASSWORD, reply->str,
				"could not authenticate to Redis at %s", rl_conn_name(conn));
	else
		rl_fail(failure, RL_FAILURE_REPLY, ERRCODE_CONNECTION_EXCEPTION,
				rl_classify_error(reply->str, conn->host, NULL) == RL_REPLY_NO_FUNCTION ?
				RL_HINT_LIBRARY : RL_HINT_NONE, reply->str,
				"Redis at %s returned an error", rl_conn_name(conn));
	freeReplyObject(reply);
}

/*
 * Returns reply, or raises when it is NULL (the failure) or an error reply
 * (rl_error_reply, which frees it): the check of an administrative
 * command's reply before its contents are read.
 */
redisReply *
rl_reply_or_raise(RlConn *conn, redisReply *reply, RlFailure *failure)
{
	if (reply == NULL)
		rl_raise(failure);
	if (reply->type == REDIS_REPLY_ERROR)
	{
		rl_error_reply(conn, reply, failure);
		rl_raise(failure);
	}
	return reply;
}

/*
 * Sends one SCAN step (COUNT 1000) on conn for pattern from cursor; returns
 * its reply, whose second element is an array of strings (the keys), and
 * the next cursor ("0" when done) in cursor; raises on any other reply.
 */
redisReply *
rl_scan_step(RlConn *conn, StringInfo pattern, char *cursor, size_t cursorsize)
{
	const char *argv[6] = {"SCAN", cursor, "MATCH", pattern->data, "COUNT", "1000"};
	size_t		argvlen[6] = {4, strlen(cursor), 5, pattern->len, 5, 4};
	RlFailure	failure = {0};
	redisReply *reply = rl_command(conn, 6, argv, argvlen, &failure);
	size_t		i;

	rl_reply_or_raise(conn, reply, &failure);
	if (reply->type != REDIS_REPLY_ARRAY || reply->elements != 2 ||
		reply->element[0]->type != REDIS_REPLY_STRING ||
		reply->element[0]->len >= cursorsize ||
		reply->element[1]->type != REDIS_REPLY_ARRAY)
		goto bad;
	for (i = 0; i < reply->element[1]->elements; i++)
		if (reply->element[1]->element[i]->type != REDIS_REPLY_STRING)
			goto bad;
	memcpy(cursor, reply->element[0]->str, reply->element[0]->len);
	cursor[reply->element[0]->len] = '\0';
	return reply;

bad:
	freeReplyObject(reply);
	ereport(ERROR,
			(errcode(ERRCODE_PROTOCOL_VIOLATION),
			 errmsg("unexpected reply to SCAN from Redis at %s",
					rl_conn_name(conn))));
	return NULL;				/* keep compiler quiet */
}

/*
 * Sends the work queued on the connections other than except (with a PING
 * after it, to read its replies): work that a transaction end could not
 * write, because that server had no open connection then, goes with the
 * session's next call wherever that call goes (unless that server's last
 * call failed). A failure is left to that connection's breaker and next
 * call.
 */
void
rl_send_queued(RlConn *except)
{
	int			pass;

	/* a reply may move work to another node (MOVED): that node next */
	for (pass = 0; pass < 3; pass++)
	{
		RlConn	   *conn;
		bool		sent = false;

		for (conn = rl_conn_list; conn != NULL; conn = conn->next)
		{
			const char *argv[1] = {"PING"};
			size_t		argvlen[1] = {4};
			RlFailure	failure = {0};
			redisReply *reply;

			/* a server in an outage gets its work with its own next call */
			if (conn == except || conn->queue_count == 0 ||
				conn->kind == RL_CONN_SENTINEL || conn->breaker.outage_start != 0 ||
				(pass > 0 && !conn->got_redirected))
				continue;
			conn->got_redirected = false;
			reply = rl_command(conn, 1, argv, argvlen, &failure);
			if (reply != NULL)
				freeReplyObject(reply);
			sent = true;
		}
		if (!sent)
			break;
	}
}

/*
 * Sends one command and returns its reply, which the caller must free with
 * freeReplyObject; as rl_pipeline_send and rl_pipeline_recv, for one.
 * NULL on failure, with failure filled in and the connection discarded.
 */
static redisReply *
rl_command_within(RlConn *conn, int argc, const char **argv,
				  const size_t *argvlen, int limit_ms, RlFailure *failure)
{
	RlCommand	cmd = {argc, argv, argvlen};

	if (!rl_pipeline_send(conn, 1, &cmd, limit_ms, failure))
		return NULL;
	return rl_pipeline_recv(conn, failure);
}

/*
 * Sends one command and returns its reply, which the caller must free with
 * freeReplyObject: rl_command_within with connect_timeout and
 * command_timeout.
 */
redisReply *
rl_command(RlConn *conn, int argc, const char **argv, const size_t *argvlen,
		   RlFailure *failure)
{
	return rl_command_within(conn, argc, argv, argvlen, -1, failure);
}

/*
 * Sends n commands on conn in one write; their replies, which the caller
 * must read with rl_pipeline_recv (all n, or the connection is dropped
 * before its next use), come in order. Opens the connection when needed,
 * and first sends what a transaction end left queued and reads what it
 * left unread; the connection may take connect_timeout and one command
 * command_timeout, or, with limit_ms >= 0, each at most limit_ms. Of
 * several commands, each wait (for Redis to take more of them, or for the
 * next reply) may take command_timeout. False on
 * failure, with failure filled in and the connection already discarded;
 * rl_command_was_sent then says whether any command may have reached
 * Redis. While the circuit breaker is open, fails at once without touching
 * the network. An interrupt (cancel, statement_timeout) raises its error
 * from inside.
 */
bool
rl_pipeline_send(RlConn *conn, int n, const RlCommand *cmds, int limit_ms,
				 RlFailure *failure)
{
	TimestampTz deadline;
	int			connect_ms = rl_connect_timeout;
	int			command_ms = rl_command_timeout;
	size_t		done = 0;
	bool		ok;
	int			i;

	rl_idle_in_use();

	if (limit_ms >= 0)
	{
		limit_ms = Max(limit_ms, 1);
		connect_ms = Min(connect_ms, limit_ms);
		command_ms = command_ms > 0 ? Min(command_ms, limit_ms) : limit_ms;
	}

	conn->last_command_sent = false;
	conn->replies_due = 0;
	if (rl_out.data == NULL)
	{
		MemoryContext old = MemoryContextSwitchTo(TopMemoryContext);

		initStringInfo(&rl_out);
		MemoryContextSwitchTo(old);
	}
	if (conn->settings_seen != rl_settings_version())
	{
		conn->settings_seen = rl_settings_version();
		rl_breaker_reset(&conn->breaker);	/* settings were set: try at once */
		if (rl_settings_changed(conn))
			conn->ready = false;
	}
	else if (rl_breaker_open(&conn->breaker, failure))
		return false;

	conn->wait_for_call = false;
	rl_register_exit();
	if (!rl_conn_usable_now(conn))
	{
		bool		connected = rl_connect(conn, rl_deadline(connect_ms), true,
											   failure);

		/* AUTH, SELECT and ROLE were sent, not the command */
		conn->last_command_sent = false;
		if (!connected)
		{
			rl_breaker_failed(&conn->breaker, failure);
			return false;
		}
	}

	/*
	 * First the work queued by transaction ends, then the commands. Redis
	 * may still be busy with that work when the deadline comes: the call
	 * fails then, but the connection is kept, and the next call goes on with
	 * it (never losing or repeating it).
	 */
	deadline = rl_deadline(command_ms);
	if (!rl_send_queue(conn, deadline, failure) ||
		!rl_read_pending(conn, deadline, true, failure))
	{
		if (failure->sqlerrcode == 0)
			rl_fail(failure, RL_FAILURE_TIMEOUT, ERRCODE_CONNECTION_FAILURE,
					RL_HINT_COMMAND_TIMEOUT, NULL,
					"timed out: Redis at %s is still busy with rate-limit work of earlier transaction ends",
					conn->address);
		rl_breaker_failed(&conn->breaker, failure);
		return false;
	}

	resetStringInfo(&rl_out);
	for (i = 0; i < n; i++)
		rl_encode(&rl_out, cmds[i].argc, cmds[i].argv, cmds[i].argvlen);
	conn->ready = false;		/* replies may be in flight from here on */
	if (n == 1)
		ok = rl_write(conn, rl_out.data, rl_out.len, &done, deadline, false, failure);
	else
	{
		/*
		 * A pipeline goes out as fast as Redis runs it: command_timeout
		 * bounds each wait for Redis to take more of it, not the whole.
		 */
		size_t		part;

		do
		{
			ok = rl_write(conn, rl_out.data + done, rl_out.len - done, &part,
						  deadline, true, failure);
			done += part;
			deadline = rl_deadline(command_ms);
		} while (!ok && failure->sqlerrcode == 0 && part > 0);
		if (!ok && failure->sqlerrcode == 0)
			rl_conn_fail(conn, failure, RL_FAILURE_TIMEOUT,
						 ERRCODE_CONNECTION_FAILURE, RL_HINT_COMMAND_TIMEOUT,
						 NULL, "timed out sending to Redis at %s",
						 conn->address);
	}
	/* Redis runs only whole commands: the first is whole once all of it went */
	conn->last_command_sent = ok || (n > 1 && done > 0);
	if (rl_out.maxlen > RL_KEEP_BUFFER)
	{
		/* a huge command does not keep its buffer for the backend's life */
		char	   *small = MemoryContextAlloc(TopMemoryContext, 1024);

		pfree(rl_out.data);
		rl_out.data = small;
		rl_out.maxlen = 1024;
		resetStringInfo(&rl_out);
	}
	if (!ok)
	{
		rl_breaker_failed(&conn->breaker, failure);
		return false;
	}
	conn->replies_due = n;
	conn->replies_deadline = deadline;
	conn->replies_timeout_ms = n > 1 ? command_ms : 0;
	return true;
}

/*
 * Reads the next reply of the commands rl_pipeline_send wrote on conn; the
 * caller frees it with freeReplyObject. NULL on failure, with failure
 * filled in and the connection discarded (the replies still due are lost).
 */
redisReply *
rl_pipeline_recv(RlConn *conn, RlFailure *failure)
{
	redisReply *reply;

	Assert(conn->replies_due > 0);
	reply = rl_recv(conn, conn->replies_deadline, false, failure);
	if (reply == NULL)
	{
		conn->replies_due = 0;
		rl_breaker_failed(&conn->breaker, failure);
		return NULL;
	}
	if (--conn->replies_due == 0)
	{
		conn->ready = true;
		rl_breaker_succeeded(&conn->breaker, conn->address);
	}
	else if (conn->replies_timeout_ms > 0)
		conn->replies_deadline = rl_deadline(conn->replies_timeout_ms);
	return reply;
}

/*
 * Sends one command to a node asked in turn with others (the cluster's
 * nodes for the slot map, the sentinels for the master) within an equal
 * share of what is left until deadline among shares askers, and returns
 * its reply, which the caller must free with freeReplyObject. NULL on
 * failure or an error reply, with failure filled in.
 */
redisReply *
rl_command_share(RlConn *conn, int argc, const char **argv,
				 const size_t *argvlen, TimestampTz deadline, int shares,
				 RlFailure *failure)
{
	long		left = TimestampDifferenceMilliseconds(GetCurrentTimestamp(),
													   deadline);
	redisReply *reply = rl_command_within(conn, argc, argv, argvlen,
										  (int) Max(left / Max(shares, 1), 1),
										  failure);

	if (reply != NULL && reply->type == REDIS_REPLY_ERROR)
	{
		rl_error_reply(conn, reply, failure);
		return NULL;
	}
	return reply;
}

/*
 * Sends ASKING on conn, so that its next command may touch a key that Redis
 * Cluster is moving there (an ASK redirection). True when Redis took it;
 * else false with *reply its error reply, or NULL with failure filled in,
 * for the caller to return as the call's.
 */
bool
rl_asking(RlConn *conn, redisReply **reply, RlFailure *failure)
{
	const char *argv[1];
	size_t		argvlen[1];
	int			argc = rl_asking_argv(argv, argvlen);

	*reply = rl_command(conn, argc, argv, argvlen, failure);
	if (*reply == NULL || (*reply)->type == REDIS_REPLY_ERROR)
		return false;
	freeReplyObject(*reply);
	*reply = NULL;
	return true;
}
