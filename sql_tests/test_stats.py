"""Statistics (1.4): the rl_redis_stats view, rl_redis_stats_reset(),
rl_redis_metrics() (Prometheus text), rl_redis_connections(),
rl_redis_rtt_bounds() and the setting rl_redis.stats.

The test cluster preloads the library, so the counters are server-wide:
every test reads the rows of its own fresh policies (exact values), or the
difference of a shared row (explicit-argument calls are grouped per
algorithm) before and after its own calls. One test starts a second,
throwaway PostgreSQL without preloading (scope 'backend').
"""

import math
import os
import re
import threading
import time
import uuid

import psycopg
from psycopg import sql
import pytest

from conftest import control_version, free_port, new_ident, pg_connect, rl_key, set_gucs, use_redis
from test_lying_redis import LyingRedis

COUNTERS = (
    "calls", "allowed", "denied", "units_taken", "units_refunded",
    "errors", "errors_connection", "errors_timeout", "errors_reply",
    "errors_protocol", "fallback_allow", "fallback_deny", "outages", "peeks",
)
RTT_BUCKETS = 15
# a fixed window of 100 years (the longest): windows are aligned on the
# epoch, so no window boundary falls inside a test run before 2070
CENTURY_MS = 3153600000000

SESSIONS = 16
CALLS_PER_SESSION = 10


# ---------------------------------------------------------------- helpers


def stats_row(conn, policy, algorithm=None, dbname=None):
    """The view's row (a dict) of policy, or with policy None of the
    explicit-argument calls of algorithm, in dbname (default: the
    connection's database); None when there is no such row."""
    cur = conn.cursor(row_factory=psycopg.rows.dict_row)
    where = "dbname = coalesce(%s, current_database())"
    params = [dbname]
    if policy is None:
        where += " AND policy IS NULL AND algorithm = %s"
        params.append(algorithm)
    else:
        where += " AND policy = %s"
        params.append(policy)
        if algorithm is not None:
            where += " AND algorithm = %s"
            params.append(algorithm)
    rows = cur.execute("SELECT * FROM rl_redis_stats WHERE " + where, params).fetchall()
    assert len(rows) <= 1, rows
    return rows[0] if rows else None


def zero_row():
    row = {c: 0 for c in COUNTERS}
    row["rtt_buckets"] = [0] * RTT_BUCKETS
    row["rtt_sum_ms"] = 0.0
    return row


def delta(before, after):
    """after - before, counter by counter (before may be None: no row yet)."""
    before = before or zero_row()
    assert after is not None, "no row after the calls"
    return {c: after[c] - before[c] for c in COUNTERS}


def assert_counts(row, ignore=(), **expected):
    """Every counter of row is as given, the others 0 (but those in ignore)."""
    assert row is not None, "no row"
    unknown = set(expected) - set(COUNTERS)
    assert not unknown, unknown
    got = {c: row[c] for c in COUNTERS if c not in ignore}
    want = {c: expected.get(c, 0) for c in COUNTERS if c not in ignore}
    assert got == want


def assert_invariants(row):
    """calls = allowed + denied + errors; errors = the sum of its kinds;
    the round trips counted = the calls Redis answered."""
    assert row["calls"] == row["allowed"] + row["denied"] + row["errors"], row
    assert row["errors"] == (row["errors_connection"] + row["errors_timeout"]
                             + row["errors_reply"] + row["errors_protocol"]), row
    assert len(row["rtt_buckets"]) == RTT_BUCKETS, row
    assert sum(row["rtt_buckets"]) == row["allowed"] + row["denied"], row


def sqlstate_of(conn, query, params=()):
    """The SQLSTATE that query raises (fails when it does not)."""
    with pytest.raises(psycopg.Error) as exc:
        conn.execute(query, params)
    return exc.value.sqlstate


def dead_port():
    """A loopback port nothing listens on (connections are refused)."""
    return free_port()


@pytest.fixture
def policies(pg):
    """make(algorithm, lim, window_ms) -> the name of a new policy; every
    policy made is deleted at teardown (its statistics row stays)."""
    made = []

    def make(algorithm, lim, window_ms):
        name = "pytest.st.%s" % uuid.uuid4().hex[:16]
        pg.execute(
            "INSERT INTO rl_policy (name, algorithm, lim, window_ms) VALUES (%s, %s, %s, %s)",
            (name, algorithm, lim, window_ms),
        )
        made.append(name)
        return name

    yield make
    for name in made:
        pg.execute("DELETE FROM rl_policy WHERE name = %s", (name,))


@pytest.fixture
def roles(pg):
    """make(*grants) -> the name of a new LOGIN role member of grants;
    dropped at teardown."""
    made = []

    def make(*member_of):
        name = "rl_st_%s" % uuid.uuid4().hex[:12]
        pg.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(name)))
        for g in member_of:
            pg.execute(sql.SQL("GRANT {} TO {}").format(sql.Identifier(g), sql.Identifier(name)))
        made.append(name)
        return name

    yield make
    for name in made:
        pg.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(name)))


# ---------------------------------------------------------------- basics


