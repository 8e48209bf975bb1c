#!/usr/bin/python3
"""An HTTP rate-limit decision service on top of the rl_redis extension.

    POST /api/v1/rate-limiter/fixed-window
    POST /api/v1/rate-limiter/sliding-window
        {"identity": "user:42", "limit": 5, "windowSeconds": 60, "cost": 1}
    POST /api/v1/rate-limiter/policy
        {"identity": "user:42", "policy": "pro", "cost": 1}
    GET  /healthz

    200 {"allow": true,  "reason": "allowed", "retryAfterSeconds": 0, "limit": 5, "remaining": 4}
    429 {"allow": false, "reason": "rate limit exceeded", "retryAfterSeconds": 31, "limit": 5, "remaining": 0}

Every decision is one prepared SQL statement (rl_fixed, rl_sliding or
rl_check, plus rl_headers) on a pooled PostgreSQL session; the counters live
in Redis, so any number of processes and hosts running this service (and SQL
code using the same identity and limit) share one quota.

Python standard library (asyncio) plus psycopg 3 (Debian: python3-psycopg):

    /usr/bin/python3 server.py --dsn 'host=127.0.0.1 dbname=app user=ratelimiter' --workers 2

See README.md next to this file: why asyncio and not a framework, the
options, the limits it enforces and the benchmark figures.
"""

import argparse
import asyncio
import collections
import errno
import json
import math
import os
import re
import resource
import signal
import socket
import sys
import time
import traceback
from http import HTTPStatus

import psycopg
from psycopg import pq

# ---------------------------------------------------------------- limits

MAX_HEAD_BYTES = 8 * 1024     # request line and header fields, 431 above
MAX_HEADER_FIELDS = 64        # 431 above
MAX_BODY_BYTES = 64 * 1024    # 413 above
LINGER_SECONDS = 2.0          # after a response that closes: wait for the client's FIN
SWEEP_SECONDS = 0.25          # how often deadlines are checked
INT32_MAX = 2147483647

FIXED = "/api/v1/rate-limiter/fixed-window"
SLIDING = "/api/v1/rate-limiter/sliding-window"
POLICY = "/api/v1/rate-limiter/policy"
HEALTHZ = "/healthz"
ENDPOINTS = (FIXED, SLIDING, POLICY)

_RESULT = "r.allowed, r.lim, r.remaining, r.reset_ms, r.retry_after_ms"
# Prepared on every session when it is opened; one round trip per request.
STATEMENTS = {
    FIXED: "SELECT %s, rl_headers(r)::text "
           "FROM rl_fixed($1::text, $2::integer, $3::bigint, $4::integer) AS r" % _RESULT,
    SLIDING: "SELECT %s, rl_headers(r)::text "
             "FROM rl_sliding($1::text, $2::integer, $3::bigint, $4::integer) AS r" % _RESULT,
    POLICY: "SELECT %s, rl_headers(r, $2::text)::text "
            "FROM rl_check($2::text, $1::text, $3::integer) AS r" % _RESULT,
    HEALTHZ: "SELECT rtt_ms FROM rl_redis_ping()",
}
STATEMENT_NAMES = {path: ("rl_http_%d" % i).encode() for i, path in enumerate(STATEMENTS)}


def log(msg):
    """One line on stderr. Never raises: a closed stderr must not stop the service."""
    now = time.time()
    line = "%s.%03d [%d] %s\n" % (time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(now)),
                                  int(now * 1000) % 1000, os.getpid(), msg)
    try:
        sys.stderr.write(line)
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def _first_line(e):
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


# ---------------------------------------------------------------- request bodies


class BadRequest(Exception):
    """A 400 answer; the message names the offending field."""


def _no_duplicate_keys(pairs):
    obj = {}
    for key, value in pairs:
        if key in obj:
            raise BadRequest("malformed JSON body: duplicate key %s" % json.dumps(key))
        obj[key] = value
    return obj


def _no_constants(name):
    raise BadRequest("malformed JSON body: %s is not a JSON number" % name)


def _short(value):
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _int_field(body, field, minimum, maximum, default=None):
    value = body.get(field)
    if value is None:
        if default is not None:
            return default
        raise BadRequest("%s is required (a positive integer)" % field)
    # bool is an int subclass in Python; 5.0 is not an integer in this API
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest("%s must be an integer, got %s" % (field, _short(value)))
    if value < minimum:
        raise BadRequest("%s must be %s, got %d" % (
            field, "greater than zero" if minimum == 1 else "at least %d" % minimum, value))
    if value > maximum:
        raise BadRequest("%s must be at most %d, got %d" % (field, maximum, value))
    return value


# the longest identity accepted (a Redis key each)
MAX_IDENTITY_BYTES = 512


def _text_field(body, field, what):
    value = body.get(field)
    if value is None:
        raise BadRequest("%s is required (%s)" % (field, what))
    if not isinstance(value, str):
        raise BadRequest("%s must be a string, got %s" % (field, _short(value)))
    if not value.strip():
        raise BadRequest("%s must not be blank" % field)
    if "\x00" in value:
        raise BadRequest("%s must not contain NUL characters" % field)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        # "\ud800" is valid JSON syntax but not a Unicode character
        raise BadRequest("%s must be valid Unicode: it contains a lone surrogate" % field)
    return value


POLICY_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,63}")
FIELDS = {
    FIXED: ("identity", "limit", "windowSeconds", "cost"),
    SLIDING: ("identity", "limit", "windowSeconds", "cost"),
    POLICY: ("identity", "policy", "cost"),
}


DECODER = json.JSONDecoder(object_pairs_hook=_no_duplicate_keys, parse_constant=_no_constants)


