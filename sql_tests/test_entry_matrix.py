"""Every entry path of rl_redis in every cell of the transport and topology
matrix (issue 19): one set of promises, kept by each way in.

Cells: rl_redis.transport = backend and shared on a standalone Redis, and
both on Redis Cluster (3 masters, 3 replicas). The shared transport serves
standalone Redis only: in cluster mode a session under transport = shared
uses its own connections (README, "The shared transport"), and the
shared-cluster cell checks that it does, beside a worker that runs. The
standalone cells and the shared-cluster cell run on one preloading server
of the module (conftest's shared_server, its worker connected to its own
Redis), the cluster cell on the run's server; both cluster cells use the
module's cluster (redis_topology's redis_cluster). The standalone cells are
one xdist group and the cluster cells another: the worker of a group starts
the servers the group needs once (shared_server in each group: the
shared-cluster cell in the standalone group would start the cluster there
instead, and leave that group with three cells of four).

Entry paths: the explicit decisions rl_<algorithm> and
rl_<algorithm>_allow, the policies rl_check / rl_allow and rl_check_all /
rl_allow_all, the batches rl_check_many and rl_<algorithm>_many (each for
the five algorithms), the row guard (rl_guard) and the statement guard
(rl_guard_statement) on a policy, the concurrency slots rl_acquire /
rl_acquire_allow (a policy) and rl_concurrency_acquire /
rl_concurrency_acquire_allow (explicit), and the refunds
rl_<algorithm>_refund and rl_refund.

What each cell asserts, on a fresh identity under a key prefix of the
test's own (rl_redis.key_prefix), on the frozen test clock:
  limit      lim 3, 5 calls (or a batch of 5 copies) in one transaction:
             exactly the first 3 allowed; after COMMIT a rate limit admits
             nothing more and a concurrency limit has its 3 slots back
  bound      an identity of rl_redis.max_identity_bytes + 1 bytes (in a
             batch or a statement beside a short one): 54000, and no key
             written under the prefix; one of exactly the bound is decided
  rollback   rl_redis.refund_on_abort = 'all'; BEGIN; 2 units; ROLLBACK:
             the full quota again (3 of 5 allowed)
  terminate  the concurrency paths: a session holding the only slot (lim
             1, lease 10 minutes) in an open transaction is ended by
             pg_terminate_backend; another session takes the slot within
             5 s (the lease cannot have ended)
  timeout    the concurrency paths: an acquire (lim 1) ended by
             statement_timeout (57014) while the node holding the slot is
             held by CLIENT PAUSE (the call sent, or queued for the worker;
             the holder's connection opened first, so that the timeout
             ends the acquire, not a connect); once the pause ends, another
             session takes the slot within 5 s
  cancel     the same with pg_cancel_backend, the node held by CLIENT
             PAUSE WRITE until the call was cancelled
  privilege  a role granted nothing (SET ROLE in a session the superuser
             set up) can execute the path exactly when the README's
             privilege table gives its functions to PUBLIC: then the limit
             holds for it too; else 42501 and no key written (the guards:
             CREATE TRIGGER with rl_guard on its own temporary table)
  refunds    (rl_<algorithm>_refund, rl_refund) 3 units taken, 2 given
             back: 2 remaining; 5 more given back: 3 (never above lim), and
             3 of 5 allowed; the bound of a refund is 1 MB, not
             max_identity_bytes: a refund of max_identity_bytes + 1 bytes
             is accepted and writes no key, one of 1 MB + 1 is 54000
  inspect    (rl_inspect, a dry run, on a policy of each algorithm and a
             concurrency policy) the full quota and no key on a fresh
             identity; with 2 units taken, what is left and every key's
             value and expiry as they were; then exactly lim - 2 more pass;
             max_identity_bytes + 1: 54000; a role granted nothing inspects
             as the README's table says, and charges nothing
  releases   (rl_release, rl_concurrency_release) lim 3 held by one
             transaction: a release frees exactly one slot, a release of
             none held is false, and the COMMIT after frees nothing of
             another session's; the bound is 1 MB, as for refunds; a role
             granted nothing frees no slot another session holds
  reset      (rl_reset) an identity used up under every algorithm, by an
             explicit limit and a policy, and holding a slot: every key of
             it deleted, the full quota again, a neighbour's keys as they
             were; the bound is 1 MB; a role granted nothing: 42501
In the shared cell, every path but the batches (which go on the session's
own connection by design) is served by the worker: the session opens no
connection of its own. In the shared-cluster cell, every path goes on the
session's own connections: CLIENT LIST of the masters shows the session's
and none of the worker's.
"""

import os

import psycopg
import pytest
from psycopg import sql

import conftest
from conftest import (QueryThread, give_back_session, new_ident, own_connection_open,
                      readme_privileges, redis_clients, set_gucs, take_session, wait_for)
from redis_topology import made_policies, redis_cluster  # noqa: F401

