"""Regression tests for the review of cluster and sentinel modes (commit
a469871 "Cluster/Sentinel review fixes"). One or more tests per finding:

  1. a hung sentinel first in rl_redis.nodes, a working one second: the call
     is decided by Redis within bounds, and the rechecks after it ask the
     sentinel that answered first (fast); the same with a first sentinel
     that answers an error
  2. every cluster seed hung: one slot-map fetch takes at most
     connect_timeout in all, and a failed fetch is not tried again before
     retry_interval
  3. sentinel mode, data nodes with requirepass: a call whose new connection
     meets a demoted master (AUTH accepted, ROLE says slave) is sent to the
     master the sentinels name next, in the same call (the handshake is not
     "the command was sent")
  4. MOVED <slot> :<port> (empty host) goes to <port> on the asking node's host
  5. Unix socket paths named by a cluster node (CLUSTER SLOTS, MOVED, ASK) or
     a sentinel are refused, never connected to
  6. CLUSTER SLOTS naming 2000 nodes is refused; the backend stays usable
     (also when the same seed then tells the truth)
  7. a statement guard split over slots with refund_on_abort = off: allowed
     then rolled back gives nothing back; a denial gives back the units of
     the slots decided before it, and only those (fixed, token_bucket, gcra)
  8. standalone mode: assigning rl_redis.nodes / sentinel_master /
     sentinel_password (unused there) inside a transaction keeps its refunds
  9. rl_redis.nodes parsing (IPv6 without brackets, blanks, stray ']')
 10. a transaction-end refund that gets TRYAGAIN (or CLUSTERDOWN, LOADING,
     MASTERDOWN, READONLY) is sent again intact with the session's next
     call (a fake node, byte for byte), and with a real half-migrated slot
     arrives once the migration is over; one that gets MOVED or ASK reaches
     the node named (after ASKING for ASK)

Fake servers (FakeServer: a Python RESP server answering what the test
scripts, or nothing at all) stand in for lying cluster nodes, sentinels and
hung servers; real redis-server processes hold the data. The tests that wait
for the sentinels' re-check or for a new fetch of the slot map shorten it
(rl_redis.sentinel_recheck_interval, rl_redis.slot_map_refresh_interval)
and wait the interval they set and a little more. About 20 s.
"""

import os
import shutil
import socket
import tempfile
import threading
import time
import uuid

import psycopg
import pytest
from psycopg import sql

from conftest import fixed_units, new_ident, rl_key, set_gucs
from redis_topology import (connections, made_policies, timed, ClusterNode, identity_slot, info_dict, key_slot,  # noqa: F401
                            redis_cluster, resp_pipeline, wait_for)

TEST_CLOCK_MS = 1800000000000  # a frozen clock on a whole minute (2027-01-15)
HUGE_WINDOW_MS = 10**12  # a fixed window that does not roll over before 2033
FIXED = "SELECT rl_fixed_allow(%s, 5, %s)"
PASSWORD = "review-pw-1618"
SENTINEL_RECHECK_MS = 100  # rl_redis.sentinel_recheck_interval where a test waits for it (production: 1 s)
SLOT_MAP_REFRESH_MS = 10  # rl_redis.slot_map_refresh_interval where a test waits for it (production: 100 ms)


def past_interval(ms):
    """Sleeps a little longer than the interval ms (the backend started it
    before its reply reached us)."""
    time.sleep(ms / 1000.0 + 0.05)


# ------------------------------------------------------------------- RESP


def r_bulk(s):
    b = s.encode() if isinstance(s, str) else s
    return b"$%d\r\n%s\r\n" % (len(b), b)


def r_int(n):
    return b":%d\r\n" % n


def r_arr(items):
    return b"*%d\r\n" % len(items) + b"".join(items)


def r_err(text):
    return b"-%s\r\n" % text.encode()


def slots_reply(entries):
    """A CLUSTER SLOTS reply: entries of (from, to, host, port)."""
    return r_arr([r_arr([r_int(f), r_int(t), r_arr([r_bulk(h), r_int(p), r_bulk("%040x" % (i + 1))])])
                  for i, (f, t, h, p) in enumerate(entries)])


def decision(allowed=1, lim=5, remaining=4):
    """A reply the one-decision scripts could give: 7 integers, packed as
    lua/common.lua packs them (little-endian signed 8-byte integers)."""
    return r_bulk(b"".join(v.to_bytes(8, "little", signed=True)
                           for v in (allowed, lim, remaining, 0, 0, 1, 0)))


class _TeeReader:
    """readline() and read(n) over a socket, keeping every byte received
    (raw) and how many were consumed."""

    def __init__(self, sock):
        self.sock = sock
        self.raw = bytearray()
        self.pos = 0

    @property
    def consumed(self):
        return self.pos

    def _fill(self):
        data = self.sock.recv(65536)
        self.raw.extend(data)
        return bool(data)

    def readline(self):
        while self.raw.find(b"\n", self.pos) < 0:
            if not self._fill():
                line, self.pos = bytes(self.raw[self.pos:]), len(self.raw)
                return line
        end = self.raw.find(b"\n", self.pos) + 1
        line, self.pos = bytes(self.raw[self.pos:end]), end
        return line

    def read(self, n):
        while len(self.raw) - self.pos < n:
            if not self._fill():
                break
        data = bytes(self.raw[self.pos:self.pos + n])
        self.pos += len(data)
        return data


