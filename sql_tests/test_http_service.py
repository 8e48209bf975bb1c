"""The HTTP rate-limit service (examples/http_service/server.py), end to end.

Every test starts the real server as a subprocess (Debian's /usr/bin/python3,
the PG* variables of the test cluster) and talks to it with urllib, or with
a raw socket (RawClient) where the bytes on the wire are the point:
malformed requests, keep-alive, slow and abandoned clients. The decisions
come from the shared Redis that postgresql.conf points at.

Timing: the deadlines under test are 1 s; every assertion about time has
seconds of slack, so a loaded machine makes the tests slower, not flaky.
Speed is measured by sql_tests/bench_http.sh, not here.
"""

import json
import os
import re
import resource
import select
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid

import pytest

from conftest import fixed_units, BlackHole, free_port, new_ident, pg_connect, rl_key, same_fixed_window

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVER = os.path.join(ROOT, "examples", "http_service", "server.py")
PYTHON = "/usr/bin/python3"

FIXED = "/api/v1/rate-limiter/fixed-window"
SLIDING = "/api/v1/rate-limiter/sliding-window"
POLICY = "/api/v1/rate-limiter/policy"
HEALTHZ = "/healthz"
ENDPOINTS = [FIXED, SLIDING]
KEY_ALG = {FIXED: "fixed", SLIDING: "sliding"}

RATELIMIT_RE = re.compile(r'^"([^"]+)";r=(\d+);t=(\d+)$')


# ---------------------------------------------------------------- the server


class Response:
    def __init__(self, status, headers, raw):
        self.status = status
        self.headers = headers  # http.client.HTTPMessage: case-insensitive
        self.raw = raw
        try:
            self.json = json.loads(raw.decode("utf-8")) if raw else None
        except ValueError:
            self.json = None

    def __repr__(self):
        return "<%d %r %s>" % (self.status, self.raw, dict(self.headers))


