"""Fixtures for the rl_redis concurrency and fault tests.

Run through sql_tests/run_tests.sh, which exports PGHOST/PGPORT/PGUSER/
PGDATABASE for a throwaway cluster, RL_DIR (its temporary folder) and
RL_REDIS_PORT (the Redis that the cluster's postgresql.conf points at).

Use Debian's interpreter: /usr/bin/python3 -m pytest sql_tests
(python3-psycopg is psycopg 3, python3-pytest is pytest).

Fixtures:
  pg                 new autocommit connection as the postgres superuser,
                     closed after the test
  redis_factory      starts extra redis-server processes (see RedisServer),
                     all killed at teardown
  shared_redis_port  int(os.environ["RL_REDIS_PORT"])
  shared_redis       a RedisServer-like handle (cli/command) for that Redis
  ident              a unique identity for the test
  shared_server      a preloading PgServer of the module's own on a Redis of
                     its own (the rl_redis worker connected), for the
                     shared transport
  private_server     a preloading PgServer of the module's own on the shared
                     Redis (with on_private_server)

Module-level helpers (importable from the test modules: `from conftest
import ...`): pg_connect, new_ident, set_gucs, use_redis, rl_key, wait_for,
own_connection_open, RedisServer, PgServer (with a look at its processes),
BlackHole (a port that accepts and never answers),
redis_clients, backend_tcp_ports, and the README's privilege table
(readme_privileges, readme_section).
"""

import fcntl
import os
import pwd
import re
import resource
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
import psycopg.rows
from psycopg import sql
import pytest

from ports import free_port

# RL_REDIS_SERVER / RL_REDIS_CLI (set by sql_tests/test_matrix.sh to
# valkey-server / valkey-cli) pick the server that every test starts
REDIS_SERVER = shutil.which(os.environ.get("RL_REDIS_SERVER") or "redis-server") or "/usr/bin/redis-server"
REDIS_CLI = shutil.which(os.environ.get("RL_REDIS_CLI") or "redis-cli") or "/usr/bin/redis-cli"

# Under pytest-xdist (run_tests.sh runs the suite with -n), each worker works
# in a database of its own, made by the _extension fixture: the statistics
# (one row per database, policy and algorithm) and the rl_policy table of one
# worker never see another worker's calls. Redis keys need no such care:
# every test uses identities and policy names of its own.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if XDIST_WORKER:
    os.environ["PGDATABASE"] = "rl_pytest_%s%s" % (os.environ.get("RL_TEST_RUN", ""), XDIST_WORKER)


# ---------------------------------------------------------------- the run


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "alone: the test changes a server that the other tests share (ALTER SYSTEM, "
        "pausing or reconfiguring the shared Redis); run_tests.sh runs these after "
        "the parallel run, one at a time",
    )
    config.addinivalue_line(
        "markers",
        "heavy: a test of tens of seconds; run_tests.sh runs these in a pytest run of "
        "their own beside the others, one worker each",
    )
    config.addinivalue_line(
        "markers",
        "new_session: the pg fixture gives a new session, not one an earlier test "
        "used (the test looks at the backend's own descriptors or memory)",
    )
    global _CONFIG
    _CONFIG = config


_CONFIG = None


# Module-scoped fixtures that start a server of their own (seconds each):
# the tests that use one stay on one xdist worker, which starts it once.
ONE_WORKER_FIXTURES = ("shared_server", "private_server")
# fixtures of a module's own servers (a Redis Cluster, a Sentinel set): the
# tests of one module that use one go to one xdist worker, which starts it
# once instead of once per worker
ONE_WORKER_PER_MODULE_FIXTURES = ("redis_cluster", "redis_sentinel")


@pytest.hookimpl(tryfirst=True)  # before xdist reads the xdist_group marks
def pytest_collection_modifyitems(session, config, items):
    """The tests of a fixture of ONE_WORKER_FIXTURES share an xdist group,
    and so do a module's tests of a fixture of ONE_WORKER_PER_MODULE_FIXTURES.
    RL_TEST_ORDER=reverse runs the modules in reverse order (each module's
    tests in their own order): a check that no module depends on another
    having run first."""
    for item in items:
        names = getattr(item, "fixturenames", ())
        group = next((name for name in ONE_WORKER_FIXTURES if name in names), None)
        if group is None:
            group = next(("%s@%s" % (name, item.module.__name__)
                          for name in ONE_WORKER_PER_MODULE_FIXTURES if name in names), None)
        if group is not None and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group))
    if os.environ.get("RL_TEST_ORDER") == "reverse":
        modules = []
        for item in items:
            if not modules or modules[-1][0] != item.module.__name__:
                modules.append((item.module.__name__, []))
            modules[-1][1].append(item)
        items[:] = [item for _, group in reversed(modules) for item in group]


def _cpu_seconds():
    """The CPU time of this process and of its waited-for children; with
    RL_MACHINE_CPU=1 the whole machine's (/proc/stat: servers included),
    which says what a test costs when the tests run one at a time
    (`-p no:xdist`)."""
    if os.environ.get("RL_MACHINE_CPU"):
        with open("/proc/stat") as f:
            fields = f.readline().split()
        # user, nice, system, irq, softirq (USER_HZ ticks)
        return sum(int(fields[i]) for i in (1, 2, 3, 6, 7)) / os.sysconf("SC_CLK_TCK")
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Adds the CPU time the test process spent in this phase (the client's
    side: Python, psycopg, redis-cli) to the phase's report."""
    start = getattr(item, "_rl_cpu_mark", None)
    now = _cpu_seconds()
    item._rl_cpu_mark = now
    outcome = yield
    outcome.get_result().user_properties.append(("client_cpu", now - start if start is not None else 0.0))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Marks where the setup phase's CPU time starts."""
    item._rl_cpu_mark = _cpu_seconds()


