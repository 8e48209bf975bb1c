"""Batch decisions (1.5): rl_check_many(policy, identities, cost) and
rl_<algorithm>_many(identities, lim, window_ms, cost [, burst]).

One limit decided for many identities, each on its own (not all or
nothing), one row per array element in the array's order; the same
identity twice is decided twice, in order. The keys are those of rl_check
and rl_<algorithm>, so a batch and a single call share one counter. Redis
sees script calls of at most 500 keys (per cluster slot in cluster mode),
all pipelined on one connection per node.

Covered: equality with one-by-one calls for every algorithm (burst, cost 0,
cost above the limit, time moving on), order and duplicates over several
500-key calls, the counter shared with rl_check both ways, argument errors
and privileges, exact limits under 8 concurrent sessions, refunds on abort,
rl_redis.on_error with a dead Redis, a key Redis cannot decide (only its
row falls back), a hung Redis (command_timeout and pg_cancel_backend),
command_timeout bounding each wait of a long batch, FUNCTION FLUSH between batches, Redis Cluster (2 000
identities on 3 masters, one connection per master), rl_redis_stats and
rl_redis.track_denials.

Regressions of the 1.5 review: FUNCTION FLUSH (SCRIPT FLUSH then) before a
batch of 200 000 identities under on_error = 'deny' (every call that found
no function goes again in one
more pipeline: all allowed, at most one WARNING); the backend's peak memory
(VmHWM from /proc) over a batch of 1 000 000 identities (< 150 MB more:
pipeline rounds of about 10 000 keys); track_denials over 200 000 copies
of one denied identity (counted per distinct identity: no command holds
Redis 50 ms, by its slow log; rl_top_denied shows 200 000).

Single-session tests freeze time with rl_redis.test_clock_ms (superuser
sessions); the concurrent test freezes it in every session too, so that
every count is exact. Tests that break or inspect a Redis get their own
redis-server (redis_factory); the others use the shared one.
"""

import re
import random
import threading
import time
import uuid

import psycopg
import psycopg.errors
import pytest
from psycopg import sql

from conftest import (fixed_units, QueryThread, backend_tcp_ports, client_ports, free_port, new_ident, pg_connect, rl_key,
                      set_gucs, use_redis, vm_hwm_kb)
from test_faults import wait_until_active
from test_stats import stats_row
from redis_topology import identity_slot, made_policies, redis_cluster  # noqa: F401

TEST_CLOCK_MS = 1800000000000  # a frozen clock on a whole minute (2027-01-15)
ALGORITHMS = ["fixed", "sliding", "token_bucket", "gcra", "sliding_counter"]
BURST_ALGORITHMS = ("token_bucket", "gcra")
BATCH_KEYS = 500  # the most keys of one script call
COLS = "identity, allowed, lim, remaining, reset_ms, retry_after_ms"
DENY_RETRY_MS = 1000  # retry_after_ms of an on_error = 'deny' row


# ---------------------------------------------------------------- helpers


def many(conn, algorithm, identities, lim, window_ms, cost=1, burst=None):
    """rl_<algorithm>_many(...) as a list of (identity, allowed, lim,
    remaining, reset_ms, retry_after_ms); burst only when given."""
    if burst is None:
        query = "SELECT %s FROM rl_%s_many(%%s::text[], %%s, %%s, %%s)" % (COLS, algorithm)
        params = (identities, lim, window_ms, cost)
    else:
        query = "SELECT %s FROM rl_%s_many(%%s::text[], %%s, %%s, %%s, %%s)" % (COLS, algorithm)
        params = (identities, lim, window_ms, cost, burst)
    return conn.execute(query, params).fetchall()


def one(conn, algorithm, identity, lim, window_ms, cost=1, burst=None):
    """rl_<algorithm>(...) as a row like those of many()."""
    args = "%s, %s, %s, %s" + (", %s" if burst is not None else "")
    params = (identity, lim, window_ms, cost) + ((burst,) if burst is not None else ())
    row = conn.execute(
        "SELECT (r).allowed, (r).lim, (r).remaining, (r).reset_ms, (r).retry_after_ms "
        "FROM rl_%s(%s) AS r" % (algorithm, args), params).fetchone()
    return (identity,) + tuple(row)


def check_many(conn, policy, identities, cost=1):
    return conn.execute("SELECT %s FROM rl_check_many(%%s, %%s::text[], %%s)" % COLS,
                        (policy, identities, cost)).fetchall()


def check(conn, policy, identity, cost=1):
    """rl_check(...) as a row like those of check_many()."""
    row = conn.execute(
        "SELECT (r).allowed, (r).lim, (r).remaining, (r).reset_ms, (r).retry_after_ms "
        "FROM rl_check(%s, %s, %s) AS r", (policy, identity, cost)).fetchone()
    return (identity,) + tuple(row)


def sqlstate_of(conn, query, params=None):
    """The SQLSTATE query raises (fails the test when it raises nothing)."""
    with pytest.raises(psycopg.Error) as excinfo:
        conn.execute(query, params).fetchall()
    return excinfo.value.sqlstate


def renamed(rows, names):
    """rows with the identity column replaced through the dict names."""
    return [(names[r[0]],) + tuple(r[1:]) for r in rows]


def expected_counts(identities, lim, cost=1):
    """(allowed, remaining) of each element of a batch of fresh identities on
    a limit that does not refill: each identity's first lim // cost
    occurrences are allowed."""
    used = {}
    out = []
    for i in identities:
        n = used.get(i, 0)
        if (n + 1) * cost <= lim:
            used[i] = n + 1
            out.append((True, lim - (n + 1) * cost))
        else:
            out.append((False, lim - n * cost))
    return out


def with_repeats(base, distinct, copies, seed):
    """distinct fresh identities, each `copies` times, shuffled (a fixed
    seed): returns the list."""
    idents = ["%s:%d" % (base, i) for i in range(distinct)]
    out = [i for i in idents for _ in range(copies)]
    random.Random(seed).shuffle(out)
    return out


class Notice:
    """A notice's fields, copied out of psycopg's handler."""

    def __init__(self, diag):
        self.severity = diag.severity_nonlocalized
        self.sqlstate = diag.sqlstate
        self.message = diag.message_primary
        self.detail = diag.message_detail or ""
        self.context = diag.context

    def __repr__(self):
        return "Notice(%s %s %r)" % (self.severity, self.sqlstate, self.message)


def collect_warnings(conn):
    """A list that fills with the connection's WARNING notices."""
    notices = []
    conn.add_notice_handler(lambda d: notices.append(Notice(d)))

    class View:
        def __call__(self):
            return [n for n in notices if n.severity == "WARNING"]

        def clear(self):
            del notices[:]

    return View()


def script_calls_seen(server):
    """The numkeys of every script call (EVAL, FCALL) in server's slow log,
    oldest first, with the client address of each (needs
    slowlog-log-slower-than 0)."""
    out = []
    for entry in reversed(server.command("SLOWLOG", "GET", "100000")):
        args = entry[3]
        if args and args[0].lower() in ("eval", "evalsha", "fcall"):
            out.append((int(args[2]), entry[4]))
    return out


def info_field(server, section, field):
    for line in server.command("INFO", section).splitlines():
        if line.startswith(field + ":"):
            return line.split(":", 1)[1].strip()
    return None


