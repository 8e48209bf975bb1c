"""The 1.1 additions against real servers: token bucket, GCRA, sliding-window
counter, named policies, rl_allow_all, concurrency slots, peeks, refunds and
rl_reset.

Also: retry_after_ms and reset_ms checked against the state they describe
(a random walk per algorithm, probing a copy of the state), and the
sliding-window counter's error against the sliding log on generated request
streams.

Many-session tests use the real Redis clock with a one-day window, so that
refill during a test (100 units a day: ~0.0012 units a second) stays far
below one unit and the counts are exact. Single-session tests use the
superuser test clock (rl_redis.test_clock_ms) and are fully deterministic.

All of these use the shared Redis that postgresql.conf points at, with the
default key prefix 'rl:'.
"""

import math
import os
import random
import signal
import threading
import time
import uuid
import zlib

import psycopg
import psycopg.errors
import pytest

from conftest import give_back_session, new_ident, pg_connect, rl_key, same_fixed_window, set_gucs, take_session

THREADS = 16
CALLS_PER_THREAD = 20
DAY_MS = 86400000
# a test clock value (ms) on a whole minute, far from the real clock
TEST_CLOCK_MS = 1800000000000

ALGORITHMS = ["fixed", "sliding", "token_bucket", "gcra", "sliding_counter"]

RESULT = "SELECT (r).allowed, (r).lim, (r).remaining, (r).reset_ms, (r).retry_after_ms FROM %s AS r"


# ---------------------------------------------------------------- helpers


def key_of(algorithm, identity, policy=None, lim=None, window_ms=None, burst=None):
    """The documented Redis key (default prefix) of a policy's state, or of
    an explicit limit's (conftest.rl_key)."""
    return rl_key(algorithm, identity, policy, lim, window_ms, burst)


def exists(redis, key):
    return redis.command("EXISTS", key)


def decide(conn, algorithm, identity, lim, window_ms, cost=1, burst=None):
    """rl_<algorithm>(...) as (allowed, lim, remaining, reset_ms, retry_after_ms)."""
    if burst is None:
        call = "rl_%s(%%s, %%s, %%s, %%s)" % algorithm
        params = (identity, lim, window_ms, cost)
    else:
        call = "rl_%s(%%s, %%s, %%s, %%s, %%s)" % algorithm
        params = (identity, lim, window_ms, cost, burst)
    return conn.execute(RESULT % call, params).fetchone()


def refund(conn, algorithm, identity, lim, window_ms, amount, burst=None):
    if burst is None:
        call = "rl_%s_refund(%%s, %%s, %%s, %%s)" % algorithm
        params = (identity, lim, window_ms, amount)
    else:
        call = "rl_%s_refund(%%s, %%s, %%s, %%s, %%s)" % algorithm
        params = (identity, lim, window_ms, amount, burst)
    return conn.execute(RESULT % call, params).fetchone()


def check(conn, policy, identity, cost=1):
    return conn.execute(RESULT % "rl_check(%s, %s, %s)", (policy, identity, cost)).fetchone()


def acquire(conn, identity, lim, lease_ms):
    return conn.execute(
        RESULT % "rl_concurrency_acquire(%s, %s, %s)", (identity, lim, lease_ms)
    ).fetchone()