def test_version_and_objects(pg):
    assert pg.execute(
        "SELECT extversion FROM pg_extension WHERE extname = 'rl_redis'"
    ).fetchone()[0] == control_version()
    assert pg.execute("SHOW rl_redis.stats").fetchone()[0] == "on"
    cols = [c.name for c in pg.execute("SELECT * FROM rl_redis_stats LIMIT 0").description]
    assert cols == [
        "dbname", "policy", "algorithm", "calls", "allowed", "denied",
        "units_taken", "units_refunded", "errors", "errors_connection",
        "errors_timeout", "errors_reply", "errors_protocol", "fallback_allow",
        "fallback_deny", "outages", "rtt_buckets", "rtt_sum_ms", "scope", "peeks",
        "shadow_denied",
    ]
    bounds = pg.execute("SELECT rl_redis_rtt_bounds()").fetchone()[0]
    assert len(bounds) == RTT_BUCKETS
    assert bounds[-1] == math.inf
    assert all(0 < a < b for a, b in zip(bounds, bounds[1:])), bounds
    assert all(s == "server" for (s,) in pg.execute("SELECT scope FROM rl_redis_stats"))


# ---------------------------------------------------------------- exact counts


def test_counts_exact_under_16_sessions(pg, policies):
    """16 sessions, 10 rounds each of: a fixed policy (lim 50), an explicit
    sliding window (lim 30) and a concurrency policy (2 slots, given back
    at each autocommit): the rows hold exactly what the sessions saw."""
    rate = policies("fixed", 50, CENTURY_MS)
    conc = policies("concurrency", 2, 60000)
    id_rate, id_explicit, id_conc = new_ident("st16p"), new_ident("st16x"), new_ident("st16c")
    jobs = [
        ("rate", "SELECT rl_allow(%s, %s)", (rate, id_rate)),
        ("explicit", "SELECT rl_sliding_allow(%s, 30, 600000)", (id_explicit,)),
        ("conc", "SELECT rl_acquire_allow(%s, %s)", (conc, id_conc)),
    ]
    explicit_before = stats_row(pg, None, "sliding")

    conns = [pg_connect() for _ in range(SESSIONS)]
    barrier = threading.Barrier(SESSIONS)
    seen = [{name: [0, 0] for name, _, _ in jobs} for _ in range(SESSIONS)]
    errors = []

    def worker(t):
        try:
            barrier.wait(timeout=60)
            for _ in range(CALLS_PER_SESSION):
                for name, query, params in jobs:
                    value = conns[t].execute(query, params).fetchone()[0]
                    assert isinstance(value, bool), value
                    seen[t][name][0 if value else 1] += 1
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(SESSIONS)]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=120)
        assert not any(th.is_alive() for th in threads), "worker threads hung"
    finally:
        for c in conns:
            c.close()
    assert errors == [], errors
    total = {name: [sum(s[name][0] for s in seen), sum(s[name][1] for s in seen)]
             for name, _, _ in jobs}
    n = SESSIONS * CALLS_PER_SESSION

    # what the sessions saw: exact for the rate limits
    assert total["rate"] == [50, n - 50]
    assert total["explicit"] == [30, n - 30]
    assert sum(total["conc"]) == n and 2 <= total["conc"][0] <= n

    row = stats_row(pg, rate)
    assert row["algorithm"] == "fixed" and row["scope"] == "server"
    assert_counts(row, calls=n, allowed=50, denied=n - 50, units_taken=50)
    assert_invariants(row)

    d = delta(explicit_before, stats_row(pg, None, "sliding"))
    assert d == {c: {"calls": n, "allowed": 30, "denied": n - 30, "units_taken": 30}.get(c, 0)
                 for c in COUNTERS}

    row = stats_row(pg, conc)
    assert row["algorithm"] == "concurrency"
    allowed, denied = total["conc"]
    assert_counts(row, calls=n, allowed=allowed, denied=denied, units_taken=allowed)
    assert_invariants(row)


def test_concurrency_slots_counted(pg, policies):
    """Held slots, deterministic: a policy of 2 slots and explicit slots
    (policy NULL, algorithm 'concurrency')."""
    conc = policies("concurrency", 2, 60000)
    ident = new_ident("stslot")
    explicit_before = stats_row(pg, None, "concurrency")
    with pg_connect(autocommit=False) as a, pg_connect() as b:
        got = [a.execute("SELECT rl_acquire_allow(%s, %s)", (conc, ident)).fetchone()[0] for _ in range(3)]
        assert got == [True, True, False]
        assert b.execute("SELECT rl_acquire_allow(%s, %s)", (conc, ident)).fetchone()[0] is False
        got = [a.execute("SELECT rl_concurrency_acquire_allow(%s, 1, 60000)", (ident,)).fetchone()[0]
               for _ in range(2)]
        assert got == [True, False]
        a.commit()
        assert b.execute("SELECT rl_acquire_allow(%s, %s)", (conc, ident)).fetchone()[0] is True
    assert_counts(stats_row(pg, conc), calls=5, allowed=3, denied=2, units_taken=3)
    d = delta(explicit_before, stats_row(pg, None, "concurrency"))
    assert d == {c: {"calls": 2, "allowed": 1, "denied": 1, "units_taken": 1}.get(c, 0)
                 for c in COUNTERS}


# ---------------------------------------------------------------- failures


