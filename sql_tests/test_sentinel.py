"""rl_redis.mode = 'sentinel' against a real master, its replica and three
sentinels (redis_topology.py): decisions go to the master the sentinels
name; SENTINEL FAILOVER and a SIGKILLed master under load; sentinels that
are dead or hung, an empty or unknown master name, a "sentinel" that names
a replica (the ROLE check), a call lost after it was sent (never sent
twice), and passwords (rl_redis.sentinel_password for the sentinels,
rl_redis.password for the data nodes).

Sessions are superuser sessions with SET rl_redis.mode = 'sentinel',
rl_redis.nodes = '<the sentinels>', rl_redis.sentinel_master = 'mymaster'
(retry_interval 0: no circuit breaker). The failover tests get their own
master, replica and sentinels. About 45 s in all.
"""

import socket
import threading
import time

import psycopg
import pytest

from conftest import fixed_units, Hammer, free_port, new_ident, rl_key, set_gucs
from test_fault_matrix import Blackhole
from test_reports import HINT_PASSWORD
from redis_topology import (connections, backend_identity, timed, MASTER_NAME, RedisSentinelFixture, fresh_redis_sentinel,  # noqa: F401
                            redis_sentinel, resp_pipeline, wait_for)

HUGE_WINDOW_MS = 10**12  # a fixed window that does not roll over before 2033
BIG_LIM = 1000000
SENTINEL_RECHECK_MS = 100  # rl_redis.sentinel_recheck_interval of the failover test (production: 1 s)
RESUME_MARGIN_S = 4.0  # how much later than the re-check interval decisions reach the new master


def resume_bound(recheck_ms=1000):
    """Seconds after the sentinels switched (or promoted the replica) from
    which every decision is on the new master, for sessions that ask the
    sentinels again every recheck_ms."""
    return recheck_ms / 1000.0 + RESUME_MARGIN_S


RESUME_BOUND_S = resume_bound()  # for sessions with the production re-check interval
HINT_SENTINEL_PASSWORD = "Set rl_redis.sentinel_password to the password the sentinels expect."


# ---------------------------------------------------------------- helpers


def point_at_sentinels(conn, topo, sentinels=None, **gucs):
    gucs.setdefault("retry_interval", 0)
    gucs.setdefault("sentinel_master", MASTER_NAME)
    nodes = sentinels if isinstance(sentinels, str) else topo.sentinels_arg(sentinels)
    set_gucs(conn, mode="sentinel", nodes=nodes)
    set_gucs(conn, **gucs)


@pytest.fixture
def sessions():
    """sessions(topo, sentinels=None, **gucs): a new superuser connection in
    sentinel mode; all closed at teardown."""
    yield from connections(point_at_sentinels)


FIXED = "SELECT rl_fixed_allow(%s, %s, %s)"


def fixed_key(identity, lim):
    return rl_key("fixed", identity, lim=lim, window_ms=HUGE_WINDOW_MS)




def script_calls(node):
    """EVAL/EVALSHA/FCALL calls a data node saw (run, rejected or failed)."""
    total = 0
    for line in node.command("INFO", "commandstats").splitlines():
        if line.split(":")[0] in ("cmdstat_eval", "cmdstat_evalsha", "cmdstat_eval_ro",
                                  "cmdstat_evalsha_ro", "cmdstat_fcall", "cmdstat_fcall_ro"):
            fields = dict(p.split("=", 1) for p in line.split(":", 1)[1].split(","))
            total += int(fields["calls"]) + int(fields.get("rejected_calls", 0)) + \
                int(fields.get("failed_calls", 0))
    return total


def command_calls(node, name):
    for line in node.command("INFO", "commandstats").splitlines():
        if line.startswith("cmdstat_%s:" % name):
            return int(dict(p.split("=", 1) for p in line.split(":", 1)[1].split(","))["calls"])
    return 0


