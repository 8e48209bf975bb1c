"""rl_redis.mode = 'cluster' against a real Redis Cluster (3 masters, 3
replicas, redis_topology.py): every algorithm, policies, concurrency slots,
guards and refunds with identities spread over all three masters; MOVED
(seed = one node), a stale slot map, transaction-end work (slot releases,
refunds) whose slot moved, a live slot migration under load, a call lost
after it was sent (never sent twice), a manual failover under load and a
master killed with SIGKILL. Also the settings' validation (rl_redis.mode,
rl_redis.nodes), and a cross-slot statement guard ended by
statement_timeout while one master is held by CLIENT PAUSE: it reads every
master's reply first, so its rollback gives back every unit.

The tests that move slots share the module's cluster (redis_cluster): they
leave every node running, and every test finds where its identities live
when it runs. The failover tests get a cluster of their own.

Sessions are superuser sessions pointed at the cluster with SET
rl_redis.mode = 'cluster', rl_redis.nodes = '<one node>' (retry_interval 0:
no circuit breaker). Single-session tests freeze time with
rl_redis.test_clock_ms; many-session tests use windows that never roll
over during a test. About 30 s in all.
"""

import os
import threading
import time

import psycopg
import pytest
from psycopg import sql

from conftest import fixed_units, Hammer, new_ident, pg_connect, rl_key, set_gucs
from redis_topology import (connections, made_policies, backend_identity, fresh_redis_cluster, identity_slot, idents_in_slot,  # noqa: F401
                            redis_cluster, wait_for)

TEST_CLOCK_MS = 1800000000000  # a frozen clock on a whole minute (2027-01-15)
HUGE_WINDOW_MS = 10**12  # a fixed window that does not roll over before 2033
LONG_WINDOW_MS = 600000
BIG_LIM = 1000000
ALGORITHMS = ["fixed", "sliding", "token_bucket", "gcra", "sliding_counter"]
RESULT = "SELECT (r).allowed, (r).lim, (r).remaining, (r).reset_ms, (r).retry_after_ms FROM %s AS r"


# ---------------------------------------------------------------- helpers


def point_at_cluster(conn, cluster, seeds=None, **gucs):
    """SET mode = cluster, nodes = the seeds (default: the first master)."""
    if seeds is None:
        seeds = [cluster.masters()[0]]
    gucs.setdefault("retry_interval", 0)
    set_gucs(conn, mode="cluster", nodes=cluster.nodes_arg(seeds))
    set_gucs(conn, **gucs)


@pytest.fixture
def sessions():
    """sessions(cluster, seeds=None, **gucs): a new superuser connection
    pointed at the cluster; all closed at teardown."""
    yield from connections(point_at_cluster)


@pytest.fixture
def policies(pg):
    """policies(algorithm, lim, window_ms, burst=None) -> a new policy's name;
    deleted at teardown."""
    yield from made_policies(pg, "t_cluster")


@pytest.fixture
def tables(pg):
    """tables(trigger_sql_format) -> a new table (tenant text, cost int)
    with the trigger made by trigger_sql_format.format(table=...); dropped
    at teardown."""
    names = []

    def make(trigger):
        name = "rl_cluster_%s" % new_ident().split(":")[-1][:16]
        pg.execute(sql.SQL("CREATE TABLE {} (tenant text NOT NULL, cost int NOT NULL DEFAULT 1)")
                   .format(sql.Identifier(name)))
        names.append(name)
        pg.execute(trigger.format(table=sql.Identifier(name).as_string(pg)))
        return name

    yield make
    for n in names:
        pg.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(n)))


def decide(conn, algorithm, identity, lim, window_ms, cost=1):
    return conn.execute(RESULT % ("rl_%s(%%s, %%s, %%s, %%s)" % algorithm),
                        (identity, lim, window_ms, cost)).fetchone()


def refund(conn, algorithm, identity, lim, window_ms, amount):
    return conn.execute(RESULT % ("rl_%s_refund(%%s, %%s, %%s, %%s)" % algorithm),
                        (identity, lim, window_ms, amount)).fetchone()


def check(conn, policy, identity, cost=1):
    return conn.execute(RESULT % "rl_check(%s, %s, %s)", (policy, identity, cost)).fetchone()


def remaining(conn, policy, identity):
    """remaining of a cost-0 rl_check (a peek: takes nothing)."""
    return conn.execute("SELECT (r).remaining FROM rl_check(%s, %s, 0) AS r", (policy, identity)).fetchone()[0]


def holders(cluster, key):
    """The live masters whose dataset has the key."""
    return cluster.holders(key)


def spread(cluster, tag, per_master):
    """per_master fresh identities on each master; asserts there are 3
    masters. Returns (flat list of identities, {identity: master})."""
    by_master = cluster.idents_on_each_master(new_ident(tag), per_master)
    assert len(by_master) == 3
    where = {i: m for m, ids in by_master.items() for i in ids}
    return [i for ids in by_master.values() for i in ids], where


def sqlstate_of(conn, query, params=None):
    with pytest.raises(psycopg.Error) as excinfo:
        conn.execute(query, params)
    return excinfo.value.sqlstate, str(excinfo.value)



# ---------------------------------------------------------------- settings


def test_mode_setting(pg):
    for mode in ("standalone", "cluster", "sentinel"):
        pg.execute(sql.SQL("SET rl_redis.mode = {}").format(sql.Literal(mode)))
        assert pg.execute("SHOW rl_redis.mode").fetchone()[0] == mode
    pg.execute("SET rl_redis.mode = 'standalone'")
    for bad in ("bogus", "", "clustered", "redis"):
        state, msg = sqlstate_of(pg, sql.SQL("SET rl_redis.mode = {}").format(sql.Literal(bad)))
        assert state == "22023", msg
    assert pg.execute("SHOW rl_redis.mode").fetchone()[0] == "standalone"
    # the default of a new session is standalone
    with pg_connect() as other:
        assert other.execute("SHOW rl_redis.mode").fetchone()[0] == "standalone"