class FakeServer:
    """A RESP server on 127.0.0.1 (or a Unix socket at unix_path) that
    answers each command with handler(server, args) (args: list of str; a
    None answer: that command is never answered). With no handler it
    accepts every connection and never answers anything (a hung server).
    Counts connections and records every command."""

    def __init__(self, handler=None, unix_path=None):
        self.handler = handler
        self.commands = []
        self.raw_commands = []  # the bytes of each command, as received
        self.connections = 0
        self.clients = []
        self.closed = False
        self.unix_path = unix_path
        if unix_path:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.bind(unix_path)
            os.chmod(unix_path, 0o777)  # the postgres user could connect
            self.port = None
            self.addr = unix_path
        else:
            self.sock = socket.socket()
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind(("127.0.0.1", 0))
            self.port = self.sock.getsockname()[1]
            self.addr = "127.0.0.1:%d" % self.port
        self.sock.listen(64)
        self.sock.settimeout(0.1)
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self):
        while not self.closed:
            try:
                c, _ = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            self.connections += 1
            self.clients.append(c)
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    @staticmethod
    def _read_command(f):
        line = f.readline()
        if not line:
            return None
        if not line.startswith(b"*"):
            return line.strip().decode("latin-1").split()
        args = []
        for _ in range(int(line[1:])):
            n = int(f.readline()[1:])
            args.append(f.read(n + 2)[:-2].decode("latin-1"))
        return args

    def _serve(self, c):
        c.settimeout(None)
        f = _TeeReader(c)
        try:
            while True:
                start = f.consumed
                args = self._read_command(f)
                if args is None:
                    return
                self.commands.append(args)
                self.raw_commands.append(bytes(f.raw[start:f.consumed]))
                if self.handler is None or not args:
                    continue
                reply = self.handler(self, args)
                if reply is not None:
                    c.sendall(reply)
        except (OSError, ValueError):
            pass

    def count(self, *words):
        """How many commands began with these words (case-insensitive)."""
        words = [w.upper() for w in words]
        return sum(1 for c in self.commands if [a.upper() for a in c[:len(words)]] == words)

    def close(self):
        self.closed = True
        self.sock.close()
        for c in self.clients:
            try:
                c.close()
            except OSError:
                pass
        if self.unix_path and os.path.exists(self.unix_path):
            os.unlink(self.unix_path)


def basic_reply(args):
    """What every fake node answers to the connection's own commands."""
    word = args[0].upper()
    if word == "PING":
        return b"+PONG\r\n"
    if word in ("AUTH", "SELECT", "CLIENT", "ASKING", "READONLY", "READWRITE"):
        return b"+OK\r\n"
    return r_err("ERR unknown command '%s'" % args[0])


def cluster_handler(slots, script):
    """A fake cluster node: CLUSTER SLOTS -> slots(server) (bytes), a script
    call (FCALL, EVAL, EVALSHA) -> script(server, args)."""
    def handle(server, args):
        word = args[0].upper()
        if word == "CLUSTER" and len(args) > 1 and args[1].upper() == "SLOTS":
            return slots(server)
        if word in ("FCALL", "FCALL_RO", "EVALSHA", "EVAL", "EVALSHA_RO", "EVAL_RO"):
            if len(args) < 4:  # not a script call with a key (a garbled command)
                return r_err("ERR wrong number of arguments for '%s' command" % args[0])
            return script(server, args)
        return basic_reply(args)
    return handle


class SentinelTarget:
    """What a fake sentinel names: host and port, changeable."""

    def __init__(self, port, host="127.0.0.1"):
        self.host, self.port = host, port


def sentinel_handler(target):
    def handle(server, args):
        if args[0].upper() == "SENTINEL" and len(args) == 3 and args[1].upper() == "GET-MASTER-ADDR-BY-NAME":
            return r_arr([r_bulk(target.host), r_bulk(str(target.port))])
        return basic_reply(args)
    return handle


@pytest.fixture
def fakes():
    """fakes(handler=None, unix_path=None) -> a FakeServer; closed at teardown."""
    made = []

    def make(handler=None, unix_path=None):
        s = FakeServer(handler, unix_path)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


@pytest.fixture
def sock_dir():
    """A folder the postgres user can reach, for Unix sockets."""
    base = os.environ.get("RL_DIR")
    d = tempfile.mkdtemp(prefix="rev_", dir=base if base and os.path.isdir(base) else None)
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


# ---------------------------------------------------------------- sessions


@pytest.fixture
def session():
    """session(**gucs): a new superuser connection with those settings
    (retry_interval 0 unless given); all closed at teardown."""
    def point(conn, **gucs):
        gucs.setdefault("retry_interval", 0)
        set_gucs(conn, **gucs)

    yield from connections(point)



def is_class_08(value):
    return isinstance(value, psycopg.Error) and (value.sqlstate or "").startswith("08")


def command_calls(server, name):
    """How many times a real redis-server ran command `name`."""
    stats = info_dict(server.command("INFO", "commandstats")).get("cmdstat_%s" % name.lower())
    return int(dict(p.split("=", 1) for p in stats.split(","))["calls"]) if stats else 0


def fixed_key(identity, lim=5):
    return rl_key("fixed", identity, lim=lim, window_ms=HUGE_WINDOW_MS)


@pytest.fixture(scope="module")
def solo_node():
    """A one-node Redis Cluster: one cluster-enabled redis-server that owns
    all 16384 slots (redis-cli --cluster create wants 3 masters)."""
    base = os.environ.get("RL_DIR")
    d = tempfile.mkdtemp(prefix="redis_solo_", dir=base if base and os.path.isdir(base) else None)
    os.chmod(d, 0o755)
    node = ClusterNode(d, "solo", 1000)
    try:
        node.start()
        node.node_id = node.command("CLUSTER", "MYID")
        node.command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
        wait_for(lambda: info_dict(node.command("CLUSTER", "INFO")).get("cluster_state") == "ok",
                 20, "the one-node cluster to be ok")
        yield node
    finally:
        node.stop()
        shutil.rmtree(d, ignore_errors=True)


# ------------------------------------------------ 1. a hung sentinel first


