"""rl_redis behind PgBouncer (Debian's pgbouncer package).

A module fixture starts one pgbouncer on a free loopback port, in a folder
under RL_DIR, as the unprivileged postgres user (pgbouncer -u), in front of
the test cluster (127.0.0.1:$PGPORT), auth_type trust with an auth_file,
pool_mode = transaction and default_pool_size = 2. Its databases are
aliases of the one database "postgres":

  rl_tx    transaction pooling, 2 server connections per user (the subject)
  rl_tx1   transaction pooling, 1 server connection per user (so that which
           client runs on which server connection is deterministic)
  rl_stmt  statement pooling, 2 server connections per user
  rl_sess  session pooling, 1 server connection per user

Every test uses more clients than server connections, and checks through
pg_backend_pid() that the clients really shared them. pgbouncer reuses the
most recently released server connection first (server_round_robin = 0),
which some tests rely on to show that a server connection that ended a
transaction holding a slot serves another client next.

Settings: the rl_redis.* settings are superuser-only, and a plain SET does
not follow a client under transaction pooling (it stays on the server
connection, see test_tx_pool_session_set_leaks_to_other_clients). So the
superuser clients rely on postgresql.conf (run_tests.sh points it at the
shared Redis); the module's ordinary role (LOGIN, granted nothing but
INSERT on the guarded tables) gets its own rl_redis.key_prefix from
ALTER ROLE ... SET, which every server connection pgbouncer opens for it
applies; a per-transaction setting is made with SET LOCAL.

Connections through pgbouncer use prepare_threshold=None: pgbouncer 1.18
does not carry server-side prepared statements across server connections.
About 3 s in all.
"""

import os
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
import uuid

import psycopg
import pytest
from psycopg import sql

from conftest import fixed_units, free_port, new_ident, pg_connect, rl_key

PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
POOL_SIZE = 2
LEASE_MS = 600000  # no test can pass by a lease ending
LONG_WINDOW_MS = 600000  # sliding window: no boundary to fall into
HUGE_WINDOW_MS = 10**12  # a fixed window that does not roll over (next: 2033)
FREE_BOUND_S = 5.0  # generous bound for "the slot is free again"
CLIENTS = 8  # > POOL_SIZE
CALLS_PER_CLIENT = 15


def uid():
    return uuid.uuid4().hex[:12]


# ---------------------------------------------------------------- pgbouncer