def test_dead_port_errors_and_fallbacks(policies):
    """A refused connection (retry_interval 0), one session per on_error
    mode, 3 calls each: every call is an error of kind connection, allow
    and deny also count a fallback, and each session's run is one outage."""
    policy = policies("fixed", 5, 60000)
    port = dead_port()
    for on_error, expect in (("error", None), ("allow", True), ("deny", False)):
        with pg_connect() as conn:
            set_gucs(conn, host="127.0.0.1", port=port, retry_interval=0, on_error=on_error)
            for _ in range(3):
                ident = new_ident("stdead")
                if expect is None:
                    assert sqlstate_of(conn, "SELECT rl_allow(%s, %s)", (policy, ident)) == "08001"
                else:
                    assert conn.execute("SELECT rl_allow(%s, %s)", (policy, ident)).fetchone()[0] is expect
    with pg_connect() as pg:
        row = stats_row(pg, policy)
    assert_counts(row, calls=9, errors=9, errors_connection=9,
                  fallback_allow=3, fallback_deny=3, outages=3)
    assert_invariants(row)
    assert row["rtt_sum_ms"] == 0


def test_dead_port_breaker_open_counts_each_call(policies):
    """With the circuit breaker (retry_interval 5 s) the calls after the
    first fail at once, without the network: still one error each, one
    outage in all."""
    policy = policies("fixed", 5, 60000)
    with pg_connect() as conn:
        set_gucs(conn, host="127.0.0.1", port=dead_port(), retry_interval=5000, on_error="deny")
        for _ in range(4):
            assert conn.execute("SELECT rl_allow(%s, %s)", (policy, new_ident("stbrk"))).fetchone()[0] is False
        row = stats_row(conn, policy)
    assert_counts(row, calls=4, errors=4, errors_connection=4, fallback_deny=4, outages=1)


def test_hung_redis_counts_timeouts(policies, redis_factory):
    policy = policies("fixed", 5, 60000)
    r = redis_factory()
    with pg_connect() as conn:
        use_redis(conn, r, command_timeout=300, connect_timeout=300, on_error="allow")
        assert conn.execute("SELECT rl_allow(%s, %s)", (policy, new_ident("sthung"))).fetchone()[0] is True
        r.pause()
        try:
            for _ in range(2):
                t0 = time.monotonic()
                assert conn.execute("SELECT rl_allow(%s, %s)", (policy, new_ident("sthung"))).fetchone()[0] is True
                assert 0.25 <= time.monotonic() - t0 <= 2.0
            set_gucs(conn, on_error="error")
            # a timeout: 08006 for the reply, 08001 for a new connection's handshake
            assert sqlstate_of(conn, "SELECT rl_allow(%s, %s)", (policy, new_ident("sthung"))) in ("08006", "08001")
        finally:
            r.resume()
        row = stats_row(conn, policy)
    assert_counts(row, calls=4, allowed=1, units_taken=1, errors=3, errors_timeout=3,
                  fallback_allow=2, outages=1)
    assert_invariants(row)


def test_error_reply_counts_errors_reply(pg, policies, shared_redis):
    """WRONGTYPE at the decision's key: an error reply of Redis (08000)."""
    policy = policies("fixed", 5, 60000)
    ident = new_ident("stwrong")
    assert int(shared_redis.cli("RPUSH", rl_key("fixed", ident, policy, 5, 60000), "x")) == 1
    with pg_connect() as conn:
        set_gucs(conn, on_error="error", retry_interval=0)
        assert sqlstate_of(conn, "SELECT rl_allow(%s, %s)", (policy, ident)) == "08000"
        set_gucs(conn, on_error="allow")
        assert conn.execute("SELECT rl_allow(%s, %s)", (policy, ident)).fetchone()[0] is True
        set_gucs(conn, on_error="deny")
        assert conn.execute("SELECT rl_allow(%s, %s)", (policy, ident)).fetchone()[0] is False
        # another identity of the same policy is decided by Redis
        assert conn.execute("SELECT rl_allow(%s, %s)", (policy, new_ident("stwrong"))).fetchone()[0] is True
    row = stats_row(pg, policy)
    # outages: see test_error_replies_are_not_outages
    assert_counts(row, ignore=("outages",), calls=4, allowed=1, units_taken=1, errors=3,
                  errors_reply=3, fallback_allow=1, fallback_deny=1)
    assert_invariants(row)


def test_bad_reply_counts_errors_protocol(pg, policies):
    """A reply that is not what the script returns (08P01)."""
    policy = policies("fixed", 5, 60000)
    liar = LyingRedis(b":1\r\n")
    try:
        with pg_connect() as conn:
            set_gucs(conn, host="127.0.0.1", port=liar.port, retry_interval=0, on_error="error")
            assert sqlstate_of(conn, "SELECT rl_allow(%s, %s)", (policy, new_ident("stlie"))) == "08P01"
            set_gucs(conn, on_error="allow")
            assert conn.execute("SELECT rl_allow(%s, %s)", (policy, new_ident("stlie"))).fetchone()[0] is True
    finally:
        liar.close()
    row = stats_row(pg, policy)
    assert_counts(row, ignore=("outages",), calls=2, errors=2, errors_protocol=2, fallback_allow=1)
    assert_invariants(row)