def test_hung_first_sentinel_then_a_working_one(session, fakes, redis_factory):
    """nodes = '<hung>,<working>' (the hung one accepts and never answers),
    connect_timeout 1000 (the sentinels share it: half each; with 500, a
    loaded machine once let the hung one's 250 ms run past the whole 500,
    and the working one was never asked), command_timeout 5000, on_error =
    error: the call is decided by Redis (the master's counter moves) within
    2.5 s, and so are
    the calls after the re-check interval (SENTINEL_RECHECK_MS), each under
    0.5 s: the sentinel that answered is asked first from then on, the hung
    one is never asked again."""
    master = redis_factory()
    hung = fakes()
    good = fakes(sentinel_handler(SentinelTarget(master.port)))
    conn = session(mode="sentinel", nodes="%s,%s" % (hung.addr, good.addr), sentinel_master="mymaster",
                   connect_timeout=1000, command_timeout=5000, on_error="error",
                   sentinel_recheck_interval=SENTINEL_RECHECK_MS)
    identity = new_ident("hungsent")
    value, elapsed = timed(conn, FIXED, (identity, HUGE_WINDOW_MS))
    assert value is True and elapsed < 2.5, (value, elapsed, hung.connections, good.count("SENTINEL"))
    assert fixed_units(master.command("GET", fixed_key(identity))) == "1"
    asked_good = good.count("SENTINEL")
    assert asked_good >= 1
    for i in range(2):
        past_interval(SENTINEL_RECHECK_MS)  # the sentinels are asked again
        value, elapsed = timed(conn, FIXED, (identity, HUGE_WINDOW_MS))
        assert value is True and elapsed < 0.5, (i, value, elapsed)
        assert fixed_units(master.command("GET", fixed_key(identity))) == str(2 + i)
    assert good.count("SENTINEL") >= asked_good + 2, "the re-checks did not ask the working sentinel"
    assert hung.connections <= 1, "the hung sentinel was asked again: %d connections" % hung.connections


def test_the_sentinel_that_answered_is_asked_first(session, fakes, redis_factory):
    """nodes = '<a sentinel that does not know the master>,<a working one>':
    the first call asks both; the re-checks after it (SENTINEL_RECHECK_MS
    apart) ask the working one first, and the other one never again."""
    master = redis_factory()
    unknowing = fakes(lambda s, args: r_err("ERR No such master with that name")
                      if args[0].upper() == "SENTINEL" else basic_reply(args))
    good = fakes(sentinel_handler(SentinelTarget(master.port)))
    conn = session(mode="sentinel", nodes="%s,%s" % (unknowing.addr, good.addr), sentinel_master="mymaster",
                   on_error="error", sentinel_recheck_interval=SENTINEL_RECHECK_MS)
    identity = new_ident("first")
    assert conn.execute(FIXED, (identity, HUGE_WINDOW_MS)).fetchone()[0] is True
    assert (unknowing.count("SENTINEL"), good.count("SENTINEL")) == (1, 1)
    for i in range(2):
        past_interval(SENTINEL_RECHECK_MS)
        assert conn.execute(FIXED, (identity, HUGE_WINDOW_MS)).fetchone()[0] is True
    assert good.count("SENTINEL") == 3
    assert unknowing.count("SENTINEL") == 1, "the sentinel that failed was asked first again"
    assert fixed_units(master.command("GET", fixed_key(identity))) == "3"


# ------------------------------------------------- 2. every cluster seed hung


@pytest.mark.parametrize("n_seeds", [1, 3])
def test_hung_cluster_seeds_bounded_and_not_retried(session, fakes, n_seeds):
    """Every seed accepts and never answers; connect_timeout 500,
    command_timeout 5000, on_error = deny, retry_interval 3000: the first
    call is denied within 2 s (one slot-map fetch takes connect_timeout in
    all, not command_timeout per seed), and the calls right after it are
    denied without asking a seed again: no seed gets another connection or
    command before retry_interval has passed, and each takes less than 1 s
    (a fetch would cost at least connect_timeout, 0.5 s, which a loaded
    machine's scheduling alone can come close to: the count decides)."""
    seeds = [fakes() for _ in range(n_seeds)]
    conn = session(mode="cluster", nodes=",".join(s.addr for s in seeds), connect_timeout=500,
                   command_timeout=5000, on_error="deny", retry_interval=3000)
    identity = new_ident("hungseed")
    t_first = time.monotonic()
    value, elapsed = timed(conn, FIXED, (identity, HUGE_WINDOW_MS))
    assert value is False and elapsed < 2.0, (value, elapsed)
    after_first = [(s.connections, len(s.commands)) for s in seeds]
    assert sum(c for c, _ in after_first) >= 1, after_first  # the fetch was tried
    times = []
    for _ in range(3):
        value, elapsed = timed(conn, FIXED, (new_ident("hungseed"), HUGE_WINDOW_MS))
        times.append(round(elapsed, 3))
        assert value is False, value
    within = time.monotonic() - t_first < 3.0
    now = [(s.connections, len(s.commands)) for s in seeds]
    if within:
        assert now == after_first, "calls within retry_interval asked the hung seeds again " \
            "(connections and commands per seed after the first call %r, now %r; %r s)" % (after_first, now, times)
    assert max(times) < 1.0, "calls within retry_interval waited for the hung seeds again: %r s " \
        "(connections and commands per seed after the first call %r, now %r)" % (times, after_first, now)


# ------------------------------------- 3. handshake is not "the call was sent"