class PgBouncer:
    """One pgbouncer process in its own folder, in front of the test cluster."""

    def __init__(self, base_dir, pg_port, users):
        self.dir = tempfile.mkdtemp(prefix="pgbouncer_", dir=base_dir)
        self.pg_port = pg_port
        self.users = list(users)
        self.port = free_port()
        self.proc = None
        self.ini = os.path.join(self.dir, "pgbouncer.ini")
        self.logfile = os.path.join(self.dir, "pgbouncer.log")

    def _write_config(self):
        target = "host=127.0.0.1 port=%d dbname=%s" % (self.pg_port, os.environ.get("PGDATABASE", "postgres"))
        with open(os.path.join(self.dir, "userlist.txt"), "w") as f:
            for user in self.users:
                f.write('"%s" ""\n' % user)
        with open(self.ini, "w") as f:
            f.write(
                "[databases]\n"
                "rl_tx = %(t)s\n"
                "rl_tx1 = %(t)s pool_size=1\n"
                "rl_stmt = %(t)s pool_mode=statement\n"
                "rl_sess = %(t)s pool_mode=session pool_size=1\n"
                "\n"
                "[pgbouncer]\n"
                "listen_addr = 127.0.0.1\n"
                "listen_port = %(port)d\n"
                "unix_socket_dir =\n"
                "auth_type = trust\n"
                "auth_file = %(dir)s/userlist.txt\n"
                "admin_users = postgres\n"
                "pool_mode = transaction\n"
                "default_pool_size = %(pool)d\n"
                "min_pool_size = 0\n"
                "reserve_pool_size = 0\n"
                "max_client_conn = 200\n"
                "server_round_robin = 0\n"
                "server_reset_query = DISCARD ALL\n"
                "query_wait_timeout = 60\n"
                "query_timeout = 60\n"  # nothing here waits forever
                "ignore_startup_parameters = extra_float_digits\n"
                "logfile = %(log)s\n"
                "pidfile = %(dir)s/pgbouncer.pid\n"
                % {"t": target, "port": self.port, "dir": self.dir,
                   "pool": POOL_SIZE, "log": self.logfile}
            )

    def start(self, timeout=20.0):
        deadline = time.monotonic() + timeout
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres")
        while True:
            self._write_config()
            argv = [PGBOUNCER]
            if os.geteuid() == 0:
                argv += ["-u", "postgres"]  # it refuses to run as root
            argv.append(self.ini)
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    with self.connect("rl_tx") as conn:
                        conn.execute("SELECT 1")
                    return self
                except psycopg.OperationalError:
                    time.sleep(0.1)
            self.stop()
            if time.monotonic() >= deadline:
                raise RuntimeError("pgbouncer did not start; log:\n%s" % self.log())
            self.port = free_port()  # somebody took the port: try another

    def stop(self):
        """SIGTERM (immediate shutdown in 1.18), SIGKILL if it lingers."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def connect(self, dbname, user="postgres", autocommit=True):
        return psycopg.connect(
            host="127.0.0.1",
            port=self.port,
            dbname=dbname,
            user=user,
            autocommit=autocommit,
            connect_timeout=10,
            application_name="rl_redis_pytest_pgbouncer",
            prepare_threshold=None,
        )

    def log(self):
        try:
            with open(self.logfile) as f:
                return f.read()[-4000:]
        except OSError:
            return ""


class Bouncer:
    """What the module fixture hands the tests."""

    def __init__(self, server, role, prefix):
        self.server = server
        self.role = role  # an ordinary LOGIN role, granted nothing special
        self.prefix = prefix  # its rl_redis.key_prefix (ALTER ROLE ... SET)
        self.conns = []

    def connect(self, dbname="rl_tx", user="postgres", autocommit=True):
        conn = self.server.connect(dbname, user=user, autocommit=autocommit)
        self.conns.append(conn)
        return conn

    def close_all(self):
        for conn in self.conns:
            try:
                conn.close()
            except Exception:
                pass
        self.conns = []


def _drop_role(pg, role):
    pg.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,))
    for _ in range(100):
        try:
            pg.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            pg.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))
            return
        except psycopg.Error:
            time.sleep(0.1)  # a terminated session still ending


@pytest.fixture(scope="module")
def pgbouncer_server():
    if not os.access(PGBOUNCER, os.X_OK):
        pytest.fail("pgbouncer is not installed (sql_tests/install_deps.sh installs it)")
    role = "rl_pgb_%s" % uid()
    prefix = "rl:pgb%s:" % uid()
    admin = pg_connect()
    try:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        # the ordinary role's rl_redis settings come with every server
        # connection the pool opens for it (role settings are applied at
        # SUSET level, so a superuser-only setting works for that role)
        admin.execute(
            sql.SQL("ALTER ROLE {} SET rl_redis.key_prefix = {}").format(
                sql.Identifier(role), sql.Literal(prefix)
            )
        )
        base = os.environ.get("RL_DIR")
        server = PgBouncer(base if base and os.path.isdir(base) else None,
                           int(os.environ["PGPORT"]), ["postgres", role])
        try:
            server.start()
            yield Bouncer(server, role, prefix)
        finally:
            server.stop()
            shutil.rmtree(server.dir, ignore_errors=True)
    finally:
        _drop_role(admin, role)
        admin.close()


@pytest.fixture
def bouncer(pgbouncer_server):
    try:
        yield pgbouncer_server
    finally:
        pgbouncer_server.close_all()


class Objects:
    """Policies and guarded tables for one test, removed at teardown."""

    def __init__(self, pg):
        self.pg = pg
        self.policies = []
        self.tables = []

    def policy(self, algorithm, lim, window_ms):
        name = "t_pgb_%s" % uid()
        self.pg.execute(
            "INSERT INTO rl_policy (name, algorithm, lim, window_ms) VALUES (%s, %s, %s, %s)",
            (name, algorithm, lim, window_ms),
        )
        self.policies.append(name)
        return name

    def guarded_table(self, limit, grant_insert_to):
        name = "rl_pgb_%s" % uid()
        ident = sql.Identifier(name)
        self.pg.execute(sql.SQL("CREATE TABLE {} (tenant text NOT NULL, note text)").format(ident))
        self.tables.append(name)
        self.pg.execute(
            sql.SQL(
                "CREATE TRIGGER guard AFTER INSERT ON {} FOR EACH ROW "
                "EXECUTE FUNCTION rl_guard({}, 'tenant')"
            ).format(ident, sql.Literal(limit))
        )
        self.pg.execute(sql.SQL("GRANT INSERT, SELECT ON {} TO {}").format(ident, sql.Identifier(grant_insert_to)))
        return name

    def cleanup(self):
        for t in self.tables:
            self.pg.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(t)))
        if self.policies:
            self.pg.execute("DELETE FROM rl_policy WHERE name = ANY(%s)", (self.policies,))


@pytest.fixture
def objs(pg, pgbouncer_server):
    o = Objects(pg)
    try:
        yield o
    finally:
        # the test's clients first: one left in a transaction would hold
        # locks on its table
        pgbouncer_server.close_all()
        pg.execute("SET lock_timeout = '20s'")
        o.cleanup()


# ---------------------------------------------------------------- helpers


def interleave(connect, expr, params, clients=CLIENTS, calls=CALLS_PER_CLIENT):
    """`clients` connections from connect(), one thread each, all starting
    together, each evaluating the boolean SQL expression `expr` `calls`
    times (after a 2 ms sleep on the server, so that the clients overlap
    and the pool opens all its server connections). Returns (number of true
    results, set of server backend pids that answered)."""
    query = "SELECT pg_backend_pid(), %s FROM pg_sleep(0.002)" % expr
    conns = [connect() for _ in range(clients)]
    barrier = threading.Barrier(clients)
    allowed = [0] * clients
    pids = [set() for _ in range(clients)]
    errors = []

    def worker(t):
        try:
            barrier.wait(timeout=60)
            for _ in range(calls):
                pid, ok = conns[t].execute(query, params).fetchone()
                assert isinstance(ok, bool), ok
                pids[t].add(pid)
                allowed[t] += 1 if ok else 0
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    ths = [threading.Thread(target=worker, args=(t,)) for t in range(clients)]
    try:
        for th in ths:
            th.start()
        for th in ths:
            th.join(timeout=120)
        assert not any(th.is_alive() for th in ths), "client threads hung"
    finally:
        for c in conns:
            c.close()
    assert errors == [], errors
    return sum(allowed), set().union(*pids)


def raw_connect(port, dbname, user="postgres"):
    """A bare protocol-3 connection (trust): returns (socket, reader) once
    the server said ReadyForQuery. For what psycopg does not show: the
    fields of the FATAL error pgbouncer sends before it closes."""
    s = socket.create_connection(("127.0.0.1", port), timeout=15)
    body = (struct.pack("!I", 196608) + b"user\0" + user.encode() + b"\0database\0"
            + dbname.encode() + b"\0application_name\0rl_redis_pytest_pgbouncer\0\0")
    s.sendall(struct.pack("!I", len(body) + 4) + body)
    f = s.makefile("rb")
    while True:
        kind, payload = raw_read(f)
        assert kind is not None, "connection closed during startup"
        if kind == b"E":
            raise AssertionError("startup failed: %r" % payload)
        if kind == b"Z":
            return s, f


def raw_read(f):
    """(message type, payload), or (None, None) at end of stream."""
    kind = f.read(1)
    if not kind:
        return None, None
    (n,) = struct.unpack("!I", f.read(4))
    return kind, f.read(n - 4)


def raw_send_query(s, query):
    body = query.encode() + b"\0"
    s.sendall(b"Q" + struct.pack("!I", len(body) + 4) + body)


def raw_messages(f):
    """Every message until ReadyForQuery or the end of the stream; an
    ErrorResponse comes as ("E", {field code: value})."""
    out = []
    while True:
        kind, payload = raw_read(f)
        if kind is None:
            out.append("EOF")
            return out
        if kind == b"E":
            fields = {}
            for part in payload.split(b"\0"):
                if part:
                    fields[part[:1].decode()] = part[1:].decode()
            out.append(("E", fields))
        else:
            out.append(kind.decode())
        if kind == b"Z":
            return out


def one(conn, query, params=None):
    return conn.execute(query, params).fetchone()


class Acquirer:
    """The slot calls of one kind: a concurrency policy through rl_acquire as
    the ordinary role, or rl_concurrency_acquire as the superuser."""

    def __init__(self, kind, bouncer, objs, lim=1):
        self.kind = kind
        self.identity = new_ident("pgb")
        if kind == "policy":
            self.user = bouncer.role
            self.policy = objs.policy("concurrency", lim, LEASE_MS)
            self.query = "SELECT pg_backend_pid(), (rl_acquire(%s, %s)).allowed"
            self.params = (self.policy, self.identity)
            self.key = rl_key("concurrency", self.identity, policy=self.policy, lim=lim,
                              window_ms=LEASE_MS, prefix=bouncer.prefix)
        else:
            self.user = "postgres"
            self.policy = None
            self.query = "SELECT pg_backend_pid(), (rl_concurrency_acquire(%s, %s, %s)).allowed"
            self.params = (self.identity, lim, LEASE_MS)
            self.key = rl_key("concurrency", self.identity, lim=lim, window_ms=LEASE_MS)

    def __call__(self, conn):
        """(server pid, allowed)"""
        return one(conn, self.query, self.params)


def wait_until(pred, bound):
    """Polls pred() every 20 ms; returns (its last value, seconds waited)."""
    t0 = time.monotonic()
    while True:
        value = pred()
        if value or time.monotonic() - t0 > bound:
            return value, time.monotonic() - t0
        time.sleep(0.02)


# ---------------------------------------------------------------- decisions


def test_tx_pool_explicit_decisions_exact(bouncer, shared_redis):
    """Superuser, explicit limit: 8 clients over 2 server connections
    interleave 120 calls on one identity; exactly lim are allowed."""
    lim = 37
    identity = new_ident("pgb")
    allowed, pids = interleave(
        lambda: bouncer.connect("rl_tx"),
        "rl_sliding_allow(%s, %s, %s)",
        (identity, lim, LONG_WINDOW_MS),
    )
    assert CLIENTS * CALLS_PER_CLIENT > 3 * lim
    assert allowed == lim
    assert len(pids) == POOL_SIZE  # 8 clients shared 2 server connections
    assert shared_redis.command("ZCARD", rl_key("sliding", identity, lim=lim, window_ms=LONG_WINDOW_MS)) == lim
    peek = one(bouncer.connect("rl_tx"), "SELECT allowed, remaining FROM rl_sliding(%s, %s, %s, 0)",
               (identity, lim, LONG_WINDOW_MS))
    assert peek == (True, 0)  # cost 0 is always allowed, nothing left


def test_tx_pool_policy_decisions_exact_ordinary_role(bouncer, objs, shared_redis):
    """The ordinary role decides through a policy (PUBLIC may), interleaved
    over the pool: exactly lim; explicit limits stay refused (42501); its
    role setting (key_prefix) is in force on every pooled server
    connection."""
    lim = 29
    pol = objs.policy("sliding", lim, LONG_WINDOW_MS)
    identity = new_ident("pgb")
    allowed, pids = interleave(
        lambda: bouncer.connect("rl_tx", user=bouncer.role),
        "rl_allow(%s, %s)",
        (pol, identity),
    )
    assert allowed == lim
    assert len(pids) == POOL_SIZE

    c = bouncer.connect("rl_tx", user=bouncer.role)
    r = one(c, "SELECT allowed, lim, remaining, retry_after_ms > 0 FROM rl_check(%s, %s)", (pol, identity))
    assert r == (False, lim, 0, True)
    assert one(c, "SELECT current_user, current_setting('rl_redis.key_prefix')") == (bouncer.role, bouncer.prefix)
    # the counter lives under the role's prefix, nothing under the default one
    assert shared_redis.command("ZCARD", rl_key("sliding", identity, pol, lim, LONG_WINDOW_MS, prefix=bouncer.prefix)) == lim
    assert shared_redis.command("EXISTS", rl_key("sliding", identity, pol, lim, LONG_WINDOW_MS)) == 0

    for query, params in [
        ("SELECT rl_sliding_allow(%s, 5, 60000)", (identity,)),
        ("SELECT rl_concurrency_acquire(%s, 1, 60000)", (identity,)),
        ("SELECT rl_refund(%s, %s)", (pol, identity)),
    ]:
        with pytest.raises(psycopg.Error) as exc:
            c.execute(query, params)
        assert exc.value.sqlstate == "42501"
    # and the server connection is usable for the next client statement
    assert one(c, "SELECT (rl_check(%s, %s, 0)).remaining", (pol, identity)) == (0,)

    # a policy change reaches every pooled server connection: the sliding
    # count goes on under the new lim, exactly 5 more
    objs.pg.execute("UPDATE rl_policy SET lim = %s WHERE name = %s", (lim + 5, pol))
    allowed, pids = interleave(
        lambda: bouncer.connect("rl_tx", user=bouncer.role),
        "rl_allow(%s, %s)",
        (pol, identity),
    )
    assert allowed == 5
    assert len(pids) == POOL_SIZE


# ---------------------------------------------------------------- slots


@pytest.mark.parametrize("end", ["commit", "rollback", "error"])
@pytest.mark.parametrize("kind", ["policy", "explicit"])
def test_tx_pool_slot_released_at_transaction_end(bouncer, objs, shared_redis, kind, end):
    """A slot held in a transaction is given back at COMMIT / ROLLBACK (also
    after an error), and the next client that gets that same server
    connection takes the slot at once."""
    acq = Acquirer(kind, bouncer, objs)
    a, b, c, d = (bouncer.connect("rl_tx", user=acq.user) for _ in range(4))

    a.execute("BEGIN")
    pid_a, ok = acq(a)
    assert ok is True
    pid_b, ok = acq(b)  # autocommit, on the other server connection
    assert ok is False
    assert pid_b != pid_a
    assert shared_redis.command("ZCARD", acq.key) == 1

    if end == "commit":
        a.execute("COMMIT")
    elif end == "rollback":
        a.execute("ROLLBACK")
    else:
        with pytest.raises(psycopg.Error) as exc:
            a.execute("SELECT 1/0")
        assert exc.value.sqlstate == "22012"
        a.execute("ROLLBACK")
    assert shared_redis.command("ZCARD", acq.key) == 0  # given back when the end returned

    # c gets a's server connection (most recently released) and the slot
    c.execute("BEGIN")
    pid_c, ok = acq(c)
    assert (pid_c, ok) == (pid_a, True)
    pid_d, ok = acq(d)
    assert (pid_d, ok) == (pid_b, False)
    c.execute("COMMIT")
    # a, now a different client of the pool, takes it in autocommit
    pid, ok = acq(a)
    assert ok is True
    assert pid in (pid_a, pid_b)
    assert shared_redis.command("ZCARD", acq.key) == 0


@pytest.mark.parametrize("kind", ["policy", "explicit"])
def test_tx_pool_release_never_reaches_another_clients_slot(bouncer, objs, shared_redis, kind):
    """rl_release / rl_concurrency_release give back "the slot this session
    took last": on a pooled server connection whose previous client took a
    slot (given back at its COMMIT), another client's release returns false
    and leaves the slot of the client that holds it now alone. Inside the
    holder's own transaction the release gives it back early."""
    acq = Acquirer(kind, bouncer, objs)
    if kind == "policy":
        release, rparams = "SELECT pg_backend_pid(), rl_release(%s, %s)", (acq.policy, acq.identity)
    else:
        release, rparams = "SELECT pg_backend_pid(), rl_concurrency_release(%s)", (acq.identity,)
    a, x, b, d = (bouncer.connect("rl_tx", user=acq.user) for _ in range(4))

    a.execute("BEGIN")
    pid_1, ok = acq(a)
    assert ok is True
    x.execute("BEGIN")  # x holds the other server connection
    pid_2 = one(x, "SELECT pg_backend_pid()")[0]
    assert pid_2 != pid_1
    a.execute("COMMIT")
    assert acq(x) == (pid_2, True)  # x now holds the slot, on connection 2

    assert one(b, release, rparams) == (pid_1, False)  # b runs where a took its slot
    assert shared_redis.command("ZCARD", acq.key) == 1
    assert acq(d) == (pid_1, False)
    assert one(x, release, rparams) == (pid_2, True)  # the holder, early
    assert shared_redis.command("ZCARD", acq.key) == 0
    assert acq(d) == (pid_1, True)
    assert one(x, release, rparams) == (pid_2, False)
    x.execute("COMMIT")
    assert shared_redis.command("ZCARD", acq.key) == 0


