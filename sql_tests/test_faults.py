"""Fault injection: hung, dead, restarted and misbehaving Redis servers.

Every test starts its own redis-server(s) through redis_factory and points
its session at them with SET rl_redis.* (the tests connect as superuser).
Redis "hangs" are SIGSTOP: the kernel still accepts the connection and the
request, nothing answers.
"""

import os
import pwd
import threading
import time

import psycopg
import psycopg.errors
import pytest

from conftest import TcpProxy, new_ident, pg_connect, rl_key, set_gucs, use_redis
from redis_topology import wait_for

LONG_WINDOW_MS = 600000

ALLOW = "SELECT rl_sliding_allow(%s, 1000, 600000)"
FIXED_ALLOW = "SELECT rl_fixed_allow(%s, 1000, 600000)"
# what an ordinary role needs to run ALLOW (1.3: not executable by PUBLIC)
ALLOW_FUNCTION = "rl_sliding_allow(text, integer, bigint, integer)"


def allow_key(identity, prefix="rl:"):
    """The Redis key ALLOW writes (explicit keys carry lim/window_ms)."""
    return rl_key("sliding", identity, lim=1000, window_ms=600000, prefix=prefix)


def allow(conn, identity, query=ALLOW):
    """One rate-limit call that must succeed; returns the boolean."""
    value = conn.execute(query, (identity,)).fetchone()[0]
    assert isinstance(value, bool), value
    return value


def in_sync_call(conn, identity, lim=777):
    """A call whose reply must belong to it: lim is echoed back by the script,
    so a stale reply of an abandoned command (with lim 1000) would show up
    here. Returns (allowed, lim)."""
    row = conn.execute(
        "SELECT (r).allowed, (r).lim FROM rl_sliding(%s, %s, 600000) AS r",
        (identity, lim),
    ).fetchone()
    return row


def timed_error(conn, query, params):
    """Runs a query that must fail; returns (exception, seconds it took)."""
    t0 = time.monotonic()
    with pytest.raises(psycopg.Error) as excinfo:
        conn.execute(query, params)
    return excinfo.value, time.monotonic() - t0


class Notice:
    """What a notice said (psycopg's Diagnostic is only valid inside the
    handler, so the fields are copied out there)."""

    def __init__(self, diag):
        self.severity = diag.severity_nonlocalized
        self.sqlstate = diag.sqlstate
        self.message_primary = diag.message_primary
        self.message_detail = diag.message_detail

    def __repr__(self):
        return "Notice(%s %s %r)" % (self.severity, self.sqlstate, self.message_primary)


def collect_notices(conn):
    notices = []
    conn.add_notice_handler(lambda diag: notices.append(Notice(diag)))
    return notices


def warnings_of(notices):
    return [n for n in notices if n.severity == "WARNING"]