def parse_body(path, raw):
    """The request body of a decision endpoint -> the statement's parameters
    (a list of bytes); raises BadRequest."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest("malformed JSON body: not UTF-8 (%s at byte %d)" % (e.reason, e.start))
    try:
        body = DECODER.decode(text)
    except RecursionError:
        raise BadRequest("malformed JSON body: nested too deeply")
    except ValueError as e:  # JSONDecodeError; also an integer of more than 4300 digits
        raise BadRequest("malformed JSON body: %s" % e)
    if not isinstance(body, dict):
        raise BadRequest("malformed JSON body: expected an object with %s" % ", ".join(FIELDS[path][:-1]))
    for key in body:
        if key not in FIELDS[path]:
            hint = ""
            if key == "policy":
                hint = "; named policies are decided by POST %s" % POLICY
            elif key in ("limit", "windowSeconds"):
                hint = "; a policy's limits come from the database"
            raise BadRequest("unknown field %s (this endpoint takes %s)%s"
                             % (_short(key), ", ".join(FIELDS[path]), hint))

    identity = _text_field(body, "identity", "a non-blank string")
    if len(identity.encode("utf-8")) > MAX_IDENTITY_BYTES:
        # every identity is a Redis key for up to a window: keep them small
        raise BadRequest("identity must be at most %d bytes of UTF-8, got %d"
                         % (MAX_IDENTITY_BYTES, len(identity.encode("utf-8"))))
    if path == POLICY:
        policy = _text_field(body, "policy", "the name of a policy")
        if not POLICY_NAME.fullmatch(policy):
            raise BadRequest("policy must be a policy name (letters, digits, _ . : -, under 64 bytes), got %s"
                             % _short(policy))
        cost = _int_field(body, "cost", 0, INT32_MAX, default=1)
        return [identity.encode(), policy.encode(), b"%d" % cost]

    limit = _int_field(body, "limit", 1, INT32_MAX)
    # windowSeconds * 1000 stays far below the 100 years the extension accepts
    window_seconds = _int_field(body, "windowSeconds", 1, INT32_MAX)
    cost = _int_field(body, "cost", 0, INT32_MAX, default=1)
    if cost > limit:
        raise BadRequest("cost must be at most limit (%d), got %d: it could never be allowed" % (limit, cost))
    return [identity.encode(), b"%d" % limit, b"%d" % (window_seconds * 1000), b"%d" % cost]


# ---------------------------------------------------------------- PostgreSQL


class DatabaseError(Exception):
    """The database did not decide. `public` goes to the client, `detail`
    (which may name hosts and ports) only to the log; `sqlstate` is None
    when there was no SQL error (connection trouble, pool timeout)."""

    def __init__(self, public, detail, sqlstate=None, message=None):
        super().__init__(public)
        self.public = public
        self.detail = detail
        self.sqlstate = sqlstate
        self.message = message  # the primary message of an SQL error


class Session:
    """One autocommit PostgreSQL session, used by one request at a time.

    psycopg opens it (`Connection.pgconn` then gives libpq's asynchronous
    API): a request sends one prepared statement, and the reply is read when
    the socket is readable, in the event loop's callback, which answers the
    request right there. That is a fraction of the CPU time of psycopg's
    cursor layer (about 60 us a query instead of 250 us here), and the
    request path is where that matters. The socket stays registered with the
    event loop, so a session that the server ends while it is idle (restart,
    pg_terminate_backend) is noticed at once and never handed to a request.
    """

    def __init__(self, conn, loop):
        self.conn = conn
        self.pg = conn.pgconn
        self.loop = loop
        self.fd = self.pg.socket
        self.broken = False
        self.on_reply = None  # on_reply(result, error) of the command in progress
        self.results = []
        self.timer = None
        loop.add_reader(self.fd, self._readable)

    @classmethod
    async def open(cls, conninfo, application_name, statement_timeout_ms):
        conn = await psycopg.AsyncConnection.connect(
            conninfo, autocommit=True, application_name=application_name)
        self = cls(conn, asyncio.get_running_loop())
        try:
            if statement_timeout_ms:
                await self.run(lambda: self.pg.send_query_params(
                    b"SELECT set_config('statement_timeout', $1, false)", [b"%d" % statement_timeout_ms]))
            for path, sql in STATEMENTS.items():
                await self.run(lambda: self.pg.send_prepare(STATEMENT_NAMES[path], sql.encode()))
        except BaseException:
            self.close()
            raise
        return self

    def start(self, send, on_reply, timeout=None):
        """send() puts one command in libpq's queue; on_reply(result, error)
        is called once, with its PGresult or a DatabaseError (maybe before
        start returns)."""
        if self.broken:
            on_reply(None, DatabaseError("the database connection was lost", "closed before use"))
            return
        self.results = []
        self.on_reply = on_reply
        if timeout:
            self.timer = self.loop.call_later(timeout, self._lost, "no reply within %g s" % timeout)
        try:
            send()
            if self.pg.flush():  # only for a command larger than the socket's buffer
                self.loop.add_writer(self.fd, self._writable)
        except psycopg.OperationalError as e:
            self._lost(_first_line(e))

    async def run(self, send, timeout=None):
        """start() as a coroutine: returns the PGresult or raises DatabaseError."""
        fut = self.loop.create_future()

        def done(res, err):
            if not fut.done():
                fut.set_exception(err) if err else fut.set_result(res)

        self.start(send, done, timeout)
        try:
            return await fut
        except asyncio.CancelledError:
            self._lost("cancelled")  # mid-query: the session can't be reused
            raise

    def _writable(self):
        try:
            if not self.pg.flush():
                self.loop.remove_writer(self.fd)
        except psycopg.OperationalError as e:
            self._lost(_first_line(e))

    def _readable(self):
        try:
            self.pg.consume_input()
        except psycopg.OperationalError as e:
            self._lost(_first_line(e))
            return
        if self.on_reply is None:
            # Nothing was asked. An idle session gets a message only when the
            # server ends it (a FATAL error, then EOF): drop it now, before a
            # request picks it, rather than when the EOF arrives.
            self._lost("the server ended the session")
            return
        while not self.pg.is_busy():
            res = self.pg.get_result()
            if res is None:
                self._reply(*self._outcome())
                return
            self.results.append(res)

    def _outcome(self):
        res = self.results[0] if self.results else None
        if res is not None and res.status != pq.ExecStatus.FATAL_ERROR:
            return res, None
        sqlstate = (res.error_field(pq.DiagnosticField.SQLSTATE) or b"").decode() if res else ""
        message = (res.error_field(pq.DiagnosticField.MESSAGE_PRIMARY) or b"").decode(
            "utf-8", "replace") if res else "no result"
        return None, DatabaseError("the decision failed" + (" (SQLSTATE %s)" % sqlstate if sqlstate else ""),
                                   message, sqlstate or None, message)

    def _reply(self, res, err):
        on_reply, self.on_reply = self.on_reply, None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        on_reply(res, err)

    def _lost(self, why):
        if self.broken:
            return
        self.close()
        if self.on_reply is not None:
            self._reply(None, DatabaseError("the database connection was lost", why))

    def close(self):
        self.broken = True
        if self.fd is not None:
            self.loop.remove_reader(self.fd)
            self.loop.remove_writer(self.fd)
            self.fd = None
        self.pg.finish()


class Pool:
    """At most `size` sessions, opened on demand, reused most recent first.
    A request that finds none free waits up to `timeout` seconds, and
    opening one takes at most as long. A connection error is the answer
    (503) at once, so an outage costs each request one refused connection,
    not a wait."""

    def __init__(self, conninfo, size, timeout, statement_timeout_ms):
        self.conninfo = conninfo
        self.size = size
        self.timeout = timeout
        self.statement_timeout_ms = statement_timeout_ms
        self.application_name = _application_name(conninfo)
        self.idle = []
        self.sessions = set()  # open ones, idle or in use
        self.opening = 0
        self.waiters = collections.deque()
        self.closed = False

    def take(self):
        """An idle session now, or None."""
        while self.idle:
            session = self.idle.pop()
            if not session.broken:
                return session
            self.sessions.discard(session)
        return None

    async def acquire(self, timeout=None):
        loop = asyncio.get_running_loop()
        while True:
            session = self.take()
            if session is not None:
                return session
            if self.closed:
                raise DatabaseError("the service is shutting down", "pool closed")
            if len(self.sessions) + self.opening < self.size:
                self.opening += 1
                try:
                    session = await asyncio.wait_for(
                        Session.open(self.conninfo, self.application_name, self.statement_timeout_ms),
                        self.timeout)
                except BaseException as e:
                    self._hand_over(None)  # a waiter may try in this slot
                    if isinstance(e, (psycopg.Error, asyncio.TimeoutError)):
                        raise DatabaseError("could not connect to the database",
                                            _first_line(e) if str(e) else "no connection within %g s"
                                            % self.timeout) from None
                    raise
                finally:
                    self.opening -= 1
                self.sessions.add(session)
                return session
            fut = loop.create_future()
            self.waiters.append(fut)
            wait = self.timeout if timeout is None else timeout
            timer = loop.call_later(wait, _expire, fut, wait)
            try:
                session = await fut
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled() and fut.exception() is None and fut.result():
                    self.release(fut.result())
                raise
            finally:
                timer.cancel()
            if session is not None:
                return session
            # a slot was freed: open a session in it (next turn of the loop)

    def release(self, session):
        if session.broken or self.closed:
            session.close()
            self.sessions.discard(session)
            self._hand_over(None)
        elif not self._hand_over(session):
            self.idle.append(session)

    def _hand_over(self, session):
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_result(session)
                return True
        return False

    def close(self):
        """Closes every session; a request still waiting on one gets a 503."""
        self.closed = True
        self.idle = []
        for session in list(self.sessions):
            session._lost("the service is shutting down")
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_exception(DatabaseError("the service is shutting down", "pool closed"))


def _expire(fut, wait):
    if not fut.done():
        fut.set_exception(DatabaseError("no database connection available",
                                        "no database connection free after %.1f s" % wait))


def _application_name(conninfo):
    try:
        given = psycopg.conninfo.conninfo_to_dict(conninfo).get("application_name")
    except psycopg.ProgrammingError:
        given = None
    return given or os.environ.get("PGAPPNAME") or "rl_redis_http_service"


# ---------------------------------------------------------------- the application


class App:
    """A complete request's answer: reply(status, payload, extra headers) is
    called once, from a callback of the event loop or (a 503 at once)
    before decide() returns."""

    def __init__(self, pool, args):
        self.pool = pool
        self.query_timeout = (args.statement_timeout_ms / 1000.0 + 5.0) if args.statement_timeout_ms else None
        self.draining = False
        self.tasks = set()  # the loop keeps only weak references to tasks

    def _spawn(self, coro):
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def decide(self, path, params, reply):
        session = self.pool.take()
        if session is not None:  # the usual case: no task, no wait
            self._send(session, path, params, reply)
        else:
            self._spawn(self._decide_when_free(path, params, reply))

    async def _decide_when_free(self, path, params, reply):
        try:
            session = await self.pool.acquire()
        except DatabaseError as e:
            reply(*self._unavailable(path, params, e))
            return
        self._send(session, path, params, reply)

    def _send(self, session, path, params, reply):
        def done(res, err):
            self.pool.release(session)
            try:
                answer = self._answer(path, params, res, err)
            except Exception:
                log("500 %s: %s" % (path, traceback.format_exc().replace("\n", " | ")))
                answer = 500, {"error": "internal error"}, ()
            reply(*answer)

        session.start(lambda: session.pg.send_query_prepared(STATEMENT_NAMES[path], params), done,
                      self.query_timeout)

    def _answer(self, path, params, res, err):
        if err is not None:
            if err.sqlstate in ("22023", "42704", "54000"):
                # invalid_parameter_value (a sliding limit above rl_redis.sliding_max_lim,
                # a concurrency policy), undefined_object (no such policy),
                # program_limit_exceeded (an identity over rl_redis.max_identity_bytes):
                # the request
                return 400, {"error": self._client_error(path, err)}, ()
            return self._unavailable(path, params, err)

        allowed = res.get_value(0, 0) == b"t"
        lim, remaining = int(res.get_value(0, 1)), int(res.get_value(0, 2))
        retry_after_ms = int(res.get_value(0, 4))
        if not allowed and retry_after_ms < 0:
            # cost above the policy's limit (or burst): never allowed
            return 400, {"error": "cost %s is above the limit %d of policy %s: it could never be allowed"
                         % (params[2].decode(), lim, params[1].decode())}, ()
        headers = []
        for obj in json.loads(res.get_value(0, 5)):
            for name, value in obj.items():
                if name != "Retry-After":
                    headers.append((name, str(value)))
        if allowed and retry_after_ms <= 0:
            retry_after_s = 0
        else:
            # a denial, or a shadow policy's would-be denial (allowed, with
            # the wait enforcing would give)
            retry_after_s = max(1, math.ceil(retry_after_ms / 1000))
            headers.append(("Retry-After", str(retry_after_s)))
        return (200 if allowed else 429), {
            "allow": allowed,
            "reason": "allowed" if allowed else "rate limit exceeded",
            "retryAfterSeconds": retry_after_s,
            "limit": lim,
            "remaining": remaining,
        }, headers

    @staticmethod
    def _client_error(path, err):
        if err.sqlstate == "54000":
            return "identity rejected by the database: %s" % err.message
        if path == POLICY:
            return "policy: %s" % err.message
        return "limit or windowSeconds rejected by the database: %s" % err.message

    @staticmethod
    def _unavailable(path, params, e):
        log("503 %s identity=%s: %s: %s" % (path, json.dumps(params[0].decode()), e.public, e.detail))
        return 503, {"error": "rate limiter unavailable: %s" % e.public}, (("Retry-After", "1"),)

    def health(self, reply):
        self._spawn(self._health(reply))

    async def _health(self, reply):
        if self.draining:
            return reply(503, {"status": "shutting down"}, (("Retry-After", "1"),))
        try:
            session = await self.pool.acquire(timeout=min(self.pool.timeout, 2.0))
        except DatabaseError as e:
            log("healthz: database: %s: %s" % (e.public, e.detail))
            return reply(503, {"status": "unavailable", "database": e.public}, (("Retry-After", "1"),))
        try:
            res = await session.run(lambda: session.pg.send_query_prepared(STATEMENT_NAMES[HEALTHZ], []),
                                    min(self.query_timeout or 5.0, 5.0))
        except DatabaseError as e:
            log("healthz: rl_redis_ping(): %s: %s" % (e.public, e.detail))
            redis = ("SQLSTATE %s" % e.sqlstate) if e.sqlstate else "unknown"
            return reply(503, {"status": "unavailable", "database": "ok" if e.sqlstate else e.public,
                               "redis": redis}, (("Retry-After", "1"),))
        finally:
            self.pool.release(session)
        reply(200, {"status": "ok", "database": "ok", "redis": "ok",
                    "redisRttMs": float(res.get_value(0, 0))}, ())


# ---------------------------------------------------------------- HTTP/1.1

TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
TARGET = re.compile(rb"[\x21-\x7e]+")
VERSION = re.compile(rb"HTTP/([0-9])\.([0-9])")
BAD_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
DIGITS = re.compile(rb"[0-9]+")
REASONS = {s.value: s.phrase for s in HTTPStatus}
REASONS[413] = "Content Too Large"  # RFC 9110's name


class HttpError(Exception):
    """A request that can't be taken as it is: answered with `status` and
    a JSON error, then the connection is closed."""

    def __init__(self, status, message):
        super().__init__(message)
        self.status = status
        self.message = message


class Request:
    __slots__ = ("method", "path", "line", "minor", "keep_alive", "length", "expect_continue", "t0")


def parse_head(head, t0):
    """The request line and header fields (without the final CRLF CRLF),
    RFC 9112 taken strictly: what is not clearly right is an HttpError."""
    if head.count(b"\r") != head.count(b"\r\n") or head.count(b"\n") != head.count(b"\r\n"):
        raise HttpError(400, "lines must end with CRLF (a bare CR or LF was found)")
    lines = head.split(b"\r\n")
    req = Request()
    req.t0 = t0
    req.line = lines[0]
    parts = lines[0].split(b" ")
    if len(parts) != 3:
        raise HttpError(400, "malformed request line: expected METHOD SP TARGET SP HTTP/1.1")
    method, target, version = parts
    if not TOKEN.fullmatch(method):
        raise HttpError(400, "malformed request line: invalid method")
    if not TARGET.fullmatch(target):
        raise HttpError(400, "malformed request line: invalid request target")
    m = VERSION.fullmatch(version)
    if not m:
        raise HttpError(400, "malformed request line: invalid HTTP version")
    if m.group(1) != b"1":
        raise HttpError(505, "only HTTP/1.0 and HTTP/1.1 are supported")
    req.minor = 1 if m.group(2) != b"0" else 0
    req.method = method.decode()
    if target.startswith(b"/"):
        path = target
    elif target[:7].lower() == b"http://" or target[:8].lower() == b"https://":
        path = b"/" + target.split(b"//", 1)[1].partition(b"/")[2]  # absolute-form
    else:
        raise HttpError(400, "malformed request line: the target must be a path")
    req.path = path.partition(b"?")[0].decode()

    if len(lines) - 1 > MAX_HEADER_FIELDS:
        raise HttpError(431, "more than %d header fields" % MAX_HEADER_FIELDS)
    fields = {}
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not TOKEN.fullmatch(name):
            # also obsolete line folding and whitespace before the colon (RFC 9112, 5)
            raise HttpError(400, "malformed header field line")
        value = value.strip(b" \t")
        if BAD_VALUE.search(value):
            raise HttpError(400, "control character in header field %s" % name.decode())
        fields.setdefault(name.lower(), []).append(value)

    if req.minor == 1 and len(fields.get(b"host", ())) != 1:
        raise HttpError(400, "an HTTP/1.1 request needs exactly one Host header field")
    connection = {t.strip().lower() for v in fields.get(b"connection", ()) for t in v.split(b",")}
    req.keep_alive = b"close" not in connection and (req.minor == 1 or b"keep-alive" in connection)

    lengths = fields.get(b"content-length")
    if b"transfer-encoding" in fields:
        if lengths is not None:
            raise HttpError(400, "both Transfer-Encoding and Content-Length")
        codings = [c.strip().lower() for v in fields[b"transfer-encoding"] for c in v.split(b",")]
        if req.minor == 0 or codings[-1:] != [b"chunked"]:
            raise HttpError(400, "invalid Transfer-Encoding")
        raise HttpError(411, "send the body with a Content-Length, not chunked")
    if lengths is None:
        req.length = 0
    elif len(lengths) != 1:
        raise HttpError(400, "more than one Content-Length header field")
    elif not DIGITS.fullmatch(lengths[0]):
        raise HttpError(400, "invalid Content-Length: digits only")
    else:
        req.length = int(lengths[0]) if len(lengths[0]) <= 12 else MAX_BODY_BYTES + 1
        if req.length > MAX_BODY_BYTES:
            raise HttpError(413, "request body larger than %d bytes" % MAX_BODY_BYTES)

    expect = fields.get(b"expect")
    req.expect_continue = False
    if expect is not None:
        if [e.lower() for e in expect] != [b"100-continue"]:
            raise HttpError(417, "the only expectation supported is 100-continue")
        req.expect_continue = req.minor == 1
    return req


_date_cache = [0, ""]


def http_date():
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache[0] = now
        _date_cache[1] = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(now))
    return _date_cache[1]


def render(status, payload, headers, close, keep_alive_10, head_only):
    body = (json.dumps(payload) + "\n").encode()
    out = ["HTTP/1.1 %d %s\r\nDate: %s\r\nContent-Type: application/json\r\n"
           "Cache-Control: no-store\r\nContent-Length: %d\r\n" % (status, REASONS[status], http_date(), len(body))]
    for name, value in headers:
        if "\r" not in value and "\n" not in value:
            out.append("%s: %s\r\n" % (name, value))
    if close:
        out.append("Connection: close\r\n")
    elif keep_alive_10:
        out.append("Connection: keep-alive\r\n")
    out.append("\r\n")
    head = "".join(out).encode("latin-1")
    return (head if head_only else head + body), len(body)


# connection states
IDLE, HEAD, BODY, BUSY, WRITE_WAIT, LINGER, CLOSED = range(7)


class HttpConnection(asyncio.Protocol):
    """One client connection: requests one at a time (pipelined ones wait
    their turn), each within its deadlines, each answered with one write."""

    def __init__(self, worker):
        self.w = worker
        self.buf = bytearray()
        self.state = IDLE
        self.deadline = 0.0
        self.requests = 0
        self.req = None
        self.write_paused = False
        self.reading_paused = False
        self.eof = False
        self.transport = None
        self.peer = "-"

    # -- asyncio callbacks

    def connection_made(self, transport):
        self.transport = transport
        peer = transport.get_extra_info("peername")
        if peer:
            self.peer = "%s:%s" % (peer[0], peer[1])
        # the first request's head is due within header_timeout of the accept
        self.deadline = self.w.loop.time() + self.w.header_timeout
        self.w.conns.add(self)
        self.w.waiting[self] = None
        if self.w.draining:
            self.evict()
        else:
            # accepting may have stopped while this one was still being
            # attached; as it waits for a request, it can make room
            self.w.became_idle()

    def connection_lost(self, exc):
        self.state = CLOSED
        self.w.connection_lost(self)

    def pause_writing(self):
        self.write_paused = True

    def resume_writing(self):
        self.write_paused = False
        if self.state == WRITE_WAIT:
            self._next_request()

    def eof_received(self):
        self.eof = True
        if self.state in (BUSY, WRITE_WAIT):
            return True  # answer first; close after
        if self.state == HEAD and self.buf.strip(b"\r\n"):
            self._fail(HttpError(400, "incomplete request head: the client closed its side"))
            return True
        if self.state == BODY:
            self._fail(HttpError(400, "request body shorter than its Content-Length (%d bytes): "
                                      "the client closed its side" % self.req.length))
            return True
        return False  # the transport closes

    def data_received(self, data):
        state = self.state
        if state == LINGER:
            return  # discarded: the answer has been sent
        self.buf += data
        if state == IDLE:
            self.state = HEAD
            if self.requests:
                self.deadline = self.w.loop.time() + self.w.header_timeout
            self._advance()
        elif state == HEAD or state == BODY:
            self._advance()
        elif len(self.buf) > MAX_HEAD_BYTES + MAX_BODY_BYTES and not self.reading_paused:
            # pipelined requests beyond what one request may be: wait
            self.reading_paused = True
            self.transport.pause_reading()

    # -- reading a request

    def _advance(self):
        if self.state == HEAD:
            buf = self.buf
            while buf[:2] == b"\r\n":  # RFC 9112, 2.2: empty lines before a request
                del buf[:2]
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD_BYTES:
                    return self._fail(HttpError(431, "request head larger than %d bytes" % MAX_HEAD_BYTES))
                if buf.count(b"\n") != buf.count(b"\r\n"):
                    return self._fail(HttpError(400, "lines must end with CRLF (a bare LF was found)"))
                return
            if end > MAX_HEAD_BYTES:
                return self._fail(HttpError(431, "request head larger than %d bytes" % MAX_HEAD_BYTES))
            head = bytes(buf[:end])
            del buf[:end + 4]
            try:
                self.req = parse_head(head, time.monotonic())
            except HttpError as e:
                return self._fail(e, head.partition(b"\r\n")[0])
            self.state = BODY
            self.deadline = self.w.loop.time() + self.w.body_timeout
            if self.req.expect_continue and len(buf) < self.req.length:
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if self.state == BODY:
            n = self.req.length
            if len(self.buf) < n:
                return
            body = bytes(self.buf[:n])
            del self.buf[:n]
            self._dispatch(self.req, body)

    def _dispatch(self, req, body):
        self.state = BUSY
        self.deadline = 0.0
        self.requests += 1
        self.w.waiting.pop(self, None)
        path, method = req.path, req.method
        if path in ENDPOINTS:
            if method != "POST":
                return self._respond(req, 405, {"error": "method %s not allowed on %s; use POST" % (method, path)},
                                     (("Allow", "POST"),))
            try:
                params = parse_body(path, body)
            except BadRequest as e:
                return self._respond(req, 400, {"error": str(e)})
        elif path == HEALTHZ:
            if method not in ("GET", "HEAD"):
                return self._respond(req, 405, {"error": "method %s not allowed on %s; use GET" % (method, path)},
                                     (("Allow", "GET, HEAD"),))
            params = None
        else:
            return self._respond(req, 404, {"error": "no such endpoint: %s" % path})
        if self.w.in_flight >= self.w.max_in_flight:
            return self._respond(req, 503, {"error": "rate limiter unavailable: too many requests in flight"},
                                 (("Retry-After", "1"),))
        self.w.in_flight += 1
        self.req = req
        if params is None:
            self.w.app.health(self._decided)
        else:
            self.w.app.decide(path, params, self._decided)

    def _decided(self, status, payload, headers):
        self.w.in_flight -= 1
        self._respond(self.req, status, payload, headers)  # logged as "client gone" if it went away

    # -- answering

    def _respond(self, req, status, payload, headers=()):
        close = not req.keep_alive or self.eof or self.w.draining
        data, n = render(status, payload, headers, close, req.keep_alive and req.minor == 0,
                         req.method == "HEAD")
        gone = self.transport.is_closing()
        if not gone:
            self.transport.write(data)
        self.w.access(self, req, status, n, "client gone" if gone else None)
        if gone:
            return
        if close:
            return self._linger()
        self._next_request()

    def _next_request(self):
        if self.write_paused:
            self.state = WRITE_WAIT  # the client reads slowly (or not at all)
            self.deadline = self.w.loop.time() + self.w.body_timeout
            return
        self.state = IDLE
        self.req = None
        self.deadline = self.w.loop.time() + self.w.keepalive_timeout
        self.w.waiting[self] = None
        if self.reading_paused:
            self.reading_paused = False
            self.transport.resume_reading()
        if self.buf:  # pipelined: the next one is already here
            self.state = HEAD
            self.deadline = self.w.loop.time() + self.w.header_timeout
            self.w.loop.call_soon(self._advance)
        self.w.became_idle()

    def _fail(self, err, line=None):
        """An HttpError before the request was complete: answer it, close."""
        req = self.req if self.state == BODY else None
        if req is None:
            req = Request()
            req.method, req.path, req.minor, req.t0 = "-", "-", 1, time.monotonic()
            req.line = line if line is not None else bytes(self.buf[:80]).partition(b"\r\n")[0]
        req.keep_alive = False
        self.state = BUSY
        self.w.waiting.pop(self, None)
        self._respond(req, err.status, {"error": err.message})

    def _linger(self):
        """Closes after the answer: shut our side down, read and drop what
        the client still sends until it closes (LINGER_SECONDS at most), so
        that unread data can't make the kernel reset the connection before
        the client has read the answer."""
        self.state = LINGER
        self.buf = bytearray()
        self.w.waiting.pop(self, None)
        self.deadline = self.w.loop.time() + LINGER_SECONDS
        if self.reading_paused:
            self.reading_paused = False
            self.transport.resume_reading()
        if self.eof or not self.transport.can_write_eof():
            self.transport.close()
        else:
            self.transport.write_eof()

    def expire(self):
        """The deadline of the current state has passed."""
        state = self.state
        if state == IDLE:
            self._close()  # idle keep-alive (or a connection that never sent a byte)
        elif state == HEAD:
            self._fail(HttpError(408, "request head not received within %g s" % self.w.header_timeout))
        elif state == BODY:
            self._fail(HttpError(408, "request body not received within %g s" % self.w.body_timeout))
        else:  # WRITE_WAIT, LINGER
            self.transport.abort()

    def evict(self):
        """Closes a connection waiting for a request, for a new one (at
        --max-connections) or at shutdown. It no longer counts from now."""
        self.deadline = 0.0
        self.w.waiting.pop(self, None)
        self.w.conns.discard(self)
        if self.state == IDLE:
            self._close()
        else:
            self.transport.abort()

    def _close(self):
        """Closes an idle connection; one with answers still unsent (a
        client that pipelines and never reads) is aborted: close() would
        wait for them without end, and the connection would no longer be
        counted."""
        if self.transport.get_write_buffer_size() > 0:
            self.transport.abort()
        else:
            self.transport.close()


# ---------------------------------------------------------------- one worker process


class Worker:
    def __init__(self, loop, lsock, app, args):
        self.loop = loop
        self.lsock = lsock
        self.app = app
        self.max_connections = args.max_connections
        self.max_in_flight = args.max_in_flight
        self.header_timeout = args.header_timeout
        self.body_timeout = args.body_timeout
        self.keepalive_timeout = args.keepalive_timeout
        self.access_log = args.access_log
        self.conns = set()
        self.pending = 0                 # accepted, transport not made yet
        self.attaching = set()
        self.waiting = {}                # connections waiting for a request, oldest first
        self.in_flight = 0
        self.accepting = False
        self.resume_timer = None
        self.accept_errors = 0
        self.accept_error_logged = -1e9
        self.full_logged = 0.0
        self.draining = False
        self.sweeper = None

    def start(self):
        self._accept_on()
        self.sweeper = self.loop.call_later(SWEEP_SECONDS, self._sweep)

    def _accept_on(self):
        if not self.accepting and not self.draining:
            self.accepting = True
            self.loop.add_reader(self.lsock.fileno(), self._accept)

    def _accept_off(self):
        if self.accepting:
            self.accepting = False
            self.loop.remove_reader(self.lsock.fileno())

    def _accept(self):
        for _ in range(64):
            if len(self.conns) + self.pending >= self.max_connections and not self.waiting:
                # every connection has a request in progress or is still
                # being attached: new ones wait in the backlog until one of
                # them waits for a request (connection_made, became_idle)
                self._accept_off()
                now = self.loop.time()
                if now - self.full_logged > 10:
                    self.full_logged = now
                    log("at --max-connections (%d), none waiting for a request: new connections wait"
                        % self.max_connections)
                return
            try:
                sock, _ = self.lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.ECONNABORTED, errno.EPERM, errno.EPROTO):
                    continue  # that client is gone already
                # EMFILE, ENFILE (no file descriptor: accept needs one even
                # when nothing is pending), ENOBUFS, ENOMEM: stop accepting for a
                # moment; the connections already open keep being served
                self.accept_errors += 1
                now = self.loop.time()
                if now - self.accept_error_logged >= 10:
                    log("accept: %s (%d times in the last 10 s): pausing accept for 0.5 s at a time"
                        % (os.strerror(e.errno), self.accept_errors))
                    self.accept_error_logged = now
                    self.accept_errors = 0
                self._accept_off()
                self.resume_timer = self.loop.call_later(0.5, self._resume_accept)
                return
            if len(self.conns) + self.pending >= self.max_connections:
                next(iter(self.waiting)).evict()  # the one waiting longest for a request
            self.pending += 1
            sock.setblocking(False)
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
            task = self.loop.create_task(self._attach(sock))
            self.attaching.add(task)  # the loop keeps only a weak reference
            task.add_done_callback(self.attaching.discard)

    async def _attach(self, sock):
        try:
            await self.loop.connect_accepted_socket(lambda: HttpConnection(self), sock)
        except OSError:
            sock.close()
        finally:
            self.pending -= 1

    def _resume_accept(self):
        self.resume_timer = None
        self._accept_on()

    def connection_lost(self, conn):
        self.conns.discard(conn)
        self.waiting.pop(conn, None)
        if not self.accepting and self.resume_timer is None:
            self._accept_on()

    def became_idle(self):
        if not self.accepting and self.resume_timer is None:
            self._accept_on()  # an idle connection can make room for a new one

    def _sweep(self):
        now = self.loop.time()
        for conn in list(self.conns):
            if conn.deadline and now >= conn.deadline:
                conn.expire()
        self.sweeper = self.loop.call_later(SWEEP_SECONDS, self._sweep)

    def access(self, conn, req, status, nbytes, note=None):
        if not self.access_log:
            return
        line = req.line.decode("latin-1")
        if len(line) > 200:
            line = line[:200] + "..."
        ms = (time.monotonic() - req.t0) * 1000
        log('%s %s %s %s %.2fms%s' % (conn.peer, json.dumps(line), status, nbytes, ms,
                                      " (%s)" % note if note else ""))

    async def drain(self, timeout):
        """Stop accepting; close connections waiting for a request; let the
        requests in progress finish (their answers say Connection: close)."""
        self.draining = True
        self.app.draining = True
        self._accept_off()
        if self.resume_timer is not None:
            self.resume_timer.cancel()
        self.lsock.close()
        for conn in list(self.waiting):
            if conn.state == IDLE:
                conn.evict()
        deadline = self.loop.time() + timeout
        while self.conns and self.loop.time() < deadline:
            await asyncio.sleep(0.05)
        for conn in list(self.conns):
            conn.transport.abort()
        if self.sweeper is not None:
            self.sweeper.cancel()
        await asyncio.sleep(0)


async def serve(args, lsock):
    loop = asyncio.get_running_loop()
    pool = Pool(args.dsn, args.pool_size, args.pool_timeout, args.statement_timeout_ms)
    app = App(pool, args)
    worker = Worker(loop, lsock, app, args)
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    worker.start()
    await stop.wait()
    log("shutting down: %d connections, %d requests in flight" % (len(worker.conns), worker.in_flight))
    await worker.drain(args.shutdown_timeout)
    pool.close()


def run_worker(args, lsock):
    try:
        asyncio.run(serve(args, lsock))
    except Exception:
        log("worker failed: %s" % traceback.format_exc())
        return 1
    return 0


# ---------------------------------------------------------------- startup, workers


def check_database(dsn):
    """Once at startup: warn about what would make every request a 503."""
    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=5,
                             application_name=_application_name(dsn)) as conn:
            row = conn.execute("SELECT extversion FROM pg_extension WHERE extname = 'rl_redis'").fetchone()
            if row is None:
                log("warning: extension rl_redis is not installed in this database (CREATE EXTENSION rl_redis)")
                return
            missing = [f for f in ("rl_fixed(text,integer,bigint,integer)",
                                   "rl_sliding(text,integer,bigint,integer)",
                                   "rl_check(text,text,integer)")
                       if not conn.execute("SELECT has_function_privilege(%s, 'EXECUTE')", (f,)).fetchone()[0]]
            if missing:
                log("warning: this role may not execute %s: those requests get 503 (see README.md, GRANT)"
                    % ", ".join(missing))
    except psycopg.Error as e:
        log("warning: database not reachable yet: %s" % _first_line(e))


def raise_fd_limit(args):
    """Every connection is a file descriptor: make the soft limit as large
    as allowed, and lower --max-connections if it still does not fit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = args.max_connections + args.pool_size + 64
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < need:
        args.max_connections = max(1, soft - args.pool_size - 64)
        log("warning: the file descriptor limit is %d: --max-connections lowered to %d"
            % (soft, args.max_connections))