def library_loads(server):
    """How many times the server ran FUNCTION LOAD (INFO commandstats)."""
    stats = info_field(server, "commandstats", "cmdstat_function|load")
    return int(stats.split("calls=", 1)[1].split(",", 1)[0]) if stats else 0


def clients_from(node, ports):
    """The CLIENT LIST fields of a Redis node's clients that are connections
    of ports (backend_tcp_ports)."""
    return [f for client, server, f in client_ports(node) if (client, server) in ports]


@pytest.fixture
def policies(pg):
    """policies(algorithm, lim, window_ms, burst=None) -> a new policy's name;
    deleted at teardown."""
    yield from made_policies(pg, "t_batch")


@pytest.fixture
def clock(pg):
    """The pg session on the frozen test clock, without circuit breaker."""
    set_gucs(pg, test_clock_ms=TEST_CLOCK_MS, retry_interval=0)
    return pg


@pytest.fixture
def role(pg):
    """A new LOGIN role without any grant; dropped at teardown."""
    name = "rl_batch_%s" % uuid.uuid4().hex[:12]
    pg.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(name)))
    yield name
    pg.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(name)))


# ------------------------------------------------- same as one at a time


LIMITS = [(a, None) for a in ALGORITHMS] + [(a, 8) for a in BURST_ALGORITHMS]


@pytest.mark.parametrize("algorithm, burst", LIMITS,
                         ids=["%s-burst%s" % (a, b) for a, b in LIMITS])