def wait_until_active(pg, pid, timeout=10.0):
    """Waits until backend `pid` is running a statement."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = pg.execute(
            "SELECT state FROM pg_stat_activity WHERE pid = %s", (pid,)
        ).fetchone()
        if row is not None and row[0] == "active":
            return
        time.sleep(0.02)
    pytest.fail("backend %d never became active" % pid)


class Victim(threading.Thread):
    """Runs one statement on `conn` in a thread; records the outcome and when
    it happened (time.monotonic())."""

    def __init__(self, conn, query, params):
        super().__init__(daemon=True)
        self.conn, self.query, self.params = conn, query, params
        self.result = self.error = None
        self.started = self.finished = None

    def run(self):
        self.started = time.monotonic()
        try:
            self.result = self.conn.execute(self.query, self.params).fetchone()
        except BaseException as e:
            self.error = e
        self.finished = time.monotonic()


# ------------------------------------------------------------ hung Redis


@pytest.mark.parametrize("on_error", ["error", "allow", "deny"])
def test_hung_redis_statement_timeout(pg, redis_factory, on_error):
    r = redis_factory()
    use_redis(pg, r, on_error=on_error)
    identity = new_ident("stmt")
    assert allow(pg, identity) is True  # connection and scripts are ready

    pg.execute("SET statement_timeout = '300ms'")
    r.pause()
    err, elapsed = timed_error(pg, ALLOW, (identity,))
    # a cancel is never turned into a policy decision, whatever on_error says
    assert isinstance(err, psycopg.errors.QueryCanceled), repr(err)
    assert err.sqlstate == "57014"
    assert 0.25 <= elapsed < 0.3 + 0.7, elapsed

    r.resume()
    pg.execute("RESET statement_timeout")
    assert in_sync_call(pg, identity) == (True, 777)  # same session, reconnected
    assert allow(pg, identity) is True


def test_hung_redis_pg_cancel_backend(pg, redis_factory):
    r = redis_factory()
    victim_conn = pg_connect()
    try:
        use_redis(victim_conn, r, command_timeout=60000)
        identity = new_ident("cancel")
        assert allow(victim_conn, identity) is True
        pid = victim_conn.info.backend_pid

        r.pause()
        v = Victim(victim_conn, ALLOW, (identity,))
        v.start()
        wait_until_active(pg, pid)
        time.sleep(0.3)
        t_cancel = time.monotonic()
        assert pg.execute("SELECT pg_cancel_backend(%s)", (pid,)).fetchone()[0] is True
        v.join(timeout=30)
        assert not v.is_alive(), "the cancel was not honoured within 30 s"

        assert isinstance(v.error, psycopg.errors.QueryCanceled), repr(v.error)
        assert v.error.sqlstate == "57014"
        assert v.finished - t_cancel < 1.5, v.finished - t_cancel
        assert v.finished - v.started >= 0.25  # it really was stuck in Redis

        r.resume()
        assert in_sync_call(victim_conn, identity) == (True, 777)
        assert allow(victim_conn, identity) is True
    finally:
        r.resume()
        victim_conn.close()


def test_hung_redis_pg_terminate_backend(pg, redis_factory):
    r = redis_factory()
    victim_conn = pg_connect()
    try:
        use_redis(victim_conn, r, command_timeout=60000)
        identity = new_ident("term")
        assert allow(victim_conn, identity) is True
        pid = victim_conn.info.backend_pid

        r.pause()
        v = Victim(victim_conn, ALLOW, (identity,))
        v.start()
        wait_until_active(pg, pid)
        time.sleep(0.3)
        t_kill = time.monotonic()
        assert pg.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone()[0] is True
        v.join(timeout=30)
        assert not v.is_alive(), "pg_terminate_backend was not honoured within 30 s"

        # AdminShutdown (57P01) is a subclass of OperationalError
        assert isinstance(v.error, psycopg.OperationalError), repr(v.error)
        assert v.finished - t_kill < 2.0, v.finished - t_kill

        deadline = time.monotonic() + 5.0
        while True:
            gone = pg.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,)
            ).fetchone()[0] == 0
            if gone or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert gone, "backend %d still in pg_stat_activity 5 s after terminate" % pid
    finally:
        r.resume()
        victim_conn.close()


def test_hung_redis_command_timeout(pg, redis_factory):
    r = redis_factory()
    use_redis(pg, r, command_timeout=300)
    identity = new_ident("cmdto")
    assert allow(pg, identity) is True

    r.pause()
    err, elapsed = timed_error(pg, ALLOW, (identity,))
    assert err.sqlstate == "08006", repr(err)
    assert 0.25 <= elapsed <= 1.5, elapsed

    r.resume()
    assert in_sync_call(pg, identity) == (True, 777)
    assert allow(pg, identity) is True


@pytest.mark.parametrize("on_error, expected", [("allow", True), ("deny", False)])
def test_hung_redis_command_timeout_policy(pg, redis_factory, on_error, expected):
    """command_timeout is a Redis failure, so on_error decides (unlike a cancel)."""
    r = redis_factory()
    use_redis(pg, r, command_timeout=300, on_error=on_error)
    notices = collect_notices(pg)
    identity = new_ident("cmdto_policy")
    assert allow(pg, identity) is True
    assert warnings_of(notices) == []

    r.pause()
    t0 = time.monotonic()
    value = allow(pg, identity)
    elapsed = time.monotonic() - t0
    assert value is expected
    assert 0.25 <= elapsed <= 1.5, elapsed
    assert len(warnings_of(notices)) == 1, notices

    r.resume()
    assert in_sync_call(pg, identity) == (True, 777)
    assert allow(pg, identity) is True


# ------------------------------------------------------------ restart, flush


def test_redis_restart_on_error_error(pg, redis_factory):
    r = redis_factory()
    use_redis(pg, r, on_error="error")
    identity = new_ident("restart")
    assert allow(pg, identity) is True

    r.stop()
    r.start()

    outcomes = []
    for _ in range(3):
        try:
            outcomes.append(allow(pg, identity))
        except psycopg.Error as e:
            outcomes.append(e)
    failures = [o for o in outcomes if isinstance(o, Exception)]
    assert len(failures) <= 1, outcomes
    if failures:
        assert outcomes[0] is failures[0], outcomes  # only the first may fail
        assert failures[0].sqlstate is not None and failures[0].sqlstate.startswith("08"), (
            repr(failures[0])
        )
    # the restarted Redis has no data: every successful call is allowed
    assert [o for o in outcomes if not isinstance(o, Exception)] == [True] * (3 - len(failures))


def test_redis_restart_on_error_allow(pg, redis_factory):
    r = redis_factory()
    use_redis(pg, r, on_error="allow")
    identity = new_ident("restart_allow")
    assert allow(pg, identity) is True

    r.stop()
    assert allow(pg, identity) is True  # Redis down: allowed by policy
    r.start()
    assert [allow(pg, identity) for _ in range(3)] == [True, True, True]
    # and the calls after the restart really reached the new Redis
    assert int(r.cli("EXISTS", allow_key(identity))) == 1


@pytest.mark.parametrize("flush", ["FUNCTION", "SCRIPT"])
def test_script_flush_is_transparent(pg, redis_factory, flush):
    """FUNCTION FLUSH (the library gone: the next call loads it) or SCRIPT
    FLUSH (the scripts that go by EVAL gone) between calls: nothing seen."""
    r = redis_factory()
    use_redis(pg, r, on_error="error")
    notices = collect_notices(pg)
    query = "SELECT (r).allowed, (r).remaining FROM rl_fixed(%s, 5, %s) AS r"

    for _ in range(4):
        identity = new_ident("flush")
        t0 = r.time_ms()
        first = pg.execute(query, (identity, LONG_WINDOW_MS)).fetchone()
        assert r.cli(flush, "FLUSH") == "OK"
        second = pg.execute(query, (identity, LONG_WINDOW_MS)).fetchone()
        t1 = r.time_ms()
        if t0 // LONG_WINDOW_MS == t1 // LONG_WINDOW_MS:
            break
    else:
        pytest.fail("never stayed inside one fixed window")
    assert first == (True, 4)
    assert second == (True, 3)
    assert warnings_of(notices) == []
    # flushing twice in a row, with the sliding script too
    assert r.cli(flush, "FLUSH") == "OK"
    assert allow(pg, identity) is True
    assert r.cli(flush, "FLUSH") == "OK"
    assert allow(pg, identity) is True


# ------------------------------------------------------------ Redis down


def _down_redis(redis_factory):
    r = redis_factory()
    r.stop()
    return r


def test_redis_down_on_error_error(pg, redis_factory):
    r = _down_redis(redis_factory)
    use_redis(pg, r, on_error="error")
    identity = new_ident("down")
    for query in (ALLOW, FIXED_ALLOW, "SELECT rl_fixed(%s, 5, 60000)"):
        err, elapsed = timed_error(pg, query, (identity,))
        assert err.sqlstate == "08001", repr(err)
        assert "127.0.0.1:%d" % r.port in str(err), str(err)
        assert elapsed < 1.0, elapsed
    # the session stays usable (and sees Redis once it is back)
    r.start()
    assert allow(pg, identity) is True


def test_redis_down_on_error_allow(pg, redis_factory):
    r = _down_redis(redis_factory)
    use_redis(pg, r, on_error="allow")
    notices = collect_notices(pg)
    identity = new_ident("down_allow")

    t0 = time.monotonic()
    assert allow(pg, identity) is True
    assert time.monotonic() - t0 < 1.0
    w = warnings_of(notices)
    assert len(w) == 1, notices
    assert "127.0.0.1:%d" % r.port in w[0].message_primary, w[0].message_primary

    t0 = time.monotonic()
    row = pg.execute(
        "SELECT (r).allowed, (r).lim, (r).remaining, (r).retry_after_ms "
        "FROM rl_fixed(%s, 5, 60000, 2) AS r",
        (identity,),
    ).fetchone()
    assert time.monotonic() - t0 < 1.0
    assert row == (True, 5, 3, 0)  # remaining = max(lim - cost, 0)
    # one warning per outage, not one per call
    assert len(warnings_of(notices)) == 1, notices


def test_redis_down_on_error_deny(pg, redis_factory):
    r = _down_redis(redis_factory)
    use_redis(pg, r, on_error="deny")
    notices = collect_notices(pg)
    identity = new_ident("down_deny")

    t0 = time.monotonic()
    assert allow(pg, identity) is False
    assert time.monotonic() - t0 < 1.0
    t0 = time.monotonic()
    assert allow(pg, identity, FIXED_ALLOW) is False
    assert time.monotonic() - t0 < 1.0
    t0 = time.monotonic()
    row = pg.execute(
        "SELECT (r).allowed, (r).lim, (r).remaining, (r).retry_after_ms "
        "FROM rl_fixed(%s, 5, 60000) AS r",
        (identity,),
    ).fetchone()
    assert time.monotonic() - t0 < 1.0
    assert row == (False, 5, 0, 1000)
    # one warning per outage, not one per call
    assert len(warnings_of(notices)) == 1, notices


# ------------------------------------------------------------ error replies


def test_redis_error_reply(pg, redis_factory):
    r = redis_factory()
    use_redis(pg, r, on_error="error")
    identity = new_ident("wrongtype")
    # the key of rl_fixed(identity, 5, 60000) and rl_fixed_allow(identity, 5, 60000)
    fixed_key = rl_key("fixed", identity, lim=5, window_ms=60000)
    assert int(r.cli("RPUSH", fixed_key, "x")) == 1

    err, _ = timed_error(pg, "SELECT rl_fixed(%s, 5, 60000)", (identity,))
    assert err.sqlstate == "08000", repr(err)
    assert "WRONGTYPE" in str(err), str(err)
    err, _ = timed_error(pg, "SELECT rl_fixed_allow(%s, 5, 60000)", (identity,))
    assert err.sqlstate == "08000", repr(err)

    # the session is fine: another key of the same identity works
    assert allow(pg, identity) is True

    set_gucs(pg, on_error="allow")
    notices = collect_notices(pg)
    assert allow(pg, identity, "SELECT rl_fixed_allow(%s, 5, 60000)") is True
    w = warnings_of(notices)
    assert len(w) == 1, notices
    assert w[0].message_primary == "Redis at 127.0.0.1:%d returned an error" % r.port, w[0].message_primary
    assert w[0].message_detail.startswith("WRONGTYPE "), w[0].message_detail
    # the list was not touched
    assert r.cli("LRANGE", fixed_key, "0", "-1") == "x"


# ------------------------------------------------------------ GUC changes


def test_guc_change_reconnects(pg, redis_factory):
    a = redis_factory()
    b = redis_factory()
    identity = new_ident("guc")
    query = "SELECT rl_sliding_allow(%s, 2, 600000)"

    use_redis(pg, a)
    assert [allow(pg, identity, query) for _ in range(3)] == [True, True, False]
    # only the port changes from here on: the next call must reconnect
    pg.execute("SET rl_redis.port = %d" % b.port)
    assert allow(pg, identity, query) is True  # fresh state on B
    pg.execute("SET rl_redis.port = %d" % a.port)
    assert allow(pg, identity, query) is False  # A still remembers
    pg.execute("SET rl_redis.port = %d" % b.port)
    assert allow(pg, identity, query) is True
    assert allow(pg, identity, query) is False  # B: now 2 used
    # RESET goes back to postgresql.conf's server, where this identity is new
    pg.execute("RESET rl_redis.port")
    assert allow(pg, identity, query) is True

    key = rl_key("sliding", identity, lim=2, window_ms=600000)
    assert int(a.cli("ZCARD", key)) >= 1
    assert int(b.cli("EXISTS", key)) == 1


def test_key_prefix_guc(pg, redis_factory):
    r = redis_factory()
    use_redis(pg, r, key_prefix="other:")
    identity = new_ident("prefix")
    assert allow(pg, identity, "SELECT rl_fixed_allow(%s, 5, 600000)") is True
    assert int(r.cli("EXISTS", rl_key("fixed", identity, lim=5, window_ms=600000,
                                      prefix="other:"))) == 1
    assert int(r.cli("EXISTS", rl_key("fixed", identity, lim=5, window_ms=600000))) == 0
    assert r.cli("KEYS", "rl:*") == ""  # nothing at all under the default prefix


# ------------------------------------------------------------ AUTH, privileges


def test_auth_password(pg, redis_factory):
    password = "secret"
    r = redis_factory(password=password)
    use_redis(pg, r)
    identity = new_ident("auth")

    err, elapsed = timed_error(pg, ALLOW, (identity,))
    assert err.sqlstate == "08001", repr(err)
    assert password not in str(err)
    assert elapsed < 1.0

    set_gucs(pg, password="wrong-" + identity)
    err, _ = timed_error(pg, ALLOW, (identity,))
    assert err.sqlstate == "08001", repr(err)
    assert "wrong-" + identity not in str(err)
    assert password not in str(err)

    pg.execute("SET rl_redis.password = 'secret'")
    assert allow(pg, identity) is True
    assert int(r.cli("EXISTS", allow_key(identity))) == 1


def password_file(password):
    """A file with the password on its first line, readable by the cluster's
    owner only (0600, owned by postgres when the tests run as root), in the
    test cluster's folder. Returns its path."""
    path = os.path.join(os.environ["RL_DIR"], "redis-password-%s" % new_ident().split(":")[-1])
    with open(path, "w") as f:
        f.write(password + "\n")
    os.chmod(path, 0o600)
    if os.geteuid() == 0:
        pw = pwd.getpwnam("postgres")
        os.chown(path, pw.pw_uid, pw.pw_gid)
    return path


