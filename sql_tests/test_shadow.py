"""Shadow policies (rl_policy.mode = 'shadow', 1.6).

A shadow policy decides and charges in Redis exactly as enforcing, but every
caller is allowed: a decision it would deny comes back allowed = true with
the remaining / reset_ms / retry_after_ms enforcing gives, takes nothing and
holds no slot. It is counted in rl_redis_stats.shadow_denied, the metric
rl_redis_shadow_denied_total and, with rl_redis.track_denials, rl_top_denied.
Every path that decides a policy honours it: rl_check / rl_allow,
rl_check_all / rl_allow_all (a shadow policy's would-be denial stops no other
policy, and the shadow policy is then not charged), rl_check_many,
rl_acquire / rl_acquire_allow, the row and statement guards; the denial
cache never denies a shadow policy's call. Each test compares with an
enforcing twin (the same numbers, mode 'enforce') or with what enforcing
would do, on the frozen test clock, and reads the state in Redis.
"""

import uuid

import psycopg
import pytest

from conftest import fixed_units, new_ident, pg_connect, rl_key, set_gucs, use_redis
from test_stats import dead_port, stats_row

TEST_CLOCK_MS = 1800000000000  # a frozen clock on a whole minute
WINDOW_MS = 60000


@pytest.fixture
def redis(redis_factory):
    """A redis-server of the module's tests' own."""
    return redis_factory()


@pytest.fixture
def session(redis):
    """session(**gucs) -> a new autocommit superuser connection on the test's
    Redis and the frozen clock; all closed at teardown."""
    conns = []

    def make(**gucs):
        conn = pg_connect()
        conns.append(conn)
        gucs.setdefault("test_clock_ms", TEST_CLOCK_MS)
        use_redis(conn, redis, **gucs)
        return conn

    yield make
    for c in conns:
        c.close()


@pytest.fixture
def policy(pg):
    """policy(algorithm, lim, window_ms=WINDOW_MS, mode='shadow') -> a new
    policy's name; all deleted at teardown."""
    names = []

    def make(algorithm, lim, window_ms=WINDOW_MS, mode="shadow"):
        name = "t_shadow_%s" % uuid.uuid4().hex[:16]
        pg.execute("INSERT INTO rl_policy (name, algorithm, lim, window_ms, mode) "
                   "VALUES (%s, %s, %s, %s, %s)", (name, algorithm, lim, window_ms, mode))
        names.append(name)
        return name

    yield make
    if names:
        pg.execute("DELETE FROM rl_policy WHERE name = ANY(%s)", (names,))


def check(conn, policy, identity, cost=1):
    """rl_check's (allowed, lim, remaining, reset_ms, retry_after_ms)."""
    return conn.execute("SELECT (r).* FROM rl_check(%s, %s, %s) r",
                        (policy, identity, cost)).fetchone()


def units(redis, policy, identity, lim=3):
    """The units the fixed window of policy holds for identity in Redis."""
    return fixed_units(redis.command("GET", rl_key("fixed", identity, policy, lim, WINDOW_MS)))


def counts(conn, policy):
    """(allowed, denied, units_taken, shadow_denied) of policy's stats row."""
    row = stats_row(conn, policy)
    return row["allowed"], row["denied"], row["units_taken"], row["shadow_denied"]


def test_shadow_allows_what_enforcing_denies_and_charges_the_same(session, policy, redis, ident):
    """A shadow fixed window of lim 3: 5 calls -> 5 allowed, 2 counted as
    shadow_denied, the numbers and the Redis state those of an enforcing
    twin (which denies 2)."""
    conn = session()
    shadow, twin = policy("fixed", 3), policy("fixed", 3, mode="enforce")
    got = [check(conn, shadow, ident) for _ in range(5)]
    want = [check(conn, twin, ident) for _ in range(5)]
    assert [r[0] for r in got] == [True] * 5
    assert [r[0] for r in want] == [True, True, True, False, False]
    assert [r[1:] for r in got] == [r[1:] for r in want]
    assert got[4][4] > 0
    assert counts(conn, shadow) == (5, 0, 3, 2)
    assert counts(conn, twin) == (3, 2, 3, 0)
    assert units(redis, shadow, ident) == units(redis, twin, ident) == "3"
    assert conn.execute("SELECT rl_allow(%s, %s)", (shadow, ident)).fetchone()[0] is True
    assert counts(conn, shadow) == (6, 0, 3, 3)