class Service:
    """One server.py process listening on 127.0.0.1:<port>."""

    def __init__(self, log_dir, args=(), env=None):
        self.args = list(args)
        self.env = dict(os.environ if env is None else env)
        self.log_path = os.path.join(log_dir, "http_service_%s.log" % uuid.uuid4().hex[:8])
        self.proc = None
        self.port = None

    def start(self, timeout=20.0):
        for _ in range(5):
            self.port = free_port()
            if self._start_on(self.port, timeout):
                return self
        raise RuntimeError("server.py did not start; log:\n%s" % self.log())

    def _start_on(self, port, timeout):
        self.log_file = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [PYTHON, SERVER, "--host", "127.0.0.1", "--port", str(port)] + self.args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self.log_file,
            env=self.env,
            cwd=ROOT,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.1)
            if ready:
                line = self.proc.stdout.readline().decode()
                if line.startswith("listening on "):
                    assert line.strip() == "listening on http://127.0.0.1:%d" % port, line
                    self.url = "http://127.0.0.1:%d" % port
                    return True
                if line == "":  # exited (port taken since free_port()?)
                    break
            elif self.proc.poll() is not None:
                break
        self.kill()
        return False

    def signal(self, signum):
        self.proc.send_signal(signum)

    def wait(self, timeout):
        return self.proc.wait(timeout=timeout)

    def kill(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def stop(self, timeout=15.0):
        """SIGTERM; returns the exit status (None if it had to be killed)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                return None
        if self.proc.stdout:
            self.proc.stdout.close()
        self.log_file.close()
        return self.proc.returncode

    def log(self, tail=4000):
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                text = f.read()
                return text[-tail:] if tail else text
        except OSError:
            return ""

    def raw(self, timeout=15.0):
        return RawClient(self.port, timeout)

    # -- HTTP

    def request(self, method, path, body=None, timeout=30.0, headers=None):
        """body: a dict/list (sent as JSON), bytes (sent as is) or None."""
        if body is not None and not isinstance(body, bytes):
            body = json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=body, method=method)
        req.add_header("Content-Type", "application/json")
        for k, v in (headers or {}).items():
            req.add_header(k, v)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return Response(resp.status, resp.headers, resp.read())
        except urllib.error.HTTPError as e:
            with e:
                return Response(e.code, e.headers, e.read())

    def post(self, path, body, **kw):
        return self.request("POST", path, body, **kw)

    def decide(self, path, identity, limit, window_seconds):
        return self.post(path, {"identity": identity, "limit": limit, "windowSeconds": window_seconds})


def _service_factory(log_dir):
    services = []

    def start(*args, env=None):
        svc = Service(log_dir, args=args, env=env)
        services.append(svc)
        return svc.start()

    def stop_all():
        bad = []
        for svc in services:
            status = svc.stop()
            if status != 0 or "Traceback" in svc.log(tail=None):
                bad.append((status, svc.log()))
        assert bad == [], "services did not shut down cleanly (or logged a traceback): %r" % bad

    return start, stop_all


@pytest.fixture
def start_service(tmp_path):
    """start_service(*extra_args, env=None) -> a running Service. Every
    service is stopped with SIGTERM at teardown and must exit with status 0."""
    start, stop_all = _service_factory(str(tmp_path))
    yield start
    stop_all()


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """One service with the default options, shared by the tests of a
    module (in one xdist worker) that do not stop it or read its log: each
    uses identities of its own. It must shut down cleanly at the end."""
    start, stop_all = _service_factory(str(tmp_path_factory.mktemp("http_service")))
    yield start()
    stop_all()


@pytest.fixture(scope="module")
def strict_service(tmp_path_factory):
    """One service with 1 s deadlines, shared by the wire-level tests."""
    start, stop_all = _service_factory(str(tmp_path_factory.mktemp("http_strict")))
    yield start("--header-timeout", "1", "--body-timeout", "1", "--keepalive-timeout", "1")
    stop_all()


# ---------------------------------------------------------------- helpers


class RawResponse:
    def __init__(self, status, headers, body):
        self.status = status
        self.headers = headers  # lower-case name -> [values]
        self.body = body
        self.json = json.loads(body.decode("utf-8")) if body else None

    def header(self, name):
        values = self.headers.get(name.lower(), [])
        assert len(values) <= 1, self
        return values[0] if values else None

    def __repr__(self):
        return "<%d %r %r>" % (self.status, self.headers, self.body)


class RawClient:
    """A TCP connection to the service, for what urllib won't send."""

    def __init__(self, port, timeout=15.0):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.buf = b""

    def send(self, data):
        self.sock.sendall(data)

    def _fill(self):
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the connection; received %r" % self.buf)
        self.buf += chunk

    def response(self, to_head=False):
        """Reads one whole response (to_head: to a HEAD request, so without
        a body); fails if the connection ends first."""
        while b"\r\n\r\n" not in self.buf:
            self._fill()
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        version, status, _ = lines[0].split(" ", 2)
        assert version == "HTTP/1.1", lines
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers.setdefault(name.lower(), []).append(value.strip())
        length = 0 if to_head else int(headers["content-length"][0])
        while len(self.buf) < length:
            self._fill()
        body, self.buf = self.buf[:length], self.buf[length:]
        return RawResponse(int(status), headers, body)

    def closed_by_server(self, timeout):
        """True if the server closes (EOF or reset) within timeout s,
        discarding anything it still sends."""
        self.sock.settimeout(timeout)
        try:
            while self.sock.recv(65536):
                pass
            return True
        except ConnectionResetError:
            return True
        except socket.timeout:
            return False

    def close(self, reset=False):
        if reset:  # RST instead of FIN
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        self.sock.close()


def http_request(path=FIXED, body=None, method="POST", headers=None, version=b"HTTP/1.1"):
    """The bytes of one request; body: dict (JSON), bytes or None.
    headers: a list of (name, value) that replaces the default ones."""
    if body is not None and not isinstance(body, bytes):
        body = json.dumps(body).encode()
    if headers is None:
        headers = [(b"Host", b"127.0.0.1")]
        if body is not None:
            headers += [(b"Content-Type", b"application/json"), (b"Content-Length", b"%d" % len(body))]
    head = b"%s %s %s\r\n" % (method.encode(), path.encode(), version)
    head += b"".join(b"%s: %s\r\n" % (n, v) for n, v in headers)
    return head + b"\r\n" + (body or b"")


@pytest.fixture
def black_hole():
    hole = BlackHole()
    yield hole
    hole.close()


def hung_redis_dsn(hole, on_error="error", timeout_ms=1500):
    """Sessions whose decisions take timeout_ms (then fail, or answer as
    on_error says). The tests connect as a superuser, who may set these."""
    return ("options='-c rl_redis.port=%d -c rl_redis.command_timeout=%d -c rl_redis.connect_timeout=%d "
            "-c rl_redis.retry_interval=0 -c rl_redis.on_error=%s'" % (hole.port, timeout_ms, timeout_ms, on_error))


ACCESS_RE = re.compile(r'^\S+ \[(\d+)\] \S+ "(.*)" (\S+) (\d+) [\d.]+ms( \(.*\))?$')


def access_lines(svc):
    """[(pid, request line, status)] of the service's access log."""
    got = []
    for line in svc.log(tail=None).splitlines():
        m = ACCESS_RE.match(line)
        if m:
            got.append((int(m.group(1)), json.loads('"%s"' % m.group(2)), m.group(3)))
    return got



def run_in_one_window(endpoint, redis, window_ms, body):
    if endpoint == FIXED:
        return same_fixed_window(redis, window_ms, body)
    return body()


def check_allowed(resp, limit, remaining, window_seconds, name="default"):
    assert resp.status == 200, resp
    assert resp.headers["Content-Type"] == "application/json"
    assert resp.json == {
        "allow": True,
        "reason": "allowed",
        "retryAfterSeconds": 0,
        "limit": limit,
        "remaining": remaining,
    }, resp
    check_rate_headers(resp, limit, remaining, window_seconds, name)
    assert resp.headers["Retry-After"] is None, resp


def check_denied(resp, limit, window_seconds, name="default"):
    assert resp.status == 429, resp
    assert resp.headers["Content-Type"] == "application/json"
    body = resp.json
    assert body["allow"] is False, resp
    assert body["reason"] == "rate limit exceeded"
    assert body["limit"] == limit and body["remaining"] == 0, resp
    assert isinstance(body["retryAfterSeconds"], int) and body["retryAfterSeconds"] > 0, resp
    retry = resp.headers["Retry-After"]
    assert retry is not None and re.fullmatch(r"\d+", retry), resp
    assert 1 <= int(retry) <= window_seconds, resp
    assert int(retry) == body["retryAfterSeconds"], resp
    assert len(resp.headers.get_all("Retry-After")) == 1, resp
    check_rate_headers(resp, limit, 0, window_seconds, name)
    return int(retry)


def check_rate_headers(resp, limit, remaining, window_seconds, name="default"):
    assert resp.headers["X-RateLimit-Limit"] == str(limit), resp
    assert resp.headers["X-RateLimit-Remaining"] == str(remaining), resp
    reset = resp.headers["X-RateLimit-Reset"]
    assert reset is not None and 1 <= int(reset) <= window_seconds, resp
    m = RATELIMIT_RE.match(resp.headers["RateLimit"] or "")
    assert m and m.group(1) == name, resp
    assert int(m.group(2)) == remaining, resp
    assert 1 <= int(m.group(3)) <= window_seconds, resp


def concurrently(n, fn):
    """Runs fn(i) for i in range(n) in n threads released at once; returns
    the results in order."""
    barrier = threading.Barrier(n)
    results = [None] * n
    errors = []

    def worker(i):
        try:
            barrier.wait(timeout=60)
            results[i] = fn(i)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "request threads hung"
    assert errors == [], errors
    return results


# ---------------------------------------------------------------- quotas


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_quota_exhaustion(service, shared_redis, endpoint):
    limit, window = 5, 60

    def run():
        identity = new_ident("http-quota")
        got = [service.decide(endpoint, identity, limit, window) for _ in range(limit + 2)]
        return identity, got

    identity, got = run_in_one_window(endpoint, shared_redis, window * 1000, run)
    for i, resp in enumerate(got[:limit]):
        check_allowed(resp, limit, limit - 1 - i, window)
    for resp in got[limit:]:
        check_denied(resp, limit, window)

    # the identity went to the extension as given: its key (which carries
    # the limit and the window in ms) is in Redis, and the denied calls took
    # nothing
    key = rl_key(KEY_ALG[endpoint], identity, lim=limit, window_ms=window * 1000)
    if endpoint == FIXED:
        assert fixed_units(shared_redis.command("GET", key)) == str(limit)
    else:
        assert shared_redis.command("ZCARD", key) == limit


def clock_env(clock_ms):
    """The environment of a service whose sessions run on the frozen clock
    clock_ms (rl_redis.test_clock_ms, through libpq's PGOPTIONS: the tests
    connect as a superuser)."""
    env = dict(os.environ)
    env["PGOPTIONS"] = (env.get("PGOPTIONS", "") + " -c rl_redis.test_clock_ms=%d" % clock_ms).strip()
    return env


TEST_CLOCK_MS = 1800000000000  # a whole minute (2027-01-15)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_window_expiry(start_service, shared_redis, endpoint):
    """limit 2 per 1 s on the frozen clock: at T two allowed and one denied
    (Retry-After 1); a service whose clock reads T + 1 s (the window has
    passed) allows the identity again with one left."""
    limit, window = 2, 1
    # both started at once (most of a start is the interpreter's)
    before, after = concurrently(2, lambda i: start_service(env=clock_env(TEST_CLOCK_MS + 1000 * i)))
    identity = new_ident("http-expiry")
    got = [before.decide(endpoint, identity, limit, window) for _ in range(3)]
    assert [r.status for r in got] == [200, 200, 429], got
    check_allowed(got[0], limit, 1, window)
    check_allowed(got[1], limit, 0, window)
    assert check_denied(got[2], limit, window) == 1
    assert before.decide(endpoint, identity, limit, window).status == 429

    check_allowed(after.decide(endpoint, identity, limit, window), limit, 1, window)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_concurrent_requests_no_overshoot(service, shared_redis, endpoint):
    limit, window, n = 10, 60, 40

    def run():
        identity = new_ident("http-conc")
        return concurrently(n, lambda i: service.decide(endpoint, identity, limit, window))

    got = run_in_one_window(endpoint, shared_redis, window * 1000, run)
    statuses = [r.status for r in got]
    assert statuses.count(200) == limit, statuses
    assert statuses.count(429) == n - limit, statuses
    # every unit was handed out exactly once
    assert sorted(r.json["remaining"] for r in got if r.status == 200) == list(range(limit))
    for r in got:
        if r.status == 429:
            check_denied(r, limit, window)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_two_instances_share_one_quota(start_service, shared_redis, endpoint):
    a, b = start_service(), start_service()
    assert a.port != b.port
    limit, window = 4, 60

    def alternate():
        identity = new_ident("http-two")
        return [(a if i % 2 == 0 else b).decide(endpoint, identity, limit, window) for i in range(10)]

    got = run_in_one_window(endpoint, shared_redis, window * 1000, alternate)
    assert [r.status for r in got] == [200] * 4 + [429] * 6, got
    assert [r.json["remaining"] for r in got[:4]] == [3, 2, 1, 0]

    def both_at_once():
        identity = new_ident("http-two-conc")
        return concurrently(20, lambda i: (a if i % 2 == 0 else b).decide(endpoint, identity, limit, window))

    got = run_in_one_window(endpoint, shared_redis, window * 1000, both_at_once)
    assert [r.status for r in got].count(200) == limit, got
    assert [r.status for r in got].count(429) == 20 - limit, got


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_independent_identities(service, shared_redis, endpoint):
    limit, window = 3, 60

    def run():
        x, y = new_ident("http-indepX"), new_ident("http-indepY")
        got_x = [service.decide(endpoint, x, limit, window).status for _ in range(4)]
        got_y = [service.decide(endpoint, y, limit, window).status for _ in range(4)]
        # the other endpoint keeps its own counter for the same identity
        other = SLIDING if endpoint == FIXED else FIXED
        got_x_other = [service.decide(other, x, limit, window).status for _ in range(4)]
        return got_x, got_y, got_x_other

    got_x, got_y, got_x_other = same_fixed_window(shared_redis, window * 1000, run)
    assert got_x == [200, 200, 200, 429]
    assert got_y == [200, 200, 200, 429]
    assert got_x_other == [200, 200, 200, 429]


# ---------------------------------------------------------------- bad requests


VALID = {"identity": "x", "limit": 5, "windowSeconds": 60}


def without(field):
    body = dict(VALID)
    del body[field]
    return body


def with_(**kw):
    body = dict(VALID)
    body.update(kw)
    return body


BAD_REQUESTS = [
    ("blank identity", with_(identity=""), "identity"),
    ("whitespace identity", with_(identity="  \t "), "identity"),
    ("missing identity", without("identity"), "identity"),
    ("null identity", with_(identity=None), "identity"),
    ("numeric identity", with_(identity=42), "identity"),
    ("limit 0", with_(limit=0), "limit"),
    ("limit -1", with_(limit=-1), "limit"),
    ("limit abc", with_(limit="abc"), "limit"),
    ("limit '5'", with_(limit="5"), "limit"),
    ("limit 2.5", with_(limit=2.5), "limit"),
    ("limit true", with_(limit=True), "limit"),
    ("missing limit", without("limit"), "limit"),
    ("limit above int4", with_(limit=2147483648), "limit"),
    ("windowSeconds 0", with_(windowSeconds=0), "windowSeconds"),
    ("windowSeconds -60", with_(windowSeconds=-60), "windowSeconds"),
    ("windowSeconds '60'", with_(windowSeconds="60"), "windowSeconds"),
    ("windowSeconds 1.5", with_(windowSeconds=1.5), "windowSeconds"),
    ("missing windowSeconds", without("windowSeconds"), "windowSeconds"),
    ("huge windowSeconds", with_(windowSeconds=10 ** 20), "windowSeconds"),
    ("malformed JSON", b'{"identity": "x", "limit": 5,', "JSON"),
    ("not JSON", b"identity=x&limit=5&windowSeconds=60", "JSON"),
    ("empty body", b"", "JSON"),
    ("JSON array", b"[1, 2, 3]", "JSON"),
    ("invalid UTF-8", b'{"identity": "\xff", "limit": 5, "windowSeconds": 60}', "JSON"),
    # strict JSON: what json.loads alone would take, or fail on without a 400
    ("lone high surrogate", b'{"identity": "a\\ud800", "limit": 5, "windowSeconds": 60}', "identity"),
    ("lone low surrogate", b'{"identity": "\\udc00b", "limit": 5, "windowSeconds": 60}', "identity"),
    ("deeply nested JSON", b"[" * 30000 + b"]" * 30000, "JSON"),
    ("deeply nested value", b'{"identity": ' + b"[" * 20000 + b"]" * 20000 + b', "limit": 5}', "JSON"),
    ("duplicate key", b'{"identity": "x", "limit": 5, "limit": 500, "windowSeconds": 60}', "limit"),
    ("duplicate identity", b'{"identity": "x", "identity": "y", "limit": 5, "windowSeconds": 60}', "identity"),
    ("NaN", b'{"identity": "x", "limit": NaN, "windowSeconds": 60}', "JSON"),
    ("Infinity", b'{"identity": "x", "limit": 5, "windowSeconds": Infinity}', "JSON"),
    ("5000-digit integer", b'{"identity": "x", "limit": ' + b"9" * 5000 + b', "windowSeconds": 60}', "JSON"),
    ("byte order mark", b'\xef\xbb\xbf{"identity": "x", "limit": 5, "windowSeconds": 60}', "JSON"),
    ("trailing data", b'{"identity": "x", "limit": 5, "windowSeconds": 60} {}', "JSON"),
    ("NUL in identity", with_(identity="a\x00b"), "identity"),
    ("object identity", with_(identity={"a": 1}), "identity"),
    ("unknown field", with_(windowSecond=60), "windowSecond"),
    ("policy field", with_(policy="free"), "policy"),
    ("cost -1", with_(cost=-1), "cost"),
    ("cost '1'", with_(cost="1"), "cost"),
    ("cost 1.5", with_(cost=1.5), "cost"),
    ("cost above limit", with_(cost=6), "cost"),
]


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize("case, body, field", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request(service, endpoint, case, body, field):
    resp = service.post(endpoint, body)
    assert resp.status == 400, resp
    assert resp.headers["Content-Type"] == "application/json"
    assert set(resp.json) == {"error"}, resp
    assert field in resp.json["error"], resp


def test_bad_requests_take_nothing(service):
    identity = new_ident("http-bad")
    for body in ({"identity": identity, "limit": 0, "windowSeconds": 60},
                 {"identity": identity, "limit": 5, "windowSeconds": -1},
                 {"identity": identity, "limit": "5", "windowSeconds": 60}):
        assert service.post(SLIDING, body).status == 400
    check_allowed(service.decide(SLIDING, identity, 5, 60), 5, 4, 60)


@pytest.mark.parametrize("method, path, status", [
    ("POST", "/api/v1/rate-limiter/token-bucket", 404),
    ("POST", "/", 404),
    ("GET", "/api/v1/rate-limiter", 404),
    ("POST", FIXED + "/", 404),
    ("POST", "/healthz/", 404),
    ("GET", FIXED, 405),
    ("GET", SLIDING, 405),
    ("PUT", SLIDING, 405),
    ("DELETE", FIXED, 405),
    ("GET", POLICY, 405),
    ("POST", HEALTHZ, 405),
])
def test_unknown_path_and_wrong_method(service, method, path, status):
    body = VALID if method in ("POST", "PUT") else None
    resp = service.request(method, path, body)
    assert resp.status == status, resp
    assert resp.headers["Content-Type"] == "application/json"
    assert isinstance(resp.json.get("error"), str) and resp.json["error"], resp
    if status == 405:
        assert resp.headers["Allow"] == ("GET, HEAD" if path == HEALTHZ else "POST")


def test_query_string_is_ignored(service):
    identity = new_ident("http-qs")
    resp = service.post(SLIDING + "?debug=1", {"identity": identity, "limit": 2, "windowSeconds": 60})
    check_allowed(resp, 2, 1, 60)


def test_identity_passed_as_given(service, shared_redis):
    # no trimming, no prefixing: the key is the identity byte for byte
    identity = " " + new_ident("http-asis") + ":ü "
    check_allowed(service.decide(SLIDING, identity, 3, 60), 3, 2, 60)
    assert shared_redis.command("ZCARD", rl_key("sliding", identity, lim=3, window_ms=60000)) == 1
    check_allowed(service.decide(SLIDING, identity.strip(), 3, 60), 3, 2, 60)


# ---------------------------------------------------------------- failures and lifecycle


def test_database_unreachable_gives_503(start_service):
    dead = free_port()
    svc = start_service("--dsn", "host=127.0.0.1 port=%d connect_timeout=5" % dead)
    resp = svc.decide(SLIDING, new_ident("http-nodb"), 5, 60)
    assert resp.status == 503, resp
    assert set(resp.json) == {"error"} and resp.json["error"], resp


def test_redis_unreachable_gives_503(start_service):
    # the service's sessions point at a port where no Redis listens
    # (rl_redis.port is superuser-only; the tests connect as postgres)
    dead = free_port()
    svc = start_service("--dsn", "options='-c rl_redis.port=%d'" % dead)
    resp = svc.decide(FIXED, new_ident("http-noredis"), 5, 60)
    assert resp.status == 503, resp
    assert "08001" in resp.json["error"], resp
    # the session survived the error: the next request is answered the same way
    assert svc.decide(FIXED, new_ident("http-noredis"), 5, 60).status == 503


def test_ordinary_role_with_the_grants(start_service):
    """The service as its README sets it up: a LOGIN role without any other
    privilege, granted EXECUTE on rl_fixed and rl_sliding (since 1.3 they
    are not executable by PUBLIC). Before the grant: 503 with 42501."""
    role = "rl_http_%s" % uuid.uuid4().hex[:12]
    with pg_connect() as conn:
        conn.execute('CREATE ROLE "%s" LOGIN' % role)
    try:
        svc = start_service("--dsn", "user=%s" % role)
        identity = new_ident("http-role")
        for endpoint in ENDPOINTS:
            resp = svc.decide(endpoint, identity, 5, 60)
            assert resp.status == 503, resp
            assert "42501" in resp.json["error"], resp
        with pg_connect() as conn:
            conn.execute(
                'GRANT EXECUTE ON FUNCTION rl_fixed(text, integer, bigint, integer), '
                'rl_sliding(text, integer, bigint, integer) TO "%s"' % role)
        for endpoint in ENDPOINTS:
            check_allowed(svc.decide(endpoint, identity, 5, 60), 5, 4, 60)
        assert svc.stop() == 0, svc.log()
    finally:
        with pg_connect() as conn:
            conn.execute('DROP OWNED BY "%s"' % role)
            conn.execute('DROP ROLE "%s"' % role)


def test_terminated_backends_are_replaced(start_service):
    app = "rl_http_test_%s" % uuid.uuid4().hex[:12]
    svc = start_service("--dsn", "application_name=%s" % app)
    identity = new_ident("http-term")
    check_allowed(svc.decide(SLIDING, identity, 10, 60), 10, 9, 60)
    with pg_connect() as conn:
        n = conn.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = %s",
            (app,),
        ).fetchone()[0]
        assert n >= 1
        deadline = time.monotonic() + 10
        while conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
                           (app,)).fetchone()[0]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    # the pooled connection is dead: it is replaced, and the unit counted once
    check_allowed(svc.decide(SLIDING, identity, 10, 60), 10, 8, 60)