def pytest_runtest_logreport(report):
    """Appends each phase's duration (and the client's CPU time in it) to
    $RL_DURATIONS_FILE (in the process that reports, not in xdist's
    workers), for run_tests.sh's list of the slowest tests over both runs."""
    path = os.environ.get("RL_DURATIONS_FILE")
    if not path or _CONFIG is None or hasattr(_CONFIG, "workerinput"):
        return
    cpu = dict(report.user_properties).get("client_cpu", 0.0)
    with open(path, "a") as f:
        f.write("%.2f\t%s\t%s\t%.2f\n" % (report.duration, report.when, report.nodeid, cpu))


# ---------------------------------------------------------------- PostgreSQL


def pg_connect(**kwargs):
    """A new autocommit psycopg connection to the test cluster.

    Connection parameters come from the PG* environment variables that
    run_tests.sh exports; keyword arguments (e.g. user=...) override them.
    """
    kwargs.setdefault("autocommit", True)
    kwargs.setdefault("connect_timeout", 10)
    kwargs.setdefault("application_name", "rl_redis_pytest")
    return psycopg.connect(**kwargs)


def control_version():
    """The extension's default_version, as rl_redis.control says."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "rl_redis.control")
    with open(path) as f:
        for line in f:
            if line.startswith("default_version"):
                return line.split("'")[1]
    raise AssertionError("rl_redis.control has no default_version")


class QueryThread(threading.Thread):
    """Runs one query on conn in a thread: .rows or .error (looked at by the
    main thread), .started and .finished (time.monotonic())."""

    def __init__(self, conn, query, params=None):
        super().__init__(daemon=True)
        self.conn, self.query, self.params = conn, query, params
        self.rows = self.error = None
        self.started = self.finished = None

    def run(self):
        self.started = time.monotonic()
        try:
            self.rows = self.conn.execute(self.query, self.params).fetchall()
        except BaseException as e:  # looked at by the main thread
            self.error = e
        self.finished = time.monotonic()


def wait_for(predicate, timeout, what, interval=0.05):
    """Polls predicate() (exceptions count as False) until it returns a true
    value, which is returned; raises AssertionError after timeout s."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except (OSError, RespError, ValueError, KeyError, IndexError) as e:
            last = e
        if time.monotonic() >= deadline:
            raise AssertionError("timed out after %.1f s waiting for %s (last error: %r)"
                                 % (timeout, what, last))
        time.sleep(interval)


def vm_hwm_kb(pid):
    """The peak resident set size of a process, from /proc (the tests run as
    root or as the cluster owner)."""
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise AssertionError("no VmHWM for process %d" % pid)


def new_ident(tag="t"):
    """An identity nobody else uses (curly braces are left out on purpose:
    the extension wraps the identity in {} itself)."""
    return "pytest:%s:%s" % (tag, uuid.uuid4().hex)


def set_gucs(conn, **gucs):
    """SET rl_redis.<name> = <value> for every keyword, in this session."""
    for name, value in gucs.items():
        conn.execute(
            sql.SQL("SET {} = {}").format(
                sql.Identifier("rl_redis", name), sql.Literal(str(value))
            )
        )


# the kind in the keys of an algorithm whose state changed layout (README,
# "Keys in Redis")
KEY_KINDS = {"fixed": "fixed.2", "sliding_counter": "sliding_counter.2",
             "token_bucket": "token_bucket.2", "gcra": "gcra.2"}


def rl_key(algorithm, identity, policy=None, lim=None, window_ms=None, burst=None,
           prefix="rl:"):
    """The documented Redis key of a decision:
      explicit: <prefix><kind>:{<enc(identity)>}:<lim>/<window_ms>[/<burst>]
      policy:   <prefix><kind>:{<enc(identity)>}:<policy>:<lim>/<window_ms>[/<burst>]
                (token_bucket and gcra)
                <prefix><kind>:{<enc(identity)>}:<policy>:/<window_ms>
                (fixed, sliding and sliding_counter: lim is left out)
                <prefix>concurrency:{<enc(identity)>}:<policy>
    (concurrency: window_ms is the lease) where kind is the algorithm's
    (KEY_KINDS), enc() percent-encodes '%', '{' and '}', and the burst is
    written only when it differs from lim.
    Give lim and window_ms (and burst when the call or the policy has one),
    and the policy's name for a policy."""
    if lim is None or window_ms is None:
        raise ValueError("rl_key needs lim and window_ms")
    enc = identity.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")
    key = "%s%s:{%s}:" % (prefix, KEY_KINDS.get(algorithm, algorithm), enc)
    if policy is not None and algorithm == "concurrency":
        return key + policy
    if policy is not None:
        key += policy + ":"
    if policy is None or algorithm in ("token_bucket", "gcra"):
        key += "%d" % lim
    key += "/%d" % window_ms
    if burst is not None and burst != lim:
        key += "/%d" % burst
    return key