TEST_CLOCK_MS = 1800000000000  # a frozen clock on a whole minute (2027-01-15)
WINDOW_MS = 60000
LEASE_MS = 600000  # 10 minutes: no slot's lease ends during a test
LIM = 3
PAUSE_MS = 400  # CLIENT PAUSE of the node holding a timed-out acquire
CANCEL_PAUSE_MS = 60000  # the same for a cancelled one (lifted by CLIENT UNPAUSE)
MAX_REFUND_IDENTITY = 1024 * 1024  # the bound of what only touches existing state
ALGORITHMS = conftest.ALGORITHMS
COLS = "(r).allowed, (r).remaining"

STANDALONE = pytest.mark.xdist_group("entry_matrix_standalone")
CLUSTER = pytest.mark.xdist_group("entry_matrix_cluster")
CELLS = [pytest.param("backend", marks=STANDALONE), pytest.param("shared", marks=STANDALONE),
         pytest.param("cluster", marks=CLUSTER), pytest.param("shared-cluster", marks=CLUSTER)]


# ---------------------------------------------------------------- a cell


class Cell:
    """One transport and topology: sessions (superuser, frozen clock, the
    test's key prefix), an admin session, policies and guarded tables of
    the test's own, the keys under the prefix, roles granted nothing."""

    def __init__(self, name, connect, point, nodes, node_of, server=None):
        self.name, self._connect, self._point, self.nodes = name, connect, point, nodes
        self.node_of = node_of  # the node that holds an identity's keys
        self.server = server  # the preloading PgServer of the shared cells
        self.prefix = "rlm%s:" % os.urandom(6).hex()
        self.conns, self.roles, self.tables = [], [], []
        self.admin = self._connect()
        self._policies = made_policies(self.admin, "t_matrix")
        self.policy = next(self._policies)

    def session(self, **gucs):
        """A superuser session of the cell (take_session)."""
        conn = self._connect()
        self.conns.append(conn)
        self._point(conn)
        gucs.setdefault("test_clock_ms", TEST_CLOCK_MS)
        set_gucs(conn, key_prefix=self.prefix, **gucs)
        return conn

    def _scan(self):
        """(node, key) of every key under the test's prefix, on every node."""
        for node in self.nodes:
            cursor = "0"
            while True:
                cursor, batch = node.command("SCAN", cursor, "MATCH", self.prefix + "*",
                                             "COUNT", 1000)
                for key in batch:
                    yield node, key
                if cursor == "0":
                    break

    def keys(self):
        """Every key under the test's prefix, on every node."""
        return [key for _, key in self._scan()]

    def snapshot(self):
        """{key: (DUMP, PEXPIRETIME)} of every key under the test's prefix:
        the state and absolute expiry Redis holds."""
        return {key: (node.command("DUMP", key), node.command("PEXPIRETIME", key))
                for node, key in self._scan()}

    def keys_of(self, identity):
        """The keys under the prefix of one identity ({identity} in them)."""
        return sorted(k for k in self.keys() if "{%s}" % identity in k)

    def guarded_table(self, trigger):
        """A new table (tenant text) with the trigger trigger % table."""
        name = "rl_matrix_%s" % os.urandom(6).hex()
        self.admin.execute(sql.SQL("CREATE TABLE {} (tenant text NOT NULL)").format(
            sql.Identifier(name)))
        self.tables.append(name)
        self.admin.execute(trigger % name)
        return name

    def role(self):
        """A new role, granted nothing."""
        name = "rl_matrix_%s" % os.urandom(6).hex()
        self.admin.execute(sql.SQL("CREATE ROLE {}").format(sql.Identifier(name)))
        self.roles.append(name)
        return name

    def close(self):
        """Gives the sessions back and drops what the test made."""
        for conn in self.conns:
            give_back_session(conn)
        for name in self.tables:
            self.admin.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(name)))
        for name in self.roles:
            self.admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))
        next(self._policies, None)  # deletes the policies
        give_back_session(self.admin)


    def connections_of(self, conn):
        """(the session's, the worker's) connections to the cell's nodes,
        as Redis's CLIENT LIST shows them (the shared cluster cell)."""
        backend, worker = conn.info.backend_pid, self.server.worker_pid()
        clients = [redis_clients(node, [backend, worker]) for node in self.nodes]
        return sum(c.get(backend, 0) for c in clients), sum(c.get(worker, 0) for c in clients)


@pytest.fixture(params=CELLS)
def cell(request):
    """The cell of the test's parameter (backend, shared, cluster or
    shared-cluster)."""
    if request.param in ("cluster", "shared-cluster"):
        cluster = request.getfixturevalue("redis_cluster")
        masters = cluster.masters()
        transport = "shared" if request.param == "shared-cluster" else "backend"

        def point(conn):
            set_gucs(conn, mode="cluster", nodes=masters[0].addr, retry_interval=0,
                     transport=transport)
        if transport == "shared":  # a server whose worker runs (on its own Redis)
            server = request.getfixturevalue("shared_server")
            made = Cell(request.param, lambda: take_session(server), point, masters,
                        cluster.master_of_identity, server)
        else:
            made = Cell(request.param, take_session, point, masters, cluster.master_of_identity)
    else:
        server = request.getfixturevalue("shared_server")
        transport = request.param
        made = Cell(transport, lambda: take_session(server), lambda conn: set_gucs(conn, transport=transport),
                    [server.redis], lambda identity: server.redis, server)
    try:
        yield made
    finally:
        made.close()