def test_nodes_setting(pg):
    good = ["", "127.0.0.1:6379", "127.0.0.1:7000,127.0.0.1:7001,localhost:7002", "127.0.0.1:1",
            "127.0.0.1:65535"]
    for value in good:
        pg.execute(sql.SQL("SET rl_redis.nodes = {}").format(sql.Literal(value)))
        assert pg.execute("SHOW rl_redis.nodes").fetchone()[0] == value
    pg.execute("SET rl_redis.nodes = '127.0.0.1:7000'")
    bad = [
        "127.0.0.1",                       # no port
        "127.0.0.1:",                      # empty port
        "127.0.0.1:0",                     # port 0
        "127.0.0.1:65536",                 # port > 65535
        "127.0.0.1:99999999999",
        "127.0.0.1:-1",
        "127.0.0.1:70a",
        "127.0.0.1:7000,",                 # empty element at the end
        ",127.0.0.1:7000",                 # empty element at the start
        "127.0.0.1:7000,,127.0.0.1:7001",  # empty element in the middle
        "127.0.0.1:7000,localhost",        # second element without a port
        "127.0.0.1:7000,127.0.0.1:0",
    ]
    for value in bad:
        state, msg = sqlstate_of(pg, sql.SQL("SET rl_redis.nodes = {}").format(sql.Literal(value)))
        assert state == "22023", (value, msg)
    assert pg.execute("SHOW rl_redis.nodes").fetchone()[0] == "127.0.0.1:7000"


def test_topology_settings_are_superuser_only(pg):
    role = "rl_cluster_%s" % new_ident().split(":")[-1][:16]
    pg.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
    try:
        with pg_connect(user=role) as conn:
            for name, value in (("mode", "cluster"), ("nodes", "127.0.0.1:7000"),
                                ("sentinel_master", "mymaster"), ("sentinel_password", "x")):
                state, msg = sqlstate_of(conn, sql.SQL("SET {} = {}").format(
                    sql.Identifier("rl_redis", name), sql.Literal(value)))
                assert state == "42501", (name, msg)
    finally:
        pg.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,))
        for _ in range(50):
            try:
                pg.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))
                break
            except psycopg.Error:
                time.sleep(0.1)


# ------------------------------------------------------ decisions on 3 masters


