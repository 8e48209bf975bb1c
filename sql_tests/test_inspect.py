"""Inspecting a quota (issue 21, item 1): rl_inspect, the peeks of the
statistics and rl_concurrency_holders.

rl_inspect(policy, identity, cost) runs the policy's script as a dry run: it
decides as rl_check (or, for a concurrency policy, rl_acquire of cost
slots) would now and writes nothing in Redis. Each test compares it with
the real call made right after, on the test clock (so both decide at the
same instant), and the key's value (DUMP) and absolute expiry (PEXPIRETIME)
before and after the inspections. Inspections and calls of cost 0 are
counted as peeks, not as calls. rl_concurrency_holders lists the tokens of
the slots held now (of one identity, or of every identity of the policy),
the pid in each and when its lease ends.
"""

import datetime
import uuid

import psycopg
from psycopg import sql
import pytest

from conftest import ALGORITHMS, new_ident, pg_connect, rl_key, set_gucs

BASE_CLOCK_MS = 1000000020000  # on a whole minute (fixed windows start here)
LIM, WINDOW_MS = 3, 60000
LEASE_MS = 60000
INSPECTIONS = 3

# (clock offset ms, cost) of the real calls, each inspected first: used up,
# denied, refilled in part, a unit out of the sliding log's window (which
# the inspection must leave in the log), a cost larger than lim
STEPS = [(0, 3), (0, 1), (10000, 1), (30000, 2), (65000, 1), (65000, 5)]


def result(conn, fn, policy, identity, cost):
    return conn.execute(
        sql.SQL("SELECT (r).allowed, (r).lim, (r).remaining, (r).reset_ms, (r).retry_after_ms"
                " FROM (SELECT {}(%s, %s, %s) AS r) s").format(sql.Identifier(fn)),
        (policy, identity, cost)).fetchone()


def state(redis, key):
    """The key's value and absolute expiry (ms), as Redis holds them."""
    return redis.command("DUMP", key), redis.command("PEXPIRETIME", key)


def keys_of(redis, identity):
    return set(redis.command("KEYS", "rl:*{%s}*" % identity))


def sqlstate_of(conn, query, params=None):
    with pytest.raises(psycopg.Error) as e:
        conn.execute(query, params).fetchall()
    return e.value.sqlstate


@pytest.fixture
def policies(pg):
    """Makes policies (algorithm, lim, window_ms) of fresh names; deletes
    them at teardown."""
    made = []

    def make(algorithm, lim=LIM, window_ms=WINDOW_MS):
        name = "inspect_%s" % uuid.uuid4().hex[:12]
        pg.execute("INSERT INTO rl_policy (name, algorithm, lim, window_ms) VALUES (%s, %s, %s, %s)",
                   (name, algorithm, lim, window_ms))
        made.append(name)
        return name

    yield make
    pg.execute("DELETE FROM rl_policy WHERE name = ANY(%s)", (made,))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_inspect_says_what_the_call_says_and_writes_nothing(pg, policies, shared_redis, algorithm):
    policy = policies(algorithm)
    identity = new_ident("inspect")
    key = rl_key(algorithm, identity, policy, LIM, WINDOW_MS)
    seen = []
    for offset, cost in STEPS:
        set_gucs(pg, test_clock_ms=BASE_CLOCK_MS + offset)
        before = state(shared_redis, key)
        inspected = [result(pg, "rl_inspect", policy, identity, cost) for _ in range(INSPECTIONS)]
        assert state(shared_redis, key) == before, (offset, cost)
        called = result(pg, "rl_check", policy, identity, cost)
        assert inspected == [called] * INSPECTIONS, (offset, cost)
        seen.append(called)
    # used up: denied, with the wait of the real call; a cost over lim never fits
    assert seen[1][0] is False and seen[1][4] > 0, seen
    assert seen[-1][0] is False and seen[-1][4] == -1, seen


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_inspect_of_an_unused_identity_makes_no_key(pg, policies, shared_redis, algorithm):
    policy = policies(algorithm)
    identity = new_ident("inspect")
    set_gucs(pg, test_clock_ms=BASE_CLOCK_MS)
    allowed, lim, remaining, _, retry = result(pg, "rl_inspect", policy, identity, 1)
    assert (allowed, lim, remaining, retry) == (True, LIM, LIM - 1, 0)
    assert result(pg, "rl_inspect", policy, identity, 0) == (True, LIM, LIM, 0, 0)
    assert keys_of(shared_redis, identity) == set()