class FakeSentinel:
    """A TCP server that answers like a sentinel, naming (host, port) as the
    master of every name; PING, AUTH (checked against password when given),
    CLIENT and SELECT answer OK, anything else an error. Records every
    command it got."""

    def __init__(self, master_port, password=None):
        self.master_port = master_port
        self.password = password
        self.commands = []
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.addr = "127.0.0.1:%d" % self.port
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.closed:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    @staticmethod
    def _read_command(f):
        line = f.readline()
        if not line:
            return None
        if not line.startswith(b"*"):
            return line.strip().decode(errors="replace").split()
        args = []
        for _ in range(int(line[1:])):
            n = int(f.readline()[1:])
            args.append(f.read(n + 2)[:-2].decode(errors="replace"))
        return args

    def _serve(self, c):
        f = c.makefile("rb")
        authed = self.password is None
        try:
            while True:
                cmd = self._read_command(f)
                if cmd is None:
                    return
                self.commands.append(cmd)
                name = cmd[0].upper()
                if name == "AUTH":
                    if cmd[-1] == self.password:
                        authed = True
                        c.sendall(b"+OK\r\n")
                    else:
                        c.sendall(b"-WRONGPASS invalid username-password pair or user is disabled.\r\n")
                elif not authed:
                    c.sendall(b"-NOAUTH Authentication required.\r\n")
                elif name == "PING":
                    c.sendall(b"+PONG\r\n")
                elif name in ("CLIENT", "SELECT"):
                    c.sendall(b"+OK\r\n")
                elif name == "SENTINEL" and len(cmd) == 3 and cmd[1].upper() == "GET-MASTER-ADDR-BY-NAME":
                    port = str(self.master_port).encode()
                    c.sendall(b"*2\r\n$9\r\n127.0.0.1\r\n$%d\r\n%s\r\n" % (len(port), port))
                else:
                    c.sendall(b"-ERR unknown command\r\n")
        except OSError:
            pass
        finally:
            c.close()

    def close(self):
        self.closed = True
        self.sock.close()


# ------------------------------------------------------------ decisions


def test_decisions_go_to_the_master(sessions, redis_sentinel):
    topo = redis_sentinel
    master = topo.current_master()
    replica = topo.other_data_node(master)
    conn = sessions(topo)
    identity = new_ident("sent")
    assert [conn.execute(FIXED, (identity, 3, HUGE_WINDOW_MS)).fetchone()[0] for _ in range(4)] == \
        [True, True, True, False]
    row = conn.execute("SELECT (r).allowed, (r).remaining FROM rl_sliding(%s, 2, 600000) AS r",
                       (identity,)).fetchone()
    assert row == (True, 1)
    assert fixed_units(master.command("GET", fixed_key(identity, 3))) == "3"
    assert master.command("WAIT", 1, 2000) == 1
    assert fixed_units(replica.command("GET", fixed_key(identity, 3))) == "3"
    server, rtt = conn.execute("SELECT server, rtt_ms FROM rl_redis_ping()").fetchone()
    assert server == "127.0.0.1:%d" % master.port
    assert rtt >= 0


def test_sentinels_are_asked_in_order(sessions, redis_sentinel):
    """A dead first sentinel (nothing listens) is skipped."""
    topo = redis_sentinel
    dead = "127.0.0.1:%d" % free_port()
    conn = sessions(topo, "%s,%s" % (dead, topo.sentinels_arg()))
    identity = new_ident("order")
    value, elapsed = timed(conn, FIXED, (identity, 2, HUGE_WINDOW_MS))
    assert value is True and elapsed < 2.0, (value, elapsed)
    assert fixed_units(topo.current_master().command("GET", fixed_key(identity, 2))) == "1"
    # only the last sentinel is alive
    conn2 = sessions(topo, "%s,%s" % (dead, topo.sentinels[2].addr))
    assert conn2.execute(FIXED, (identity, 2, HUGE_WINDOW_MS)).fetchone()[0] is True
    assert conn2.execute(FIXED, (identity, 2, HUGE_WINDOW_MS)).fetchone()[0] is False


@pytest.fixture
def blackholes():
    """blackholes(n): n addresses whose connects hang (SYNs dropped, see
    test_fault_matrix.Blackhole); closed at teardown."""
    made = []

    def make(n):
        out = []
        for _ in range(n):
            bh = Blackhole()
            made.append(bh)
            if not bh.fill():
                pytest.skip("could not make a connect hang on 127.0.0.1 (the kernel does not drop "
                            "SYNs on a full accept queue here)")
            out.append("127.0.0.1:%d" % bh.port)
        return ",".join(out)

    yield make
    for bh in made:
        bh.close()