def test_error_replies_are_not_outages(pg, policies, shared_redis):
    """outages counts "failures that began an outage (the circuit breaker
    opened)"; an error reply (WRONGTYPE) or a bad reply comes from a Redis
    that answers, opens no breaker (the next call goes to Redis again, the
    connection is not failing), so it begins no outage."""
    wrong = policies("fixed", 5, 60000)
    ident = new_ident("stwrong")
    shared_redis.cli("RPUSH", rl_key("fixed", ident, wrong, 5, 60000), "x")
    with pg_connect() as conn:
        set_gucs(conn, on_error="allow", retry_interval=5000)
        for _ in range(3):
            assert conn.execute("SELECT rl_allow(%s, %s)", (wrong, ident)).fetchone()[0] is True
        # no breaker is open: the connection is fine and not failing
        assert conn.execute(
            "SELECT count(*) FROM rl_redis_connections() WHERE failing_since IS NOT NULL"
        ).fetchone()[0] == 0
    lying = policies("fixed", 5, 60000)
    liar = LyingRedis(b":1\r\n")
    try:
        with pg_connect() as conn:
            set_gucs(conn, host="127.0.0.1", port=liar.port, retry_interval=5000, on_error="allow")
            for _ in range(2):
                assert conn.execute("SELECT rl_allow(%s, %s)", (lying, new_ident("stlie"))).fetchone()[0] is True
            assert conn.execute(
                "SELECT count(*) FROM rl_redis_connections() WHERE failing_since IS NOT NULL"
            ).fetchone()[0] == 0
    finally:
        liar.close()
    row_wrong, row_lying = stats_row(pg, wrong), stats_row(pg, lying)
    assert (row_wrong["errors_reply"], row_wrong["fallback_allow"]) == (3, 3)
    assert (row_lying["errors_protocol"], row_lying["fallback_allow"]) == (2, 2)
    assert (row_wrong["outages"], row_lying["outages"]) == (0, 0), (
        "outages of 3 WRONGTYPE replies: %d, of 2 bad replies: %d"
        % (row_wrong["outages"], row_lying["outages"]))


# ---------------------------------------------------------------- refunds, rtt


def test_units_refunded(pg, policies, shared_redis):
    policy = policies("fixed", 10, CENTURY_MS)
    ident = new_ident("strefund")
    with pg_connect(autocommit=False) as conn:
        set_gucs(conn, refund_on_abort="all")
        conn.commit()
        # a rolled-back transaction that charged 3
        assert conn.execute("SELECT rl_allow(%s, %s, 3)", (policy, ident)).fetchone()[0] is True
        conn.rollback()
        row = stats_row(conn, policy)
        conn.commit()
        assert_counts(row, calls=1, allowed=1, units_taken=3, units_refunded=3)
        # the quota is whole again
        assert conn.execute("SELECT (rl_check(%s, %s, 0)).remaining", (policy, ident)).fetchone()[0] == 10
        conn.commit()
        # a savepoint rolled back (2), then the transaction (4 + 1)
        assert conn.execute("SELECT rl_allow(%s, %s, 4)", (policy, ident)).fetchone()[0] is True
        conn.execute("SAVEPOINT s")
        assert conn.execute("SELECT rl_allow(%s, %s, 2)", (policy, ident)).fetchone()[0] is True
        conn.execute("ROLLBACK TO SAVEPOINT s")
        mid = stats_row(conn, policy)["units_refunded"]
        assert conn.execute("SELECT rl_allow(%s, %s, 1)", (policy, ident)).fetchone()[0] is True
        conn.rollback()
        row = stats_row(conn, policy)
        conn.commit()
        assert mid == 3 + 2
        # a peek (cost 0) is counted apart (1.6), not as a call
        assert_counts(row, calls=4, allowed=4, peeks=1, units_taken=3 + 4 + 2 + 1,
                      units_refunded=3 + 2 + 5)
        # refund function: 2 units taken (committed), then given back by rl_refund
        assert conn.execute("SELECT rl_allow(%s, %s, 2)", (policy, ident)).fetchone()[0] is True
        conn.commit()
        conn.execute("SELECT rl_refund(%s, %s, 2)", (policy, ident))
        conn.commit()
        row = stats_row(conn, policy)
        conn.commit()
    assert row["units_taken"] == 3 + 4 + 2 + 1 + 2
    assert row["units_refunded"] == 3 + 2 + 5 + 2
    assert_invariants(row)


def test_rtt_buckets(pg, policies):
    policy = policies("token_bucket", 5, 60000)
    ident = new_ident("strtt")
    got = [pg.execute("SELECT rl_allow(%s, %s)", (policy, ident)).fetchone()[0] for _ in range(8)]
    assert got == [True] * 5 + [False] * 3
    row = stats_row(pg, policy)
    assert_counts(row, calls=8, allowed=5, denied=3, units_taken=5)
    assert len(row["rtt_buckets"]) == RTT_BUCKETS
    assert sum(row["rtt_buckets"]) == row["allowed"] + row["denied"] == 8
    assert all(b >= 0 for b in row["rtt_buckets"])
    assert row["rtt_sum_ms"] > 0
    # the sum fits the buckets: above the lower bounds, below the upper ones
    bounds = pg.execute("SELECT rl_redis_rtt_bounds()").fetchone()[0]
    lower = sum(n * (bounds[i - 1] if i else 0) for i, n in enumerate(row["rtt_buckets"]) if n)
    upper = sum(n * bounds[i] for i, n in enumerate(row["rtt_buckets"]) if n)
    assert lower <= row["rtt_sum_ms"] <= upper, (row, bounds)