def create_app_role(pg):
    """An ordinary LOGIN role that may run ALLOW (1.3: the explicit-argument
    functions are not executable by PUBLIC, an administrator grants them)."""
    role = "rl_pytest_%s" % new_ident().split(":")[-1][:16]
    pg.execute('CREATE ROLE "%s" LOGIN' % role)
    pg.execute('GRANT EXECUTE ON FUNCTION %s TO "%s"' % (ALLOW_FUNCTION, role))
    return role


def drop_app_role(pg, role):
    pg.execute('DROP OWNED BY "%s"' % role)  # and its privileges
    pg.execute('DROP ROLE "%s"' % role)


def test_non_superuser_cannot_set_or_read_connection_gucs(pg, redis_factory):
    password = "pw-" + new_ident("role").split(":")[-1]
    r = redis_factory(password=password)
    path = password_file(password)
    role = create_app_role(pg)
    conn = None
    try:
        # as superuser: the role's sessions use the password-protected Redis.
        # A role setting is readable by every role, so the password itself
        # may not be one (1.3: 22023); the role gets the file that holds it.
        pg.execute('ALTER ROLE "%s" SET rl_redis.port = %d' % (role, r.port))
        with pytest.raises(psycopg.Error) as excinfo:
            pg.execute("ALTER ROLE \"%s\" SET rl_redis.password = '%s'" % (role, password))
        assert excinfo.value.sqlstate == "22023", repr(excinfo.value)
        pg.execute("ALTER ROLE \"%s\" SET rl_redis.password_file = '%s'" % (role, path))
        conn = pg_connect(user=role)
        assert conn.execute("SELECT current_user").fetchone()[0] == role
        # this loads the library (so the GUCs are real, not placeholders) and
        # shows that the superuser-provided password works for the role
        identity = new_ident("role")
        assert allow(conn, identity) is True

        for stmt in (
            "SET rl_redis.port = 1",
            "SET rl_redis.on_error = 'allow'",
            "SET rl_redis.password = 'x'",
            "SET rl_redis.password_file = '/tmp/x'",
            "SET rl_redis.host = '10.0.0.1'",
        ):
            with pytest.raises(psycopg.Error) as excinfo:
                conn.execute(stmt)
            assert excinfo.value.sqlstate == "42501", (stmt, repr(excinfo.value))
        with pytest.raises(psycopg.Error) as excinfo:
            conn.execute("SELECT set_config('rl_redis.on_error', 'deny', false)")
        assert excinfo.value.sqlstate == "42501"

        # nothing reveals the password
        for query in (
            "SHOW rl_redis.password",
            "SELECT current_setting('rl_redis.password')",
            "SELECT setting FROM pg_settings WHERE name = 'rl_redis.password'",
            "SELECT string_agg(setting, ',') FROM pg_settings WHERE name LIKE 'rl_redis.%'",
            "SELECT * FROM pg_db_role_setting",
        ):
            try:
                rows = conn.execute(query).fetchall()
            except psycopg.Error as e:
                assert e.sqlstate == "42501", (query, repr(e))
                assert password not in str(e)
            else:
                assert password not in repr(rows), query

        # still usable, still on the protected Redis, nothing changed
        assert allow(conn, identity) is True
        assert conn.execute("SHOW rl_redis.port").fetchone()[0] == str(r.port)
        assert int(r.cli("ZCARD", allow_key(identity))) == 2
    finally:
        if conn is not None:
            conn.close()
        drop_app_role(pg, role)
        os.unlink(path)