def test_pool_bounds_backends(start_service):
    app = "rl_http_test_%s" % uuid.uuid4().hex[:12]
    svc = start_service("--dsn", "application_name=%s" % app, "--pool-size", "3")
    identity = new_ident("http-pool")
    got = concurrently(30, lambda i: svc.decide(FIXED, identity, 1000, 600))
    assert all(r.status == 200 for r in got), got
    with pg_connect() as conn:
        n = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
                         (app,)).fetchone()[0]
    assert 1 <= n <= 3


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_clean_shutdown(start_service, signum):
    svc = start_service()
    assert svc.decide(SLIDING, new_ident("http-stop"), 5, 60).status == 200
    svc.signal(signum)
    assert svc.wait(timeout=15) == 0, svc.log()
    assert "Traceback" not in svc.log()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(svc.url + SLIDING, data=b"{}", timeout=5)


# ---------------------------------------------------------------- cost, policies, health


def test_cost(service, shared_redis):
    identity = new_ident("http-cost")
    body = {"identity": identity, "limit": 5, "windowSeconds": 60}
    check_allowed(service.post(SLIDING, dict(body, cost=3)), 5, 2, 60)
    check_allowed(service.post(SLIDING, dict(body, cost=0)), 5, 2, 60)  # a peek takes nothing
    denied = service.post(SLIDING, dict(body, cost=3))  # all or nothing
    assert denied.status == 429 and denied.json["remaining"] == 2, denied
    assert 1 <= int(denied.headers["Retry-After"]) <= 60, denied
    check_allowed(service.post(SLIDING, dict(body, cost=2)), 5, 0, 60)
    key = rl_key("sliding", identity, lim=5, window_ms=60000)
    assert shared_redis.command("ZCARD", key) == 5