def test_demoted_master_met_at_connect_is_skipped_in_the_same_call(session, fakes, redis_factory):
    """Data nodes with requirepass; a fake sentinel names A. After a first
    call on A, A becomes a replica of B (REPLICAOF), the sentinel names B and
    the session's connection to A is killed. The next call (within the 1 s
    re-check, so it goes to A first) reconnects to A: AUTH succeeds, ROLE
    says slave; nothing was sent, so the same call asks the sentinel again
    and is decided on B: allowed (on_error = error), B's counter is 1."""
    for attempt in range(3):
        a = redis_factory(password=PASSWORD)
        b = redis_factory(password=PASSWORD)
        target = SentinelTarget(a.port)
        sentinel = fakes(sentinel_handler(target))
        conn = session(mode="sentinel", nodes=sentinel.addr, sentinel_master="mymaster",
                       password=PASSWORD, on_error="error", command_timeout=3000)
        identity = new_ident("demoted")
        assert conn.execute(FIXED, (identity, HUGE_WINDOW_MS)).fetchone()[0] is True
        t_first = time.monotonic()
        assert fixed_units(a.command("GET", fixed_key(identity))) == "1"
        a.command("CONFIG", "SET", "masterauth", PASSWORD)
        a.command("REPLICAOF", "127.0.0.1", str(b.port))
        target.port = b.port
        assert a.command("ROLE")[0] == "slave"
        killed = a.command("CLIENT", "KILL", "TYPE", "normal")
        assert killed >= 1, "the session's connection to A was not found"
        roles = command_calls(a, "role")
        asked = sentinel.count("SENTINEL")
        value, elapsed = timed(conn, FIXED, (identity, HUGE_WINDOW_MS))
        met_a = command_calls(a, "role") > roles
        if not met_a and time.monotonic() - t_first > 0.9:
            continue  # the machine was too slow: the call asked the sentinel first; again
        assert met_a, "the call did not go to A first (ROLE calls on A: %d)" % command_calls(a, "role")
        assert value is True, "a call that met a demoted master at connect was not retried on the " \
            "new master: %r (%.2f s)" % (value, elapsed)
        assert sentinel.count("SENTINEL") == asked + 1
        assert fixed_units(b.command("GET", fixed_key(identity))) == "1"
        assert elapsed < 3.0, elapsed
        return
    pytest.fail("could not make the call reach A within the re-check interval in 3 attempts")


# ----------------------------------------------- 4. MOVED with an empty host


def test_moved_with_empty_host_goes_to_the_asking_nodes_host(session, fakes, solo_node):
    """A fake seed says it serves every slot and answers each script call
    with 'MOVED <slot> :<port>' (port: a real one-node cluster): the call
    goes to 127.0.0.1:<port> (the fake's host) and is decided there."""
    def script(server, args):
        return r_err("MOVED %d :%d" % (key_slot(args[3]), solo_node.port))

    seed = fakes(cluster_handler(lambda s: slots_reply([(0, 16383, "127.0.0.1", s.port)]), script))
    conn = session(mode="cluster", nodes=seed.addr, on_error="error")
    identity = new_ident("emptyhost")
    value, _ = timed(conn, FIXED, (identity, HUGE_WINDOW_MS))
    assert value is True, value
    assert fixed_units(solo_node.command("GET", fixed_key(identity))) == "1"
    assert seed.count("FCALL") + seed.count("EVAL") >= 1, "the fake seed was never asked"
    value, _ = timed(conn, FIXED, (identity, HUGE_WINDOW_MS))
    assert value is True, value
    assert fixed_units(solo_node.command("GET", fixed_key(identity))) == "2"


def test_one_node_cluster_as_its_own_seed(session, solo_node):
    """A lone cluster node may name itself with an empty host in CLUSTER
    SLOTS: that is the node asked."""
    conn = session(mode="cluster", nodes=solo_node.addr, on_error="error")
    identity = new_ident("solo")
    assert [conn.execute(FIXED, (identity, HUGE_WINDOW_MS)).fetchone()[0] for _ in range(6)] == \
        [True] * 5 + [False]
    assert fixed_units(solo_node.command("GET", fixed_key(identity))) == "5"


# ---------------------------------------------- 5. no Unix sockets from replies


@pytest.mark.parametrize("how", ["slots", "moved", "ask", "sentinel"])
def test_socket_paths_from_replies_are_refused(session, fakes, sock_dir, how):
    """A listening Unix socket (which would answer every call 'allowed') at
    <dir>/x.sock, and a lying server that names it: in CLUSTER SLOTS, in a
    MOVED or an ASK redirection, or as the master a sentinel names. The call
    gets an 08 error (on_error = error) and the deny decision (on_error =
    deny); nobody ever connects to the socket; the backend stays usable."""
    path = os.path.join(sock_dir, "x.sock")
    trap = fakes(lambda s, args: decision() if args[0].upper() in ("FCALL", "EVAL", "EVALSHA")
                 else basic_reply(args),
                 unix_path=path)
    if how == "sentinel":
        liar = fakes(sentinel_handler(SentinelTarget(1, host=path)))
        conn = session(mode="sentinel", nodes=liar.addr, sentinel_master="mymaster", on_error="error")
    else:
        if how == "slots":
            slots = (lambda s: slots_reply([(0, 16383, path, 1)]))
        else:
            slots = (lambda s: slots_reply([(0, 16383, "127.0.0.1", s.port)]))
        word = "MOVED" if how != "ask" else "ASK"

        def script(server, args):
            return r_err("%s %d %s:1" % (word, key_slot(args[3]), path))

        liar = fakes(cluster_handler(slots, script))
        conn = session(mode="cluster", nodes=liar.addr, on_error="error")
    pid = conn.info.backend_pid
    identity = new_ident("sock")
    value, _ = timed(conn, FIXED, (identity, HUGE_WINDOW_MS))
    assert is_class_08(value), value
    set_gucs(conn, on_error="deny")
    value, _ = timed(conn, FIXED, (identity, HUGE_WINDOW_MS))
    assert value is False, value
    assert len(liar.commands) > 0, "the liar was never asked"
    assert trap.connections == 0, "the backend connected to the Unix socket %s" % path
    assert conn.execute("SELECT pg_backend_pid()").fetchone()[0] == pid


# ---------------------------------------------------- 6. 2000 nodes in a map