def test_non_superuser_cannot_set_timeouts(pg):
    """The timeouts are superuser-only: with on_error = allow, a 1 ms timeout
    would let an ordinary role make its own calls fail open."""
    role = create_app_role(pg)
    conn = None
    try:
        conn = pg_connect(user=role)
        identity = new_ident("userset")
        assert allow(conn, identity) is True  # loads the library
        for setting in ("rl_redis.command_timeout", "rl_redis.connect_timeout"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege) as exc:
                conn.execute("SET %s = 1" % setting)
            assert exc.value.sqlstate == "42501"
        assert conn.execute("SHOW rl_redis.command_timeout").fetchone()[0] == "2s"
        assert allow(conn, identity) is True
    finally:
        if conn is not None:
            conn.close()
        drop_app_role(pg, role)


# (name, unit, production default, least, context): the timers tests shorten
TIMER_SETTINGS = [
    ("rl_redis.xact_end_budget", "ms", 1000, 1, "superuser"),
    ("rl_redis.worker_restart_interval", "s", 1, 0, "postmaster"),
    ("rl_redis.sentinel_recheck_interval", "ms", 1000, 1, "superuser"),
    ("rl_redis.slot_map_refresh_interval", "ms", 100, 1, "superuser"),
]


def test_timer_settings_for_tests(pg):
    """The settings that let tests shorten the built-in timers: each has its
    production value as default and as maximum (none can make anything wait
    longer: 22023 above it) and is refused to an ordinary role (42501); the
    worker's restart interval is read at server start (55P02 for SET, even
    by a superuser; reloadable, and without effect, when the library is not
    preloaded, as there is no worker then)."""
    preloaded = "rl_redis" in pg.execute("SHOW shared_preload_libraries").fetchone()[0]
    rows = pg.execute(
        "SELECT name, unit, boot_val, reset_val, setting, min_val, max_val, context "
        "FROM pg_settings WHERE name = ANY(%s) ORDER BY name",
        ([t[0] for t in TIMER_SETTINGS],)).fetchall()
    want = [(name, unit, str(default), str(default), str(default), str(least), str(default),
             context if context != "postmaster" or preloaded else "sighup")
            for name, unit, default, least, context in sorted(TIMER_SETTINGS)]
    assert rows == want
    for name, _, default, _, context in TIMER_SETTINGS:
        with pytest.raises(psycopg.Error) as exc:
            pg.execute("SET %s = %d" % (name, default + 1))
        assert exc.value.sqlstate == ("55P02" if context == "postmaster" else "22023"), (name, exc.value)
    pg.execute("SET rl_redis.xact_end_budget = 100")
    assert pg.execute("SHOW rl_redis.xact_end_budget").fetchone()[0] == "100ms"
    with pytest.raises(psycopg.Error) as exc:
        pg.execute("SET rl_redis.worker_restart_interval = 0")
    assert exc.value.sqlstate == "55P02", exc.value

    role = create_app_role(pg)
    conn = None
    try:
        conn = pg_connect(user=role)
        assert allow(conn, new_ident("timers")) is True  # loads the library
        for name, _, default, least, context in TIMER_SETTINGS:
            with pytest.raises(psycopg.Error) as exc:
                conn.execute("SET %s = %d" % (name, least))
            assert exc.value.sqlstate == ("55P02" if context == "postmaster" else "42501"), (name, exc.value)
            if context == "superuser":
                with pytest.raises(psycopg.errors.InsufficientPrivilege):
                    conn.execute("SELECT set_config(%s, %s, false)", (name, str(least)))
            # still the production value in the role's session
            assert conn.execute("SELECT setting FROM pg_settings WHERE name = %s",
                                (name,)).fetchone() == (str(default),), name
    finally:
        if conn is not None:
            conn.close()
        drop_app_role(pg, role)


