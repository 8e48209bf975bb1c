"""Real Redis topologies for the cluster and sentinel tests: a Redis Cluster
of masters with one replica each, and a master + replica watched by three
sentinels. Every process is a redis-server on 127.0.0.1 started through
conftest's RedisServer (Debian's Redis 7.0; no other packages).

    from redis_topology import (RedisClusterFixture, RedisSentinelFixture,
                                redis_cluster, fresh_redis_cluster,
                                redis_sentinel, fresh_redis_sentinel)

Fixtures (import them into the test module so that pytest sees them):
  redis_cluster         3 masters + 3 replicas shared by the tests of a module
                        (tests must use fresh identities; a test may move
                        slots around but must leave every node running)
  fresh_redis_cluster   the same, for one test (failovers, killed nodes)
  redis_sentinel        master + replica + 3 sentinels shared by a module
  fresh_redis_sentinel  the same, for one test (failovers)

Timing: node timeout 1000 ms (cluster), down-after 1000 ms and failover
timeout 5000 ms (sentinel). Starting a cluster takes about 2-4 s, a sentinel
set about 3-5 s on a 2-core machine.
"""

import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid

import psycopg
import pytest

from conftest import (REDIS_CLI, REDIS_SERVER, RedisServer, RespError, _read_reply, free_port, pg_connect,
                      resp_encode, wait_for)

CLUSTER_NODE_TIMEOUT_MS = 1000
SENTINEL_DOWN_AFTER_MS = 1000
SENTINEL_FAILOVER_TIMEOUT_MS = 5000
MASTER_NAME = "mymaster"
SLOTS = 16384


# ------------------------------------------------------------------ RESP