def test_slot_map_with_2000_nodes_is_refused(session, fakes, solo_node):
    """A fake seed answers CLUSTER SLOTS with 2000 distinct nodes (8 slots
    each): refused (08 error with on_error = error, deny with deny), the
    backend stays up. When the same seed then tells the truth (every slot
    on a real one-node cluster), the same session decides there: nothing of
    the refused map was kept."""
    state = {"lie": True}

    def slots(server):
        if state["lie"]:
            return slots_reply([(i * 8, i * 8 + 7, "127.0.0.1", 20000 + i) for i in range(2000)])
        return slots_reply([(0, 16383, "127.0.0.1", solo_node.port)])

    seed = fakes(cluster_handler(slots, lambda s, a: r_err("MOVED %d 127.0.0.1:%d" % (key_slot(a[3]),
                                                                                      solo_node.port))))
    conn = session(mode="cluster", nodes=seed.addr, on_error="error",
                   slot_map_refresh_interval=SLOT_MAP_REFRESH_MS)
    pid = conn.info.backend_pid
    identity = new_ident("many")
    value, _ = timed(conn, FIXED, (identity, HUGE_WINDOW_MS))
    assert is_class_08(value), value
    set_gucs(conn, on_error="deny")
    past_interval(SLOT_MAP_REFRESH_MS)  # a failed fetch of the map is not tried again before
    value, _ = timed(conn, FIXED, (identity, HUGE_WINDOW_MS))
    assert value is False, value
    assert seed.count("CLUSTER", "SLOTS") >= 2
    assert conn.execute("SELECT pg_backend_pid()").fetchone()[0] == pid
    assert solo_node.command("EXISTS", fixed_key(identity)) == 0

    # the seed tells the truth now: the same session decides on the real node
    state["lie"] = False
    set_gucs(conn, on_error="error")
    past_interval(SLOT_MAP_REFRESH_MS)
    value, _ = timed(conn, FIXED, (identity, HUGE_WINDOW_MS))
    assert value is True, "after a refused 2000-node map, a truthful map was not taken: %r" % (value,)
    assert fixed_units(solo_node.command("GET", fixed_key(identity))) == "1"


def test_slot_map_with_2000_nodes_then_other_seeds(session, fakes, solo_node):
    """The same lie, then the session pointed at the real node: decides."""
    seed = fakes(cluster_handler(
        lambda s: slots_reply([(i * 8, i * 8 + 7, "127.0.0.1", 20000 + i) for i in range(2000)]),
        lambda s, a: decision()))
    conn = session(mode="cluster", nodes=seed.addr, on_error="error")
    identity = new_ident("many2")
    assert is_class_08(timed(conn, FIXED, (identity, HUGE_WINDOW_MS))[0])
    set_gucs(conn, nodes=solo_node.addr)
    assert conn.execute(FIXED, (identity, HUGE_WINDOW_MS)).fetchone()[0] is True
    assert fixed_units(solo_node.command("GET", fixed_key(identity))) == "1"


# ------------------------- 7. split statement guard, refund_on_abort = off


@pytest.fixture
def policies(pg):
    yield from made_policies(pg, "t_review")


@pytest.fixture
def guarded_table(pg):
    """guarded_table(policy) -> a new table (tenant text) with an AFTER
    INSERT statement guard on policy; dropped at teardown."""
    names = []

    def make(policy):
        name = "rl_review_%s" % uuid.uuid4().hex[:16]
        pg.execute(sql.SQL("CREATE TABLE {} (tenant text NOT NULL)").format(sql.Identifier(name)))
        names.append(name)
        pg.execute(sql.SQL("CREATE TRIGGER g AFTER INSERT ON {} REFERENCING NEW TABLE AS n FOR EACH "
                           "STATEMENT EXECUTE FUNCTION rl_guard_statement({}, 'tenant')").format(
            sql.Identifier(name), sql.Literal(policy)))
        return name

    yield make
    for n in names:
        pg.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(n)))


def remaining(conn, policy, identity):
    return conn.execute("SELECT (r).remaining FROM rl_check(%s, %s, 0) AS r", (policy, identity)).fetchone()[0]


def spread_tenants(cluster, tag, per_master=3):
    by_master = cluster.idents_on_each_master(new_ident(tag), per_master)
    assert len(by_master) == 3
    tenants = [i for ids in by_master.values() for i in ids]
    assert len({identity_slot(t) for t in tenants}) == len(tenants)
    return tenants


def victim_after(tenants, tag):
    """A fresh identity whose slot comes after every tenant's: it is decided
    last, after every tenant's slot was charged."""
    top = max(identity_slot(t) for t in tenants)
    assert top < 16383
    base, i = new_ident(tag), 0
    while True:
        v = "%s:%d" % (base, i)
        if identity_slot(v) > top:
            return v
        i += 1


@pytest.mark.parametrize("algorithm", ["fixed", "token_bucket", "gcra"])
def test_split_statement_guard_with_refund_off(session, policies, guarded_table, redis_cluster, algorithm):
    """refund_on_abort = off, a statement guard over 9 tenants on 3 masters
    (9 slots, decided one slot after another):
      a. the statement is allowed, the transaction rolls back: nothing is
         given back (also for a savepoint rolled back);
      b. the last slot denies (PT429): every unit taken in the slots before
         it is given back;
      c. both in one transaction (an allowed statement, then a denied one
         over the same tenants), rolled back: the allowed statement's units
         stay taken, the denied one's come back."""
    lim = 5
    policy = policies(algorithm, lim, 60000)
    table = guarded_table(policy)
    insert = "INSERT INTO %s (tenant) SELECT unnest(%%s::text[])" % table
    conn = session(mode="cluster", nodes=redis_cluster.nodes_arg(redis_cluster.masters()),
                   refund_on_abort="off", test_clock_ms=TEST_CLOCK_MS, on_error="error")

    # a. allowed, then rolled back
    tenants = spread_tenants(redis_cluster, "off_a")
    rows = tenants + tenants[:3]
    conn.execute("BEGIN")
    conn.execute(insert, (rows,))
    conn.execute("ROLLBACK")
    got = {t: remaining(conn, policy, t) for t in tenants}
    assert got == {t: lim - rows.count(t) for t in tenants}, \
        "an allowed split statement's units were given back by a rollback with refund_on_abort = off"
    tenants = spread_tenants(redis_cluster, "off_sp")
    conn.execute("BEGIN")
    conn.execute("SAVEPOINT s")
    conn.execute(insert, (tenants,))
    conn.execute("ROLLBACK TO SAVEPOINT s")
    conn.execute("COMMIT")
    assert {t: remaining(conn, policy, t) for t in tenants} == {t: lim - 1 for t in tenants}

    # b. the last slot denies: the earlier slots' units come back
    tenants = spread_tenants(redis_cluster, "off_b")
    victim = victim_after(tenants, "off_b_victim")
    assert conn.execute("SELECT rl_allow(%s, %s, %s)", (policy, victim, lim)).fetchone()[0] is True
    with pytest.raises(psycopg.Error) as exc:
        conn.execute(insert, (tenants + [victim],))
    assert exc.value.sqlstate == "PT429" and victim in str(exc.value), exc.value
    assert {t: remaining(conn, policy, t) for t in tenants} == {t: lim for t in tenants}
    assert remaining(conn, policy, victim) == 0

    # c. an allowed statement, then a denied one, in one transaction
    tenants = spread_tenants(redis_cluster, "off_c")
    victim = victim_after(tenants, "off_c_victim")
    assert conn.execute("SELECT rl_allow(%s, %s, %s)", (policy, victim, lim)).fetchone()[0] is True
    conn.execute("BEGIN")
    conn.execute(insert, (tenants,))
    with pytest.raises(psycopg.Error) as exc:
        conn.execute(insert, (tenants + [victim],))
    assert exc.value.sqlstate == "PT429", exc.value
    conn.execute("ROLLBACK")
    got = {t: remaining(conn, policy, t) for t in tenants}
    assert got == {t: lim - 1 for t in tenants}, \
        "expected the allowed statement's unit to stay taken and the denied one's to come back: %r" % got
    assert conn.execute("SELECT count(*) FROM %s" % table).fetchone()[0] == 0


