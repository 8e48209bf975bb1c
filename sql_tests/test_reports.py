"""What a failed Redis call reports, the way postgres_fdw reports a remote
error: the SQLSTATE, a primary message of ours, as DETAIL what Redis or the
system said, a HINT with the settings to look at, and as CONTEXT the call
that failed (which decision, on which key). Each kind of failure is checked
exactly: a closed port, a Redis that wants a password (NOAUTH on a small
command or on the set-up's SELECT, the unauthenticated multibulk length of
a decision's EVALSHA, a wrong password), an error reply (WRONGTYPE), a hung
Redis (command timeout) and a TLS handshake that never ends (connect
timeout); as an error and as rl_redis.on_error = allow's warning, through
rl_redis.transport = backend and shared (the worker's refused connection
and missing password too); and an ordinary role never sees the password or
the password file's path in any part of it. What Redis says that is not
text in the server encoding (a lying Redis's bytes, a long reply cut
mid-character) reaches a client of another encoding as the report, also at
a transaction end.
"""

import os

import psycopg
from psycopg import sql
import pytest

from conftest import (BlackHole, PgServer, free_port, give_to_owner, new_ident, own_connection_open,
                      pg_connect, rl_key, set_gucs, use_redis, wait_for)
from test_lying_redis import LyingRedis

HINT_SERVER = ("Check rl_redis.host and rl_redis.port (rl_redis.nodes in cluster and sentinel mode); "
               "while Redis cannot be reached, rl_redis.on_error decides.")
HINT_PASSWORD = "Set rl_redis.password or rl_redis.password_file to the password Redis expects."
HINT_COMMAND_TIMEOUT = "Check that Redis is not overloaded or stopped, or raise rl_redis.command_timeout."
HINT_CONNECT_TIMEOUT = "Check that Redis is reachable, or raise rl_redis.connect_timeout."
ALLOWED = 'Requests are allowed without a decision from Redis because rl_redis.on_error is "allow".'
HELD_BACK = "Redis is not retried for rl_redis.retry_interval after a failure."
WRONGTYPE = "WRONGTYPE Operation against a key holding the wrong kind of value"
NOAUTH = "NOAUTH Authentication required."
UNAUTHENTICATED = "ERR Protocol error: unauthenticated multibulk length"

FIXED = "SELECT rl_fixed(%s, 5, 60000)"
FIXED_ALLOW = "SELECT rl_fixed_allow(%s, 5, 60000)"


def fixed_context(identity):
    """The CONTEXT of a failed rl_fixed(identity, 5, 60000)."""
    return 'rl_redis decision "fixed" on key "%s"' % rl_key("fixed", identity, lim=5, window_ms=60000)


def report(diag):
    """(SQLSTATE, message, detail, hint, context) of an error or a notice."""
    return (diag.sqlstate, diag.message_primary, diag.message_detail, diag.message_hint, diag.context)


def error_report(conn, query, params):
    with pytest.raises(psycopg.Error) as exc:
        conn.execute(query, params)
    return report(exc.value.diag)


def warnings_of(conn, query, params):
    """Runs query and returns the reports of the warnings it raised."""
    got = []
    handler = lambda d: got.append(report(d)) if d.severity_nonlocalized == "WARNING" else None
    conn.add_notice_handler(handler)
    try:
        conn.execute(query, params)
    finally:
        conn.remove_notice_handler(handler)
    return got


def test_connection_refused(pg):
    """A closed port: 08001, what the system said, the settings to check; the
    warning of on_error = allow says the same and what was decided; a call
    the circuit breaker held back says so in the detail."""
    port = free_port()
    set_gucs(pg, host="127.0.0.1", port=port, retry_interval=0, on_error="allow")
    identity = new_ident("refused")
    message = "could not connect to Redis at 127.0.0.1:%d" % port
    # (one warning per outage: the first call of this server's)
    assert warnings_of(pg, FIXED_ALLOW, (identity,)) == [
        ("08001", message, "Connection refused\n" + ALLOWED, HINT_SERVER, fixed_context(identity))]

    set_gucs(pg, on_error="error")
    assert error_report(pg, FIXED, (identity,)) == (
        "08001", message, "Connection refused", HINT_SERVER, fixed_context(identity))

    # the breaker holds the next call back (the last failure was just now)
    set_gucs(pg, retry_interval=60000)
    assert error_report(pg, FIXED, (identity,)) == (
        "08001", message, "Connection refused\n" + HELD_BACK, HINT_SERVER, fixed_context(identity))