@pytest.mark.parametrize("kind", ["refused", "blackholed"])
@pytest.mark.parametrize("on_error", ["error", "allow", "deny"])
def test_dead_sentinels_apply_on_error(sessions, blackholes, redis_sentinel, kind, on_error):
    """Two dead sentinels: nothing listens (refused), or the address never
    answers (SYNs dropped): on_error decides, within the connect_timeout
    (500 ms) of each plus slack; the session stays usable."""
    if kind == "refused":
        nodes = "127.0.0.1:%d,127.0.0.1:%d" % (free_port(), free_port())
        bound = 1.0
    else:
        nodes = blackholes(2)
        bound = 2 * 0.5 + 1.5
    conn = sessions(redis_sentinel, nodes, on_error=on_error, connect_timeout=500)
    identity = new_ident("dead")
    for _ in range(2):
        value, elapsed = timed(conn, FIXED, (identity, 5, HUGE_WINDOW_MS))
        if on_error == "error":
            assert isinstance(value, psycopg.Error) and value.sqlstate.startswith("08"), value
        else:
            assert value is (on_error == "allow"), value
        assert elapsed < bound, elapsed
    assert conn.execute("SELECT 1").fetchone()[0] == 1
    # pointed at the real sentinels, the same session decides again
    set_gucs(conn, nodes=redis_sentinel.sentinels_arg())
    assert conn.execute(FIXED, (identity, 5, HUGE_WINDOW_MS)).fetchone()[0] is True
    assert fixed_units(redis_sentinel.current_master().command("GET", fixed_key(identity, 5))) == "1"


@pytest.mark.parametrize("on_error", ["error", "deny"])
def test_hung_sentinels_apply_on_error(sessions, redis_factory, redis_sentinel, on_error):
    """Two hung sentinels (SIGSTOP: the connection is accepted, nothing
    answers): asking them is part of connecting, so on_error decides within
    connect_timeout bounds (500 ms each, plus slack), not after the much
    longer command_timeout (5 s) of the data nodes' commands."""
    hung = [redis_factory(), redis_factory()]
    for h in hung:
        h.pause()
    nodes = ",".join("127.0.0.1:%d" % h.port for h in hung)
    conn = sessions(redis_sentinel, nodes, on_error=on_error, connect_timeout=500, command_timeout=5000)
    identity = new_ident("hung")
    value, elapsed = timed(conn, FIXED, (identity, 5, HUGE_WINDOW_MS))
    if on_error == "error":
        assert isinstance(value, psycopg.Error) and value.sqlstate.startswith("08"), value
    else:
        assert value is False, value
    assert elapsed < 2 * 0.5 + 1.5, elapsed
    set_gucs(conn, nodes=redis_sentinel.sentinels_arg())
    assert conn.execute(FIXED, (identity, 5, HUGE_WINDOW_MS)).fetchone()[0] is True


@pytest.mark.parametrize("master_name", ["", "nosuchmaster"])
def test_empty_or_unknown_master_name(sessions, redis_sentinel, master_name):
    topo = redis_sentinel
    conn = sessions(topo, sentinel_master=master_name, on_error="error")
    identity = new_ident("nomaster")
    value, elapsed = timed(conn, FIXED, (identity, 5, HUGE_WINDOW_MS))
    assert isinstance(value, psycopg.Error) and value.sqlstate.startswith("08"), value
    assert elapsed < 3.0
    value, _ = timed(conn, "SELECT server FROM rl_redis_ping()")
    assert isinstance(value, psycopg.Error) and value.sqlstate.startswith("08"), value
    set_gucs(conn, on_error="allow")
    assert conn.execute(FIXED, (identity, 5, HUGE_WINDOW_MS)).fetchone()[0] is True
    set_gucs(conn, on_error="deny")
    assert conn.execute(FIXED, (identity, 5, HUGE_WINDOW_MS)).fetchone()[0] is False
    # nothing was written anywhere
    for node in topo.data:
        assert node.command("EXISTS", fixed_key(identity, 5)) == 0
    set_gucs(conn, sentinel_master=MASTER_NAME, on_error="error")
    assert conn.execute(FIXED, (identity, 5, HUGE_WINDOW_MS)).fetchone()[0] is True