# ---------------------------------------------------------------- reset, privileges


@pytest.mark.alone  # the reset zeroes the rows of every test running meanwhile
def test_reset_zeroes_every_row(pg, policies):
    policy = policies("fixed", 2, CENTURY_MS)
    ident = new_ident("streset")
    for _ in range(3):
        pg.execute("SELECT rl_allow(%s, %s)", (policy, ident))
    assert stats_row(pg, policy)["calls"] == 3
    pg.execute("SELECT rl_redis_stats_reset()")
    rows = pg.execute(
        "SELECT policy, algorithm, %s, rtt_buckets, rtt_sum_ms FROM rl_redis_stats"
        % ", ".join(COUNTERS)
    ).fetchall()
    assert rows, "the rows stay"
    for r in rows:
        assert list(r[2:2 + len(COUNTERS)]) == [0] * len(COUNTERS), r
        assert r[-2] == [0] * RTT_BUCKETS and r[-1] == 0, r
    # the policy's row is still there, and counts again from zero
    assert_counts(stats_row(pg, policy), calls=0)
    assert pg.execute("SELECT rl_allow(%s, %s)", (policy, ident)).fetchone()[0] is False
    assert_counts(stats_row(pg, policy), calls=1, denied=1)


def test_privileges(pg, policies, roles):
    policy = policies("fixed", 5, 60000)
    pg.execute("SELECT rl_allow(%s, %s)", (policy, new_ident("stpriv")))
    plain = roles()
    reader = roles("pg_read_all_stats")
    with pg_connect(user=plain) as conn:
        # an ordinary role may still decide (rl_allow is PUBLIC) ...
        assert conn.execute("SELECT rl_allow(%s, %s)", (policy, new_ident("stpriv"))).fetchone()[0] is True
        # ... but reads and resets nothing
        for query in (
            "SELECT * FROM rl_redis_stats",
            "SELECT rl_redis_metrics()",
            "SELECT rl_redis_stats_reset()",
            "SELECT * FROM rl_redis_stats_rows()",
            "SELECT * FROM rl_redis_connections()",
            "SET rl_redis.stats = off",
        ):
            assert sqlstate_of(conn, query) == "42501", query
    with pg_connect(user=reader) as conn:
        row = stats_row(conn, policy)
        assert_counts(row, calls=2, allowed=2, units_taken=2)
        text = conn.execute("SELECT rl_redis_metrics()").fetchone()[0]
        assert 'policy="%s"' % policy in text
        conn.execute("SELECT * FROM rl_redis_connections()")
        assert sqlstate_of(conn, "SELECT rl_redis_stats_reset()") == "42501"
        assert sqlstate_of(conn, "SET rl_redis.stats = off") == "42501"
    # nothing was reset
    assert_counts(stats_row(pg, policy), calls=2, allowed=2, units_taken=2)


def test_stats_off_counts_nothing(pg, policies):
    policy = policies("fixed", 5, CENTURY_MS)
    ident = new_ident("stoff")
    explicit_before = stats_row(pg, None, "gcra")
    with pg_connect() as conn:
        conn.execute("SET rl_redis.stats = off")
        for _ in range(3):
            assert conn.execute("SELECT rl_allow(%s, %s)", (policy, ident)).fetchone()[0] is True
            assert conn.execute("SELECT rl_gcra_allow(%s, 5, 60000)", (ident,)).fetchone()[0] is True
        assert stats_row(conn, policy) is None
        assert delta(explicit_before, stats_row(conn, None, "gcra") or zero_row()) == {c: 0 for c in COUNTERS}
        # failures are not counted either
        set_gucs(conn, host="127.0.0.1", port=dead_port(), retry_interval=0, on_error="allow")
        assert conn.execute("SELECT rl_allow(%s, %s)", (policy, ident)).fetchone()[0] is True
        assert stats_row(conn, policy) is None
        conn.execute("RESET rl_redis.host")
        conn.execute("RESET rl_redis.port")
        conn.execute("SET rl_redis.stats = on")
        assert conn.execute("SELECT rl_allow(%s, %s)", (policy, ident)).fetchone()[0] is True
    assert_counts(stats_row(pg, policy), calls=1, allowed=1, units_taken=1)


# ---------------------------------------------------------------- Prometheus text

LABEL_VALUE = r'"((?:[^"\\\n]|\\[\\"n])*)"'
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)=' + LABEL_VALUE)
SAMPLE = re.compile(
    r'^([a-zA-Z_:][a-zA-Z0-9_:]*)'
    r'(?:\{((?:[a-zA-Z_][a-zA-Z0-9_]*=' + LABEL_VALUE + r'(?:,(?=[a-zA-Z_]))?)*)\})?'
    r' ([-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?|[-+]?Inf|NaN)$'
)


def unescape(value):
    return re.sub(r'\\(.)', lambda m: {"n": "\n"}.get(m.group(1), m.group(1)), value)