def test_headers_and_metrics_say_what_enforcing_would(session, policy, ident):
    """rl_headers of a shadow policy's would-be denial carries Retry-After as
    enforcing's denial does; rl_redis_metrics() has
    rl_redis_shadow_denied_total."""
    conn = session()
    shadow, twin = policy("fixed", 1), policy("fixed", 1, mode="enforce")
    for p in (shadow, twin):
        check(conn, p, ident)
    h_shadow = conn.execute("SELECT r.allowed, rl_headers(r, %s)::text FROM rl_check(%s, %s) r",
                            (shadow, shadow, ident)).fetchone()
    h_twin = conn.execute("SELECT r.allowed, rl_headers(r, %s)::text FROM rl_check(%s, %s) r",
                          (twin, twin, ident)).fetchone()
    assert h_shadow[0] is True and h_twin[0] is False
    assert '"Retry-After"' in h_twin[1]
    assert h_shadow[1].replace(shadow, "P") == h_twin[1].replace(twin, "P")
    text = conn.execute("SELECT rl_redis_metrics()").fetchone()[0]
    assert "# TYPE rl_redis_shadow_denied_total counter" in text
    line = [l for l in text.splitlines()
            if l.startswith("rl_redis_shadow_denied_total") and 'policy="%s"' % shadow in l]
    assert len(line) == 1 and line[0].endswith("} 1")


def test_check_all_shadow_does_not_stop_the_others(session, policy, redis, ident):
    """rl_check_all over a shadow policy of lim 2 and an enforcing one of lim
    3: the shadow policy's would-be denials stop nothing (the enforcing one
    is charged, the shadow one not, as enforcing would not charge it); an
    enforcing denial denies the call and charges neither."""
    conn = session()
    shadow, enforce = policy("fixed", 2), policy("fixed", 3, mode="enforce")
    rows = [conn.execute("SELECT (r).* FROM rl_check_all(ARRAY[%s, %s], %s) r",
                         (shadow, enforce, ident)).fetchone() for _ in range(4)]
    assert [r[0] for r in rows] == [True, True, True, False]
    # the third: the shadow policy is the most restrictive, as enforcing
    assert rows[2][1:3] == (2, 0) and rows[2][4] > 0
    assert units(redis, shadow, ident, 2) == "2"
    assert units(redis, enforce, ident) == "3"
    assert counts(conn, shadow) == (3, 1, 2, 2)
    assert counts(conn, enforce) == (3, 1, 3, 0)
    assert conn.execute("SELECT rl_allow_all(ARRAY[%s], %s)", (shadow, ident)).fetchone()[0] is True
    assert units(redis, shadow, ident, 2) == "2"


def test_check_many(session, policy, redis):
    """rl_check_many of a shadow lim 1 policy: every row allowed, the
    repeated identity's second a shadow denial that takes nothing."""
    conn = session()
    shadow = policy("fixed", 1)
    a, b = new_ident("a"), new_ident("b")
    rows = conn.execute("SELECT identity, allowed, remaining, retry_after_ms > 0 "
                        "FROM rl_check_many(%s, ARRAY[%s, %s, %s])", (shadow, a, a, b)).fetchall()
    assert rows == [(a, True, 0, False), (a, True, 0, True), (b, True, 0, False)]
    assert units(redis, shadow, a, 1) == "1" and units(redis, shadow, b, 1) == "1"
    assert counts(conn, shadow) == (3, 0, 2, 1)


def test_acquire_holds_no_slot_on_a_shadow_denial(session, policy, redis, ident):
    """A shadow concurrency policy of 1 slot: a second acquire in the same
    transaction is allowed and holds no slot (one member in Redis, one
    release)."""
    conn = session()
    shadow = policy("concurrency", 1)
    key = rl_key("concurrency", ident, shadow, 1, WINDOW_MS)
    with conn.transaction():
        assert conn.execute("SELECT rl_acquire_allow(%s, %s)", (shadow, ident)).fetchone()[0] is True
        r = conn.execute("SELECT (r).* FROM rl_acquire(%s, %s) r", (shadow, ident)).fetchone()
        assert r[0] is True and r[2] == 0
        assert redis.command("ZCARD", key) == 1
        assert conn.execute("SELECT rl_release(%s, %s)", (shadow, ident)).fetchone()[0] is True
        assert conn.execute("SELECT rl_release(%s, %s)", (shadow, ident)).fetchone()[0] is False
    assert counts(conn, shadow)[3] == 1