def test_role_is_checked_before_any_command(sessions, redis_sentinel):
    """A sentinel that names the replica: the connection's ROLE check fails,
    so the call fails per on_error and no script reaches the replica."""
    topo = redis_sentinel
    replica = topo.other_data_node(topo.current_master())
    fake = FakeSentinel(replica.port)
    try:
        conn = sessions(topo, fake.addr, on_error="error")
        identity = new_ident("role")
        scripts, roles = script_calls(replica), command_calls(replica, "role")
        value, elapsed = timed(conn, FIXED, (identity, 5, HUGE_WINDOW_MS))
        assert isinstance(value, psycopg.Error) and value.sqlstate.startswith("08"), value
        assert elapsed < 3.0
        set_gucs(conn, on_error="deny")
        assert conn.execute(FIXED, (identity, 5, HUGE_WINDOW_MS)).fetchone()[0] is False
        assert script_calls(replica) == scripts
        assert command_calls(replica, "role") > roles
        asked = [c for c in fake.commands if c[0].upper() == "SENTINEL"]
        assert asked and all(c[1].upper() == "GET-MASTER-ADDR-BY-NAME" and c[2] == MASTER_NAME for c in asked)
    finally:
        fake.close()


def test_sentinel_and_node_passwords(sessions):
    """Sentinels with their own requirepass and data nodes with another:
    rl_redis.sentinel_password goes to the sentinels, rl_redis.password to
    the master; neither appears in an error, whose hint names the setting
    of the password that was refused."""
    topo = RedisSentinelFixture(password="data-pw-3141", sentinel_password="sentinel-pw-2718")
    try:
        topo.start()
        master = topo.current_master()
        identity = new_ident("pw")
        conn = sessions(topo, on_error="error", password="data-pw-3141", sentinel_password="sentinel-pw-2718")
        assert conn.execute(FIXED, (identity, 5, HUGE_WINDOW_MS)).fetchone()[0] is True
        assert fixed_units(master.command("GET", fixed_key(identity, 5))) == "1"
        for gucs in ({"sentinel_password": ""}, {"sentinel_password": "wrong-sentinel-pw"},
                     {"password": "wrong-data-pw"}, {"password": ""}):
            other = sessions(topo, on_error="error", password="data-pw-3141",
                             sentinel_password="sentinel-pw-2718")
            set_gucs(other, **gucs)
            value, _ = timed(other, FIXED, (identity, 5, HUGE_WINDOW_MS))
            assert isinstance(value, psycopg.Error) and value.sqlstate.startswith("08"), (gucs, value)
            # the hint names the password of the servers that refused it
            assert value.diag.message_hint == (HINT_SENTINEL_PASSWORD if "sentinel_password" in gucs
                                               else HINT_PASSWORD), (gucs, value.diag.message_hint)
            for secret in ("data-pw-3141", "sentinel-pw-2718", "wrong-sentinel-pw", "wrong-data-pw"):
                assert secret not in str(value)
        assert fixed_units(master.command("GET", fixed_key(identity, 5))) == "1"
    finally:
        topo.cleanup()