def test_password_wanted(pg, redis_factory):
    """A Redis with requirepass and no password set: a batch's FCALL (more
    than 10 words) gets the unauthenticated multibulk length error, a
    decision's (9 words) and a concurrency slot's (8 words) NOAUTH, and a
    wrong password WRONGPASS; each is 08001 with a hint that names the
    password settings."""
    r = redis_factory(password="report-secret")
    use_redis(pg, r, on_error="error")
    identity = new_ident("noauth")
    message = "could not authenticate to Redis at 127.0.0.1:%d" % r.port
    batch = error_report(pg, "SELECT * FROM rl_fixed_many(%s, 5, 60000)",
                         ([identity + str(i) for i in range(8)],))
    assert batch[:4] == ("08001", message, UNAUTHENTICATED, HINT_PASSWORD), batch
    # Redis closes the connection after a protocol error (Valkey 8 a moment
    # later): the session does not count on it any more, the next call opens
    # a new one and gets the same kind of failure, never a lost connection
    assert not own_connection_open(pg)

    assert error_report(pg, FIXED, (identity,)) == (
        "08001", message, NOAUTH, HINT_PASSWORD, fixed_context(identity))
    assert error_report(pg, "SELECT rl_concurrency_acquire(%s, 3, 60000)", (identity,)) == (
        "08001", message, NOAUTH, HINT_PASSWORD,
        'rl_redis concurrency acquire on key "%s"' % rl_key("concurrency", identity, lim=3, window_ms=60000))

    set_gucs(pg, password="wrong-" + identity)
    got = error_report(pg, FIXED, (identity,))
    assert got[:2] == ("08001", message) and got[2].startswith("WRONGPASS "), got
    assert got[3:] == (HINT_PASSWORD, fixed_context(identity)), got
    assert "wrong-" + identity not in repr(got) and "report-secret" not in repr(got)


def test_password_wanted_by_the_set_up(pg, redis_factory):
    """A Redis that wants a password, none set and rl_redis.database 1: the
    set-up's SELECT gets NOAUTH, reported as an authentication failure with
    the hint that names the password settings (not as a failed SELECT
    without a hint)."""
    r = redis_factory(password="setup-secret")
    use_redis(pg, r, on_error="error", database=1)
    identity = new_ident("noauthselect")
    assert error_report(pg, FIXED, (identity,)) == (
        "08001", "could not authenticate to Redis at 127.0.0.1:%d" % r.port, NOAUTH, HINT_PASSWORD,
        fixed_context(identity))


def assert_wrongtype_reported(conn, redis):
    """WRONGTYPE (a list where the fixed window's key is) on conn (on_error =
    error), whose Redis is redis: 08000, Redis's text as the detail, no
    hint; the same in on_error = allow's warning."""
    identity = new_ident("wrongtype")
    redis.cli("RPUSH", rl_key("fixed", identity, lim=5, window_ms=60000), "x")
    message = "Redis at 127.0.0.1:%d returned an error" % redis.port
    got = error_report(conn, FIXED, (identity,))
    assert got[:2] == ("08000", message) and got[2].startswith(WRONGTYPE), got
    assert got[3:] == (None, fixed_context(identity)), got

    set_gucs(conn, on_error="allow")
    assert warnings_of(conn, FIXED_ALLOW, (identity,)) == [
        ("08000", message, got[2] + "\n" + ALLOWED, None, fixed_context(identity))]


def test_error_reply(pg, redis_factory):
    """An error reply of Redis (WRONGTYPE), on the session's own connection."""
    r = redis_factory()
    use_redis(pg, r, on_error="error")
    assert_wrongtype_reported(pg, r)


def test_command_timeout(pg):
    """A Redis that accepts and never answers: 08006 after command_timeout,
    no detail, a hint that names rl_redis.command_timeout."""
    hole = BlackHole()
    try:
        set_gucs(pg, host="127.0.0.1", port=hole.port, retry_interval=0, on_error="error",
                 command_timeout=300, connect_timeout=300)
        identity = new_ident("timeout")
        assert error_report(pg, FIXED, (identity,)) == (
            "08006", "timed out waiting for a reply from Redis at 127.0.0.1:%d" % hole.port, None,
            HINT_COMMAND_TIMEOUT, fixed_context(identity))
    finally:
        hole.close()