def sqlstate_of(call):
    """The SQLSTATE of the error that call() raises (fails when none)."""
    with pytest.raises(psycopg.Error) as excinfo:
        call()
    return excinfo.value.sqlstate


def identity_of(size, tag):
    """A fresh identity of exactly size bytes."""
    base = new_ident(tag) + ":"
    assert len(base) <= size
    return base + "x" * (size - len(base))


def max_identity_bytes(conn):
    """rl_redis.max_identity_bytes of the session, in bytes."""
    return conn.execute(
        "SELECT pg_size_bytes(current_setting('rl_redis.max_identity_bytes'))").fetchone()[0]


# ---------------------------------------------------------------- the paths


class Path:
    """An entry path: prepare(cell, algorithm, lim) makes what it needs (a
    policy, a guarded table) and returns it; calls(conn, ctx, identity, n)
    makes n decisions of one unit in the session's transaction and returns
    whether each was allowed."""

    functions = ()  # what the path executes (for the privilege table)
    algorithms = ALGORITHMS
    concurrency = False
    via_worker = True

    def __init__(self, name):
        self.name = name

    def prepare(self, cell, algorithm, lim):
        return cell.policy(algorithm, lim, WINDOW_MS)

    def bound_call(self, conn, ctx, short, long):
        """The call that must be refused for the identity long."""
        return self.calls(conn, ctx, long, 1)

    def role_attempt(self, conn, ctx, identity):
        """What a role granted nothing tries (returns the decisions)."""
        with conn.transaction():
            return self.calls(conn, ctx, identity, 5)

    def __repr__(self):
        return self.name


class Explicit(Path):
    """rl_<algorithm> or rl_<algorithm>_allow with the limit in the call."""

    def __init__(self, suffix):
        super().__init__("rl_<algorithm>" + suffix)
        self.suffix = suffix
        self.functions = ["rl_%s%s" % (a, suffix) for a in ALGORITHMS]

    def prepare(self, cell, algorithm, lim):
        return algorithm, lim

    def calls(self, conn, ctx, identity, n):
        algorithm, lim = ctx
        if self.suffix:
            query = "SELECT rl_%s_allow(%%s, %%s, %%s)" % algorithm
        else:
            query = "SELECT (r).allowed FROM rl_%s(%%s, %%s, %%s) AS r" % algorithm
        return [conn.execute(query, (identity, lim, WINDOW_MS)).fetchone()[0] for _ in range(n)]


class Policy(Path):
    """A decision on a policy (several: the policy and a looser one)."""

    def __init__(self, function, several=False):
        super().__init__(function)
        self.functions = [function]
        self.several = several

    def prepare(self, cell, algorithm, lim):
        if self.several:  # the tighter of two limits decides
            return "{%s,%s}" % (cell.policy(algorithm, lim + 5, WINDOW_MS),
                                cell.policy(algorithm, lim, WINDOW_MS))
        return cell.policy(algorithm, lim, WINDOW_MS)

    def calls(self, conn, ctx, identity, n):
        if self.name.startswith("rl_allow"):
            query = "SELECT %s(%%s, %%s)" % self.name
        else:
            query = "SELECT (r).allowed FROM %s(%%s, %%s) AS r" % self.name
        return [conn.execute(query, (ctx, identity)).fetchone()[0] for _ in range(n)]


class Batch(Path):
    """One call with n copies of the identity."""

    via_worker = False

    def __init__(self, name):
        super().__init__(name)
        self.functions = ([name] if name == "rl_check_many"
                          else ["rl_%s_many" % a for a in ALGORITHMS])

    def prepare(self, cell, algorithm, lim):
        if self.name == "rl_check_many":
            return "SELECT allowed FROM rl_check_many(%s, %%s)" % sql.Literal(
                cell.policy(algorithm, lim, WINDOW_MS)).as_string(cell.admin)
        return "SELECT allowed FROM rl_%s_many(%%s, %d, %d)" % (algorithm, lim, WINDOW_MS)

    def calls(self, conn, ctx, identity, n):
        return self.batch(conn, ctx, [identity] * n)

    @staticmethod
    def batch(conn, ctx, identities):
        """The decisions of one batch, in the identities' order."""
        return [row[0] for row in conn.execute(ctx, (identities,)).fetchall()]

    def bound_call(self, conn, ctx, short, long):
        return self.batch(conn, ctx, [short, long])


