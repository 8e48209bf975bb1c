"""The Redis password stays secret.

rl_redis.password belongs in postgresql.conf (or ALTER SYSTEM), or in a file
that rl_redis.password_file names; the test cluster preloads the library
(shared_preload_libraries), so no session ever sees the setting as a
placeholder that every role can read. These tests set the password for the
whole cluster (ALTER SYSTEM + pg_reload_conf(), undone in a finally) and
point it at a Redis of their own that requires it.
"""

import contextlib
import os
import time
import uuid

import psycopg
from psycopg import sql
import pytest

from conftest import PgServer, give_to_owner, new_ident, pg_connect


# a fixed window that ends in 2033: a key made under it cannot expire
# between a call and the check of Redis that follows (a 60 s window ends,
# and its key expires, every minute)
LONG_WINDOW_MS = 10**12

def new_secret(tag):
    return "%s-%s" % (tag, uuid.uuid4().hex)


class Notices:
    """Collects the notices and warnings a connection receives."""

    def __init__(self, conn):
        self.items = []
        conn.add_notice_handler(self._handle)

    def _handle(self, diag):
        self.items.append(
            (diag.severity_nonlocalized, diag.message_primary, diag.message_hint)
        )

    def text(self):
        return repr(self.items)


@contextlib.contextmanager
def cluster_settings(pg, **settings):
    """ALTER SYSTEM SET rl_redis.<name> for the whole cluster and reload;
    ALTER SYSTEM RESET and reload again afterwards, whatever happens."""
    before = current_settings(settings)
    try:
        for name, value in settings.items():
            pg.execute(
                sql.SQL("ALTER SYSTEM SET {} = {}").format(
                    sql.Identifier("rl_redis", name), sql.Literal(str(value))
                )
            )
        pg.execute("SELECT pg_reload_conf()")
        wait_for_settings({n: str(v) for n, v in settings.items()})
        yield
    finally:
        for name in settings:
            pg.execute(
                sql.SQL("ALTER SYSTEM RESET {}").format(sql.Identifier("rl_redis", name))
            )
        pg.execute("SELECT pg_reload_conf()")
        wait_for_settings(before)