def resp_pipeline(port, commands, password=None, timeout=5.0):
    """Sends several commands over one fresh connection (e.g. ASKING then
    the command) and returns their replies in order; an error reply is
    returned as a RespError instance instead of being raised."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        cmds = ([["AUTH", password]] if password is not None else []) + [
            [str(a) for a in c] for c in commands
        ]
        s.sendall(resp_encode(cmds))
        f = s.makefile("rb")
        replies = []
        for _ in cmds:
            try:
                replies.append(_read_reply(f))
            except RespError as e:
                replies.append(e)
        if password is not None:
            if isinstance(replies[0], RespError):
                raise replies[0]
            replies = replies[1:]
        return replies
    finally:
        s.close()


def timed(conn, query, params=None):
    """Runs query's first column: (value, or the psycopg.Error it raised;
    seconds it took)."""
    t0 = time.monotonic()
    try:
        value = conn.execute(query, params).fetchone()[0]
    except psycopg.Error as e:
        value = e
    return value, time.monotonic() - t0


def backend_identity(conn):
    """(backend pid, postmaster start): changes when a backend or the
    server restarted."""
    return conn.execute("SELECT pg_backend_pid(), pg_postmaster_start_time()").fetchone()


def info_dict(text):
    """INFO output as a dict (values as strings)."""
    out = {}
    for line in text.splitlines():
        if ":" in line and not line.startswith("#"):
            k, v = line.split(":", 1)
            out[k] = v.strip()
    return out


# ------------------------------------------------------------ hash slots


def _crc16_table():
    table = []
    for i in range(256):
        crc = i << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else (crc << 1)
        table.append(crc & 0xFFFF)
    return table


_CRC16 = _crc16_table()


def crc16(data):
    """CRC16/XMODEM, the one Redis Cluster uses."""
    crc = 0
    for b in data:
        crc = ((crc << 8) & 0xFFFF) ^ _CRC16[((crc >> 8) ^ b) & 0xFF]
    return crc


def key_slot(key):
    """The hash slot of a key (bytes or str), hash tags included: the part
    between the first '{' and the next '}' when it is not empty."""
    if isinstance(key, str):
        key = key.encode()
    start = key.find(b"{")
    if start >= 0:
        end = key.find(b"}", start + 1)
        if end > start + 1:
            key = key[start + 1:end]
    return crc16(key) % SLOTS


def identity_slot(identity):
    """The slot of every key of an identity ('{<enc(identity)>}')."""
    enc = identity.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")
    return key_slot("{%s}" % enc)


def idents_in_slot(slot, n, base):
    """n distinct identities '<base>:<i>' whose keys all hash to `slot`."""
    out = []
    i = 0
    while len(out) < n:
        ident = "%s:%d" % (base, i)
        if identity_slot(ident) == slot:
            out.append(ident)
        i += 1
    return out


# --------------------------------------------------------------- cluster


class ClusterNode(RedisServer):
    """A redis-server with cluster mode on; the cluster bus gets a port of
    its own (port + 10000 may be above 65535 or taken)."""

    def __init__(self, base_dir, name, node_timeout_ms, extra_args=()):
        self.bus_port = free_port()
        self.node_timeout_ms = node_timeout_ms
        super().__init__(base_dir, name, extra_args=extra_args)
        self.node_id = None
        self.dead = False

    def _argv(self):
        return super()._argv() + [
            "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(self.node_timeout_ms),
            "--cluster-port", str(self.bus_port),
            # a replica may always take over, however long it was cut off
            "--cluster-replica-validity-factor", "0",
            # keep one replica per master: no replica migration
            "--cluster-allow-replica-migration", "no",
            # a replica's first sync starts at once (the default waits 5 s)
            "--repl-diskless-sync-delay", "0",
        ]

    def start(self, timeout=15.0):
        """As RedisServer.start; a cluster bus port somebody took meanwhile
        is replaced by another."""
        for attempt in range(3):
            try:
                return super().start(timeout)
            except RuntimeError:
                if attempt == 2:
                    raise
                self.bus_port = free_port()

    @property
    def addr(self):
        return "127.0.0.1:%d" % self.port

    def role(self):
        return self.command("ROLE")[0]  # 'master' or 'slave'

    def info(self, section=None):
        return info_dict(self.command("INFO", section) if section else self.command("INFO"))

    def script_calls(self):
        """EVAL/EVALSHA/FCALL calls this node saw (executed, rejected and
        failed), from INFO commandstats."""
        total = 0
        for k, v in self.info("commandstats").items():
            if k in ("cmdstat_eval", "cmdstat_evalsha", "cmdstat_eval_ro", "cmdstat_evalsha_ro",
                     "cmdstat_fcall", "cmdstat_fcall_ro"):
                fields = dict(p.split("=", 1) for p in v.split(","))
                total += int(fields["calls"]) + int(fields.get("rejected_calls", 0)) + \
                    int(fields.get("failed_calls", 0))
        return total

    def command_calls(self, name):
        """How many times this node ran command `name` (INFO commandstats)."""
        stats = self.info("commandstats").get("cmdstat_%s" % name.lower())
        return int(dict(p.split("=", 1) for p in stats.split(","))["calls"]) if stats else 0

    def error_count(self, prefix):
        """How many error replies starting with prefix (MOVED, ASK, TRYAGAIN,
        ...) this node sent (INFO errorstats)."""
        stats = self.info("errorstats").get("errorstat_%s" % prefix)
        return int(stats.split("=", 1)[1]) if stats else 0

    def __repr__(self):
        return "<node %s %s%s>" % (self.port, (self.node_id or "?")[:8], " dead" if self.dead else "")


class RedisClusterFixture:
    """`masters` masters, each with `replicas` replicas, made with
    redis-cli --cluster create, on 127.0.0.1.

    Attributes: nodes (every ClusterNode started, dead ones included),
    masters() / replicas() (live nodes by their current role)."""

    def __init__(self, base_dir=None, masters=3, replicas=1,
                 node_timeout_ms=CLUSTER_NODE_TIMEOUT_MS):
        base = base_dir or os.environ.get("RL_DIR")
        if not base or not os.path.isdir(base):
            base = None
        self.base_dir = tempfile.mkdtemp(prefix="redis_cluster_", dir=base)
        os.chmod(self.base_dir, 0o755)
        self.n_masters = masters
        self.n_replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        self.nodes = []

    # -- set-up and tear-down

    def start(self, timeout=60.0):
        total = self.n_masters * (1 + self.n_replicas)
        for i in range(total):
            node = ClusterNode(self.base_dir, "n%d" % i, self.node_timeout_ms)
            self.nodes.append(node)
            node.start()
        for node in self.nodes:
            node.node_id = node.command("CLUSTER", "MYID")
        argv = [REDIS_CLI, "--cluster", "create"] + [n.addr for n in self.nodes] + [
            "--cluster-replicas", str(self.n_replicas), "--cluster-yes"]
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        if res.returncode != 0:
            raise RuntimeError("redis-cli --cluster create failed:\n%s\n%s" % (res.stdout, res.stderr))
        self.wait_healthy(timeout=timeout)
        return self

    def cleanup(self):
        for node in self.nodes:
            try:
                if node.paused:
                    node.resume()
                node.stop()
            except Exception:
                pass
        shutil.rmtree(self.base_dir, ignore_errors=True)

    # -- topology

    def live(self):
        return [n for n in self.nodes if not n.dead]

    def node_for(self, port):
        """The node listening on port (an int or '127.0.0.1:<port>')."""
        port = int(str(port).rsplit(":", 1)[-1])
        for n in self.nodes:
            if n.port == port:
                return n
        raise KeyError("no cluster node on port %s" % port)

    def masters(self):
        return [n for n in self.live() if n.role() == "master"]

    def replicas(self):
        return [n for n in self.live() if n.role() == "slave"]

    def slot_map(self, node=None):
        """[(start, end, master_port)] sorted, as `node` (default: any live
        master) sees it from CLUSTER SLOTS."""
        node = node or self.live()[0]
        ranges = []
        for entry in node.command("CLUSTER", "SLOTS"):
            start, end, master = entry[0], entry[1], entry[2]
            ranges.append((int(start), int(end), int(master[1])))
        return sorted(ranges)

    def replica_of(self, master):
        """The live replicas of master (by their own INFO replication)."""
        out = []
        for n in self.live():
            rep = n.info("replication")
            if rep.get("role") == "slave" and int(rep.get("master_port", 0)) == master.port:
                out.append(n)
        return out

    def roles_agree(self):
        """Every live node's CLUSTER NODES gives every other live node its
        real role, and every replica its real master."""
        real = {}
        for n in self.live():
            rep = n.info("replication")
            if rep.get("role") == "slave":
                real[n.node_id] = ("slave", self.node_for(rep["master_port"]).node_id)
            else:
                real[n.node_id] = ("master", "-")
        for n in self.live():
            for line in n.command("CLUSTER", "NODES").splitlines():
                f = line.split()
                if f[0] not in real:
                    continue  # a dead node
                role = "slave" if "slave" in f[2].split(",") else "master"
                if (role, f[3] if role == "slave" else "-") != real[f[0]] or "fail" in f[2]:
                    return False
        return True

    def master_of_slot(self, slot, node=None):
        for start, end, port in self.slot_map(node):
            if start <= slot <= end:
                return self.node_for(port)
        raise KeyError("slot %d is not served" % slot)

    def master_of_key(self, key):
        return self.master_of_slot(key_slot(key))

    def master_of_identity(self, identity):
        return self.master_of_slot(identity_slot(identity))

    def slots_of(self, master):
        return [s for start, end, port in self.slot_map() if port == master.port
                for s in range(start, end + 1)]

    def healthy(self):
        """True when every live node says cluster_state:ok, all 16384 slots
        are assigned, every live node sees the same slot map, every live
        replica's link to its master is up, and every node of the map
        answers ROLE master, and every node knows every live node's role
        (and a replica's master) as it is."""
        maps = set()
        for n in self.live():
            info = info_dict(n.command("CLUSTER", "INFO"))
            if info.get("cluster_state") != "ok" or info.get("cluster_slots_assigned") != str(SLOTS):
                return False
            maps.add(tuple(self.slot_map(n)))
            rep = n.info("replication")
            if rep.get("role") == "slave" and rep.get("master_link_status") != "up":
                return False
        if len(maps) != 1:
            return False
        for port in {p for _, _, p in next(iter(maps))}:
            node = self.node_for(port)
            if node.dead or node.role() != "master":
                return False
        return self.roles_agree()

    def wait_healthy(self, timeout=30.0):
        wait_for(self.healthy, timeout, "the cluster to be healthy and agree on its slot map")

    # -- slots

    def idents_on_each_master(self, base, per_master=1):
        """{master: [identities]}: per_master identities for every master."""
        out = {m: [] for m in self.masters()}
        i = 0
        while any(len(v) < per_master for v in out.values()):
            ident = "%s:%d" % (base, i)
            i += 1
            m = self.master_of_identity(ident)
            if len(out[m]) < per_master:
                out[m].append(ident)
        return out

    def migrate_slot(self, slot, to_master, on_each_key_step=None, batch=1, timeout=30.0):
        """Moves a slot with the live-migration protocol: SETSLOT IMPORTING on
        the target, MIGRATING on the source, GETKEYSINSLOT + MIGRATE ... KEYS
        in batches of `batch` keys (on_each_key_step(keys) is called after
        every batch, while the slot is half moved), then SETSLOT NODE on the
        target, the source and every other master; waits until every node
        agrees. Returns the number of keys moved."""
        src = self.master_of_slot(slot)
        dst = to_master
        if src is dst:
            return 0
        dst.command("CLUSTER", "SETSLOT", slot, "IMPORTING", src.node_id)
        src.command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst.node_id)
        moved = 0
        while True:
            keys = src.command("CLUSTER", "GETKEYSINSLOT", slot, batch)
            if not keys:
                break
            src.command("MIGRATE", "127.0.0.1", dst.port, "", 0, 5000, "KEYS", *keys)
            moved += len(keys)
            if on_each_key_step is not None:
                on_each_key_step(keys)
        dst.command("CLUSTER", "SETSLOT", slot, "NODE", dst.node_id)
        src.command("CLUSTER", "SETSLOT", slot, "NODE", dst.node_id)
        for m in self.masters():
            if m is not src and m is not dst:
                m.command("CLUSTER", "SETSLOT", slot, "NODE", dst.node_id)
        wait_for(lambda: self.healthy() and self.master_of_slot(slot) is dst, timeout,
                 "slot %d to be served by %r everywhere" % (slot, dst))
        return moved

    # -- failures

    def manual_failover(self, replica, timeout=30.0):
        """CLUSTER FAILOVER on `replica`; waits until it is master, its old
        master is its replica, and the cluster is healthy. Returns the old
        master."""
        old = self.node_for(replica.info("replication")["master_port"])
        replica.command("CLUSTER", "FAILOVER")
        wait_for(lambda: replica.role() == "master" and old.role() == "slave"
                 and self.healthy(), timeout, "the manual failover of %r" % old)
        return old

    def kill_master(self, master, timeout=30.0):
        """SIGKILLs a master; waits until one of its replicas was promoted and
        the cluster (the live nodes) is healthy again. Returns the promoted
        replica."""
        replicas = self.replica_of(master)
        assert replicas, "%r has no live replica" % master
        slots = self.slots_of(master)
        master.stop()
        master.dead = True
        promoted = wait_for(lambda: next((r for r in replicas if r.role() == "master"), None),
                            timeout, "a replica of %r to be promoted" % master)
        wait_for(lambda: self.healthy() and self.master_of_slot(slots[0]) is promoted,
                 timeout, "the cluster to be ok after killing %r" % master)
        return promoted

    # -- data

    def command_for_key(self, key, *args):
        """Runs a command about `key` on the master that holds it, following
        MOVED and ASK (a slot half-migrated)."""
        node = self.master_of_key(key)
        asking = False
        for _ in range(5):
            cmds = ([["ASKING"]] if asking else []) + [list(args)]
            reply = resp_pipeline(node.port, cmds)[-1]
            if isinstance(reply, RespError):
                msg = str(reply)
                if msg.startswith("MOVED ") or msg.startswith("ASK "):
                    node = self.node_for(msg.split()[2])
                    asking = msg.startswith("ASK ")
                    continue
                raise reply
            return reply
        raise RuntimeError("too many redirections for %r" % key)

    def holders(self, key):
        """The live masters whose dataset holds key, whoever owns its slot
        (CLUSTER GETKEYSINSLOT is never redirected)."""
        slot = key_slot(key)
        return [m for m in self.masters() if key in (m.command("CLUSTER", "GETKEYSINSLOT", slot, 100000) or [])]

    def hash_of(self, key):
        """HGETALL of a key as a dict, from the master that holds it."""
        flat = self.command_for_key(key, "HGETALL", key) or []
        return dict(zip(flat[0::2], flat[1::2]))

    def zcard_of(self, key):
        return self.command_for_key(key, "ZCARD", key)

    def key_count(self):
        """{master: DBSIZE}"""
        return {m: m.command("DBSIZE") for m in self.masters()}

    def nodes_arg(self, nodes=None):
        """'127.0.0.1:p1,127.0.0.1:p2,...' (for rl_redis.nodes)."""
        return ",".join(n.addr for n in (nodes if nodes is not None else self.live()))