def test_the_cluster_has_three_masters(redis_cluster):
    masters = redis_cluster.masters()
    assert len(masters) == 3 and len(redis_cluster.replicas()) == 3
    owners = {port for _, _, port in redis_cluster.slot_map()}
    assert owners == {m.port for m in masters}


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_algorithm_matches_standalone(pg, sessions, redis_cluster, algorithm):
    """The same sequence of decisions and refunds, on a frozen clock, gives
    the same results in cluster mode (identities on each of the 3 masters)
    as in standalone mode (the shared Redis); each key lives on the master
    of its identity's slot and nowhere else."""
    lim, window = 5, 60000

    def run(conn, identity):
        out = []
        for _ in range(3):
            out.append(decide(conn, algorithm, identity, lim, window))
        out.append(decide(conn, algorithm, identity, lim, window, 2))   # the last two units
        out.append(decide(conn, algorithm, identity, lim, window))      # denied
        out.append(decide(conn, algorithm, identity, lim, window, 9))   # never fits: -1
        out.append(refund(conn, algorithm, identity, lim, window, 2))
        out.append(decide(conn, algorithm, identity, lim, window, 0))   # a peek
        out.append(decide(conn, algorithm, identity, lim, window))
        set_gucs(conn, test_clock_ms=TEST_CLOCK_MS + window // 2)
        out.append(decide(conn, algorithm, identity, lim, window, 0))
        out.append(decide(conn, algorithm, identity, lim, window))
        set_gucs(conn, test_clock_ms=TEST_CLOCK_MS + window + 1)
        out.append(decide(conn, algorithm, identity, lim, window))
        out.append(decide(conn, algorithm, identity, lim, window, 0))
        set_gucs(conn, test_clock_ms=TEST_CLOCK_MS)
        return out

    set_gucs(pg, test_clock_ms=TEST_CLOCK_MS, retry_interval=0)
    expected = run(pg, new_ident("standalone"))
    # the sequence does what it says: 3 + 2 allowed, then denied
    assert [r[0] for r in expected[:6]] == [True, True, True, True, False, False]
    assert expected[3][2] == 0 and expected[5][4] == -1

    conn = sessions(redis_cluster, test_clock_ms=TEST_CLOCK_MS)
    idents, where = spread(redis_cluster, "alg", 1)
    for identity in idents:
        assert run(conn, identity) == expected, identity
        key = rl_key(algorithm, identity, lim=lim, window_ms=window)
        assert holders(redis_cluster, key) == [where[identity]], key
    assert len(set(where.values())) == 3


def test_policies_check_and_check_all(sessions, policies, redis_cluster):
    conn = sessions(redis_cluster, test_clock_ms=TEST_CLOCK_MS)
    p_fixed = policies("fixed", 3, 60000)
    p_sliding = policies("sliding", 5, 60000)
    p_bucket = policies("token_bucket", 4, 60000, 4)
    idents, where = spread(redis_cluster, "pol", 2)
    for identity in idents:
        assert check(conn, p_bucket, identity, 3)[:3] == (True, 4, 1)
        assert check(conn, p_bucket, identity, 2)[:3] == (False, 4, 1)
        got = [conn.execute(RESULT % "rl_check_all(%s, %s)", ([p_fixed, p_sliding], identity)).fetchone()
               for _ in range(4)]
        # all or nothing: the fixed policy (3) is the most restrictive
        assert [g[:3] for g in got] == [(True, 3, 2), (True, 3, 1), (True, 3, 0), (False, 3, 0)]
        assert remaining(conn, p_sliding, identity) == 2  # the denied call took nothing
        assert conn.execute("SELECT rl_allow(%s, %s, 2)", (p_sliding, identity)).fetchone()[0] is True
        assert conn.execute("SELECT rl_allow(%s, %s)", (p_sliding, identity)).fetchone()[0] is False
        assert conn.execute("SELECT rl_allow_all(%s, %s, 0)", ([p_fixed, p_sliding, p_bucket], identity)
                            ).fetchone()[0] is True
        for alg, pol, numbers in (("fixed", p_fixed, (3, 60000)), ("sliding", p_sliding, (5, 60000)),
                                  ("token_bucket", p_bucket, (4, 60000, 4))):
            assert holders(redis_cluster, rl_key(alg, identity, pol, *numbers)) == [where[identity]]
        m = where[identity]
        assert fixed_units(m.command("GET", rl_key("fixed", identity, p_fixed, 3, 60000))) == "3"
        assert m.command("ZCARD", rl_key("sliding", identity, p_sliding, 5, 60000)) == 5


def test_concurrency_slots_across_masters(sessions, redis_cluster):
    a = sessions(redis_cluster)
    b = sessions(redis_cluster, seeds=[redis_cluster.masters()[2]])
    idents, where = spread(redis_cluster, "conc", 1)
    acquire = "SELECT rl_concurrency_acquire_allow(%s, 2, %s)"
    key = {i: rl_key("concurrency", i, lim=2, window_ms=LONG_WINDOW_MS) for i in idents}

    a.execute("BEGIN")
    for i in idents:
        assert [a.execute(acquire, (i, LONG_WINDOW_MS)).fetchone()[0] for _ in range(3)] == [True, True, False]
        assert where[i].command("ZCARD", key[i]) == 2
        assert holders(redis_cluster, key[i]) == [where[i]]
    b.execute("BEGIN")
    assert [b.execute(acquire, (i, LONG_WINDOW_MS)).fetchone()[0] for i in idents] == [False] * 3
    b.execute("ROLLBACK")
    a.execute("COMMIT")  # gives back the 6 slots, each on its own master
    for i in idents:
        assert redis_cluster.command_for_key(key[i], "ZCARD", key[i]) == 0
    b.execute("BEGIN")
    assert [b.execute(acquire, (i, LONG_WINDOW_MS)).fetchone()[0] for i in idents for _ in range(2)] == [True] * 6
    assert b.execute("SELECT rl_concurrency_release(%s)", (idents[1],)).fetchone()[0] is True
    assert where[idents[1]].command("ZCARD", key[idents[1]]) == 1
    b.execute("ROLLBACK")
    for i in idents:
        assert redis_cluster.command_for_key(key[i], "ZCARD", key[i]) == 0


def test_row_guard_across_masters(sessions, policies, tables, redis_cluster):
    conn = sessions(redis_cluster, test_clock_ms=TEST_CLOCK_MS)
    policy = policies("fixed", 3, 60000)
    table = tables("CREATE TRIGGER g AFTER INSERT ON {table} FOR EACH ROW "
                   "EXECUTE FUNCTION rl_guard('%s', 'tenant')" % policy)
    tenants, where = spread(redis_cluster, "rowg", 4)
    insert = "INSERT INTO %s (tenant) SELECT t FROM unnest(%%s::text[]) t, generate_series(1, %%s)" % table
    conn.execute(insert, (tenants, 3))
    for t in tenants:
        state, msg = sqlstate_of(conn, "INSERT INTO %s (tenant) VALUES (%%s)" % table, (t,))
        assert state == "PT429" and t in msg, msg
        assert remaining(conn, policy, t) == 0
        key = rl_key("fixed", t, policy=policy, lim=3, window_ms=60000)
        assert holders(redis_cluster, key) == [where[t]]
        assert fixed_units(where[t].command("GET", key)) == "3"
    assert conn.execute("SELECT count(*) FROM %s" % table).fetchone()[0] == 3 * len(tenants)


def test_statement_guard_across_masters(sessions, policies, tables, redis_cluster):
    """One statement with rows of 30 tenants on 3 masters charges each tenant
    exactly its rows, on its own master."""
    conn = sessions(redis_cluster, test_clock_ms=TEST_CLOCK_MS)
    policy = policies("fixed", 10, 60000)
    table = tables("CREATE TRIGGER g AFTER INSERT ON {table} REFERENCING NEW TABLE AS n "
                   "FOR EACH STATEMENT EXECUTE FUNCTION rl_guard_statement('%s', 'tenant', 'cost')" % policy)
    tenants, where = spread(redis_cluster, "stmt", 10)
    rows = [(t, 1 + k % 5) for k, t in enumerate(tenants) for _ in range(2)]  # 2 rows each
    conn.execute("INSERT INTO %s (tenant, cost) SELECT * FROM unnest(%%s::text[], %%s::int[])" % table,
                 ([r[0] for r in rows], [r[1] for r in rows]))
    for k, t in enumerate(tenants):
        charged = 2 * (1 + k % 5)
        assert remaining(conn, policy, t) == 10 - charged, t
        key = rl_key("fixed", t, policy=policy, lim=10, window_ms=60000)
        assert holders(redis_cluster, key) == [where[t]]
        assert fixed_units(where[t].command("GET", key)) == str(charged)


@pytest.mark.parametrize("refund_on_abort", ["guards", "off"])
def test_statement_guard_denial_in_one_slot_gives_back_the_others(
        sessions, policies, tables, redis_cluster, refund_on_abort):
    """A statement whose rows hold 12 tenants on 3 masters plus one tenant
    with nothing left: PT429, and every unit taken for the 12 is given back
    (also with refund_on_abort = off). Run 3 times, the exhausted tenant on
    each master in turn, on the lowest and highest slot of the statement."""
    conn = sessions(redis_cluster, test_clock_ms=TEST_CLOCK_MS, refund_on_abort=refund_on_abort)
    lim = 5
    policy = policies("fixed", lim, 60000)
    table = tables("CREATE TRIGGER g AFTER INSERT ON {table} REFERENCING NEW TABLE AS n "
                   "FOR EACH STATEMENT EXECUTE FUNCTION rl_guard_statement('%s', 'tenant')" % policy)
    insert = "INSERT INTO %s (tenant) SELECT unnest(%%s::text[])" % table
    reached_other_masters = 0
    for run, victim_master in enumerate(redis_cluster.masters()):
        tenants, where = spread(redis_cluster, "deny%d" % run, 4)
        victims = [v for v in idents_on(redis_cluster, victim_master, "victim%d" % run, 40)]
        # the victim's slot is the lowest of the statement in one run and
        # the highest in another, whatever order the slots are decided in
        victims.sort(key=identity_slot)
        victim = victims[0] if run % 2 == 0 else victims[-1]
        assert conn.execute("SELECT rl_allow(%s, %s, %s)", (policy, victim, lim)).fetchone()[0] is True
        before = {m: m.script_calls() for m in redis_cluster.masters()}
        state, msg = sqlstate_of(conn, insert, (tenants + [victim] + tenants[:2],))
        after = {m: m.script_calls() for m in redis_cluster.masters()}
        assert state == "PT429", msg
        assert '"%s"' % victim in msg, msg
        reached_other_masters += sum(1 for m in after if m is not victim_master and after[m] > before[m])
        for t in tenants:
            assert remaining(conn, policy, t) == lim, (t, where[t], victim_master)
        assert remaining(conn, policy, victim) == 0
    assert conn.execute("SELECT count(*) FROM %s" % table).fetchone()[0] == 0
    # the statements did charge other masters before the denial (else this
    # test proved nothing): some master other than the victim's saw scripts
    assert reached_other_masters > 0


def test_statement_guard_timeout_waits_for_every_slot(sessions, policies, tables, redis_cluster):
    """statement_timeout 200 ms, command_timeout 2000 ms: an INSERT of 12
    tenants on the 3 masters through rl_guard_statement while one master is
    held by CLIENT PAUSE 1000. The guard reads every master's reply before
    serving the timeout (a cancel while calls are out used to leave the
    unread slots charged, unknowably): the statement fails with 57014 once
    the paused master has answered (after about 1 s, within 5 s), and its
    rollback gives every unit back: every tenant's key on every master has
    its full quota, and every master ran the statement's calls. Once with
    each master paused."""
    lim = 5
    policy = policies("fixed", lim, 60000)
    table = tables("CREATE TRIGGER g AFTER INSERT ON {table} REFERENCING NEW TABLE AS n "
                   "FOR EACH STATEMENT EXECUTE FUNCTION rl_guard_statement('%s', 'tenant')" % policy)
    conn = sessions(redis_cluster, test_clock_ms=TEST_CLOCK_MS, command_timeout=2000)
    insert = "INSERT INTO %s (tenant) SELECT unnest(%%s::text[])" % table
    masters = redis_cluster.masters()
    for run, paused in enumerate(masters):
        tenants, where = spread(redis_cluster, "stmto%d" % run, 4)
        # connections, slot map and scripts in place on every master
        assert [remaining(conn, policy, t) for t in tenants] == [lim] * len(tenants)
        before = {m.port: m.script_calls() for m in masters}
        conn.execute("SET statement_timeout = 200")
        try:
            paused.command("CLIENT", "PAUSE", "1000")
            t0 = time.monotonic()
            state, msg = sqlstate_of(conn, insert, (tenants,))
            elapsed = time.monotonic() - t0
        finally:
            conn.execute("RESET statement_timeout")
        # every master, the paused one too, had run the statement's call
        after = {m.port: m.script_calls() for m in masters}
        assert state == "57014", msg
        assert 0.7 <= elapsed < 5.0, (run, elapsed)
        assert all(after[p] > before[p] for p in before), (run, before, after)
        time.sleep(max(0.0, t0 + 1.2 - time.monotonic()))  # the pause is over
        left = {t: remaining(conn, policy, t) for t in tenants}
        assert left == dict.fromkeys(tenants, lim), (run, paused, left)
        for t in tenants:
            key = rl_key("fixed", t, policy=policy, lim=lim, window_ms=60000)
            assert fixed_units(where[t].command("GET", key)) in (None, "0"), (run, t, where[t])
    assert conn.execute("SELECT count(*) FROM %s" % table).fetchone()[0] == 0


def test_terminate_during_statement_guard_is_served_at_once(pg, sessions, policies, tables, redis_cluster):
    """command_timeout 10000 ms: an INSERT of 12 tenants on the 3 masters
    through rl_guard_statement while every master is held by CLIENT PAUSE
    8000 WRITE (scripts wait, CLIENT UNPAUSE does not); 0.5 s after the
    guard began to wait, pg_terminate_backend. The guard holds back only a
    cancel until every master's reply is read (see above): a terminate is
    served at once, and the backend is gone within 3 s (it used to hold
    every interrupt and wait until the masters answered, about 7.6 s here,
    or command_timeout per node). The masters are unpaused afterwards and
    answer again."""
    policy = policies("fixed", 5, 60000)
    table = tables("CREATE TRIGGER g AFTER INSERT ON {table} REFERENCING NEW TABLE AS n "
                   "FOR EACH STATEMENT EXECUTE FUNCTION rl_guard_statement('%s', 'tenant')" % policy)
    conn = sessions(redis_cluster, test_clock_ms=TEST_CLOCK_MS, command_timeout=10000)
    tenants, where = spread(redis_cluster, "term", 4)
    assert len(set(where.values())) == 3
    # connections, slot map and scripts in place on every master
    assert [remaining(conn, policy, t) for t in tenants] == [5] * len(tenants)
    pid = conn.info.backend_pid
    insert = "INSERT INTO %s (tenant) SELECT unnest(%%s::text[])" % table
    outcome = {}

    def run():
        try:
            conn.execute(insert, (tenants,))
            outcome["error"] = None
        except BaseException as e:  # looked at by the main thread
            outcome["error"] = e

    masters = redis_cluster.masters()
    call = threading.Thread(target=run, daemon=True)
    try:
        for m in masters:
            m.command("CLIENT", "PAUSE", "8000", "WRITE")  # scripts wait; UNPAUSE does not
        t_pause = time.monotonic()
        call.start()
        # the guard waits for the paused masters
        wait_for(lambda: pg.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s",
                                    (pid,)).fetchone() == ("Extension",), 5.0,
                 "the guard to wait for Redis")
        time.sleep(0.5)
        assert time.monotonic() - t_pause < 3.0, "the statement did not reach the guard in time"
        t0 = time.monotonic()
        assert pg.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone()[0] is True
        while os.path.exists("/proc/%d" % pid) and time.monotonic() - t0 < 15.0:
            time.sleep(0.02)
        gone_s = time.monotonic() - t0
        call.join(15)
    finally:
        for m in masters:
            m.command("CLIENT", "UNPAUSE")
    assert not call.is_alive()
    assert gone_s < 3.0, "the backend took %.2f s to exit after pg_terminate_backend" % gone_s
    assert isinstance(outcome["error"], psycopg.OperationalError), outcome
    assert pg.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()[0] == 0
    # the masters answer again
    other = sessions(redis_cluster, test_clock_ms=TEST_CLOCK_MS)
    fresh, _ = spread(redis_cluster, "termafter", 1)
    assert [check(other, policy, t)[:3] for t in fresh] == [(True, 5, 4)] * 3
    assert pg.execute("SELECT count(*) FROM %s" % table).fetchone()[0] == 0