def fixed_state(state):
    """A fixed window's state (the GET reply of its key) unpacked, as
    lua/fixed_window.lua packs it: (units, lim, epoch, window number or
    None when the state leaves it out), or None when there is no key."""
    if state is None:
        return None
    raw = state.encode(errors="surrogateescape")
    short = len(raw) <= 15
    k = (len(raw) - (7 if short else 15)) // 2
    assert len(raw) % 2 == 1 and 1 <= k <= 4, "a fixed window's state of %d bytes" % len(raw)
    fields = [int.from_bytes(raw[i:i + n], "little")
              for i, n in zip((0, k, 2 * k, 2 * k + 7), (k, k, 7, 8))]
    return tuple(fields[:3]) + ((None,) if short else (fields[3],))


def level_state(v):
    """A token bucket's or GCRA key's level (tokens; backlog, µs) and the
    clock it was measured at (µs): field v of its hash (the HGET reply)
    unpacked, as lua/records.lua packs it, or None when there is none."""
    if v is None:
        return None
    raw = v.encode(errors="surrogateescape")
    assert len(raw) == 16, "a level state of %d bytes" % len(raw)
    return struct.unpack("<dd", raw)


def fixed_units(state):
    """The units a fixed window's state holds (the GET reply of its key: see
    lua/fixed_window.lua), as a string, or None when there is no key."""
    if state is None:
        return None
    return str(fixed_state(state)[0])


def same_fixed_window(redis, window_ms, body, attempts=4):
    """Runs body() (which must use fresh identities on every call) until one
    run starts and ends inside one fixed window of the Redis clock, so a
    window boundary falling in the middle can't change the counts. Returns
    body()'s result."""
    for _ in range(attempts):
        t0 = redis.time_ms()
        result = body()
        t1 = redis.time_ms()
        if t0 // window_ms == t1 // window_ms:
            return result
    pytest.fail("could not run inside one %d ms window in %d attempts" % (window_ms, attempts))


def own_connection_open(conn):
    """Whether the session shows an open connection in rl_redis_connections()."""
    return conn.execute(
        "SELECT count(*) FROM rl_redis_connections() WHERE state <> 'closed'").fetchone()[0] > 0


def use_redis(conn, server, **gucs):
    """Points the session at `server` (a RedisServer), plus other GUCs.

    The circuit breaker is off (retry_interval 0) unless asked for, so that
    these tests see every call reach the network; test_breaker.py covers it.
    """
    gucs.setdefault("retry_interval", 0)
    if server.unix_socket:
        set_gucs(conn, host=server.unix_socket)
    else:
        set_gucs(conn, host="127.0.0.1", port=server.port)
    set_gucs(conn, **gucs)


@pytest.fixture(scope="session", autouse=True)
def _extension():
    """Makes sure the extension exists in the test database."""
    for var in ("PGHOST", "PGPORT", "RL_REDIS_PORT"):
        if var not in os.environ:
            pytest.exit(
                "%s is not set: run these tests through sql_tests/run_tests.sh" % var,
                returncode=2,
            )
    if XDIST_WORKER:
        with pg_connect(dbname="postgres") as conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s",
                                  (os.environ["PGDATABASE"],)).fetchone()
            if not exists:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(
                    sql.Identifier(os.environ["PGDATABASE"])))
    with pg_connect() as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS rl_redis")
    yield


# Sessions that tests gave back (give_back_session), this process's, per
# server, for the next take_session: a new backend costs about 40 ms of CPU
# on the 2-core test machine (some 760 page faults at about 17 us each), and
# the suite would start thousands of them.
_IDLE_SESSIONS = {}
IDLE_SESSIONS_KEPT = 16  # per server and process: 4 workers keep at most 64


def _target_of(conn):
    """The server, database and user of a session."""
    return (conn.info.host, str(conn.info.port), conn.info.dbname, conn.info.user)


def _session_reusable(conn):
    """Makes a session that a test ended look as a new one to the next
    test, as a pooler's reset does: out of any transaction, DISCARD ALL
    (settings, role, temporary tables, prepared statements, locks, LISTEN),
    its Redis connections closed (rl_redis_disconnect), and psycopg's own
    state as a new connection's. False when it cannot be made so: it is
    broken or in a transaction, a connection still carries work of a
    transaction end (a release or refund Redis has not taken), or calls to a
    server failed last (what is said once per outage would then not be said
    to the next test); the session is then closed instead."""
    if conn.closed or conn.broken or \
            conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        return False
    try:
        conn.autocommit = True
        conn.row_factory = psycopg.rows.tuple_row
        conn.prepare_threshold = 5
        conn._notice_handlers.clear()
        conn._notify_handlers.clear()
        conn._prepared.clear()  # its DEALLOCATE ALL goes first
        conn.execute("DISCARD ALL")
        left = conn.execute(
            "SELECT rl_redis_disconnect() + (SELECT (coalesce(sum(queued), 0) + "
            "count(failing_since))::int FROM rl_redis_connections())").fetchone()[0]
    except psycopg.Error:
        return False
    return left == 0