# -------------------------------------------------------------- sentinel


class SentinelServer(RedisServer):
    """redis-server <own writable conf> --sentinel, monitoring one master."""

    def __init__(self, base_dir, name, master_port, quorum=2, password=None,
                 auth_pass=None, down_after_ms=SENTINEL_DOWN_AFTER_MS,
                 failover_timeout_ms=SENTINEL_FAILOVER_TIMEOUT_MS):
        super().__init__(base_dir, name)
        self.password = password  # the sentinel's own requirepass
        self.conf = os.path.join(self.dir, "sentinel.conf")
        self.master_port = master_port
        self.quorum = quorum
        self.auth_pass = auth_pass
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self._conf_port = None

    def _write_conf(self):
        lines = [
            "port %d" % self.port,
            "bind 127.0.0.1",
            "daemonize no",
            "dir %s" % self.dir,
            "logfile %s" % os.path.join(self.dir, "redis.log"),
            "sentinel resolve-hostnames no",
            "sentinel monitor %s 127.0.0.1 %d %d" % (MASTER_NAME, self.master_port, self.quorum),
            "sentinel down-after-milliseconds %s %d" % (MASTER_NAME, self.down_after_ms),
            "sentinel failover-timeout %s %d" % (MASTER_NAME, self.failover_timeout_ms),
            "sentinel parallel-syncs %s 1" % MASTER_NAME,
        ]
        if self.auth_pass is not None:
            lines.append("sentinel auth-pass %s %s" % (MASTER_NAME, self.auth_pass))
        if self.password is not None:
            lines.append("requirepass %s" % self.password)
        with open(self.conf, "w") as f:
            f.write("\n".join(lines) + "\n")
        os.chmod(self.conf, 0o644)
        self._conf_port = self.port

    def _argv(self):
        if self._conf_port != self.port or not os.path.exists(self.conf):
            self._write_conf()
        return [REDIS_SERVER, self.conf, "--sentinel"]

    @property
    def addr(self):
        return "127.0.0.1:%d" % self.port

    def master_state(self):
        flat = self.command("SENTINEL", "MASTER", MASTER_NAME)
        return dict(zip(flat[0::2], flat[1::2]))

    def replicas_state(self):
        return [dict(zip(r[0::2], r[1::2])) for r in self.command("SENTINEL", "REPLICAS", MASTER_NAME)]

    def master_addr(self):
        host, port = self.command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER_NAME)
        return host, int(port)