def listen_sockets(host, port, count):
    """count listening sockets on one port. Several workers each get their
    own SO_REUSEPORT socket, and the kernel spreads new connections over
    them; the bind without it first makes sure nobody else holds the port."""
    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                               flags=socket.AI_PASSIVE)[0]
    probe = socket.socket(family, socket.SOCK_STREAM)
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    probe.bind(addr)
    if count == 1:
        probe.listen(1024)
        probe.setblocking(False)
        return [probe]
    addr = probe.getsockname()
    probe.close()
    socks = []
    for _ in range(count):
        s = socket.socket(family, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(addr)
        s.listen(1024)
        s.setblocking(False)
        socks.append(s)
    return socks


def supervise(args, socks):
    """The parent of several workers: starts them, starts a new one when one
    dies, forwards SIGTERM/SIGINT and waits for them to drain."""
    signals = {signal.SIGTERM, signal.SIGINT, signal.SIGCHLD}
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    workers = {}  # pid -> index

    def spawn(i):
        pid = os.fork()
        if pid == 0:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)
            for j, s in enumerate(socks):
                if j != i:
                    s.close()
            status = 1
            try:
                status = run_worker(args, socks[i])
            finally:
                os._exit(status)
        workers[pid] = (i, time.monotonic())

    for i in range(len(socks)):
        spawn(i)
    print_listening(socks[0])

    stopping = False
    failed = False
    kill_at = None
    while workers:
        info = signal.sigtimedwait(signals, 0.5)
        if info is not None and info.si_signo in (signal.SIGTERM, signal.SIGINT) and not stopping:
            stopping = True
            log("shutting down %d workers" % len(workers))
            for s in socks:
                s.close()  # the workers close theirs: nothing listens any more
            for pid in workers:
                os.kill(pid, signal.SIGTERM)
            kill_at = time.monotonic() + args.shutdown_timeout + 5
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            i, started = workers.pop(pid)
            code = os.waitstatus_to_exitcode(status)
            if stopping:
                failed |= code != 0
            else:
                log("worker %d exited with status %d; starting a new one" % (pid, code))
                if time.monotonic() - started < 1:
                    time.sleep(1)  # do not spin on a worker that dies at once
                spawn(i)
        if kill_at is not None and time.monotonic() > kill_at:
            for pid in workers:
                os.kill(pid, signal.SIGKILL)
            failed = True
            kill_at = None
    return 1 if failed else 0


