"""The one entry point of every decision (src/engine.c:rl_decide, issue 19).

Every SQL function that charges an identity (explicit limits, policies,
several limits, batches, guards, refunds) hands its charges to rl_decide,
which checks them, makes their keys and applies rl_redis.on_error. These
tests pin what only a shared entry point gives: every path answers alike
when Redis cannot decide, and a limit is checked against the settings in
force at the call, not when a policy was first read.
"""

import uuid

import pytest
from psycopg import sql

from conftest import free_port, new_ident, set_gucs


def uid():
    return uuid.uuid4().hex[:12]


@pytest.fixture
def policy(pg):
    """Makes rl_policy rows with unique names; deletes them afterwards."""
    names = []

    def make(algorithm, lim, window_ms, burst=None):
        name = "pytest.decide.%s" % uid()
        pg.execute("INSERT INTO rl_policy (name, algorithm, lim, window_ms, burst) "
                   "VALUES (%s, %s, %s, %s, %s)", (name, algorithm, lim, window_ms, burst))
        names.append(name)
        return name

    yield make
    pg.execute("DELETE FROM rl_policy WHERE name = ANY(%s)", (names,))


RESULT = "SELECT r.allowed, r.lim, r.remaining, r.reset_ms, r.retry_after_ms FROM %s AS r"


@pytest.mark.parametrize("on_error,expected", [
    ("allow", (True, 20, 17, 0, 0)),
    ("deny", (False, 20, 0, 0, 1000)),
])
def test_on_error_answers_alike_on_every_path(pg, policy, on_error, expected):
    """Redis unreachable: a token bucket of rate 10 and burst 20, cost 3,
    gets the same fallback answer whichever function asks: lim is the
    bucket's capacity, as Redis would have said, and remaining counts the
    cost. Up to 1.5 rl_check_all answered lim 10, remaining 7 (its first
    policy's rate), and a statement guard counted no cost."""
    bucket = policy("token_bucket", 10, 60000, 20)
    me = new_ident("decide_fallback")
    set_gucs(pg, host="127.0.0.1", port=free_port(), on_error=on_error,
             retry_interval=0, connect_timeout=500)
    pg.execute("SET client_min_messages = error")
    paths = {
        "explicit": (RESULT % "rl_token_bucket(%s, 10, 60000, 3, 20)", (me,)),
        "policy": (RESULT % "rl_check(%s, %s, 3)", (bucket, me)),
        "several limits": (RESULT % "rl_check_all(ARRAY[%s], %s, 3)", (bucket, me)),
        "batch": ("SELECT allowed, lim, remaining, reset_ms, retry_after_ms "
                  "FROM rl_check_many(%s, ARRAY[%s], 3)", (bucket, me)),
        "explicit batch": ("SELECT allowed, lim, remaining, reset_ms, retry_after_ms "
                           "FROM rl_token_bucket_many(ARRAY[%s], 10, 60000, 3, 20)", (me,)),
    }
    got = {path: pg.execute(query, params).fetchone() for path, (query, params) in paths.items()}
    assert got == {path: expected for path in paths}


def test_a_lowered_sliding_max_lim_holds_for_a_policy_already_read(pg, policy):
    """rl_redis.sliding_max_lim bounds a sliding log's lim at every call.
    Up to 1.5 a policy was checked when the session first read it, and a
    bound lowered afterwards (a reload of postgresql.conf, here SET) let the
    session go on charging the larger log."""
    big = policy("sliding", 15000, 60000)
    me = new_ident("decide_maxlim")
    set_gucs(pg, sliding_max_lim=20000)
    assert pg.execute("SELECT rl_allow(%s, %s)", (big, me)).fetchone()[0] is True
    set_gucs(pg, sliding_max_lim=10000)
    for query, params in [
        ("SELECT rl_allow(%s, %s)", (big, me)),
        ("SELECT rl_refund(%s, %s)", (big, me)),
        ("SELECT rl_check_all(ARRAY[%s], %s)", (big, me)),
        ("SELECT * FROM rl_check_many(%s, ARRAY[%s])", (big, me)),
    ]:
        with pytest.raises(Exception) as err:
            pg.execute(query, params)
        assert err.value.sqlstate == "22023", query
        assert "lim of a sliding window log must be at most 10000" in str(err.value)


def test_a_lowered_sliding_max_lim_holds_for_a_guard_already_set_up(pg):
    """The same for a row guard's explicit limit (read when the guard is
    set up): the next write is refused under the lowered bound."""
    table = "decide_guard_%s" % uid()
    pg.execute(sql.SQL("CREATE TABLE {} (tenant text)").format(sql.Identifier(table)))
    try:
        # CREATE TRIGGER checks the limit under the bound of its session too
        set_gucs(pg, sliding_max_lim=20000)
        pg.execute(sql.SQL("CREATE TRIGGER g AFTER INSERT ON {} FOR EACH ROW "
                           "EXECUTE FUNCTION rl_guard('sliding:15000/60000', 'tenant')")
                   .format(sql.Identifier(table)))
        tenant = new_ident("decide_guard")
        pg.execute(sql.SQL("INSERT INTO {} VALUES (%s)").format(sql.Identifier(table)), (tenant,))
        set_gucs(pg, sliding_max_lim=10000)
        with pytest.raises(Exception) as err:
            pg.execute(sql.SQL("INSERT INTO {} VALUES (%s)").format(sql.Identifier(table)), (tenant,))
        assert err.value.sqlstate == "22023"
    finally:
        pg.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(table)))