def test_same_rows_as_one_at_a_time(clock, algorithm, burst):
    """Batches with duplicates, cost 1, 2, 0, above the limit (and between
    lim and burst), then with time moving on: every row equals the row of
    rl_<algorithm> called one identity at a time, in order, on other fresh
    identities. Then a single call continues a batch's counter and a batch
    a single call's (the keys are the same)."""
    conn = clock
    lim, window = 5, 60000
    batch_ids = {k: new_ident("b%s" % k) for k in "abcd"}
    single_ids = {k: new_ident("s%s" % k) for k in "abcd"}
    to_single = {batch_ids[k]: single_ids[k] for k in "abcd"}
    steps = [
        (0, 1, "abaacbaaacaaa"),   # a 9 times: above lim and burst
        (0, 2, "bcbba"),
        (0, 0, "abca"),
        (0, 9, "abc"),             # above lim and burst: never (-1)
        (0, 7, "dad"),             # above lim, within burst 8
        (window // 2, 1, "abcdab"),
        (window // 2, 0, "dcba"),
        (window + 1, 1, "aabcd"),
        (window + 1, 0, "abcd"),
    ]
    got, want, at = [], [], []
    for offset, cost, keys in steps:
        at.append(len(want))
        set_gucs(conn, test_clock_ms=TEST_CLOCK_MS + offset)
        idents = [batch_ids[k] for k in keys]
        rows = many(conn, algorithm, idents, lim, window, cost, burst)
        assert [r[0] for r in rows] == idents
        got += renamed(rows, to_single)
        want += [one(conn, algorithm, single_ids[k], lim, window, cost, burst) for k in keys]
    assert got == want

    # the sequence does what it says
    cap = burst or lim
    assert [r[1] for r in want[:at[1]]] == [a for a, _ in expected_counts(list(steps[0][2]), cap)]
    assert False in [r[1] for r in want[:at[1]]]
    assert all(r[2] == cap for r in want)
    assert [r[5] for r in want[at[3]:at[4]]] == [-1, -1, -1]  # cost 9
    d1, d2 = want[at[4]], want[at[4] + 2]  # cost 7: within burst only
    assert (d1[1], d2[1]) == ((True, False) if burst else (False, False))

    # shared counters: a single call continues a batch's state, and a batch
    # a single call's (the state is not fresh: each was charged last step)
    for k in "abcd":
        assert (one(conn, algorithm, batch_ids[k], lim, window, 1, burst)[1:]
                == one(conn, algorithm, single_ids[k], lim, window, 1, burst)[1:]), k
        assert (many(conn, algorithm, [single_ids[k]], lim, window, 1, burst)[0][1:]
                == many(conn, algorithm, [batch_ids[k]], lim, window, 1, burst)[0][1:]), k
        fresh = one(conn, algorithm, new_ident("fresh"), lim, window, 0, burst)
        assert one(conn, algorithm, batch_ids[k], lim, window, 0, burst)[1:] != fresh[1:], k


def test_keys_are_those_of_single_calls(clock, shared_redis, policies):
    """rl_<algorithm>_many writes rl:<alg>:{id}:<lim>/<window>[/<burst>] and
    rl_check_many rl:<alg>:{id}:<policy>:<lim>/<window>, identities
    percent-encoded."""
    odd = new_ident("odd") + ":{x}%"
    ident = new_ident("key")
    many(clock, "fixed", [odd, ident], 5, 60000)
    many(clock, "token_bucket", [ident], 5, 60000, 1, 7)
    policy = policies("sliding", 5, 60000)
    check_many(clock, policy, [ident])
    for key in (rl_key("fixed", odd, lim=5, window_ms=60000),
                rl_key("fixed", ident, lim=5, window_ms=60000),
                rl_key("token_bucket", ident, lim=5, window_ms=60000, burst=7),
                rl_key("sliding", ident, policy=policy, lim=5, window_ms=60000)):
        assert shared_redis.command("EXISTS", key) == 1, key
    assert fixed_units(shared_redis.command("GET", rl_key("fixed", odd, lim=5, window_ms=60000))) == "1"


# ---------------------------------------------------- order, duplicates


def test_order_and_duplicates_over_several_calls(redis_factory):
    """1 200 elements (400 identities, 3 times each, shuffled) on lim 3 and
    then the same again: the rows come in the input order, the first batch
    allows everything, the second denies everything; Redis saw script calls
    of 500, 500 and 200 keys per batch, from one connection (which loaded
    the library before)."""
    r = redis_factory(extra_args=["--slowlog-log-slower-than", "0", "--slowlog-max-len", "100000"])
    conn = pg_connect()
    try:
        use_redis(conn, r, test_clock_ms=TEST_CLOCK_MS)
        assert many(conn, "fixed", [new_ident("warm")], 3, 60000)[0][1] is True
        idents = with_repeats(new_ident("order"), 400, 3, seed=1)
        assert len(idents) == 1200
        r.command("SLOWLOG", "RESET")
        rows = many(conn, "fixed", idents, 3, 60000)
        assert [row[0] for row in rows] == idents
        assert [(row[1], row[3]) for row in rows] == expected_counts(idents, 3)
        assert all(row[1] for row in rows)
        calls = script_calls_seen(r)
        assert [n for n, _ in calls] == [500, 500, 200]
        assert len({addr for _, addr in calls}) == 1

        again = list(reversed(idents)) + idents[:5]
        rows = many(conn, "fixed", again, 3, 60000)
        assert [row[0] for row in rows] == again
        assert [(row[1], row[3]) for row in rows] == [(False, 0)] * len(again)
        assert [n for n, _ in script_calls_seen(r)][3:] == [500, 500, 205]
        for ident in set(idents):
            assert fixed_units(r.command("GET", rl_key("fixed", ident, lim=3, window_ms=60000))) == "3"
    finally:
        conn.close()


def test_mixed_counts_in_order(clock):
    """1 500 elements over 300 identities that appear 1 to 9 times (lim 4,
    cost 1), then cost 2 on the same: every row exact, in order."""
    rnd = random.Random(7)
    base = new_ident("mixed")
    idents = []
    for i in range(300):
        idents += ["%s:%d" % (base, i)] * rnd.randint(1, 9)
    rnd.shuffle(idents)
    rows = many(clock, "sliding_counter", idents, 4, 60000)
    assert [r[0] for r in rows] == idents
    assert [(r[1], r[3]) for r in rows] == expected_counts(idents, 4)
    # cost 2 on what is left: allowed only where 2 units remain
    left = {}
    for r in rows:
        left[r[0]] = r[3]
    sample = idents[:700]
    rows = many(clock, "sliding_counter", sample, 4, 60000, 2)
    want = []
    for i in sample:
        if left[i] >= 2:
            left[i] -= 2
            want.append((i, True, left[i]))
        else:
            want.append((i, False, left[i]))
    assert [(r[0], r[1], r[3]) for r in rows] == want


# ------------------------------------------------------- with rl_check


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_shares_the_counter_with_rl_check(clock, policies, algorithm):
    """rl_check then rl_check_many on one identity, and rl_check_many then
    rl_check on another, give exactly the rows of rl_check alone."""
    burst = 6 if algorithm in BURST_ALGORITHMS else None
    policy = policies(algorithm, 4, 60000, burst)
    ref, x, y = new_ident("ref"), new_ident("x"), new_ident("y")
    want = [check(clock, policy, ref) for _ in range(8)]
    cap = burst or 4
    assert [w[1] for w in want] == [True] * cap + [False] * (8 - cap)

    got_x = [check(clock, policy, x), check(clock, policy, x)]
    got_x += check_many(clock, policy, [x] * 5)
    got_x.append(check(clock, policy, x))
    assert renamed(got_x, {x: ref}) == want

    got_y = check_many(clock, policy, [y, y, y])
    got_y += [check(clock, policy, y) for _ in range(4)]
    got_y += check_many(clock, policy, [y])
    assert renamed(got_y, {y: ref}) == want
    # a peek of either form sees the same state
    assert check_many(clock, policy, [x, y], 0) == [check(clock, policy, x, 0), check(clock, policy, y, 0)]


# ------------------------------------------------------ errors, privileges


def test_argument_errors(clock, policies):
    policy = policies("fixed", 3, 60000)
    conc = policies("concurrency", 2, 60000)
    ok = new_ident("ok")
    cases = [
        ("SELECT * FROM rl_check_many(%s, ARRAY[%s])", (conc, ok), "22023"),
        ("SELECT * FROM rl_check_many(%s, NULL)", (policy,), "22004"),
        ("SELECT * FROM rl_check_many(%s, NULL::text[])", (policy,), "22004"),
        ("SELECT * FROM rl_check_many(%s, ARRAY[%s, NULL])", (policy, ok), "22004"),
        ("SELECT * FROM rl_check_many(%s, ARRAY[%s, ''])", (policy, ok), "22023"),
        ("SELECT * FROM rl_check_many(%s, ARRAY[%s], -1)", (policy, ok), "22023"),
        ("SELECT * FROM rl_check_many(%s, ARRAY[%s], NULL)", (policy, ok), "22004"),
        ("SELECT * FROM rl_check_many(NULL, ARRAY[%s])", (ok,), "22004"),
        ("SELECT * FROM rl_check_many('', ARRAY[%s])", (ok,), "22023"),
        ("SELECT * FROM rl_fixed_many(ARRAY[%s], 0, 60000)", (ok,), "22023"),
        ("SELECT * FROM rl_fixed_many(ARRAY[%s], 3, 0)", (ok,), "22023"),
        ("SELECT * FROM rl_fixed_many(ARRAY[%s], NULL, 60000)", (ok,), "22004"),
        ("SELECT * FROM rl_fixed_many(ARRAY[%s], 3, NULL)", (ok,), "22004"),
        ("SELECT * FROM rl_fixed_many(ARRAY[%s], 3, 60000, -1)", (ok,), "22023"),
        ("SELECT * FROM rl_fixed_many(ARRAY[%s], 3, 60000, NULL)", (ok,), "22004"),
        ("SELECT * FROM rl_fixed_many(NULL, 3, 60000)", (), "22004"),
        ("SELECT * FROM rl_fixed_many(ARRAY[%s, ''], 3, 60000)", (ok,), "22023"),
        ("SELECT * FROM rl_sliding_many(ARRAY[%s], 10001, 60000)", (ok,), "22023"),
        ("SELECT * FROM rl_token_bucket_many(ARRAY[%s], 3, 60000, 1, 0)", (ok,), "22023"),
        ("SELECT * FROM rl_gcra_many(ARRAY[%s], 3, 60000, 1, -2)", (ok,), "22023"),
        ("SELECT * FROM rl_gcra_many(ARRAY[%s], 1, 3153600000000, 1, 2)", (ok,), "22023"),
    ]
    for query, params, state in cases:
        assert sqlstate_of(clock, query, params) == state, query
    # the argument errors come before anything is written
    assert check(clock, policy, ok, 0)[3] == 3
    assert one(clock, "fixed", ok, 3, 60000, 0)[3] == 3


def test_unknown_policy_same_error_as_rl_check(clock):
    name = "nope.%s" % uuid.uuid4().hex[:8]
    with pytest.raises(psycopg.Error) as single:
        clock.execute("SELECT rl_check(%s, 'x')", (name,))
    with pytest.raises(psycopg.Error) as batch:
        clock.execute("SELECT * FROM rl_check_many(%s, ARRAY['x'])", (name,))
    assert single.value.sqlstate == batch.value.sqlstate == "42704"
    assert batch.value.diag.message_primary == single.value.diag.message_primary


def test_empty_array_gives_no_rows(clock, policies):
    policy = policies("fixed", 3, 60000)
    assert check_many(clock, policy, []) == []
    assert clock.execute("SELECT count(*) FROM rl_check_many(%s, '{}')", (policy,)).fetchone()[0] == 0
    for algorithm in ALGORITHMS:
        assert many(clock, algorithm, [], 3, 60000) == []
    assert many(clock, "gcra", [], 3, 60000, 1, 5) == []


def test_privileges(pg, policies, role):
    """rl_check_many runs for any role; the explicit forms are refused
    (42501) to an ordinary role and granted neither to PUBLIC."""
    policy = policies("fixed", 2, 3153600000000)
    ident = new_ident("priv")
    with pg_connect(user=role) as conn:
        rows = check_many(conn, policy, [ident, ident, ident])
        assert [(r[0], r[1], r[3]) for r in rows] == [(ident, True, 1), (ident, True, 0), (ident, False, 0)]
        for algorithm in ALGORITHMS:
            assert sqlstate_of(conn, "SELECT * FROM rl_%s_many(ARRAY[%%s], 3, 60000)" % algorithm,
                               (ident,)) == "42501", algorithm
        for algorithm in BURST_ALGORITHMS:
            assert sqlstate_of(conn, "SELECT * FROM rl_%s_many(ARRAY[%%s], 3, 60000, 1, 5)" % algorithm,
                               (ident,)) == "42501", algorithm
    for algorithm in ALGORITHMS:
        # the window as a bigint, an interval and a text
        can = pg.execute("SELECT has_function_privilege('public', p.oid, 'EXECUTE') "
                         "FROM pg_proc p WHERE proname = %s", ("rl_%s_many" % algorithm,)).fetchall()
        assert can == [(False,)] * 3, algorithm
    can = pg.execute("SELECT has_function_privilege('public', p.oid, 'EXECUTE') "
                     "FROM pg_proc p WHERE proname = 'rl_check_many'").fetchall()
    assert can == [(True,)]


# ------------------------------------------------------------ concurrency


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_exact_limits_under_8_sessions(pg, policies, algorithm):
    """8 sessions, each 6 rounds of rl_check_many on the same 50 identities
    (each session its own order, every element twice), lim 20: exactly 20
    allowed per identity in all, and a remaining of 0 afterwards."""
    sessions, rounds, lim = 8, 6, 20
    policy = policies(algorithm, lim, 3600000)
    base = new_ident("conc")
    idents = ["%s:%d" % (base, i) for i in range(50)]
    conns = [pg_connect() for _ in range(sessions)]
    for c in conns:
        set_gucs(c, test_clock_ms=TEST_CLOCK_MS, retry_interval=0)
    allowed = [dict.fromkeys(idents, 0) for _ in range(sessions)]
    barrier = threading.Barrier(sessions)
    errors = []

    def worker(s):
        try:
            rnd = random.Random(s)
            barrier.wait(timeout=60)
            for _ in range(rounds):
                order = idents * 2
                rnd.shuffle(order)
                rows = check_many(conns[s], policy, order)
                assert [r[0] for r in rows] == order
                for r in rows:
                    allowed[s][r[0]] += r[1]
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(sessions)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a session hung"
    finally:
        for c in conns:
            c.close()
    assert errors == [], errors
    total = {i: sum(a[i] for a in allowed) for i in idents}
    assert total == dict.fromkeys(idents, lim)
    set_gucs(pg, test_clock_ms=TEST_CLOCK_MS)
    assert [r[3] for r in check_many(pg, policy, idents, 0)] == [0] * len(idents)


# ---------------------------------------------------------------- refunds


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("form", ["policy", "explicit"])
def test_refund_on_abort(clock, policies, algorithm, form):
    """refund_on_abort = 'all': a rolled-back batch (with a denied element)
    gives every unit back, a rolled-back savepoint its own units only;
    'guards' (the default) keeps them taken."""
    lim, window = 5, 60000
    policy = policies(algorithm, lim, window)

    def batch(idents, cost=1):
        if form == "policy":
            return check_many(clock, policy, idents, cost)
        return many(clock, algorithm, idents, lim, window, cost)

    def left(idents):
        return [r[3] for r in batch(idents, 0)]

    a, b, c = new_ident("ra"), new_ident("rb"), new_ident("rc")
    set_gucs(clock, refund_on_abort="all")
    with clock.transaction():
        rows = batch([a, b, a, c, a, a, a, a])
        assert [r[1] for r in rows] == [True] * 7 + [False]
        assert left([a, b, c]) == [0, 4, 4]
        raise psycopg.Rollback()  # rolls back, swallowed by the block
    assert left([a, b, c]) == [5, 5, 5]

    # a savepoint rolled back gives back only what it took
    with clock.transaction():
        batch([a, b])
        with clock.transaction():  # a savepoint
            assert [r[1] for r in batch([a, a, c, c], 2)] == [True, True, True, True]
            assert left([a, b, c]) == [0, 4, 1]
            raise psycopg.Rollback()
        assert left([a, b, c]) == [4, 4, 5]
    assert left([a, b, c]) == [4, 4, 5]
    # the full quota really is there again
    assert [r[1] for r in batch([c] * 6)] == [True] * 5 + [False]

    set_gucs(clock, refund_on_abort="guards")
    with clock.transaction():
        batch([a, b, b])
        raise psycopg.Rollback()
    assert left([a, b, c]) == [3, 2, 0]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_refund_on_abort_of_a_key_in_several_calls(clock, algorithm):
    """refund_on_abort = 'all', one transaction: 1 300 elements over two
    identities, one of them 900 times (its key in two script calls), lim
    1000; ROLLBACK gives back exactly 900 and 400 units."""
    lim, window = 1000, 3600000
    a, b = new_ident("ka"), new_ident("kb")
    batch = [a] * 300 + [b] * 400 + [a] * 600
    set_gucs(clock, refund_on_abort="all")
    many(clock, algorithm, [a, b], lim, window, 10)  # committed: stays taken
    with clock.transaction():
        rows = many(clock, algorithm, batch, lim, window)
        assert [(r[0], r[1]) for r in rows] == [(i, True) for i in batch]
        assert [r[3] for r in many(clock, algorithm, [a, b], lim, window, 0)] == [90, 590]
        raise psycopg.Rollback()
    assert [r[3] for r in many(clock, algorithm, [a, b], lim, window, 0)] == [990, 990]


# ---------------------------------------------------------------- on_error


@pytest.mark.parametrize("on_error", ["error", "allow", "deny"])
@pytest.mark.parametrize("how", ["killed", "closed_port"])
def test_on_error_redis_down(redis_factory, on_error, how):
    """A Redis killed after a first batch, or a port nothing listens on: a
    batch of 1 200 elements (3 script calls) raises 08xxx under 'error',
    gives every row allowed (remaining lim - cost) under 'allow' and denied
    (remaining 0, retry after 1 s) under 'deny', with one WARNING; the same
    session decides correctly once Redis is back."""
    r = redis_factory()
    conn = pg_connect()
    try:
        warnings = collect_warnings(conn)
        use_redis(conn, r, test_clock_ms=TEST_CLOCK_MS)
        if how == "killed":
            assert [x[1] for x in many(conn, "fixed", [new_ident("warm")] * 2, 5, 60000)] == [True, True]
            r.stop()
        else:
            set_gucs(conn, port=free_port())
        set_gucs(conn, on_error=on_error)
        idents = with_repeats(new_ident("down"), 400, 3, seed=3)
        query = "SELECT %s FROM rl_gcra_many(%%s::text[], 5, 60000, 2)" % COLS
        if on_error == "error":
            state = sqlstate_of(conn, query, (idents,))
            assert state.startswith("08"), state
        else:
            rows = conn.execute(query, (idents,)).fetchall()
            assert [x[0] for x in rows] == idents
            if on_error == "allow":
                assert set(x[1:] for x in rows) == {(True, 5, 3, 0, 0)}
            else:
                assert set(x[1:] for x in rows) == {(False, 5, 0, 0, DENY_RETRY_MS)}
        outage_warnings = warnings()
        warnings.clear()

        # Redis back: the same session decides again
        if how == "killed":
            r.start()
        else:
            use_redis(conn, r)
        set_gucs(conn, on_error="error")
        fresh = new_ident("back")
        rows = many(conn, "gcra", [fresh, idents[0], fresh, fresh], 5, 60000, 2)
        assert [(x[0], x[1], x[2], x[3]) for x in rows] == [
            (fresh, True, 5, 3), (idents[0], True, 5, 3), (fresh, True, 5, 1), (fresh, False, 5, 1)]
        assert warnings() == []
        # the outage was reported once (a 1 200-element batch is 3 script calls)
        if on_error == "error":
            assert outage_warnings == []
        else:
            assert [w.sqlstate for w in outage_warnings] == ["08001"], outage_warnings
    finally:
        conn.close()


def test_on_error_deny_charges_nothing(clock, policies, redis_factory):
    """Under 'deny', rl_check_many against a dead Redis denies every row
    (remaining 0, retry after 1 s); once Redis is back the quota is full."""
    policy = policies("fixed", 3, 60000)
    r = redis_factory()
    ident = new_ident("spare")
    use_redis(clock, r, on_error="deny")
    r.stop()
    rows = check_many(clock, policy, [ident] * 4)
    assert [x[1:] for x in rows] == [(False, 3, 0, 0, DENY_RETRY_MS)] * 4
    r.start()
    rows = check_many(clock, policy, [ident] * 4)
    assert [(x[1], x[3]) for x in rows] == [(True, 2), (True, 1), (True, 0), (False, 0)]


def test_error_reply_falls_back_for_its_key_only(clock, shared_redis):
    """1 200 fresh identities (calls of 500, 500, 200 keys); the key of
    element 700 holds a string (WRONGTYPE): under 'allow' that row gets the
    fallback (remaining lim - cost, reset 0) and nothing is written to its
    key; the 1 199 others, in the same script calls, Redis's exact
    decisions; one WARNING (08000)."""
    base = new_ident("wrong")
    idents = ["%s:%d" % (base, i) for i in range(1200)]
    shared_redis.command("SET", rl_key("fixed", idents[700], lim=5, window_ms=60000), "not a hash")
    warnings = collect_warnings(clock)
    set_gucs(clock, on_error="allow")
    rows = many(clock, "fixed", idents, 5, 60000, 2)
    assert [r[0] for r in rows] == idents
    assert rows[700][1:] == (True, 5, 3, 0, 0)
    decided = rows[:700] + rows[701:]
    assert {(r[1], r[2], r[3], r[5]) for r in decided} == {(True, 5, 3, 0)}
    assert all(0 < r[4] <= 60000 for r in decided)  # reset_ms of a real window
    # the warning names the key Redis could not decide, and says why
    assert [(w.sqlstate, w.message, w.detail.startswith("WRONGTYPE "), w.context) for w in warnings()] == [
        ("08000", "Redis at 127.0.0.1:%d returned an error" % shared_redis.port, True,
         'rl_redis decision "fixed" on key "%s"' % rl_key("fixed", idents[700], lim=5, window_ms=60000))]
    # Redis counted every identity but the one it could not decide
    for i in (0, 699, 701, 999, 1199):
        assert fixed_units(shared_redis.command("GET", rl_key("fixed", idents[i], lim=5, window_ms=60000))) == "2"
    assert shared_redis.command("GET", rl_key("fixed", idents[700], lim=5, window_ms=60000)) == "not a hash"


@pytest.mark.parametrize("on_error", ["deny", "error"])
def test_failed_key_charges_nothing(clock, shared_redis, on_error):
    """A key of a batch that Redis cannot decide (WRONGTYPE at the third of
    four) is charged nothing, and the rows say exactly what Redis holds:
    under 'deny' its row is denied by the fallback and the three others are
    decided (and charged); under 'error' (refund_on_abort = 'all') the
    batch raises 08000 and the transaction's ROLLBACK gives back what the
    three others took."""
    x1, x2, bad, x3 = [new_ident(t) for t in ("fx1", "fx2", "fbad", "fx3")]
    key = lambda i: rl_key("fixed", i, lim=5, window_ms=60000)  # noqa: E731
    shared_redis.command("SET", key(bad), "not a hash")
    set_gucs(clock, on_error=on_error, refund_on_abort="all")
    if on_error == "deny":
        rows = many(clock, "fixed", [x1, x2, bad, x3], 5, 60000)
        assert [r[1] for r in rows] == [True, True, False, True]
        assert rows[2][1:] == (False, 5, 0, 0, DENY_RETRY_MS)
        assert [r[3] for r in rows] == [4, 4, 0, 4]
        taken = ["1", "1", "1"]
    else:
        with pytest.raises(psycopg.Error) as excinfo:
            with clock.transaction():
                many(clock, "fixed", [x1, x2, bad, x3], 5, 60000)
        assert excinfo.value.sqlstate == "08000"
        taken = [None, None, None]
    assert [fixed_units(shared_redis.command("GET", key(i))) for i in (x1, x2, x3)] == taken
    assert shared_redis.command("GET", key(bad)) == "not a hash"


@pytest.mark.parametrize("algorithm", ["fixed", "token_bucket"])
def test_refund_skips_a_key_it_cannot_read(clock, shared_redis, algorithm):
    """Review: a rolled-back batch of 21 identities, whose refund goes in
    one script call; before the ROLLBACK one key is replaced by a list (not
    rl_redis's: Redis cannot read it as a state). That key gives nothing
    back and stays a list, and every other key is given back in full: the
    refund script used to stop at the unreadable key (its error ended the
    whole call), so the keys after it kept their charge."""
    idents = ["%s:%d" % (new_ident("unread"), i) for i in range(21)]
    bad = rl_key(algorithm, idents[10], lim=5, window_ms=60000)
    set_gucs(clock, refund_on_abort="all")
    with clock.transaction():
        assert {r[3] for r in many(clock, algorithm, idents, 5, 60000, 2)} == {3}
        shared_redis.command("DEL", bad)
        shared_redis.command("RPUSH", bad, "not a state")
        raise psycopg.Rollback()
    left = [r[3] for r in many(clock, algorithm, idents[:10] + idents[11:], 5, 60000, 0)]
    assert left == [5] * 20
    assert shared_redis.command("LRANGE", bad, "0", "-1") == ["not a state"]
    shared_redis.command("DEL", bad)


# ---------------------------------------------------------------- hung Redis


@pytest.mark.parametrize("on_error", ["error", "allow"])
def test_hung_redis_command_timeout(redis_factory, on_error):
    """SIGSTOPped Redis, command_timeout 300 ms: a batch of 1 200 elements
    ends within 5 s (an 08xxx error, or every row allowed); after SIGCONT
    the session's next batch gets its own replies (lim 777, exact)."""
    r = redis_factory()
    conn = pg_connect()
    try:
        use_redis(conn, r, command_timeout=300, connect_timeout=300, test_clock_ms=TEST_CLOCK_MS)
        base = new_ident("hung")
        assert many(conn, "sliding", [base], 5, 60000)[0][1] is True  # connected, scripts loaded
        idents = with_repeats(base, 400, 3, seed=4)
        set_gucs(conn, on_error=on_error)
        r.pause()
        try:
            t0 = time.monotonic()
            if on_error == "error":
                state = sqlstate_of(conn, "SELECT * FROM rl_sliding_many(%s::text[], 5, 60000)", (idents,))
                assert state.startswith("08"), state
            else:
                rows = many(conn, "sliding", idents, 5, 60000)
                assert [x[0] for x in rows] == idents
                assert set(x[1:] for x in rows) == {(True, 5, 4, 0, 0)}
            elapsed = time.monotonic() - t0
            assert 0.25 <= elapsed < 5.0, elapsed
        finally:
            r.resume()
        set_gucs(conn, on_error="error")
        fresh = new_ident("after")
        rows = many(conn, "sliding", [fresh, idents[0], fresh], 777, 60000, 500)
        assert [(x[0], x[1], x[2], x[3]) for x in rows] == [
            (fresh, True, 777, 277), (idents[0], True, 777, 277), (fresh, False, 777, 277)]
        assert conn.execute("SELECT 1").fetchone() == (1,)
    finally:
        r.resume()
        conn.close()


def test_hung_redis_cancel(pg, redis_factory):
    """pg_cancel_backend during a batch waiting on a SIGSTOPped Redis: 57014
    soon after the cancel; after SIGCONT the session's next batch gets its
    own decisions, not a reply of the cancelled one."""
    r = redis_factory()
    victim_conn = pg_connect()
    try:
        use_redis(victim_conn, r, command_timeout=60000, test_clock_ms=TEST_CLOCK_MS)
        base = new_ident("cancel")
        assert many(victim_conn, "fixed", [base], 5, 60000)[0][1] is True
        idents = with_repeats(base, 400, 3, seed=5)
        pid = victim_conn.info.backend_pid
        r.pause()
        try:
            v = QueryThread(victim_conn, "SELECT %s FROM rl_fixed_many(%%s::text[], 5, 60000)" % COLS, (idents,))
            v.start()
            wait_until_active(pg, pid)
            time.sleep(0.3)
            t_cancel = time.monotonic()
            assert pg.execute("SELECT pg_cancel_backend(%s)", (pid,)).fetchone()[0] is True
            v.join(timeout=30)
            assert not v.is_alive(), "the cancel was not honoured within 30 s"
            assert isinstance(v.error, psycopg.errors.QueryCanceled), repr(v.error)
            assert v.error.sqlstate == "57014"
            assert v.finished - t_cancel < 2.0, v.finished - t_cancel
            assert v.finished - v.started >= 0.25
        finally:
            r.resume()
        fresh = new_ident("next")
        rows = many(victim_conn, "fixed", [fresh, idents[1], fresh], 777, 60000, 400)
        assert [(x[0], x[1], x[2], x[3]) for x in rows] == [
            (fresh, True, 777, 377), (idents[1], True, 777, 377), (fresh, False, 777, 377)]
        rows = many(victim_conn, "fixed", [fresh], 3, 60000)
        assert [(x[0], x[1], x[2], x[3]) for x in rows] == [(fresh, True, 3, 2)]
    finally:
        r.resume()
        victim_conn.close()


# ------------------------------------------------------- the library flushed


def test_command_timeout_bounds_each_wait_not_the_batch(redis_factory):
    """command_timeout bounds each wait of a pipelined batch (for Redis to
    take more of it, or for its next reply), not the whole batch: 40 000
    identities (80 script calls) take longer than a 500 ms command_timeout
    in all, and every one is decided exactly. On a Redis of its own: on the
    shared one another test's long script call (a 10 000-row statement
    guard's) once held a reply past the 500 ms on a loaded machine."""
    base = new_ident("long")
    idents = ["%s:%d" % (base, i) for i in range(40000)]
    conn = pg_connect()
    try:
        use_redis(conn, redis_factory(), command_timeout=500)
        t0 = time.monotonic()
        rows = many(conn, "sliding", idents, 3, 60000, 2)
        elapsed = time.monotonic() - t0
    finally:
        conn.close()
    assert len(rows) == 40000
    assert {r[1:4] for r in rows} == {(True, 3, 1)}
    assert elapsed > 0.5, "the batch must outlast command_timeout for this test to mean anything"


@pytest.mark.parametrize("algorithm", ["fixed", "sliding"])
def test_function_flush_between_batches(redis_factory, algorithm):
    """FUNCTION FLUSH between two batches of 1 100 elements: the second
    batch still decides right (its calls get "Function not found" and go
    again behind FUNCTION LOAD), and each element is counted exactly once
    in Redis."""
    r = redis_factory()
    conn = pg_connect()
    try:
        use_redis(conn, r, test_clock_ms=TEST_CLOCK_MS)
        idents = ["%s:%d" % (new_ident("flush"), i) for i in range(550)]
        rows = many(conn, algorithm, idents + idents, 5, 60000)
        assert [(x[1], x[3]) for x in rows] == [(True, 4)] * 550 + [(True, 3)] * 550
        loads_before = library_loads(r)
        r.command("FUNCTION", "FLUSH")
        rows = many(conn, algorithm, idents + list(reversed(idents)), 5, 60000)
        assert [x[0] for x in rows] == idents + list(reversed(idents))
        assert [(x[1], x[3]) for x in rows] == [(True, 2)] * 550 + [(True, 1)] * 550
        assert library_loads(r) == loads_before + 1  # the path was taken, once
        rows = many(conn, algorithm, idents[:3] * 2, 5, 60000)
        assert [(x[1], x[3]) for x in rows] == [(True, 0)] * 3 + [(False, 0)] * 3
        for ident in idents:
            key = rl_key(algorithm, ident, lim=5, window_ms=60000)
            if algorithm == "fixed":
                count = int(fixed_units(r.command("GET", key)))
            else:
                count = r.command("ZCARD", key)
            assert count == (5 if ident in idents[:3] else 4), ident
    finally:
        conn.close()


def test_function_flush_before_a_large_batch_under_deny(redis_factory, policies):
    """on_error = 'deny', command_timeout 5 s: FUNCTION FLUSH after a first
    batch (the connection knows the library), then rl_check_many of 200 000
    fresh identities (lim 1 000 000): the calls Redis answers "Function not
    found" go again in one more pipeline (the library sent first), so every identity
    is allowed and counted once, with at most one WARNING. They used to go
    again one by one until command_timeout, and about half the batch was
    denied by the fallback, with hundreds of warnings. (With 500 ms, a
    loaded machine let a wait of the first pipeline pass: 14 000 denied.)"""
    n = 200000
    r = redis_factory()
    policy = policies("fixed", 1000000, 3600000)
    conn = pg_connect()
    try:
        warnings = collect_warnings(conn)
        use_redis(conn, r, test_clock_ms=TEST_CLOCK_MS, on_error="deny", command_timeout=5000)
        base = new_ident("flushbig")
        assert check_many(conn, policy, [base])[0][1:4] == (True, 1000000, 999999)
        loads_before = library_loads(r)
        r.command("FUNCTION", "FLUSH")
        row = conn.execute(
            "SELECT count(*) FILTER (WHERE allowed), count(*) FILTER (WHERE NOT allowed), "
            "count(*) FILTER (WHERE remaining = 999999) "
            "FROM rl_check_many(%s, ARRAY(SELECT %s || ':' || i FROM generate_series(1, %s) i))",
            (policy, base, n)).fetchone()
        assert row == (n, 0, n)
        assert len(warnings()) <= 1, "%d warnings, the first: %r" % (len(warnings()), warnings()[:1])
        assert library_loads(r) == loads_before + 1  # the path was taken, once
        assert r.command("DBSIZE") == n + 1
        for i in (1, 2, n // 2, n - 1, n):
            key = rl_key("fixed", "%s:%d" % (base, i), policy=policy, lim=1000000, window_ms=3600000)
            assert fixed_units(r.command("GET", key)) == "1", i
    finally:
        conn.close()


@pytest.mark.heavy
def test_memory_of_half_a_million_identities(redis_factory, policies):
    """rl_check_many of 500 000 distinct identities (a fixed window, lim
    1 000) on a Redis of its own: all allowed, and the backend's peak
    resident memory (VmHWM) grows by less than 75 MB over the statement,
    the array included (a million grew it by 680 MB when the hiredis
    replies of the whole batch were held at once, and by 119 MB, of which
    56 MB the array, against a bound of 150 MB, since). The growth of a
    statement that only builds the same array is measured first and shown
    with a failure."""
    n = 500000
    r = redis_factory()
    policy = policies("fixed", 1000, 3600000)
    conn = pg_connect()
    try:
        use_redis(conn, r, test_clock_ms=TEST_CLOCK_MS)
        assert check_many(conn, policy, ["warm"])[0][1] is True  # library, connection, script
        pid = conn.info.backend_pid
        before = vm_hwm_kb(pid)
        array = "ARRAY(SELECT 'u' || i FROM generate_series(1, %d) i)" % n
        assert conn.execute("SELECT count(*) FROM unnest(%s) u" % array).fetchone()[0] == n
        array_only = vm_hwm_kb(pid) - before
        t0 = time.monotonic()
        row = conn.execute("SELECT count(*) FILTER (WHERE allowed), count(*) FILTER (WHERE remaining = 999) "
                           "FROM rl_check_many(%%s, %s)" % array, (policy,)).fetchone()
        elapsed = time.monotonic() - t0
        grown = vm_hwm_kb(pid) - before
        assert row == (n, n)
        assert grown < 75 * 1024, (
            "VmHWM grew by %d MB over the batch (%.1f s); building the array alone: %d MB"
            % (grown // 1024, elapsed, array_only // 1024))
        assert r.command("DBSIZE") == n + 1
    finally:
        conn.close()


# ---------------------------------------------------------------- cluster


def point_at_cluster(conn, cluster, **gucs):
    """mode = cluster, the first master as the one seed, no breaker."""
    set_gucs(conn, mode="cluster", nodes=cluster.nodes_arg([cluster.masters()[0]]),
             retry_interval=0, **gucs)


def test_cluster_2000_identities(redis_cluster):
    """2 000 identities over the 3 masters, lim 2, frozen clock: two batches
    allow everything (remaining 1, then 0), a third denies everything, and
    the rows keep the input order; 600 copies of one identity (two calls
    of its slot) get exactly 2 allowed, the first two. Each key lives on
    its identity's master; the backend holds one connection per master."""
    conn = pg_connect()
    try:
        point_at_cluster(conn, redis_cluster, test_clock_ms=TEST_CLOCK_MS)
        base = new_ident("cl")
        idents = ["%s:%d" % (base, i) for i in range(2000)]
        random.Random(8).shuffle(idents)
        masters = redis_cluster.masters()
        assert len(masters) == 3
        slot_map = redis_cluster.slot_map()
        per_master = {}
        for i in idents:
            slot = identity_slot(i)
            port = next(p for start, end, p in slot_map if start <= slot <= end)
            per_master[port] = per_master.get(port, 0) + 1
        assert len(per_master) == 3 and min(per_master.values()) > 400, per_master

        for remaining in (1, 0):
            rows = many(conn, "fixed", idents, 2, 60000)
            assert [x[0] for x in rows] == idents
            assert [(x[1], x[3]) for x in rows] == [(True, remaining)] * 2000
        order = list(reversed(idents))
        rows = many(conn, "fixed", order, 2, 60000)
        assert [x[0] for x in rows] == order
        assert [(x[1], x[3]) for x in rows] == [(False, 0)] * 2000

        # the keys: on the identity's master only, counted twice
        for i in idents[:30]:
            key = rl_key("fixed", i, lim=2, window_ms=60000)
            assert redis_cluster.holders(key) == [redis_cluster.master_of_identity(i)], i
            assert fixed_units(redis_cluster.command_for_key(key, "GET", key)) == "2"

        # one identity 600 times, between others: two calls on its slot
        hot = new_ident("hot")
        mixed = [idents[0]] + [hot] * 300 + [idents[1]] + [hot] * 300
        rows = many(conn, "fixed", mixed, 2, 60000)
        assert [x[0] for x in rows] == mixed
        hot_rows = [(x[1], x[3]) for x in rows if x[0] == hot]
        assert hot_rows == [(True, 1), (True, 0)] + [(False, 0)] * 598
        assert [x[1] for x in rows if x[0] != hot] == [False, False]

        # a policy batch over the cluster, and rl_check on the same keys
        pname = "t_batch_cl_%s" % uuid.uuid4().hex[:12]
        with pg_connect() as admin:
            admin.execute("INSERT INTO rl_policy (name, algorithm, lim, window_ms) VALUES (%s, 'sliding', 3, 60000)",
                          (pname,))
        try:
            rows = check_many(conn, pname, idents[:900] + idents[:900])
            assert [(x[1], x[3]) for x in rows] == [(True, 2)] * 900 + [(True, 1)] * 900
            assert check(conn, pname, idents[5])[1:4] == (True, 3, 0)
            assert check_many(conn, pname, [idents[5]])[0][1:4] == (False, 3, 0)
        finally:
            with pg_connect() as admin:
                admin.execute("DELETE FROM rl_policy WHERE name = %s", (pname,))

        # one connection per master from this backend
        ports = backend_tcp_ports(conn.info.backend_pid)
        for m in masters:
            assert len(clients_from(m, ports)) == 1, m
        for n in redis_cluster.replicas():
            assert clients_from(n, ports) == [], n
        conns = conn.execute("SELECT server, state FROM rl_redis_connections() WHERE kind <> 'sentinel'").fetchall()
        assert sorted(conns) == sorted(("127.0.0.1:%d" % m.port, "open") for m in masters)
    finally:
        conn.close()


def test_cluster_stale_slot_map(redis_cluster):
    """A slot moved (with its keys) to another master after the backend
    learnt the slot map: the next batch's call to the old master gets MOVED
    and goes again to the new one; every row exact, each element counted
    once, still one connection per master."""
    conn = pg_connect()
    try:
        point_at_cluster(conn, redis_cluster, test_clock_ms=TEST_CLOCK_MS)
        base = new_ident("stale")
        idents = ["%s:%d" % (base, i) for i in range(300)]
        rows = many(conn, "sliding", idents, 3, 60000)
        assert [(r[0], r[1], r[3]) for r in rows] == [(i, True, 2) for i in idents]
        moved = idents[7]
        slot = identity_slot(moved)
        old = redis_cluster.master_of_slot(slot)
        new = next(m for m in redis_cluster.masters() if m is not old)
        assert redis_cluster.migrate_slot(slot, new) >= 1
        moved_before = old.error_count("MOVED")
        order = [moved] + idents + [moved]
        rows = many(conn, "sliding", order, 3, 60000)
        assert [r[0] for r in rows] == order
        want = [(True, 1)] + [(True, 0) if i == moved else (True, 1) for i in idents] + [(False, 0)]
        assert [(r[1], r[3]) for r in rows] == want
        assert old.error_count("MOVED") > moved_before  # the stale route was taken
        key = rl_key("sliding", moved, lim=3, window_ms=60000)
        assert redis_cluster.holders(key) == [new]
        assert new.command("ZCARD", key) == 3
        ports = backend_tcp_ports(conn.info.backend_pid)
        for m in redis_cluster.masters():
            assert len(clients_from(m, ports)) == 1, m
    finally:
        conn.close()


# ---------------------------------------------------------------- stats


STAT_COUNTERS = ("calls", "allowed", "denied", "units_taken", "units_refunded", "errors",
                 "errors_connection", "errors_timeout", "errors_reply", "errors_protocol",
                 "fallback_allow", "fallback_deny", "outages")


def counters(row):
    return {c: (row[c] if row else 0) for c in STAT_COUNTERS}


def test_stats_count_every_identity(clock, policies):
    """A batch of 12 on a policy (lim 6, cost 2): calls 12, allowed 9,
    denied 3, units 18, one round trip counted per element; the explicit
    form counts under (NULL, algorithm)."""
    policy = policies("fixed", 6, 60000)
    a, b, c = new_ident("sa"), new_ident("sb"), new_ident("sc")
    rows = check_many(clock, policy, [a] * 5 + [b] * 4 + [c] * 3, 2)
    assert [r[1] for r in rows] == [True] * 3 + [False] * 2 + [True] * 3 + [False] + [True] * 3
    row = stats_row(clock, policy)
    want = dict.fromkeys(STAT_COUNTERS, 0)
    want.update(calls=12, allowed=9, denied=3, units_taken=18)
    assert counters(row) == want
    assert sum(row["rtt_buckets"]) == 12

    check_many(clock, policy, [a, c, new_ident("sd")])
    want.update(calls=15, allowed=10, denied=5, units_taken=19)
    assert counters(stats_row(clock, policy)) == want

    before = counters(stats_row(clock, None, "token_bucket"))
    many(clock, "token_bucket", [a] * 7, 3, 60000, 1, 4)
    after = counters(stats_row(clock, None, "token_bucket"))
    assert {k: after[k] - before[k] for k in STAT_COUNTERS} == dict(
        dict.fromkeys(STAT_COUNTERS, 0), calls=7, allowed=4, denied=3, units_taken=4)


def test_stats_of_a_failed_batch(policies):
    """A batch of 700 against a closed port under 'deny': 700 calls, all
    errors of kind connection that fell back to deny, one outage."""
    policy = policies("fixed", 6, 60000)
    with pg_connect() as conn:
        set_gucs(conn, host="127.0.0.1", port=free_port(), retry_interval=0, on_error="deny")
        rows = check_many(conn, policy, [new_ident("sf")] * 700)
        assert {r[1] for r in rows} == {False}
        want = dict.fromkeys(STAT_COUNTERS, 0)
        want.update(calls=700, errors=700, errors_connection=700, fallback_deny=700, outages=1)
        assert counters(stats_row(conn, policy)) == want


# ---------------------------------------------------------------- denials


def test_track_denials_counts_every_denied_identity(clock, policies, shared_redis):
    """track_denials on, lim 1: a batch in which 5 identities are denied 1 to
    5 times (and one only allowed) shows them in rl_top_denied with those
    counts; a second batch and a single rl_check add to them; the explicit
    form and a peek count nothing."""
    policy = policies("fixed", 1, 3600000)
    set_gucs(clock, track_denials="on")
    ids = [new_ident("dn%d" % k) for k in range(6)]
    batch = []
    for k, ident in enumerate(ids[:5]):
        batch += [ident] * (k + 2)
    batch.append(ids[5])
    random.Random(9).shuffle(batch)
    rows = check_many(clock, policy, batch)
    assert sum(1 for r in rows if not r[1]) == 1 + 2 + 3 + 4 + 5

    def top():
        return clock.execute("SELECT identity, denials FROM rl_top_denied(%s, '10 minutes', 10)",
                             (policy,)).fetchall()

    assert top() == [(ids[4], 5), (ids[3], 4), (ids[2], 3), (ids[1], 2), (ids[0], 1)]
    check_many(clock, policy, [ids[0]] * 5 + [ids[5]])
    check(clock, policy, ids[1])
    check_many(clock, policy, ids, 0)  # a peek is no denial
    many(clock, "fixed", ids * 3, 1, 3600000)  # explicit: no policy to count under
    assert top() == [(ids[0], 6), (ids[4], 5), (ids[3], 4), (ids[2], 3), (ids[1], 3), (ids[5], 1)]
    minute = TEST_CLOCK_MS // 60000
    bucket = "rl:denials:{%s}:%d" % (policy, minute)
    assert int(float(shared_redis.command("ZSCORE", bucket, ids[0]))) == 6


def logged_args(entry):
    """The number of arguments of a SLOWLOG entry's command: Redis shows
    at most 32, the last of them "... (N more arguments)"."""
    args = entry[3]
    m = re.match(r"^\.\.\. \((\d+) more arguments\)$", args[-1]) if len(args) == 32 else None
    return len(args) - 1 + int(m.group(1)) if m else len(args)


def test_track_denials_of_a_huge_batch_hold_redis_briefly(redis_factory, policies):
    """track_denials on, a policy of lim 1 whose one identity is exhausted
    first: a batch of 50 000 copies of it is denied 50 000 times, counted
    in one script call (each distinct identity once, with its number), and
    rl_top_denied shows the identity with 50 000 denials. Every command
    Redis ran (its slow log, every command logged) is short: a decision
    script carries at most 500 keys, the denial note a handful of
    arguments. The denials used to go one argument each in one call, which
    held Redis about 0.5 s for 200 000. (A bound in time would measure the machine's
    load; the bound on each command's size holds Redis briefly on any.)"""
    n = 50000
    r = redis_factory(extra_args=["--slowlog-log-slower-than", "0", "--slowlog-max-len", "1000000"])
    policy = policies("fixed", 1, 3600000)
    conn = pg_connect()
    try:
        use_redis(conn, r, test_clock_ms=TEST_CLOCK_MS, track_denials="on")
        ident = new_ident("huge")
        assert check(conn, policy, ident)[1:4] == (True, 1, 0)
        r.command("SLOWLOG", "RESET")
        row = conn.execute("SELECT count(*) FILTER (WHERE allowed), count(*) FILTER (WHERE NOT allowed) "
                           "FROM rl_check_many(%s, array_fill(%s::text, ARRAY[%s]))",
                           (policy, ident, n)).fetchone()
        assert row == (0, n)
        # (Redis 7.0 logs the commands a script runs too: 50 000 GETs)
        log = r.command("SLOWLOG", "GET", "1000000")
        assert len(log) < 1000000  # the whole statement is in it
        scripts = [e for e in log if e[3][0].lower() in ("eval", "evalsha", "fcall")]
        notes = [e for e in scripts if len(e[3]) > 3 and e[3][3].startswith("rl:denials:")]
        # one call (an FCALL answered "Function not found" may come before it), with
        # the one identity and its number
        assert 1 <= len(notes) <= 2, [e[3][:4] for e in notes]
        assert max(logged_args(e) for e in notes) <= 10, [e[3] for e in notes]
        # the decisions: 50 000 in scripts of at most 500 keys each
        decisions = [e for e in scripts if e not in notes]
        assert max(int(e[3][2]) for e in decisions) == 500
        assert sum(int(e[3][2]) for e in decisions) >= n
        longest = max(logged_args(e) for e in log)
        assert longest <= 3 + 500 + 8, longest
        top = conn.execute("SELECT identity, denials FROM rl_top_denied(%s, '10 minutes', 10)",
                           (policy,)).fetchall()
        assert top == [(ident, n)]
    finally:
        conn.close()