def test_inspect_leaves_the_sliding_log_as_it_is(pg, policies, shared_redis):
    """A dry run counts the units that left the window out and leaves them
    in the log (the real call removes them)."""
    policy = policies("sliding")
    identity = new_ident("inspect")
    key = rl_key("sliding", identity, policy, LIM, WINDOW_MS)
    set_gucs(pg, test_clock_ms=BASE_CLOCK_MS)
    result(pg, "rl_check", policy, identity, 3)
    set_gucs(pg, test_clock_ms=BASE_CLOCK_MS + WINDOW_MS + 1)
    assert result(pg, "rl_inspect", policy, identity, 1) == (True, LIM, LIM - 1, WINDOW_MS, 0)
    assert shared_redis.command("ZCARD", key) == 3
    assert result(pg, "rl_check", policy, identity, 1) == (True, LIM, LIM - 1, WINDOW_MS, 0)
    assert shared_redis.command("ZCARD", key) == 1


@pytest.fixture
def holders(policies):
    """A concurrency policy of lim 2 and sessions that hold its slots for
    one identity, each in a transaction left open: hold() takes one and
    returns the session's pid."""
    policy = policies("concurrency", 2, LEASE_MS)
    identity = new_ident("inspect_cc")
    conns = []

    def hold(clock_ms=BASE_CLOCK_MS):
        conn = pg_connect()
        conns.append(conn)
        set_gucs(conn, test_clock_ms=clock_ms)
        conn.execute("BEGIN")
        assert conn.execute("SELECT rl_acquire_allow(%s, %s)", (policy, identity)).fetchone()[0]
        return conn.info.backend_pid

    yield policy, identity, hold
    for conn in conns:
        conn.close()


def lease_end(clock_ms):
    """When a lease taken at clock_ms ends, as a timestamptz reads."""
    return (datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
            + datetime.timedelta(milliseconds=clock_ms + LEASE_MS))


def test_inspect_concurrency(pg, holders, shared_redis):
    policy, identity, hold = holders
    key = rl_key("concurrency", identity, policy, 2, LEASE_MS)
    set_gucs(pg, test_clock_ms=BASE_CLOCK_MS + 1000)
    assert result(pg, "rl_inspect", policy, identity, 1) == (True, 2, 2, 0, 0)
    assert keys_of(shared_redis, identity) == set()
    hold()
    assert result(pg, "rl_inspect", policy, identity, 1) == (True, 2, 1, LEASE_MS - 1000, 0)
    assert result(pg, "rl_inspect", policy, identity, 2) == (False, 2, 1, LEASE_MS - 1000, LEASE_MS - 1000)
    assert result(pg, "rl_inspect", policy, identity, 3) == (False, 2, 1, LEASE_MS - 1000, -1)
    hold(BASE_CLOCK_MS + 500)
    assert shared_redis.command("ZCARD", key) == 2
    before = state(shared_redis, key)
    inspected = [result(pg, "rl_inspect", policy, identity, 1) for _ in range(INSPECTIONS)]
    assert state(shared_redis, key) == before
    # what a real acquire says (it is denied, so it holds nothing)
    called = pg.execute(
        "SELECT (r).allowed, (r).lim, (r).remaining, (r).reset_ms, (r).retry_after_ms"
        " FROM (SELECT rl_acquire(%s, %s) AS r) s", (policy, identity)).fetchone()
    assert inspected == [called] * INSPECTIONS
    assert called == (False, 2, 0, LEASE_MS - 500, LEASE_MS - 1000)
    # leases that ended are counted out, and left in place
    set_gucs(pg, test_clock_ms=BASE_CLOCK_MS + LEASE_MS + 1)
    assert result(pg, "rl_inspect", policy, identity, 1) == (True, 2, 1, 499, 0)
    assert shared_redis.command("ZCARD", key) == 2