@pytest.fixture
def policies():
    """Creates rl_policy rows with unique names; deletes them afterwards."""
    names = []

    def make(algorithm, lim, window_ms, burst=None, mode="enforce"):
        name = "http_test_%s" % uuid.uuid4().hex[:12]
        with pg_connect() as conn:
            conn.execute("INSERT INTO rl_policy (name, algorithm, lim, window_ms, burst, mode)"
                         " VALUES (%s, %s, %s, %s, %s, %s)", (name, algorithm, lim, window_ms, burst, mode))
        names.append(name)
        return name

    yield make
    with pg_connect() as conn:
        conn.execute("DELETE FROM rl_policy WHERE name = ANY(%s)", (names,))


def test_policy(service, policies, shared_redis):
    policy = policies("sliding", 3, 60000)
    identity = new_ident("http-policy")
    got = [service.post(POLICY, {"identity": identity, "policy": policy}) for _ in range(4)]
    # the RateLimit header names the policy, and the key is the policy's
    for i, resp in enumerate(got[:3]):
        check_allowed(resp, 3, 2 - i, 60, name=policy)
    check_denied(got[3], 3, 60, name=policy)
    assert shared_redis.command("ZCARD", rl_key("sliding", identity, policy=policy, lim=3, window_ms=60000)) == 3

    bucket = policies("token_bucket", 10, 60000, 20)
    resp = service.post(POLICY, {"identity": identity, "policy": bucket, "cost": 15})
    assert resp.status == 200 and resp.json["limit"] == 20 and resp.json["remaining"] == 5, resp