def idents_on(cluster, master, tag, n):
    """n fresh identities whose slot is on master."""
    base = new_ident(tag)
    out, i = [], 0
    while len(out) < n:
        ident = "%s:%d" % (base, i)
        i += 1
        if cluster.master_of_identity(ident) is master:
            out.append(ident)
    return out


def test_rollback_gives_back_exactly_across_slots(sessions, policies, tables, redis_cluster):
    conn = sessions(redis_cluster, test_clock_ms=TEST_CLOCK_MS, refund_on_abort="all")
    policy = policies("sliding", 6, 60000)
    table = tables("CREATE TRIGGER g AFTER INSERT ON {table} FOR EACH ROW "
                   "EXECUTE FUNCTION rl_guard('%s', 'tenant')" % policy)
    idents, where = spread(redis_cluster, "rb", 3)
    lim, window = 6, 60000

    def state():
        out = []
        for i in idents:
            out.append(remaining(conn, policy, i))
            for alg in ALGORITHMS:
                out.append(decide(conn, alg, i, lim, window, 0)[2])
        return out

    full = [lim] * (len(idents) * (1 + len(ALGORITHMS)))
    # one unit of each kept (committed) first
    conn.execute("BEGIN")
    for i in idents:
        conn.execute("INSERT INTO %s (tenant) VALUES (%%s)" % table, (i,))
        for alg in ALGORITHMS:
            assert decide(conn, alg, i, lim, window)[0] is True
    conn.execute("COMMIT")
    kept = [lim - 1] * len(full)
    assert state() == kept

    conn.execute("BEGIN")
    for i in idents:
        conn.execute("INSERT INTO %s (tenant) SELECT %%s FROM generate_series(1, 3)" % table, (i,))
        for alg in ALGORITHMS:
            assert decide(conn, alg, i, lim, window, 3)[0] is True
    assert state() == [lim - 4] * len(full)
    conn.execute("ROLLBACK")
    assert state() == kept

    # a savepoint rolled back gives back its part only
    conn.execute("BEGIN")
    for i in idents:
        assert decide(conn, "fixed", i, lim, window, 2)[0] is True
    conn.execute("SAVEPOINT s")
    for i in idents:
        conn.execute("INSERT INTO %s (tenant) SELECT %%s FROM generate_series(1, 2)" % table, (i,))
        for alg in ALGORITHMS:
            assert decide(conn, alg, i, lim, window, 2)[0] is True
    conn.execute("ROLLBACK TO SAVEPOINT s")
    conn.execute("COMMIT")
    after = []
    for i in idents:
        after.append(remaining(conn, policy, i))
        for alg in ALGORITHMS:
            after.append(decide(conn, alg, i, lim, window, 0)[2])
    expected = []
    for i in idents:
        expected.append(lim - 1)
        for alg in ALGORITHMS:
            expected.append(lim - 3 if alg == "fixed" else lim - 1)
    assert after == expected
    assert len(set(where.values())) == 3


