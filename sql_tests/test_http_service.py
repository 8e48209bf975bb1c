"""The example HTTP service (examples/http_service/server.py), end to end.

Every test starts the real server as a subprocess (Debian's /usr/bin/python3,
the PG* variables of the test cluster) and talks to it with urllib; the
decisions come from the shared Redis that postgresql.conf points at.
"""

import json
import os
import re
import select
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid

import pytest

from conftest import free_port, new_ident, pg_connect, rl_key, same_fixed_window

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVER = os.path.join(ROOT, "examples", "http_service", "server.py")
PYTHON = "/usr/bin/python3"

FIXED = "/api/v1/rate-limiter/fixed-window"
SLIDING = "/api/v1/rate-limiter/sliding-window"
ENDPOINTS = [FIXED, SLIDING]
KEY_ALG = {FIXED: "fixed", SLIDING: "sliding"}

RATELIMIT_RE = re.compile(r'^"default";r=(\d+);t=(\d+)$')


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

    def log(self):
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return f.read()[-4000:]
        except OSError:
            return ""

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
            if status != 0:
                bad.append((status, svc.log()))
        assert bad == [], "services did not shut down cleanly: %r" % bad

    return start, stop_all


@pytest.fixture
def start_service(tmp_path):
    """start_service(*extra_args, env=None) -> a running Service. Every
    service is stopped with SIGTERM at teardown and must exit with status 0."""
    start, stop_all = _service_factory(str(tmp_path))
    yield start
    stop_all()


@pytest.fixture
def service(start_service):
    return start_service()


@pytest.fixture(scope="module")
def module_service(tmp_path_factory):
    """One service shared by the tests that only send bad requests."""
    start, stop_all = _service_factory(str(tmp_path_factory.mktemp("http_service")))
    yield start()
    stop_all()


# ---------------------------------------------------------------- helpers



def run_in_one_window(endpoint, redis, window_ms, body):
    if endpoint == FIXED:
        return same_fixed_window(redis, window_ms, body)
    return body()


def check_allowed(resp, limit, remaining, window_seconds):
    assert resp.status == 200, resp
    assert resp.headers["Content-Type"] == "application/json"
    assert resp.json == {
        "allow": True,
        "reason": "allowed",
        "retryAfterSeconds": 0,
        "limit": limit,
        "remaining": remaining,
    }, resp
    check_rate_headers(resp, limit, remaining, window_seconds)
    assert resp.headers["Retry-After"] is None, resp


def check_denied(resp, limit, window_seconds):
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
    check_rate_headers(resp, limit, 0, window_seconds)
    return int(retry)


def check_rate_headers(resp, limit, remaining, window_seconds):
    assert resp.headers["X-RateLimit-Limit"] == str(limit), resp
    assert resp.headers["X-RateLimit-Remaining"] == str(remaining), resp
    reset = resp.headers["X-RateLimit-Reset"]
    assert reset is not None and 1 <= int(reset) <= window_seconds, resp
    m = RATELIMIT_RE.match(resp.headers["RateLimit"] or "")
    assert m, resp
    assert int(m.group(1)) == remaining, resp
    assert 1 <= int(m.group(2)) <= window_seconds, resp


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
        assert shared_redis.command("HGET", key, "n") == str(limit)
    else:
        assert shared_redis.command("ZCARD", key) == limit


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_window_expiry(service, shared_redis, endpoint):
    limit, window = 2, 1
    for _ in range(6):
        if endpoint == FIXED:
            # start early in a 1 s window of the Redis clock
            into = shared_redis.time_ms() % 1000
            if into > 200:
                time.sleep((1000 - into + 20) / 1000.0)
        identity = new_ident("http-expiry")
        t0 = shared_redis.time_ms()
        got = [service.decide(endpoint, identity, limit, window) for _ in range(3)]
        t1 = shared_redis.time_ms()
        if endpoint == FIXED and t0 // 1000 == t1 // 1000:
            break  # all three in one fixed window
        if endpoint == SLIDING and t1 - t0 < 700:
            break  # all three well inside one rolling second
    else:
        pytest.fail("3 requests never fitted in one window")

    assert [r.status for r in got] == [200, 200, 429], got
    check_allowed(got[0], limit, 1, window)
    check_allowed(got[1], limit, 0, window)
    assert check_denied(got[2], limit, window) == 1

    time.sleep(2.5)
    check_allowed(service.decide(endpoint, identity, limit, window), limit, 1, window)


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
]


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize("case, body, field", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request(module_service, endpoint, case, body, field):
    resp = module_service.post(endpoint, body)
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
    ("GET", FIXED, 405),
    ("GET", SLIDING, 405),
    ("PUT", SLIDING, 405),
    ("DELETE", FIXED, 405),
])
def test_unknown_path_and_wrong_method(module_service, method, path, status):
    body = VALID if method in ("POST", "PUT") else None
    resp = module_service.request(method, path, body)
    assert resp.status == status, resp
    assert resp.headers["Content-Type"] == "application/json"
    assert isinstance(resp.json.get("error"), str) and resp.json["error"], resp
    if status == 405:
        assert resp.headers["Allow"] == "POST"


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