def test_guards(session, policy, redis, pg):
    """A row guard and a statement guard on a shadow lim 2 policy let every
    row in; the window holds 2 units, 2 rows are counted as shadow denials."""
    conn = session()
    table = "t_shadow_%s" % uuid.uuid4().hex[:12]
    row_p, stmt_p = policy("fixed", 2), policy("fixed", 2)
    pg.execute("CREATE TABLE %s (tenant text)" % table)
    pg.execute("CREATE TABLE %s_s (tenant text, n int)" % table)
    try:
        pg.execute("CREATE TRIGGER g AFTER INSERT ON %s FOR EACH ROW "
                   "EXECUTE FUNCTION rl_guard('%s', 'tenant')" % (table, row_p))
        pg.execute("CREATE TRIGGER g AFTER INSERT ON %s_s REFERENCING NEW TABLE AS new_rows "
                   "FOR EACH STATEMENT EXECUTE FUNCTION rl_guard_statement('%s', 'tenant', 'n')"
                   % (table, stmt_p))
        for _ in range(4):
            conn.execute("INSERT INTO %s VALUES ('acme')" % table)
        conn.execute("INSERT INTO %s_s VALUES ('acme', 2)" % table)
        conn.execute("INSERT INTO %s_s VALUES ('acme', 1), ('acme', 1)" % table)
        assert conn.execute("SELECT count(*) FROM %s" % table).fetchone()[0] == 4
        assert conn.execute("SELECT count(*) FROM %s_s" % table).fetchone()[0] == 3
        assert units(redis, row_p, "acme", 2) == "2"
        assert units(redis, stmt_p, "acme", 2) == "2"
        assert counts(conn, row_p) == (4, 0, 2, 2)
        assert counts(conn, stmt_p)[3] == 1
    finally:
        pg.execute("DROP TABLE %s, %s_s" % (table, table))


# on a server of its own: a denial the cache answers is counted as denied
# without a round trip, which test_stats' invariant (round trips = the
# calls Redis answered) would see in this database's rows
@pytest.mark.usefixtures("on_private_server")
def test_deny_cache_never_denies_a_shadow_policy(session, policy, pg, ident):
    """With rl_redis.deny_cache on, a denial remembered while the policy
    enforced does not deny it once it is in shadow, nor do its own."""
    conn = session(deny_cache="on")
    p = policy("fixed", 1, mode="enforce")
    assert [check(conn, p, ident)[0] for _ in range(3)] == [True, False, False]
    a, d = counts(conn, p)[:2]
    pg.execute("UPDATE rl_policy SET mode = 'shadow' WHERE name = %s", (p,))
    assert [check(conn, p, ident)[0] for _ in range(3)] == [True, True, True]
    assert counts(conn, p) == (a + 3, d, 1, 3)


def test_track_denials(session, policy, ident):
    """With rl_redis.track_denials on, a shadow policy's would-be denials are
    counted in rl_top_denied as denials of the identity."""
    conn = session(track_denials="on", test_clock_ms=0)
    shadow = policy("token_bucket", 1, 3600000)
    assert [check(conn, shadow, ident)[0] for _ in range(3)] == [True] * 3
    assert conn.execute("SELECT identity, denials FROM rl_top_denied(%s, '1 hour', 5)",
                        (shadow,)).fetchall() == [(ident, 2)]


def test_mode_switch_takes_effect_at_once_in_other_sessions(session, policy, pg, ident):
    """UPDATE rl_policy SET mode commits, and the other session's next call
    follows it, both ways."""
    a = session()
    p = policy("fixed", 1, mode="enforce")
    assert [check(a, p, ident)[0] for _ in range(2)] == [True, False]
    pg.execute("UPDATE rl_policy SET mode = 'shadow' WHERE name = %s", (p,))
    assert check(a, p, ident)[0] is True
    pg.execute("UPDATE rl_policy SET mode = 'enforce' WHERE name = %s", (p,))
    assert check(a, p, ident)[0] is False
    assert counts(a, p) == (2, 2, 1, 1)


def test_mode_is_checked(pg):
    """Only 'enforce' and 'shadow': the named constraint says no to others."""
    with pytest.raises(psycopg.errors.CheckViolation) as e:
        pg.execute("INSERT INTO rl_policy (name, algorithm, lim, window_ms, mode) "
                   "VALUES ('t_shadow_bad', 'fixed', 1, 1000, 'dry-run')")
    assert e.value.diag.constraint_name == "rl_policy_mode_known"
    assert pg.execute("SELECT mode FROM rl_policy WHERE false").description[0].name == "mode"