def take_session(server=None):
    """An autocommit superuser session of server (a PgServer) or, without
    one, of where pg_connect() connects now: one that an earlier test gave
    back, or a new one."""
    if server is None:
        target = tuple(os.environ.get(v) for v in ("PGHOST", "PGPORT", "PGDATABASE", "PGUSER"))
    else:
        target = server.target()
    idle = _IDLE_SESSIONS.get(target, [])
    while idle:
        conn = idle.pop()
        try:
            conn.execute("SELECT 1")  # the server may have restarted
            return conn
        except psycopg.Error:
            conn.close()
    return pg_connect() if server is None else server.connect()


def give_back_session(conn):
    """Keeps a session a test ended for a later take_session, reset
    (_session_reusable), while fewer than IDLE_SESSIONS_KEPT of its server
    wait; closes it otherwise. True when it was kept."""
    if not conn.closed and not conn.broken:
        idle = _IDLE_SESSIONS.setdefault(_target_of(conn), [])
        if len(idle) < IDLE_SESSIONS_KEPT and _session_reusable(conn):
            idle.append(conn)
            return True
    conn.close()
    return False


@pytest.fixture
def pg(request):
    """An autocommit session of the test cluster as the postgres superuser
    (take_session), given back at the end; always a new one for a test
    marked new_session (it looks at the backend's own descriptors or
    memory)."""
    if request.node.get_closest_marker("new_session"):
        conn = pg_connect()
        try:
            yield conn
        finally:
            conn.close()
        return
    conn = take_session()
    try:
        yield conn
    finally:
        give_back_session(conn)


@pytest.fixture
def ident():
    return new_ident()


# ---------------------------------------------------------------- Redis


class RespError(Exception):
    """A Redis error reply."""


def _read_reply(f):
    line = f.readline()
    if not line:
        raise ConnectionError("Redis closed the connection")
    kind, rest = line[:1], line[1:-2].decode()
    if kind == b"+":
        return rest
    if kind == b"-":
        raise RespError(rest)
    if kind == b":":
        return int(rest)
    if kind == b"$":
        n = int(rest)
        if n < 0:
            return None
        data = f.read(n + 2)
        # bytes that are not UTF-8 (a packed state) kept: fixed_units
        return data[:-2].decode(errors="surrogateescape")
    if kind == b"*":
        n = int(rest)
        if n < 0:
            return None
        return [_read_reply(f) for _ in range(n)]
    raise ConnectionError("bad RESP reply: %r" % line)


def resp_encode(cmds):
    """The RESP bytes of several commands (lists of str), one after another."""
    payload = b""
    for cmd in cmds:
        payload += b"*%d\r\n" % len(cmd)
        for a in cmd:
            b = a.encode()
            payload += b"$%d\r\n%s\r\n" % (len(b), b)
    return payload


def resp_command(args, port=None, unix_socket=None, password=None, timeout=5.0):
    """Sends one command over a fresh connection and returns the parsed reply
    (raises RespError for an error reply)."""
    if unix_socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        addr = unix_socket
    else:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        addr = ("127.0.0.1", port)
    s.settimeout(timeout)
    try:
        s.connect(addr)
        cmds = []
        if password is not None:
            cmds.append(["AUTH", password])
        cmds.append([str(a) for a in args])
        s.sendall(resp_encode(cmds))
        f = s.makefile("rb")
        reply = None
        for _ in cmds:
            reply = _read_reply(f)
        return reply
    finally:
        s.close()