def test_holders_lists_exact_holders(pg, holders):
    policy, identity, hold = holders
    query = "SELECT backend_pid, lease_ends, holder FROM rl_concurrency_holders(%s, %s) ORDER BY lease_ends"
    set_gucs(pg, test_clock_ms=BASE_CLOCK_MS)
    assert pg.execute(query, (policy, identity)).fetchall() == []
    first = hold(BASE_CLOCK_MS)
    second = hold(BASE_CLOCK_MS + 2000)
    rows = pg.execute(query, (policy, identity)).fetchall()
    assert [r[:2] for r in rows] == [(first, lease_end(BASE_CLOCK_MS)),
                                     (second, lease_end(BASE_CLOCK_MS + 2000))]
    assert [r[2].split(":")[0] for r in rows] == [str(first), str(second)]
    # the first lease has ended at this clock: only the second holds
    set_gucs(pg, test_clock_ms=BASE_CLOCK_MS + LEASE_MS + 1000)
    assert [r[0] for r in pg.execute(query, (policy, identity))] == [second]


def test_holders_without_a_pid_and_on_the_redis_clock(pg, policies, shared_redis):
    """A member that carries no pid has a NULL pid; without the test clock
    the leases are compared with Redis's clock."""
    policy = policies("concurrency", 2, LEASE_MS)
    identity = new_ident("inspect_cc")
    key = rl_key("concurrency", identity, policy, 2, LEASE_MS)
    now_ms = shared_redis.time_ms()
    shared_redis.command("ZADD", key, str((now_ms + LEASE_MS) * 1000), "someone")
    shared_redis.command("ZADD", key, str((now_ms - 1000) * 1000), "12:gone")
    shared_redis.command("PEXPIRE", key, str(LEASE_MS))
    assert pg.execute("SELECT holder, backend_pid, lease_ends FROM rl_concurrency_holders(%s, %s)",
                      (policy, identity)).fetchall() == [("someone", None, lease_end(now_ms))]


def test_holders_of_every_identity(pg, policies, shared_redis):
    """rl_concurrency_holders(policy) (identity NULL) lists the holders of
    every identity of the policy, each identity's once with its name
    (glob and key characters decoded), and nothing of another policy, of a
    rate policy, of a lease that ended or of a key the policy's pattern
    matches that rl_redis does not make."""
    policy, other = policies("concurrency", 2, LEASE_MS), policies("concurrency", 2, LEASE_MS)
    rate = policies("fixed")
    base = new_ident("holders")
    a, b, ended = base + ":a*?[%{}\\", base + ":b", base + ":ended"
    conns = []
    try:
        for identity, clock_ms, name in [(a, BASE_CLOCK_MS, policy), (a, BASE_CLOCK_MS + 1000, policy),
                                         (b, BASE_CLOCK_MS, policy), (b, BASE_CLOCK_MS, other),
                                         (ended, BASE_CLOCK_MS - LEASE_MS, policy)]:
            conn = pg_connect()
            conns.append(conn)
            set_gucs(conn, test_clock_ms=clock_ms)
            conn.execute("BEGIN")
            assert conn.execute("SELECT rl_acquire_allow(%s, %s)", (name, identity)).fetchone()[0]
        result(pg, "rl_check", rate, a, 1)
        # matched by the policy's pattern, but no key of an identity ('%' alone)
        stray = "rl:concurrency:{%s%%zz}:%s" % (base, policy)
        shared_redis.command("ZADD", stray, str((BASE_CLOCK_MS + LEASE_MS) * 1000), "1:x")
        shared_redis.command("PEXPIRE", stray, str(LEASE_MS))
        set_gucs(pg, test_clock_ms=BASE_CLOCK_MS + 500)
        rows = pg.execute("SELECT identity, backend_pid, lease_ends FROM rl_concurrency_holders(%s)",
                          (policy,)).fetchall()
        pids = [c.info.backend_pid for c in conns]
        assert sorted(rows) == sorted([(a, pids[0], lease_end(BASE_CLOCK_MS)),
                                       (a, pids[1], lease_end(BASE_CLOCK_MS + 1000)),
                                       (b, pids[2], lease_end(BASE_CLOCK_MS))]), rows
        # one identity after another, each as rl_concurrency_holders(policy, identity) gives it
        one_by_one = [(i,) + r for i in dict.fromkeys(r[0] for r in rows)
                      for r in pg.execute("SELECT holder, backend_pid, lease_ends FROM "
                                          "rl_concurrency_holders(%s, %s)", (policy, i)).fetchall()]
        assert pg.execute("SELECT * FROM rl_concurrency_holders(%s, NULL)", (policy,)).fetchall() == one_by_one
        assert [r[0] for r in pg.execute("SELECT identity FROM rl_concurrency_holders(%s)", (other,))] == [b]
    finally:
        for conn in conns:
            conn.close()