def test_timer_settings_refused_through_a_placeholder(unpreloaded_cluster):
    """Before a session loads the library, rl_redis.* names are placeholders
    that any role may SET: an ordinary role's value of a timer setting is
    refused when the library loads (WARNING 42501) and the production value
    stays; a role setting of one is refused outright (42501)."""
    with pg_connect(host="127.0.0.1", port=unpreloaded_cluster, user="postgres",
                    dbname="postgres") as su:
        su.execute("CREATE EXTENSION rl_redis")
        role = create_app_role(su)
        try:
            with pg_connect(host="127.0.0.1", port=unpreloaded_cluster, user=role,
                            dbname="postgres") as conn:
                notices = []
                conn.add_notice_handler(lambda d: notices.append((d.severity_nonlocalized, d.sqlstate)))
                for name, _, _, least, context in TIMER_SETTINGS:
                    conn.execute("SET %s = %d" % (name, least))  # a placeholder: accepted
                assert allow(conn, new_ident("placeholder")) is True  # loads the library
                refused = [n for n in notices if n == ("WARNING", "42501")]
                assert len(refused) == sum(1 for t in TIMER_SETTINGS if t[4] != "postmaster"), notices
                for name, _, default, _, _ in TIMER_SETTINGS:
                    assert conn.execute("SELECT setting FROM pg_settings WHERE name = %s",
                                        (name,)).fetchone() == (str(default),), name
                with pytest.raises(psycopg.errors.InsufficientPrivilege):
                    conn.execute('ALTER ROLE "%s" SET rl_redis.xact_end_budget = 1' % role)
        finally:
            drop_app_role(su, role)


# ------------------------------------------------------------ Unix socket


def test_unix_socket(pg, redis_factory):
    r = redis_factory(unix_socket=True)
    set_gucs(pg, host=r.unix_socket)
    identity = new_ident("unix")
    query = "SELECT rl_sliding_allow(%s, 2, 600000)"
    assert [allow(pg, identity, query) for _ in range(3)] == [True, True, False]
    assert int(r.cli("EXISTS", rl_key("sliding", identity, lim=2, window_ms=600000))) == 1
    assert pg.execute("SELECT (rl_redis_ping()).server").fetchone()[0] is not None


def test_abort_after_interrupted_wait_does_not_wait_again(pg, redis_factory):
    """A transaction that holds a concurrency slot and has a refund pending
    is cancelled while Redis hangs: its end does not wait on Redis again
    beyond rl_redis.xact_end_budget (200 ms here). The interrupted call's
    connection is kept, its reply to be dropped: the slot release and the
    refund are written behind the cancelled call on the same connection, so
    that once Redis wakes it runs them in order, without the session calling
    again (before, the connection was dropped and they waited for the
    session's next call). The next call then reads and drops the cancelled
    call's reply and gets its own."""
    r = redis_factory()
    use_redis(pg, r, on_error="error", command_timeout=5000, refund_on_abort="all",
              xact_end_budget=200)
    identity = new_ident("abort_hung")
    slot_key = rl_key("concurrency", identity, lim=2, window_ms=60000)
    notices = collect_notices(pg)
    pg.execute("BEGIN")
    assert pg.execute("SELECT rl_concurrency_acquire_allow(%s, 2, 60000)",
                      (identity,)).fetchone()[0] is True
    assert allow(pg, identity) is True
    assert int(r.cli("ZCARD", slot_key)) == 1
    assert int(r.cli("ZCARD", allow_key(identity))) == 1
    r.pause()
    try:
        pg.execute("SET LOCAL statement_timeout = '300ms'")
        with pytest.raises(psycopg.errors.QueryCanceled):
            pg.execute(ALLOW, (identity,))
        t0 = time.monotonic()
        pg.execute("ROLLBACK")
        elapsed = time.monotonic() - t0
    finally:
        r.resume()
    assert elapsed < 0.2 + 0.5, elapsed  # the budget, not 2 x command_timeout
    assert warnings_of(notices) == []
    # Redis ran the cancelled call, then the release and the refund (the
    # cancelled call's unit too): nobody called meanwhile
    wait_for(lambda: int(r.cli("EXISTS", slot_key)) == 0 and
               int(r.cli("EXISTS", allow_key(identity))) == 0, 5.0,
               "the release and the refund after Redis woke")
    # the next call gets its own reply (lim 7), not the cancelled call's
    fresh = new_ident("abort_hung_after")
    assert pg.execute("SELECT (r).allowed, (r).lim, (r).remaining "
                      "FROM rl_sliding(%s, 7, 600000) AS r", (fresh,)).fetchone() == (True, 7, 6)
    assert allow(pg, fresh) is True