class RedisServer:
    """One redis-server process on 127.0.0.1:<port> (or a Unix socket when
    unix_socket=True), no persistence, in its own folder."""

    def __init__(self, base_dir, name, unix_socket=False, password=None, extra_args=()):
        self.dir = os.path.join(base_dir, name)
        os.makedirs(self.dir)
        os.chmod(self.dir, 0o755)
        self.password = password
        self.extra_args = list(extra_args)
        self.unix_socket = os.path.join(self.dir, "redis.sock") if unix_socket else None
        self.port = 0 if unix_socket else free_port()
        self.proc = None
        self.paused = False

    # -- process control

    def _argv(self):
        argv = [
            REDIS_SERVER,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--dir", self.dir,
            "--logfile", os.path.join(self.dir, "redis.log"),
        ]
        if self.unix_socket:
            argv += ["--unixsocket", self.unix_socket, "--unixsocketperm", "777"]
        if self.password is not None:
            argv += ["--requirepass", self.password]
        return argv + self.extra_args

    def start(self, timeout=15.0):
        """Starts the server (again, on the same port / socket)."""
        assert self.proc is None or self.proc.poll() is not None, "already running"
        first_start = self.proc is None
        deadline = time.monotonic() + timeout
        while True:
            self.proc = subprocess.Popen(
                self._argv(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            self.paused = False
            if self._wait_ready(deadline):
                return self
            self.stop()
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    "redis-server in %s did not start; log:\n%s" % (self.dir, self.log())
                )
            if first_start and not self.unix_socket:
                self.port = free_port()  # somebody else took the port: pick another
            time.sleep(0.2)

    def _wait_ready(self, deadline):
        """True once our process answers (and not some other server that
        happens to listen on the port)."""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                info = self.command("INFO", "server", timeout=1.0)
                if "process_id:%d\r\n" % self.proc.pid in info and not self._loading():
                    return True
                if self.proc.poll() is not None:
                    return False
            except (OSError, RespError):
                pass
            time.sleep(0.05)
        return False

    def _loading(self):
        """True while the server is still loading its data (AOF or RDB):
        Redis and Valkey answer INFO then (loading:1), but data commands get
        a LOADING error. Redis 7 and 8 load a small AOF before a client gets
        there; Valkey 8.1 is slower, and without this wait both calls of
        test_counts_survive_restart_with_aof right after the restart got
        "LOADING Valkey is loading the dataset in memory" (make test-matrix).
        A sentinel has no persistence section: never loading."""
        try:
            return "loading:1" in self.command("INFO", "persistence", timeout=1.0)
        except RespError:
            return False

    def stop(self):
        """SIGKILL and wait (works on a paused process too)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.paused = False

    def pause(self):
        """SIGSTOP: the kernel still accepts connections and data, nobody answers."""
        assert self.proc is not None and self.proc.poll() is None
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self):
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
        self.paused = False

    # -- talking to it

    def cli(self, *args, check=True):
        """Runs redis-cli against this server; returns its stdout, stripped."""
        argv = [REDIS_CLI]
        if self.unix_socket:
            argv += ["-s", self.unix_socket]
        else:
            argv += ["-h", "127.0.0.1", "-p", str(self.port)]
        if self.password is not None:
            argv += ["--no-auth-warning", "-a", self.password]
        argv += [str(a) for a in args]
        res = subprocess.run(argv, capture_output=True, text=True, timeout=15)
        if check and res.returncode != 0:
            raise RuntimeError("redis-cli %s failed: %s" % (args, res.stderr))
        return res.stdout.strip()

    def command(self, *args, timeout=5.0):
        """Sends one command through a raw RESP connection (fast, no fork)."""
        return resp_command(
            args,
            port=self.port,
            unix_socket=self.unix_socket,
            password=self.password,
            timeout=timeout,
        )

    def time_ms(self):
        """The Redis clock (what the Lua scripts use), in ms."""
        sec, usec = self.command("TIME")
        return int(sec) * 1000 + int(usec) // 1000

    def log(self):
        try:
            with open(os.path.join(self.dir, "redis.log")) as f:
                return f.read()[-4000:]
        except OSError:
            return ""


# ---------------------------------------------------------------- throwaway PostgreSQL

PGBIN = os.environ.get("RL_PGBIN") or subprocess.run(
    ["pg_config", "--bindir"], capture_output=True, text=True, check=True
).stdout.strip()

# sql_tests/valgrind.sh: the postgres that PgServer starts, a script that
# runs this build's server under valgrind, as valgrind.sh's own server
VALGRIND_POSTGRES = os.environ.get("RL_VALGRIND_POSTGRES")


class Hammer:
    """Sessions calling in threads until stop(): session s runs
    job(conn, s, i) for i = 0, 1, ... (pause_s apart) and the outcome of
    each call is recorded as (s, i, started, finished, value or
    exception). The load of the Cluster and Sentinel failover tests."""

    def __init__(self, conns, job, pause_s=0.002):
        self.conns = conns
        self.job = job
        self.pause_s = pause_s  # between two calls of a session
        self.records = [[] for _ in conns]
        self.stopping = threading.Event()
        self.barrier = threading.Barrier(len(conns) + 1)
        self.threads = [threading.Thread(target=self._run, args=(s,), daemon=True) for s in range(len(conns))]

    def _run(self, s):
        conn = self.conns[s]
        self.barrier.wait(timeout=60)
        i = 0
        while not self.stopping.is_set():
            t0 = time.monotonic()
            try:
                value = self.job(conn, s, i)
            except psycopg.Error as e:
                value = e
            except BaseException as e:  # a bug of the test: recorded too
                value = e
            self.records[s].append((s, i, t0, time.monotonic(), value))
            i += 1
            time.sleep(self.pause_s)  # leave some CPU to Redis on a small machine

    def start(self):
        for t in self.threads:
            t.start()
        self.barrier.wait(timeout=60)
        return self

    def stop(self):
        self.stopping.set()
        for t in self.threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in self.threads), "a session hung"

    def errors(self, s=None):
        recs = self.records if s is None else [self.records[s]]
        return [r for rs in recs for r in rs if isinstance(r[4], BaseException)]

    def calls(self, s=None):
        recs = self.records if s is None else [self.records[s]]
        return [r for rs in recs for r in rs]


class BlackHole:
    """A TCP port that accepts connections and never answers: a Redis that
    hangs. A decision pointed at it waits rl_redis.command_timeout; each one
    opens a connection (the extension drops it after the timeout), so
    wait_for(n) tells that n decisions have reached "Redis"."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.accepted = []
        self.cond = threading.Condition()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self.cond:
                self.accepted.append(conn)
                self.cond.notify_all()

    def wait_for(self, n, timeout=30):
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.accepted) >= n, timeout), len(self.accepted)

    def close(self):
        self.sock.close()
        with self.cond:
            for conn in self.accepted:
                conn.close()

    # closing the port and every connection ends the decisions waiting on
    # it at once (a lost connection: on_error says the answer); wait_for
    # first the decisions that must be among them
    release = close