def parse_metrics(text):
    """Checks the exposition format and returns
    {(sample name, ((label, value), ...)): float}."""
    assert text.endswith("\n"), text[-200:]
    helps, types, done = {}, {}, set()
    current = None
    samples = {}
    for line in text[:-1].split("\n"):
        assert line != "", "empty line in the metrics"
        if line.startswith("#"):
            m = re.match(r"^# (HELP|TYPE) ([a-zA-Z_:][a-zA-Z0-9_:]*) (.+)$", line)
            assert m, line
            kind, name, rest = m.groups()
            assert name not in done, "%s comes back after other metrics" % name
            table = helps if kind == "HELP" else types
            assert name not in table, "second # %s of %s" % (kind, name)
            if kind == "TYPE":
                assert rest in ("counter", "gauge", "histogram", "summary", "untyped"), line
                assert name not in samples_families(samples), "# TYPE %s after its samples" % name
            table[name] = rest
            continue
        m = SAMPLE.match(line)
        assert m, "not a sample line: %r" % line
        name, labels, value = m.group(1), m.group(2) or "", m.group(4)
        family = name
        if name not in types:
            for suffix in ("_bucket", "_sum", "_count"):
                base = name[: -len(suffix)]
                if name.endswith(suffix) and types.get(base) == "histogram":
                    family = base
        assert family in helps, "no # HELP before %s" % line
        assert family in types, "no # TYPE before %s" % line
        if current != family:
            if current is not None:
                done.add(current)
            assert family not in done, "the samples of %s are not together" % family
            current = family
        pairs = tuple((k, unescape(v)) for k, v in LABEL.findall(labels))
        assert ",".join('%s="%s"' % (k, v) for k, v in LABEL.findall(labels)) == labels, line
        assert len({k for k, _ in pairs}) == len(pairs), "a label twice: %s" % line
        key = (name, pairs)
        assert key not in samples or not dict(pairs).get("database"), "series twice: %s" % line
        samples.setdefault(key, [])
        samples[key].append(float(value.replace("Inf", "inf")))
    return samples, types


def samples_families(samples):
    return {name for name, _ in samples}


def check_histograms(samples, types):
    """Buckets ascending and cumulative, the last le="+Inf" equal to _count."""
    for family, kind in types.items():
        if kind != "histogram":
            continue
        series = {}
        for (name, pairs), values in samples.items():
            if name == family + "_bucket":
                rest = tuple(p for p in pairs if p[0] != "le")
                le = dict(pairs)["le"]
                series.setdefault(rest, []).append((le, values[0]))
        assert series, "histogram %s has no buckets" % family
        for rest, buckets in series.items():
            les = [float(le.replace("+Inf", "inf")) for le, _ in buckets]
            assert les == sorted(les) and len(set(les)) == len(les), buckets
            assert buckets[-1][0] == "+Inf", buckets
            counts = [v for _, v in buckets]
            assert counts == sorted(counts), "not cumulative: %s" % (buckets,)
            assert samples[(family + "_count", rest)][0] == counts[-1], (rest, buckets)
            assert (family + "_sum", rest) in samples, rest


def series(samples, name, **labels):
    """The value of the one sample of name whose labels include labels."""
    found = [v for (n, pairs), v in samples.items()
             if n == name and all(dict(pairs).get(k) == w for k, w in labels.items())]
    assert len(found) == 1, (name, labels, found)
    assert len(found[0]) == 1
    return found[0][0]


def test_metrics_format_and_values(pg, policies):
    policy = policies("sliding_counter", 4, 60000)
    ident = new_ident("stmetrics")
    for _ in range(6):
        pg.execute("SELECT rl_allow(%s, %s)", (policy, ident))
    text = pg.execute("SELECT rl_redis_metrics()").fetchone()[0]
    samples, types = parse_metrics(text)
    check_histograms(samples, types)

    row = stats_row(pg, policy)
    labels = dict(database=pg.info.dbname, policy=policy, algorithm="sliding_counter")
    for c in ("calls", "allowed", "denied", "units_taken", "units_refunded", "errors",
              "fallback_allow", "fallback_deny", "outages"):
        assert types["rl_redis_%s_total" % c] == "counter"
        assert series(samples, "rl_redis_%s_total" % c, **labels) == row[c], c
    assert (row["calls"], row["allowed"], row["denied"]) == (6, 4, 2)
    for kind in ("connection", "timeout", "reply", "protocol"):
        assert series(samples, "rl_redis_errors_by_kind_total", kind=kind, **labels) == 0
    # the histogram is the view's, in seconds
    assert types["rl_redis_rtt_seconds"] == "histogram"
    bounds = pg.execute("SELECT rl_redis_rtt_bounds()").fetchone()[0]
    cumulative = 0
    for i, bound in enumerate(bounds):
        cumulative += row["rtt_buckets"][i]
        le = "+Inf" if math.isinf(bound) else None
        got = [v[0] for (n, pairs), v in samples.items()
               if n == "rl_redis_rtt_seconds_bucket" and dict(pairs).get("policy") == policy
               and (dict(pairs)["le"] == le if le else
                    dict(pairs)["le"] != "+Inf" and math.isclose(float(dict(pairs)["le"]), bound / 1000))]
        assert got == [cumulative], (i, bound, got)
    assert series(samples, "rl_redis_rtt_seconds_count", **labels) == 6
    assert math.isclose(series(samples, "rl_redis_rtt_seconds_sum", **labels),
                        row["rtt_sum_ms"] / 1000, rel_tol=1e-9)
    # the explicit-argument rows have an empty policy label
    assert any(dict(p).get("policy") == "" for n, p in samples if n == "rl_redis_calls_total") or \
        pg.execute("SELECT count(*) FROM rl_redis_stats WHERE policy IS NULL").fetchone()[0] == 0
    # every row of the view is consistent
    cur = pg.cursor(row_factory=psycopg.rows.dict_row)
    for r in cur.execute("SELECT * FROM rl_redis_stats"):
        assert_invariants(r)