def test_many_sessions_one_identity(sessions, redis_cluster):
    """8 sessions, 30 calls each, on one identity whose slot is not on the
    seed: exactly lim allowed, for two algorithms."""
    seed = redis_cluster.masters()[0]
    other = next(m for m in redis_cluster.masters() if m is not seed)
    identity = idents_on(redis_cluster, other, "many", 1)[0]
    conns = [sessions(redis_cluster, seeds=[seed]) for _ in range(8)]
    lim = 50
    queries = ["SELECT rl_fixed_allow(%s, %s, %s)", "SELECT rl_sliding_allow(%s, %s, %s)"]
    windows = [HUGE_WINDOW_MS, LONG_WINDOW_MS]

    def job(conn, s, i):
        k = i % 2
        return k, conn.execute(queries[k], (identity, lim, windows[k])).fetchone()[0]

    h = Hammer(conns, job).start()
    wait_for(lambda: all(len(r) >= 30 for r in h.records), 60, "30 calls per session", 0.02)
    h.stop()
    assert h.errors() == []
    allowed = [sum(1 for r in h.calls() if r[4][0] == k and r[4][1]) for k in range(2)]
    assert sum(1 for r in h.calls() if r[4][0] == 0) > 2 * lim  # contention
    assert allowed == [lim, lim], allowed
    assert fixed_units(other.command("GET", rl_key("fixed", identity, lim=lim, window_ms=HUGE_WINDOW_MS))) == str(lim)
    assert other.command("ZCARD", rl_key("sliding", identity, lim=lim, window_ms=LONG_WINDOW_MS)) == lim


def test_concurrency_holders_of_every_identity_on_every_master(sessions, policies, redis_cluster):
    """rl_concurrency_holders(policy) finds the slots of identities on each
    of the three masters (a SCAN of each), every identity once."""
    policy = policies("concurrency", 2, 60000)
    idents, where = spread(redis_cluster, "holders", 2)
    held = {}
    for i in idents:
        conn = sessions(redis_cluster, test_clock_ms=TEST_CLOCK_MS)
        conn.execute("BEGIN")
        assert conn.execute("SELECT rl_acquire_allow(%s, %s)", (policy, i)).fetchone()[0] is True
        held[i] = conn.info.backend_pid
    conn = sessions(redis_cluster, test_clock_ms=TEST_CLOCK_MS)
    rows = conn.execute("SELECT identity, backend_pid FROM rl_concurrency_holders(%s)", (policy,)).fetchall()
    assert sorted(rows) == sorted(held.items()), rows
    assert len(set(where.values())) == 3


def test_rl_reset_deletes_on_the_identity_node(sessions, policies, redis_cluster):
    conn = sessions(redis_cluster, test_clock_ms=TEST_CLOCK_MS)
    policy = policies("token_bucket", 5, 60000)
    idents, where = spread(redis_cluster, "reset", 1)
    keep = {m: idents_on(redis_cluster, m, "keep", 1)[0] for m in redis_cluster.masters()}
    for i in idents + list(keep.values()):
        for alg in ALGORITHMS:
            assert decide(conn, alg, i, 5, 60000, 3)[0] is True
        assert check(conn, policy, i, 4)[0] is True
    for i in idents:
        keys = [rl_key(alg, i, lim=5, window_ms=60000) for alg in ALGORITHMS] + \
               [rl_key("token_bucket", i, policy=policy, lim=5, window_ms=60000)]
        assert all(holders(redis_cluster, k) == [where[i]] for k in keys)
        conn.execute("SELECT rl_reset(%s)", (i,))
        assert [k for k in keys if holders(redis_cluster, k)] == []
        for alg in ALGORITHMS:
            assert decide(conn, alg, i, 5, 60000, 0)[2] == 5
        assert remaining(conn, policy, i) == 5
    # the other identities (one on each master) keep their counts
    for m, i in keep.items():
        for alg in ALGORITHMS:
            assert decide(conn, alg, i, 5, 60000, 0)[2] == 2
        assert remaining(conn, policy, i) == 1
        assert m.command("EXISTS", rl_key("fixed", i, lim=5, window_ms=60000)) == 1