class Guard(Path):
    """Inserts of one row each (in a savepoint each: a denied one ends with
    PT429)."""

    algorithms = ("fixed", "gcra")

    def __init__(self, function):
        super().__init__(function)
        self.functions = [function]

    def trigger(self, policy):
        """CREATE TRIGGER of the guard on the policy, for a table's name."""
        if self.name == "rl_guard":
            return ("CREATE TRIGGER g AFTER INSERT ON %%s FOR EACH ROW "
                    "EXECUTE FUNCTION rl_guard('%s', 'tenant')" % policy)
        return ("CREATE TRIGGER g AFTER INSERT ON %%s REFERENCING NEW TABLE AS n "
                "FOR EACH STATEMENT EXECUTE FUNCTION rl_guard_statement('%s', 'tenant')" % policy)

    def prepare(self, cell, algorithm, lim):
        return cell.guarded_table(self.trigger(cell.policy(algorithm, lim, WINDOW_MS)))

    def insert(self, conn, table, tenants):
        """Whether one INSERT of the tenants' rows passed the guard."""
        try:
            with conn.transaction():
                conn.execute(sql.SQL("INSERT INTO {} (tenant) SELECT unnest(%s::text[])").format(
                    sql.Identifier(table)), (tenants,))
            return True
        except psycopg.Error as e:
            if e.sqlstate != "PT429":
                raise
            return False

    def calls(self, conn, ctx, identity, n):
        return [self.insert(conn, ctx, [identity]) for _ in range(n)]

    def bound_call(self, conn, ctx, short, long):
        if self.name == "rl_guard_statement":  # one statement of both rows
            return self.insert(conn, ctx, [short, long])
        return self.calls(conn, ctx, long, 1)

    def role_attempt(self, conn, ctx, identity):
        """A guard trigger on a table of the role's own."""
        conn.execute("CREATE TEMPORARY TABLE mine (tenant text NOT NULL)")
        try:
            conn.execute(self.trigger("any") % "mine")
        finally:  # nothing of the role's is left when the test drops it
            conn.execute("DROP TABLE mine")


class Concurrency(Path):
    """Slots (a lease of 10 minutes), given back at the transaction's end."""

    concurrency = True
    algorithms = ("concurrency",)

    def __init__(self, function):
        super().__init__(function)
        self.functions = [function]

    def prepare(self, cell, algorithm, lim):
        if self.name.startswith("rl_acquire"):  # a concurrency policy
            args = "%s, %%s" % sql.Literal(
                cell.policy("concurrency", lim, LEASE_MS)).as_string(cell.admin)
        else:
            args = "%%s, %d, %d" % (lim, LEASE_MS)
        if self.name.endswith("_allow"):
            return "SELECT %s(%s)" % (self.name, args)
        return "SELECT (r).allowed FROM %s(%s) AS r" % (self.name, args)

    def calls(self, conn, ctx, identity, n):
        return [conn.execute(ctx, (identity,)).fetchone()[0] for _ in range(n)]


PATHS = [
    Explicit(""), Explicit("_allow"),
    Policy("rl_check"), Policy("rl_allow"),
    Policy("rl_check_all", several=True), Policy("rl_allow_all", several=True),
    Batch("rl_check_many"), Batch("rl_<algorithm>_many"),
    Guard("rl_guard"), Guard("rl_guard_statement"),
    Concurrency("rl_acquire"), Concurrency("rl_acquire_allow"),
    Concurrency("rl_concurrency_acquire"), Concurrency("rl_concurrency_acquire_allow"),
]
CONCURRENCY_PATHS = [p for p in PATHS if p.concurrency]
ALLOWED_THEN_DENIED = [True] * LIM + [False] * 2


def public(functions):
    """Whether the README's privilege table gives every one of the
    functions to PUBLIC by default (each must be named by one row)."""
    rows = readme_privileges()
    result = set()
    for function in functions:
        named = [r for r in rows if function in r.names]
        assert len(named) == 1, function
        result.add(named[0].public)
    assert len(result) == 1, functions
    return result.pop()


# ---------------------------------------------------------------- the cells


def check_own_connections(cell, conn, via_worker):
    """In the shared cell, the session opened a connection of its own
    exactly when the path does not go through the worker; in the
    shared-cluster cell, it used its own and none of the worker's."""
    if cell.name == "shared":
        assert own_connection_open(conn) is not via_worker
    if cell.name == "shared-cluster":
        session, worker = cell.connections_of(conn)
        assert session > 0 and worker == 0, (session, worker)


@pytest.mark.parametrize("path", PATHS, ids=repr)
def test_limit(cell, path):
    """lim 3: 3 of 5 in one transaction, then nothing more (a rate) or the
    3 slots back (concurrency); in the shared cell, only the batches open a
    connection of the session's own; in the shared-cluster cell, every
    path uses the session's own connections and none of the worker's."""
    conn = cell.session()
    for algorithm in path.algorithms:
        ctx = path.prepare(cell, algorithm, LIM)
        ident = new_ident("limit")
        with conn.transaction():
            assert path.calls(conn, ctx, ident, 5) == ALLOWED_THEN_DENIED, algorithm
        if path.concurrency:  # the slots came back at COMMIT
            with conn.transaction():
                assert path.calls(conn, ctx, ident, 5) == ALLOWED_THEN_DENIED
        else:
            assert path.calls(conn, ctx, ident, 2) == [False, False], algorithm
    check_own_connections(cell, conn, path.via_worker)