def test_metrics_escape_database_name(pg):
    dbname = 'we"ird\\db.%s' % uuid.uuid4().hex[:8]
    pg.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
    try:
        with pg_connect(dbname=dbname) as conn:
            conn.execute("CREATE EXTENSION rl_redis")
            assert conn.execute("SELECT rl_fixed_allow(%s, 5, 60000)", (new_ident("stdb"),)).fetchone()[0] is True
            assert conn.execute("SELECT current_database()").fetchone()[0] == dbname
        row = stats_row(pg, None, "fixed", dbname=dbname)
        assert_counts(row, calls=1, allowed=1, units_taken=1)
        text = pg.execute("SELECT rl_redis_metrics()").fetchone()[0]
        escaped = dbname.replace("\\", "\\\\").replace('"', '\\"')
        assert escaped.startswith('we\\"ird\\\\db.')
        line = 'rl_redis_calls_total{database="%s",policy="",algorithm="fixed"} 1' % escaped
        assert line in text.split("\n"), [x for x in text.split("\n") if "ird" in x]
        samples, types = parse_metrics(text)
        assert series(samples, "rl_redis_allowed_total", database=dbname, algorithm="fixed") == 1
    finally:
        pg.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(dbname)))


def test_metrics_unique_series_after_dropped_databases(pg):
    """Rows of a dropped database stay (dbname NULL): two dropped databases
    with explicit calls of the same algorithm must not give two series of
    the same name and labels (Prometheus rejects duplicate samples)."""
    for _ in range(2):
        dbname = "rl_st_drop_%s" % uuid.uuid4().hex[:8]
        pg.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
        try:
            with pg_connect(dbname=dbname) as conn:
                conn.execute("CREATE EXTENSION rl_redis")
                conn.execute("SELECT rl_fixed_allow(%s, 5, 60000)", (new_ident("stdrop"),))
        finally:
            pg.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(dbname)))
    text = pg.execute("SELECT rl_redis_metrics()").fetchone()[0]
    lines = [x for x in text.split("\n") if x and not x.startswith("#")]
    seen, dups = set(), []
    for x in lines:
        name_labels = x.rsplit(" ", 1)[0]
        if name_labels in seen:
            dups.append(x)
        seen.add(name_labels)
    assert dups == [], "duplicate series in rl_redis_metrics(): %s" % dups[:4]


# ---------------------------------------------------------------- connections


def test_connections(pg, shared_redis_port):
    with pg_connect() as conn:
        assert conn.execute("SELECT * FROM rl_redis_connections()").fetchall() == []
        assert conn.execute("SELECT rl_fixed_allow(%s, 5, 60000)", (new_ident("stconn"),)).fetchone()[0] is True
        rows = conn.execute("SELECT * FROM rl_redis_connections()").fetchall()
        # a function of the library ran there: all 12 scripts are loaded
        assert rows == [("127.0.0.1:%d" % shared_redis_port, "server", "open", 0, None, None, None,
                         "standalone", 12, 12)]

        port = dead_port()
        set_gucs(conn, host="127.0.0.1", port=port, retry_interval=5000, on_error="allow")
        t0 = time.time()
        assert conn.execute("SELECT rl_fixed_allow(%s, 5, 60000)", (new_ident("stconn"),)).fetchone()[0] is True
        cur = conn.cursor(row_factory=psycopg.rows.dict_row)
        rows = cur.execute(
            "SELECT *, now() AS now FROM rl_redis_connections() WHERE server = %s",
            ("127.0.0.1:%d" % port,),
        ).fetchall()
        assert len(rows) == 1, rows
        r = rows[0]
        assert r["kind"] == "server" and r["state"] == "closed", r
        assert r["failing_since"] is not None
        assert abs(r["failing_since"].timestamp() - t0) < 5, r
        assert "127.0.0.1:%d" % port in r["last_error"], r
        assert 0 <= r["retry_in_ms"] <= 5000, r
        # a call within the interval fails at once; the breaker still holds
        assert conn.execute("SELECT rl_fixed_allow(%s, 5, 60000)", (new_ident("stconn"),)).fetchone()[0] is True
        again = cur.execute(
            "SELECT * FROM rl_redis_connections() WHERE server = %s", ("127.0.0.1:%d" % port,)
        ).fetchone()
        assert again["failing_since"] == r["failing_since"]
        assert 0 <= again["retry_in_ms"] <= r["retry_in_ms"], (again, r)
        # back to the shared Redis: that connection is not failing
        conn.execute("RESET rl_redis.host")
        conn.execute("RESET rl_redis.port")
        assert conn.execute("SELECT rl_fixed_allow(%s, 5, 60000)", (new_ident("stconn"),)).fetchone()[0] is True
        ok = cur.execute(
            "SELECT * FROM rl_redis_connections() WHERE server = %s",
            ("127.0.0.1:%d" % shared_redis_port,),
        ).fetchone()
        assert ok["state"] == "open" and ok["failing_since"] is None, ok
    # another session has connections of its own
    with pg_connect() as other:
        assert other.execute("SELECT count(*) FROM rl_redis_connections()").fetchone()[0] == 0