@pytest.mark.parametrize("seed", ["one_master", "one_replica", "host_port"])
def test_one_seed_reaches_every_master(sessions, redis_cluster, seed):
    """A seed naming one node (a master, a replica, or rl_redis.host/port
    with rl_redis.nodes empty) is enough: keys on the other masters are
    reached (MOVED followed / map learnt)."""
    if seed == "one_master":
        conn = sessions(redis_cluster, seeds=[redis_cluster.masters()[1]])
    elif seed == "one_replica":
        conn = sessions(redis_cluster, seeds=[redis_cluster.replicas()[0]])
    else:
        conn = sessions(redis_cluster)
        node = redis_cluster.masters()[2]
        set_gucs(conn, nodes="", host="127.0.0.1", port=node.port)
    idents, where = spread(redis_cluster, "seed", 2)
    for i in idents:
        got = [conn.execute("SELECT rl_fixed_allow(%s, 3, %s)", (i, HUGE_WINDOW_MS)).fetchone()[0]
               for _ in range(4)]
        assert got == [True, True, True, False], i
        key = rl_key("fixed", i, lim=3, window_ms=HUGE_WINDOW_MS)
        assert holders(redis_cluster, key) == [where[i]]
        assert fixed_units(where[i].command("GET", key)) == "3"


def test_ping_lists_every_master(sessions, redis_cluster):
    conn = sessions(redis_cluster, seeds=[redis_cluster.replicas()[1]])
    server, rtt = conn.execute("SELECT server, rtt_ms FROM rl_redis_ping()").fetchone()
    listed = sorted(s.strip() for s in server.split(","))
    assert listed == sorted(m.addr for m in redis_cluster.masters()), server
    assert rtt >= 0


def test_stale_map_after_a_migration(sessions, redis_cluster):
    """The session learnt the map; a slot moves behind its back (all its
    keys migrated): the next calls are still right, counts kept."""
    conn = sessions(redis_cluster)
    identity = new_ident("stale")
    src = redis_cluster.master_of_identity(identity)
    dst = next(m for m in redis_cluster.masters() if m is not src)
    fixed = "SELECT (r).allowed, (r).remaining FROM rl_fixed(%s, 5, %s) AS r"
    sliding = "SELECT (r).allowed, (r).remaining FROM rl_sliding(%s, 10, %s) AS r"
    assert [conn.execute(fixed, (identity, HUGE_WINDOW_MS)).fetchone() for _ in range(2)] == [(True, 4), (True, 3)]
    assert conn.execute(sliding, (identity, LONG_WINDOW_MS)).fetchone() == (True, 9)
    moved = redis_cluster.migrate_slot(identity_slot(identity), dst, batch=10)
    assert moved >= 2
    fkey = rl_key("fixed", identity, lim=5, window_ms=HUGE_WINDOW_MS)
    skey = rl_key("sliding", identity, lim=10, window_ms=LONG_WINDOW_MS)
    assert holders(redis_cluster, fkey) == [dst]
    got = [conn.execute(fixed, (identity, HUGE_WINDOW_MS)).fetchone() for _ in range(4)]
    assert got == [(True, 2), (True, 1), (True, 0), (False, 0)]
    assert conn.execute(sliding, (identity, LONG_WINDOW_MS)).fetchone() == (True, 8)
    assert fixed_units(dst.command("GET", fkey)) == "5"
    assert holders(redis_cluster, fkey) == [dst]
    # and back again, with a call in every half-moved state of the slot
    during = []
    redis_cluster.migrate_slot(identity_slot(identity), src, batch=1, on_each_key_step=lambda keys: during.append(
        conn.execute(sliding, (identity, LONG_WINDOW_MS)).fetchone()))
    assert len(during) >= 2
    assert during == [(True, 7 - k) for k in range(len(during))]
    assert conn.execute(sliding, (identity, LONG_WINDOW_MS)).fetchone() == (True, 7 - len(during))
    assert src.command("ZCARD", skey) == 3 + len(during)
    assert holders(redis_cluster, skey) == [src] and holders(redis_cluster, fkey) == [src]
    assert conn.execute(fixed, (identity, HUGE_WINDOW_MS)).fetchone() == (False, 0)


@pytest.mark.parametrize("end", ["COMMIT", "ROLLBACK"])
@pytest.mark.parametrize("target", ["connected", "unconnected"])
def test_transaction_end_work_follows_a_moved_slot(sessions, redis_cluster, end, target):
    """Two slots taken and 3 units charged (refund_on_abort = all) in a
    transaction, then the identity's slot moves behind the session's back:
    the COMMIT's slot releases, or the ROLLBACK's refund, sent to the old
    node, get MOVED and must reach the new node. When the session has a
    connection to the new node, by the time the transaction end returns;
    when it has none (a transaction end never connects), at the latest with
    the session's next call (here one whose key is on a third node)."""
    seed, src, third = redis_cluster.masters()
    dst = seed if target == "connected" else third
    elsewhere = idents_on(redis_cluster, seed, "elsewhere", 1)[0]
    conn = sessions(redis_cluster, seeds=[seed], refund_on_abort="all", test_clock_ms=TEST_CLOCK_MS)
    assert decide(conn, "fixed", elsewhere, 5, 60000)[0] is True  # a connection to the seed
    identity = idents_on(redis_cluster, src, "xend", 1)[0]
    ckey = rl_key("concurrency", identity, lim=2, window_ms=LONG_WINDOW_MS)
    fkey = rl_key("fixed", identity, lim=5, window_ms=60000)
    assert decide(conn, "fixed", identity, 5, 60000)[:3] == (True, 5, 4)  # kept

    conn.execute("BEGIN")
    assert [conn.execute("SELECT rl_concurrency_acquire_allow(%s, 2, %s)", (identity, LONG_WINDOW_MS)
                         ).fetchone()[0] for _ in range(2)] == [True, True]
    assert decide(conn, "fixed", identity, 5, 60000, 3)[:3] == (True, 5, 1)
    redis_cluster.migrate_slot(identity_slot(identity), dst, batch=10)
    assert (dst.command("ZCARD", ckey), fixed_units(dst.command("GET", fkey))) == (2, "4")
    conn.execute(end)
    expected = (0, "4") if end == "COMMIT" else (0, "1")
    if target == "unconnected":
        assert decide(conn, "fixed", elsewhere, 5, 60000)[0] is True  # the session's next call
    got = (dst.command("ZCARD", ckey), fixed_units(dst.command("GET", fkey)))
    assert got == expected, "on the new node: %r slots held and n = %r" % got
    assert holders(redis_cluster, fkey) == [dst]
    # and the session sees it so
    assert decide(conn, "fixed", identity, 5, 60000, 0)[:3] == (True, 5, 5 - int(expected[1]))