def test_a_1_5_schema_works_with_the_new_library(pg, redis):
    """rl_redis 1.5 (no rl_policy.mode, 18 statistics columns) keeps working
    with this library until ALTER EXTENSION UPDATE, which adds both."""
    db = "t_shadow_%s" % uuid.uuid4().hex[:12]
    pg.execute("CREATE DATABASE %s" % db)
    try:
        with pg_connect(dbname=db) as conn:
            conn.autocommit = True
            conn.execute("CREATE EXTENSION rl_redis VERSION '1.5'")
            use_redis(conn, redis, test_clock_ms=TEST_CLOCK_MS)
            conn.execute("INSERT INTO rl_policy (name, algorithm, lim, window_ms) "
                         "VALUES ('p', 'fixed', 1, 60000)")
            assert [check(conn, "p", "x")[0] for _ in range(2)] == [True, False]
            row = stats_row(conn, "p")
            assert (row["allowed"], row["denied"]) == (1, 1) and "shadow_denied" not in row
            conn.execute("ALTER EXTENSION rl_redis UPDATE TO '1.6'")
            conn.execute("UPDATE rl_policy SET mode = 'shadow'")
            assert check(conn, "p", "x")[0] is True
            assert counts(conn, "p") == (2, 1, 1, 1)
    finally:
        pg.execute("DROP DATABASE %s" % db)


def test_check_all_denial_waits_for_the_enforcing_limits_only(session, policy, ident):
    """rl_check_all over an enforcing fixed window of 1 a minute and a shadow
    one of 1 an hour: the second call is denied by the enforcing policy, and
    its numbers (retry_after_ms above all, which Retry-After carries) are
    the enforcing policy's alone, as without the shadow policy: a shadow
    policy stops nothing, so it must not make a client wait an hour."""
    conn = session()
    enforce, shadow = policy("fixed", 1, mode="enforce"), policy("fixed", 1, 3600000)
    twin = new_ident("twin")

    def check_all(names, identity):
        return conn.execute("SELECT (r).* FROM rl_check_all(%s, %s) r",
                            (names, identity)).fetchone()

    got = [check_all([enforce, shadow], ident) for _ in range(2)]
    want = [check_all([enforce], twin) for _ in range(2)]
    assert got[1] == want[1] == (False, 1, 0, WINDOW_MS, WINDOW_MS)


def test_on_error_deny_does_not_deny_a_shadow_policy(pg, policy, ident):
    """Redis refusing connections and rl_redis.on_error = deny: every path
    allows a shadow policy's call (counted in fallback_allow and
    shadow_denied), and rl_check_all denies only when one of its policies
    enforces. A shadow policy must never deny."""
    conn = pg_connect()
    try:
        set_gucs(conn, host="127.0.0.1", port=dead_port(), retry_interval=0, on_error="deny",
                 test_clock_ms=TEST_CLOCK_MS)
        shadow, enforce, slots = policy("fixed", 3), policy("fixed", 3, mode="enforce"), policy("concurrency", 1)
        assert check(conn, shadow, ident)[0] is True
        assert conn.execute("SELECT rl_allow(%s, %s)", (shadow, ident)).fetchone()[0] is True
        assert conn.execute("SELECT array_agg(allowed) FROM rl_check_many(%s, ARRAY[%s, %s])",
                            (shadow, ident, "other")).fetchone()[0] == [True, True]
        assert conn.execute("SELECT rl_allow_all(ARRAY[%s], %s)", (shadow, ident)).fetchone()[0] is True
        assert conn.execute("SELECT rl_allow_all(ARRAY[%s, %s], %s)", (shadow, enforce, ident)).fetchone()[0] \
            is False
        assert check(conn, enforce, ident)[0] is False
        with conn.transaction():
            assert conn.execute("SELECT rl_acquire_allow(%s, %s)", (slots, ident)).fetchone()[0] is True
        # the call of both policies, which on_error denied, counts on the
        # shadow policy's row too, as a denial by another policy does
        row = stats_row(conn, shadow)
        assert (row["fallback_allow"], row["fallback_deny"], row["shadow_denied"]) == (5, 1, 5), row
        row = stats_row(conn, slots)
        assert (row["fallback_allow"], row["fallback_deny"], row["shadow_denied"]) == (1, 0, 1), row
    finally:
        conn.close()