def test_call_lost_after_sending_is_not_sent_again(pg, sessions, redis_sentinel):
    """A call written to the master whose connection is lost before the
    reply (CLIENT KILL while writes are paused, so Redis never ran it):
    class 08 at once (on_error = error), not sent again after asking the
    sentinels (a second try would wait out the pause and succeed)."""
    topo = redis_sentinel
    master = topo.current_master()
    conn = sessions(topo, on_error="error", command_timeout=8000)
    identity = new_ident("lost")
    assert conn.execute(FIXED, (identity, 5, HUGE_WINDOW_MS)).fetchone()[0] is True
    pid = conn.info.backend_pid
    out = {}

    def victim():
        out["value"], out["elapsed"] = timed(conn, FIXED, (identity, 5, HUGE_WINDOW_MS))

    master.command("CLIENT", "PAUSE", 4000, "WRITE")
    try:
        t = threading.Thread(target=victim, daemon=True)
        t.start()
        wait_for(lambda: pg.execute("SELECT state FROM pg_stat_activity WHERE pid = %s", (pid,)
                                    ).fetchone()[0] == "active", 10, "the call to start", 0.01)
        time.sleep(0.3)
        killed = 0
        for line in master.command("CLIENT", "LIST").splitlines():
            f = dict(p.split("=", 1) for p in line.split() if "=" in p)
            if f.get("cmd") in ("evalsha", "eval", "fcall"):
                master.command("CLIENT", "KILL", "ID", f["id"])
                killed += 1
        assert killed >= 1
        t.join(timeout=10)
        assert not t.is_alive()
    finally:
        master.command("CLIENT", "UNPAUSE")
    value = out["value"]
    assert isinstance(value, psycopg.Error) and value.sqlstate.startswith("08"), value
    assert out["elapsed"] < 2.5, out["elapsed"]
    assert fixed_units(master.command("GET", fixed_key(identity, 5))) == "1"
    assert conn.execute(FIXED, (identity, 5, HUGE_WINDOW_MS)).fetchone()[0] is True
    assert fixed_units(master.command("GET", fixed_key(identity, 5))) == "2"


# ------------------------------------------------------------ failovers


@pytest.mark.heavy
def test_failover_under_load(sessions, fresh_redis_sentinel):
    """SENTINEL FAILOVER while 4 sessions call. Before it, each session
    charges one identity; from the failover on, every call charges a fresh
    identity, so where each call landed can be read afterwards. Checked:
    at most one failed call per session (class 08); the counts made before
    the failover are on the new master; from resume_bound(SENTINEL_RECHECK_MS)
    after the sentinels switched (the sessions ask them again every
    SENTINEL_RECHECK_MS), every allowed call landed on the new master; and no
    script reached the old master from then on, through its demotion (which
    Sentinel does about 10 s later) and after."""
    topo = fresh_redis_sentinel
    old = topo.current_master()
    new = topo.other_data_node(old)
    conns = [sessions(topo, on_error="error", connect_timeout=1000, command_timeout=1000,
                      sentinel_recheck_interval=SENTINEL_RECHECK_MS) for _ in range(4)]
    resume_s = resume_bound(SENTINEL_RECHECK_MS)
    base = new_ident("sfo")
    phase = [0]

    def job(conn, s, i):
        p = phase[0]
        identity = "%s:%d" % (base, s) if p == 0 else "%s:%d:%d" % (base, s, i)
        return p, identity, conn.execute(FIXED, (identity, BIG_LIM, HUGE_WINDOW_MS)).fetchone()[0]

    h = Hammer(conns, job, pause_s=0.005).start()
    wait_for(lambda: all(len(r) >= 20 for r in h.records), 30, "a warm-up", 0.02)
    phase[0] = 1
    wait_for(lambda: all(any(not isinstance(r[4], BaseException) and r[4][0] == 1 for r in rs)
                         for rs in h.records), 30, "every session in phase 1", 0.01)
    assert old.command("WAIT", 1, 5000) == 1  # the replica has every phase-0 write
    t_failover = time.monotonic()
    o, n = topo.failover()
    t_switch = time.monotonic()
    assert (o, n) == (old, new)
    time.sleep(max(0.0, t_switch + resume_s + 0.5 - time.monotonic()))
    old_scripts = script_calls(old)
    topo.wait_demoted(old, timeout=60)
    t_demoted = time.monotonic()
    time.sleep(1.0)
    h.stop()
    assert script_calls(old) == old_scripts, "scripts reached the old master after the switch"

    for s in range(len(conns)):
        errs = h.errors(s)
        assert len(errs) <= 1, errs
        assert all(isinstance(e[4], psycopg.Error) and e[4].sqlstate.startswith("08") for e in errs), errs
    ok = [r for r in h.calls() if not isinstance(r[4], BaseException)]
    assert all(r[4][2] is True for r in ok)
    # phase 0: counts kept across the failover
    for s in range(len(conns)):
        allowed = sum(1 for r in ok if r[0] == s and r[4][0] == 0)
        assert fixed_units(new.command("GET", fixed_key("%s:%d" % (base, s), BIG_LIM))) == str(allowed)
    # phase 1: where did each call land?
    later = [r for r in ok if r[4][0] == 1 and r[2] > t_failover]
    on_new = resp_pipeline(new.port, [["GET", fixed_key(r[4][1], BIG_LIM)] for r in later], timeout=30)
    landed = {r[4][1]: fixed_units(v) for r, v in zip(later, on_new)}
    lost = [r for r in later if landed[r[4][1]] != "1"]  # written to the old master after the promotion
    print("\n[failover: sentinels switched %.2f s after SENTINEL FAILOVER; %d calls went to the old master "
          "after the promotion, the last one started %.2f s after the switch; the old master was demoted "
          "%.1f s after the switch]"
          % (t_switch - t_failover, len(lost), max((r[2] for r in lost), default=t_switch) - t_switch,
             t_demoted - t_switch), end="")
    bound = t_switch + resume_s
    stray = [r for r in lost if r[2] > bound]
    assert stray == [], "%d calls after the bound did not land on the new master: %r" % (len(stray), stray[:3])
    for s in range(len(conns)):
        assert sum(1 for r in later if r[0] == s and r[2] > bound) >= 10, "session %d stalled" % s
    assert new.command("ROLE")[0] == "master" and old.command("ROLE")[0] == "slave"
    server = conns[0].execute("SELECT server FROM rl_redis_ping()").fetchone()[0]
    assert server == "127.0.0.1:%d" % new.port