def run_threads(conns, work, timeout=300):
    """Runs work(t, conns[t]) in one thread per connection, all released at
    the same moment; returns the list of results, re-raises worker errors."""
    n = len(conns)
    barrier = threading.Barrier(n)
    results = [None] * n
    errors = []

    def wrap(t):
        try:
            barrier.wait(timeout=60)
            results[t] = work(t, conns[t])
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    ths = [threading.Thread(target=wrap, args=(t,)) for t in range(n)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(timeout=timeout)
    assert not any(th.is_alive() for th in ths), "worker threads hung"
    assert errors == [], errors
    return results


def hammer(query, params, threads=THREADS, calls=CALLS_PER_THREAD):
    """`threads` sessions each run `query` (returning a boolean) `calls`
    times, all at once; returns (how many were true, seconds taken)."""
    conns = [take_session() for _ in range(threads)]
    try:

        def work(t, conn):
            n = 0
            for _ in range(calls):
                value = conn.execute(query, params).fetchone()[0]
                assert isinstance(value, bool), value
                n += value
            return n

        t0 = time.monotonic()
        counts = run_threads(conns, work)
        return sum(counts), time.monotonic() - t0
    finally:
        for c in conns:
            give_back_session(c)



def connect_retry(timeout=30.0):
    """A new connection, retrying while the cluster restarts after a crash."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            conn = pg_connect(connect_timeout=5)
            conn.execute("SELECT 1")
            return conn
        except psycopg.OperationalError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.2)


class Policies:
    """Creates rl_policy rows with unique names; deletes them at teardown."""

    def __init__(self):
        self.names = []

    def name(self, tag="p"):
        name = "pytest.%s.%s" % (tag, uuid.uuid4().hex[:16])
        self.names.append(name)
        return name

    def create(self, conn, algorithm, lim, window_ms, burst=None, tag="p"):
        name = self.name(tag)
        conn.execute(
            "INSERT INTO rl_policy (name, algorithm, lim, window_ms, burst) "
            "VALUES (%s, %s, %s, %s, %s)",
            (name, algorithm, lim, window_ms, burst),
        )
        return name

    def cleanup(self):
        if not self.names:
            return
        with connect_retry() as conn:
            conn.execute("DELETE FROM rl_policy WHERE name = ANY(%s)", (self.names,))


@pytest.fixture
def policies():
    p = Policies()
    try:
        yield p
    finally:
        p.cleanup()


@pytest.fixture
def fixed_clock(pg):
    """The pg session on the test clock at TEST_CLOCK_MS; returns a setter."""

    def set_clock(ms):
        set_gucs(pg, test_clock_ms=ms)

    set_clock(TEST_CLOCK_MS)
    return set_clock


# ---------------------------------------------------------------- many sessions, one identity


@pytest.mark.parametrize("algorithm", ["token_bucket", "gcra", "sliding_counter"])
def test_many_sessions_one_identity(pg, algorithm):
    """16 sessions x 20 calls on one identity, lim 100 a day: exactly 100.

    Refill: 100 units per 86400 s, so even a (generous) 600 s run refills
    0.69 of a unit, never a whole one -- the count must be exactly 100."""
    lim = 100
    identity = new_ident("many_" + algorithm)
    query = "SELECT rl_%s_allow(%%s, %%s, %%s)" % algorithm
    allowed, seconds = hammer(query, (identity, lim, DAY_MS))
    assert seconds < 600, "too slow for the refill bound"
    assert allowed == lim
    # nothing left, and the next call is denied with a wait
    allowed_now, lim_now, remaining, _, retry = decide(pg, algorithm, identity, lim, DAY_MS, 0)
    assert (allowed_now, lim_now, remaining) == (True, lim, 0)
    allowed_now, _, remaining, _, retry = decide(pg, algorithm, identity, lim, DAY_MS)
    assert allowed_now is False and remaining == 0
    assert 0 < retry <= longest_retry(algorithm, lim, DAY_MS, 1)


def longest_retry(algorithm, lim, window_ms, cost):
    """The longest retry_after_ms a denied call of `cost` can get while
    `cost <= lim`: a window, except for the sliding counter, whose full
    window keeps weighing on the next one until cost/lim of it has passed."""
    if algorithm == "sliding_counter":
        return window_ms + -(-window_ms * cost // lim)
    return window_ms


def test_sliding_counter_retry_reaches_into_the_next_window(pg, fixed_clock):
    """A counter filled just after its window started: the retry runs to
    the window's end and then W * cost / lim into the next one, more than
    one window (the case test_many_sessions_one_identity meets in the
    first 14 minutes after midnight UTC)."""
    W, lim = DAY_MS, 100
    start = TEST_CLOCK_MS // W * W
    fixed_clock(start + 1000)
    identity = new_ident("sc_retry")
    assert decide(pg, "sliding_counter", identity, lim, W, lim)[0] is True
    allowed, _, remaining, _, retry = decide(pg, "sliding_counter", identity, lim, W)
    assert (allowed, remaining) == (False, 0)
    assert retry == W - 1000 + W // lim
    assert retry > W and retry <= longest_retry("sliding_counter", lim, W, 1)
    fixed_clock(start + 1000 + retry - 1)
    assert decide(pg, "sliding_counter", identity, lim, W)[0] is False
    fixed_clock(start + 1000 + retry)
    assert decide(pg, "sliding_counter", identity, lim, W)[0] is True


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_many_sessions_one_policy(pg, shared_redis, policies, algorithm):
    """rl_allow(policy, identity) from 16 sessions: exactly the policy's lim."""
    lim = 100
    name = policies.create(pg, algorithm, lim, DAY_MS, tag=algorithm)
    query = "SELECT rl_allow(%s, %s)"

    def run():
        identity = new_ident("pol_" + algorithm)
        allowed, _ = hammer(query, (name, identity))
        return identity, allowed

    if algorithm == "fixed":
        identity, allowed = same_fixed_window(shared_redis, DAY_MS, run)
    else:
        identity, allowed = run()
    assert allowed == lim
    assert check(pg, name, identity, 0)[:3] == (True, lim, 0)
    assert exists(shared_redis, key_of(algorithm, identity, name, lim, DAY_MS)) == 1


def test_many_sessions_allow_all(pg, shared_redis, policies):
    """rl_allow_all over fixed 30/day and sliding 1000/day from 16 sessions:
    exactly 30 allowed, and the 290 denied calls took nothing from p_big."""
    small = policies.create(pg, "fixed", 30, DAY_MS, tag="small")
    big = policies.create(pg, "sliding", 1000, DAY_MS, tag="big")
    query = "SELECT rl_allow_all(ARRAY[%s, %s]::text[], %s)"

    def run():
        identity = new_ident("all")
        allowed, _ = hammer(query, (small, big, identity))
        # peeks, in the same fixed window
        return identity, allowed, check(pg, big, identity, 0), check(pg, small, identity, 0)

    identity, allowed, peek_big, peek_small = same_fixed_window(shared_redis, DAY_MS, run)
    assert allowed == 30
    assert peek_big[:3] == (True, 1000, 970)
    assert peek_small[:3] == (True, 30, 0)
    assert shared_redis.command("ZCARD", key_of("sliding", identity, big, 1000, DAY_MS)) == 30


def test_check_all_is_all_or_nothing(pg, fixed_clock, policies):
    """Sequential, on the test clock: the second policy's denial takes nothing
    from the first; the result is the most restrictive policy's."""
    a = policies.create(pg, "fixed", 5, 60000, tag="a")
    b = policies.create(pg, "sliding", 3, 60000, tag="b")
    identity = new_ident("all_seq")
    q = RESULT % "rl_check_all(ARRAY[%s, %s]::text[], %s, %s)"
    got = [pg.execute(q, (a, b, identity, 1)).fetchone()[:3] for _ in range(4)]
    assert got == [(True, 3, 2), (True, 3, 1), (True, 3, 0), (False, 3, 0)]
    assert check(pg, a, identity, 0)[:3] == (True, 5, 2)
    # cost 2: a has 2 left, b none -> denied, a keeps its 2
    assert pg.execute(q, (a, b, identity, 2)).fetchone()[0] is False
    assert check(pg, a, identity, 0)[:3] == (True, 5, 2)
    # a policy named twice counts once
    c = policies.create(pg, "token_bucket", 4, 60000, tag="c")
    other = new_ident("all_dup")
    assert pg.execute(q, (c, c, other, 1)).fetchone()[:3] == (True, 4, 3)
    assert check(pg, c, other, 0)[:3] == (True, 4, 3)


# ---------------------------------------------------------------- concurrency slots


def test_concurrency_slots_many_sessions(shared_redis):
    """16 sessions compete for 5 slots, each holding a slot ~0.3 s inside a
    transaction: never more than 5 holders, and every session gets a turn
    because commits give the slots back."""
    identity = new_ident("slots")
    lim = 5
    key = key_of("concurrency", identity, lim=lim, window_ms=60000)
    lock = threading.Lock()
    state = {"holding": 0, "peak": 0, "denied": 0}
    conns = [take_session() for _ in range(THREADS)]

    def work(t, conn):
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            conn.execute("BEGIN")
            got = conn.execute(
                "SELECT rl_concurrency_acquire_allow(%s, %s, 60000)", (identity, lim)
            ).fetchone()[0]
            if got:
                # counted from after the acquire until before the COMMIT, a
                # sub-interval of the time the slot is really held
                with lock:
                    state["holding"] += 1
                    state["peak"] = max(state["peak"], state["holding"])
                time.sleep(0.3)
                with lock:
                    state["holding"] -= 1
                conn.execute("COMMIT")
                return True
            conn.execute("COMMIT")
            with lock:
                state["denied"] += 1
            time.sleep(0.02)
        return False

    try:
        results = run_threads(conns, work)
    finally:
        for c in conns:
            give_back_session(c)
    print("slots: peak holders %d of %d, denied attempts %d" % (state["peak"], lim, state["denied"]))
    assert state["peak"] <= lim
    assert sum(results) == THREADS  # so at least 5 succeeded: all 16 did
    assert state["denied"] > 0  # there was contention
    assert exists(shared_redis, key) == 0  # every slot was given back


def test_autocommit_acquire_is_released_at_once(pg, shared_redis):
    identity = new_ident("slot_auto")
    for _ in range(3):
        assert acquire(pg, identity, 1, 60000) == (True, 1, 0, 60000, 0)
    assert exists(shared_redis, key_of("concurrency", identity, lim=1, window_ms=60000)) == 0


@pytest.mark.parametrize("ending", ["commit", "rollback", "error"])
def test_transaction_end_releases_slot(shared_redis, ending):
    identity = new_ident("slot_" + ending)
    key = key_of("concurrency", identity, lim=1, window_ms=60000)
    with pg_connect() as a, pg_connect() as b:
        a.execute("BEGIN")
        got = acquire(a, identity, 1, 60000)
        assert got[:3] == (True, 1, 0) and got[4] == 0
        assert shared_redis.command("ZCARD", key) == 1
        denied = acquire(b, identity, 1, 60000)
        assert denied[:3] == (False, 1, 0)
        assert 0 < denied[4] <= 60000
        if ending == "commit":
            a.execute("COMMIT")
        elif ending == "rollback":
            a.execute("ROLLBACK")
        else:
            with pytest.raises(psycopg.errors.DivisionByZero):
                a.execute("SELECT 1 / 0")
            # the transaction is aborted at the error, before the ROLLBACK
            assert exists(shared_redis, key) == 0
        assert exists(shared_redis, key) == 0
        assert acquire(b, identity, 1, 60000)[:3] == (True, 1, 0)
        if ending == "error":
            a.execute("ROLLBACK")
        # a holds nothing any more
        assert a.execute("SELECT rl_concurrency_release(%s)", (identity,)).fetchone()[0] is False


def test_release_inside_transaction(shared_redis):
    identity = new_ident("slot_release")
    key = key_of("concurrency", identity, lim=2, window_ms=60000)
    release = "SELECT rl_concurrency_release(%s)"
    with pg_connect() as a, pg_connect() as b:
        assert a.execute(release, (identity,)).fetchone()[0] is False  # holds none
        a.execute("BEGIN")
        assert acquire(a, identity, 2, 60000)[:3] == (True, 2, 1)
        assert acquire(a, identity, 2, 60000)[:3] == (True, 2, 0)
        assert acquire(b, identity, 2, 60000)[0] is False
        assert a.execute(release, (identity,)).fetchone()[0] is True
        assert shared_redis.command("ZCARD", key) == 1
        # the transaction is still open: b gets the slot a gave back
        b.execute("BEGIN")
        assert acquire(b, identity, 2, 60000)[:3] == (True, 2, 0)
        assert acquire(a, identity, 2, 60000)[0] is False
        assert a.execute(release, (identity,)).fetchone()[0] is True
        assert a.execute(release, (identity,)).fetchone()[0] is False  # none left
        assert shared_redis.command("ZCARD", key) == 1  # b's
        a.execute("COMMIT")
        assert shared_redis.command("ZCARD", key) == 1
        b.execute("COMMIT")
        assert exists(shared_redis, key) == 0


def test_ended_lease_is_taken_over(shared_redis):
    """On the test clock: once a holder's lease has ended its slot goes to
    someone else, and the old holder's release or COMMIT does not free the
    new holder's slot. (Every call names the same limit, 1 slot with a 30 s
    lease: an explicit limit is part of the key, so another lease would be
    another counter.)"""
    identity = new_ident("slot_lease")
    key = key_of("concurrency", identity, lim=1, window_ms=30000)
    release = "SELECT rl_concurrency_release(%s)"
    with pg_connect() as a, pg_connect() as b:
        set_gucs(a, test_clock_ms=TEST_CLOCK_MS)
        a.execute("BEGIN")
        assert acquire(a, identity, 1, 30000) == (True, 1, 0, 30000, 0)
        set_gucs(b, test_clock_ms=TEST_CLOCK_MS + 29999)
        assert acquire(b, identity, 1, 30000) == (False, 1, 0, 1, 1)
        set_gucs(b, test_clock_ms=TEST_CLOCK_MS + 30000)
        b.execute("BEGIN")
        assert acquire(b, identity, 1, 30000) == (True, 1, 0, 30000, 0)
        assert a.execute(release, (identity,)).fetchone()[0] is False  # its lease had ended
        assert shared_redis.command("ZCARD", key) == 1
        set_gucs(a, test_clock_ms=TEST_CLOCK_MS + 30000)
        assert acquire(a, identity, 1, 30000)[0] is False
        a.execute("COMMIT")
        assert shared_redis.command("ZCARD", key) == 1
        b.execute("COMMIT")
        assert exists(shared_redis, key) == 0


def test_terminated_backend_releases_slot(pg, shared_redis):
    """pg_terminate_backend of an idle-in-transaction holder: the backend
    aborts its transaction on the way out, which gives the slot back at once
    (the 60 s lease could not explain a quick return)."""
    identity = new_ident("slot_term")
    key = key_of("concurrency", identity, lim=1, window_ms=60000)
    a = pg_connect()
    try:
        a.execute("BEGIN")
        assert acquire(a, identity, 1, 60000)[0] is True
        pid = a.info.backend_pid
        assert acquire(pg, identity, 1, 60000)[0] is False
        t0 = time.monotonic()
        assert pg.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone()[0] is True
        while exists(shared_redis, key) and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        took = time.monotonic() - t0
        print("slot back %.3f s after pg_terminate_backend" % took)
        assert exists(shared_redis, key) == 0
        assert took < 5.0  # ~1 s expected; generous for a loaded machine
        assert acquire(pg, identity, 1, 60000)[:3] == (True, 1, 0)
        with pytest.raises(psycopg.OperationalError):
            a.execute("SELECT 1")
    finally:
        a.close()


@pytest.mark.alone  # the crash restart ends every session of the cluster
def test_sigkilled_backend_slot_returns_after_lease(shared_redis):
    """A holder killed with SIGKILL never gives its slot back: the slot stays
    taken until its lease ends, then it is free. (SIGKILL makes the
    postmaster restart every backend; we reconnect with retries.) On the
    frozen clock: taken at T with a 60 s lease (the key's expiry in Redis,
    60 s of real time, outlasts the crash restart), denied at T + 25 s with
    exactly the 35 s left and at T + 60 s - 1 ms with 1 ms left, allowed at
    T + 60 s, when the dead holder's entry is gone."""
    lease_ms = 60000
    identity = new_ident("slot_kill9")
    key = key_of("concurrency", identity, lim=1, window_ms=lease_ms)
    # a session of its own, ended by the crash restart: once it is gone, a
    # new connection is one made after the restart
    watcher = pg_connect()
    a = pg_connect()
    try:
        set_gucs(a, test_clock_ms=TEST_CLOCK_MS)
        a.execute("BEGIN")
        assert acquire(a, identity, 1, lease_ms) == (True, 1, 0, lease_ms, 0)
        pid = a.info.backend_pid
        members = shared_redis.command("ZRANGE", key, 0, -1, "WITHSCORES")
        assert len(members) == 2
        dead = members[0]
        assert float(members[1]) == (TEST_CLOCK_MS + lease_ms) * 1000.0
        os.kill(pid, signal.SIGKILL)
    finally:
        a.close()

    deadline = time.monotonic() + 30
    try:
        while True:
            assert time.monotonic() < deadline, "the crash restart never ended the other sessions"
            try:
                watcher.execute("SELECT 1")
            except psycopg.OperationalError:
                break
            time.sleep(0.05)
    finally:
        watcher.close()
    b = connect_retry(timeout=30)
    try:
        # every backend was restarted: nobody gave it back
        assert shared_redis.command("ZRANGE", key, 0, -1) == [dead]
        set_gucs(b, test_clock_ms=TEST_CLOCK_MS + 25000)
        # retry_after_ms is the time until the dead holder's lease ends
        assert acquire(b, identity, 1, lease_ms) == (False, 1, 0, 35000, 35000)
        set_gucs(b, test_clock_ms=TEST_CLOCK_MS + lease_ms - 1)
        assert acquire(b, identity, 1, lease_ms) == (False, 1, 0, 1, 1)
        assert shared_redis.command("ZRANGE", key, 0, -1) == [dead]
        set_gucs(b, test_clock_ms=TEST_CLOCK_MS + lease_ms)
        b.execute("BEGIN")
        assert acquire(b, identity, 1, lease_ms) == (True, 1, 0, lease_ms, 0)
        # the dead holder's entry is gone; the one left is b's new slot
        members = shared_redis.command("ZRANGE", key, 0, -1, "WITHSCORES")
        assert len(members) == 2 and members[0] != dead, members
        assert float(members[1]) == (TEST_CLOCK_MS + 2 * lease_ms) * 1000.0
        b.execute("COMMIT")
        assert exists(shared_redis, key) == 0
    finally:
        b.close()


# ---------------------------------------------------------------- policy changes


def test_policy_change_seen_by_open_session(policies):
    with pg_connect() as a, pg_connect() as b:
        set_gucs(a, test_clock_ms=TEST_CLOCK_MS)
        name = policies.create(b, "fixed", 2, 60000, tag="x")
        identity = new_ident("polchange")
        got = [check(a, name, identity)[:3] for _ in range(3)]
        assert got == [(True, 2, 1), (True, 2, 0), (False, 2, 0)]

        # a committed UPDATE is seen by a's next call; a fixed window's
        # count goes on under the new lim
        b.execute("UPDATE rl_policy SET lim = 5 WHERE name = %s", (name,))
        assert check(a, name, identity)[:3] == (True, 5, 2)

        # an uncommitted one is not; a rolled back one never is
        b.execute("BEGIN")
        b.execute("UPDATE rl_policy SET lim = 10 WHERE name = %s", (name,))
        assert check(a, name, identity)[:3] == (True, 5, 1)
        b.execute("ROLLBACK")
        assert check(a, name, identity)[:3] == (True, 5, 0)
        b.execute("BEGIN")
        b.execute("UPDATE rl_policy SET lim = 10 WHERE name = %s", (name,))
        assert [check(a, name, identity)[:3] for _ in range(3)] == [(False, 5, 0)] * 3
        b.execute("COMMIT")
        assert check(a, name, identity)[:3] == (True, 10, 4)

        # back to the first lim: the 6 units taken deny at once
        b.execute("UPDATE rl_policy SET lim = 2 WHERE name = %s", (name,))
        assert check(a, name, identity)[:3] == (False, 2, 0)

        # another algorithm: another key, starting empty
        b.execute("UPDATE rl_policy SET algorithm = 'sliding', lim = 3 WHERE name = %s", (name,))
        assert check(a, name, identity)[:3] == (True, 3, 2)

        # DELETE: the policy is gone for a
        b.execute("DELETE FROM rl_policy WHERE name = %s", (name,))
        with pytest.raises(psycopg.errors.UndefinedObject) as excinfo:
            check(a, name, identity)
        assert excinfo.value.sqlstate == "42704"

        # INSERT of a new policy, after a looked for it in vain
        new = policies.name("new")
        with pytest.raises(psycopg.errors.UndefinedObject):
            check(a, new, identity)
        b.execute(
            "INSERT INTO rl_policy (name, algorithm, lim, window_ms) VALUES (%s, 'gcra', 4, 60000)",
            (new,),
        )
        assert check(a, new, identity)[:3] == (True, 4, 3)

        # the deleted name inserted again, with other numbers
        b.execute(
            "INSERT INTO rl_policy (name, algorithm, lim, window_ms) VALUES (%s, 'sliding', 7, 60000)",
            (name,),
        )
        # the same window: the sliding count goes on under the new lim
        assert check(a, name, identity)[:3] == (True, 7, 5)


def test_policy_change_seen_inside_cached_rl_allow_all(policies):
    """rl_allow_all uses the same cache: an UPDATE in another session changes
    its numbers too; a fixed window's count goes on under the new lim."""
    with pg_connect() as a, pg_connect() as b:
        set_gucs(a, test_clock_ms=TEST_CLOCK_MS)
        p1 = policies.create(b, "fixed", 2, 60000, tag="fx")
        p2 = policies.create(b, "sliding_counter", 50, 60000, tag="sc")
        identity = new_ident("polchange_all")
        q = "SELECT rl_allow_all(ARRAY[%s, %s]::text[], %s)"
        assert [a.execute(q, (p1, p2, identity)).fetchone()[0] for _ in range(3)] == [True, True, False]
        b.execute("UPDATE rl_policy SET lim = 4 WHERE name = %s", (p1,))
        assert [a.execute(q, (p1, p2, identity)).fetchone()[0] for _ in range(5)] == [True] * 2 + [False] * 3
        assert check(a, p2, identity, 0)[:3] == (True, 50, 46)


# ---------------------------------------------------------------- sliding counter vs sliding log


def mixed_stream(seed, lim, window_ms, windows):
    """Deterministic request times (integer ms from 0, sorted) over `windows`
    windows: back-to-back phases of random length (0.5 to 1.5 windows, so
    they do not line up with the counter's windows), each uniform (Poisson)
    or bursty (2 to 5 bursts of 2 s), at 0.5x to 2x the limit's rate."""
    rnd = random.Random(seed)
    W = window_ms
    end = windows * W
    times = []
    t = 0.0
    while t < end:
        length = rnd.uniform(0.5, 1.5) * W
        kind = rnd.choice(["uniform", "uniform", "bursty"])
        rate_x = rnd.choice([0.5, 0.8, 1.0, 1.3, 2.0])
        count = int(rate_x * lim * length / W)
        seg_end = min(t + length, end)
        if kind == "uniform":
            u = t
            while True:
                u += rnd.expovariate(count / length)
                if u >= seg_end:
                    break
                times.append(int(u))
        else:
            bursts = rnd.randint(2, 5)
            for _ in range(bursts):
                at = rnd.uniform(t, max(t, seg_end - 2000))
                for _ in range(count // bursts):
                    times.append(int(at + rnd.uniform(0, 2000)))
        t = seg_end
    return sorted(x for x in times if x < end)


def edge_stream(seed, lim, window_ms, windows):
    """Like mixed_stream, but with phases of exactly one counter window and
    bursts placed at the ends and starts of windows: the counter's worst
    case (a full previous window whose units all sit at its end)."""
    rnd = random.Random(seed)
    times = []

    def poisson(start, length, count):
        t = start
        rate = count / float(length)
        while True:
            t += rnd.expovariate(rate)
            if t >= start + length:
                return
            times.append(int(t))

    def burst(at, length, count):
        for _ in range(count):
            times.append(int(at + rnd.uniform(0, length)))

    W = window_ms
    for w in range(windows):
        s = w * W
        phase = w % 5
        if phase == 0:  # uniform, 0.8 x the limit
            poisson(s, W, int(0.8 * lim))
        elif phase == 1:  # uniform, 1.5 x the limit
            poisson(s, W, int(1.5 * lim))
        elif phase == 2:  # a few bursts at random moments
            for _ in range(3):
                burst(s + rnd.uniform(0, W - 2000), 1000, int(0.6 * lim))
        elif phase == 3:  # a burst at the end of the window, then trickle
            burst(s + W - 5000, 4000, int(1.1 * lim))
            poisson(s, W, int(0.3 * lim))
        else:  # a burst at the start of the window, then uniform overload
            burst(s, 3000, int(1.2 * lim))
            poisson(s, W, int(1.0 * lim))
    return sorted(times)


def log_model(times_ms, lim, W):
    """The sliding log on integer-ms request times: a unit counts while
    now - W < t <= now."""
    allowed = []
    decisions = []
    for t in times_ms:
        n = sum(1 for a in allowed if a > t - W)  # small: fine
        ok = n + 1 <= lim
        if ok:
            allowed.append(t)
        decisions.append(ok)
    return decisions


def counter_model(times_ms, lim, W):
    """The documented two-window estimate: prev * (W - elapsed)/W + cur,
    allowed if estimate + cost <= lim (same float arithmetic as the Lua)."""
    state = None  # (w, c, p)
    decisions = []
    for t in times_ms:
        now_ms = float(t)
        start = math.floor(now_ms / W) * W
        c = p = 0
        if state is not None:
            w, sc, sp = state
            if w == start:
                c, p = sc, sp
            elif w == start - W:
                p = sc
        weight = (W - (now_ms - start)) / W
        ok = p * weight + (c + 1) <= lim + 1e-9
        if ok:
            state = (start, c + 1, p)
        decisions.append(ok)
    return decisions


def max_trailing(allowed_times, W):
    """The most allowed requests in any trailing window (t - W, t]."""
    best = 0
    j = 0
    for i, t in enumerate(allowed_times):
        while allowed_times[j] <= t - W:
            j += 1
        best = max(best, i - j + 1)
    return best


# The calls of a request stream, one per test-clock time of clocks, in
# order: the sliding log's and the sliding counter's decisions.
STREAM_FUNCTION = """
CREATE OR REPLACE FUNCTION pg_temp.rl_test_stream(clocks bigint[], id_log text, id_cnt text,
                                                  lim integer, w bigint)
RETURNS TABLE (a boolean, b boolean) LANGUAGE plpgsql AS $$
DECLARE
  t bigint;
BEGIN
  FOREACH t IN ARRAY clocks LOOP
    PERFORM set_config('rl_redis.test_clock_ms', t::text, false);
    a := rl_sliding_allow(id_log, lim, w);
    b := rl_sliding_counter_allow(id_cnt, lim, w);
    RETURN NEXT;
  END LOOP;
END $$"""


@pytest.mark.parametrize(
    "stream, seed",
    [("mixed", 0), ("mixed", 1), ("mixed", 2), ("mixed", 3), ("mixed", 4), ("edge", 20240611)],
)
def test_sliding_counter_vs_sliding_log(pg, shared_redis, fixed_clock, stream, seed):
    """The same request stream through the sliding log and the sliding-window
    counter, on the test clock. Both must match their reference models call
    by call; the log never lets more than lim through in any trailing
    window; the counter stays within 2 x lim (its documented worst case) and,
    on the mixed streams, within 10% of the log's allowed total. The edge
    stream is built to hit the counter's weak spot: only the 2 x bound holds
    there."""
    lim, W, windows = 100, 60000, 10
    make = mixed_stream if stream == "mixed" else edge_stream
    offsets = make(seed, lim, W, windows)
    base = TEST_CLOCK_MS  # a multiple of W: the counter's windows start at base + k*W
    assert base % W == 0
    id_log, id_cnt = new_ident("err_log"), new_ident("err_cnt")
    keys = [key_of("sliding", id_log, lim=lim, window_ms=W),
            key_of("sliding_counter", id_cnt, lim=lim, window_ms=W)]
    # the stream in one statement, each call on its own test-clock time (a
    # round trip per call cost the suite's CPU, not the test's point); the
    # keys expire on the real clock 60 s after a call wrote them while the
    # test clock stands still, far more than the statement takes
    pg.execute(STREAM_FUNCTION)
    try:
        rows = pg.execute("SELECT a, b FROM pg_temp.rl_test_stream(%s, %s, %s, %s, %s)",
                          ([base + off for off in offsets], id_log, id_cnt, lim, W)).fetchall()
    finally:
        for key in keys:
            shared_redis.command("DEL", key)
    got_log = [a for a, _ in rows]
    got_cnt = [b for _, b in rows]
    assert len(rows) == len(offsets)

    # both match their reference models call by call
    assert got_log == log_model(offsets, lim, W)
    assert got_cnt == counter_model(offsets, lim, W)

    log_times = [t for t, ok in zip(offsets, got_log) if ok]
    cnt_times = [t for t, ok in zip(offsets, got_cnt) if ok]
    log_max = max_trailing(log_times, W)
    cnt_max = max_trailing(cnt_times, W)
    differ = sum(1 for x, y in zip(got_log, got_cnt) if x != y)
    total_err = (len(cnt_times) - len(log_times)) / float(len(log_times))
    print(
        "\nsliding counter vs log, %s stream seed %d: %d requests over %d windows of %d ms, lim %d\n"
        "  allowed: log %d, counter %d (%+.1f%%)\n"
        "  decisions that differ: %d (%.1f%% of requests)\n"
        "  max in any trailing window: log %d, counter %d (x%.2f of lim)"
        % (stream, seed, len(offsets), windows, W, lim, len(log_times), len(cnt_times),
           100 * total_err, differ, 100.0 * differ / len(offsets), log_max, cnt_max,
           cnt_max / float(lim))
    )
    assert log_max <= lim  # exact: the log never goes over
    assert log_max == lim  # and the stream does fill it
    assert cnt_max <= 2 * lim  # the documented worst case
    if stream == "mixed":
        assert abs(total_err) <= 0.10


# ---------------------------------------------------------------- peeks, refunds, reset


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_peek_consumes_nothing(pg, shared_redis, fixed_clock, algorithm):
    lim, W = 10, 60000
    identity = new_ident("peek_" + algorithm)
    key = key_of(algorithm, identity, lim=lim, window_ms=W)
    # on a fresh identity: full, and no state is written
    assert decide(pg, algorithm, identity, lim, W, 0)[:3] == (True, lim, lim)
    assert exists(shared_redis, key) == 0
    assert decide(pg, algorithm, identity, lim, W, 3)[:3] == (True, lim, 7)
    for _ in range(5):
        assert decide(pg, algorithm, identity, lim, W, 0)[:3] == (True, lim, 7)
    assert decide(pg, algorithm, identity, lim, W, 7)[:3] == (True, lim, 0)
    for _ in range(3):
        peek = decide(pg, algorithm, identity, lim, W, 0)
        assert peek[:3] == (True, lim, 0) and peek[4] == 0
    denied = decide(pg, algorithm, identity, lim, W, 1)
    assert denied[:3] == (False, lim, 0) and denied[4] > 0
    assert decide(pg, algorithm, identity, lim, W, 0)[:3] == (True, lim, 0)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_peek_of_policy_consumes_nothing(pg, fixed_clock, policies, algorithm):
    name = policies.create(pg, algorithm, 4, 60000, tag="peek")
    identity = new_ident("ppeek_" + algorithm)
    assert check(pg, name, identity, 1)[:3] == (True, 4, 3)
    for _ in range(4):
        assert check(pg, name, identity, 0)[:3] == (True, 4, 3)
    q = RESULT % "rl_check_all(ARRAY[%s]::text[], %s, 0)"
    assert pg.execute(q, (name, identity)).fetchone()[:3] == (True, 4, 3)
    assert check(pg, name, identity, 3)[:3] == (True, 4, 0)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_refund_never_exceeds_lim(pg, shared_redis, fixed_clock, algorithm):
    lim, W = 10, 60000
    identity = new_ident("refund_" + algorithm)
    key = key_of(algorithm, identity, lim=lim, window_ms=W)
    # on a fresh identity: nothing to give back, no state written
    assert refund(pg, algorithm, identity, lim, W, 5)[:3] == (True, lim, lim)
    assert exists(shared_redis, key) == 0
    # partial refund
    assert decide(pg, algorithm, identity, lim, W, 5)[:3] == (True, lim, 5)
    assert refund(pg, algorithm, identity, lim, W, 2)[:3] == (True, lim, 7)
    assert decide(pg, algorithm, identity, lim, W, 0)[:3] == (True, lim, 7)
    # refund far more than was taken: back to lim, not above
    got = refund(pg, algorithm, identity, lim, W, 1000)
    assert got == (True, lim, lim, 0, 0)
    assert decide(pg, algorithm, identity, lim, W, 0)[:3] == (True, lim, lim)
    assert exists(shared_redis, key) == 0  # a full allowance is the same as no state
    # exactly lim units fit afterwards, not one more
    got = [decide(pg, algorithm, identity, lim, W)[0] for _ in range(lim + 1)]
    assert got == [True] * lim + [False]


@pytest.mark.parametrize("algorithm", ["token_bucket", "gcra"])
def test_refund_never_exceeds_burst(pg, fixed_clock, algorithm):
    lim, W, burst = 10, 60000, 20
    identity = new_ident("refund_burst_" + algorithm)
    assert decide(pg, algorithm, identity, lim, W, 3, burst)[:3] == (True, burst, 17)
    assert refund(pg, algorithm, identity, lim, W, 1000, burst)[:3] == (True, burst, burst)
    got = [decide(pg, algorithm, identity, lim, W, 1, burst)[0] for _ in range(burst + 1)]
    assert got == [True] * burst + [False]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_policy_refund_never_exceeds_lim(pg, fixed_clock, policies, algorithm):
    name = policies.create(pg, algorithm, 6, 60000, tag="refund")
    identity = new_ident("prefund_" + algorithm)
    assert check(pg, name, identity, 3)[:3] == (True, 6, 3)
    q = RESULT % "rl_refund(%s, %s, %s)"
    assert pg.execute(q, (name, identity, 1000)).fetchone()[:3] == (True, 6, 6)
    assert check(pg, name, identity, 0)[:3] == (True, 6, 6)
    assert check(pg, name, identity, 7)[0] is False


def probe(pg, redis, algorithm, identity, lim, W, cost, at_ms, burst=None):
    """The decision a call of `cost` would get at clock at_ms, made on a copy
    of the identity's state (Redis COPY to a probe identity), so the real
    state is left alone."""
    probe_id = identity + ":probe"
    probe_key = key_of(algorithm, probe_id, lim=lim, window_ms=W, burst=burst)
    redis.command("DEL", probe_key)
    redis.command("COPY", key_of(algorithm, identity, lim=lim, window_ms=W, burst=burst), probe_key)
    set_gucs(pg, test_clock_ms=at_ms)
    return decide(pg, algorithm, probe_id, lim, W, cost, burst)


STEPS = int(os.environ.get("RL_EXACT_STEPS", "120"))


@pytest.mark.parametrize(
    "algorithm, burst",
    [(alg, None) for alg in ALGORITHMS] + [("token_bucket", 25), ("gcra", 25), ("gcra", 3)],
)
def test_retry_after_and_reset_are_exact(pg, shared_redis, algorithm, burst):
    """A random walk of calls on the test clock (varied gaps, costs 0 to
    cap + 1). After every call, on a copy of the state:
      - denied with retry_after_ms R: the same call is allowed at +R ms (a
        client that waits R is served) and still denied at +R-2 ms;
        R = -1 exactly when cost > capacity
      - reset_ms Z: a peek shows the full capacity at +Z and less at +Z-2
      - remaining is what a peek right after shows (for allowed calls).
    R and Z are the waits rounded up to the ms, never more: a probe at
    +R-1 (+Z-1) must still be denied (short of capacity)."""
    lim, W = 10, 60000
    cap = burst or lim
    rnd = random.Random(zlib.crc32(("%s/%s" % (algorithm, burst)).encode()))
    identity = new_ident("exact_" + algorithm)
    now = TEST_CLOCK_MS + 12345
    late = []  # (what, step, call, probe): a wait 1 ms longer than needed
    expired = 0
    key = key_of(algorithm, identity, lim=lim, window_ms=W, burst=burst)
    for step in range(STEPS):
        gap = rnd.choice([0, 0, 1, rnd.randint(1, 999), rnd.randint(1, W // 4),
                          rnd.randint(W // 2, 2 * W)])
        now += gap
        cost = rnd.choice([0, 1, 1, 1, 2, 3, rnd.randint(1, cap), cap, cap + 1])
        set_gucs(pg, test_clock_ms=now)
        call = decide(pg, algorithm, identity, lim, W, cost, burst)
        allowed, lim_r, remaining, reset, retry = call
        where = "step %d at +%d ms, cost %d: %r" % (step, now - TEST_CLOCK_MS, cost, call)
        assert lim_r == cap, where
        assert 0 <= remaining <= cap, where
        assert reset >= 0, where
        # The scripts PEXPIRE keys by test-clock durations, which Redis
        # counts in real time: a state a few ms from clear could vanish
        # while we probe it. Take the expiry off (the scripts never rely on
        # it: every state carries its own timestamps); if it is already
        # gone, this step cannot be probed.
        shared_redis.command("PERSIST", key)
        if reset > 0 and not exists(shared_redis, key):
            expired += 1
            continue
        if cost > cap:
            assert (allowed, retry) == (False, -1), where
        elif allowed:
            assert retry == 0, where
            assert probe(pg, shared_redis, algorithm, identity, lim, W, 0, now, burst)[2] == remaining, where
        else:
            assert retry > 0, where
            got = probe(pg, shared_redis, algorithm, identity, lim, W, cost, now + retry, burst)
            assert got[0] is True, "%s; at +retry: %r" % (where, got)
            if retry > 1:
                got = probe(pg, shared_redis, algorithm, identity, lim, W, cost, now + retry - 1, burst)
                if got[0]:
                    late.append(("retry_after_ms", where, got))
            if retry > 2:
                got = probe(pg, shared_redis, algorithm, identity, lim, W, cost, now + retry - 2, burst)
                assert got[0] is False, "%s; at +retry-2: %r" % (where, got)
        if reset == 0:
            assert probe(pg, shared_redis, algorithm, identity, lim, W, 0, now, burst)[2] == cap, where
        else:
            got = probe(pg, shared_redis, algorithm, identity, lim, W, 0, now + reset, burst)
            assert got[2] == cap, "%s; at +reset: %r" % (where, got)
            got = probe(pg, shared_redis, algorithm, identity, lim, W, 0, now + reset - 1, burst)
            if got[2] == cap:
                late.append(("reset_ms", where, got))
            if reset > 1:
                got = probe(pg, shared_redis, algorithm, identity, lim, W, 0, now + reset - 2, burst)
                assert got[2] < cap, "%s; at +reset-2: %r" % (where, got)
        set_gucs(pg, test_clock_ms=now)
    for k in (key, key_of(algorithm, identity + ":probe", lim=lim, window_ms=W, burst=burst)):
        shared_redis.command("DEL", k)
    print("\n%s burst %s: %d of %d steps not probed (expired in real time)"
          % (algorithm, burst, expired, STEPS))
    assert expired <= STEPS // 10
    assert late == [], "waits 1 ms longer than needed: %r" % late


def test_reset_removes_every_key(pg, shared_redis, policies):
    identity = new_ident("reset")
    other = new_ident("reset_other")
    W = 3600000
    names = {alg: policies.create(pg, alg, 10, W, tag="reset") for alg in ALGORITHMS}

    def fill(ident):
        for alg in ALGORITHMS:
            assert decide(pg, alg, ident, 10, W)[0] is True
            assert check(pg, names[alg], ident)[0] is True

    fill(identity)
    fill(other)
    keys = [key_of(alg, identity, lim=10, window_ms=W) for alg in ALGORITHMS]
    keys += [key_of(alg, identity, names[alg], 10, W) for alg in ALGORITHMS]
    other_keys = [key_of(alg, other, lim=10, window_ms=W) for alg in ALGORITHMS]
    other_keys += [key_of(alg, other, names[alg], 10, W) for alg in ALGORITHMS]
    slot_key = key_of("concurrency", identity, lim=1, window_ms=60000)
    other_slot_key = key_of("concurrency", other, lim=1, window_ms=60000)

    with pg_connect() as holder:
        holder.execute("BEGIN")
        assert acquire(holder, identity, 1, 60000)[0] is True
        assert acquire(holder, other, 1, 60000)[0] is True
        for k in keys + [slot_key] + other_keys + [other_slot_key]:
            assert exists(shared_redis, k) == 1, k

        pg.execute("SELECT rl_reset(%s)", (identity,))
        for k in keys + [slot_key]:
            assert exists(shared_redis, k) == 0, k
        for k in other_keys + [other_slot_key]:
            assert exists(shared_redis, k) == 1, k  # another identity is untouched

        # everything starts over for identity
        for alg in ALGORITHMS:
            assert decide(pg, alg, identity, 10, W, 0)[:3] == (True, 10, 10)
            assert check(pg, names[alg], identity, 0)[:3] == (True, 10, 10)
        assert acquire(pg, identity, 1, 60000)[:3] == (True, 1, 0)
        holder.execute("COMMIT")  # gives back a slot that is gone: no error

    assert exists(shared_redis, other_slot_key) == 0
    pg.execute("SELECT rl_reset(%s)", (other,))
    for k in other_keys:
        assert exists(shared_redis, k) == 0, k