def test_live_migration_under_load(sessions, policies, redis_cluster):
    """4 sessions hammer 6 identities of one slot (fixed, sliding and a
    two-policy rl_allow_all: two keys in one script) while the slot is
    migrated key by key (IMPORTING/MIGRATING, MIGRATE, SETSLOT NODE): no
    call fails, and every counter equals the calls allowed."""
    p1, p2 = policies("fixed", BIG_LIM, HUGE_WINDOW_MS), policies("fixed", BIG_LIM, HUGE_WINDOW_MS)
    slot = identity_slot(new_ident("slot"))
    idents = idents_in_slot(slot, 6, new_ident("live"))
    src = redis_cluster.master_of_slot(slot)
    dst = next(m for m in redis_cluster.masters() if m is not src)
    conns = [sessions(redis_cluster, seeds=[dst], command_timeout=5000) for _ in range(4)]
    kinds = ["fixed", "sliding", "all"]

    def job(conn, s, i):
        identity = idents[(s + i) % len(idents)]
        kind = kinds[i % 3]
        if kind == "fixed":
            q, p = "SELECT rl_fixed_allow(%s, %s, %s)", (identity, BIG_LIM, HUGE_WINDOW_MS)
        elif kind == "sliding":
            q, p = "SELECT rl_sliding_allow(%s, 10000, %s)", (identity, LONG_WINDOW_MS)
        else:
            q, p = "SELECT rl_allow_all(%s, %s)", ([p1, p2], identity)
        return identity, kind, conn.execute(q, p).fetchone()[0]

    h = Hammer(conns, job).start()
    # every key exists before the migration starts
    wait_for(lambda: all(len(r) >= 20 for r in h.records), 60, "a warm-up", 0.02)
    steps = []
    asking, tryagain = dst.command_calls("asking"), src.error_count("TRYAGAIN") + dst.error_count("TRYAGAIN")
    ask = src.error_count("ASK")
    t0 = time.monotonic()
    moved = redis_cluster.migrate_slot(slot, dst, batch=1,
                                       on_each_key_step=lambda keys: (steps.append(time.monotonic()),
                                                                      time.sleep(0.12)))
    t1 = time.monotonic()
    time.sleep(0.5)
    h.stop()
    assert moved >= len(idents) * 4, moved  # fixed, sliding, p1, p2 of each
    assert h.errors() == [], h.errors()[:5]
    asked = src.error_count("ASK") - ask
    tried_again = src.error_count("TRYAGAIN") + dst.error_count("TRYAGAIN") - tryagain
    print("\n[live migration: %d ASK replies, %d ASKING, %d TRYAGAIN replies]"
          % (asked, dst.command_calls("asking") - asking, tried_again), end="")
    # the half-moved states were met, and ASK was followed with ASKING
    assert asked > 0 and dst.command_calls("asking") - asking >= asked
    during = [r for r in h.calls() if r[2] > t0 and r[3] < t1]
    assert len(during) >= 20, "too few calls ran while the slot was half moved"
    assert redis_cluster.master_of_slot(slot) is dst
    for identity in idents:
        mine = [r[4] for r in h.calls() if r[4][0] == identity]
        n = {k: sum(1 for _, kind, ok in mine if kind == k and ok) for k in kinds}
        assert all(ok for _, _, ok in mine)
        assert fixed_units(dst.command("GET", rl_key("fixed", identity, lim=BIG_LIM, window_ms=HUGE_WINDOW_MS))) \
            == str(n["fixed"]), identity
        assert dst.command("ZCARD", rl_key("sliding", identity, lim=10000, window_ms=LONG_WINDOW_MS)) \
            == n["sliding"], identity
        for p in (p1, p2):
            assert fixed_units(dst.command("GET", rl_key("fixed", identity, p, BIG_LIM, HUGE_WINDOW_MS))) \
                == str(n["all"]), identity
    assert src.command("CLUSTER", "COUNTKEYSINSLOT", slot) == 0


def script_clients(node):
    """ids of the clients of node whose current or last command is a script
    call (CLIENT LIST)."""
    ids = []
    for line in node.command("CLIENT", "LIST").splitlines():
        f = dict(p.split("=", 1) for p in line.split() if "=" in p)
        if f.get("cmd") in ("evalsha", "eval", "fcall"):
            ids.append(f["id"])
    return ids