# ------------------ 8. standalone: unused settings changed mid-transaction


@pytest.mark.parametrize("setting, value", [("nodes", "127.0.0.1:1"), ("sentinel_master", "elsewhere"),
                                            ("sentinel_password", "unused-pw")])
def test_standalone_keeps_refunds_when_unused_settings_change(session, redis_factory, setting, value):
    """Standalone mode (the default) on a Redis of its own (whose connection
    count no other test moves), refund_on_abort =
    all: BEGIN; charge 2; SET rl_redis.<setting> (a setting standalone mode
    does not use); charge 1 more; ROLLBACK: all 3 units come back, no
    WARNING, and the session's connection to Redis was never reopened."""
    r = redis_factory()
    conn = session(host="127.0.0.1", port=r.port, refund_on_abort="all", test_clock_ms=TEST_CLOCK_MS,
                   on_error="error")
    notices = []
    conn.add_notice_handler(lambda d: notices.append("%s: %s" % (d.severity, d.message_primary)))
    identity = new_ident("standalone")
    q = "SELECT (r).allowed, (r).remaining FROM rl_fixed(%s, 5, 60000, %s) AS r"
    assert conn.execute(q, (identity, 0)).fetchone() == (True, 5)  # the connection is open
    before = info_dict(r.command("INFO", "stats"))["total_connections_received"]
    conn.execute("BEGIN")
    assert conn.execute(q, (identity, 2)).fetchone() == (True, 3)
    conn.execute(sql.SQL("SET {} = {}").format(sql.Identifier("rl_redis", setting), sql.Literal(value)))
    assert conn.execute(q, (identity, 1)).fetchone() == (True, 2)
    conn.execute("ROLLBACK")
    after = info_dict(r.command("INFO", "stats"))["total_connections_received"]
    assert conn.execute(q, (identity, 0)).fetchone() == (True, 5), "the refund was lost"
    assert fixed_units(r.command("GET", rl_key("fixed", identity, lim=5, window_ms=60000))) in (None, "0")
    assert notices == [], notices
    # one connection: our own INFO (the session kept its connection)
    assert int(after) - int(before) == 1, (before, after)
    # also when nothing is called between the SET and the ROLLBACK
    conn.execute("BEGIN")
    assert conn.execute(q, (identity, 4)).fetchone() == (True, 1)
    conn.execute(sql.SQL("SET {} = {}").format(sql.Identifier("rl_redis", setting), sql.Literal(value)))
    conn.execute("ROLLBACK")
    assert conn.execute(q, (identity, 0)).fetchone() == (True, 5)
    assert notices == [], notices


# -------------------------------------------------- 9. rl_redis.nodes parsing


@pytest.mark.parametrize("value", ["::1:6379", "host name:1", "a]:1", "h\t:1", "[::1:6379", "::1]:6379",
                                   "127.0.0.1:1,::1:2", "a,b:1"])
def test_nodes_refused(pg, value):
    pg.execute("SET rl_redis.nodes = '127.0.0.1:7000'")
    with pytest.raises(psycopg.Error) as exc:
        pg.execute(sql.SQL("SET rl_redis.nodes = {}").format(sql.Literal(value)))
    assert exc.value.sqlstate == "22023", (value, exc.value)
    assert pg.execute("SHOW rl_redis.nodes").fetchone()[0] == "127.0.0.1:7000"


@pytest.mark.parametrize("value", ["[::1]:6379", " 127.0.0.1:1 , 127.0.0.1:2", "[::1]:1,127.0.0.1:2",
                                   "localhost:6379"])
def test_nodes_accepted(pg, value):
    pg.execute(sql.SQL("SET rl_redis.nodes = {}").format(sql.Literal(value)))
    assert pg.execute("SHOW rl_redis.nodes").fetchone()[0] == value


# ----------------------------------- 10. TRYAGAIN of a queued refund


QUEUED_CHECK = "SELECT (r).allowed, (r).remaining FROM rl_check(%s, %s, %s) AS r"