def where_the_call_went(pg, conn, r, identity):
    """What the session and the servers say of a decision whose key r does
    not hold (for the failure message of a test that once failed so in a
    full run and never alone)."""
    settings = conn.execute(
        "SELECT string_agg(name || '=' || setting, ' ') FROM pg_settings "
        "WHERE name LIKE 'rl_redis.%' AND name NOT LIKE '%password%'").fetchone()[0]
    pid = conn.info.backend_pid
    connections = pg.execute(
        "SELECT * FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchall()
    main = pg.execute("SELECT current_setting('rl_redis.port')").fetchone()[0]
    return ("the session's settings: %s; its backend: %s; r (port %d) holds %s keys; "
            "the cluster's rl_redis.port: %s; the call's policy row: %s"
            % (settings, connections, r.port, r.cli("DBSIZE"), main,
               pg.execute("SELECT * FROM rl_policy WHERE name LIKE 'secrets.%'").fetchall()))


def current_settings(names):
    """{name: value} of rl_redis.<name> in a new superuser session (with
    GUC_UNIT_MS settings in ms, as ALTER SYSTEM was given them)."""
    with pg_connect() as conn:
        return {
            name: conn.execute(
                "SELECT current_setting(%s)", ("rl_redis." + name,)
            ).fetchone()[0]
            for name in names
        }


def wait_for_settings(want, timeout=10.0):
    """Waits until a new superuser session sees the settings."""
    deadline = time.monotonic() + timeout
    while True:
        seen = current_settings(want)
        if all(normal(seen[n]) == normal(want[n]) for n in want):
            return
        assert time.monotonic() < deadline, "reload not seen: %r != %r" % (seen, want)
        time.sleep(0.05)


def normal(value):
    """'0' and '0ms', '1000' and '1s' compare equal (retry_interval)."""
    units = {"ms": 1, "s": 1000, "min": 60000, "h": 3600000, "d": 86400000}
    for unit, factor in units.items():
        if value.endswith(unit) and value[: -len(unit)].isdigit():
            return str(int(value[: -len(unit)]) * factor)
    return value


@pytest.fixture
def app_role(pg):
    """An ordinary LOGIN role without any privilege."""
    role = "rl_secret_%s" % uuid.uuid4().hex[:12]
    pg.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
    try:
        yield role
    finally:
        pg.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


@pytest.fixture
def policy(pg):
    """A policy the ordinary role may decide through (100 per minute)."""
    name = "secrets.%s" % uuid.uuid4().hex[:12]
    pg.execute(
        "INSERT INTO rl_policy (name, algorithm, lim, window_ms) VALUES (%s, 'fixed', 100, 60000)",
        (name,),
    )
    try:
        yield name
    finally:
        pg.execute("DELETE FROM rl_policy WHERE name = %s", (name,))


def assert_password_hidden(conn, secrets):
    """Nothing an ordinary session can run shows the password settings:
    42501 or no row, and the secret never appears."""
    queries = [
        "SHOW rl_redis.password",
        "SELECT current_setting('rl_redis.password')",
        "SELECT current_setting('rl_redis.password', true)",
        "SHOW rl_redis.password_file",
        "SELECT current_setting('rl_redis.password_file')",
        "SELECT name, setting, reset_val, boot_val FROM pg_settings"
        " WHERE name IN ('rl_redis.password', 'rl_redis.password_file')",
        "SELECT string_agg(concat_ws(' ', name, setting, reset_val, sourcefile), ',')"
        " FROM pg_settings WHERE name LIKE 'rl%'",
        "SELECT * FROM pg_file_settings WHERE name LIKE 'rl_redis.password%'",
        "SELECT * FROM pg_db_role_setting",
        "SHOW ALL",
    ]
    for query in queries:
        try:
            rows = conn.execute(query).fetchall()
        except psycopg.Error as e:
            assert e.sqlstate == "42501", (query, repr(e))
            for secret in secrets:
                assert secret not in str(e), query
        else:
            if "pg_settings" in query and "IN (" in query:
                assert rows == [], (query, rows)
            for secret in secrets:
                assert secret not in repr(rows), query


@pytest.mark.alone  # ALTER SYSTEM moves every session of the cluster to its Redis
def test_password_in_config_is_hidden_from_ordinary_roles(pg, redis_factory, app_role, policy):
    password = new_secret("pw")
    r = redis_factory(password=password)
    with cluster_settings(pg, host="127.0.0.1", port=r.port, password=password, retry_interval=0):
        # a superuser sees it (SHOW) and can decide with explicit arguments
        su = pg_connect()
        try:
            assert su.execute("SHOW rl_redis.password").fetchone()[0] == password
            identity = new_ident("secret")
            # (a window that cannot end, and its key expire, before KEYS)
            assert su.execute(
                "SELECT (rl_fixed(%s, 5, %s)).allowed", (identity, LONG_WINDOW_MS)
            ).fetchone()[0] is True
            assert r.cli("KEYS", "rl:fixed.2:*%s*" % identity.split(":")[-1])
        finally:
            su.close()

        # a fresh session of an ordinary role, before it calls the extension
        conn = pg_connect(user=app_role)
        notices = Notices(conn)
        try:
            assert conn.execute("SELECT current_user").fetchone()[0] == app_role
            assert_password_hidden(conn, [password])
            # decisions through a policy work, with the configured password
            identity = new_ident("secret")
            assert conn.execute("SELECT rl_allow(%s, %s)", (policy, identity)).fetchone()[0] is True
            assert r.cli("KEYS", "rl:fixed.2:*%s*" % identity.split(":")[-1]), \
                where_the_call_went(pg, conn, r, identity)
            # and once the extension ran, still nothing shows it
            assert_password_hidden(conn, [password])
            # the library was preloaded: no warning about the password
            assert not [n for n in notices.items if n[0] == "WARNING"], notices.text()
            assert password not in notices.text()
        finally:
            conn.close()


@pytest.mark.alone  # ALTER SYSTEM moves every session of the cluster to its Redis
def test_password_file(pg, redis_factory, app_role, policy):
    password = new_secret("pwfile")
    r = redis_factory(password=password)
    path = os.path.join(os.environ["RL_DIR"], "redis-password-%s" % uuid.uuid4().hex[:8])
    # the first line, without its line end (CR LF too), is the password
    with open(path, "w") as f:
        f.write(password + "\r\nsecond line is ignored\n")
    os.chmod(path, 0o600)
    give_to_owner(path)
    try:
        with cluster_settings(pg, host="127.0.0.1", port=r.port, password_file=path,
                              retry_interval=0):
            su = pg_connect()
            try:
                assert su.execute("SHOW rl_redis.password").fetchone()[0] == ""
                assert su.execute("SHOW rl_redis.password_file").fetchone()[0] == path
                identity = new_ident("pwfile")
                assert su.execute(
                    "SELECT (rl_fixed(%s, 5, 60000)).allowed", (identity,)
                ).fetchone()[0] is True
                assert su.execute("SELECT rl_allow(%s, %s)", (policy, identity)).fetchone()[0] is True
            finally:
                su.close()

            # an ordinary role decides through it and reads neither setting
            conn = pg_connect(user=app_role)
            try:
                assert_password_hidden(conn, [password, path])
                identity = new_ident("pwfile")
                assert conn.execute("SELECT rl_allow(%s, %s)", (policy, identity)).fetchone()[0] is True
                assert r.cli("KEYS", "rl:fixed.2:*%s*" % identity.split(":")[-1])
            finally:
                conn.close()

            # rl_redis.password, when set, comes first
            su = pg_connect()
            try:
                su.execute(sql.SQL("SET rl_redis.password = {}").format(sql.Literal("wrong")))
                with pytest.raises(psycopg.Error) as exc:
                    su.execute("SELECT rl_fixed(%s, 5, 60000)", (new_ident("pwfile"),))
                assert exc.value.sqlstate == "08001", repr(exc.value)
                su.execute("RESET rl_redis.password")
                assert su.execute(
                    "SELECT (rl_fixed(%s, 5, 60000)).allowed", (new_ident("pwfile"),)
                ).fetchone()[0] is True
            finally:
                su.close()

            # a file others can read is refused, with a clear error that
            # names the setting, not the file: the path is for the server
            # log (and superusers) only
            os.chmod(path, 0o644)
            err = decide_error(new_ident("pwfile"))
            assert err.sqlstate == "08001", repr(err)
            assert "rl_redis.password_file" in str(err), str(err)
            assert "group or world access" in str(err), str(err)
            assert_not_shown(err, [path, password])
            log = server_log_lines("group or world access")
            assert any(path in line for line in log), log
            err = decide_error(new_ident("pwfile"), user=app_role, policy=policy)
            assert err.sqlstate == "08001" and "group or world access" in str(err), str(err)
            assert_not_shown(err, [path, password, os.path.basename(path)])
            os.chmod(path, 0o640)
            err = decide_error(new_ident("pwfile"))
            assert err.sqlstate == "08001" and "group or world access" in str(err), str(err)

            # a file that cannot be read, or is empty
            os.chmod(path, 0o600)
            os.rename(path, path + ".gone")
            try:
                err = decide_error(new_ident("pwfile"), user=app_role, policy=policy)
                assert err.sqlstate == "08001", repr(err)
                assert "could not open the file" in str(err), str(err)
                assert_not_shown(err, [path, os.path.basename(path)])
            finally:
                os.rename(path + ".gone", path)
            with open(path, "w") as f:
                f.write("\n" + password + "\n")
            err = decide_error(new_ident("pwfile"))
            assert err.sqlstate == "08001" and "is empty" in str(err), str(err)

            with open(path, "w") as f:
                f.write("x" * 100000 + "\n")
            err = decide_error(new_ident("pwfile"))
            assert err.sqlstate == "08001" and "is longer than" in str(err), str(err)
            with open(path, "w") as f:
                f.write(password[:4] + "\0" + password[4:] + "\n")
            err = decide_error(new_ident("pwfile"))
            assert err.sqlstate == "08001" and "zero byte" in str(err), str(err)
            fifo = path + ".fifo"
            os.mkfifo(fifo, 0o600)
            give_to_owner(fifo)
            try:
                pg.execute(
                    sql.SQL("ALTER SYSTEM SET rl_redis.password_file = {}").format(sql.Literal(fifo))
                )
                pg.execute("SELECT pg_reload_conf()")
                wait_for_settings({"password_file": fifo})
                t0 = time.monotonic()
                err = decide_error(new_ident("pwfile"))
                assert err.sqlstate == "08001" and "not a plain file" in str(err), str(err)
                assert time.monotonic() - t0 < 5
            finally:
                pg.execute(
                    sql.SQL("ALTER SYSTEM SET rl_redis.password_file = {}").format(sql.Literal(path))
                )
                pg.execute("SELECT pg_reload_conf()")
                wait_for_settings({"password_file": path})
                os.unlink(fifo)

            # fixed again: decisions work again
            with open(path, "w") as f:
                f.write(password)
            su = pg_connect()
            try:
                assert su.execute(
                    "SELECT (rl_fixed(%s, 5, 60000)).allowed", (new_ident("pwfile"),)
                ).fetchone()[0] is True
            finally:
                su.close()
    finally:
        os.unlink(path)


def decide_error(identity, user=None, policy=None):
    """The error of a decision in a new session (a new connection to Redis,
    so the password is read again): of the superuser with explicit
    arguments, or of user through policy."""
    conn = pg_connect(user=user) if user else pg_connect()
    try:
        with pytest.raises(psycopg.Error) as exc:
            if policy:
                conn.execute("SELECT rl_allow(%s, %s)", (policy, identity))
            else:
                conn.execute("SELECT rl_fixed(%s, 5, 60000)", (identity,))
        return exc.value
    finally:
        conn.close()


def assert_not_shown(err, secrets):
    """None of secrets is in what the error shows its session."""
    diag = err.diag
    shown = " ".join(x or "" for x in (str(err), diag.message_primary, diag.message_detail,
                                       diag.message_hint, diag.context))
    for secret in secrets:
        assert secret not in shown, (secret, shown)


def server_log_lines(text):
    """The lines of the test cluster's server log that contain text."""
    with open(os.path.join(os.environ["RL_DIR"], "postgres.log"), errors="replace") as f:
        return [line for line in f if text in line]


@pytest.mark.parametrize(
    "stmt",
    [
        "ALTER ROLE {role} SET rl_redis.password = {pw}",
        "ALTER ROLE {role} IN DATABASE {db} SET rl_redis.password = {pw}",
        "ALTER ROLE ALL SET rl_redis.password = {pw}",
        "ALTER DATABASE {db} SET rl_redis.password = {pw}",
        "CREATE FUNCTION {fn}() RETURNS int LANGUAGE sql SET rl_redis.password = {pw} AS 'SELECT 1'",
    ],
)
def test_password_refused_in_database_and_role_settings(pg, app_role, stmt):
    """pg_db_role_setting (and pg_proc.proconfig) are readable by every role."""
    password = new_secret("pwrole")
    db = pg.execute("SELECT current_database()").fetchone()[0]
    fn = "rl_secret_fn_%s" % uuid.uuid4().hex[:8]
    query = sql.SQL(stmt).format(
        role=sql.Identifier(app_role), db=sql.Identifier(db), fn=sql.Identifier(fn),
        pw=sql.Literal(password),
    )
    try:
        with pytest.raises(psycopg.Error) as exc:
            pg.execute(query)
        assert exc.value.sqlstate == "22023", repr(exc.value)
        assert "rl_redis.password_file" in (exc.value.diag.message_hint or ""), repr(exc.value)
        stored = pg.execute(
            "SELECT count(*) FROM pg_db_role_setting s, unnest(s.setconfig) c"
            " WHERE c LIKE 'rl\\_redis.password%'"
        ).fetchone()[0]
        assert stored == 0
        assert pg.execute(
            "SELECT count(*) FROM pg_proc WHERE proname = %s", (fn,)
        ).fetchone()[0] == 0
    finally:
        pg.execute(sql.SQL("DROP FUNCTION IF EXISTS {}()").format(sql.Identifier(fn)))


def test_empty_password_setting_is_accepted(pg, app_role):
    """Only a secret is refused: an empty value may be set anywhere."""
    pg.execute(sql.SQL("ALTER ROLE {} SET rl_redis.password = ''").format(sql.Identifier(app_role)))
    pg.execute(sql.SQL("ALTER ROLE {} RESET rl_redis.password").format(sql.Identifier(app_role)))


def use_password_file(port, path, content, mode, **settings):
    """Writes content to the file path (with mode, owned by the cluster's
    owner), and sets rl_redis.password_file to it and rl_redis.<name> for
    each of settings in the cluster at port (ALTER SYSTEM, reload)."""
    with open(path, "w") as f:
        f.write(content)
    os.chmod(path, mode)
    give_to_owner(path)
    su = pg_connect(host="127.0.0.1", port=port, user="postgres", dbname="postgres")
    try:
        # (PostgreSQL 15 knows no placeholder that the configuration does
        # not name before the library is loaded)
        su.execute("LOAD 'rl_redis'")
        for name, value in dict(settings, password_file=path).items():
            su.execute(sql.SQL("ALTER SYSTEM SET {} = {}").format(
                sql.Identifier("rl_redis", name), sql.Literal(value)))
        su.execute("SELECT pg_reload_conf()")
    finally:
        su.close()


def test_password_refused_when_not_preloaded(redis_factory):
    """Without shared_preload_libraries, postgresql.conf's rl_redis.password
    is a placeholder that every role reads until the library is loaded: it
    is not used. Loading the library warns, and a connection attempt fails
    with an error that names shared_preload_libraries and
    rl_redis.password_file, without sending the password (Redis holds no
    key); the password file works. rl_redis.sentinel_password is refused the
    same way. A short-lived cluster of its own (about 2 s)."""
    password = new_secret("pwnopreload")
    r = redis_factory(password=password)
    server = PgServer(r, preload=False, extension=False, max_connections=10, password=password)
    port = server.port
    path = os.path.join(server.base, "redis-password")
    try:
        su = pg_connect(host="127.0.0.1", port=port, user="postgres", dbname="postgres")
        try:
            su.execute("CREATE ROLE rl_nopreload LOGIN")
            # the placeholder, before anything loads the library: every role reads it
            other = pg_connect(host="127.0.0.1", port=port, user="rl_nopreload", dbname="postgres")
            try:
                assert other.execute("SHOW rl_redis.password").fetchone()[0] == password
            finally:
                other.close()
            # loading the library says so
            notices = Notices(su)
            su.execute("LOAD 'rl_redis'")
            warnings = [n for n in notices.items if n[0] == "WARNING"]
            assert len(warnings) == 1, notices.text()
            assert "not used" in warnings[0][1], warnings
            assert "shared_preload_libraries" in warnings[0][2], warnings
            assert "rl_redis.password_file" in warnings[0][2], warnings
            # the file's path stays a placeholder every role reads, not its contents
            assert "path" in warnings[0][2], warnings
            assert password not in notices.text()
            # and it is not used: the connection attempt fails
            su.execute("CREATE EXTENSION rl_redis")
            with pytest.raises(psycopg.Error) as exc:
                su.execute("SELECT rl_fixed(%s, 5, 60000)", (new_ident("nopreload"),))
            err = exc.value
            assert err.sqlstate == "08001", repr(err)
            # the message says what, the hint what to do
            assert err.diag.message_primary == "could not connect to Redis at 127.0.0.1:%d" % r.port, \
                err.diag.message_primary
            assert err.diag.message_detail == \
                "rl_redis.password is not used without rl_redis in shared_preload_libraries", \
                err.diag.message_detail
            hint = err.diag.message_hint or ""
            assert "shared_preload_libraries" in hint and "rl_redis.password_file" in hint, hint
            assert "path" in hint, hint
            assert password not in str(err)
            assert r.cli("DBSIZE") == "0"
            # the sentinels' password is refused the same way
            su.execute("SET rl_redis.mode = 'sentinel'")
            su.execute("SET rl_redis.nodes = '127.0.0.1:%d'" % r.port)
            su.execute("SET rl_redis.sentinel_master = 'm'")
            su.execute("SET rl_redis.sentinel_password = 'sentinel-secret'")
            with pytest.raises(psycopg.Error) as exc:
                su.execute("SELECT rl_fixed(%s, 5, 60000)", (new_ident("nopreload"),))
            assert exc.value.diag.message_detail == \
                "rl_redis.sentinel_password is not used without rl_redis in shared_preload_libraries", \
                exc.value.diag.message_detail
            hint = exc.value.diag.message_hint or ""
            assert "shared_preload_libraries" in hint and "password_file" not in hint, hint
            assert "sentinel-secret" not in str(exc.value)
        finally:
            su.close()
        # the password file: no password setting, no warning, and it is used
        use_password_file(port, path, password + "\n", 0o600, password="")
        deadline = time.monotonic() + 10
        while True:
            su = pg_connect(host="127.0.0.1", port=port, user="postgres", dbname="postgres")
            try:
                if su.execute("SHOW rl_redis.password").fetchone()[0] == "":
                    notices = Notices(su)
                    su.execute("LOAD 'rl_redis'")
                    assert notices.items == [], notices.text()
                    identity = new_ident("nopreload")
                    assert su.execute("SELECT (rl_fixed(%s, 5, %s)).allowed",
                                      (identity, LONG_WINDOW_MS)).fetchone()[0] is True
                    assert r.cli("DBSIZE") == "1"
                    break
            finally:
                su.close()
            assert time.monotonic() < deadline, "reload not seen"
            time.sleep(0.05)
    finally:
        server.remove()


def test_password_file_failure_logged_once_per_outage(redis_factory):
    """The server-log line that names a failing password file comes once
    per outage, not with every connection attempt: 1 000 calls of a session
    under on_error = allow without a circuit breaker (retry_interval = 0)
    add one line; a session of its own, one more, and 1 000 rl_redis_ping()
    (each starts a new outage) none (at most a line a minute). A cluster of
    its own, for a log of its own."""
    r = redis_factory(password=new_secret("pwlog"))
    server = PgServer(r, on_error="allow")
    path = os.path.join(server.base, "redis-password")
    try:
        use_password_file(server.port, path, "whatever\n", 0o644)
        deadline = time.monotonic() + 10
        while True:
            with server.connect() as conn:
                if conn.execute("SHOW rl_redis.password_file").fetchone()[0] == path:
                    break
            assert time.monotonic() < deadline, "reload not seen"
            time.sleep(0.05)
        for _ in range(2):
            conn = server.connect()
            try:
                for i in range(1000):
                    assert conn.execute("SELECT rl_fixed_allow(%s, 5, 60000)",
                                        ("pwlog:%d" % i,)).fetchone()[0] is True
                if _ == 1:
                    for i in range(1000):
                        with pytest.raises(psycopg.Error):
                            conn.execute("SELECT rl_redis_ping()")
            finally:
                conn.close()
        # (the reload logs the setting's new value once, too)
        lines = [line for line in server.log().splitlines()
                 if path in line and "changed to" not in line]
        assert len(lines) == 2, lines
        assert all("group or world access" in line for line in lines), lines
        assert r.cli("DBSIZE") == "0"
    finally:
        server.remove()