@pytest.mark.parametrize("kind", ["policy", "explicit"])
def test_tx_pool_autocommit_slot_released_per_statement(bouncer, objs, shared_redis, kind):
    """In autocommit a lone acquire is its own transaction: 6 clients over 2
    server connections take a 1-slot limit 18 times in a row, every time."""
    acq = Acquirer(kind, bouncer, objs)
    conns = [bouncer.connect("rl_tx", user=acq.user) for _ in range(6)]
    got, pids = [], set()
    for i in range(18):
        pid, ok = acq(conns[i % len(conns)])
        got.append(ok)
        pids.add(pid)
    assert got == [True] * 18
    assert 1 <= len(pids) <= POOL_SIZE
    assert shared_redis.command("ZCARD", acq.key) == 0
    # a two-statement transaction holds it until its end
    conns[0].execute("BEGIN")
    assert acq(conns[0])[1] is True
    assert acq(conns[1])[1] is False
    assert conns[0].execute("SELECT 1").fetchone() == (1,)
    assert acq(conns[2])[1] is False
    conns[0].execute("COMMIT")
    assert acq(conns[3])[1] is True


@pytest.mark.parametrize("how", ["terminate", "drop_socket"])
@pytest.mark.parametrize("pool", ["rl_tx", "rl_sess"])
def test_disconnect_mid_transaction_releases_slot(pg, bouncer, objs, shared_redis, pool, how):
    """A client that goes away from pgbouncer inside a transaction holding a
    slot (transaction or session pooling): pgbouncer closes that server
    connection (it cannot hand it to another client in the middle of a
    transaction), the backend aborts and exits, and the slot comes back
    (not by its 600 s lease). Another client of the transaction pool
    watches."""
    acq = Acquirer("policy", bouncer, objs)
    a = bouncer.connect(pool, user=acq.user)
    b = bouncer.connect("rl_tx", user=acq.user)
    a.execute("BEGIN")
    pid_a, ok = acq(a)
    assert ok is True
    assert acq(b)[1] is False

    if how == "terminate":
        a.close()  # a Terminate message to pgbouncer
    else:
        # the TCP connection ends without a Terminate message
        s = socket.socket(fileno=os.dup(a.pgconn.socket))
        s.shutdown(socket.SHUT_RDWR)
        s.close()

    ok, waited = wait_until(lambda: acq(b)[1], FREE_BOUND_S)
    assert ok is True, "slot not free %.1f s after the client left" % waited
    gone, waited = wait_until(
        lambda: one(pg, "SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid_a,)) == (0,),
        FREE_BOUND_S,
    )
    assert gone is True, "the server connection of the client that left still exists"
    a.close()
    # the pool goes on: 4 clients, one after another, each take the slot
    assert [acq(bouncer.connect("rl_tx", user=acq.user))[1] for _ in range(4)] == [True] * 4
    assert shared_redis.command("ZCARD", acq.key) == 0


# ---------------------------------------------------------------- guards, refunds


def test_tx_pool_guard_refund_on_rollback(bouncer, objs, shared_redis):
    """rl_guard with refund_on_abort = guards (the default): what a rolled-back
    transaction, savepoint or statement charged is back for the other
    clients of the pool at once."""
    role = bouncer.role
    pol = objs.policy("fixed", 3, HUGE_WINDOW_MS)
    table = objs.guarded_table(pol, grant_insert_to=role)
    tenant = new_ident("tenant")
    insert = sql.SQL("INSERT INTO {} (tenant) SELECT %s FROM generate_series(1, %s)").format(sql.Identifier(table))
    a, b = (bouncer.connect("rl_tx", user=role) for _ in range(2))

    def peek():
        # a new client each time: a, busy in its transaction, holds one
        # server connection, so this runs on the other one
        return one(bouncer.connect("rl_tx", user=role),
                   "SELECT pg_backend_pid(), (rl_check(%s, %s, 0)).remaining", (pol, tenant))

    assert one(b, "SHOW rl_redis.refund_on_abort") == ("guards",)

    # a rolled-back transaction
    a.execute("BEGIN")
    a.execute(insert, (tenant, 2))
    pid_a = one(a, "SELECT pg_backend_pid()")[0]
    pid, remaining = peek()
    assert pid != pid_a and remaining == 1
    a.execute("ROLLBACK")
    assert peek()[1] == 3

    # a rolled-back savepoint, then a commit
    a.execute("BEGIN")
    a.execute(insert, (tenant, 1))
    a.execute("SAVEPOINT s")
    a.execute(insert, (tenant, 1))
    assert peek()[1] == 1
    a.execute("ROLLBACK TO SAVEPOINT s")
    assert peek()[1] == 2
    a.execute("COMMIT")
    assert peek()[1] == 2

    # a statement that is denied half-way (autocommit): its first row is back
    with pytest.raises(psycopg.Error) as exc:
        a.execute(insert, (tenant, 3))
    assert exc.value.sqlstate == "PT429"
    assert peek()[1] == 2
    a.execute(insert, (tenant, 2))
    assert peek()[1] == 0
    with pytest.raises(psycopg.Error) as exc:
        b.execute(insert, (tenant, 1))
    assert exc.value.sqlstate == "PT429"
    assert one(b, sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table))) == (3,)
    assert fixed_units(shared_redis.command(
        "GET", rl_key("fixed", tenant, pol, 3, HUGE_WINDOW_MS, prefix=bouncer.prefix))) == "3"