ACQUIRE_LONG = "SELECT rl_concurrency_acquire_allow(%s, 1, 600000)"


def slot_key_long(identity):
    """The key of ACQUIRE_LONG (lim 1, a lease of 10 minutes)."""
    return rl_key("concurrency", identity, lim=1, window_ms=600000)


def killed_in_transaction(pg, r, end, refund=False):
    """BEGIN; a slot of ACQUIRE_LONG (and with refund a unit of ALLOW to be
    refunded); Redis kills the session's connection (CLIENT KILL); then end
    ("COMMIT" or "ROLLBACK"). Returns the identity."""
    identity = new_ident("killed")
    pg.execute("BEGIN")
    assert allow(pg, identity, ACQUIRE_LONG) is True
    if refund:
        assert allow(pg, identity) is True
    assert int(r.cli("ZCARD", slot_key_long(identity))) == 1
    assert int(r.cli("CLIENT", "KILL", "TYPE", "normal")) >= 1
    pg.execute(end)
    return identity


@pytest.mark.parametrize("end", ["COMMIT", "ROLLBACK"])
def test_slot_free_when_xact_ends_after_client_kill(pg, redis_factory, end):
    """Redis closed the session's idle connection (CLIENT KILL) inside a
    transaction that holds a slot (lease 10 minutes): the slot is free as
    soon as COMMIT (or ROLLBACK) returns, with no WARNING and no other call
    of that session: the transaction end connects again, to the address it
    resolved before (before, the release waited for the session's next
    call). With ROLLBACK the unit of the rolled-back transaction is given
    back too. Another session takes the slot at once."""
    r = redis_factory()
    use_redis(pg, r, refund_on_abort="all")
    notices = collect_notices(pg)
    identity = killed_in_transaction(pg, r, end, refund=True)
    assert int(r.cli("EXISTS", slot_key_long(identity))) == 0
    assert int(r.cli("EXISTS", allow_key(identity))) == (0 if end == "ROLLBACK" else 1)
    assert warnings_of(notices) == []
    with pg_connect() as other:
        use_redis(other, r)
        other.execute("BEGIN")
        assert allow(other, identity, ACQUIRE_LONG) is True
        assert allow(other, identity, ACQUIRE_LONG) is False
        other.execute("ROLLBACK")


def test_slot_free_at_commit_after_redis_idle_timeout(pg, redis_factory):
    """Redis's own `timeout` (1 s) closed the session's connection while its
    transaction held a slot: the slot is free once COMMIT returns."""
    r = redis_factory(extra_args=("--timeout", "1"))
    use_redis(pg, r)
    identity = new_ident("redis_timeout")
    pg.execute("BEGIN")
    assert allow(pg, identity, ACQUIRE_LONG) is True
    # only the connection asking is left
    wait_for(lambda: len(r.command("CLIENT", "LIST").splitlines()) == 1, 15.0,
               "Redis to close the idle connection")
    pg.execute("COMMIT")
    assert int(r.cli("EXISTS", slot_key_long(identity))) == 0


def test_xact_end_after_failed_call_gives_the_slot_back(pg, redis_factory):
    """While the transaction holds a slot, Redis holds its clients (CLIENT
    PAUSE 400 ms): a call is cancelled by statement_timeout in a savepoint
    (rolled back), then a call fails by command_timeout (on_error allow).
    COMMIT still gives the slot back as soon as Redis answers again, with no
    other call of the session (before, it waited for the next call)."""
    r = redis_factory()
    use_redis(pg, r, on_error="allow")
    identity = new_ident("failed_call")
    pg.execute("BEGIN")
    assert allow(pg, identity, ACQUIRE_LONG) is True
    for _ in range(5):
        r.cli("CLIENT", "PAUSE", "400", "ALL")
        t0 = time.monotonic()
        pg.execute("SAVEPOINT s")
        pg.execute("SET LOCAL statement_timeout = '100ms'")
        try:
            pg.execute(ALLOW, (new_ident("failed_call_other"),))
        except psycopg.errors.QueryCanceled:
            pg.execute("ROLLBACK TO SAVEPOINT s")
            break
        # answered: only when the pause was over before the call (a loaded
        # machine); then again
        assert time.monotonic() - t0 >= 0.4
        pg.execute("ROLLBACK TO SAVEPOINT s")
    else:
        pytest.fail("no call came within a 400 ms CLIENT PAUSE in 5 tries")
    set_gucs(pg, command_timeout=100)
    assert allow(pg, new_ident("failed_call_third")) is True  # on_error allow
    pg.execute("COMMIT")
    wait_for(lambda: int(r.cli("EXISTS", slot_key_long(identity))) == 0, 3.0,
               "the release after CLIENT PAUSE ended")