class RedisSentinelFixture:
    """One master, one replica (REPLICAOF) and 3 sentinels (quorum 2).

    password: requirepass of the data nodes (masterauth too, and the
    sentinels' auth-pass); sentinel_password: the sentinels' own
    requirepass."""

    def __init__(self, base_dir=None, n_sentinels=3, password=None, sentinel_password=None):
        base = base_dir or os.environ.get("RL_DIR")
        if not base or not os.path.isdir(base):
            base = None
        self.base_dir = tempfile.mkdtemp(prefix="redis_sentinel_", dir=base)
        os.chmod(self.base_dir, 0o755)
        self.n_sentinels = n_sentinels
        self.password = password
        self.sentinel_password = sentinel_password
        self.data = []
        self.sentinels = []

    def _data_node(self, name, extra):
        extra = ["--repl-diskless-sync-delay", "0"] + list(extra)
        if self.password is not None:
            extra += ["--masterauth", self.password]
        node = RedisServer(self.base_dir, name, password=self.password, extra_args=extra)
        self.data.append(node)
        return node.start()

    def start(self, timeout=60.0):
        master = self._data_node("master", [])
        self._data_node("replica", ["--replicaof", "127.0.0.1", str(master.port)])
        for i in range(self.n_sentinels):
            s = SentinelServer(self.base_dir, "s%d" % i, master.port, password=self.sentinel_password,
                               auth_pass=self.password)
            self.sentinels.append(s)
            s.start()
        self.wait_ready(timeout)
        return self

    def cleanup(self):
        for s in self.sentinels + self.data:
            try:
                if s.paused:
                    s.resume()
                s.stop()
            except Exception:
                pass
        shutil.rmtree(self.base_dir, ignore_errors=True)

    # -- state

    def node_for(self, port):
        for n in self.data:
            if n.port == int(port):
                return n
        raise KeyError("no data node on port %s" % port)

    def current_master(self):
        """The data node that the first sentinel names as master."""
        return self.node_for(self.sentinels[0].master_addr()[1])

    def other_data_node(self, node):
        return next(n for n in self.data if n is not node)

    def ready(self):
        """Every sentinel names the same master, whose ROLE is master, knows
        the other sentinels, and sees the other data node as a healthy
        replica of it with its link up."""
        masters = {s.master_addr()[1] for s in self.sentinels}
        if len(masters) != 1:
            return False
        master = self.node_for(masters.pop())
        if master.command("ROLE")[0] != "master":
            return False
        replica = self.other_data_node(master)
        rep = info_dict(replica.command("INFO", "replication"))
        if rep.get("role") != "slave" or int(rep.get("master_port", 0)) != master.port \
                or rep.get("master_link_status") != "up":
            return False
        for s in self.sentinels:
            st = s.master_state()
            if st["flags"] != "master" or int(st["num-other-sentinels"]) != self.n_sentinels - 1:
                return False
            reps = [r for r in s.replicas_state() if int(r["port"]) == replica.port]
            if not reps or reps[0]["flags"] != "slave" or reps[0].get("master-link-status") != "ok":
                return False
        return True

    def wait_ready(self, timeout=60.0):
        wait_for(self.ready, timeout, "the sentinels to agree on a healthy master and replica", 0.1)

    def failover(self, timeout=60.0):
        """SENTINEL FAILOVER; waits until every sentinel names the new master
        and the new master's ROLE is master. Returns (old, new)."""
        old = self.current_master()
        new = self.other_data_node(old)
        self.sentinels[0].command("SENTINEL", "FAILOVER", MASTER_NAME)
        wait_for(lambda: all(s.master_addr()[1] == new.port for s in self.sentinels)
                 and new.command("ROLE")[0] == "master", timeout,
                 "every sentinel to name %d as master" % new.port, 0.05)
        return old, new

    def wait_demoted(self, node, timeout=60.0):
        """Waits until `node` (an old master) is a replica whose link to the
        current master is up."""
        def demoted():
            rep = info_dict(node.command("INFO", "replication"))
            return rep.get("role") == "slave" and rep.get("master_link_status") == "up"
        wait_for(demoted, timeout, "%d to be demoted" % node.port, 0.05)

    def sentinels_arg(self, sentinels=None):
        return ",".join(s.addr for s in (sentinels if sentinels is not None else self.sentinels))