def roll_back_two_charges(session, policies, node):
    """A session in cluster mode seeded by the fake node (refund_on_abort
    all) charges two fixed-window policies for one identity in a
    transaction (both allowed) and rolls it back, which queues one refund
    call with both keys. Returns the session, the notices it gets and the
    first policy."""
    p1, p2 = policies("fixed", 5, 60000), policies("fixed", 5, 60000)
    conn = session(mode="cluster", nodes=node.addr, refund_on_abort="all", test_clock_ms=TEST_CLOCK_MS,
                   on_error="error", command_timeout=2000)
    notices = []
    conn.add_notice_handler(lambda d: notices.append("%s: %s" % (d.severity, d.message_primary)))
    identity = new_ident("queued_fake")
    conn.execute("BEGIN")
    assert conn.execute(QUEUED_CHECK, (p1, identity, 2)).fetchone() == (True, 4)
    assert conn.execute(QUEUED_CHECK, (p2, identity, 3)).fetchone() == (True, 4)
    conn.execute("ROLLBACK")
    return conn, notices, p1


# The error replies that say Redis did not run a command, as a node that
# moves a slot, fails over, restarts or is a replica now gives them; the
# last is how Redis 6 and older report a script that wrote on a replica.
NOT_RUN_ERRORS = [
    "TRYAGAIN Multiple keys request during rehashing of slot",
    "CLUSTERDOWN The cluster is down",
    "LOADING Redis is loading the dataset in memory",
    "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
    "READONLY You can't write against a read only replica.",
    "ERR Error running script (call to f_0123): @user_script:1: @user_script: 1: "
    "-READONLY You can't write against a read only replica.",
]


@pytest.mark.parametrize("error", NOT_RUN_ERRORS, ids=lambda e: e.split()[0] if e[0] != "E" else "wrapped-READONLY")
def test_queued_refund_told_tryagain_is_sent_again_intact(session, policies, fakes, error):
    """A fake cluster node that serves every slot, decides every script call
    'allowed' and answers the first transaction-end refund (EVAL of the
    refund script) with an error that says it was not run (TRYAGAIN,
    CLUSTERDOWN, LOADING, MASTERDOWN, READONLY, also inside a script's
    error): the refund waits in the queue and goes, byte for byte the same,
    with the session's next call, which is decided normally (its reply is
    its own), with no warning."""
    evals = []

    def script(server, args):
        if args[0].upper() == "EVAL":
            evals.append(args)
            if len(evals) == 1:
                return r_err(error)
            return r_int(int(args[2]))  # the refund script returns #KEYS
        return decision(1, 5, 4)

    node = fakes(cluster_handler(lambda s: slots_reply([(0, 16383, "127.0.0.1", s.port)]), script))
    conn, notices, p1 = roll_back_two_charges(session, policies, node)
    assert len(evals) == 1, "the rollback sent %d refund calls" % len(evals)
    first = node.commands.index(evals[0])
    assert evals[0][2] == "2"  # one call, both keys
    value, elapsed = timed(conn, QUEUED_CHECK, (p1, new_ident("tryagain_fake_next"), 1))
    after = node.raw_commands[first + 1:]
    assert value is True and elapsed < 1.5, \
        "the next call: %r after %.2f s; bytes the node got after the refund: %r" % (
            value, elapsed, [c[:60] for c in after][:6])
    assert len(evals) == 2, "the refund was not sent again intact; bytes after the first: %r" % (
        [c[:60] for c in after][:6],)
    assert node.raw_commands[node.commands.index(evals[1], first + 1)] == node.raw_commands[first]
    assert notices == [], notices


@pytest.mark.parametrize("word", ["MOVED", "ASK"])
def test_queued_refund_redirected_goes_to_the_node_named(session, policies, fakes, word):
    """A fake cluster node A that serves every slot answers the first
    transaction-end refund with a redirection (MOVED or ASK) to another
    fake node B: the refund moves to B's queue and reaches B, byte for byte
    the same, by the session's next call at the latest (after ASKING for
    ASK, never after MOVED); A gets it once, the next call is decided
    normally on A, and there is no warning."""
    a_evals, b_evals = [], []

    def on_b(server, args):
        if args[0].upper() == "EVAL":
            b_evals.append(args)
            return r_int(int(args[2]))  # the refund script returns #KEYS
        return decision(1, 5, 4)

    b = fakes(cluster_handler(lambda s: slots_reply([(0, 16383, "127.0.0.1", a.port)]), on_b))

    def on_a(server, args):
        if args[0].upper() == "EVAL":
            a_evals.append(args)
            return r_err("%s %d 127.0.0.1:%d" % (word, key_slot(args[3]), b.port))
        return decision(1, 5, 4)

    a = fakes(cluster_handler(lambda s: slots_reply([(0, 16383, "127.0.0.1", s.port)]), on_a))
    conn, notices, p1 = roll_back_two_charges(session, policies, a)
    assert len(a_evals) == 1, "the rollback sent %d refund calls to A" % len(a_evals)
    value, elapsed = timed(conn, QUEUED_CHECK, (p1, new_ident("redirect_fake_next"), 1))
    assert value is True and elapsed < 1.5, (value, elapsed)
    assert len(a_evals) == 1 and len(b_evals) == 1, (len(a_evals), len(b_evals), b.commands)
    at_b = b.commands.index(b_evals[0])
    assert b.raw_commands[at_b] == a.raw_commands[a.commands.index(a_evals[0])]
    assert (b.commands[at_b - 1] == ["ASKING"]) == (word == "ASK"), b.commands
    assert b.count("ASKING") == (1 if word == "ASK" else 0), b.commands
    assert notices == [], notices