def test_xact_end_after_a_call_opened_the_breaker_gives_the_slot_back(pg, redis_factory):
    """The same with the circuit breaker on (retry_interval 10 s): a call of
    the transaction fails during CLIENT PAUSE and opens the breaker; the
    COMMIT after the pause still tries and gives the slot back with no
    other call (the breaker holds back only the transaction ends of an
    outage that began before the transaction)."""
    r = redis_factory()
    use_redis(pg, r, on_error="allow", retry_interval=10000)
    identity = new_ident("failed_breaker")
    pg.execute("BEGIN")
    assert allow(pg, identity, ACQUIRE_LONG) is True
    r.cli("CLIENT", "PAUSE", "400", "ALL")
    set_gucs(pg, command_timeout=100)
    assert allow(pg, new_ident("failed_breaker_other")) is True  # on_error allow
    assert r.cli("PING") == "PONG"  # (answered once the pause is over)
    set_gucs(pg, command_timeout=2000)
    pg.execute("COMMIT")
    wait_for(lambda: int(r.cli("EXISTS", slot_key_long(identity))) == 0, 3.0,
             "the release after the failed call that opened the breaker")


def end_killed_and_paused(pg, r, identity, end, refund=False):
    """BEGIN; a slot of ACQUIRE_LONG for identity (with refund, a unit of
    ALLOW too); Redis kills the session's connection and stops (SIGSTOP);
    end ("COMMIT" or "ROLLBACK") must return within the 200 ms budget (with
    a generous margin); then Redis goes on."""
    pg.execute("BEGIN")
    assert allow(pg, identity, ACQUIRE_LONG) is True
    assert int(r.cli("ZCARD", slot_key_long(identity))) == 1  # taken
    if refund:
        assert allow(pg, identity) is True
    assert int(r.cli("CLIENT", "KILL", "TYPE", "normal")) >= 1
    r.pause()
    try:
        t0 = time.monotonic()
        pg.execute(end)
        elapsed = time.monotonic() - t0
    finally:
        r.resume()
    assert elapsed < 0.2 + 0.5, (end, elapsed)


def test_xact_end_with_redis_unreachable_is_bounded(pg, redis_factory):
    """Redis killed the session's connection, then hangs (SIGSTOP) at the
    transaction end, rl_redis.xact_end_budget 200 ms: COMMIT and ROLLBACK
    return within the budget (with a generous margin). Without a password
    the new connection takes the release and the refund and Redis runs them
    once it wakes, with no call of the session. With a password the
    connect's AUTH gets no answer in time: a WARNING says the work waits
    for the session's next call, the slot stays taken until that call, which
    gives it back."""
    r = redis_factory()
    use_redis(pg, r, refund_on_abort="all", xact_end_budget=200)
    notices = collect_notices(pg)
    for end in ("COMMIT", "ROLLBACK"):
        identity = new_ident("unreachable")
        end_killed_and_paused(pg, r, identity, end, refund=True)
        wait_for(lambda: int(r.cli("EXISTS", slot_key_long(identity))) == 0, 5.0,
                   "the release after Redis woke")
        assert int(r.cli("EXISTS", allow_key(identity))) == (0 if end == "ROLLBACK" else 1)
    assert warnings_of(notices) == []

    r = redis_factory(password="s3cret", extra_args=["--slowlog-log-slower-than", "0"])
    # (on_error = error: an acquire that failed under load must not pass
    # for a slot taken; once a slot was seen free after such a run)
    use_redis(pg, r, password="s3cret", on_error="error")
    for end in ("COMMIT", "ROLLBACK"):
        identity = new_ident("unreachable_auth")
        notices.clear()
        end_killed_and_paused(pg, r, identity, end)
        warned = [n.message_primary or "" for n in warnings_of(notices)]
        assert any("waits for the session's next call" in w for w in warned), warned
        # (what Redis ran, and its clients, shown in full when this fails:
        # it failed so now and then in loaded runs, the slot found free)
        if int(r.cli("ZCARD", slot_key_long(identity))) != 1:
            pytest.fail("the slot was given back after %s; warnings %r\nSLOWLOG:\n%s\nCLIENT LIST:\n%s"
                        % (end, warned, "\n".join(repr(e) for e in r.command("SLOWLOG", "GET", "30")),
                           r.command("CLIENT", "LIST")), pytrace=False)
        assert allow(pg, new_ident("unreachable_next")) is True  # the next call
        assert int(r.cli("EXISTS", slot_key_long(identity))) == 0


def test_reload_with_same_settings_keeps_the_connection(pg, redis_factory):
    """pg_reload_conf() assigns every setting again; unchanged connection
    settings must not make the backend reconnect."""
    r = redis_factory()
    use_redis(pg, r)
    identity = new_ident("reload")

    def connections():
        info = r.cli("INFO", "stats")
        return int(info.split("total_connections_received:")[1].split()[0])

    assert allow(pg, identity) is True
    before = connections()
    for _ in range(3):
        pg.execute("SELECT pg_reload_conf()")
        time.sleep(0.2)  # the reload signal reaches the backend
        pg.execute("SELECT 1")
        assert allow(pg, identity) is True
        pg.execute("SET rl_redis.port = %d" % r.port)  # the same value again
        assert allow(pg, identity) is True
    # only redis-cli's own INFO connections are new
    assert connections() - before == 1


def queued_of(pg):
    """The commands of transaction ends this session's connections hold."""
    return pg.execute("SELECT coalesce(sum(queued), 0)::int FROM rl_redis_connections()").fetchone()[0]


