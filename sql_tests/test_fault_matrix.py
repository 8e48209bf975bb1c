"""Fault matrix: what a decision does when Redis misbehaves in ways that
test_faults.py and test_breaker.py do not cover.

Every row checks the SQLSTATE (or the on_error decision), how long the call
took (bounds are generous: the suite runs on small, loaded machines), and
that the same backend (same pid) still makes real decisions afterwards.

  1. CLIENT KILL between calls                 -> next calls just work
  2. FLUSHALL between calls                    -> fresh state, functions fine
  3. maxmemory + noeviction, memory full       -> 08000 OOM / allow / deny
  4. pointed at a read-only replica            -> 08000 READONLY
  5. wrong password; ACL user without scripting-> 08001 / 08000 NOPERM,
                                                  never the password
  6. AOF persistence across SHUTDOWN + restart -> counts kept
  7. blackholed address (SYNs dropped)         -> 08001 after connect_timeout;
                                                  cancel / statement_timeout
                                                  end the connect at once
(command_timeout under SIGSTOP is in test_faults.py.)

CLIENT KILL while a call is in flight is not tested: there is no way to
land the kill between the send and the reply reliably.
"""

import os
import socket
import time

import psycopg
import psycopg.errors
import pytest

from conftest import new_ident, pg_connect, set_gucs, use_redis

# they count the backend's descriptors before and after (see test_leaks.py)
pytestmark = pytest.mark.new_session
from test_faults import (
    Victim,
    allow,
    allow_key,
    collect_notices,
    in_sync_call,
    timed_error,
    wait_until_active,
    warnings_of,
)

ALLOW = "SELECT rl_sliding_allow(%s, 1000, 600000)"
FIXED_ALLOW = "SELECT rl_fixed_allow(%s, 1000, 600000)"
# a fixed window this long does not roll over during a test (next boundary:
# the year 2033)
HUGE_WINDOW_MS = 10**12


# ---------------------------------------------------------------- helpers


def assert_usable(conn, pid, server=None):
    """The same backend still makes real decisions (on_error = error, so a
    failure could not pass for a decision; lim 777 is echoed back by the
    script, so a stale reply could not either). With server, the session is
    first pointed at that Redis."""
    if server is not None:
        use_redis(conn, server)
    set_gucs(conn, on_error="error")
    assert conn.info.backend_pid == pid
    assert conn.execute("SELECT pg_backend_pid()").fetchone()[0] == pid
    identity = new_ident("usable")
    assert in_sync_call(conn, identity) == (True, 777)
    assert in_sync_call(conn, identity) == (True, 777)
    assert allow(conn, identity) is True


def note(row, what, seconds):
    """Prints a measured time (pytest -s shows it)."""
    print("\n[fault matrix] %s, %s: %.3f s" % (row, what, seconds), end="")


def error_texts(err):
    """Every text field of a server error (and psycopg's rendering of it)."""
    d = err.diag
    return [
        str(err),
        d.message_primary or "",
        d.message_detail or "",
        d.message_hint or "",
        d.context or "",
        d.internal_query or "",
    ]


def timed(fn, *args):
    t0 = time.monotonic()
    value = fn(*args)
    return value, time.monotonic() - t0


def command_calls(server, command):
    """How many times Redis ran `command` (INFO commandstats)."""
    info = server.command("INFO", "commandstats")
    for line in info.splitlines():
        if line.startswith("cmdstat_%s:" % command):
            fields = dict(f.split("=", 1) for f in line.split(":", 1)[1].split(","))
            return int(fields["calls"])
    return 0


def proc_fds(pid):
    """Number of open file descriptors of process pid (None if unreadable)."""
    try:
        return len(os.listdir("/proc/%d/fd" % pid))
    except PermissionError:
        return None


def postgres_log():
    path = os.path.join(os.environ.get("RL_DIR", ""), "postgres.log")
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


# ------------------------------------------------------- 1. CLIENT KILL


def script_clients(server):
    """Ids of the normal clients whose last command ran a script."""
    ids = []
    for line in server.command("CLIENT", "LIST", "TYPE", "normal").splitlines():
        fields = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
        if fields.get("cmd") in ("evalsha", "eval", "fcall"):
            ids.append(int(fields["id"]))
    return ids