def test_tx_pool_set_local_applies_to_one_transaction(bouncer):
    """SET LOCAL rl_redis.refund_on_abort = 'all' (superuser) inside a
    transaction: that rollback gives the explicit calls back; the next
    client on the same server connection has the default again."""
    identity = new_ident("pgb")
    a, b = bouncer.connect("rl_tx1"), bouncer.connect("rl_tx1")  # 1 server connection
    call = "SELECT rl_fixed_allow(%s, 5, %s)"
    peek = "SELECT pg_backend_pid(), (rl_fixed(%s, 5, %s, 0)).remaining"

    a.execute("BEGIN")
    a.execute("SET LOCAL rl_redis.refund_on_abort = 'all'")
    assert [one(a, call, (identity, HUGE_WINDOW_MS))[0] for _ in range(2)] == [True, True]
    pid_a = one(a, "SELECT pg_backend_pid()")[0]
    a.execute("ROLLBACK")
    assert one(b, peek, (identity, HUGE_WINDOW_MS)) == (pid_a, 5)
    assert one(b, "SHOW rl_redis.refund_on_abort") == ("guards",)

    # without it: explicit calls are kept by a rollback
    b.execute("BEGIN")
    assert [one(b, call, (identity, HUGE_WINDOW_MS))[0] for _ in range(2)] == [True, True]
    b.execute("ROLLBACK")
    assert one(a, peek, (identity, HUGE_WINDOW_MS)) == (pid_a, 3)