def test_stats_count_peeks_apart(pg, policies, holders):
    policy = policies("fixed")
    cc_policy, identity, hold = holders
    other = new_ident("inspect")
    set_gucs(pg, test_clock_ms=BASE_CLOCK_MS)
    for cost in (1, 1, 0, 0, 0):
        result(pg, "rl_check", policy, other, cost)
    for cost in (1, 0, 5, 1):
        result(pg, "rl_inspect", policy, other, cost)
    pg.execute("SELECT * FROM rl_check_many(%s, %s, 0)", (policy, [new_ident("a"), new_ident("b")])).fetchall()
    for _ in range(2):
        result(pg, "rl_inspect", cc_policy, identity, 1)
    rows = pg.execute("SELECT policy, calls, allowed, denied, units_taken, peeks FROM rl_redis_stats"
                      " WHERE dbname = current_database() AND policy = ANY(%s) ORDER BY calls",
                      ([policy, cc_policy],)).fetchall()
    assert rows == [(cc_policy, 0, 0, 0, 0, 2), (policy, 2, 2, 0, 2, 9)]
    metrics = pg.execute("SELECT rl_redis_metrics()").fetchone()[0]
    assert 'rl_redis_peeks_total{database="%s",policy="%s",algorithm="fixed"} 9' % (
        pg.info.dbname, policy) in metrics.splitlines()


@pytest.fixture
def ordinary(pg):
    name = "rl_inspect_%s" % uuid.uuid4().hex[:12]
    pg.execute(sql.SQL("CREATE ROLE {}").format(sql.Identifier(name)))
    conn = pg_connect()
    conn.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(name)))
    yield conn
    conn.close()
    pg.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


def test_privileges_and_arguments_as_rl_check(ordinary, policies):
    policy = policies("fixed")
    cc_policy = policies("concurrency", 2, LEASE_MS)
    identity = new_ident("inspect")
    assert result(ordinary, "rl_inspect", policy, identity, 1)[0] is True
    assert sqlstate_of(ordinary, "SELECT * FROM rl_concurrency_holders(%s, %s)",
                       (cc_policy, identity)) == "42501"
    for args, state_ in [((policy, "", 1), "22023"), ((policy, "x" * 1025, 1), "54000"),
                         ((policy, identity, None), "22004"), ((policy, identity, -1), "22023"),
                         ((None, identity, 1), "22004"), (("no_such_policy", identity, 1), "42704")]:
        assert sqlstate_of(ordinary, "SELECT rl_check(%s, %s, %s)", args) == state_, args
        assert sqlstate_of(ordinary, "SELECT rl_inspect(%s, %s, %s)", args) == state_, args


def test_holders_arguments(pg, policies):
    policy = policies("fixed")
    assert sqlstate_of(pg, "SELECT * FROM rl_concurrency_holders(%s, 'x')", (policy,)) == "22023"
    assert sqlstate_of(pg, "SELECT * FROM rl_concurrency_holders('no_such_policy', 'x')") == "42704"
    assert sqlstate_of(pg, "SELECT * FROM rl_concurrency_holders('no_such_policy')") == "42704"
    assert sqlstate_of(pg, "SELECT * FROM rl_concurrency_holders(NULL)") == "22004"


def test_stats_serve_the_1_5_declaration_until_the_update(pg, policies):
    """rl_redis_stats_rows serves the 1.5 declaration (18 columns) and,
    after ALTER EXTENSION UPDATE, 1.6's with peeks at the end."""
    db = "rl_inspect_%s" % uuid.uuid4().hex[:10]
    pg.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(db)))
    try:
        with pg_connect(dbname=db) as conn:
            conn.execute("CREATE EXTENSION rl_redis VERSION '1.5'")
            conn.execute("SELECT rl_fixed_allow(%s, 3, 60000, 0)", (new_ident("inspect"),))
            query = "SELECT * FROM rl_redis_stats WHERE dbname = current_database() AND algorithm = 'fixed'"
            cur = conn.execute(query)
            assert len(cur.description) == 19 and cur.fetchall()[0][3] == 0
            conn.execute("ALTER EXTENSION rl_redis UPDATE")
            cur = conn.execute(query)
            assert [c.name for c in cur.description][-2:] == ["peeks", "shadow_denied"]
            assert cur.fetchall()[0][-2] == 1
    finally:
        pg.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(db)))