def test_client_kill_between_calls(pg, redis_factory):
    r = redis_factory()
    use_redis(pg, r, on_error="error")
    pid = pg.info.backend_pid
    identity = new_ident("kill")
    assert allow(pg, identity) is True
    (first_client,) = script_clients(r)

    # redis-cli's own connection is spared (CLIENT KILL's default SKIPME yes)
    assert int(r.cli("CLIENT", "KILL", "TYPE", "normal")) >= 1
    assert first_client not in script_clients(r)

    results, elapsed = timed(lambda: [allow(pg, identity) for _ in range(5)])
    note("1 CLIENT KILL", "5 calls after the kill", elapsed)
    assert results == [True] * 5
    assert elapsed < 3.0, elapsed
    # one new connection did all five calls
    (second_client,) = script_clients(r)
    assert second_client != first_client
    assert int(r.cli("ZCARD", allow_key(identity))) == 6

    # a kill before every call: each one reconnects without an error
    for i in range(5):
        assert int(r.cli("CLIENT", "KILL", "TYPE", "normal")) >= 1
        value, elapsed = timed(allow, pg, identity)
        note("1 CLIENT KILL", "call right after kill #%d" % (i + 1), elapsed)
        assert value is True
        assert elapsed < 2.0, (i, elapsed)
    assert int(r.cli("ZCARD", allow_key(identity))) == 11
    assert_usable(pg, pid)


# ------------------------------------------------------- 2. FLUSHALL


def library_names(server):
    """The names of the function libraries the server holds."""
    return [lib[lib.index("library_name") + 1] for lib in server.command("FUNCTION", "LIST")]


@pytest.mark.parametrize("flush", ["FLUSHALL", "FLUSHALL ASYNC", "FLUSHALL+FUNCTION FLUSH",
                                   "FLUSHALL+SCRIPT FLUSH"])
def test_flushall_between_calls(pg, redis_factory, flush):
    r = redis_factory()
    use_redis(pg, r, on_error="error")
    notices = collect_notices(pg)
    pid = pg.info.backend_pid
    identity = new_ident("flushall")
    queries = {
        "sliding": "SELECT (r).allowed, (r).remaining FROM rl_sliding(%s, 5, 600000) AS r",
        "fixed": "SELECT (r).allowed, (r).remaining FROM rl_fixed(%s, 5, %s) AS r",
    }

    def decide(alg):
        params = (identity,) if alg == "sliding" else (identity, HUGE_WINDOW_MS)
        return pg.execute(queries[alg], params).fetchone()

    for alg in queries:
        assert [decide(alg) for _ in range(3)] == [(True, 4), (True, 3), (True, 2)]
    libraries = library_names(r)
    assert len(libraries) == 1, libraries

    for word in flush.split("+"):
        assert r.cli(*word.split()) == "OK"
    assert int(r.cli("DBSIZE")) == 0
    loads_before = command_calls(r, "function|load")

    for alg in queries:
        row, elapsed = timed(decide, alg)
        note("2 %s" % flush, "first %s call after it" % alg, elapsed)
        assert row == (True, 4), (alg, row)  # counting starts over
        assert elapsed < 1.0, elapsed
        assert decide(alg) == (True, 3)
    assert warnings_of(notices) == []

    # the library is there again (or never left: FLUSHALL and SCRIPT FLUSH
    # keep it), loaded once when it was flushed
    assert library_names(r) == libraries
    loads = command_calls(r, "function|load") - loads_before
    assert loads == (1 if "FUNCTION" in flush else 0), loads
    assert_usable(pg, pid)


# ------------------------------------------------------- 3. maxmemory, OOM

OOM_ARGS = ["--maxmemory", "1mb", "--maxmemory-policy", "noeviction"]


def fill_memory(r, warm_up=None):
    """Puts a Redis started with OOM_ARGS well over its 1 MB maxmemory. The
    limit is lifted for a moment so that the warm-up call (which loads a
    script and opens the connection) and the filler cannot be refused: an
    idle Redis 7 sits just under 1 MB already. One tiny SETRANGE makes a
    2 MB string (a 2 MB SET would itself be refused: its query buffer
    counts)."""
    assert r.cli("CONFIG", "SET", "maxmemory", "0") == "OK"
    if warm_up is not None:
        warm_up()
    assert int(r.cli("SETRANGE", "filler", str(2 * 1024 * 1024 - 1), "x")) == 2 * 1024 * 1024
    assert r.cli("CONFIG", "SET", "maxmemory", "1mb") == "OK"
    with pytest.raises(Exception) as excinfo:
        r.command("SET", "probe", "1")
    assert "OOM" in str(excinfo.value), excinfo.value