# ---------------------------------------------------------------- without preloading


def test_without_preloading_scope_backend(unpreloaded_cluster):
    port = unpreloaded_cluster
    connect = lambda: pg_connect(host="127.0.0.1", port=port, user="postgres", dbname="postgres")
    with connect() as su:
        # the update path from 1.3 too
        su.execute("CREATE EXTENSION rl_redis VERSION '1.3'")
        su.execute("ALTER EXTENSION rl_redis UPDATE")
        assert su.execute(
            "SELECT extversion FROM pg_extension WHERE extname = 'rl_redis'"
        ).fetchone()[0] == control_version()
        assert su.execute("SHOW shared_preload_libraries").fetchone()[0] == ""
        policy = "pytest.st.%s" % uuid.uuid4().hex[:16]
        su.execute("INSERT INTO rl_policy (name, algorithm, lim, window_ms) VALUES (%s, 'fixed', 3, %s)",
                   (policy, CENTURY_MS))
    ident = new_ident("stnopre")
    a, b = connect(), connect()
    try:
        # nothing counted yet in either backend
        assert a.execute("SELECT count(*) FROM rl_redis_stats").fetchone()[0] == 0
        got = [a.execute("SELECT rl_allow(%s, %s)", (policy, ident)).fetchone()[0] for _ in range(5)]
        assert got == [True, True, True, False, False]
        a.execute("SELECT rl_sliding_allow(%s, 5, 60000)", (ident,))
        row = stats_row(a, policy)
        assert row["scope"] == "backend" and row["dbname"] == "postgres" and row["algorithm"] == "fixed"
        assert_counts(row, calls=5, allowed=3, denied=2, units_taken=3)
        assert_invariants(row)
        assert_counts(stats_row(a, None, "sliding"), calls=1, allowed=1, units_taken=1)

        # another session sees only its own
        assert b.execute("SELECT count(*) FROM rl_redis_stats").fetchone()[0] == 0
        assert b.execute("SELECT rl_allow(%s, %s)", (policy, ident)).fetchone()[0] is False
        assert_counts(stats_row(b, policy), calls=1, denied=1)
        assert stats_row(b, None, "sliding") is None
        assert [s for (s,) in b.execute("SELECT scope FROM rl_redis_stats")] == ["backend"]
        text = b.execute("SELECT rl_redis_metrics()").fetchone()[0]
        samples, types = parse_metrics(text)
        assert series(samples, "rl_redis_denied_total", policy=policy) == 1

        # and a's counts are a's: unchanged by b, reset only in a
        assert_counts(stats_row(a, policy), calls=5, allowed=3, denied=2, units_taken=3)
        b.execute("SELECT rl_redis_stats_reset()")
        assert_counts(stats_row(b, policy), calls=0)
        assert_counts(stats_row(a, policy), calls=5, allowed=3, denied=2, units_taken=3)
    finally:
        a.close()
        b.close()


# ------------------------------------------------- the README's exporter query


def test_readme_postgres_exporter_query(pg, policies):
    """The postgres_exporter queries file the README shows runs on the
    shared server: each query returns exactly the columns its metrics
    declare (a HISTOGRAM column with its _bucket, _sum and _count), with a
    policy's counts (test_exporter.py runs the exporter itself on it)."""
    import re
    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    m = re.search(r"^```text\n(rl_redis:\n.*?)^```", readme, re.M | re.S)
    assert m, "the postgres_exporter queries file is missing from README.md"
    blocks = re.findall(r"^(\w+):\n  query: \|\n((?:    .*\n)+)  metrics:\n((?:    - .*\n)+)",
                        m.group(1), re.M)
    assert [b[0] for b in blocks] == ["rl_redis", "rl_redis_errors_by_kind"], blocks
    name = policies("fixed", 1, 60000)
    pg.execute("SELECT rl_allow(%s, 'exporter') FROM generate_series(1, 3)", (name,))
    for namespace, query, metrics in blocks:
        declared = re.findall(r'^    - (\w+): \{usage: "(\w+)"', metrics, re.M)
        want = []
        for column, usage in declared:
            want += [column] + ([column + s for s in ("_bucket", "_sum", "_count")]
                                if usage == "HISTOGRAM" else [])
        cur = pg.execute(query)
        columns = [d.name for d in cur.description]
        assert sorted(columns) == sorted(want), namespace
        rows = [dict(zip(columns, r)) for r in cur.fetchall()]
        mine = [r for r in rows if r["policy"] == name]
        if namespace == "rl_redis":
            assert len(mine) == 1 and mine[0]["allowed_total"] == 1 and mine[0]["denied_total"] == 2
            assert mine[0]["rtt_seconds_count"] == 3
        else:
            assert sorted((r["kind"], r["total"]) for r in mine) == [
                ("connection", 0), ("protocol", 0), ("reply", 0), ("timeout", 0)]
