"""The shared transport (1.5): rl_redis.transport = shared.

With the library preloaded and rl_redis.mode standalone, a session's script
calls (rl_check, rl_allow, rl_<algorithm>, rl_acquire ...) go through a
queue in shared memory (rl_redis.shared_queue_size entries) to one background
worker ("postgres: rl_redis worker"), which sends them pipelined on its own
connection. A session uses its own connection instead when the worker is
not running, when its connection settings differ from the worker's, when
the queue is full (LOG once per session), for a call over 8 KB, for
batches (rl_check_many ...), and while its own connection still has
transaction-end work queued. Transaction-end work (refunds, slot releases)
of a session without an open connection is handed to the worker without
waiting. A waiting session is bounded by connect_timeout + command_timeout
and ends at once on cancel / statement_timeout (57014); a call the worker
had taken when it exited fails (08006), calls still queued are sent by
their sessions.

Covered: the rows of every algorithm (explicit and policy forms, and
concurrency slots with savepoints) equal those of backend mode; 8 and 100
concurrent sessions hold one Redis connection (the worker's) instead of one
each; exact limits and no misrouted reply under 16 sessions; refunds on
rollback and slot releases handed to the worker; a session-level
rl_redis.port, batches and calls over 8 KB on the session's own connection;
replies over a slot's 2 KB (rl_check_all of 80 policies, a statement guard
over 70 tenants, rl_top_denied); cancel, statement_timeout and the
session's own wait bound with Redis paused, with no stale reply afterwards;
the worker killed with calls taken and queued, and under load; a full
queue; the worker reconnecting (FUNCTION FLUSH, Redis restarted, CLIENT
KILL), its idle_timeout and a reload that moves it to another Redis; no
worker at all (library not preloaded).

Regressions of the 1.5 review: with transport = shared in postgresql.conf
(the worker reads it too) the worker's own retries of a call whose
function Redis lacks go on its own connection, not into its own queue (a
call after FUNCTION FLUSH answers within 500 ms), and several calls of
functions Redis does not have in one worker round (3 sessions, fixed,
sliding and gcra, Redis held by CLIENT PAUSE) all run, after a new worker
or a FUNCTION FLUSH; the rollback refund
of 300 keys is cut to what a slot holds and handed to the worker (every
key's quota back, the session never connected); rl_redis.shared_queue_size
in the postgresql.conf of a server without preloading warns no session.

These tests start throwaway PostgreSQL servers that preload rl_redis (but
one) and point at a Redis of their own, so that CLIENT LIST counts exactly the
connections of that server's processes (matched by local port through
/proc: the tests run as root or as the cluster owner):
  shared_server   one per module, max_connections 150 (the 100-session test)
  clusters        per test, for tests that pause Redis, kill the worker,
                  shrink the queue, set the transport in postgresql.conf or
                  do not preload
The worker is found among the postmaster's children by its command line;
pg_terminate_backend() cannot end it (it is not a backend of the proc
array), so the tests send it SIGTERM; those that wait for the new worker
set rl_redis.worker_restart_interval = 0 (production: 1 s), so that it runs
at once. Decisions are made on a frozen clock
(rl_redis.test_clock_ms) unless said otherwise, so every count is exact.
"""

import os
import signal
import threading
import time
import uuid

import psycopg
import psycopg.errors
import pytest

from conftest import (fixed_units, give_back_session, PgServer, QueryThread, new_ident, own_connection_open,
                      pg_connect, redis_clients, rl_key, same_fixed_window, set_gucs, take_session, wait_for)
from redis_topology import made_policies
from test_batch import wait_until_active

TEST_CLOCK_MS = 1800000000000  # a frozen clock on a whole minute (2027-01-15)
CENTURY_MS = 3153600000000  # a fixed window no test run crosses
ALGORITHMS = ["fixed", "sliding", "token_bucket", "gcra", "sliding_counter"]
BURST_ALGORITHMS = ("token_bucket", "gcra")
COLS = "(r).allowed, (r).lim, (r).remaining, (r).reset_ms, (r).retry_after_ms"
DENY_RETRY_MS = 1000  # retry_after_ms of an on_error = 'deny' fallback
QUEUE_FULL = "the shared queue is full"
WORKER_EXITED = "the rl_redis worker exited while a call to Redis was on its way"
WORKER_RESTART_S = 0  # rl_redis.worker_restart_interval of the servers whose worker is killed


def close_and_wait(conns, timeout=15.0):
    """Closes the sessions and waits until their backends have exited (so
    that their Redis connections are gone too)."""
    pids = [c.info.backend_pid for c in conns if not c.closed]
    for c in conns:
        c.close()
    wait_for(lambda: not any(os.path.exists("/proc/%d" % p) for p in pids), timeout,
             "the backends to exit")


# ---------------------------------------------------------------- calls


def explicit(conn, algorithm, identity, lim, window_ms, cost=1, burst=None):
    """rl_<algorithm>(...) as (allowed, lim, remaining, reset_ms, retry_after_ms)."""
    args = "%s, %s, %s, %s" + (", %s" if burst is not None else "")
    params = (identity, lim, window_ms, cost) + ((burst,) if burst is not None else ())
    return conn.execute("SELECT %s FROM rl_%s(%s) AS r" % (COLS, algorithm, args),
                        params).fetchone()


def check(conn, policy, identity, cost=1):
    return conn.execute("SELECT %s FROM rl_check(%%s, %%s, %%s) AS r" % COLS,
                        (policy, identity, cost)).fetchone()


def error_of(conn, query, params=None):
    """The psycopg.Error that query raises (fails the test when none)."""
    with pytest.raises(psycopg.Error) as excinfo:
        conn.execute(query, params).fetchall()
    return excinfo.value


def wait_all_waiting(admin, pids, timeout=20.0):
    """Until every backend of pids runs a query and waits in the extension
    (on the queue or on its own Redis socket)."""
    def ready():
        rows = admin.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s) AND state = 'active' "
            "AND wait_event_type = 'Extension'", (list(pids),)).fetchone()
        return rows[0] == len(pids)
    wait_for(ready, timeout, "%d sessions waiting in rl_redis" % len(pids))