@pytest.mark.parametrize("path", PATHS, ids=repr)
def test_identity_bound(cell, path):
    """max_identity_bytes + 1 bytes: 54000 and no key written; the bound
    itself passes."""
    conn = cell.session()
    bound = max_identity_bytes(conn)
    # the bound is the one argument checker's: each function once
    for algorithm in path.algorithms[:len(path.functions)]:
        ctx = path.prepare(cell, algorithm, LIM)
        short, long = identity_of(60, "short"), identity_of(bound + 1, "long")
        before = sorted(cell.keys())
        assert sqlstate_of(lambda: path.bound_call(conn, ctx, short, long)) == "54000"
        assert sorted(cell.keys()) == before, algorithm
        with conn.transaction():
            assert path.calls(conn, ctx, identity_of(bound, "bound"), 1) == [True]


@pytest.mark.parametrize("path", PATHS, ids=repr)
def test_rollback_gives_back(cell, path):
    """refund_on_abort = all: 2 units taken in a rolled-back transaction
    come back, exactly."""
    conn = cell.session(refund_on_abort="all")
    for algorithm in path.algorithms:
        ctx = path.prepare(cell, algorithm, LIM)
        ident = new_ident("rollback")
        conn.execute("BEGIN")
        assert path.calls(conn, ctx, ident, 2) == [True, True]
        conn.execute("ROLLBACK")
        with conn.transaction():
            assert path.calls(conn, ctx, ident, 5) == ALLOWED_THEN_DENIED, algorithm


def wait_until_taken(path, conn, ctx, identity, what):
    """Until the session takes the slot (each try a transaction of its own,
    which gives a slot it took back); 5 s at most."""
    def taken():
        with conn.transaction():
            return path.calls(conn, ctx, identity, 1) == [True]
    wait_for(taken, 5.0, what)


def connect_first(path, holder, ctx, identity):
    """Takes and gives back the slot in a transaction of the holder's own,
    so that its connection (or the worker's) to the node is open and an
    interrupt that follows ends the acquire, not a connect that sent
    nothing."""
    with holder.transaction():
        assert path.calls(holder, ctx, identity, 1) == [True]


@pytest.mark.parametrize("path", CONCURRENCY_PATHS, ids=repr)
def test_terminated_holder_gives_back(cell, path):
    """The holder of the only slot terminated in its transaction: another
    session takes the slot within 5 s (lease 10 minutes)."""
    ctx = path.prepare(cell, "concurrency", 1)
    ident = new_ident("terminate")
    holder, other = cell.session(), cell.session()
    pid = holder.info.backend_pid
    holder.execute("BEGIN")
    assert path.calls(holder, ctx, ident, 1) == [True]
    with other.transaction():
        assert path.calls(other, ctx, ident, 1) == [False]
    assert cell.admin.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone()[0]
    wait_for(lambda: cell.admin.execute("SELECT count(*) = 0 FROM pg_stat_activity WHERE pid = %s",
                                        (pid,)).fetchone()[0], 10.0, "the backend to exit")
    wait_until_taken(path, other, ctx, ident, "the terminated holder's slot")


@pytest.mark.parametrize("path", CONCURRENCY_PATHS, ids=repr)
def test_timed_out_acquire_gives_back(cell, path):
    """An acquire ended by statement_timeout while its node is paused:
    once the pause ends, another session takes the slot within 5 s."""
    ctx = path.prepare(cell, "concurrency", 1)
    ident = new_ident("timeout")
    holder, other = cell.session(), cell.session()
    connect_first(path, holder, ctx, ident)
    holder.execute("SET statement_timeout = '100ms'")
    holder.execute("BEGIN")
    cell.node_of(ident).command("CLIENT", "PAUSE", str(PAUSE_MS), "ALL")
    assert sqlstate_of(lambda: path.calls(holder, ctx, ident, 1)) == "57014"
    holder.execute("ROLLBACK")
    wait_until_taken(path, other, ctx, ident, "the timed-out acquire's slot")


def waiting_in_extension(admin, pid):
    """Whether the backend runs a query and waits in rl_redis (on its Redis
    socket or the worker's reply)."""
    return admin.execute("SELECT count(*) = 1 FROM pg_stat_activity WHERE pid = %s "
                         "AND state = 'active' AND wait_event_type = 'Extension'",
                         (pid,)).fetchone()[0]


@pytest.mark.parametrize("path", CONCURRENCY_PATHS, ids=repr)
def test_cancelled_acquire_gives_back(cell, path):
    """An acquire (lim 1) cancelled by pg_cancel_backend while it waits for
    Redis (the node of its key paused by CLIENT PAUSE WRITE: the call sent,
    or taken by the worker): 57014; the pause lifted and the holder's block
    rolled back, another session takes the slot within 5 s (the lease is 10
    minutes): the release queued at the abort reached Redis after the
    acquire. Without that release (rl_release_asking in src/slots.c
    dropping it), every cell fails here."""
    ctx = path.prepare(cell, "concurrency", 1)
    ident = new_ident("cancel")
    holder, other = cell.session(), cell.session()
    pid = holder.info.backend_pid
    connect_first(path, holder, ctx, ident)
    node = cell.node_of(ident)
    holder.execute("BEGIN")
    # WRITE: the scripts wait, and CLIENT UNPAUSE still runs (Redis 7.0
    # makes it wait too under ALL)
    node.command("CLIENT", "PAUSE", str(CANCEL_PAUSE_MS), "WRITE")
    try:
        call = QueryThread(holder, ctx, (ident,))
        call.start()
        wait_for(lambda: waiting_in_extension(cell.admin, pid), 10.0, "the acquire to wait for Redis")
        assert cell.admin.execute("SELECT pg_cancel_backend(%s)", (pid,)).fetchone()[0]
        call.join(30)
        assert not call.is_alive(), "the cancel did not end the acquire within 30 s"
        assert isinstance(call.error, psycopg.errors.QueryCanceled), call.error
    finally:
        node.command("CLIENT", "UNPAUSE")
    holder.execute("ROLLBACK")
    wait_until_taken(path, other, ctx, ident, "the cancelled acquire's slot")


