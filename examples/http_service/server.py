#!/usr/bin/python3
"""A small HTTP rate-limit decision service on top of the rl_redis extension.

    POST /api/v1/rate-limiter/fixed-window
    POST /api/v1/rate-limiter/sliding-window
    {"identity": "user:42", "limit": 5, "windowSeconds": 60}

    200 {"allow": true,  "reason": "allowed", "retryAfterSeconds": 0, "limit": 5, "remaining": 4}
    429 {"allow": false, "reason": "rate limit exceeded", "retryAfterSeconds": 31, "limit": 5, "remaining": 0}

Every decision is one SQL statement (rl_fixed or rl_sliding plus rl_headers)
on a pooled PostgreSQL connection; the counters live in Redis, so any number
of instances of this service (and any SQL caller using the same identity,
limit and window) share one quota. The service itself keeps no state. Its
database role needs EXECUTE on rl_fixed and rl_sliding (not granted to
PUBLIC since rl_redis 1.3; see README.md, "Requirements").

Python 3 standard library plus psycopg 3 (Debian: python3-psycopg):

    /usr/bin/python3 server.py --dsn 'host=127.0.0.1 port=5432 dbname=app' --port 8081

See README.md next to this file.
"""

import argparse
import json
import math
import os
import select
import signal
import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import psycopg
from psycopg import pq

ROUTES = {
    "/api/v1/rate-limiter/fixed-window": "rl_fixed",
    "/api/v1/rate-limiter/sliding-window": "rl_sliding",
}

# One statement per decision: the decision and its HTTP headers together.
DECISION_SQL = {
    func: (
        "SELECT r.allowed, r.lim, r.remaining, r.reset_ms, r.retry_after_ms, "
        "rl_headers(r)::text FROM %s(%%s, %%s, %%s) AS r" % func
    )
    for func in ROUTES.values()
}

INT32_MAX = 2147483647
MAX_BODY_BYTES = 64 * 1024
# limit is an SQL integer. windowSeconds is capped at the same value (68
# years): window_ms = windowSeconds * 1000 must stay far below the range where
# the Lua scripts lose integer precision.
MAX_LIMIT = INT32_MAX
MAX_WINDOW_SECONDS = INT32_MAX


def log(msg):
    sys.stderr.write("%s %s\n" % (time.strftime("%Y-%m-%dT%H:%M:%S"), msg))
    sys.stderr.flush()


# ---------------------------------------------------------------- validation


class BadRequest(Exception):
    """A 400 answer; the message names the offending field."""


def _positive_int(body, field, maximum):
    if field not in body or body[field] is None:
        raise BadRequest("%s is required (a positive integer)" % field)
    value = body[field]
    # bool is an int subclass in Python; 5.0 is not an integer in this API
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest("%s must be an integer, got %s" % (field, json.dumps(value)))
    if value <= 0:
        raise BadRequest("%s must be greater than zero, got %d" % (field, value))
    if value > maximum:
        raise BadRequest("%s must be at most %d, got %d" % (field, maximum, value))
    return value


def parse_request(raw):
    """bytes -> (identity, limit, window_seconds); raises BadRequest."""
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise BadRequest("malformed JSON body: %s" % e)
    if not isinstance(body, dict):
        raise BadRequest("malformed JSON body: expected an object with identity, limit and windowSeconds")

    identity = body.get("identity")
    if identity is None:
        raise BadRequest("identity is required (a non-blank string)")
    if not isinstance(identity, str):
        raise BadRequest("identity must be a string")
    if not identity.strip():
        raise BadRequest("identity must not be blank")
    if "\x00" in identity:
        raise BadRequest("identity must not contain NUL characters")

    limit = _positive_int(body, "limit", MAX_LIMIT)
    window_seconds = _positive_int(body, "windowSeconds", MAX_WINDOW_SECONDS)
    return identity, limit, window_seconds


# ---------------------------------------------------------------- connection pool


class PoolTimeout(Exception):
    pass