class TcpProxy:
    """A TCP proxy on 127.0.0.1:<port> in front of a Redis: what a client
    sends goes on at once, what Redis answers is held `delay` seconds before
    it goes back. cut() turns the connections open then into black holes
    (nothing goes either way any more, nothing is closed), as a connection
    through a failed-over address or a lost NAT entry; connections made
    after it go through. Has .port and .unix_socket (None), like a
    RedisServer, for use_redis; close() ends it."""

    def __init__(self, target_port, delay=0):
        self.target_port, self.delay = target_port, delay
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.port = self.listener.getsockname()[1]
        self.unix_socket = None
        self.pairs = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target_port))
            pair = {"cut": False, "sockets": (client, server)}
            self.pairs.append(pair)
            threading.Thread(target=self._pipe, args=(pair, client, server, 0), daemon=True).start()
            threading.Thread(target=self._pipe, args=(pair, server, client, self.delay),
                             daemon=True).start()

    @staticmethod
    def _pipe(pair, src, dst, delay):
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if delay:
                    time.sleep(delay)
                if not pair["cut"]:
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut(self):
        for pair in self.pairs:
            pair["cut"] = True

    def close(self):
        self.listener.close()
        for pair in self.pairs:
            for s in pair["sockets"]:
                try:
                    s.close()
                except OSError:
                    pass


def as_owner(argv):
    """argv as the cluster's owner (postgres when the tests run as root)."""
    if os.geteuid() == 0:
        return ["runuser", "-u", "postgres", "--"] + argv
    return argv


def give_to_owner(path):
    """Makes the cluster's owner (postgres when the tests run as root) own
    path, user and group."""
    if os.geteuid() == 0:
        pw = pwd.getpwnam("postgres")
        os.chown(path, pw.pw_uid, pw.pw_gid)