@pytest.mark.parametrize("path", PATHS, ids=repr)
def test_privilege(cell, path):
    """A role granted nothing executes the path as the README's privilege
    table says: the limit holds for it, or 42501 and no key written."""
    ctx = path.prepare(cell, path.algorithms[0], LIM)
    role = cell.role()
    conn = cell.session()
    conn.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(role)))
    ident = new_ident("privilege")
    if public(path.functions):
        assert path.role_attempt(conn, ctx, ident) == ALLOWED_THEN_DENIED
    else:
        assert sqlstate_of(lambda: path.role_attempt(conn, ctx, ident)) == "42501"
        assert cell.keys() == []
    conn.execute("RESET ROLE")


# ---------------------------------------------------------------- refunds


class Refund:
    """A refund path and the decision that charges what it gives back."""

    def __init__(self, name):
        self.name = name
        self.functions = ([name] if name == "rl_refund"
                          else ["rl_%s_refund" % a for a in ALGORITHMS])

    def prepare(self, cell, algorithm):
        if self.name == "rl_refund":
            policy = sql.Literal(cell.policy(algorithm, LIM, WINDOW_MS)).as_string(cell.admin)
            return ("SELECT %s FROM rl_check(%s, %%s, %%s) AS r" % (COLS, policy),
                    "SELECT %s FROM rl_refund(%s, %%s, %%s) AS r" % (COLS, policy))
        return tuple("SELECT %s FROM rl_%s%s(%%s, %d, %d, %%s) AS r"
                     % (COLS, algorithm, suffix, LIM, WINDOW_MS) for suffix in ("", "_refund"))

    def __repr__(self):
        return self.name


REFUNDS = [Refund("rl_<algorithm>_refund"), Refund("rl_refund")]


@pytest.mark.parametrize("path", REFUNDS, ids=repr)
def test_refund_exact(cell, path):
    """3 taken, 2 given back: 2 remaining; 5 more: lim, never above it."""
    conn = cell.session()
    for algorithm in ALGORITHMS:
        charge, refund = path.prepare(cell, algorithm)
        ident = new_ident("refund")
        assert conn.execute(charge, (ident, 3)).fetchone() == (True, 0), algorithm
        assert conn.execute(refund, (ident, 2)).fetchone()[1] == 2, algorithm
        assert conn.execute(charge, (ident, 0)).fetchone() == (True, 2), algorithm
        assert conn.execute(refund, (ident, 5)).fetchone()[1] == LIM, algorithm
        assert [conn.execute(charge, (ident, 1)).fetchone()[0] for _ in range(5)] == \
            ALLOWED_THEN_DENIED, algorithm


@pytest.mark.parametrize("path", REFUNDS, ids=repr)
def test_refund_identity_bound(cell, path):
    """A refund takes identities up to 1 MB (over max_identity_bytes: no
    key made); over 1 MB: 54000; no key written either way."""
    conn = cell.session()
    charge, refund = path.prepare(cell, "fixed")
    over = identity_of(max_identity_bytes(conn) + 1, "over")
    conn.execute(refund, (over, 1))
    too_long = identity_of(MAX_REFUND_IDENTITY + 1, "huge")
    assert sqlstate_of(lambda: conn.execute(refund, (too_long, 1))) == "54000"
    assert cell.keys() == []


@pytest.mark.parametrize("path", REFUNDS, ids=repr)
def test_refund_privilege(cell, path):
    """A role granted nothing may not give back (as the README's table
    says): 42501 and the charge stays."""
    charge, refund = path.prepare(cell, "fixed")
    ident = new_ident("refund")
    admin_session = cell.session()
    assert admin_session.execute(charge, (ident, 3)).fetchone() == (True, 0)
    conn = cell.session()
    conn.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(cell.role())))
    assert not public(path.functions)
    assert sqlstate_of(lambda: conn.execute(refund, (ident, 3))) == "42501"
    conn.execute("RESET ROLE")
    assert admin_session.execute(charge, (ident, 0)).fetchone() == (True, 0)


# ---------------------------------------------------------------- inspection

INSPECTED = ALGORITHMS + ("concurrency",)


def inspect(conn, policy, identity):
    """(allowed, remaining) of rl_inspect of one unit."""
    return conn.execute("SELECT (r).allowed, (r).remaining FROM rl_inspect(%s, %s) AS r",
                        (policy, identity)).fetchone()