# -------------------------------------------------------------- fixtures


def _start_cluster():
    c = RedisClusterFixture()
    try:
        c.start()
    except BaseException:
        c.cleanup()
        raise
    return c


@pytest.fixture(scope="module")
def redis_cluster():
    """3 masters + 3 replicas shared by a module's tests."""
    c = _start_cluster()
    try:
        yield c
    finally:
        c.cleanup()


@pytest.fixture
def fresh_redis_cluster():
    """3 masters + 3 replicas for one test."""
    c = _start_cluster()
    try:
        yield c
    finally:
        c.cleanup()


def _start_sentinel(**kw):
    s = RedisSentinelFixture(**kw)
    try:
        s.start()
    except BaseException:
        s.cleanup()
        raise
    return s


@pytest.fixture(scope="module")
def redis_sentinel():
    s = _start_sentinel()
    try:
        yield s
    finally:
        s.cleanup()


@pytest.fixture
def fresh_redis_sentinel():
    s = _start_sentinel()
    try:
        yield s
    finally:
        s.cleanup()


# ------------------------------------------------- sessions and policies


def connections(point):
    """A fixture body: yields make(*args, **gucs) -> a new superuser
    connection that point(conn, *args, **gucs) set up; all closed at
    teardown."""
    conns = []

    def make(*args, **gucs):
        conn = pg_connect()
        conns.append(conn)
        point(conn, *args, **gucs)
        return conn

    yield make
    for c in conns:
        try:
            c.close()
        except Exception:
            pass


def made_policies(pg, tag):
    """A fixture body: yields make(algorithm, lim, window_ms, burst=None) ->
    a new policy's name ("<tag>_<random>"); all deleted at teardown."""
    names = []

    def make(algorithm, lim, window_ms, burst=None):
        name = "%s_%s" % (tag, uuid.uuid4().hex[:16])
        pg.execute("INSERT INTO rl_policy (name, algorithm, lim, window_ms, burst) VALUES (%s, %s, %s, %s, %s)",
                   (name, algorithm, lim, window_ms, burst))
        names.append(name)
        return name

    yield make
    if names:
        pg.execute("DELETE FROM rl_policy WHERE name = ANY(%s)", (names,))