def test_shadow_policy_would_be_denial_is_200_with_enforcing_headers(service, policies, shared_redis):
    # a shadow policy allows every call; its would-be denial answers 200
    # with the numbers and the headers (Retry-After included) that enforcing
    # gives with 429, and takes nothing
    policy = policies("fixed", 2, 60000, mode="shadow")

    def run():
        # same_fixed_window may run this again: each run starts in shadow mode
        with pg_connect() as conn:
            conn.execute("UPDATE rl_policy SET mode = 'shadow' WHERE name = %s", (policy,))
        identity = new_ident("http-shadow")
        got = [service.post(POLICY, {"identity": identity, "policy": policy}) for _ in range(3)]
        with pg_connect() as conn:
            conn.execute("UPDATE rl_policy SET mode = 'enforce' WHERE name = %s", (policy,))
        got.append(service.post(POLICY, {"identity": identity, "policy": policy}))
        return identity, got

    identity, (first, second, shadow, enforced) = same_fixed_window(shared_redis, 60000, run)
    check_allowed(first, 2, 1, 60, name=policy)
    check_allowed(second, 2, 0, 60, name=policy)
    retry = check_denied(enforced, 2, 60, name=policy)
    assert shadow.status == 200, shadow
    assert shadow.json == {"allow": True, "reason": "allowed", "retryAfterSeconds": shadow.json["retryAfterSeconds"],
                           "limit": 2, "remaining": 0}, shadow
    assert abs(shadow.json["retryAfterSeconds"] - retry) <= 1, (shadow, enforced)
    assert shadow.headers["Retry-After"] == str(shadow.json["retryAfterSeconds"]), shadow
    assert len(shadow.headers.get_all("Retry-After")) == 1, shadow
    check_rate_headers(shadow, 2, 0, 60, name=policy)
    assert sorted(shadow.headers.keys()) == sorted(enforced.headers.keys()), (shadow, enforced)
    assert fixed_units(shared_redis.command("GET", rl_key("fixed", identity, policy=policy, lim=2, window_ms=60000))) == "2"


def test_policy_errors_are_400(service, policies):
    identity = new_ident("http-policy-bad")
    concurrency = policies("concurrency", 3, 60000)
    small = policies("fixed", 2, 60000)
    for body, word in [
        ({"identity": identity, "policy": "no_such_policy_%s" % uuid.uuid4().hex[:8]}, "does not exist"),
        ({"identity": identity, "policy": concurrency}, "concurrency"),
        ({"identity": identity, "policy": small, "cost": 3}, "never"),
        ({"identity": identity, "policy": "bad name!"}, "policy"),
        ({"identity": identity, "policy": ""}, "policy"),
        ({"identity": identity}, "policy"),
        ({"identity": identity, "policy": small, "limit": 5}, "limit"),
        ({"policy": small}, "identity"),
    ]:
        resp = service.post(POLICY, body)
        assert resp.status == 400, (body, resp)
        assert set(resp.json) == {"error"} and word in resp.json["error"], (body, resp)
    check_allowed(service.post(POLICY, {"identity": identity, "policy": small}), 2, 1, 60, name=small)


def test_sliding_limit_above_the_log_cap_is_400(service):
    # rl_redis.sliding_max_lim (10000) is the database's rule, raised as 22023:
    # the request asked for something this server refuses, not an outage
    identity = new_ident("http-cap")
    resp = service.decide(SLIDING, identity, 10001, 60)
    assert resp.status == 400, resp
    assert set(resp.json) == {"error"} and "limit" in resp.json["error"], resp
    assert "10000" in resp.json["error"], resp
    check_allowed(service.decide(SLIDING, identity, 10000, 60), 10000, 9999, 60)
    check_allowed(service.decide(FIXED, identity, 10001, 60), 10001, 10000, 60)


def test_healthz(service, start_service, black_hole):
    resp = service.request("GET", HEALTHZ)
    assert resp.status == 200, resp
    assert resp.json["status"] == "ok" and resp.json["database"] == "ok" and resp.json["redis"] == "ok", resp
    assert resp.json["redisRttMs"] >= 0
    head = service.raw()
    head.send(http_request(HEALTHZ, method="HEAD"))
    resp = head.response(to_head=True)  # Content-Length of the GET, no body
    assert resp.status == 200 and resp.body == b"" and int(resp.header("Content-Length")) > 0, resp
    head.close()

    no_redis = start_service("--dsn", hung_redis_dsn(black_hole, timeout_ms=500))
    resp = no_redis.request("GET", HEALTHZ)
    assert resp.status == 503 and resp.json["database"] == "ok" and resp.json["redis"] != "ok", resp
    assert resp.headers["Retry-After"] == "1"

    no_db = start_service("--dsn", "host=127.0.0.1 port=%d connect_timeout=5" % free_port())
    resp = no_db.request("GET", HEALTHZ)
    assert resp.status == 503 and resp.json["status"] == "unavailable" and resp.json["database"] != "ok", resp