def relieve_memory(r):
    assert r.cli("DEL", "filler") == "1"
    assert r.cli("CONFIG", "SET", "maxmemory", "0") == "OK"


# Decisions whose scripts' first write is refused under OOM. (rl_sliding is
# not among them: see test_oom_sliding_window.)
OOM_QUERIES = [
    "SELECT rl_fixed_allow(%s, 1000, 600000)",
    "SELECT rl_fixed(%s, 5, 60000)",
    "SELECT rl_token_bucket(%s, 5, 60000)",
    "SELECT rl_gcra_allow(%s, 5, 60000)",
    "SELECT rl_sliding_counter_allow(%s, 5, 60000)",
]


@pytest.mark.parametrize("warm", [True, False], ids=["scripts_loaded", "cold"])
def test_oom_on_error_error(pg, redis_factory, warm):
    r = redis_factory(extra_args=OOM_ARGS)
    use_redis(pg, r, on_error="error")
    pid = pg.info.backend_pid
    fill_memory(r, (lambda: allow(pg, new_ident("oom_warm"), FIXED_ALLOW)) if warm else None)
    identity = new_ident("oom")

    for query in OOM_QUERIES:
        err, elapsed = timed_error(pg, query, (identity,))
        note("3 OOM on_error=error (%s)" % ("warm" if warm else "cold"), query, elapsed)
        assert err.sqlstate == "08000", (query, repr(err))
        assert isinstance(err, psycopg.errors.ConnectionException), repr(err)
        assert err.diag.message_primary == "Redis at 127.0.0.1:%d returned an error" % r.port, \
            err.diag.message_primary
        assert err.diag.message_detail.startswith("OOM "), err.diag.message_detail
        assert elapsed < 1.0, elapsed
    assert r.cli("KEYS", "rl:*{%s}*" % identity) == ""  # nothing was written

    # an error reply keeps the connection: freeing memory is enough (an idle
    # Redis 7 alone is close to 1 MB, so the limit goes too)
    relieve_memory(r)
    assert allow(pg, identity, FIXED_ALLOW) is True
    assert_usable(pg, pid)


@pytest.mark.parametrize("on_error, expected", [("allow", True), ("deny", False)])
def test_oom_on_error_policy(pg, redis_factory, on_error, expected):
    r = redis_factory(extra_args=OOM_ARGS)
    use_redis(pg, r, on_error=on_error)
    notices = collect_notices(pg)
    pid = pg.info.backend_pid
    fill_memory(r, lambda: allow(pg, new_ident("oom_warm"), FIXED_ALLOW))
    identity = new_ident("oom_policy")

    value, elapsed = timed(allow, pg, identity, FIXED_ALLOW)
    note("3 OOM on_error=%s" % on_error, "rl_fixed_allow", elapsed)
    assert value is expected
    assert elapsed < 1.0, elapsed
    w = warnings_of(notices)
    assert len(w) == 1, notices
    assert w[0].message_primary == "Redis at 127.0.0.1:%d returned an error" % r.port, w[0].message_primary
    assert w[0].message_detail.startswith("OOM "), w[0].message_detail

    row = pg.execute(
        "SELECT (r).allowed, (r).lim, (r).remaining, (r).retry_after_ms "
        "FROM rl_fixed(%s, 5, 60000) AS r",
        (identity,),
    ).fetchone()
    assert row == ((True, 5, 4, 0) if expected else (False, 5, 0, 1000)), row
    assert r.cli("KEYS", "rl:*{%s}*" % identity) == ""

    relieve_memory(r)
    assert_usable(pg, pid)


def test_oom_sliding_window(pg, redis_factory):
    r = redis_factory(extra_args=OOM_ARGS)
    use_redis(pg, r, on_error="error")
    fill_memory(r)
    identity = new_ident("oom_sliding")
    # Redis 7 lets a script without flags write on once its first write
    # (ZREMRANGEBYSCORE, which frees memory) has run; the scripts' "#!lua"
    # line makes it refuse the whole script instead
    for query in (ALLOW,
                  "SELECT rl_concurrency_acquire_allow(%s, 5, 60000)",
                  "SELECT rl_sliding_counter_allow(%s, 5, 60000)"):
        err, _ = timed_error(pg, query, (identity,))
        assert err.sqlstate == "08000" and err.diag.message_detail.startswith("OOM "), repr(err)
    assert r.cli("KEYS", "rl:*{%s}*" % identity) == ""