def test_connect_timeout(pg):
    """A TLS handshake that never ends (the port accepts, nobody answers):
    08001 after connect_timeout, with a hint that names it."""
    hole = BlackHole()
    try:
        set_gucs(pg, host="127.0.0.1", port=hole.port, retry_interval=0, on_error="error",
                 command_timeout=300, connect_timeout=300, tls="on")
        identity = new_ident("tlshang")
        assert error_report(pg, FIXED, (identity,)) == (
            "08001",
            "could not connect to Redis at 127.0.0.1:%d: TLS handshake timed out after 300 ms" % hole.port,
            None, HINT_CONNECT_TIMEOUT, fixed_context(identity))
    finally:
        hole.close()


def test_shared_transport(shared_server):
    """Through the rl_redis worker (the session never connects): the error
    reply, on_error = allow's warning and a timeout of the wait for the
    worker report as through the session's own connection."""
    redis = shared_server.redis
    conn = shared_server.connect(transport="shared", on_error="error")
    try:
        assert_wrongtype_reported(conn, redis)
        assert not own_connection_open(conn)

        set_gucs(conn, on_error="error", command_timeout=300, connect_timeout=300)
        identity = new_ident("sharedhang")
        redis.pause()
        try:
            got = error_report(conn, FIXED, (identity,))
        finally:
            redis.resume()
        assert got == ("08006", "timed out after 600 ms waiting for the rl_redis worker's reply from Redis",
                       None, HINT_COMMAND_TIMEOUT, fixed_context(identity)), got
        assert not own_connection_open(conn)
    finally:
        conn.close()


def test_shared_transport_password_wanted_and_refused(redis_factory):
    """Through the rl_redis worker of a server whose configuration gives no
    password to a Redis that wants one: 08001 with Redis's text and the
    hint that names the password settings; that Redis gone, a refused
    connection with the hint that names host and port, as through the
    session's own connection (test_password_wanted, test_connection_refused)."""
    redis = redis_factory(password="worker-secret")
    server = PgServer(redis, transport="shared")
    conn = None
    try:
        wait_for(server.worker_pids, 10, "the rl_redis worker")
        conn = server.connect(transport="shared", on_error="error")
        identity = new_ident("sharedauth")
        assert error_report(conn, FIXED, (identity,)) == (
            "08001", "could not authenticate to Redis at 127.0.0.1:%d" % redis.port, NOAUTH,
            HINT_PASSWORD, fixed_context(identity))
        assert not own_connection_open(conn)

        redis.stop()
        assert error_report(conn, FIXED, (identity,)) == (
            "08001", "could not connect to Redis at 127.0.0.1:%d" % redis.port, "Connection refused",
            HINT_SERVER, fixed_context(identity))
        assert not own_connection_open(conn)
    finally:
        if conn is not None:
            conn.close()
        server.remove()


def test_ordinary_role_sees_no_secret(redis_factory):
    """A role with no privilege decides through a policy: the password
    file's path (missing, then group-readable) and the password (a wrong
    one) are in no part of what it sees, which says what is wrong."""
    password = "pw-%s" % new_ident("secret")
    r = redis_factory(password=password)
    server = PgServer(r, max_connections=10)
    path = os.path.join(server.base, "secret-path-marker")
    try:
        with server.connect() as su:
            su.execute("CREATE ROLE rl_report_app LOGIN")
            su.execute("INSERT INTO rl_policy (name, algorithm, lim, window_ms)"
                       " VALUES ('reports', 'fixed', 5, 60000)")
            su.execute(sql.SQL("ALTER SYSTEM SET rl_redis.password_file = {}").format(sql.Literal(path)))
            su.execute("SELECT pg_reload_conf()")

        def seen(identity):
            conn = pg_connect(host="127.0.0.1", port=server.port, user="rl_report_app", dbname="postgres")
            try:
                with pytest.raises(psycopg.Error) as exc:
                    conn.execute("SELECT rl_allow('reports', %s)", (identity,))
                got = report(exc.value.diag)
                shown = str(exc.value) + repr(got)
                assert path not in shown and "secret-path-marker" not in shown, shown
                assert password not in shown, shown
                return got
            finally:
                conn.close()

        context = lambda identity: 'rl_redis decision "fixed" on key "%s"' % rl_key(
            "fixed", identity, policy="reports", lim=5, window_ms=60000)
        message = "could not connect to Redis at 127.0.0.1:%d" % r.port
        identity = new_ident("nofile")
        assert seen(identity) == (
            "08001", message, "rl_redis.password_file: could not open the file: No such file or directory",
            None, context(identity))

        with open(path, "w") as f:
            f.write("wrong-" + password + "\n")
        os.chmod(path, 0o644)
        give_to_owner(path)
        identity = new_ident("worldfile")
        assert seen(identity) == (
            "08001", message,
            "rl_redis.password_file: the file has group or world access; "
            "permissions should be u=rw (0600) or less",
            None, context(identity))

        os.chmod(path, 0o600)
        identity = new_ident("wrongpw")
        got = seen(identity)
        assert got[:2] == ("08001", "could not authenticate to Redis at 127.0.0.1:%d" % r.port), got
        assert got[2].startswith("WRONGPASS "), got
        assert got[3:] == (HINT_PASSWORD, context(identity)), got
    finally:
        server.remove()