def print_listening(sock):
    host, port = sock.getsockname()[:2]
    if ":" in host:
        host = "[%s]" % host
    print("listening on http://%s:%d" % (host, port), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description="HTTP rate-limit service on rl_redis")
    ap.add_argument("--dsn", default="", help="libpq connection string (default: PG* environment variables)")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=8081, help="port to listen on (default 8081; 0 = any free port)")
    ap.add_argument("--workers", type=int, default=1,
                    help="worker processes, one per core to use (default 1)")
    ap.add_argument("--pool-size", type=int, default=8,
                    help="PostgreSQL sessions per worker at most (default 8)")
    ap.add_argument("--pool-timeout", type=float, default=5.0,
                    help="seconds a request waits for a free session before 503 (default 5)")
    ap.add_argument("--statement-timeout-ms", type=int, default=5000,
                    help="statement_timeout of the sessions, 0 = the server's (default 5000)")
    ap.add_argument("--max-connections", type=int, default=1000,
                    help="open client connections per worker at most (default 1000)")
    ap.add_argument("--max-in-flight", type=int, default=128,
                    help="requests being decided per worker at most; more get 503 (default 128)")
    ap.add_argument("--header-timeout", type=float, default=10.0,
                    help="seconds for a request line and headers to arrive (default 10)")
    ap.add_argument("--body-timeout", type=float, default=10.0,
                    help="seconds for a request body to arrive, and for a client to read an answer (default 10)")
    ap.add_argument("--keepalive-timeout", type=float, default=75.0,
                    help="seconds an idle keep-alive connection stays open (default 75)")
    ap.add_argument("--shutdown-timeout", type=float, default=10.0,
                    help="seconds SIGTERM waits for requests in progress (default 10)")
    ap.add_argument("--no-access-log", dest="access_log", action="store_false", default=True,
                    help="no line per request on stderr (errors are always logged)")
    ap.add_argument("--access-log", dest="access_log", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for name in ("workers", "pool_size", "max_connections", "max_in_flight"):
        if getattr(args, name) < 1:
            ap.error("--%s must be at least 1" % name.replace("_", "-"))
    for name in ("pool_timeout", "header_timeout", "body_timeout", "keepalive_timeout", "shutdown_timeout"):
        if not getattr(args, name) > 0:
            ap.error("--%s must be greater than 0" % name.replace("_", "-"))

    raise_fd_limit(args)
    check_database(args.dsn)
    try:
        socks = listen_sockets(args.host, args.port, args.workers)
    except OSError as e:
        log("cannot listen on %s:%d: %s" % (args.host, args.port, e))
        return 1
    if args.workers > 1:
        return supervise(args, socks)
    print_listening(socks[0])
    return run_worker(args, socks[0])


if __name__ == "__main__":
    sys.exit(main())