@pytest.mark.parametrize("outage", ["refused", "hung"])
def test_xact_ends_in_an_outage_return_at_once(pg, redis_factory, outage):
    """A slot release is queued while Redis is away (stopped: connections
    are refused; or hung, SIGSTOP: the kernel accepts, nothing answers),
    rl_redis.xact_end_budget 300 ms, the breaker on (retry_interval 60 s).
    The transaction end that queued it tries once (refused: a WARNING whose
    detail says why); the next 20 transaction ends, which use no rate limit
    at all, consult the breaker and return at once, without another
    WARNING (before, each connected again: refused, 20 WARNINGs; hung, each
    waited the whole budget, 6 s in all). Once Redis is back the work is
    done: hung, Redis runs the release it was sent; refused, the session's
    next call sends it."""
    r = redis_factory()
    use_redis(pg, r, xact_end_budget=300, retry_interval=60000, command_timeout=1000)
    notices = collect_notices(pg)
    identity = new_ident("outage_" + outage)
    pg.execute("BEGIN")
    assert allow(pg, identity, ACQUIRE_LONG) is True
    assert int(r.cli("CLIENT", "KILL", "TYPE", "normal")) >= 1
    if outage == "refused":
        r.stop()
    else:
        r.pause()
    try:
        pg.execute("COMMIT")
        t0 = time.monotonic()
        for i in range(20):
            if i % 2:
                pg.execute("SELECT 1")
            else:
                pg.execute("BEGIN")
                pg.execute("SELECT 1")
                pg.execute("COMMIT")
        elapsed = time.monotonic() - t0
    finally:
        if outage == "refused":
            r.start()
        else:
            r.resume()
    assert elapsed < 20 * 0.3 / 3, elapsed
    warned = warnings_of(notices)
    if outage == "refused":
        assert len(warned) == 1, warned
        assert "Connection refused" in (warned[0].message_detail or ""), warned[0].message_detail
        assert queued_of(pg) == 1
        set_gucs(pg, retry_interval=0)  # (a setting assigned: the breaker lets the next call try)
        assert allow(pg, new_ident("outage_next")) is True
        assert queued_of(pg) == 0
    else:
        assert warned == []
        wait_for(lambda: int(r.cli("EXISTS", slot_key_long(identity))) == 0, 5.0,
                 "the release after Redis woke")
    assert warnings_of(notices) == warned


def test_connection_with_unanswered_interrupted_call_is_dropped(pg, redis_factory):
    """A call is cancelled (statement_timeout) on a connection that then
    never answers again (TcpProxy.cut: a black hole, never closed):
    only the cancelled call's reply was due, so the next call, once its wait
    for it times out (command_timeout), drops the connection (nothing is
    lost), and the call after it connects again and is answered (before,
    the connection was kept for ever and every call failed with "still
    busy with rate-limit work of earlier transaction ends")."""
    r = redis_factory()
    proxy = TcpProxy(r.port)
    try:
        use_redis(pg, proxy, command_timeout=300, on_error="error")
        identity = new_ident("black_hole")
        assert allow(pg, identity) is True
        proxy.cut()
        pg.execute("SET statement_timeout = '100ms'")
        with pytest.raises(psycopg.errors.QueryCanceled):
            pg.execute(ALLOW, (identity,))
        pg.execute("RESET statement_timeout")
        with pytest.raises(psycopg.errors.ConnectionFailure):
            pg.execute(ALLOW, (identity,))
        assert allow(pg, identity) is True
        assert allow(pg, identity) is True
    finally:
        proxy.close()


def test_interrupted_call_answered_then_connection_closed(pg, redis_factory):
    """A call is cancelled while Redis hangs; Redis then answers it and
    closes the connection (CLIENT KILL). The next call reads and drops the
    cancelled call's reply, finds the connection closed (the liveness check,
    after the dropped replies) and connects again: it gets its answer
    (before, it was written to the closed connection and failed)."""
    r = redis_factory()
    use_redis(pg, r, command_timeout=2000, on_error="error")
    identity = new_ident("skip_then_kill")
    assert allow(pg, identity) is True
    r.pause()
    try:
        pg.execute("SET statement_timeout = '100ms'")
        with pytest.raises(psycopg.errors.QueryCanceled):
            pg.execute(ALLOW, (identity,))
        pg.execute("RESET statement_timeout")
    finally:
        r.resume()
    # Redis ran the cancelled call (2 units), then closes the connection
    wait_for(lambda: int(r.cli("ZCARD", allow_key(identity))) == 2, 5.0,
             "Redis to run the cancelled call")
    assert int(r.cli("CLIENT", "KILL", "TYPE", "normal")) >= 1
    assert in_sync_call(pg, identity) == (True, 777)


def test_release_refused_by_a_replica_stays_queued(pg, redis_factory):
    """The transaction end connects again to the address it resolved before,
    where a server that has become a replica now answers READONLY (a DNS
    failover endpoint's old IP): the slot release was not run there, so it
    stays queued (no WARNING, nothing lost) and the transaction end does not
    try that address again; once the server is a master again, the
    session's next call (which resolves the name again) sends it and the
    slot is free (before, the release was dropped with a WARNING)."""
    r = redis_factory()
    master = redis_factory()
    use_redis(pg, r, on_error="error")
    notices = collect_notices(pg)
    identity = new_ident("readonly")
    key = slot_key_long(identity)
    pg.execute("BEGIN")
    assert allow(pg, identity, ACQUIRE_LONG) is True
    members = r.command("ZRANGE", key, "0", "-1", "WITHSCORES")
    assert len(members) == 2
    assert int(r.cli("CLIENT", "KILL", "TYPE", "normal")) >= 1
    r.cli("REPLICAOF", "127.0.0.1", str(master.port))
    wait_for(lambda: "master_link_status:up" in r.cli("INFO", "replication"), 10.0,
             "the replica to sync")
    pg.execute("COMMIT")
    assert warnings_of(notices) == []
    assert queued_of(pg) == 1
    pg.execute("SELECT 1")  # another transaction end: nothing to do there
    assert queued_of(pg) == 1
    r.cli("REPLICAOF", "NO", "ONE")
    # the slot as it was before the sync emptied the server
    r.command("ZADD", key, members[1], members[0])
    assert allow(pg, new_ident("readonly_next")) is True
    assert queued_of(pg) == 0
    assert int(r.cli("EXISTS", key)) == 0
    assert warnings_of(notices) == []