def test_master_killed_on_error_deny(pg, sessions, fresh_redis_sentinel):
    """SIGKILL the master: calls answer false (on_error = deny, never an
    error) until the sentinels promote the replica, then true again; the
    backend survives."""
    topo = fresh_redis_sentinel
    old = topo.current_master()
    new = topo.other_data_node(old)
    conn = sessions(topo, on_error="deny", connect_timeout=500, command_timeout=1000)
    before = backend_identity(conn)
    identity = new_ident("skill")
    assert conn.execute(FIXED, (identity, BIG_LIM, HUGE_WINDOW_MS)).fetchone()[0] is True
    h = Hammer([conn], lambda c, s, i: c.execute(FIXED, (identity, BIG_LIM, HUGE_WINDOW_MS)).fetchone()[0], pause_s=0.005)
    h.start()
    time.sleep(0.3)
    t_kill = time.monotonic()
    old.stop()
    wait_for(lambda: all(s.master_addr()[1] == new.port for s in topo.sentinels)
             and new.command("ROLE")[0] == "master", 60, "the sentinels to promote the replica", 0.05)
    t_promoted = time.monotonic()

    def recovered():
        after = [r for r in h.calls() if r[2] > t_promoted]
        return len(after) >= 5 and all(r[4] is True for r in after[-5:])

    wait_for(recovered, 20, "calls to be allowed again after the promotion", 0.05)
    h.stop()
    calls = h.calls()
    assert h.errors() == [], h.errors()[:3]
    outage = [r for r in calls if r[2] >= t_kill]
    assert any(r[4] is False for r in outage), "nothing was denied while the master was down"
    last_denied = max(r[3] for r in outage if r[4] is False)
    assert last_denied - t_promoted < RESUME_BOUND_S, (last_denied - t_kill, t_promoted - t_kill)
    assert all(r[4] is True for r in outage if r[2] > last_denied)
    assert max(r[3] - r[2] for r in outage) < 4.0
    print("\n[master killed: promoted after %.1f s, last denial %.1f s after the kill]"
          % (t_promoted - t_kill, last_denied - t_kill), end="")
    assert backend_identity(conn) == before
    assert conn.execute("SELECT 1").fetchone()[0] == 1
    assert int(fixed_units(new.command("GET", fixed_key(identity, BIG_LIM)))) >= 1
    assert conn.execute("SELECT server FROM rl_redis_ping()").fetchone()[0] == "127.0.0.1:%d" % new.port