@pytest.mark.parametrize("algorithm", INSPECTED)
def test_inspect_charges_nothing(cell, algorithm):
    """rl_inspect (a dry run) of a fresh identity: the full quota, five
    times, and no key; with 2 units taken (2 slots held, in the holder's
    open transaction): what is left, five times, and every key under the
    prefix as it was (value and expiry); then exactly lim - 2 more pass."""
    concurrency = algorithm == "concurrency"
    policy = cell.policy(algorithm, LIM, LEASE_MS if concurrency else WINDOW_MS)
    take = "SELECT %s(%%s, %%s)" % ("rl_acquire_allow" if concurrency else "rl_allow")
    # a concurrency inspection counts the slots held; a rate one, the unit it asks
    full = LIM if concurrency else LIM - 1
    conn, holder = cell.session(), cell.session()
    ident = new_ident("inspect")
    assert [inspect(conn, policy, ident) for _ in range(5)] == [(True, full)] * 5
    assert cell.keys() == []
    with holder.transaction():
        assert [holder.execute(take, (policy, ident)).fetchone()[0] for _ in range(2)] == [True] * 2
        before = cell.snapshot()
        assert [inspect(conn, policy, ident) for _ in range(5)] == [(True, full - 2)] * 5
        assert cell.snapshot() == before
        assert [holder.execute(take, (policy, ident)).fetchone()[0] for _ in range(3)] == \
            [True, False, False]
    assert inspect(conn, policy, ident) == ((True, full) if concurrency else (False, 0))
    check_own_connections(cell, conn, True)


@pytest.mark.parametrize("algorithm", ("fixed", "concurrency"))
def test_inspect_identity_bound(cell, algorithm):
    """rl_inspect of max_identity_bytes + 1 bytes: 54000; of the bound:
    decided; no key written either way."""
    policy = cell.policy(algorithm, LIM, LEASE_MS if algorithm == "concurrency" else WINDOW_MS)
    conn = cell.session()
    bound = max_identity_bytes(conn)
    long = identity_of(bound + 1, "long")
    assert sqlstate_of(lambda: inspect(conn, policy, long)) == "54000"
    assert inspect(conn, policy, identity_of(bound, "bound"))[0] is True
    assert cell.keys() == []


def test_inspect_privilege(cell):
    """A role granted nothing inspects as the README's privilege table
    says (rl_inspect with the policy decisions): what is left of a quota
    another session used, and nothing charged; or 42501."""
    policy = cell.policy("fixed", LIM, WINDOW_MS)
    ident = new_ident("inspect")
    admin_session = cell.session()
    assert admin_session.execute("SELECT rl_allow(%s, %s)", (policy, ident)).fetchone()[0]
    before = cell.snapshot()
    conn = cell.session()
    conn.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(cell.role())))
    if public(["rl_inspect"]):
        assert [inspect(conn, policy, ident) for _ in range(5)] == [(True, LIM - 2)] * 5
    else:
        assert sqlstate_of(lambda: inspect(conn, policy, ident)) == "42501"
    conn.execute("RESET ROLE")
    assert cell.snapshot() == before


# ---------------------------------------------------------------- releases


class Release:
    """An explicit release and the acquire whose slot it gives back."""

    def __init__(self, name):
        self.name = name
        self.functions = [name]

    def prepare(self, cell, lim):
        """(acquire, release): queries of one identity, each a boolean."""
        if self.name == "rl_release":
            policy = sql.Literal(cell.policy("concurrency", lim, LEASE_MS)).as_string(cell.admin)
            return ("SELECT rl_acquire_allow(%s, %%s)" % policy,
                    "SELECT rl_release(%s, %%s)" % policy)
        return ("SELECT rl_concurrency_acquire_allow(%%s, %d, %d)" % (lim, LEASE_MS),
                "SELECT rl_concurrency_release(%s)")

    def __repr__(self):
        return self.name


RELEASES = [Release("rl_release"), Release("rl_concurrency_release")]


def answers(conn, query, identity, n):
    """The answers of n calls of a boolean query of one identity."""
    return [conn.execute(query, (identity,)).fetchone()[0] for _ in range(n)]


@pytest.mark.parametrize("path", RELEASES, ids=repr)
def test_release_exact(cell, path):
    """lim 3, all held by one transaction: a release gives back exactly one
    slot (another session takes one, not two); the holder's two left give
    back true, one more false; its COMMIT then gives back nothing of the
    other's (a third session takes 2 of 3); all back after both ends."""
    acquire, release = path.prepare(cell, LIM)
    ident = new_ident("release")
    holder, other, third = cell.session(), cell.session(), cell.session()
    holder.execute("BEGIN")
    assert answers(holder, acquire, ident, 4) == [True] * 3 + [False]
    assert answers(holder, release, ident, 1) == [True]
    other.execute("BEGIN")
    assert answers(other, acquire, ident, 2) == [True, False]
    assert answers(holder, release, ident, 3) == [True, True, False]
    holder.execute("COMMIT")
    with third.transaction():
        assert answers(third, acquire, ident, 3) == [True, True, False]
    other.execute("COMMIT")
    with third.transaction():
        assert answers(third, acquire, ident, 5) == ALLOWED_THEN_DENIED
    # an explicit release is a plain Redis command, on the session's own
    # connection (README, "The shared transport")
    check_own_connections(cell, holder, False)