def test_queued_redirections_to_ever_new_nodes_keep_the_connections_bounded(session, fakes):
    """A lying cluster node that serves every slot answers every
    transaction-end refund with MOVED to a node never named before (a new
    loopback address each time, where nothing listens). Each redirection
    used to add a connection to the session's cache, for the session's
    life: 1 400 refunds left 1 400 of them. The cache now stops at
    RL_MAX_CONNECTIONS (1 280); a refund sent further is dropped with its
    warning, and the session goes on deciding."""
    max_connections = 1024 + 2 * 64 + 128
    rounds = max_connections + 120
    evals = []

    def script(server, args):
        if args[0].upper() == "EVAL":
            n = len(evals)
            evals.append(n)
            return r_err("MOVED %d 127.0.%d.%d:9" % (key_slot(args[3]), 1 + n // 250, 2 + n % 250))
        if args[1].endswith("_run_many"):  # a batch: one decision per key
            return r_arr([decision(1, 5, 4)] * int(args[2]))
        return decision(1, 5, 4)

    node = fakes(cluster_handler(lambda s: slots_reply([(0, 16383, "127.0.0.1", s.port)]), script))
    conn = session(mode="cluster", nodes=node.addr, refund_on_abort="all", test_clock_ms=TEST_CLOCK_MS,
                   on_error="error", command_timeout=2000, connect_timeout=1000)
    conn.execute("SET client_min_messages = error")
    # 20 identities of 20 hash slots: each rollback sends 20 refund calls
    identities, slots = [], set()
    while len(identities) < 20:
        identity = new_ident("ever_new_nodes")
        if identity_slot(identity) not in slots:
            slots.add(identity_slot(identity))
            identities.append(identity)
    batch = "SELECT count(*) FILTER (WHERE allowed) FROM rl_fixed_many(%s, 5, %s)"
    while len(evals) < rounds:
        conn.execute("BEGIN")
        assert conn.execute(batch, (identities, HUGE_WINDOW_MS)).fetchone()[0] == 20
        conn.execute("ROLLBACK")
    assert conn.execute(FIXED, (identities[0], HUGE_WINDOW_MS)).fetchone()[0] is True
    cached = conn.execute("SELECT count(*) FROM rl_redis_connections()").fetchone()[0]
    assert cached <= max_connections, (cached, len(evals))


def test_refund_that_gets_tryagain_arrives_after_the_migration(session, policies, redis_cluster):
    """Two fixed-window keys of one identity (one slot) charged in a
    transaction with refund_on_abort = all; the slot is half migrated (one
    key moved): the ROLLBACK's refund (one script call with both keys) gets
    TRYAGAIN. Once the migration is over, the session's next call brings
    the refund to the new master: both keys back to 0, no warning, and the
    session's later decisions are right (its replies are in step)."""
    lim = 5
    p1, p2 = policies("fixed", lim, 60000), policies("fixed", lim, 60000)
    identity = new_ident("tryagain")
    slot = identity_slot(identity)
    src = redis_cluster.master_of_slot(slot)
    dst = next(m for m in redis_cluster.masters() if m is not src)
    conn = session(mode="cluster", nodes=redis_cluster.nodes_arg(redis_cluster.masters()),
                   refund_on_abort="all", test_clock_ms=TEST_CLOCK_MS, on_error="error", command_timeout=3000)
    notices = []
    conn.add_notice_handler(lambda d: notices.append("%s: %s" % (d.severity, d.message_primary)))
    k1, k2 = (rl_key("fixed", identity, p, lim, 60000) for p in (p1, p2))
    check = "SELECT (r).allowed, (r).remaining FROM rl_check(%s, %s, %s) AS r"

    conn.execute("BEGIN")
    assert conn.execute(check, (p1, identity, 2)).fetchone() == (True, 3)
    assert conn.execute(check, (p2, identity, 3)).fetchone() == (True, 2)
    tryagain = src.error_count("TRYAGAIN") + dst.error_count("TRYAGAIN")
    dst.command("CLUSTER", "SETSLOT", slot, "IMPORTING", src.node_id)
    src.command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst.node_id)
    try:
        src.command("MIGRATE", "127.0.0.1", dst.port, "", 0, 5000, "KEYS", k1)
        conn.execute("ROLLBACK")
        got_tryagain = src.error_count("TRYAGAIN") + dst.error_count("TRYAGAIN") - tryagain
        assert got_tryagain >= 1, "the refund did not meet TRYAGAIN (the scenario did not happen)"
        # not given back yet (dst imports the slot: ASKING to read there)
        assert fixed_units(resp_pipeline(dst.port, [["ASKING"], ["GET", k1]])[1]) == "2"
        assert fixed_units(src.command("GET", k2)) == "3"
    finally:
        # finish the migration
        for key in src.command("CLUSTER", "GETKEYSINSLOT", slot, 100) or []:
            src.command("MIGRATE", "127.0.0.1", dst.port, "", 0, 5000, "KEYS", key)
        for m in [dst, src] + [m for m in redis_cluster.masters() if m not in (src, dst)]:
            m.command("CLUSTER", "SETSLOT", slot, "NODE", dst.node_id)
        wait_for(lambda: redis_cluster.healthy() and redis_cluster.master_of_slot(slot) is dst, 30,
                 "the slot to be on its new master everywhere")
    # the session's next call (on an identity of a third master, so that the
    # refund must reach a node the call itself does not use) brings the refund
    other = new_ident("tryagain_other")
    while redis_cluster.master_of_slot(identity_slot(other)) in (src, dst):
        other = new_ident("tryagain_other")
    t0 = time.monotonic()
    try:
        value = conn.execute(check, (p1, other, 1)).fetchone()
    except psycopg.Error as e:
        value = e
    elapsed = time.monotonic() - t0
    stuck = [line for line in src.command("CLIENT", "LIST").splitlines()
             if " flags=N " in line and " qbuf=0 " not in line and "cmd=client|list" not in line]
    assert value == (True, 4), "the next call: %r after %.2f s; clients of the old master with a " \
        "half-read query: %r" % (value, elapsed, stuck)
    got = (fixed_units(dst.command("GET", k1)), fixed_units(dst.command("GET", k2)))
    assert got in {(None, None), ("0", "0")}, "the refund did not arrive: n = %r on the new master; notices %r" % (got, notices)
    assert [conn.execute(check, (p, identity, 0)).fetchone() for p in (p1, p2)] == [(True, lim)] * 2
    # in step: a sequence of decisions with known answers
    fresh = new_ident("tryagain_fresh")
    assert [conn.execute(check, (p2, fresh, 2)).fetchone() for _ in range(3)] == \
        [(True, 3), (True, 1), (False, 1)]
    assert conn.execute(check, (p1, other, 1)).fetchone() == (True, 3)
    assert notices == [], notices