def test_call_lost_after_sending_is_not_sent_again(pg, sessions, redis_cluster):
    """A call written to its master, whose connection is then lost before
    the reply (CLIENT KILL while writes are paused, so Redis never ran
    it): it fails with class 08 (on_error = error) at once, and is not sent
    again, even though the master is there (a second try would wait out the
    pause and succeed)."""
    conn = sessions(redis_cluster, command_timeout=8000)
    master = redis_cluster.masters()[1]
    identity = idents_on(redis_cluster, master, "lost", 1)[0]
    q = "SELECT rl_fixed_allow(%s, 5, %s)"
    key = rl_key("fixed", identity, lim=5, window_ms=HUGE_WINDOW_MS)
    assert conn.execute(q, (identity, HUGE_WINDOW_MS)).fetchone()[0] is True
    pid = conn.info.backend_pid
    out = {}

    def victim():
        t0 = time.monotonic()
        try:
            out["value"] = conn.execute(q, (identity, HUGE_WINDOW_MS)).fetchone()[0]
        except psycopg.Error as e:
            out["value"] = e
        out["elapsed"] = time.monotonic() - t0

    master.command("CLIENT", "PAUSE", 4000, "WRITE")
    try:
        t = threading.Thread(target=victim, daemon=True)
        t.start()
        wait_for(lambda: pg.execute("SELECT state FROM pg_stat_activity WHERE pid = %s", (pid,)
                                    ).fetchone()[0] == "active", 10, "the call to start", 0.01)
        time.sleep(0.3)  # written, and postponed by the pause
        ids = wait_for(lambda: script_clients(master), 5, "the backend's connection on the master")
        for cid in ids:
            master.command("CLIENT", "KILL", "ID", cid)
        t.join(timeout=10)
        assert not t.is_alive()
    finally:
        master.command("CLIENT", "UNPAUSE")
    value = out["value"]
    assert isinstance(value, psycopg.Error) and value.sqlstate.startswith("08"), value
    assert out["elapsed"] < 2.5, out["elapsed"]  # not after the pause (4 s): no second try
    assert fixed_units(master.command("GET", key)) == "1"
    assert conn.execute(q, (identity, HUGE_WINDOW_MS)).fetchone()[0] is True
    assert fixed_units(master.command("GET", key)) == "2"


# ------------------------------------------------------------ failovers


def test_manual_failover_under_load(sessions, fresh_redis_cluster):
    """CLUSTER FAILOVER of the master that holds some of the 4 sessions'
    identities, while they call: at most one failed call per session (class
    08), and every counter (now read on the promoted replica) equals the
    calls allowed, give or take the failed ones."""
    cluster = fresh_redis_cluster
    idents, where = spread(cluster, "mfo", 2)
    conns = [sessions(cluster, seeds=cluster.live(), command_timeout=3000) for _ in range(4)]

    def job(conn, s, i):
        identity = idents[(s + i) % len(idents)]
        return identity, conn.execute("SELECT rl_fixed_allow(%s, %s, %s)",
                                      (identity, BIG_LIM, HUGE_WINDOW_MS)).fetchone()[0]

    victim = where[idents[0]]
    replica = cluster.replica_of(victim)[0]
    h = Hammer(conns, job).start()
    time.sleep(1.0)
    t0 = time.monotonic()
    old = cluster.manual_failover(replica)
    t_done = time.monotonic()
    time.sleep(1.5)
    h.stop()
    assert old is victim and replica.role() == "master"
    for s in range(len(conns)):
        errs = h.errors(s)
        assert len(errs) <= 1, errs
        assert all(isinstance(e[4], psycopg.Error) and e[4].sqlstate.startswith("08") for e in errs), errs
        # the session went on after the failover
        assert any(r[2] > t_done and not isinstance(r[4], BaseException) for r in h.calls(s))
    failed = {}
    for r in h.errors():
        identity = idents[(r[0] + r[1]) % len(idents)]
        failed[identity] = failed.get(identity, 0) + 1
    for identity in idents:
        allowed = sum(1 for r in h.calls() if not isinstance(r[4], BaseException) and r[4][0] == identity
                      and r[4][1])
        n = int(fixed_units(cluster.command_for_key(rl_key("fixed", identity, lim=BIG_LIM, window_ms=HUGE_WINDOW_MS),
                                                    "GET", rl_key("fixed", identity, lim=BIG_LIM, window_ms=HUGE_WINDOW_MS))))
        assert allowed <= n <= allowed + failed.get(identity, 0), (identity, allowed, n)
    assert cluster.master_of_identity(idents[0]) is replica
    assert any(r[2] > t0 and r[3] < t_done + 1.5 for r in h.calls())


def test_master_killed_on_error_deny(pg, sessions, fresh_redis_cluster):
    """SIGKILL a master: with on_error = deny its identities' calls answer
    false (never an error) until its replica is promoted, then true again;
    the backend survives and stays usable."""
    cluster = fresh_redis_cluster
    victim = cluster.masters()[0]
    replica = cluster.replica_of(victim)[0]
    identity = idents_on(cluster, victim, "kill", 1)[0]
    survivors = [n for n in cluster.live() if n is not victim]
    conn = sessions(cluster, seeds=survivors, on_error="deny", connect_timeout=500, command_timeout=1000)
    before = backend_identity(conn)
    q = "SELECT rl_fixed_allow(%s, %s, %s)"
    assert conn.execute(q, (identity, BIG_LIM, HUGE_WINDOW_MS)).fetchone()[0] is True

    h = Hammer([conn], lambda c, s, i: c.execute(q, (identity, BIG_LIM, HUGE_WINDOW_MS)).fetchone()[0])
    h.start()
    time.sleep(0.3)
    t_kill = time.monotonic()
    promoted = cluster.kill_master(victim)
    t_promoted = time.monotonic()

    def recovered():
        after = [r for r in h.calls() if r[2] > t_promoted]
        return len(after) >= 5 and all(r[4] is True for r in after[-5:])

    wait_for(recovered, 20, "calls to be allowed again after the promotion", 0.05)
    h.stop()
    assert promoted is replica
    calls = h.calls()
    assert h.errors() == [], h.errors()[:3]
    assert all(isinstance(r[4], bool) for r in calls)
    outage = [r for r in calls if r[2] >= t_kill]
    assert any(r[4] is False for r in outage), "nothing was denied while the master was down"
    last_denied = max(r[3] for r in outage if r[4] is False)
    assert last_denied - t_kill < 20.0, "denied for %.1f s" % (last_denied - t_kill)
    assert all(r[4] is True for r in outage if r[2] > last_denied)
    # every call during the outage ended within the timeouts (+ slack)
    assert max(r[3] - r[2] for r in outage) < 4.0
    # the backend did not crash (same pid, no server restart) and works
    assert backend_identity(conn) == before
    assert conn.execute("SELECT 1").fetchone()[0] == 1
    assert pg.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (before[0],)).fetchone()[0] == 1
    assert conn.execute(q, (identity, BIG_LIM, HUGE_WINDOW_MS)).fetchone()[0] is True
    key = rl_key("fixed", identity, lim=BIG_LIM, window_ms=HUGE_WINDOW_MS)
    assert holders(cluster, key) == [promoted]