# ------------------------------------------------------- 4. read-only replica


def wait_replica_link(replica, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if "master_link_status:up" in replica.command("INFO", "replication"):
            return
        time.sleep(0.05)
    pytest.fail("replica never linked up:\n%s" % replica.log())


def test_read_only_replica(pg, redis_factory):
    a = redis_factory()
    b = redis_factory(extra_args=["--replicaof", "127.0.0.1", str(a.port)])
    wait_replica_link(b)
    pid = pg.info.backend_pid
    identity = new_ident("replica")

    use_redis(pg, b, on_error="error")
    for query in (ALLOW, FIXED_ALLOW, "SELECT rl_gcra(%s, 5, 60000)"):
        err, elapsed = timed_error(pg, query, (identity,))
        note("4 replica", query, elapsed)
        assert err.sqlstate == "08000", repr(err)
        assert err.diag.message_primary == "Redis at 127.0.0.1:%d returned an error" % b.port, \
            err.diag.message_primary
        assert err.diag.message_detail.startswith("READONLY "), err.diag.message_detail
        assert elapsed < 1.0, elapsed

    set_gucs(pg, on_error="allow")
    notices = collect_notices(pg)
    assert allow(pg, identity) is True
    assert warnings_of(notices)[0].message_detail.startswith("READONLY ")

    # back to the primary: it decides, and the write reaches the replica
    use_redis(pg, a, on_error="error")
    assert allow(pg, identity) is True
    deadline = time.monotonic() + 10
    while int(b.cli("EXISTS", allow_key(identity))) != 1:
        assert time.monotonic() < deadline, "the write never reached the replica"
        time.sleep(0.05)
    assert_usable(pg, pid)


# ------------------------------------------------------- 5. AUTH and ACL

REDIS_PASSWORD = "s3cret-value"
WRONG_PASSWORD = "not-the-s3cret"
ACL_PASSWORD = "pw-limited-6f1d2"


@pytest.mark.parametrize("on_error", ["error", "allow"])
def test_wrong_password_never_shown(pg, redis_factory, on_error):
    r = redis_factory(password=REDIS_PASSWORD)
    use_redis(pg, r, on_error=on_error, password=WRONG_PASSWORD)
    pid = pg.info.backend_pid
    notices = []
    pg.add_notice_handler(
        lambda d: notices.append(
            [d.severity_nonlocalized, d.message_primary, d.message_detail,
             d.message_hint, d.context]
        )
    )
    identity = new_ident("wrongpass")

    if on_error == "error":
        err, elapsed = timed_error(pg, ALLOW, (identity,))
        assert err.sqlstate == "08001", repr(err)
        texts = error_texts(err)
        assert err.diag.message_primary == "could not authenticate to Redis at 127.0.0.1:%d" % r.port, texts
        assert err.diag.message_detail.startswith("WRONGPASS "), texts
    else:
        value, elapsed = timed(allow, pg, identity)
        assert value is True
        assert len(notices) == 1 and notices[0][0] == "WARNING", notices
        texts = [t or "" for t in notices[0][1:]]
        assert texts[0] == "could not authenticate to Redis at 127.0.0.1:%d" % r.port, texts
        assert texts[1].startswith("WRONGPASS "), texts
    note("5 wrong password on_error=%s" % on_error, "failed call", elapsed)
    assert elapsed < 1.0, elapsed
    for text in texts:
        assert REDIS_PASSWORD not in text and WRONG_PASSWORD not in text, texts
    # nor in the server log
    log = postgres_log()
    assert WRONG_PASSWORD not in log and REDIS_PASSWORD not in log

    set_gucs(pg, password=REDIS_PASSWORD)
    assert_usable(pg, pid)
    assert int(r.cli("EXISTS", allow_key(identity))) == 0


def test_acl_user_without_scripting(pg, redis_factory):
    r = redis_factory(password=REDIS_PASSWORD)
    assert r.cli("ACL", "SETUSER", "limited", "on", ">" + ACL_PASSWORD, "~*",
                 "+@all", "-@scripting") == "OK"
    use_redis(pg, r, on_error="error", username="limited", password=ACL_PASSWORD)
    pid = pg.info.backend_pid
    identity = new_ident("noperm")

    for query in (ALLOW, "SELECT rl_fixed(%s, 5, 60000)"):
        err, elapsed = timed_error(pg, query, (identity,))
        note("5 ACL without scripting", query, elapsed)
        assert err.sqlstate == "08000", repr(err)
        assert err.diag.message_primary == "Redis at 127.0.0.1:%d returned an error" % r.port, \
            err.diag.message_primary
        assert err.diag.message_detail.startswith("NOPERM "), err.diag.message_detail
        assert elapsed < 1.0, elapsed
        for text in error_texts(err):
            assert ACL_PASSWORD not in text and REDIS_PASSWORD not in text, text
    # AUTH worked: the connection is open, as user "limited"
    assert "user=limited" in r.command("CLIENT", "LIST", "TYPE", "normal")
    # rl_redis_ping needs no scripts: it works for this user
    assert pg.execute("SELECT (rl_redis_ping()).server").fetchone()[0] == "127.0.0.1:%d" % r.port

    set_gucs(pg, username="", password=REDIS_PASSWORD)
    assert_usable(pg, pid)


# ------------------------------------------------------- 6. persistence


@pytest.mark.parametrize("alg, window_ms", [("sliding", 600000), ("fixed", HUGE_WINDOW_MS)])
def test_counts_survive_restart_with_aof(pg, redis_factory, alg, window_ms):
    aof_dir = os.path.join(redis_factory.base_dir, "aof-%s" % alg)
    os.makedirs(aof_dir)
    r = redis_factory(
        extra_args=["--appendonly", "yes", "--appendfsync", "always", "--dir", aof_dir]
    )
    assert r.command("CONFIG", "GET", "appendonly") == ["appendonly", "yes"]
    use_redis(pg, r, on_error="error")
    pid = pg.info.backend_pid
    identity = new_ident("aof")
    query = "SELECT (r).allowed, (r).remaining FROM rl_%s(%%s, 5, %%s, %%s) AS r" % alg

    def decide(cost=1):
        return pg.execute(query, (identity, window_ms, cost)).fetchone()

    assert [decide() for _ in range(3)] == [(True, 4), (True, 3), (True, 2)]

    r.cli("SHUTDOWN", check=False)  # fsyncs the AOF and exits
    assert r.proc.wait(timeout=30) == 0, r.log()
    t0 = time.monotonic()
    r.start()

    failures = []
    peek = None
    for _ in range(2):
        try:
            peek = decide(0)  # cost 0: looks without taking
            break
        except psycopg.Error as e:
            failures.append(e)
    elapsed = time.monotonic() - t0
    note("6 AOF restart (%s)" % alg, "restart + first decision (%d failed)" % len(failures), elapsed)
    assert len(failures) <= 1, failures
    for e in failures:
        assert e.sqlstate is not None and e.sqlstate.startswith("08"), repr(e)
    assert peek == (True, 2), peek  # the three units are still taken
    assert elapsed < 5.0, elapsed
    assert [decide(), decide(), decide()] == [(True, 1), (True, 0), (False, 0)]
    assert_usable(pg, pid)


# ------------------------------------------------------- 7. blackholed address


class Blackhole:
    """A TCP listener on 127.0.0.1 that never accepts, with its accept queue
    full: Linux then drops every new SYN, so a connect hangs (SYN_SENT,
    retransmitting) instead of being refused."""

    def __init__(self):
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(0)
        self.port = self.listener.getsockname()[1]
        self.fillers = []

    def _probe_hangs(self, timeout=0.5):
        probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        probe.settimeout(timeout)
        try:
            probe.connect(("127.0.0.1", self.port))
        except socket.timeout:
            probe.close()
            return True
        except OSError:
            probe.close()
            return False
        self.fillers.append(probe)  # it got in: it fills the queue too
        return False

    def fill(self):
        """Connects non-blocking sockets until a plain connect times out."""
        for _ in range(32):
            for _ in range(4):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.setblocking(False)
                s.connect_ex(("127.0.0.1", self.port))
                self.fillers.append(s)
            time.sleep(0.05)  # let the handshakes land in the queue
            if self._probe_hangs():
                return True
        return False

    def close(self):
        for s in self.fillers:
            s.close()
        self.listener.close()


@pytest.fixture
def blackhole():
    bh = Blackhole()
    try:
        if not bh.fill():
            pytest.skip(
                "could not make a connect hang: 127.0.0.1:%d still completed "
                "handshakes after %d queued connections (the kernel does not "
                "drop SYNs on a full accept queue here)" % (bh.port, len(bh.fillers))
            )
        yield bh
    finally:
        bh.close()


def prepare_victim(conn, redis_factory, **gucs):
    """Loads the library and resolves the functions through a failed call on
    a stopped Redis, so that the fd count afterwards is the backend's steady
    state without a Redis connection. Returns that count (None if
    /proc/<pid>/fd is unreadable)."""
    dead = redis_factory()
    dead.stop()
    use_redis(conn, dead, on_error="allow")
    conn.execute("SET client_min_messages = error")
    assert allow(conn, new_ident("warmup")) is True
    conn.execute("RESET client_min_messages")
    return proc_fds(conn.info.backend_pid)


@pytest.mark.parametrize("on_error, expected", [("error", None), ("allow", True), ("deny", False)])
def test_blackhole_connect_timeout(pg, redis_factory, blackhole, on_error, expected):
    pid = pg.info.backend_pid
    fds = prepare_victim(pg, redis_factory)
    set_gucs(pg, host="127.0.0.1", port=blackhole.port, connect_timeout=300,
             retry_interval=0, on_error=on_error)
    notices = collect_notices(pg)
    identity = new_ident("blackhole")

    if expected is None:
        err, elapsed = timed_error(pg, ALLOW, (identity,))
        assert err.sqlstate == "08001", repr(err)
        assert "timed out" in err.diag.message_primary, err.diag.message_primary
        assert "127.0.0.1:%d" % blackhole.port in err.diag.message_primary
    else:
        value, elapsed = timed(allow, pg, identity)
        assert value is expected
        w = warnings_of(notices)
        assert len(w) == 1 and "timed out" in w[0].message_primary, notices
    note("7 blackhole connect_timeout=300 on_error=%s" % on_error, "call", elapsed)
    assert 0.25 <= elapsed <= 2.0, elapsed
    # the half-open socket was closed
    assert proc_fds(pid) == fds

    assert_usable(pg, pid, redis_factory())


@pytest.mark.parametrize("interrupt", ["pg_cancel_backend", "statement_timeout"])
@pytest.mark.parametrize("on_error", ["error", "allow"])
def test_blackhole_connect_interrupted(pg, redis_factory, blackhole, interrupt, on_error):
    """A connect with a one-minute connect_timeout is ended at once by a
    cancel or statement_timeout (57014 whatever on_error says)."""
    victim = pg_connect()
    try:
        pid = victim.info.backend_pid
        fds = prepare_victim(victim, redis_factory)
        set_gucs(victim, host="127.0.0.1", port=blackhole.port, connect_timeout=60000,
                 retry_interval=0, on_error=on_error)
        if interrupt == "statement_timeout":
            victim.execute("SET statement_timeout = '300ms'")
        identity = new_ident("blackhole_cancel")

        v = Victim(victim, ALLOW, (identity,))
        v.start()
        if interrupt == "pg_cancel_backend":
            wait_until_active(pg, pid)
            time.sleep(0.3)
            t_interrupt = time.monotonic()
            assert pg.execute("SELECT pg_cancel_backend(%s)", (pid,)).fetchone()[0] is True
        else:
            t_interrupt = v.started + 0.3
        v.join(timeout=30)
        assert not v.is_alive(), "the connect was not interrupted within 30 s"

        note("7 blackhole %s on_error=%s" % (interrupt, on_error),
             "call (interrupted after 0.3 s)", v.finished - v.started)
        assert isinstance(v.error, psycopg.errors.QueryCanceled), repr(v.error)
        assert v.error.sqlstate == "57014"
        assert v.finished - t_interrupt < 1.5, v.finished - t_interrupt
        assert v.finished - v.started >= 0.25  # it really hung in connect
        assert proc_fds(pid) == fds  # the half-open socket was closed

        victim.execute("RESET statement_timeout")
        assert_usable(victim, pid, redis_factory())
    finally:
        victim.close()