@pytest.mark.parametrize("path", RELEASES, ids=repr)
def test_release_identity_bound(cell, path):
    """A release takes identities up to 1 MB (over max_identity_bytes: it
    held none, false); over 1 MB: 54000; no key written either way."""
    acquire, release = path.prepare(cell, LIM)
    conn = cell.session()
    over = identity_of(max_identity_bytes(conn) + 1, "over")
    assert answers(conn, release, over, 1) == [False]
    too_long = identity_of(MAX_REFUND_IDENTITY + 1, "huge")
    assert sqlstate_of(lambda: answers(conn, release, too_long, 1)) == "54000"
    assert cell.keys() == []


@pytest.mark.parametrize("path", RELEASES, ids=repr)
def test_release_privilege(cell, path):
    """A role granted nothing releases as the README's table says: false
    (it holds nothing) or 42501; either way the slot another session holds
    (lim 1) stays taken."""
    acquire, release = path.prepare(cell, 1)
    ident = new_ident("release")
    holder, other = cell.session(), cell.session()
    holder.execute("BEGIN")
    assert answers(holder, acquire, ident, 1) == [True]
    conn = cell.session()
    conn.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(cell.role())))
    if public(path.functions):
        assert answers(conn, release, ident, 2) == [False, False]
    else:
        assert sqlstate_of(lambda: answers(conn, release, ident, 1)) == "42501"
    conn.execute("RESET ROLE")
    with other.transaction():
        assert answers(other, acquire, ident, 1) == [False]
    holder.execute("COMMIT")


# ---------------------------------------------------------------- reset


def test_reset_exact(cell):
    """rl_reset of an identity used up under every algorithm (an explicit
    limit and a policy each) and holding the only slot of an explicit
    concurrency limit: every key of the identity gone, the full quota
    again (3 of 5 each) and the slot free for another session; a
    neighbour's keys as they were; the holder's COMMIT then frees nothing
    of the other's."""
    conn, holder, other = cell.session(), cell.session(), cell.session()
    ident, neighbour = new_ident("reset"), new_ident("neighbour")
    explicit = "SELECT rl_%s_allow(%%s, %d, %d)"
    policies = {a: sql.Literal(cell.policy(a, LIM, WINDOW_MS)).as_string(cell.admin)
                for a in ALGORITHMS}
    queries = [explicit % (a, LIM, WINDOW_MS) for a in ALGORITHMS] + \
        ["SELECT rl_allow(%s, %%s)" % policies[a] for a in ALGORITHMS]
    for query in queries:
        assert answers(conn, query, ident, 5) == ALLOWED_THEN_DENIED, query
        assert answers(conn, query, neighbour, 1) == [True], query
    slot = "SELECT rl_concurrency_acquire_allow(%%s, 1, %d)" % LEASE_MS
    holder.execute("BEGIN")
    assert answers(holder, slot, ident, 1) == [True]
    neighbours = {k: v for k, v in cell.snapshot().items() if "{%s}" % neighbour in k}
    assert len(neighbours) == len(queries)
    conn.execute("SELECT rl_reset(%s)", (ident,))
    assert cell.keys_of(ident) == []
    assert {k: v for k, v in cell.snapshot().items() if "{%s}" % neighbour in k} == neighbours
    for query in queries:
        assert answers(conn, query, ident, 5) == ALLOWED_THEN_DENIED, query
    other.execute("BEGIN")
    assert answers(other, slot, ident, 2) == [True, False]
    holder.execute("COMMIT")
    with conn.transaction():
        assert answers(conn, slot, ident, 1) == [False]
    other.execute("COMMIT")


def test_reset_identity_bound(cell):
    """rl_reset takes identities up to 1 MB (over max_identity_bytes: there
    is nothing to delete); over 1 MB: 54000; no key written either way."""
    conn = cell.session()
    conn.execute("SELECT rl_reset(%s)", (identity_of(max_identity_bytes(conn) + 1, "over"),))
    too_long = identity_of(MAX_REFUND_IDENTITY + 1, "huge")
    assert sqlstate_of(lambda: conn.execute("SELECT rl_reset(%s)", (too_long,))) == "54000"
    assert cell.keys() == []


def test_reset_privilege(cell):
    """A role granted nothing may not reset (as the README's table says):
    42501 and every key as it was."""
    ident = new_ident("reset")
    admin_session = cell.session()
    assert admin_session.execute("SELECT rl_fixed_allow(%s, 3, 60000)", (ident,)).fetchone()[0]
    before = cell.snapshot()
    conn = cell.session()
    conn.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(cell.role())))
    assert not public(["rl_reset"])
    assert sqlstate_of(lambda: conn.execute("SELECT rl_reset(%s)", (ident,))) == "42501"
    conn.execute("RESET ROLE")
    assert cell.snapshot() == before