def initdb_template():
    """The data folder every PgServer starts as a copy of: initdb runs once
    per make test (under a lock, whichever xdist worker comes first), not
    once per server (about 2 s of CPU each). WAL segments of 1 MB instead of
    16 make each copy 15 MB smaller (a page of a new file costs about 17 µs
    of CPU on the 2-core test machine, a 40 MB copy about 0.3 s)."""
    base = os.path.join(os.environ["RL_DIR"], "pg-template")
    datadir = os.path.join(base, "pgdata")
    with open(base + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(os.path.join(datadir, "PG_VERSION")):
            shutil.rmtree(base, ignore_errors=True)
            os.makedirs(base)
            give_to_owner(base)
            subprocess.run(
                as_owner([os.path.join(PGBIN, "initdb"), "-D", datadir, "-U", "postgres",
                          "--auth=trust", "--no-sync", "-E", "UTF8", "--locale=C",
                          "--wal-segsize=1"]),
                check=True, capture_output=True, timeout=120,
            )
    return datadir


def pg_ctl_start(datadir, logfile):
    """Starts the PostgreSQL cluster in datadir with pg_ctl (under valgrind in
    sql_tests/valgrind.sh's run, which takes longer)."""
    wrap = ["-p", VALGRIND_POSTGRES, "-t", "600"] if VALGRIND_POSTGRES else ["-t", "120"]
    subprocess.run(
        as_owner([os.path.join(PGBIN, "pg_ctl"), "-D", datadir, "-l", logfile, "-w"]
                 + wrap + ["start"]),
        check=True, capture_output=True, timeout=660 if VALGRIND_POSTGRES else 150,
    )


def start_on_free_port(datadir, logfile, conffile, port):
    """Starts the cluster in datadir, whose conffile sets port; a port somebody
    took since free_port() (the log says it could not bind) is replaced by
    another, written to conffile, twice at most. Returns the port it runs on.
    When it cannot start, the error ends with the server log's last lines (the
    log goes with the temporary folder)."""
    for attempt in range(3):
        try:
            pg_ctl_start(datadir, logfile)
            return port
        except subprocess.CalledProcessError as e:
            with open(logfile, errors="replace") as f:
                log = f.read()
            if attempt == 2 or "could not create any TCP/IP sockets" not in log:
                raise RuntimeError("pg_ctl could not start %s; its log ends:\n%s"
                                   % (datadir, log[-3000:])) from e
            port = free_port()
            with open(conffile, "a") as f:
                f.write("port = %d\n" % port)


class PgServer:
    """A throwaway PostgreSQL in a folder of its own under RL_DIR: the one
    way the tests start a server other than run_tests.sh's. It preloads
    rl_redis (unless preload is false), points rl_redis.host and port at
    `redis` (a RedisServer; None: the shared Redis), sets retry_interval 0
    (no circuit breaker) and rl_redis.<name> = 'value' for each of conf, and
    creates the extension in database postgres (unless extension is false).
    remove() stops it and deletes its folder."""

    def __init__(self, redis=None, max_connections=20, preload=True, extension=True, **conf):
        self.redis = redis if redis is not None else _SharedRedis(int(os.environ["RL_REDIS_PORT"]))
        self.base = os.path.join(os.environ["RL_DIR"], "pg-%s" % uuid.uuid4().hex[:8])
        os.makedirs(self.base)
        os.chmod(self.base, 0o755)
        give_to_owner(self.base)
        self.datadir = os.path.join(self.base, "pgdata")
        self.logfile = os.path.join(self.base, "postgres.log")
        self.port = free_port()
        subprocess.run(["cp", "-a", initdb_template(), self.datadir], check=True, timeout=120)
        settings = {"rl_redis.host": "127.0.0.1", "rl_redis.port": self.redis.port,
                    "rl_redis.retry_interval": 0}
        settings.update(("rl_redis." + k, v) for k, v in conf.items())
        with open(os.path.join(self.datadir, "postgresql.conf"), "a") as f:
            f.write("port = %d\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '%s'\n"
                    "fsync = off\nshared_buffers = 16MB\nmax_connections = %d\n"
                    "shared_preload_libraries = '%s'\n"
                    % (self.port, self.base, max_connections, "rl_redis" if preload else ""))
            for name, value in settings.items():
                f.write("%s = '%s'\n" % (name, value))
        try:
            self._first_start()
            if extension:
                with self.connect() as conn:
                    conn.execute("CREATE EXTENSION rl_redis")
        except BaseException:
            self.remove()
            raise

    def _first_start(self):
        """Starts the server, on another port if its own was taken (see
        start_on_free_port)."""
        self.port = start_on_free_port(self.datadir, self.logfile,
                                       os.path.join(self.datadir, "postgresql.conf"), self.port)

    def start(self):
        """Starts the server again after a stop (see pg_ctl_start)."""
        pg_ctl_start(self.datadir, self.logfile)

    def connect(self, user="postgres", **gucs):
        """A new autocommit session (superuser unless user is given), with
        SET rl_redis.<k> = v."""
        conn = pg_connect(host="127.0.0.1", port=self.port, user=user, dbname="postgres")
        set_gucs(conn, **gucs)
        return conn

    def target(self):
        """What take_session keeps this server's sessions under (as
        _target_of says of them)."""
        return ("127.0.0.1", str(self.port), "postgres", "postgres")

    def env(self):
        """The libpq variables that make pg_connect() reach this server."""
        return {"PGHOST": "127.0.0.1", "PGPORT": str(self.port), "PGDATABASE": "postgres",
                "PGUSER": "postgres"}

    def stop(self):
        """Stops the server at once; under valgrind, a fast shutdown first, so
        that every process writes its leak report."""
        if VALGRIND_POSTGRES and subprocess.run(
                as_owner([os.path.join(PGBIN, "pg_ctl"), "-D", self.datadir, "-m", "fast",
                          "-w", "-t", "300", "stop"]),
                capture_output=True, timeout=330).returncode == 0:
            return
        subprocess.run(
            as_owner([os.path.join(PGBIN, "pg_ctl"), "-D", self.datadir, "-m", "immediate",
                      "-w", "stop"]),
            capture_output=True, timeout=60,
        )

    def remove(self):
        for conn in _IDLE_SESSIONS.pop(self.target(), []):
            conn.close()
        self.stop()
        shutil.rmtree(self.base, ignore_errors=True)

    def log(self):
        with open(self.logfile, errors="replace") as f:
            return f.read()

    def postmaster_pid(self):
        with open(os.path.join(self.datadir, "postmaster.pid")) as f:
            return int(f.readline())

    def children(self):
        """{pid: command line} of the postmaster's child processes."""
        pm = self.postmaster_pid()
        out = {}
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open("/proc/%s/stat" % name) as f:
                    stat = f.read()
                if int(stat.rsplit(")", 1)[1].split()[1]) != pm:
                    continue
                with open("/proc/%s/cmdline" % name, "rb") as f:
                    out[int(name)] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except (OSError, ValueError, IndexError):
                continue
        return out

    def worker_pids(self):
        """The pids of the running workers: the children that logged "rl_redis
        worker started" (the process title does not show under valgrind)."""
        started = {int(m) for m in re.findall(r"\[(\d+)\] LOG:  rl_redis worker started", self.log())}
        return [pid for pid in self.children() if pid in started]

    def worker_pid(self, timeout=10.0):
        """The pid of the one worker (waits for it to run); when none runs yet,
        a call under the shared transport starts it first (the first such call
        of the server makes the queue and registers the worker)."""
        if not self.worker_pids():
            with self.connect(transport="shared") as conn:
                conn.execute("SELECT rl_fixed_allow(%s, 5, 60000)", (new_ident("start"),))
        pids = wait_for(lambda: self.worker_pids(), timeout, "the rl_redis worker")
        assert len(pids) == 1, pids
        return pids[0]

    def clients(self):
        """{pid: number of connections to self.redis} for every process of
        this server that has one (the worker included)."""
        return redis_clients(self.redis, list(self.children()))


def backend_tcp_ports(pid):
    """The TCP connections of the sockets the process pid holds, as (local
    port, remote port) pairs (from /proc: the tests run as root or as the
    cluster owner). Linux gives one local port to connections to different
    servers, so a local port alone does not name a connection."""
    inodes = set()
    fd_dir = "/proc/%d/fd" % pid
    for fd in os.listdir(fd_dir):
        try:
            link = os.readlink(os.path.join(fd_dir, fd))
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        try:
            with open("/proc/%d/net/%s" % (pid, table)) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[9] in inodes:
                ports.add((int(fields[1].rsplit(":", 1)[1], 16), int(fields[2].rsplit(":", 1)[1], 16)))
    return ports


def client_ports(redis):
    """(the client's port, the server's port, the CLIENT LIST fields) of
    each client of a Redis server: a client's connection as
    backend_tcp_ports names it."""
    for line in redis.command("CLIENT", "LIST").splitlines():
        f = dict(p.split("=", 1) for p in line.split() if "=" in p)
        yield int(f["addr"].rsplit(":", 1)[1]), int(f["laddr"].rsplit(":", 1)[1]), f


def redis_clients(redis, pids):
    """{pid: how many of redis's clients are sockets of that process}, for
    the processes of pids that have any."""
    ports = {}
    for pid in pids:
        try:
            for link in backend_tcp_ports(pid):
                ports[link] = pid
        except OSError:  # the process is gone
            continue
    out = {}
    for client, server, _ in client_ports(redis):
        pid = ports.get((client, server))
        if pid is not None:
            out[pid] = out.get(pid, 0) + 1
    return out


@pytest.fixture(scope="module")
def private_server():
    """A preloading PostgreSQL of the module's own on the shared Redis, for
    tests that a server-wide event of another test would disturb (the deny
    cache's refund counter, a crash restart). Use it with on_private_server."""
    server = PgServer()
    try:
        yield server
    finally:
        server.remove()


@pytest.fixture(scope="module")
def shared_server():
    """A preloaded PostgreSQL (max_connections 150) on a Redis of its own,
    for the module; the worker has connected once (a warm-up call)."""
    factory = RedisFactory()
    server = None
    try:
        redis = factory()
        server = PgServer(redis, max_connections=150)
        server.worker_pid()
        with server.connect(transport="shared") as conn:
            assert conn.execute("SELECT rl_fixed_allow(%s, 5, 60000)",
                                (new_ident("warm"),)).fetchone()[0] is True
        yield server
    finally:
        if server is not None:
            server.remove()
        factory.cleanup()


@pytest.fixture
def on_private_server(private_server, monkeypatch):
    """Points pg_connect() (and so the pg fixture) at private_server for the
    test: `pytestmark = pytest.mark.usefixtures("on_private_server")`."""
    for name, value in private_server.env().items():
        monkeypatch.setenv(name, value)
    return private_server


@pytest.fixture
def unpreloaded_cluster():
    """Port of a throwaway PostgreSQL that does not preload rl_redis (the
    extension not created), pointed at the shared Redis; removed at teardown."""
    server = PgServer(preload=False, extension=False, max_connections=10)
    try:
        yield server.port
    finally:
        server.remove()


class _SharedRedis(RedisServer):
    """Handle for the Redis run_tests.sh started (never stopped from here)."""

    def __init__(self, port):
        self.dir = None
        self.password = None
        self.extra_args = []
        self.unix_socket = None
        self.port = port
        self.proc = None
        self.paused = False

    def start(self, *a, **k):
        raise RuntimeError("the shared Redis is not managed by the tests")

    stop = pause = resume = start


class RedisFactory:
    def __init__(self):
        base = os.environ.get("RL_DIR")
        if not base or not os.path.isdir(base):
            base = None
        self.base_dir = tempfile.mkdtemp(prefix="redis_fx_", dir=base)
        # the postgres OS user must be able to reach Unix sockets in here
        os.chmod(self.base_dir, 0o755)
        self.servers = []

    def __call__(self, unix_socket=False, password=None, extra_args=()):
        server = RedisServer(
            self.base_dir,
            "r%d" % len(self.servers),
            unix_socket=unix_socket,
            password=password,
            extra_args=extra_args,
        )
        self.servers.append(server)
        return server.start()

    def cleanup(self):
        for s in self.servers:
            try:
                if s.paused:
                    s.resume()
                s.stop()
            except Exception:  # keep killing the others
                pass
        shutil.rmtree(self.base_dir, ignore_errors=True)


@pytest.fixture
def redis_factory():
    """Call it to start one more redis-server: redis_factory(unix_socket=False,
    password=None, extra_args=()) -> RedisServer with .port, .stop(), .start(),
    .pause(), .resume(), .cli(*args). Every server is killed at teardown."""
    factory = RedisFactory()
    try:
        yield factory
    finally:
        factory.cleanup()


@pytest.fixture
def shared_redis_port():
    return int(os.environ["RL_REDIS_PORT"])


@pytest.fixture
def shared_redis(shared_redis_port):
    return _SharedRedis(shared_redis_port)


# ---------------------------------------------------------------- the README

ALGORITHMS = ("fixed", "sliding", "sliding_counter", "token_bucket", "gcra")


def readme():
    with open(os.path.join(os.path.dirname(__file__), "..", "README.md"), encoding="utf-8") as f:
        return f.read()


def readme_section(title):
    """The text of README.md's section of that title (## or ###)."""
    m = re.search(r"^#{2,3} %s\n(.*?)^##? " % re.escape(title), readme(), re.M | re.S)
    assert m, "README.md has no section %r" % title
    return m.group(1)


class Row:
    """A row of the README's privilege table: who, what they may, and the
    function names it gives (rl_<algorithm>... stands for the five)."""

    def __init__(self, who, may):
        self.who, self.may = who, may
        self.names = set()
        for token in re.findall(r"`(rl_[a-z_<>]+)`", may):
            if "<algorithm>" in token:
                self.names |= {token.replace("<algorithm>", a) for a in ALGORITHMS}
            else:
                self.names.add(token)
        self.public = "`PUBLIC`" in who
        self.open_after_lockdown = self.public and "after the lockdown" in who
        self.read_all_stats = "`pg_read_all_stats`" in who


def readme_privileges():
    """The rows of the privilege table of "Granting access" (a row with an
    empty "who" continues the one above)."""
    lines = readme_section("Granting access").splitlines()
    start = lines.index("| who | may |")
    rows, who = [], None
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        assert len(cells) == 2, line
        who = cells[0] or who
        rows.append(Row(who, cells[1]))
    assert rows, "the Granting access section has no privilege table"
    return rows