def test_access_log_one_line_per_request(start_service):
    service = start_service()
    service.decide(SLIDING, new_ident("http-log"), 5, 60)
    service.post(SLIDING, with_(limit=0))
    service.request("GET", "/nowhere?x=1")
    bad = service.raw()
    bad.send(b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 4_8\r\n\r\n")
    assert bad.response().status == 400
    bad.close()
    service.request("GET", HEALTHZ)
    deadline = time.monotonic() + 10
    while len(access_lines(service)) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    got = [(line, status) for _, line, status in access_lines(service)]
    assert got == [
        ("POST %s HTTP/1.1" % SLIDING, "200"),
        ("POST %s HTTP/1.1" % SLIDING, "400"),
        ("GET /nowhere?x=1 HTTP/1.1", "404"),
        ("POST /x HTTP/1.1", "400"),
        ("GET /healthz HTTP/1.1", "200"),
    ], service.log()


# ---------------------------------------------------------------- HTTP on the wire


def test_keep_alive_answers_in_one_piece(strict_service):
    """Many requests on one connection; every answer is one write, so it is
    never split across segments (the cause of the 40 ms Nagle / delayed-ACK
    stall): once its first byte is readable, all of it is."""
    identity = new_ident("http-ka")
    conn = strict_service.raw()
    for i in range(20):
        conn.send(http_request(FIXED, {"identity": identity, "limit": 100, "windowSeconds": 600}))
        conn.sock.recv(1, socket.MSG_PEEK)
        data = conn.sock.recv(65536, socket.MSG_DONTWAIT)
        head, _, body = data.partition(b"\r\n\r\n")
        length = int(re.search(rb"\r\nContent-Length: (\d+)\r\n", head).group(1))
        assert len(body) == length, data
        assert json.loads(body)["remaining"] == 99 - i
        assert b"Connection: close" not in head
    conn.close()


def test_pipelined_requests_answered_in_order(strict_service):
    identity = new_ident("http-pipe")
    conn = strict_service.raw()
    conn.send(b"".join(http_request(SLIDING, {"identity": identity, "limit": 2, "windowSeconds": 60})
                       for _ in range(3)) + http_request("/nowhere", method="GET"))
    got = [conn.response() for _ in range(4)]
    assert [r.status for r in got] == [200, 200, 429, 404], got
    assert [r.json.get("remaining") for r in got[:3]] == [1, 0, 0]
    conn.close()


def test_http10_and_expect_continue(strict_service):
    conn = strict_service.raw()
    conn.send(http_request(FIXED, VALID, version=b"HTTP/1.0", headers=[
        (b"Content-Length", b"%d" % len(json.dumps(VALID)))]))
    resp = conn.response()
    assert resp.status == 200 and resp.header("Connection") == "close", resp
    assert conn.closed_by_server(10)

    body = json.dumps(dict(VALID, identity=new_ident("http-expect"))).encode()
    conn = strict_service.raw()
    conn.send(http_request(FIXED, headers=[(b"Host", b"x"), (b"Content-Length", b"%d" % len(body)),
                                           (b"Expect", b"100-continue")]))
    assert conn.sock.recv(25) == b"HTTP/1.1 100 Continue\r\n\r\n"
    conn.send(body)
    assert conn.response().status == 200
    conn.close()


GOOD_BODY = json.dumps(VALID).encode()


def _post_with(*fields, body=GOOD_BODY):
    return b"POST %s HTTP/1.1\r\n%s\r\n%s" % (FIXED.encode(), b"".join(f + b"\r\n" for f in fields), body)


HOST = b"Host: 127.0.0.1"
CL = b"Content-Length: %d" % len(GOOD_BODY)

# name, the request's bytes, status, a word of the error message
MALFORMED = [
    ("Content-Length 4_8", _post_with(HOST, b"Content-Length: 4_8", body=b"x" * 48), 400, "Content-Length"),
    ("Content-Length +48", _post_with(HOST, b"Content-Length: +48", body=b"x" * 48), 400, "Content-Length"),
    ("Content-Length -1", _post_with(HOST, b"Content-Length: -1"), 400, "Content-Length"),
    ("Content-Length 0x30", _post_with(HOST, b"Content-Length: 0x30"), 400, "Content-Length"),
    ("Content-Length in Arabic-Indic digits", _post_with(HOST, "Content-Length: ٤٨".encode()), 400,
     "Content-Length"),
    ("Content-Length 4 8", _post_with(HOST, b"Content-Length: 4 8"), 400, "Content-Length"),
    ("Content-Length empty", _post_with(HOST, b"Content-Length: "), 400, "Content-Length"),
    ("Content-Length list", _post_with(HOST, b"Content-Length: %d, %d" % (len(GOOD_BODY), len(GOOD_BODY))),
     400, "Content-Length"),
    ("Content-Length twice, same value", _post_with(HOST, CL, CL), 400, "Content-Length"),
    ("Content-Length twice, different values", _post_with(HOST, CL, b"Content-Length: 2"), 400,
     "Content-Length"),
    ("Content-Length and chunked", _post_with(HOST, CL, b"Transfer-Encoding: chunked"), 400,
     "Transfer-Encoding"),
    ("chunked", _post_with(HOST, b"Transfer-Encoding: chunked", body=b"2\r\n{}\r\n0\r\n\r\n"), 411, "Content-Length"),
    ("Transfer-Encoding gzip", _post_with(HOST, b"Transfer-Encoding: gzip"), 400, "Transfer-Encoding"),
    ("body above 64 KiB", _post_with(HOST, b"Content-Length: 70000", body=b""), 413, "65536"),
    ("huge Content-Length", _post_with(HOST, b"Content-Length: " + b"9" * 40, body=b""), 413, "65536"),
    ("bare LF", _post_with(HOST, CL).replace(b"\r\n", b"\n"), 400, "CRLF"),
    ("bare CR in a header line", _post_with(HOST, CL, b"X-A: a\rb"), 400, "CRLF"),
    ("obsolete line folding", _post_with(HOST, CL, b"X-A: a", b" b"), 400, "header"),
    ("space before the colon", _post_with(HOST, b"Content-Length : %d" % len(GOOD_BODY)), 400, "header"),
    ("header line without colon", _post_with(HOST, CL, b"Nocolon"), 400, "header"),
    ("control character in a value", _post_with(HOST, CL, b"X-A: a\x01b"), 400, "control"),
    ("no Host", _post_with(CL), 400, "Host"),
    ("two Hosts", _post_with(HOST, HOST, CL), 400, "Host"),
    ("two spaces in the request line", b"POST  /x HTTP/1.1\r\nHost: a\r\n\r\n", 400, "request line"),
    ("lower-case version", b"POST / http/1.1\r\nHost: a\r\n\r\n", 400, "version"),
    ("target not a path", b"POST x HTTP/1.1\r\nHost: a\r\n\r\n", 400, "target"),
    ("non-ASCII target", "GET /é HTTP/1.1\r\nHost: a\r\n\r\n".encode(), 400, "target"),
    ("method with a slash", b"PO/ST / HTTP/1.1\r\nHost: a\r\n\r\n", 400, "method"),
    ("HTTP/2.0", b"GET / HTTP/2.0\r\nHost: a\r\n\r\n", 505, "HTTP/1.1"),
    ("head above 8 KiB", _post_with(HOST, CL, b"X-A: " + b"a" * 9000), 431, "8192"),
    ("65 header fields", _post_with(HOST, CL, *[b"X-%d: a" % i for i in range(63)]), 431, "64"),
    ("unsupported expectation", _post_with(HOST, CL, b"Expect: teapot"), 417, "100-continue"),
    ("not HTTP", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40 + b"\r\n\r\n", 400, "request line"),
]


@pytest.mark.parametrize("case, data, status, word", MALFORMED, ids=[c[0] for c in MALFORMED])
def test_malformed_request(strict_service, case, data, status, word):
    """Every malformed request gets its status and a JSON error, whole
    (never a dropped connection); then the server closes the connection."""
    conn = strict_service.raw()
    conn.send(data)
    resp = conn.response()
    assert resp.status == status, resp
    assert resp.header("Content-Type") == "application/json"
    assert set(resp.json) == {"error"} and word in resp.json["error"], resp
    assert resp.header("Connection") == "close", resp
    assert conn.closed_by_server(10)
    conn.close()


def test_empty_lines_before_a_request_are_ignored(strict_service):
    conn = strict_service.raw()
    conn.send(b"\r\n\r\n" + http_request(FIXED, dict(VALID, identity=new_ident("http-crlf"))))
    assert conn.response().status == 200
    conn.close()


def test_long_identity(service, shared_redis):
    """An identity is a Redis key for up to a window: at most 512 bytes of
    UTF-8 (review finding: 65 000 bytes pinned 64 KB of Redis for years)."""
    base = new_ident("http-long")
    identity = base + "x" * (512 - len(base))
    check_allowed(service.decide(SLIDING, identity, 3, 60), 3, 2, 60)
    assert shared_redis.command("ZCARD", rl_key("sliding", identity, lim=3, window_ms=60000)) == 1
    too_long = base + "x" * (513 - len(base))
    body = json.dumps({"identity": too_long, "limit": 3, "windowSeconds": 60}).encode()
    response = service.post(SLIDING, body)
    assert response.status == 400
    assert "at most 512 bytes" in response.json["error"]
    assert shared_redis.command("EXISTS", rl_key("sliding", too_long, lim=3, window_ms=60000)) == 0


def test_identity_over_the_database_bound_is_400(start_service, policies, shared_redis):
    """An identity the service takes (at most 512 bytes) but the database
    refuses, as its rl_redis.max_identity_bytes is lower (54000), is the
    client's error: 400 naming the identity, not 503."""
    svc = start_service("--dsn", "options='-c rl_redis.max_identity_bytes=256'")
    policy = policies("fixed", 3, 60000)
    base = new_ident("http-dbbound")
    identity = base + "x" * (300 - len(base))
    for path, body in [(FIXED, {"identity": identity, "limit": 3, "windowSeconds": 60}),
                       (SLIDING, {"identity": identity, "limit": 3, "windowSeconds": 60}),
                       (POLICY, {"identity": identity, "policy": policy})]:
        resp = svc.post(path, body)
        assert resp.status == 400, (path, resp)
        assert set(resp.json) == {"error"}, resp
        assert resp.json["error"].startswith("identity rejected by the database:"), resp
        assert "identity is too long" in resp.json["error"], resp
    assert shared_redis.command("EXISTS", rl_key("fixed", identity, lim=3, window_ms=60000)) == 0
    check_allowed(svc.decide(FIXED, base, 3, 60), 3, 2, 60)


def test_surrogate_pair_is_one_character(service, shared_redis):
    # "\ud83d\ude00" is one character (U+1F600) in JSON, and a valid identity
    identity = new_ident("http-emoji") + "\U0001F600"
    body = json.dumps({"identity": identity, "limit": 3, "windowSeconds": 60}).encode()
    assert b"\\ud83d\\ude00" in body
    check_allowed(service.post(SLIDING, body), 3, 2, 60)
    assert shared_redis.command("ZCARD", rl_key("sliding", identity, lim=3, window_ms=60000)) == 1


# ---------------------------------------------------------------- slow, abandoned and vanishing clients


def test_slow_head_is_dropped_others_are_served(strict_service):
    """A client sending its head a byte at a time gets 408 after the 1 s
    header deadline; meanwhile other requests are answered as usual."""
    slow = strict_service.raw()
    data = http_request(FIXED, VALID)
    t0 = time.monotonic()
    errors = []

    def trickle():
        try:
            for b in data:
                slow.send(bytes([b]))
                time.sleep(0.2)
        except OSError:
            pass  # closed by the server: expected
        except Exception as e:
            errors.append(e)

    t = threading.Thread(target=trickle)
    t.start()
    identity = new_ident("http-slow-others")
    for i in range(10):
        t1 = time.monotonic()
        check_allowed(strict_service.decide(FIXED, identity, 100, 600), 100, 99 - i, 600)
        assert time.monotonic() - t1 < 5
    resp = slow.response()
    waited = time.monotonic() - t0
    assert resp.status == 408 and "head" in resp.json["error"], resp
    assert 0.9 <= waited < 8, waited
    assert slow.closed_by_server(10)
    t.join(30)
    assert errors == []
    slow.close()


def test_short_body_is_dropped(strict_service):
    """Content-Length 48 and 10 bytes sent: 408 after the 1 s body deadline
    (the old server held a thread for 68 s)."""
    conn = strict_service.raw()
    t0 = time.monotonic()
    conn.send(_post_with(HOST, b"Content-Length: 48", body=b'{"identity"'))
    resp = conn.response()
    assert resp.status == 408 and "body" in resp.json["error"], resp
    assert 0.9 <= time.monotonic() - t0 < 8
    assert conn.closed_by_server(10)
    conn.close()

    # the same, but the client says it is done: 400 at once
    conn = strict_service.raw()
    conn.send(_post_with(HOST, b"Content-Length: 48", body=b'{"identity"'))
    conn.sock.shutdown(socket.SHUT_WR)
    resp = conn.response()
    assert resp.status == 400 and "shorter" in resp.json["error"], resp
    conn.close()


def test_abandoned_connections_are_closed(strict_service):
    silent = strict_service.raw()  # never sends a byte
    idle = strict_service.raw()    # one request, then nothing
    idle.send(http_request(FIXED, dict(VALID, identity=new_ident("http-idle"))))
    assert idle.response().status == 200
    t0 = time.monotonic()
    assert silent.closed_by_server(10)
    assert idle.closed_by_server(10)
    assert time.monotonic() - t0 < 10
    silent.close()
    idle.close()


def test_clients_that_go_away(strict_service):
    """Clients that vanish mid-head, mid-body, or with a request in
    progress (FIN or RST): no traceback (checked at teardown), and the
    service keeps answering."""
    identity = new_ident("http-gone")
    for reset in (False, True):
        for data in (b"POST /api/v1/rate", _post_with(HOST, CL, body=GOOD_BODY[:10]),
                     http_request(FIXED, {"identity": identity, "limit": 1000, "windowSeconds": 600})):
            for _ in range(5):
                conn = strict_service.raw()
                conn.send(data)
                conn.close(reset=reset)
    time.sleep(0.5)
    resp = strict_service.decide(FIXED, identity, 1000, 600)
    assert resp.status == 200 and resp.json["remaining"] < 1000, resp
    assert "Traceback" not in strict_service.log(tail=None)


def test_max_connections_replaces_the_longest_waiting(start_service):
    """At --max-connections, a new connection takes the place of the one
    that has waited longest for a request (here: sent nothing)."""
    svc = start_service("--max-connections", "4")
    first = svc.raw()
    first.send(b"P")  # a byte: so it is surely accepted before the others
    time.sleep(0.3)
    others = [svc.raw() for _ in range(3)]
    time.sleep(0.3)
    identity = new_ident("http-maxconn")
    for i in range(3):
        check_allowed(svc.decide(FIXED, identity, 10, 600), 10, 9 - i, 600)
    assert first.closed_by_server(10)
    for conn in others + [first]:
        conn.close()


def test_burst_of_silent_connections_does_not_stop_accepting(start_service):
    """Review finding: a burst of more than --max-connections connections
    that send nothing must not stop the service from accepting until their
    header deadline: a new client is served at once, in the place of one
    that waits for a request."""
    svc = start_service("--max-connections", "4", "--header-timeout", "20")
    silent = []
    for _ in range(10):
        silent.append(svc.raw())
    time.sleep(0.5)
    t0 = time.monotonic()
    identity = new_ident("http-burst")
    check_allowed(svc.decide(FIXED, identity, 10, 600), 10, 9, 600)
    assert time.monotonic() - t0 < 5.0  # not the 20 s header deadline
    for conn in silent:
        conn.close()


def test_max_connections_all_busy_new_ones_wait(start_service, black_hole):
    """When every connection has a request in progress, a new one is not
    accepted until one of them is answered."""
    svc = start_service("--max-connections", "2", "--dsn", hung_redis_dsn(black_hole, "allow", 1500))
    busy = [svc.raw() for _ in range(2)]
    for conn in busy:
        conn.send(http_request(FIXED, VALID))
    black_hole.wait_for(2)  # both are being decided
    late = svc.raw()
    late.send(http_request(FIXED, VALID))
    done = {}

    def read(name, conn):
        done[name] = (conn.response().status, time.monotonic())

    threads = [threading.Thread(target=read, args=(i, c)) for i, c in enumerate(busy + [late])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(done) == [0, 1, 2], done
    assert all(status == 200 for status, _ in done.values()), done  # on_error = allow
    assert done[2][1] >= min(done[0][1], done[1][1]), done
    for conn in busy + [late]:
        conn.close()


def test_max_in_flight(start_service, black_hole):
    """Two requests in flight (their decisions hang until the black hole
    lets go; the timeouts are far longer than the test): a third gets 503
    at once; the two are answered once released."""
    svc = start_service("--max-in-flight", "2", "--statement-timeout-ms", "60000",
                        "--dsn", hung_redis_dsn(black_hole, "allow", 30000))
    busy = [svc.raw() for _ in range(2)]
    for conn in busy:
        conn.send(http_request(FIXED, VALID))
    black_hole.wait_for(2)  # both are being decided, until released
    resp = svc.post(FIXED, VALID)
    assert resp.status == 503 and "in flight" in resp.json["error"], resp
    assert resp.headers["Retry-After"] == "1"
    black_hole.release()
    assert [c.response().status for c in busy] == [200, 200]  # answered after the third
    for conn in busy:
        conn.close()


def _open_fds(pid):
    return len(os.listdir("/proc/%d/fd" % pid))


def test_out_of_file_descriptors(start_service):
    """EMFILE at accept: one log line, no busy loop, the open connections
    keep being served, and new ones are taken once descriptors are free."""
    svc = start_service()
    pid = svc.proc.pid
    identity = new_ident("http-emfile")
    kept = [svc.raw() for _ in range(3)]
    for conn in kept:
        conn.send(http_request(FIXED, {"identity": identity, "limit": 1000, "windowSeconds": 600}))
        assert conn.response().status == 200
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (_open_fds(pid), hard))
    try:
        waiting = svc.raw()
        waiting.send(http_request(FIXED, {"identity": identity, "limit": 1000, "windowSeconds": 600}))
        waiting.sock.settimeout(1.5)
        with pytest.raises(socket.timeout):
            waiting.sock.recv(1)  # not accepted
        for conn in kept[1:]:  # still served
            conn.send(http_request(FIXED, {"identity": identity, "limit": 1000, "windowSeconds": 600}))
            assert conn.response().status == 200
        kept[0].close()  # frees a descriptor in the server
        waiting.sock.settimeout(15)
        assert waiting.response().status == 200
    finally:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
    log = svc.log(tail=None)
    assert log.count("Too many open files") == 1, log  # not one line per attempt
    for conn in kept[1:] + [waiting]:
        conn.close()


# ---------------------------------------------------------------- shutdown, workers


def test_sigterm_drains_requests_in_progress(start_service, black_hole):
    """SIGTERM: idle connections are closed, new ones refused, and the
    requests in progress (one waiting on the database, one whose body is
    still arriving) are answered before the process exits 0."""
    # the decision hangs until the black hole lets go (the timeouts are far
    # longer than the test): it is surely in progress during the shutdown
    svc = start_service("--statement-timeout-ms", "60000",
                        "--dsn", hung_redis_dsn(black_hole, "allow", 30000))
    idle = svc.raw()
    idle.send(http_request("/no-such-path", method="GET"))
    assert idle.response().status == 404  # answered: the connection is idle
    deciding = svc.raw()
    deciding.send(http_request(FIXED, VALID))
    uploading = svc.raw()
    # on loopback the bytes are in the server's socket when send returns, so
    # the service reads them before it handles the signal sent after them
    uploading.send(_post_with(HOST, CL, body=GOOD_BODY[:10]))
    black_hole.wait_for(1)  # the decision reached "Redis"
    svc.signal(signal.SIGTERM)
    assert idle.closed_by_server(5)
    time.sleep(0.2)
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", svc.port), timeout=5)
    uploading.send(GOOD_BODY[10:])
    black_hole.wait_for(2)  # its decision reached "Redis" too
    black_hole.release()
    for conn in (deciding, uploading):
        resp = conn.response()
        assert resp.status == 200 and resp.header("Connection") == "close", resp
        conn.close()
    assert svc.wait(timeout=15) == 0, svc.log()
    idle.close()


def test_workers_share_one_quota(start_service, shared_redis):
    svc = start_service("--workers", "2")
    limit, n = 10, 40

    def run():
        identity = new_ident("http-workers")
        return concurrently(n, lambda i: svc.decide(SLIDING, identity, limit, 60))

    got = run()
    assert [r.status for r in got].count(200) == limit, got
    assert sorted(r.json["remaining"] for r in got if r.status == 200) == list(range(limit))
    pids = {pid for pid, _, _ in access_lines(svc)}
    assert len(pids) == 2 and svc.proc.pid not in pids, pids  # both workers answered


def test_a_worker_that_dies_is_replaced(start_service):
    svc = start_service("--workers", "2")
    identity = new_ident("http-respawn")
    for _ in range(20):
        assert svc.decide(FIXED, identity, 1000, 600).status == 200
    victim = sorted({pid for pid, _, _ in access_lines(svc)})[0]
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 15
    while "starting a new one" not in svc.log(tail=None):
        assert time.monotonic() < deadline, svc.log()
        time.sleep(0.1)
    for _ in range(20):
        assert svc.decide(FIXED, identity, 1000, 600).status == 200
    pids = {pid for pid, _, _ in access_lines(svc)} - {victim}
    assert len(pids) == 2, pids  # the survivor and the new one