def test_tx_pool_session_set_leaks_to_other_clients(bouncer):
    """Why not plain SET under transaction pooling: the setting stays on the
    server connection, and another client gets it; the client that set it
    may not have it for its next transaction (with 2 connections)."""
    a, b = bouncer.connect("rl_tx1"), bouncer.connect("rl_tx1")  # 1 server connection
    before = one(b, "SHOW rl_redis.retry_interval")
    assert before == ("1s",)
    try:
        a.execute("SET rl_redis.retry_interval = '7s'")
        assert one(b, "SHOW rl_redis.retry_interval") == ("7s",)
    finally:
        a.execute("RESET rl_redis.retry_interval")
    assert one(b, "SHOW rl_redis.retry_interval") == before


def test_session_pool_set_sticks_and_is_reset(bouncer):
    """Session pooling: a client keeps its server connection, so a session
    SET lasts for its transactions; when it leaves, DISCARD ALL
    (server_reset_query) gives the next client the configured defaults."""
    identity = new_ident("pgb")
    a = bouncer.connect("rl_sess")  # 1 server connection
    a.execute("SET rl_redis.refund_on_abort = 'all'")
    pid_a = one(a, "SELECT pg_backend_pid()")[0]
    for _ in range(2):
        a.execute("BEGIN")
        assert one(a, "SELECT rl_fixed_allow(%s, 5, %s, 2)", (identity, HUGE_WINDOW_MS)) == (True,)
        a.execute("ROLLBACK")
    assert one(a, "SELECT pg_backend_pid(), (rl_fixed(%s, 5, %s, 0)).remaining",
               (identity, HUGE_WINDOW_MS)) == (pid_a, 5)
    a.close()
    b = bouncer.connect("rl_sess")
    assert one(b, "SELECT pg_backend_pid(), current_setting('rl_redis.refund_on_abort')") == (pid_a, "guards")