class ConnectionPool:
    """At most `size` autocommit connections, opened on demand, reused LIFO.

    ThreadingHTTPServer runs one thread per client connection, so a
    thread-local connection would mean one PostgreSQL backend per HTTP
    client; a bounded pool keeps the number of backends fixed instead.
    """

    def __init__(self, conninfo, size, timeout, statement_timeout_ms):
        self.conninfo = conninfo
        self.timeout = timeout
        self.statement_timeout_ms = statement_timeout_ms
        self._slots = threading.BoundedSemaphore(size)
        self._lock = threading.Lock()
        self._idle = []
        self._closed = False

    def _connect(self):
        conn = psycopg.connect(
            self.conninfo,
            autocommit=True,
            application_name=_application_name(self.conninfo),
        )
        if self.statement_timeout_ms:
            conn.execute("SELECT set_config('statement_timeout', %s, false)",
                         (str(self.statement_timeout_ms),))
        return conn

    @staticmethod
    def _usable(conn):
        """False for a connection the server has closed or is closing while
        it sat in the pool (server restart, pg_terminate_backend, idle
        timeout): an idle libpq connection has nothing to read unless the
        server sent an error or closed it."""
        if conn.closed or conn.broken:
            return False
        if conn.pgconn.transaction_status != pq.TransactionStatus.IDLE:
            return False
        try:
            poller = select.poll()
            poller.register(conn.fileno(), select.POLLIN)
            return not poller.poll(0)
        except (OSError, ValueError):
            return False

    def getconn(self):
        if not self._slots.acquire(timeout=self.timeout):
            raise PoolTimeout("no database connection free after %.1f s" % self.timeout)
        try:
            while True:
                with self._lock:
                    if self._closed:
                        raise PoolTimeout("the service is shutting down")
                    conn = self._idle.pop() if self._idle else None
                if conn is None:
                    return self._connect()
                if self._usable(conn):
                    return conn
                conn.close()
        except BaseException:
            self._slots.release()
            raise

    def putconn(self, conn, discard=False):
        try:
            keep = (
                not discard
                and not conn.closed
                and not conn.broken
                and conn.pgconn.transaction_status == pq.TransactionStatus.IDLE
            )
            with self._lock:
                if keep and not self._closed:
                    self._idle.append(conn)
                    conn = None
            if conn is not None:
                conn.close()
        finally:
            self._slots.release()

    def close(self):
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


def _application_name(conninfo):
    try:
        given = psycopg.conninfo.conninfo_to_dict(conninfo).get("application_name")
    except psycopg.ProgrammingError:
        given = None
    return given or os.environ.get("PGAPPNAME") or "rl_redis_http_service"


# ---------------------------------------------------------------- HTTP


class DecisionError(Exception):
    """The database could not decide (503). `public` goes to the client,
    `detail` (which may name hosts and ports) only to the log."""

    def __init__(self, public, detail):
        super().__init__(public)
        self.public = public
        self.detail = detail


def decide(pool, func, identity, limit, window_seconds):
    """One decision: (allowed, lim, remaining, reset_ms, retry_after_ms, headers)."""
    try:
        conn = pool.getconn()
    except PoolTimeout as e:
        raise DecisionError("no database connection available", str(e))
    except psycopg.Error as e:
        raise DecisionError("could not connect to the database", _first_line(e))
    discard = False
    try:
        row = conn.execute(DECISION_SQL[func], (identity, limit, window_seconds * 1000)).fetchone()
    except psycopg.Error as e:
        # the session survives rl_redis errors (e.g. Redis down, SQLSTATE
        # 08xxx raised by the extension); only a broken link is thrown away
        discard = conn.broken
        sqlstate = getattr(e, "sqlstate", None)
        raise DecisionError(
            "the decision failed" + (" (SQLSTATE %s)" % sqlstate if sqlstate else ""),
            _first_line(e))
    finally:
        pool.putconn(conn, discard=discard)
    allowed, lim, remaining, reset_ms, retry_after_ms, headers = row
    return allowed, lim, remaining, reset_ms, retry_after_ms, json.loads(headers)