def run_threads(n, body, timeout=180):
    """Runs body(i) for i in range(n) in threads started together; returns
    the exceptions raised."""
    barrier = threading.Barrier(n)
    errors = []

    def target(i):
        try:
            barrier.wait(timeout=60)
            body(i)
        except BaseException as e:  # reported by the caller
            errors.append((i, e))

    threads = [threading.Thread(target=target, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert not any(t.is_alive() for t in threads), "a session hung"
    return errors


# ---------------------------------------------------------------- fixtures


@pytest.fixture
def admin(shared_server):
    conn = shared_server.connect()
    try:
        yield conn
    finally:
        conn.close()


@pytest.fixture
def policies(admin):
    yield from made_policies(admin, "t_shared")


@pytest.fixture
def sessions(shared_server):
    """sessions(n, **gucs) -> n sessions of shared_server (take_session),
    each on the frozen clock unless test_clock_ms=0 is given; at teardown
    given back, or closed and waited for (close_and_wait)."""
    made = []

    def make(n, **gucs):
        gucs.setdefault("test_clock_ms", TEST_CLOCK_MS)
        conns = [take_session(shared_server) for _ in range(n)]
        made.extend(conns)
        for conn in conns:
            set_gucs(conn, **gucs)
        return conns

    yield make
    pids = {id(c): c.info.backend_pid for c in made if not c.closed}
    closed = [c for c in made if not c.closed and not give_back_session(c)]
    wait_for(lambda: not any(os.path.exists("/proc/%d" % pids[id(c)]) for c in closed), 15.0,
             "the backends to exit")


@pytest.fixture
def clusters(redis_factory):
    """clusters(max_connections=20, preload=True, **conf) -> (PgServer, its
    RedisServer): a new (preloaded) server on a new Redis with
    rl_redis.<k> = v of conf, for one test (removed at teardown)."""
    made = []

    def make(**conf):
        redis = redis_factory()
        server = PgServer(redis, **conf)
        made.append(server)
        return server, redis

    yield make
    for server in made:
        if server.redis.paused:
            server.redis.resume()
        server.remove()


# ------------------------------------------------- same decisions as backend


def sequence(conn, algorithm, ident, policy, burst):
    """A fixed sequence of explicit and policy decisions on ident, with
    costs 1, 2, 0 and above the limit and the frozen clock moved on; the
    rows in order. The session ends on the clock it began with."""
    rows = []
    for offset, cost, n in [(0, 1, 7), (0, 2, 2), (0, 0, 1), (0, 9, 1), (0, 7, 1),
                            (30000, 1, 3), (30000, 0, 1), (60001, 1, 6), (60001, 2, 2)]:
        set_gucs(conn, test_clock_ms=TEST_CLOCK_MS + offset)
        for _ in range(n):
            rows.append(("x",) + tuple(explicit(conn, algorithm, ident, 5, 60000, cost, burst)))
            rows.append(("p",) + tuple(check(conn, policy, ident, cost)))
    set_gucs(conn, test_clock_ms=TEST_CLOCK_MS)
    return rows


def concurrency_sequence(conn, ident, release=False):
    """Acquires in transactions (lim 3, lease 60 s): 4 in one transaction,
    then after its COMMIT (the slots given back) 3 more, two of them in a
    savepoint rolled back; with release, rl_concurrency_release (a plain
    ZREM, not a script call) and one more acquire. The rows in order."""
    rows = []
    acquire = "SELECT %s FROM rl_concurrency_acquire(%%s, 3, 60000) AS r" % COLS
    with conn.transaction():
        for _ in range(4):
            rows.append(conn.execute(acquire, (ident,)).fetchone())
    with conn.transaction():
        rows.append(conn.execute(acquire, (ident,)).fetchone())
        with conn.transaction():  # a savepoint, rolled back
            rows.append(conn.execute(acquire, (ident,)).fetchone())
            rows.append(conn.execute(acquire, (ident,)).fetchone())
            raise psycopg.Rollback()  # swallowed by the block
        rows.append(conn.execute(acquire, (ident,)).fetchone())
        if release:
            rows.append(conn.execute("SELECT rl_concurrency_release(%s)", (ident,)).fetchone())
            rows.append(conn.execute(acquire, (ident,)).fetchone())
    rows.append(conn.execute(acquire, (ident,)).fetchone())
    return rows


LIMITS = [(a, None) for a in ALGORITHMS] + [(a, 8) for a in BURST_ALGORITHMS]


@pytest.mark.parametrize("algorithm, burst", LIMITS,
                         ids=["%s-burst%s" % (a, b) for a, b in LIMITS])
def test_same_decisions_as_backend(shared_server, sessions, policies, algorithm, burst):
    """Every algorithm (explicit form and rl_check on a policy), frozen
    clock: the rows of a shared session equal those of a backend session,
    and the shared session never opens a connection of its own."""
    policy = policies(algorithm, 5, 60000, burst)
    shared, backend = sessions(1, transport="shared") + sessions(1, transport="backend")
    want = sequence(backend, algorithm, new_ident("be"), policy, burst)
    got = sequence(shared, algorithm, new_ident("sh"), policy, burst)
    assert got == want
    # the sequence decides something
    allowed = [r[1] for r in want]
    assert True in allowed and False in allowed
    assert all(r[2] == (burst or 5) for r in want)

    assert not own_connection_open(shared)
    assert own_connection_open(backend)
    clients = shared_server.clients()
    assert shared.info.backend_pid not in clients, clients
    assert clients.get(backend.info.backend_pid) == 1, clients
    assert clients.get(shared_server.worker_pid()) == 1, clients


def test_same_concurrency_decisions_as_backend(shared_server, sessions):
    """rl_concurrency_acquire in transactions and savepoints: the slot
    releases of a shared session without a connection of its own are handed
    to the worker, and every row equals the backend session's. Then the
    same with rl_concurrency_release (not a script call: it goes on the
    session's own connection), rows still equal."""
    shared, backend = sessions(1, transport="shared") + sessions(1, transport="backend")
    want = concurrency_sequence(backend, new_ident("cbe"))
    got = concurrency_sequence(shared, new_ident("csh"))
    assert got == want
    assert [r[:3] for r in want] == [(True, 3, 2), (True, 3, 1), (True, 3, 0), (False, 3, 0),
                                     (True, 3, 2), (True, 3, 1), (True, 3, 0), (True, 3, 1),
                                     (True, 3, 2)]
    assert not own_connection_open(shared)
    assert shared.info.backend_pid not in shared_server.clients()

    want = concurrency_sequence(backend, new_ident("rbe"), release=True)
    got = concurrency_sequence(shared, new_ident("rsh"), release=True)
    assert got == want
    assert [r[:3] for r in want[8:]] == [(True,), (True, 3, 1), (True, 3, 2)]


def test_release_at_commit_is_seen_when_commit_returns(shared_server, sessions):
    """A concurrency slot (lim 1) taken and released at COMMIT by one shared
    session is free for another shared session as soon as COMMIT returned:
    the release handed to the worker is waited for within the transaction
    end's budget. 300 alternations, none denied; neither session opens a
    connection of its own."""
    a, b = sessions(2, transport="shared")
    ident = new_ident("relcommit")
    query = "SELECT (r).allowed FROM rl_concurrency_acquire(%s, 1, 60000) AS r"
    denied = 0
    for i in range(300):
        conn = a if i % 2 == 0 else b
        if not conn.execute(query, (ident,)).fetchone()[0]:
            denied += 1
    assert denied == 0
    assert not own_connection_open(a) and not own_connection_open(b)


def test_stale_deferred_slots_do_not_hold_commit(shared_server, sessions, policies):
    """A shared session without a connection of its own, two concurrency
    policies: BEGIN; rl_acquire(p1); rl_acquire(p2); COMMIT (two slot
    releases handed to the worker, in two slots of its queue), then BEGIN;
    rl_acquire(p1); COMMIT, alternately 10 times each. A deferred slot the
    session had waited for was freed with its owner and flags left set; one
    the next call did not take again made the next COMMIT wait for it the
    whole 1 s budget (every other COMMIT). Now every COMMIT takes < 300 ms,
    and every acquire finds the slots of the previous transaction released
    (remaining 4 of 5)."""
    p1 = policies("concurrency", 5, 60000)
    p2 = policies("concurrency", 5, 60000)
    conn = sessions(1, transport="shared")[0]
    ident = new_ident("stale")
    acquire = "SELECT (r).allowed, (r).lim, (r).remaining FROM rl_acquire(%s, %s) AS r"
    commits = []
    for k in range(20):
        conn.execute("BEGIN")
        assert conn.execute(acquire, (p1, ident)).fetchone() == (True, 5, 4), k
        if k % 2 == 0:
            assert conn.execute(acquire, (p2, ident)).fetchone() == (True, 5, 4), k
        t0 = time.monotonic()
        conn.execute("COMMIT")
        commits.append(round(time.monotonic() - t0, 3))
    assert max(commits) < 0.3, commits
    assert not own_connection_open(conn)
    assert conn.info.backend_pid not in shared_server.clients()


LONG_LEASE_MS = 600000  # 10 minutes: a slot freed in a test was given back, not expired


def test_cancelled_acquires_give_their_slots_back(shared_server, sessions):
    """4 shared sessions, 150 rounds each of BEGIN; SET LOCAL
    statement_timeout = '1ms'; rl_concurrency_acquire_allow (lim 2, lease
    10 minutes); ROLLBACK: many acquires are cancelled while the worker has
    them, and Redis may have given their slots. Once the sessions are
    closed, no slot is taken and a new session takes both at once (before,
    the release of a cancelled acquire was queued only when the session's
    own connection had sent it, which the worker path never says: the
    slots stayed taken for the whole lease)."""
    ident = new_ident("cancelled")
    conns = sessions(4, transport="shared")
    acquire = "SELECT rl_concurrency_acquire_allow(%%s, 2, %d)" % LONG_LEASE_MS
    cancelled = [0] * len(conns)

    def body(i):
        for _ in range(150):
            conns[i].execute("BEGIN")
            try:
                # the 1 ms may end the SET itself (extended protocol)
                conns[i].execute("SET LOCAL statement_timeout = '1ms'")
                conns[i].execute(acquire, (ident,))
            except psycopg.errors.QueryCanceled:
                cancelled[i] += 1
            # the ROLLBACK runs under the 1 ms too: a loaded machine cancels
            # it now and then before it starts (the transaction stays open)
            for _ in range(50):
                try:
                    conns[i].execute("ROLLBACK")
                    break
                except psycopg.errors.QueryCanceled:
                    pass
            else:
                raise AssertionError("50 ROLLBACKs were cancelled")

    assert run_threads(len(conns), body) == []
    assert sum(cancelled) > 0
    close_and_wait(conns)
    key = rl_key("concurrency", ident, lim=2, window_ms=LONG_LEASE_MS)
    assert int(shared_server.redis.command("ZCARD", key)) == 0, sum(cancelled)
    fresh = sessions(1, transport="shared")[0]
    with fresh.transaction():
        assert [fresh.execute(acquire, (ident,)).fetchone()[0] for _ in range(3)] == \
            [True, True, False]


def test_terminated_holders_give_their_slots_back(clusters):
    """Shared sessions holding a slot (lim 1, lease 10 minutes) are ended by
    pg_terminate_backend: one idle in its transaction, one while the worker
    has its acquire and Redis sleeps (SIGSTOP; the worker's command_timeout
    30 s). Once Redis wakes, each slot is free without waiting for its
    lease, and another session takes it (before, the acquire the worker had
    taken was never given back)."""
    server, redis = clusters(command_timeout=30000, connect_timeout=30000)
    admin = server.connect()
    acquire = "SELECT rl_concurrency_acquire_allow(%%s, 1, %d)" % LONG_LEASE_MS
    try:
        for in_flight in (False, True):
            ident = new_ident("terminated")
            key = rl_key("concurrency", ident, lim=1, window_ms=LONG_LEASE_MS)
            holder = server.connect(transport="shared")
            pid = holder.info.backend_pid
            assert holder.execute("SELECT rl_fixed_allow(%s, 5, 60000)",
                                  (new_ident("warm"),)).fetchone()[0] is True
            holder.execute("BEGIN")
            call = None
            if in_flight:
                redis.pause()
                call = QueryThread(holder, acquire, (ident,))
                call.start()
                wait_until_active(admin, pid)
                time.sleep(0.5)  # the worker takes it (not observable while Redis sleeps)
            else:
                assert holder.execute(acquire, (ident,)).fetchone()[0] is True
                assert int(redis.command("ZCARD", key)) == 1
            try:
                assert admin.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone()[0]
                wait_for(lambda: not os.path.exists("/proc/%d" % pid), 15.0,
                         "the terminated backend to exit")
            finally:
                redis.resume()
            if call is not None:
                call.join(10)
                assert call.error is not None
            holder.close()
            wait_for(lambda: int(redis.command("ZCARD", key)) == 0, 5.0,
                     "the slot given back (in flight: %s)" % in_flight)
            other = server.connect(transport="shared")
            with other.transaction():
                assert other.execute(acquire, (ident,)).fetchone()[0] is True
            other.close()
    finally:
        admin.close()


def test_eight_sessions_one_connection(shared_server, sessions, policies):
    """8 shared sessions at once, every algorithm: each gets the rows a
    backend session gets, and the server holds exactly one connection to
    Redis (the worker's) before and after: no session opened one."""
    before = shared_server.clients()
    worker = shared_server.worker_pid()
    assert before == {worker: 1}, before
    made = {a: policies(a, 5, 60000) for a in ALGORITHMS}
    ref = sessions(1, transport="backend")[0]
    want = {a: sequence(ref, a, new_ident("ref"), made[a], None) for a in ALGORITHMS}
    close_and_wait([ref])
    conns = sessions(8, transport="shared")
    got = [dict() for _ in conns]

    def body(i):
        for a in ALGORITHMS:
            got[i][a] = sequence(conns[i], a, new_ident("s%d" % i), made[a], None)

    assert run_threads(len(conns), body) == []
    for i in range(len(conns)):
        assert got[i] == want, i
    after = shared_server.clients()
    assert after == {worker: 1}, after
    assert [own_connection_open(c) for c in conns] == [False] * len(conns)


# ---------------------------------------------------------- connection count


@pytest.mark.parametrize("n", [8, pytest.param(100, marks=pytest.mark.heavy)])
def test_connection_count(shared_server, sessions, policies, capsys, n):
    """n sessions calling rl_allow at once (20 calls each, lim 10 per
    session's identity): shared -> the server holds 1 connection to Redis
    (the worker's), none of a session; then the same sessions with
    transport backend -> one per session. Every session gets exactly 10
    allowed in both modes."""
    policy = policies("fixed", 10, CENTURY_MS)
    figures = {}
    conns = sessions(n, test_clock_ms=0)
    pids = [c.info.backend_pid for c in conns]
    for mode in ("shared", "backend"):
        for conn in conns:
            set_gucs(conn, transport=mode)
        base = new_ident("count-%s" % mode)
        allowed = [0] * n

        def body(i):
            for _ in range(20):
                allowed[i] += conns[i].execute("SELECT rl_allow(%s, %s)",
                                               (policy, "%s:%d" % (base, i))).fetchone()[0]

        t0 = time.monotonic()
        assert run_threads(n, body) == []
        elapsed = time.monotonic() - t0
        assert allowed == [10] * n
        clients = shared_server.clients()
        worker = shared_server.worker_pid()
        from_sessions = sum(clients.get(p, 0) for p in pids)
        figures[mode] = (sum(clients.values()), from_sessions, elapsed)
        if mode == "shared":
            assert clients == {worker: 1}, clients
        else:
            assert from_sessions == n, clients
            assert all(clients.get(p) == 1 for p in pids), clients
    with capsys.disabled():
        for mode, (total, own, elapsed) in figures.items():
            print("\n[test_shared] %3d sessions, transport=%-7s: %3d Redis connections from "
                  "the server (%3d of sessions), %d calls in %.2f s"
                  % (n, mode, total, own, n * 20, elapsed))


# ------------------------------------------------------- exact under load


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_exact_limit_16_sessions(shared_server, sessions, policies, algorithm):
    """16 shared sessions × 20 rl_allow on one identity, lim 100, frozen
    clock: exactly 100 allowed, all through the worker's one connection."""
    policy = policies(algorithm, 100, 3600000)
    ident = new_ident("exact")
    conns = sessions(16, transport="shared")
    allowed = [0] * 16

    def body(i):
        for _ in range(20):
            allowed[i] += conns[i].execute("SELECT rl_allow(%s, %s)", (policy, ident)).fetchone()[0]

    assert run_threads(16, body) == []
    assert sum(allowed) == 100, allowed
    assert check(conns[0], policy, ident, 0)[2] == 0
    assert shared_server.clients() == {shared_server.worker_pid(): 1}


def test_no_misrouted_reply(shared_server, sessions):
    """16 shared sessions at once, each on its own identity with its own
    limit (lim 100 + session number), 130 calls each: every row is exactly
    that session's (its lim, its remaining counting down, then denials); a
    reply handed to the wrong session would show another lim or count."""
    conns = sessions(16, transport="shared")
    base = new_ident("route")
    rows = [None] * 16

    def body(i):
        ident = "%s:%d" % (base, i)
        rows[i] = [explicit(conns[i], "fixed", ident, 100 + i, 60000) for _ in range(130)]

    assert run_threads(16, body) == []
    reset = 60000 - TEST_CLOCK_MS % 60000
    for i in range(16):
        lim = 100 + i
        want = [(k <= lim, lim, max(lim - k, 0), reset, 0 if k <= lim else reset)
                for k in range(1, 131)]
        assert [tuple(r) for r in rows[i]] == want, i
    assert shared_server.clients() == {shared_server.worker_pid(): 1}


# ---------------------------------------------------------------- refunds


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_refund_on_abort_handed_to_the_worker(shared_server, sessions, policies, algorithm):
    """refund_on_abort = 'all', shared, no connection of the session's own:
    BEGIN; rl_check(cost 2); ROLLBACK gives the 2 units back (the refund
    goes through the worker), a rolled-back savepoint its own units, and the
    session still has no connection to Redis."""
    policy = policies(algorithm, 5, 60000)
    ident = new_ident("refund")
    conn = sessions(1, transport="shared", refund_on_abort="all")[0]
    with conn.transaction():
        assert check(conn, policy, ident, 2)[:3] == (True, 5, 3)
        raise psycopg.Rollback()  # swallowed by the block
    assert check(conn, policy, ident, 0)[2] == 5
    with conn.transaction():
        assert check(conn, policy, ident, 1)[2] == 4
        with conn.transaction():  # a savepoint, rolled back
            assert check(conn, policy, ident, 3)[2] == 1
            raise psycopg.Rollback()
        assert check(conn, policy, ident, 0)[2] == 4
    assert check(conn, policy, ident, 0)[2] == 4
    # the full remainder really is there: 4 more, then a denial
    assert [check(conn, policy, ident)[0] for _ in range(5)] == [True] * 4 + [False]
    assert not own_connection_open(conn)
    assert conn.info.backend_pid not in shared_server.clients()


def test_refund_of_300_keys_handed_to_the_worker(shared_server, sessions, policies):
    """refund_on_abort = 'all', shared, no connection of the session's own:
    300 keys charged in one transaction (single rl_allow calls, through the
    worker) and rolled back. The refund of 300 keys is far more than a slot
    of the queue holds: it is cut into calls that fit a slot and handed to
    the worker (it used to wait for a connection the session never opens,
    and was lost when the session ended). Once the session has ended, every
    key has its full quota again; the session never opened a connection of
    its own, and got no WARNING."""
    lim = 5
    policy = policies("fixed", lim, CENTURY_MS)
    conn = sessions(1, transport="shared", refund_on_abort="all")[0]
    backend = sessions(1, transport="backend")[0]
    notices = []
    conn.add_notice_handler(lambda d: notices.append((d.severity_nonlocalized, d.message_primary)))
    base = new_ident("refund300")
    idents = ["%s:%03d" % (base, i) for i in range(300)]
    peek = "SELECT remaining FROM rl_check_many(%s, %s::text[], 0)"
    pid = conn.info.backend_pid
    conn.execute("BEGIN")
    charged = conn.execute("SELECT count(*) FROM unnest(%s::text[]) AS i WHERE rl_allow(%s, i)",
                           (idents, policy)).fetchone()[0]
    assert charged == 300
    assert [r[0] for r in backend.execute(peek, (policy, idents)).fetchall()] == [lim - 1] * 300
    conn.execute("ROLLBACK")
    assert not own_connection_open(conn)
    assert pid not in shared_server.clients()
    close_and_wait([conn])
    left = [r[0] for r in backend.execute(peek, (policy, idents)).fetchall()]
    assert left == [lim] * 300, "%d of 300 keys not given back" % sum(1 for x in left if x != lim)
    assert [n for n in notices if n[0] == "WARNING"] == []


def idents_sql(base, n, width):
    """SQL for the array of n identities '<base>:<g zero-padded to width>'
    (g = 0 .. n-1), and the same identities as a Python list."""
    query = "ARRAY(SELECT %%s || ':' || lpad(g::text, %d, '0') FROM generate_series(0, %d) g)" % (
        width, n - 1)
    return query, ["%s:%0*d" % (base, width, g) for g in range(n)]


def not_full(conn, policy, array_sql, base, lim):
    """How many of the identities of array_sql have less than lim left (a
    cost-0 rl_check_many: a peek)."""
    return conn.execute("SELECT count(*) FROM rl_check_many(%%s, %s, 0) WHERE remaining <> %%s"
                        % array_sql, (policy, base, lim)).fetchone()[0]


def sample_of(idents, n=200):
    """n identities of idents spread evenly, the first and the last among them."""
    step = (len(idents) - 1) / (n - 1)
    return sorted({idents[round(k * step)] for k in range(n)})


def test_rollback_refund_of_60000_keys_with_own_connection(shared_server, sessions, policies):
    """refund_on_abort = 'all', shared: BEGIN; rl_check_many of 60 000
    distinct identities (a batch: it opens the session's own connection);
    ROLLBACK. The refund goes on the session's own connection, in calls of
    up to 1 000 keys: it used to be cut to what a slot of the worker's
    queue holds (about 24 keys) although it was not handed to the worker,
    and with the 29 kB script in every call the 64 MB queue overflowed
    (1 147 WARNINGs, some 20 000 keys not given back). Afterwards, seen from a
    backend session, every identity has its full quota (200 of them one by
    one with rl_check cost 0, the first and last among them, and all 60 000
    with a cost-0 rl_check_many), and the rolling-back session got no
    WARNING. The ROLLBACK returns within its 1 s budget; what it could not
    write by then (a loaded machine) goes with the session's next call,
    made before looking (its command_timeout, 30 s here, bounds how long
    it may wait for Redis to finish that work: a loaded machine took more
    than the default 2 s)."""
    lim, n = 3, 60000
    policy = policies("fixed", lim, CENTURY_MS)
    conn = sessions(1, transport="shared", refund_on_abort="all", command_timeout=30000)[0]
    backend = sessions(1, transport="backend")[0]
    notices = []
    conn.add_notice_handler(lambda d: notices.append((d.severity_nonlocalized, d.message_primary)))
    base = new_ident("refund60k")
    array_sql, idents = idents_sql(base, n, 5)
    sample = sample_of(idents)
    assert idents[0] in sample and idents[-1] in sample and len(sample) == 200

    conn.execute("BEGIN")
    rows = conn.execute("SELECT count(*), count(*) FILTER (WHERE allowed AND remaining = %%s) "
                        "FROM rl_check_many(%%s, %s)" % array_sql,
                        (lim - 1, policy, base)).fetchone()
    assert rows == (n, n)
    assert own_connection_open(conn)  # the batch opened it
    assert [check(backend, policy, i, 0)[2] for i in sample] == [lim - 1] * len(sample)
    t0 = time.monotonic()
    conn.execute("ROLLBACK")
    rollback_s = time.monotonic() - t0
    # the transaction end waits 1 s at most (rl_redis.xact_end_budget)
    assert rollback_s < 1.0 + 2.0, rollback_s
    # what the ROLLBACK could not write within its budget (a loaded machine)
    # goes with the session's next call
    assert conn.execute("SELECT (rl_check(%s, %s, 0)).allowed",
                        (policy, new_ident("next"))).fetchone() == (True,)
    warnings = [x[1] for x in notices if x[0] == "WARNING"]

    # what was written is run by Redis even if its replies come after the
    # transaction end's budget: a short wait, never a lost key
    def back():
        return [check(backend, policy, i, 0)[2] for i in sample] == [lim] * len(sample)

    deadline = time.monotonic() + 10.0
    while not back() and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [check(backend, policy, i, 0)[2] for i in sample]
    missing = not_full(backend, policy, array_sql, base, lim)
    assert (missing, len(warnings)) == (0, 0), (
        "%d of %d keys not given back (ROLLBACK took %.2f s), %d WARNINGs, the first: %s"
        % (missing, n, rollback_s, len(warnings), warnings[:1]))
    assert left == [lim] * len(sample)
    assert conn.execute("SELECT 1").fetchone() == (1,)
    assert [x for x in notices if x[0] == "WARNING"] == [], notices


@pytest.mark.alone  # the refund must be written within the 1 s budget: no other test competes for the cores
def test_rollback_refund_of_6000_keys_then_close(shared_server, sessions, policies):
    """refund_on_abort = 'all', shared, no connection of the session's own:
    6 000 distinct keys charged by single rl_allow calls (through the
    worker) in one transaction, ROLLBACK, and the session closes. The
    refund, cut into about 300 calls that fit a slot, is more than the
    queue's 256 slots hold at once: the rest used to stay in the session's
    queue and be lost when it closed (its exit sent only the queue of an
    open connection, and was not even registered by a session that never
    connected). Now a full queue is waited for, and the exit hands what is
    left to the worker: within 3 s of the backend's exit every key has its
    full quota (seen from a backend session); the session never connected
    and got no WARNING."""
    lim, n = 3, 6000
    policy = policies("fixed", lim, CENTURY_MS)
    conn = sessions(1, transport="shared", refund_on_abort="all")[0]
    backend = sessions(1, transport="backend")[0]
    notices = []
    conn.add_notice_handler(lambda d: notices.append((d.severity_nonlocalized, d.message_primary)))
    base = new_ident("refund6k")
    array_sql, idents = idents_sql(base, n, 4)
    pid = conn.info.backend_pid

    conn.execute("BEGIN")
    charged = conn.execute("SELECT count(*) FROM generate_series(0, %d) g "
                           "WHERE rl_allow(%%s, %%s || ':' || lpad(g::text, 4, '0'))" % (n - 1),
                           (policy, base)).fetchone()[0]
    assert charged == n
    assert not_full(backend, policy, array_sql, base, lim) == n  # every key charged
    assert not own_connection_open(conn)
    conn.execute("ROLLBACK")
    # no statement after ROLLBACK: a next transaction end would hand the
    # rest of the queue over itself
    assert pid not in shared_server.clients()
    close_and_wait([conn])
    t0 = time.monotonic()
    missing = not_full(backend, policy, array_sql, base, lim)
    while missing and time.monotonic() - t0 < 3.0:
        time.sleep(0.1)
        missing = not_full(backend, policy, array_sql, base, lim)
    assert missing == 0, "%d of %d keys not given back 3 s after the session closed" % (missing, n)
    sample = sample_of(idents)
    assert [check(backend, policy, i, 0)[2] for i in sample] == [lim] * len(sample)
    assert [x for x in notices if x[0] == "WARNING"] == [], notices
    assert [x for x in shared_server.log().splitlines()
            if "[%d]" % pid in x and "WARNING" in x] == []  # nor at its exit
    assert pid not in shared_server.clients()


# ------------------------------------------------------- settings mismatch


def test_other_redis_uses_own_connection(shared_server, sessions, redis_factory):
    """A session-level SET rl_redis.port to another Redis (settings differ
    from the worker's): the call reaches that Redis, on the session's own
    connection; the worker's Redis has no such key. RESET: through the
    worker again."""
    other = redis_factory()
    conn = sessions(1, transport="shared")[0]
    a, b = new_ident("other"), new_ident("back")
    set_gucs(conn, port=other.port)
    assert explicit(conn, "fixed", a, 7, 60000)[:3] == (True, 7, 6)
    key = rl_key("fixed", a, lim=7, window_ms=60000)
    assert fixed_units(other.command("GET", key)) == "1"
    assert shared_server.redis.command("EXISTS", key) == 0
    assert redis_clients(other, [conn.info.backend_pid]) == {conn.info.backend_pid: 1}

    conn.execute("RESET rl_redis.port")
    assert explicit(conn, "fixed", b, 7, 60000)[:3] == (True, 7, 6)
    key = rl_key("fixed", b, lim=7, window_ms=60000)
    assert fixed_units(shared_server.redis.command("GET", key)) == "1"
    assert other.command("EXISTS", key) == 0
    assert conn.info.backend_pid not in shared_server.clients()


def test_batches_and_large_calls_use_own_connection(shared_server, sessions):
    """rl_check_many in a shared session uses its own connection; so does a
    call over 8 KB (an identity of 9 000 characters), logged once. Both
    decide exactly."""
    conn = sessions(1, transport="shared")[0]
    pid = conn.info.backend_pid
    ident = new_ident("batch")
    rows = conn.execute("SELECT allowed, remaining FROM rl_fixed_many(%s::text[], 2, 60000)",
                        ([ident] * 3,)).fetchall()
    assert rows == [(True, 1), (True, 0), (False, 0)]
    assert shared_server.clients().get(pid) == 1

    other = sessions(1, transport="shared", max_identity_bytes="16kB")[0]
    big = new_ident("big") + "x" * 9000
    assert [explicit(other, "fixed", big, 2, 60000)[:3] for _ in range(3)] == [
        (True, 2, 1), (True, 2, 0), (False, 2, 0)]
    assert shared_server.clients().get(other.info.backend_pid) == 1
    assert fixed_units(shared_server.redis.command("GET", rl_key("fixed", big, lim=2, window_ms=60000))) == "2"
    lines = [x for x in shared_server.log().splitlines()
             if "[%d]" % other.info.backend_pid in x and "larger than 8192 bytes" in x]
    assert len(lines) == 1, lines


def test_large_reply_check_all(admin, sessions):
    """rl_check_all of 80 policies on the real clock (a call of about 6 KB,
    within a slot's 8 KB, and a reply of about 3 KB; a slot holds 4 KB of
    reply, and only several-limits calls of at most 64 keys are sure to
    fit) gives the same decision in a shared session as in a backend
    session, and takes one unit of each policy in both: the call goes on
    the session's own connection, as its reply may not fit a slot."""
    tag = uuid.uuid4().hex[:6]
    names = ["p%02d%s" % (i, tag) for i in range(80)]
    for name in names:
        admin.execute("INSERT INTO rl_policy (name, algorithm, lim, window_ms) "
                      "VALUES (%s, 'fixed', 5, 60000)", (name,))
    try:
        shared, backend = (sessions(1, transport="shared", test_clock_ms=0)
                           + sessions(1, transport="backend", test_clock_ms=0))
        query = "SELECT %s FROM rl_check_all(%%s, %%s) AS r" % COLS
        a, b = "a:" + uuid.uuid4().hex[:12], "b:" + uuid.uuid4().hex[:12]
        want = backend.execute(query, (names, a)).fetchone()
        assert want[:3] == (True, 5, 4) and 0 < want[3] <= 60000 and want[4] == 0
        try:
            got = shared.execute(query, (names, b)).fetchone()
        except psycopg.Error as e:
            got = e
        # charged once, whatever the session was told
        for name in (names[0], names[-1]):
            assert check(backend, name, b, 0)[2] == 4
        assert own_connection_open(shared)  # not through the worker
        assert not isinstance(got, psycopg.Error), "%s: %s" % (got.sqlstate, got)
        assert got[:3] == want[:3] and 0 < got[3] <= 60000 and got[4] == 0
    finally:
        admin.execute("DELETE FROM rl_policy WHERE name = ANY(%s)", (names,))


def test_several_limits_of_64_keys_go_through_the_worker(admin, sessions, shared_redis):
    """rl_check_all of 64 policies on the real clock (the most keys whose
    reply surely fits a slot) goes through the worker and gives the
    decision of a backend session. The calls and the peeks run inside one
    minute of Redis's clock (a minute that ended between the call and a
    peek once made the peek see a new window: 5 left, not 4)."""
    tag = uuid.uuid4().hex[:6]
    names = ["q%02d%s" % (i, tag) for i in range(64)]
    for name in names:
        admin.execute("INSERT INTO rl_policy (name, algorithm, lim, window_ms) "
                      "VALUES (%s, 'fixed', 5, 60000)", (name,))
    try:
        shared, backend = (sessions(1, transport="shared", test_clock_ms=0)
                           + sessions(1, transport="backend", test_clock_ms=0))
        query = "SELECT %s FROM rl_check_all(%%s, %%s) AS r" % COLS

        def body():
            a, b = "a:" + uuid.uuid4().hex[:12], "b:" + uuid.uuid4().hex[:12]
            want = backend.execute(query, (names, a)).fetchone()
            got = shared.execute(query, (names, b)).fetchone()
            peeks = [check(backend, name, b, 0)[2] for name in (names[0], names[-1])]
            return want, got, peeks

        want, got, peeks = same_fixed_window(shared_redis, 60000, body)
        assert not own_connection_open(shared)  # it went through the worker
        assert got[:3] == want[:3] == (True, 5, 4) and got[4] == 0
        assert peeks == [4, 4]
    finally:
        admin.execute("DELETE FROM rl_policy WHERE name = ANY(%s)", (names,))


def test_large_reply_statement_guard(admin, sessions, policies):
    """A statement guard over an INSERT of 70 tenants (one script call of
    about 5 KB, a reply of about 2.7 KB): the INSERT succeeds in a shared
    session as in a backend session, each tenant charged one unit; the call
    goes on the session's own connection (more than 64 keys)."""
    policy = policies("fixed", 5, 60000)
    table = "t_shared_guard_%s" % uuid.uuid4().hex[:8]
    admin.execute("CREATE TABLE %s (tenant text NOT NULL)" % table)
    admin.execute("CREATE TRIGGER guard AFTER INSERT ON %s REFERENCING NEW TABLE AS new_rows "
                  "FOR EACH STATEMENT EXECUTE FUNCTION rl_guard_statement('%s', 'tenant')"
                  % (table, policy))
    try:
        shared, backend = sessions(1, transport="shared") + sessions(1, transport="backend")
        insert = "INSERT INTO %s SELECT unnest(%%s::text[])" % table
        outcome = {}
        for name, conn in (("backend", backend), ("shared", shared)):
            tag = uuid.uuid4().hex[:6]
            tenants = ["%s%03d" % (tag, i) for i in range(70)]
            try:
                conn.execute(insert, (tenants,))
                error = None
            except psycopg.Error as e:
                error = "%s: %s" % (e.sqlstate, e)
            charged = [5 - check(backend, policy, t, 0)[2] for t in tenants]
            outcome[name] = (error, sorted(set(charged)))
        assert outcome["backend"] == (None, [1])
        assert own_connection_open(shared)  # 70 keys: not through the worker
        assert outcome["shared"] == (None, [1])
    finally:
        admin.execute("DROP TABLE %s" % table)


def test_large_reply_top_denied(shared_server, sessions, policies):
    """rl_redis.track_denials: denials counted through the worker (odd
    identities) and by a backend session (even ones) add up; rl_top_denied
    of the 100 identities (a reply of about 6 KB, over a slot's 2 KB for
    replies) gives the same rows in a shared session as in a backend
    session."""
    policy = policies("fixed", 1, CENTURY_MS)
    backend = sessions(1, transport="backend", track_denials="on", test_clock_ms=0)[0]
    shared = sessions(1, transport="shared", track_denials="on", test_clock_ms=0)[0]
    base = new_ident("top")
    for i in range(100):
        conn = shared if i % 2 else backend
        for _ in range(2 + i % 3):
            conn.execute("SELECT rl_allow(%s, %s)", (policy, "%s:%03d" % (base, i)))
    assert not own_connection_open(shared)
    query = "SELECT identity, denials FROM rl_top_denied(%s, '1 hour', 150) ORDER BY identity"
    want = backend.execute(query, (policy,)).fetchall()
    assert want == [("%s:%03d" % (base, i), 1 + i % 3) for i in range(100)]
    assert shared.execute(query, (policy,)).fetchall() == want


def test_worker_reconnects(clusters):
    """The worker's connection lost three ways, shared sessions with
    on_error = 'error': FUNCTION FLUSH (4 sessions at once, "Function not
    found" in one pipeline), Redis restarted, CLIENT KILL of every client: the next calls
    decide exactly, all through the worker (no session connects)."""
    server, redis = clusters()
    server.worker_pid()  # a first call under the shared transport starts it
    conns = [server.connect(transport="shared", test_clock_ms=TEST_CLOCK_MS) for _ in range(4)]
    base = new_ident("reconnect")
    reset = 60000 - TEST_CLOCK_MS % 60000
    try:
        assert explicit(conns[0], "fixed", base, 5, 60000)[:3] == (True, 5, 4)
        for round_, lose in enumerate(["flush", "restart", "kill"]):
            if lose == "flush":
                redis.command("FUNCTION", "FLUSH")
            elif lose == "restart":
                redis.stop()
                redis.start()
            else:
                redis.command("CLIENT", "KILL", "TYPE", "normal")
            rows = [None] * len(conns)

            def body(i):
                ident = "%s:%s:%d" % (base, lose, i)
                rows[i] = [explicit(conns[i], "fixed", ident, 10 + i, 60000) for _ in range(3)]

            assert run_threads(len(conns), body) == [], lose
            assert rows == [[(True, 10 + i, 9 + i - k, reset, 0) for k in range(3)]
                            for i in range(len(conns))], lose
        assert server.clients() == {server.worker_pid(): 1}
        assert [own_connection_open(c) for c in conns] == [False] * len(conns)
    finally:
        for c in conns:
            c.close()


def test_worker_retries_on_its_own_connection(clusters):
    """rl_redis.transport = shared in postgresql.conf, so that the worker
    reads it too. After FUNCTION FLUSH the worker's call gets "Function not
    found" and goes again on the worker's own connection, never into the
    worker's own queue (where it waited for itself connect_timeout +
    command_timeout = 4 s, and failed). Three times: FUNCTION FLUSH, then a call that returns
    its exact decision within 500 ms; all through the worker, nothing in
    the server's log about a timeout."""
    server, redis = clusters(transport="shared")
    conn = server.connect(test_clock_ms=TEST_CLOCK_MS)
    try:
        assert conn.execute("SHOW rl_redis.transport").fetchone()[0] == "shared"
        ident = new_ident("selfretry")
        reset = 60000 - TEST_CLOCK_MS % 60000
        assert explicit(conn, "fixed", ident, 10, 60000) == (True, 10, 9, reset, 0)
        worker = server.worker_pid()
        assert server.clients() == {worker: 1}
        for k in range(3):
            redis.command("FUNCTION", "FLUSH")
            t0 = time.monotonic()
            row = explicit(conn, "fixed", ident, 10, 60000)
            elapsed = time.monotonic() - t0
            assert row == (True, 10, 8 - k, reset, 0), k
            assert elapsed < 0.5, (k, elapsed)
        assert server.clients() == {worker: 1}
        assert not own_connection_open(conn)
        assert "timed out" not in server.log()
    finally:
        conn.close()


@pytest.mark.parametrize("lose", ["restart", "flush"])
def test_unknown_scripts_in_one_worker_round(clusters, lose):
    """rl_redis.transport = shared in postgresql.conf. The worker's
    connection does not know the library Redis lacks (restart: a new worker
    after SIGTERM, and FUNCTION FLUSH) or believes it knows it (flush:
    FUNCTION FLUSH after every script ran). Redis held by CLIENT PAUSE 1000,
    3 sessions call fixed, sliding and gcra at once, so that calls of
    functions Redis does not have go together in one worker round (each
    must run, not only the first of the round). Each session gets its exact decision
    (the row of a backend session) within 1.5 s of the pause's end, through
    the worker; nothing in the server's log about a timeout."""
    server, redis = clusters(transport="shared", worker_restart_interval=WORKER_RESTART_S)
    algorithms = ["fixed", "sliding", "gcra"]
    admin = server.connect()
    conns = [server.connect(test_clock_ms=TEST_CLOCK_MS) for _ in algorithms]
    ref = server.connect(transport="backend", test_clock_ms=TEST_CLOCK_MS)
    base = new_ident("round")
    try:
        for a, c in zip(algorithms, conns):  # every script ran through the worker
            assert explicit(c, a, "%s:warm" % base, 10, 60000)[:3] == (True, 10, 9)
        worker = server.worker_pid()
        if lose == "restart":
            os.kill(worker, signal.SIGTERM)
            new = wait_for(lambda: [p for p in server.worker_pids() if p != worker],
                           WORKER_RESTART_S + 9.0, "a new worker")
            worker = new[0]
        redis.command("FUNCTION", "FLUSH")
        pause_s = 1.0
        redis.command("CLIENT", "PAUSE", str(int(pause_s * 1000)))
        t_pause = time.monotonic()
        calls = [QueryThread(c, "SELECT %s FROM rl_%s(%%s, 10, 60000) AS r" % (COLS, a),
                      ("%s:%s" % (base, a),)) for a, c in zip(algorithms, conns)]
        for call in calls:
            call.start()
        wait_all_waiting(admin, [c.info.backend_pid for c in conns])
        assert time.monotonic() - t_pause < pause_s, "the calls were not all queued within the pause"
        for call in calls:
            call.join(20)
        assert not any(call.is_alive() for call in calls)
        assert [call.error for call in calls] == [None] * 3, [str(call.error) for call in calls]
        late = [round(call.finished - t_pause - pause_s, 3) for call in calls]
        assert max(late) < 1.5, late
        want = [explicit(ref, a, "%s:ref:%s" % (base, a), 10, 60000) for a in algorithms]
        assert [tuple(call.rows[0]) for call in calls] == want
        assert [w[:3] for w in want] == [(True, 10, 9)] * 3
        clients = server.clients()
        assert clients.get(worker) == 1 and not any(clients.get(c.info.backend_pid) for c in conns), clients
        assert "timed out" not in server.log()
    finally:
        for c in conns + [admin, ref]:
            c.close()


def test_worker_idle_timeout(clusters):
    """rl_redis.idle_timeout = 5 s in the server's configuration: the
    worker closes its idle connection (within 20 s the server holds none)
    and opens one again for the next call. (The timeout is long enough that
    a loaded machine's pause between a call and the look at CLIENT LIST
    does not close the connection in between. Each look that came too late
    costs a unit more: the limit of 100 leaves room for every retry.)"""
    server, redis = clusters(idle_timeout=5000)
    server.worker_pid()  # a first call under the shared transport starts it
    conn = server.connect(transport="shared", test_clock_ms=TEST_CLOCK_MS)

    def call_then_look(remaining):
        """A call, then the server's clients: the worker's one connection,
        when seen within 4 s of the call (a machine that paused longer
        between the two looks again after another call)."""
        for _ in range(5):
            assert explicit(conn, "fixed", ident, 100, 60000)[:3] == (True, 100, remaining)
            t = time.monotonic()
            clients = server.clients()
            if time.monotonic() - t < 4.0:
                assert clients == {server.worker_pid(): 1}
                return
            remaining -= 1
        pytest.fail("no look at CLIENT LIST came within 4 s of a call")

    try:
        ident = new_ident("idle")
        call_then_look(99)
        wait_for(lambda: server.clients() == {}, 20.0, "the worker to close its idle connection")
        n = int(fixed_units(redis.command("GET", rl_key("fixed", ident, lim=100, window_ms=60000))))
        call_then_look(100 - n - 1)
    finally:
        conn.close()


def test_reload_moves_the_worker(clusters, redis_factory):
    """ALTER SYSTEM SET rl_redis.port to another Redis and a reload: the
    worker and the sessions take it; the next calls land in the new Redis,
    through the worker (the same process, now connected there)."""
    server, redis = clusters()
    second = redis_factory()
    admin = server.connect()
    conn = server.connect(transport="shared", test_clock_ms=TEST_CLOCK_MS)
    try:
        ident = new_ident("reload")
        key = rl_key("fixed", ident, lim=5, window_ms=60000)
        assert explicit(conn, "fixed", ident, 5, 60000)[:3] == (True, 5, 4)
        worker = server.worker_pid()
        admin.execute("ALTER SYSTEM SET rl_redis.port = %d" % second.port)
        admin.execute("SELECT pg_reload_conf()")
        time.sleep(1.5)
        assert explicit(conn, "fixed", ident, 5, 60000)[:3] == (True, 5, 4)
        assert (fixed_units(redis.command("GET", key)), fixed_units(second.command("GET", key))) == ("1", "1")
        fresh = server.connect(transport="shared", test_clock_ms=TEST_CLOCK_MS)
        try:
            assert explicit(fresh, "fixed", ident, 5, 60000)[:3] == (True, 5, 3)
            pids = list(server.children())
            assert redis_clients(second, pids) == {worker: 1}
            assert not own_connection_open(conn) and not own_connection_open(fresh)
        finally:
            fresh.close()
    finally:
        conn.close()
        admin.close()


# ------------------------------------------------------- cancel, timeouts


def test_cancel_and_timeouts_with_redis_paused(clusters, capsys):
    """The worker's Redis paused (the worker's command_timeout 30 s): a
    waiting call is cancelled by pg_cancel_backend (57014 within 2 s), ends
    by statement_timeout 300 ms (57014 within 2 s), and with
    command_timeout = connect_timeout = 300 ms ends within 5 s with
    on_error (error -> 08xxx, allow -> allowed, deny -> denied). After
    SIGCONT the session's next calls return its own decisions (lim 777),
    not a reply of an abandoned call (lim 5)."""
    server, redis = clusters(command_timeout=30000, connect_timeout=30000)
    server.worker_pid()  # a first call under the shared transport starts it
    admin = server.connect()
    conn = server.connect(transport="shared", test_clock_ms=TEST_CLOCK_MS)
    pid = conn.info.backend_pid
    try:
        assert explicit(conn, "fixed", new_ident("warm"), 5, 60000)[:3] == (True, 5, 4)
        assert server.clients() == {server.worker_pid(): 1}
        redis.pause()
        try:
            # cancel: the worker has taken the call and waits for Redis
            call = QueryThread(conn, "SELECT %s FROM rl_fixed(%%s, 5, 60000) AS r" % COLS,
                        (new_ident("cancel"),))
            call.start()
            wait_until_active(admin, pid)
            time.sleep(0.5)
            t0 = time.monotonic()
            assert admin.execute("SELECT pg_cancel_backend(%s)", (pid,)).fetchone()[0] is True
            call.join(10)
            assert not call.is_alive()
            assert isinstance(call.error, psycopg.errors.QueryCanceled), call.error
            assert call.finished - t0 < 2.0

            # statement_timeout: this call waits in the queue (the worker is busy)
            conn.execute("SET statement_timeout = 300")
            t0 = time.monotonic()
            err = error_of(conn, "SELECT rl_fixed_allow(%s, 5, 60000)", (new_ident("st"),))
            assert err.sqlstate == "57014", err
            assert time.monotonic() - t0 < 2.0
            conn.execute("RESET statement_timeout")

            # the session's own bound: connect_timeout + command_timeout
            set_gucs(conn, command_timeout=300, connect_timeout=300)
            for on_error, want in [("error", None), ("allow", (True, 5, 4, 0, 0)),
                                   ("deny", (False, 5, 0, 0, DENY_RETRY_MS))]:
                set_gucs(conn, on_error=on_error)
                query = "SELECT %s FROM rl_fixed(%%s, 5, 60000) AS r" % COLS
                t0 = time.monotonic()
                if want is None:
                    err = error_of(conn, query, (new_ident("bound"),))
                    assert err.sqlstate.startswith("08"), err
                else:
                    assert conn.execute(query, (new_ident("bound"),)).fetchone() == want
                elapsed = time.monotonic() - t0
                assert 0.25 <= elapsed < 5.0, (on_error, elapsed)
        finally:
            redis.resume()
        for name in ("command_timeout", "connect_timeout", "on_error"):
            conn.execute("RESET rl_redis.%s" % name)
        fresh = new_ident("after")
        reset = 60000 - TEST_CLOCK_MS % 60000
        assert explicit(conn, "fixed", fresh, 777, 60000, 500) == (True, 777, 277, reset, 0)
        assert explicit(conn, "fixed", fresh, 777, 60000, 500) == (False, 777, 277, reset, reset)
        assert [explicit(conn, "fixed", fresh, 777, 60000, 1)[2] for _ in range(3)] == [276, 275, 274]
        assert conn.execute("SELECT 1").fetchone() == (1,)
        # all of it through the worker: the session never connected
        assert server.clients() == {server.worker_pid(): 1}
    finally:
        conn.close()
        admin.close()


# ---------------------------------------------------------------- the worker exits


def test_worker_killed_while_calls_wait(clusters):
    """Redis paused; session A's call is taken by the worker, session B's
    waits in the queue behind it; the worker gets SIGTERM: A fails at once
    with 08006 (the worker exited while its call was on its way), B sends
    its call on its own connection and gets its own decision once Redis
    answers; a new worker runs within 5 s and takes calls again. The server
    keeps the production restart interval (1 s): B finds the worker gone
    (it looks every 100 ms) before a new one could take its call, and the
    test waits longer than that anyway."""
    server, redis = clusters(command_timeout=30000, connect_timeout=30000)
    server.worker_pid()  # a first call under the shared transport starts it
    admin = server.connect()
    a = server.connect(transport="shared", test_clock_ms=TEST_CLOCK_MS)
    b = server.connect(transport="shared", test_clock_ms=TEST_CLOCK_MS)
    try:
        assert explicit(a, "fixed", new_ident("warm"), 5, 60000)[0] is True
        old = server.worker_pid()
        assert server.clients() == {old: 1}
        ident_a, ident_b = new_ident("ka"), new_ident("kb")
        redis.pause()
        try:
            call_a = QueryThread(a, "SELECT %s FROM rl_fixed(%%s, 11, 60000) AS r" % COLS, (ident_a,))
            call_a.start()
            wait_until_active(admin, a.info.backend_pid)
            time.sleep(0.5)  # the worker took it and waits for Redis
            call_b = QueryThread(b, "SELECT %s FROM rl_fixed(%%s, 22, 60000) AS r" % COLS, (ident_b,))
            call_b.start()
            wait_until_active(admin, b.info.backend_pid)
            time.sleep(0.5)
            t0 = time.monotonic()
            os.kill(old, signal.SIGTERM)
            call_a.join(10)
            assert not call_a.is_alive()
            assert isinstance(call_a.error, psycopg.Error), call_a.rows
            assert call_a.error.sqlstate == "08006", call_a.error
            assert WORKER_EXITED in call_a.error.diag.message_primary, call_a.error
            assert call_a.finished - t0 < 3.0
            time.sleep(1.0)
            assert call_b.is_alive(), (call_b.rows, call_b.error)  # on its own connection now
        finally:
            redis.resume()
        call_b.join(20)
        assert not call_b.is_alive()
        assert call_b.error is None, call_b.error
        reset = 60000 - TEST_CLOCK_MS % 60000
        assert [tuple(r) for r in call_b.rows] == [(True, 22, 21, reset, 0)]
        new = wait_for(lambda: [p for p in server.worker_pids() if p != old], 5.0, "a new worker")
        assert len(new) == 1 and old not in server.worker_pids(), new
        # a's call may have run (it was sent): never sent again
        assert fixed_units(redis.command("GET", rl_key("fixed", ident_a, lim=11, window_ms=60000))) in ("1", None)
        assert fixed_units(redis.command("GET", rl_key("fixed", ident_b, lim=22, window_ms=60000))) == "1"
        # the new worker takes calls again: a has no connection of its own
        assert explicit(a, "fixed", ident_b, 22, 60000)[:3] == (True, 22, 20)
        clients = server.clients()
        assert clients.get(new[0]) == 1 and a.info.backend_pid not in clients, clients
        assert clients.get(b.info.backend_pid) == 1, clients
    finally:
        a.close()
        b.close()
        admin.close()


def test_worker_killed_under_load(clusters):
    """8 shared sessions loop rl_check (on_error = 'deny', lim 3000 on one
    identity, real clock) while the worker gets SIGTERM: no session gets an
    error, a new worker runs within the restart interval + 4 s and decides
    again; the sessions run
    until Redis denies; never more than 3000 allowed, and allowed plus the
    fallback denials of the calls the dying worker had taken (at most one
    per session) cover the 3000 units Redis counted."""
    lim = 3000
    server, redis = clusters(worker_restart_interval=WORKER_RESTART_S)
    admin = server.connect()
    assert admin.execute("SELECT setting, context FROM pg_settings "
                         "WHERE name = 'rl_redis.worker_restart_interval'").fetchone() == (
        str(WORKER_RESTART_S), "postmaster")
    admin.execute("INSERT INTO rl_policy (name, algorithm, lim, window_ms) "
                  "VALUES ('load', 'fixed', %s, %s)", (lim, CENTURY_MS))
    ident = new_ident("load")
    conns = [server.connect(transport="shared", on_error="deny") for _ in range(8)]
    old = server.worker_pid()
    stop = threading.Event()
    restarted = threading.Event()
    stats = [dict(calls=0, allowed=0, fallback=0, denied=0, after=0) for _ in conns]

    def body(i):
        c, s = conns[i], stats[i]
        deadline = time.monotonic() + 120
        while not stop.is_set() and time.monotonic() < deadline:
            allowed, got_lim, remaining, reset, retry = check(c, "load", ident)
            s["calls"] += 1
            assert got_lim == lim
            if allowed:
                s["allowed"] += 1
            elif reset == 0 and retry == DENY_RETRY_MS:
                s["fallback"] += 1
            else:
                assert remaining == 0 and reset > 0, (allowed, remaining, reset, retry)
                s["denied"] += 1
            if restarted.is_set():
                s["after"] += 1
                if s["denied"] > 0 and s["after"] >= 20:
                    return

    threads = []
    errors = []

    def target(i):
        try:
            body(i)
        except BaseException as e:  # reported below
            errors.append((i, e))

    try:
        for i in range(len(conns)):
            threads.append(threading.Thread(target=target, args=(i,), daemon=True))
            threads[-1].start()
        wait_for(lambda: sum(s["calls"] for s in stats) >= 200, 30, "200 calls")
        assert sum(s["allowed"] for s in stats) < lim
        os.kill(old, signal.SIGTERM)
        t0 = time.monotonic()
        new = wait_for(lambda: [p for p in server.worker_pids() if p != old], WORKER_RESTART_S + 4.0,
                       "a new worker")
        restart_s = time.monotonic() - t0
        print("\n[a new worker ran %.3f s after SIGTERM]" % restart_s, end="")
        restarted.set()
        for t in threads:
            t.join(timeout=150)
        stop.set()
        assert not any(t.is_alive() for t in threads), "a session hung"
    finally:
        stop.set()
        for c in conns:
            c.close()
        admin.close()
    assert errors == [], errors
    allowed = sum(s["allowed"] for s in stats)
    fallback = sum(s["fallback"] for s in stats)
    counted = int(fixed_units(redis.command("GET", rl_key("fixed", ident, "load", lim, CENTURY_MS))))
    assert counted == lim
    assert allowed <= lim, stats
    assert allowed + fallback >= lim, stats
    assert fallback <= len(conns), stats
    assert all(s["after"] >= 20 and s["denied"] > 0 for s in stats), stats
    assert 0 < restart_s < WORKER_RESTART_S + 4.0
    assert len(new) == 1
    # the new worker decided: it has a connection to Redis
    assert server.clients().get(new[0]) == 1


# ---------------------------------------------------------------- queue full


def test_queue_full_falls_back(clusters):
    """rl_redis.shared_queue_size = 16, Redis paused, 24 shared sessions
    call at once (each its own identity and lim 100 + i): 16 hold a slot,
    the 8 others use their own connections (one LOG line each); after
    SIGCONT every session gets its own exact decision, the server holds
    1 + 8 connections to Redis, and the next round goes through the queue
    again (no new connection)."""
    server, redis = clusters(shared_queue_size=16, command_timeout=30000, connect_timeout=30000,
                              max_connections=40)
    server.worker_pid()  # a first call under the shared transport starts it
    admin = server.connect()
    assert admin.execute("SHOW rl_redis.shared_queue_size").fetchone()[0] == "16"
    conns = [server.connect(transport="shared", test_clock_ms=TEST_CLOCK_MS) for _ in range(24)]
    pids = [c.info.backend_pid for c in conns]
    base = new_ident("full")
    reset = 60000 - TEST_CLOCK_MS % 60000
    try:
        assert explicit(conns[0], "fixed", base, 5, 60000)[0] is True
        worker = server.worker_pid()
        assert server.clients() == {worker: 1}
        redis.pause()
        try:
            calls = [QueryThread(c, "SELECT %s FROM rl_fixed(%%s, %%s, 60000) AS r" % COLS,
                          ("%s:%d" % (base, i), 100 + i)) for i, c in enumerate(conns)]
            for call in calls:
                call.start()
            wait_all_waiting(admin, pids)
            time.sleep(0.5)
        finally:
            redis.resume()
        for call in calls:
            call.join(30)
        assert not any(call.is_alive() for call in calls)
        assert [call.error for call in calls] == [None] * 24
        assert [[tuple(r) for r in call.rows] for call in calls] == [
            [(True, 100 + i, 99 + i, reset, 0)] for i in range(24)]
        clients = server.clients()
        own = [p for p in pids if clients.get(p)]
        assert clients.get(worker) == 1 and len(own) == 8, clients
        assert all(clients[p] == 1 for p in own), clients
        log = server.log()
        full = [line for line in log.splitlines() if QUEUE_FULL in line]
        assert sorted(int(line.split("[", 1)[1].split("]", 1)[0]) for line in full) == sorted(own), full

        # Redis answering: every session through the queue again
        rows = [explicit(c, "fixed", "%s:%d" % (base, i), 100 + i, 60000) for i, c in enumerate(conns)]
        assert [tuple(r) for r in rows] == [(True, 100 + i, 98 + i, reset, 0) for i in range(24)]
        assert server.clients() == clients
    finally:
        for c in conns:
            c.close()
        admin.close()


# ---------------------------------------------------------------- no worker


def queue_memory(conn):
    """Bytes of the main shared memory named for the shared queue."""
    return conn.execute("SELECT coalesce(sum(size), 0)::bigint FROM pg_shmem_allocations "
                        "WHERE name = 'rl_redis shared queue'").fetchone()[0]


def test_worker_and_queue_only_with_the_shared_transport(clusters):
    """A preloaded server whose configuration keeps transport = backend has
    no worker and no queue (24 bytes of the main shared memory, the queue's
    handle, where the 256 entries took 3.3 MB), whatever its sessions decide. The
    first call under transport = shared starts both: it decides exactly on
    its own connection (logged once, as a start, not as a missing worker);
    a new session's calls then go through the one worker. After a crash
    restart the postmaster starts that worker again, which makes the queue
    again: one worker, and the calls go through it."""
    server, redis = clusters()
    admin = server.connect()
    try:
        ident = new_ident("ondemand")
        reset = 60000 - TEST_CLOCK_MS % 60000
        backend = server.connect(test_clock_ms=TEST_CLOCK_MS)
        assert [explicit(backend, a, ident + a, 5, 60000)[:3]
                for a in ("fixed", "sliding", "gcra")] == [(True, 5, 4)] * 3
        backend.close()
        time.sleep(0.3)  # a worker started at server start runs well within it
        assert server.worker_pids() == []
        assert queue_memory(admin) == 24

        first = server.connect(transport="shared", test_clock_ms=TEST_CLOCK_MS)
        rows = [explicit(first, "fixed", ident, 2, 60000) for _ in range(3)]
        assert rows == [(True, 2, 1, reset, 0), (True, 2, 0, reset, 0), (False, 2, 0, reset, reset)]
        worker = server.worker_pid()
        log = server.log()
        assert log.count("starting the rl_redis worker for rl_redis.transport = shared") == 1, log
        assert "the rl_redis worker is not running" not in log
        second = server.connect(transport="shared", test_clock_ms=TEST_CLOCK_MS)
        assert explicit(second, "fixed", ident + ":2", 2, 60000) == (True, 2, 1, reset, 0)
        assert not own_connection_open(second)
        assert server.clients() == {worker: 1, first.info.backend_pid: 1}
        first.close()
        second.close()

        # a crash restart: every process ends, the registered worker comes back
        victim = server.connect()
        os.kill(victim.info.backend_pid, signal.SIGKILL)
        wait_for(lambda: worker not in server.children(), 30.0, "the crash restart")
        again = wait_for(lambda: server.worker_pids(), 30.0, "the worker after the crash restart")
        assert len(again) == 1 and again != [worker], again
        third = wait_for(lambda: try_connect(server), 30.0, "a session after the crash restart")
        try:
            set_gucs(third, transport="shared", test_clock_ms=TEST_CLOCK_MS)
            assert explicit(third, "fixed", ident + ":3", 2, 60000) == (True, 2, 1, reset, 0)
            assert not own_connection_open(third)
            time.sleep(0.3)
            assert server.worker_pids() == again
        finally:
            third.close()
    finally:
        admin.close()


def try_connect(server):
    """A new session of server, or None while it restarts."""
    try:
        conn = server.connect()
        conn.execute("SELECT 1")
        return conn
    except psycopg.OperationalError:
        return None


def test_worker_starts_with_a_server_configured_for_it(clusters):
    """rl_redis.transport = shared in postgresql.conf: the worker runs as
    the server starts, before any call; with mode = cluster too, it does
    not (the shared transport serves standalone Redis only)."""
    server, redis = clusters(transport="shared")
    assert len(wait_for(lambda: server.worker_pids(), 10.0, "the rl_redis worker")) == 1
    server, redis = clusters(transport="shared", mode="cluster")
    time.sleep(0.3)
    assert server.worker_pids() == []


def restart_with(server, **settings):
    """Restarts server with settings (name = value) added to its configuration."""
    server.stop()
    with open(os.path.join(server.datadir, "postgresql.conf"), "a") as f:
        for name, value in settings.items():
            f.write("%s = '%s'\n" % (name, value))
    server.start()


def test_no_worker_slot_is_said_once(clusters):
    """max_worker_processes = 0: a call under the shared transport cannot
    start the worker. 20 calls of two sessions decide exactly on their own
    connections; the log says it once (with the hint), not once a call."""
    server, redis = clusters()
    restart_with(server, max_worker_processes=0)
    ident = new_ident("noslot")
    reset = 60000 - TEST_CLOCK_MS % 60000
    for k in range(2):
        conn = server.connect(transport="shared", test_clock_ms=TEST_CLOCK_MS)
        try:
            rows = [explicit(conn, "fixed", "%s:%d" % (ident, k), 10, 60000)[:3] for _ in range(10)]
            assert rows == [(True, 10, 9 - i) for i in range(10)]
            assert own_connection_open(conn)
        finally:
            conn.close()
    log = server.log()
    assert log.count("could not start the rl_redis worker: no background worker slot is free") == 1, log
    assert log.count("HINT:  Raise max_worker_processes.") == 1, log
    assert server.worker_pids() == []


def test_queue_that_cannot_be_made_is_no_error(clusters):
    """Dynamic shared memory in files of pg_dynshmem, which the server may
    no longer write: the worker cannot make the queue (it fails, and the
    postmaster tries again). A session's calls under the shared transport
    never see it: exact decisions on their own connection, no error, the
    worker asked for once. PostgreSQL's own segments (the statistics'
    memory grows by them, a new session's may need one) come from the 3 MB
    that min_dynamic_shared_memory keeps in main shared memory, which the
    queue (3.3 MB) does not fit: without it the connection itself failed
    now and then ("could not open shared memory segment", PostgreSQL 17)."""
    server, redis = clusters()
    restart_with(server, dynamic_shared_memory_type="mmap", min_dynamic_shared_memory="3MB")
    dynshmem = os.path.join(server.datadir, "pg_dynshmem")
    conn = server.connect(transport="shared", on_error="error", test_clock_ms=TEST_CLOCK_MS)
    os.chmod(dynshmem, 0o500)
    try:
        try:
            ident = new_ident("nodsm")
            reset = 60000 - TEST_CLOCK_MS % 60000
            rows = [explicit(conn, "fixed", ident, 2, 60000) for _ in range(3)]
            assert rows == [(True, 2, 1, reset, 0), (True, 2, 0, reset, 0), (False, 2, 0, reset, reset)]
            assert own_connection_open(conn)
            wait_for(lambda: "pg_dynshmem" in server.log(), 10.0, "the worker's failure")
            assert explicit(conn, "fixed", ident + ":2", 2, 60000) == (True, 2, 1, reset, 0)
        finally:
            conn.close()
        assert server.log().count("starting the rl_redis worker") == 1
        assert server.worker_pids() == []
    finally:
        os.chmod(dynshmem, 0o700)


def test_without_worker_uses_own_connection(unpreloaded_cluster, shared_redis):
    """Without preloading there is no worker (nor queue): transport =
    shared calls work on the session's own connection, exactly."""
    conn = pg_connect(host="127.0.0.1", port=unpreloaded_cluster, user="postgres", dbname="postgres")
    try:
        conn.execute("CREATE EXTENSION IF NOT EXISTS rl_redis")
        set_gucs(conn, transport="shared", test_clock_ms=TEST_CLOCK_MS, retry_interval=0)
        assert conn.execute("SHOW rl_redis.transport").fetchone()[0] == "shared"
        ident = new_ident("noworker")
        reset = 60000 - TEST_CLOCK_MS % 60000
        rows = [explicit(conn, "fixed", ident, 2, 60000) for _ in range(3)]
        assert rows == [(True, 2, 1, reset, 0), (True, 2, 0, reset, 0), (False, 2, 0, reset, reset)]
        assert own_connection_open(conn)
        pid = conn.info.backend_pid
        assert redis_clients(shared_redis, [pid]) == {pid: 1}
    finally:
        conn.close()


def test_queue_size_setting_without_preloading(clusters):
    """A server without rl_redis in shared_preload_libraries whose
    postgresql.conf sets rl_redis.shared_queue_size = 64: a session's first
    rl_redis call (which loads the library) gives no WARNING (every session
    used to be warned of an invalid configuration parameter name), the
    setting shows 64, there is no worker, and the call decides on the
    session's own connection. Twice, in two new sessions."""
    server, redis = clusters(preload=False, shared_queue_size=64)
    assert server.worker_pids() == []
    for k in range(2):
        conn = server.connect()
        try:
            notices = []
            conn.add_notice_handler(
                lambda d: notices.append((d.severity_nonlocalized, d.message_primary)))
            ident = new_ident("qsize")
            assert conn.execute("SELECT (r).allowed, (r).lim, (r).remaining FROM rl_fixed(%s, 5, 60000) r",
                                (ident,)).fetchone() == (True, 5, 4)
            assert [n for n in notices if n[0] == "WARNING"] == [], notices
            assert conn.execute("SHOW rl_redis.shared_queue_size").fetchone()[0] == "64"
            assert own_connection_open(conn)
            assert server.worker_pids() == []
        finally:
            conn.close()


def test_calls_the_worker_never_sent_queue_no_release(clusters):
    """Redis is down (stopped: connections refused): the worker fails the
    acquires of a shared session without sending them (its connect fails,
    then its breaker is open), and says so in the slot. The session queues
    no release for them and opens no connection of its own (before, every
    failure through the worker counted as sent: each session queued a
    release, and its next call opened its own connection because of it, a
    connection storm in an outage)."""
    server, redis = clusters(retry_interval=60000)
    server.worker_pid()  # a first call under the shared transport starts it
    conn = server.connect(transport="shared", on_error="allow", retry_interval=0)
    try:
        assert conn.execute("SELECT rl_fixed_allow(%s, 5, 60000)",
                            (new_ident("warm"),)).fetchone()[0] is True
        redis.stop()
        ident = new_ident("never_sent")
        acquire = "SELECT rl_concurrency_acquire_allow(%%s, 2, %d)" % LONG_LEASE_MS
        for end in ("COMMIT", "ROLLBACK"):
            conn.execute("BEGIN")
            for _ in range(3):
                assert conn.execute(acquire, (ident,)).fetchone()[0] is True  # on_error
                assert conn.execute(
                    "SELECT coalesce(sum(queued), 0)::int FROM rl_redis_connections()"
                ).fetchone()[0] == 0, end
            conn.execute(end)
        # the session's own connection was never tried
        assert conn.execute("SELECT count(*) FROM rl_redis_connections() "
                            "WHERE failing_since IS NOT NULL").fetchone()[0] == 0
    finally:
        conn.close()
        redis.start()