# ---------------------------------------------------------------- statement pooling


def test_statement_pool_single_calls_exact(bouncer, objs, shared_redis):
    """Statement pooling: every statement may run on another server
    connection; single calls still decide exactly, and an autocommit
    acquire gives its slot back at its statement's end."""
    lim = 41
    identity = new_ident("pgb")
    allowed, pids = interleave(
        lambda: bouncer.connect("rl_stmt"),
        "rl_sliding_allow(%s, %s, %s)",
        (identity, lim, LONG_WINDOW_MS),
    )
    assert allowed == lim
    assert len(pids) == POOL_SIZE

    pol = objs.policy("sliding", 7, LONG_WINDOW_MS)
    allowed, pids = interleave(
        lambda: bouncer.connect("rl_stmt", user=bouncer.role),
        "rl_allow(%s, %s)",
        (pol, identity),
    )
    assert allowed == 7
    assert len(pids) == POOL_SIZE

    for kind in ("policy", "explicit"):
        acq = Acquirer(kind, bouncer, objs)
        conns = [bouncer.connect("rl_stmt", user=acq.user) for _ in range(4)]
        assert [acq(conns[i % 4])[1] for i in range(12)] == [True] * 12
        assert shared_redis.command("ZCARD", acq.key) == 0


def test_statement_pool_refuses_transactions(bouncer, objs, shared_redis):
    """Statement pooling refuses every multi-statement transaction: pgbouncer
    answers FATAL 08P01 'transaction blocks not allowed in statement pooling
    mode', closes the client and the server connection; a slot the refused
    transaction had taken is given back by the backend's abort."""
    msg = "transaction blocks not allowed in statement pooling mode"
    refusal = [("E", {"S": "FATAL", "C": "08P01", "M": msg}), "EOF"]  # and nothing else

    s, f = raw_connect(bouncer.server.port, "rl_stmt")
    raw_send_query(s, "BEGIN")
    got = raw_messages(f)
    s.close()
    assert got == refusal

    # psycopg shows it as a lost connection with pgbouncer's message
    c = bouncer.connect("rl_stmt")
    with pytest.raises(psycopg.OperationalError) as exc:
        c.execute("BEGIN")
    assert msg in str(exc.value)
    assert c.closed

    # a non-autocommit client: its implicit BEGIN is refused before the call
    acq = Acquirer("explicit", bouncer, objs)
    c = bouncer.connect("rl_stmt", autocommit=False)
    with pytest.raises(psycopg.OperationalError) as exc:
        acq(c)
    assert msg in str(exc.value)
    assert c.closed
    assert shared_redis.command("ZCARD", acq.key) == 0

    # BEGIN, the acquire and a sleep in one simple-protocol message: the
    # server runs them all (the slot is taken) before pgbouncer sees the
    # open transaction at ReadyForQuery
    s, f = raw_connect(bouncer.server.port, "rl_stmt")
    raw_send_query(s, "BEGIN; SELECT rl_concurrency_acquire_allow('%s', 1, %d); SELECT pg_sleep(0.5)"
                   % (acq.identity, LEASE_MS))
    taken, _ = wait_until(lambda: shared_redis.command("ZCARD", acq.key) == 1, FREE_BOUND_S)
    got = raw_messages(f)
    s.close()
    assert taken is True
    assert got == refusal
    freed, waited = wait_until(lambda: shared_redis.command("ZCARD", acq.key) == 0, FREE_BOUND_S)
    assert freed is True, "slot still taken %.1f s after the refusal" % waited
    other = bouncer.connect("rl_stmt")
    assert acq(other)[1] is True