def _first_line(e):
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: every answer has a Content-Length
    server_version = "rl_redis-http-service/1.0"
    timeout = 60  # idle keep-alive connections are closed after this

    # set on the class by make_server()
    pool = None
    access_log = False

    # -- plumbing

    def log_message(self, fmt, *args):
        if self.access_log:
            log("%s %s" % (self.address_string(), fmt % args))

    def send_json(self, status, payload, headers=()):
        body = (json.dumps(payload) + "\n").encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        for name, value in headers:
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def send_error(self, code, message=None, explain=None):
        # errors raised by BaseHTTPRequestHandler itself (bad request line,
        # header too long, unknown method...) are JSON too
        if code == HTTPStatus.NOT_IMPLEMENTED and self.command and self.path:
            self._not_post()  # any other method: 405 (or 404 off the API)
            return
        self.close_connection = True
        try:
            self.send_json(code, {"error": message or HTTPStatus(code).phrase})
        except Exception:  # the client went away
            pass

    def _route(self):
        return urlsplit(self.path).path

    def _not_post(self):
        # a body we do not read would be taken for the next request
        self.close_connection = True
        path = self._route()
        if path in ROUTES:
            self.send_json(405, {"error": "method %s not allowed on %s; use POST" % (self.command, path)},
                           headers=[("Allow", "POST")])
        else:
            self.send_json(404, {"error": "no such endpoint: %s" % path})

    do_GET = do_HEAD = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _not_post

    def _read_body(self):
        """The request body, or None after answering an error."""
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            self.close_connection = True
            self.send_json(411, {"error": "send the body with a Content-Length, not chunked"})
            return None
        length = self.headers.get("Content-Length")
        try:
            n = int(length) if length is not None else 0
            if n < 0:
                raise ValueError
        except ValueError:
            self.close_connection = True
            self.send_json(400, {"error": "invalid Content-Length header"})
            return None
        if n > MAX_BODY_BYTES:
            self.close_connection = True
            self.send_json(413, {"error": "request body larger than %d bytes" % MAX_BODY_BYTES})
            return None
        return self.rfile.read(n) if n else b""

    # -- the endpoints

    def do_POST(self):
        path = self._route()
        func = ROUTES.get(path)
        if func is None:
            # read (and drop) the body so the connection stays in sync
            if self._read_body() is not None:
                self.send_json(404, {"error": "no such endpoint: %s" % path})
            return
        raw = self._read_body()
        if raw is None:
            return
        try:
            identity, limit, window_seconds = parse_request(raw)
        except BadRequest as e:
            self.send_json(400, {"error": str(e)})
            return

        try:
            allowed, lim, remaining, reset_ms, retry_after_ms, rl_headers = decide(
                self.pool, func, identity, limit, window_seconds)
        except DecisionError as e:
            log("503 %s identity=%s: %s: %s" % (path, json.dumps(identity), e.public, e.detail))
            self.send_json(503, {"error": "rate limiter unavailable: %s" % e.public},
                           headers=[("Retry-After", "1")])
            return

        headers = []
        for obj in rl_headers:
            for name, value in obj.items():
                if not (name == "Retry-After" and not allowed):
                    headers.append((name, str(value)))
        if allowed:
            retry_after_s = 0
        else:
            # retry_after_ms is -1 only when cost > lim (never here: cost is
            # 1 and limit >= 1); fall back to the whole window then
            if retry_after_ms is None or retry_after_ms < 0:
                retry_after_ms = window_seconds * 1000
            retry_after_s = max(1, math.ceil(retry_after_ms / 1000))
            headers.append(("Retry-After", str(retry_after_s)))

        self.send_json(
            200 if allowed else 429,
            {
                "allow": allowed,
                "reason": "allowed" if allowed else "rate limit exceeded",
                "retryAfterSeconds": retry_after_s,
                "limit": lim,
                "remaining": remaining,
            },
            headers=headers,
        )


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128


def default_dsn():
    """'' lets libpq take everything from PGHOST, PGPORT, PGUSER, ... ."""
    return ""


def main(argv=None):
    ap = argparse.ArgumentParser(description="HTTP rate-limit service on rl_redis")
    ap.add_argument("--dsn", default=default_dsn(),
                    help="libpq connection string (default: PG* environment variables)")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=8081, help="port to listen on (default 8081; 0 = any free port)")
    ap.add_argument("--pool-size", type=int, default=8,
                    help="maximum number of PostgreSQL connections (default 8)")
    ap.add_argument("--pool-timeout", type=float, default=5.0,
                    help="seconds a request waits for a free connection before 503 (default 5)")
    ap.add_argument("--statement-timeout-ms", type=int, default=5000,
                    help="statement_timeout of the service's sessions, 0 = server default (default 5000)")
    ap.add_argument("--access-log", action="store_true", help="log every request to stderr")
    args = ap.parse_args(argv)
    if args.pool_size < 1:
        ap.error("--pool-size must be at least 1")

    pool = ConnectionPool(args.dsn, args.pool_size, args.pool_timeout, args.statement_timeout_ms)
    Handler.pool = pool
    Handler.access_log = args.access_log

    # Check the database once, but start anyway: requests get 503 until it works.
    try:
        conn = pool.getconn()
        try:
            row = conn.execute("SELECT extversion FROM pg_extension WHERE extname = 'rl_redis'").fetchone()
        finally:
            pool.putconn(conn)
        if row is None:
            log("warning: extension rl_redis is not installed in this database (CREATE EXTENSION rl_redis)")
    except (psycopg.Error, PoolTimeout) as e:
        log("warning: database not reachable yet: %s" % _first_line(e))

    try:
        httpd = Server((args.host, args.port), Handler)
    except OSError as e:
        log("cannot listen on %s:%d: %s" % (args.host, args.port, e))
        pool.close()
        return 1

    stop = threading.Event()

    def on_signal(signum, frame):
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    serving = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.2},
                               name="serve_forever", daemon=True)
    serving.start()
    host, port = httpd.server_address[:2]
    if ":" in host:
        host = "[%s]" % host
    print("listening on http://%s:%d" % (host, port), flush=True)

    while not stop.wait(1.0):
        pass
    log("shutting down")
    httpd.shutdown()       # no new connections are accepted
    httpd.server_close()
    # requests in flight hold a pool slot: give them a moment to finish
    deadline = time.monotonic() + 5.0
    for _ in range(args.pool_size):
        if not pool._slots.acquire(timeout=max(0.0, deadline - time.monotonic())):
            break
    pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