def test_redis_text_not_in_the_server_encoding(pg):
    """What Redis says is bytes, not text in the server's encoding: a byte
    that begins no character (UTF8) is shown as \\xNN, and a character cut
    short where the detail ends (a long error reply) is left out; so the
    report reaches a client of another encoding (LATIN1) as it is, and
    on_error = allow still allows, where the conversion used to turn both
    into 22021 "invalid byte sequence"."""
    lie = LyingRedis(b"-ERR \xff\xfe bad\r\n")
    long_lie = LyingRedis(b"-ERR " + ("\u00e9" * 300).encode() + b"\r\n")
    try:
        pg.execute("SET client_encoding = 'LATIN1'")
        set_gucs(pg, host="127.0.0.1", port=lie.port, retry_interval=0, on_error="error")
        message = "Redis at 127.0.0.1:%d returned an error" % lie.port
        identity = new_ident("binary")
        assert error_report(pg, FIXED, (identity,)) == (
            "08000", message, "ERR \\xff\\xfe bad", None, fixed_context(identity))
        set_gucs(pg, on_error="allow")
        assert warnings_of(pg, FIXED_ALLOW, (identity,)) == [
            ("08000", message, "ERR \\xff\\xfe bad\n" + ALLOWED, None, fixed_context(identity))]
        assert pg.execute(FIXED_ALLOW, (identity,)).fetchone() == (True,)

        set_gucs(pg, port=long_lie.port, on_error="error")
        identity = new_ident("long")
        # the detail holds 511 bytes: "ERR " and 253 of the 254th character's 2
        assert error_report(pg, FIXED, (identity,)) == (
            "08000", "Redis at 127.0.0.1:%d returned an error" % long_lie.port,
            "ERR " + "\u00e9" * 253, None, fixed_context(identity))
    finally:
        lie.close()
        long_lie.close()


def test_refused_at_transaction_end_in_another_encoding(pg):
    """A command of a transaction end that Redis refuses with bytes that are
    no text (the release of a slot whose acquire failed) is reported as any
    failure: our message, Redis's text as the detail, as \\xNN, to a client
    of another encoding; the acquire is allowed under on_error = allow."""
    lie = LyingRedis(b"-ERR \xff bad\r\n")
    try:
        pg.execute("SET client_encoding = 'LATIN1'")
        set_gucs(pg, host="127.0.0.1", port=lie.port, retry_interval=0, on_error="allow")
        identity = new_ident("xactend")
        key = rl_key("concurrency", identity, lim=3, window_ms=60000)
        assert warnings_of(pg, "SELECT allowed FROM rl_concurrency_acquire(%s, 3, 60000)", (identity,)) == [
            ("08000", "Redis at 127.0.0.1:%d returned an error" % lie.port,
             "ERR \\xff bad\n" + ALLOWED, None,
             'rl_redis concurrency acquire on key "%s"' % key),
            ("08000", "Redis at 127.0.0.1:%d refused a rate-limit command sent at the end of a transaction"
             % lie.port,
             "ERR \\xff bad\nA slot may stay taken until its lease ends, or units of a rolled-back "
             "transaction may not have been given back.", None, None)]
    finally:
        lie.close()
