"""The local cache of denials (1.5): rl_redis.deny_cache.

With the setting on (superuser only; the library preloaded), a call that
Redis denied (cost > 0, through rl_decide_limit: rl_check/rl_allow, the
explicit rl_<algorithm>/rl_<algorithm>_allow forms, the row guard) is
remembered in the backend by its key and limit (algorithm, lim, window_ms,
burst) until the moment it was sent plus its retry_after_ms. Until then a
call on the same key and limit asking for at least as many units is denied
without Redis, with lim and remaining as Redis last said and retry_after_ms and
reset_ms counted down; cost 0 and smaller costs still go to Redis, and a
denial that can never pass (retry_after_ms -1) is not remembered. Refunds
and resets through the extension on this server bump a counter in shared
memory and every backend drops its whole cache at its next lookup. Without
preloading the setting is ignored with one WARNING per backend. At most
10 000 entries per backend: when full, the expired ones go, else all.
Cached denials count in rl_redis_stats as calls and denied, without a
round trip; rl_redis.track_denials does not count them; the batch functions
and rl_check_all neither use nor feed the cache.

A refund bumps the counter before it reaches Redis; one test stops Redis
to make a lookup fall between the two (the call that misses the cache runs
in Redis before the refund) and checks that the pre-refund denial does not
stay remembered afterwards. Another puts a TCP proxy that holds Redis's
replies 1 s (conftest's TcpProxy, a thread) in front of one session, so that a
refund lands between its call's sending and its reply: a denial is stored
only when no refund or reset came between. Only work that gives units back
empties the caches: a forget call (a token bucket charge committed under
refund_on_abort = 'all') or a concurrency slot released at COMMIT does
not.

Every test but the wall-clock one freezes time with rl_redis.test_clock_ms
(the cache's clock too), and every test that says whether Redis was asked
counts the script calls (EVAL, EVALSHA, FCALL) its own redis-server ran, from
INFO commandstats. The model test runs random sequences of every algorithm
with and without the cache side by side and predicts the cache exactly.
"""

import random
import threading
import time
import uuid
import zlib

import psycopg
import psycopg.rows
import pytest
from psycopg import sql

from conftest import fixed_units, QueryThread, TcpProxy, new_ident, pg_connect, rl_key, set_gucs, use_redis
from test_stats import stats_row
from redis_topology import made_policies, wait_for

# A refund or reset anywhere on a server empties every backend's cache: the
# module's sessions work on a PostgreSQL of its own, where no other test
# refunds anything.
pytestmark = pytest.mark.usefixtures("on_private_server")

TEST_CLOCK_MS = 1800000000000  # a frozen clock on a whole minute (2027-01-15)
ALGORITHMS = ["fixed", "sliding", "token_bucket", "gcra", "sliding_counter"]
CACHE_MAX = 10000  # the most denials one backend remembers
RATE_LIMITED = "PT429"
NOT_PRELOADED = "rl_redis.deny_cache is ignored: rl_redis is not in shared_preload_libraries"
COUNTERS = ("calls", "allowed", "denied", "units_taken", "units_refunded", "errors",
            "fallback_allow", "fallback_deny")


# ---------------------------------------------------------------- helpers


def script_calls(server):
    """How many rate-limit scripts server has run: EVAL, EVALSHA and FCALL
    calls that did not fail (an FCALL that found no function is sent again
    behind FUNCTION LOAD)."""
    total = 0
    for line in server.command("INFO", "commandstats").splitlines():
        name, _, fields = line.partition(":")
        if name in ("cmdstat_eval", "cmdstat_evalsha", "cmdstat_fcall"):
            f = dict(p.split("=", 1) for p in fields.split(","))
            total += int(f["calls"]) - int(f["failed_calls"]) - int(f["rejected_calls"])
    return total


class Scripts:
    """Counts the script calls of a server since the last look:
    `scripts.new()` -> how many ran since the previous call (or creation)."""

    def __init__(self, server):
        self.server = server
        self.seen = script_calls(server)

    def new(self):
        now = script_calls(self.server)
        n, self.seen = now - self.seen, now
        return n


def at(conn, offset_ms):
    """Sets the session's frozen clock to TEST_CLOCK_MS + offset_ms."""
    set_gucs(conn, test_clock_ms=TEST_CLOCK_MS + offset_ms)


def decide(conn, algorithm, identity, lim, window_ms, cost=1, burst=None):
    """rl_<algorithm>(...) as (allowed, lim, remaining, reset_ms, retry_after_ms)."""
    args = "%s, %s, %s, %s::int" + (", %s" if burst is not None else "")
    params = (identity, lim, window_ms, cost) + ((burst,) if burst is not None else ())
    return tuple(conn.execute(
        "SELECT (r).allowed, (r).lim, (r).remaining, (r).reset_ms, (r).retry_after_ms "
        "FROM rl_%s(%s) AS r" % (algorithm, args), params).fetchone())


def check(conn, policy, identity, cost=1):
    """rl_check(...) as (allowed, lim, remaining, reset_ms, retry_after_ms)."""
    return tuple(conn.execute(
        "SELECT (r).allowed, (r).lim, (r).remaining, (r).reset_ms, (r).retry_after_ms "
        "FROM rl_check(%s, %s, %s::int) AS r", (policy, identity, cost)).fetchone())


def sqlstate_of(conn, query, params=None):
    """(SQLSTATE, primary message, hint) of the error query raises."""
    with pytest.raises(psycopg.Error) as excinfo:
        conn.execute(query, params)
    e = excinfo.value
    return e.sqlstate, e.diag.message_primary, e.diag.message_hint


def warnings_of(conn):
    """A list that fills with the primary messages of conn's WARNINGs."""
    seen = []
    conn.add_notice_handler(
        lambda d: seen.append(d.message_primary) if d.severity_nonlocalized == "WARNING" else None)
    return seen


def counts(row):
    """The counters (and the number of round trips) of a stats row."""
    out = {c: (row[c] if row else 0) for c in COUNTERS}
    out["round_trips"] = sum(row["rtt_buckets"]) if row else 0
    return out


def cache_context_bytes(conn):
    """total_bytes of the backend's memory context of the denials table
    (0 before it exists)."""
    row = conn.execute("SELECT coalesce(sum(total_bytes), 0) FROM pg_backend_memory_contexts "
                       "WHERE name = 'rl_redis denials'").fetchone()
    return int(row[0])


def backend_bytes(conn):
    return int(conn.execute("SELECT sum(total_bytes) FROM pg_backend_memory_contexts").fetchone()[0])


@pytest.fixture
def sessions(redis_factory):
    """sessions(server=None, cache=True, **gucs) -> a new autocommit superuser
    connection pointed at server (default: one redis-server of its own,
    made on the first call and shared by the later ones; its handle is
    sessions.redis), on the frozen clock, rl_redis.deny_cache on or off.
    All closed at teardown."""
    conns = []

    class Make:
        redis = None

        def __call__(self, server=None, cache=True, **gucs):
            if server is None:
                if Make.redis is None:
                    Make.redis = redis_factory()
                server = Make.redis
            conn = pg_connect()
            conns.append(conn)
            gucs.setdefault("test_clock_ms", TEST_CLOCK_MS)
            use_redis(conn, server, deny_cache="on" if cache else "off", **gucs)
            return conn

    yield Make()
    for c in conns:
        c.close()


@pytest.fixture
def policies(pg):
    """policies(algorithm, lim, window_ms, burst=None) -> a new policy's name."""
    yield from made_policies(pg, "t_dcache")


@pytest.fixture
def guarded_table(pg):
    """guarded_table(policy, cost_column=False) -> a new table (tenant text
    [, cost int]) with a row guard on policy; dropped at teardown."""
    names = []

    def make(policy, cost_column=False):
        name = "t_dcache_%s" % uuid.uuid4().hex[:12]
        names.append(name)
        cols = "tenant text" + (", cost int" if cost_column else "")
        args = "%s, 'tenant'" % sql.Literal(policy).as_string(pg)
        if cost_column:
            args += ", 'cost'"
        pg.execute("CREATE TABLE %s (%s)" % (name, cols))
        pg.execute("CREATE TRIGGER g AFTER INSERT ON %s FOR EACH ROW "
                   "EXECUTE FUNCTION rl_guard(%s)" % (name, args))
        return name

    yield make
    for name in names:
        pg.execute("DROP TABLE IF EXISTS %s" % name)


@pytest.fixture
def role(pg):
    """A new LOGIN role without any grant; dropped at teardown."""
    name = "rl_dcache_%s" % uuid.uuid4().hex[:12]
    pg.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(name)))
    yield name
    pg.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(name)))


# ------------------------------------------------- answered without Redis


def test_denied_identity_is_denied_without_redis(sessions):
    """lim 3 on a fixed window of a minute: three allowed, the fourth denied
    by Redis; the next 50 calls, 100 ms apart, are denied without a script
    call, with lim and remaining as Redis said and reset/retry counted down.
    Redis's counter is untouched. A session without the cache on the same
    identity asks Redis every time."""
    a = sessions()
    r = sessions.redis
    ident = new_ident("deny")
    scripts = Scripts(r)
    rows = [decide(a, "fixed", ident, 3, 60000) for _ in range(4)]
    assert rows == [(True, 3, 2, 60000, 0), (True, 3, 1, 60000, 0), (True, 3, 0, 60000, 0),
                    (False, 3, 0, 60000, 60000)]
    assert scripts.new() == 4
    for k in range(1, 51):
        at(a, 100 * k)
        left = 60000 - 100 * k
        assert decide(a, "fixed", ident, 3, 60000) == (False, 3, 0, left, left), k
    assert scripts.new() == 0
    assert fixed_units(r.command("GET", rl_key("fixed", ident, lim=3, window_ms=60000))) == "3"

    # the boolean form shares the entry
    assert a.execute("SELECT rl_fixed_allow(%s, 3, 60000)", (ident,)).fetchone()[0] is False
    assert scripts.new() == 0

    # the setting is off by default, and a session without it asks Redis
    b = sessions(cache=False)
    at(b, 5000)
    with pg_connect() as fresh:
        assert fresh.execute("SHOW rl_redis.deny_cache").fetchone()[0] == "off"
    for _ in range(10):
        assert decide(b, "fixed", ident, 3, 60000) == (False, 3, 0, 55000, 55000)
    assert scripts.new() == 10

    # turned off in the session that remembers: Redis again, every time
    set_gucs(a, deny_cache="off")
    at(a, 6000)
    for _ in range(3):
        assert decide(a, "fixed", ident, 3, 60000) == (False, 3, 0, 54000, 54000)
    assert scripts.new() == 3


ENTRY_POINTS = ["rl_check", "rl_allow", "rl_sliding", "rl_sliding_allow",
                "rl_token_bucket_burst", "rl_gcra_allow_burst", "rl_sliding_counter", "row_guard"]


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_every_single_call_uses_the_cache(sessions, policies, guarded_table, entry):
    """Each single-decision entry point: lim 2 taken, the third call denied
    by Redis (one script call), ten more denied without any; for the row
    guard each denied INSERT raises PT429 and no row stays."""
    a = sessions()
    scripts = Scripts(sessions.redis)
    ident = new_ident(entry)
    if entry in ("rl_check", "rl_allow", "row_guard"):
        policy = policies("sliding", 2, 60000)
    if entry == "rl_check":
        def call():
            return check(a, policy, ident)[0]
    elif entry == "rl_allow":
        def call():
            return a.execute("SELECT rl_allow(%s, %s)", (policy, ident)).fetchone()[0]
    elif entry == "rl_sliding":
        def call():
            return decide(a, "sliding", ident, 2, 60000)[0]
    elif entry == "rl_sliding_allow":
        def call():
            return a.execute("SELECT rl_sliding_allow(%s, 2, 60000)", (ident,)).fetchone()[0]
    elif entry == "rl_token_bucket_burst":
        def call():
            return decide(a, "token_bucket", ident, 1, 60000, 1, 2)[0]
    elif entry == "rl_gcra_allow_burst":
        def call():
            return a.execute("SELECT rl_gcra_allow(%s, 1, 60000, 1, 2)", (ident,)).fetchone()[0]
    elif entry == "rl_sliding_counter":
        def call():
            return decide(a, "sliding_counter", ident, 2, 60000)[0]
    else:
        table = guarded_table(policy)

        def call():
            try:
                a.execute("INSERT INTO %s (tenant) VALUES (%%s)" % table, (ident,))
            except psycopg.Error as e:
                assert e.sqlstate == RATE_LIMITED and "exceeded" in e.diag.message_primary, e
                return False
            return True

    assert [call(), call(), call()] == [True, True, False]
    assert scripts.new() == 3
    assert [call() for _ in range(10)] == [False] * 10
    assert scripts.new() == 0
    if entry == "row_guard":
        assert a.execute("SELECT count(*) FROM %s" % table).fetchone()[0] == 2


# ------------------------------------------------------ never a false admit


def bounded_units(algorithm, lim, window, cap, history):
    """Checks that the allowed units of history [(clock, cost, allowed)]
    stay within what the algorithm permits (exact for the fixed window and
    the sliding log; lim per window of refill plus the burst for the token
    bucket and GCRA)."""
    taken = [(t, c) for t, c, ok in history if ok and c > 0]
    if algorithm == "fixed":
        per = {}
        for t, c in taken:
            per[(TEST_CLOCK_MS + t) // window] = per.get((TEST_CLOCK_MS + t) // window, 0) + c
        assert max(per.values()) <= lim
    elif algorithm == "sliding":
        for t0, _ in taken:
            assert sum(c for t, c in taken if t0 <= t < t0 + window) <= lim, t0
    elif algorithm in ("token_bucket", "gcra"):
        for t0, _ in taken:
            span = [(t, c) for t, c in taken if t >= t0]
            run = 0
            for t, c in span:
                run += c
                assert run <= cap + lim * (t - t0) / window + 1e-6, (t0, t)


SEQUENCES = [(a, None, s) for a in ALGORITHMS for s in (1, 2)] + \
    [("token_bucket", 8, 1), ("gcra", 8, 1), ("token_bucket", 8, 2), ("gcra", 8, 2)]


@pytest.mark.parametrize("algorithm, burst, seed", SEQUENCES,
                         ids=["%s-burst%s-seed%d" % c for c in SEQUENCES])
def test_same_decisions_as_without_the_cache(sessions, algorithm, burst, seed):
    """350 steps of a frozen clock moving on by 0 to 18 s, each one call
    of a random cost (0 to the capacity) in a session with the cache (on
    identity A) and one without (on identity B), same limit (5 per 60 s).
    The cache is modelled exactly: a denial by Redis (cost > 0, retry > 0)
    is remembered until its clock + retry; a call of at least its cost
    before then is answered from it. At every step:
      - the cached session made a script call exactly when the model says
        it goes to Redis, and then its row equals the uncached session's;
      - when answered from the cache, the uncached session was denied too
        (never a false admit, never a false denial), and the row is the
        remembered one with reset/retry counted down, no longer than what
        Redis told the uncached session;
      - a third session's peek (cost 0) sees the same state in both keys.
    The sequence has cached answers, Redis denials and admits, and the
    allowed units stay within the limit."""
    on = sessions()
    r = sessions.redis
    off = sessions(cache=False)
    peek = sessions(cache=False)
    # 5 per minute, the clock's steps scaled alike: a key's expiry counts on
    # the real clock, which the frozen one does not stop, so it must lie
    # seconds away, not milliseconds, on a loaded machine
    scale = 60
    lim, window = 5, 1000 * scale
    cap = burst or lim
    a, b = new_ident("on"), new_ident("off")
    rng = random.Random(zlib.crc32(("%s/%s/%d" % (algorithm, burst, seed)).encode()))
    scripts = Scripts(r)
    entry = None  # the model: dict(until, cost, lim, remaining, reset_at)
    clock = 0
    history = []
    kinds = {"cached": 0, "redis_denied": 0, "redis_allowed": 0}
    for step in range(350):
        clock += scale * rng.choice([0, 0, 5, 10, 25, 50, 100, 150, 300])
        cost = rng.choice([0, 1, 1, 1, 2, 2, 3, cap])
        for conn in (on, off, peek):
            at(conn, clock)
        if entry is not None and clock >= entry["until"]:
            entry = None
        cached = entry is not None and cost > 0 and cost >= entry["cost"]
        scripts.new()
        got = decide(on, algorithm, a, lim, window, cost, burst)
        used = scripts.new()
        want = decide(off, algorithm, b, lim, window, cost, burst)
        where = (step, clock, cost, got, want, entry)
        if cached:
            kinds["cached"] += 1
            assert used == 0, where
            reset = max(entry["reset_at"] - clock, 1) if entry["reset_at"] else 0
            assert got == (False, entry["lim"], entry["remaining"], reset, entry["until"] - clock), where
            assert want[0] is False, where
            assert got[1] == want[1], where
            assert 0 < got[4] <= want[4] and got[3] <= want[3], where
        else:
            assert used == 1, where
            assert got == want, where
            if got[0]:
                kinds["redis_allowed"] += 1
            else:
                kinds["redis_denied"] += 1
            if not got[0] and cost > 0 and got[4] > 0:
                entry = {"until": clock + got[4], "cost": cost, "lim": got[1],
                         "remaining": got[2], "reset_at": clock + got[3] if got[3] > 0 else 0}
            elif got[0] and entry is not None:
                # an allowed call (or a peek) brings remaining up to date
                entry["remaining"] = got[2]
        history.append((clock, cost, want[0]))
        assert decide(peek, algorithm, a, lim, window, 0, burst) == \
            decide(peek, algorithm, b, lim, window, 0, burst), where
    assert min(kinds.values()) >= 10, kinds
    bounded_units(algorithm, lim, window, cap, history)


def test_cost_semantics(sessions):
    """lim 5, 4 taken: cost 3 denied by Redis (remembered at cost 3); cost 1
    goes to Redis and is allowed (the entry's remaining becomes 0); cost 0
    goes to Redis; cost 5 and cost 3 are answered from the cache (with the
    remaining Redis last said, 0); cost 2
    goes to Redis, is denied and replaces the entry (remaining 0), so that
    cost 2 is then answered from the cache while cost 1 goes to Redis (and
    replaces it again)."""
    a = sessions()
    scripts = Scripts(sessions.redis)
    ident = new_ident("cost")

    def call(cost, clock):
        at(a, clock)
        row = decide(a, "fixed", ident, 5, 60000, cost)
        return row, scripts.new()

    assert call(4, 0) == ((True, 5, 1, 60000, 0), 1)
    assert call(3, 1000) == ((False, 5, 1, 59000, 59000), 1)
    assert call(1, 2000) == ((True, 5, 0, 58000, 0), 1)
    assert call(0, 3000) == ((True, 5, 0, 57000, 0), 1)
    assert call(5, 4000) == ((False, 5, 0, 56000, 56000), 0)
    assert call(3, 5000) == ((False, 5, 0, 55000, 55000), 0)
    assert call(2, 6000) == ((False, 5, 0, 54000, 54000), 1)
    assert call(2, 7000) == ((False, 5, 0, 53000, 53000), 0)
    assert call(1, 8000) == ((False, 5, 0, 52000, 52000), 1)
    assert call(1, 8500) == ((False, 5, 0, 51500, 51500), 0)
    assert call(0, 9000) == ((True, 5, 0, 51000, 0), 1)
    assert fixed_units(sessions.redis.command("GET", rl_key("fixed", ident, lim=5, window_ms=60000))) == "5"


def test_cost_above_the_limit_is_never_told_to_retry(sessions):
    """A cost above the limit can never pass: Redis answers retry_after_ms
    -1 (README: "A cost above lim (or burst) is always denied, with
    retry_after_ms = -1"), and such a denial is not remembered. That must
    stay so while a denial of a smaller cost is remembered for the key:
    the row says -1, not the remembered wait."""
    a = sessions()
    scripts = Scripts(sessions.redis)
    ident = new_ident("above")
    assert decide(a, "fixed", ident, 3, 60000, 3) == (True, 3, 0, 60000, 0)
    # nothing remembered yet: Redis, -1, and not remembered
    assert decide(a, "fixed", ident, 3, 60000, 4) == (False, 3, 0, 60000, -1)
    assert decide(a, "fixed", ident, 3, 60000, 4) == (False, 3, 0, 60000, -1)
    assert scripts.new() == 3
    # a denial of cost 1 remembered; cost 4 still can never pass
    assert decide(a, "fixed", ident, 3, 60000, 1) == (False, 3, 0, 60000, 60000)
    at(a, 1000)
    assert decide(a, "fixed", ident, 3, 60000, 4) == (False, 3, 0, 59000, -1)


def test_guard_cost_above_the_burst_can_never_pass(sessions, policies, guarded_table):
    """The row guard on a token bucket (lim 2, burst 4) with a cost column:
    a row of cost 5 can never pass (hint says so), also while a denial of
    cost 1 is remembered for the tenant."""
    a = sessions()
    policy = policies("token_bucket", 2, 60000, 4)
    table = guarded_table(policy, cost_column=True)
    never = "The write costs more than the limit allows at once; it can never pass."
    tenant = new_ident("abovet")
    a.execute("INSERT INTO %s VALUES (%%s, 4)" % table, (tenant,))
    assert sqlstate_of(a, "INSERT INTO %s VALUES (%%s, 5)" % table, (tenant,))[::2] == \
        (RATE_LIMITED, never)
    state, _, hint = sqlstate_of(a, "INSERT INTO %s VALUES (%%s, 1)" % table, (tenant,))
    assert (state, hint) == (RATE_LIMITED, "Retry after 30 s.")
    assert sqlstate_of(a, "INSERT INTO %s VALUES (%%s, 5)" % table, (tenant,))[::2] == \
        (RATE_LIMITED, never)


# ---------------------------------------------------------------- expiry


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_entry_expires_at_the_retry_time(sessions, algorithm):
    """lim 3 per 1 s taken at +123 ms, the fourth call denied with retry R:
    at +123 + R - 1 still answered from the cache (retry 1), at exactly
    +123 + R the call goes to Redis and is allowed."""
    a = sessions()
    scripts = Scripts(sessions.redis)
    ident = new_ident("exp")
    at(a, 123)
    rows = [decide(a, algorithm, ident, 3, 1000) for _ in range(4)]
    assert [x[0] for x in rows] == [True, True, True, False]
    retry = rows[3][4]
    assert retry > 1
    assert scripts.new() == 4
    at(a, 123 + retry - 1)
    row = decide(a, algorithm, ident, 3, 1000)
    assert (row[0], row[1], row[2], row[4]) == (False, 3, 0, 1)
    assert scripts.new() == 0
    at(a, 123 + retry)
    assert decide(a, algorithm, ident, 3, 1000)[0] is True
    assert scripts.new() == 1


def test_wall_clock(sessions):
    """Without the test clock the cache counts on the server's clock: a
    sliding window of 500 ms, one call allowed, the next denied by Redis;
    at once again denied without Redis (a shorter retry); once that retry
    has passed on the wall clock, Redis again, and allowed. (An attempt
    whose three calls took so long on a loaded machine that the window may
    have moved under them is made again with a fresh identity.)"""
    window = 500
    a = sessions(test_clock_ms=0)
    scripts = Scripts(sessions.redis)
    for _ in range(6):
        ident = new_ident("wall")
        scripts.new()
        t0 = time.monotonic()
        assert decide(a, "sliding", ident, 1, window)[0] is True
        first = decide(a, "sliding", ident, 1, window)
        used = scripts.new()
        again = decide(a, "sliding", ident, 1, window)
        if time.monotonic() - t0 < (window - 200) / 1000.0:
            break
    else:
        pytest.fail("3 calls never fitted in %d ms" % (window - 200))
    assert first[0] is False and 0 < first[4] <= window
    assert used == 2
    assert again[0] is False and 0 < again[4] <= first[4]
    assert scripts.new() == 0
    time.sleep(again[4] / 1000.0 + 0.2)
    assert decide(a, "sliding", ident, 1, window)[0] is True
    assert scripts.new() == 1


# ---------------------------------------------------- refunds and resets


REFUNDS = ["rl_refund", "rl_fixed_refund", "rl_reset", "rollback", "rollback_to_savepoint",
           "own_rl_refund"]


@pytest.mark.parametrize("how", REFUNDS)
def test_refund_or_reset_clears_the_cache(sessions, policies, how):
    """Session A (cache on) denied on two identities (lim 2, both
    remembered); then units come back to the first through another session
    (rl_refund, rl_fixed_refund, rl_reset, a ROLLBACK or ROLLBACK TO
    SAVEPOINT with refund_on_abort = 'all') or through A itself: A's next
    call on it goes to Redis and is allowed, and its whole cache is gone
    (the other identity goes to Redis too, is denied and remembered
    again)."""
    a = sessions()
    b = sessions(cache=False)
    scripts = Scripts(sessions.redis)
    ident, other = new_ident("ref"), new_ident("other")
    policy = policies("fixed", 2, 60000)
    if how == "rl_fixed_refund":
        def call(who, i):
            return decide(who, "fixed", i, 2, 60000)
    else:
        def call(who, i):
            return check(who, policy, i)

    if how.startswith("rollback"):
        b.execute("BEGIN")
        b.execute("SET LOCAL rl_redis.refund_on_abort = 'all'")
        if how == "rollback_to_savepoint":
            b.execute("SAVEPOINT s")
        assert call(b, ident) == (True, 2, 1, 60000, 0)
        assert call(a, ident) == (True, 2, 0, 60000, 0)
    else:
        assert [call(a, ident)[0] for _ in range(2)] == [True, True]
    assert call(a, ident) == (False, 2, 0, 60000, 60000)
    assert [call(a, other)[0] for _ in range(3)] == [True, True, False]
    scripts.new()
    at(a, 1000)
    assert call(a, ident) == (False, 2, 0, 59000, 59000)
    assert call(a, other) == (False, 2, 0, 59000, 59000)
    assert scripts.new() == 0

    if how == "rl_refund":
        b.execute("SELECT rl_refund(%s, %s, 1)", (policy, ident))
    elif how == "own_rl_refund":
        a.execute("SELECT rl_refund(%s, %s, 1)", (policy, ident))
    elif how == "rl_fixed_refund":
        b.execute("SELECT rl_fixed_refund(%s, 2, 60000, 1)", (ident,))
    elif how == "rl_reset":
        b.execute("SELECT rl_reset(%s)", (ident,))
    elif how == "rollback":
        b.execute("ROLLBACK")
    else:
        b.execute("ROLLBACK TO SAVEPOINT s")
        b.execute("COMMIT")
    scripts.new()
    at(a, 2000)
    want_remaining = 1 if how == "rl_reset" else 0
    row = call(a, ident)
    assert (row[0], row[1], row[2]) == (True, 2, want_remaining)
    assert call(a, other) == (False, 2, 0, 58000, 58000)
    assert scripts.new() == 2
    assert call(a, other) == (False, 2, 0, 58000, 58000)
    assert scripts.new() == 0


def wait_until_waiting_on_redis(pg, pid, timeout=30.0):
    """Waits until backend pid runs a statement and waits in the extension
    (wait_event_type Extension: its wait for a Redis socket)."""
    wait_for(lambda: pg.execute(
        "SELECT state = 'active' AND wait_event_type = 'Extension' FROM pg_stat_activity "
        "WHERE pid = %s", (pid,)).fetchone()[0], timeout,
        "backend %d to wait on Redis" % pid, interval=0.02)


def test_refund_landing_after_a_lookup_is_not_lost(sessions, redis_factory, pg):
    """The order of a refund and a lookup racing it: B (cache on) is denied
    (lim 1) and remembers it; Redis is stopped; A, whose first Redis call
    this is (it must connect and AUTH first), starts rl_fixed_refund and
    blocks; then B's next call misses the cache (the refund was announced)
    and blocks too. Redis resumes: it runs B's call (on a connection it
    already had) before A's refund. Once both returned, the unit is back in
    Redis, so B's next call must ask Redis again (and is allowed unless B's
    racing call took the unit): a denial remembered from before the refund
    landed must not answer. "Blocks" is seen in pg_stat_activity: the
    backend waits in the extension (its socket wait), so its call (or A's
    refund, whose announcement comes before it connects) was sent."""
    r = redis_factory(password="pw")
    slow = dict(password="pw", command_timeout=60000, connect_timeout=60000)
    b = sessions(r, **slow)
    a = sessions(r, cache=False, **slow)
    ident = new_ident("race")
    query = ("SELECT (r).allowed, (r).lim, (r).remaining, (r).reset_ms, (r).retry_after_ms "
             "FROM rl_fixed(%s, 1, 60000) r")
    assert [decide(b, "fixed", ident, 1, 60000)[0] for _ in range(2)] == [True, False]
    scripts = Scripts(r)
    r.pause()
    try:
        refund = QueryThread(a, "SELECT rl_fixed_refund(%s, 1, 60000, 1)", (ident,))
        refund.start()
        wait_until_waiting_on_redis(pg, a.info.backend_pid)
        racer = QueryThread(b, query, (ident,))
        racer.start()
        wait_until_waiting_on_redis(pg, b.info.backend_pid)
    finally:
        r.resume()
    for v in (refund, racer):
        v.join(timeout=60)
        assert not v.is_alive() and v.error is None, v.error
    assert scripts.new() == 2
    raced = tuple(racer.rows[0])
    taken = fixed_units(r.command("GET", rl_key("fixed", ident, lim=1, window_ms=60000)))
    assert int(taken or 0) == (1 if raced[0] else 0), (raced, taken)
    row = decide(b, "fixed", ident, 1, 60000)
    assert (scripts.new(), row[0]) == (1, not raced[0]), (raced, row)


def test_denial_decided_before_a_refund_is_not_remembered(sessions, pg):
    """A refund landing while a denial is on its way back: S1
    (refund_on_abort = 'all') takes the one unit (lim 1) in a transaction;
    S2 (cache on) reaches Redis through a proxy that holds every reply 1 s.
    Redis denies S2's call at once (the unit is S1's), and while the reply
    is held S1 rolls back (the unit is back in Redis). A refund came
    between the call's sending and its reply, so the denial is not
    remembered: S2's next call goes to Redis and is allowed (it used to be
    denied from the cache, without Redis, until the window's end)."""
    s1 = sessions(cache=False, refund_on_abort="all")
    r = sessions.redis
    proxy = TcpProxy(r.port, delay=1.0)
    try:
        s2 = sessions(proxy, command_timeout=10000, connect_timeout=10000)
        ident = new_ident("inflight")
        key = rl_key("fixed", ident, lim=1, window_ms=60000)
        query = ("SELECT (r).allowed, (r).lim, (r).remaining, (r).reset_ms, (r).retry_after_ms "
                 "FROM rl_fixed(%s, 1, 60000) r")
        scripts = Scripts(r)
        s1.execute("BEGIN")
        assert decide(s1, "fixed", ident, 1, 60000) == (True, 1, 0, 60000, 0)
        assert scripts.new() == 1
        racer = QueryThread(s2, query, (ident,))
        racer.start()
        wait_for(lambda: script_calls(r) > scripts.seen, 10.0, "S2's call to run in Redis")
        assert scripts.new() == 1
        s1.execute("ROLLBACK")
        wait_for(lambda: fixed_units(r.command("GET", key)) in (None, "0"), 0.5, "the refund in Redis")
        refunded = time.monotonic()
        scripts.new()  # the refund (a script too)
        racer.join(timeout=30)
        assert not racer.is_alive() and racer.error is None, racer.error
        assert racer.finished > refunded  # the denial came back after the refund
        assert tuple(racer.rows[0]) == (False, 1, 0, 60000, 60000)
        assert scripts.new() == 0
        row = decide(s2, "fixed", ident, 1, 60000)
        assert (scripts.new(), row) == (1, (True, 1, 0, 60000, 0))
        assert fixed_units(r.command("GET", key)) == "1"
    finally:
        proxy.close()


@pytest.mark.parametrize("work", ["forget", "release"])
def test_work_that_gives_nothing_back_keeps_the_cache(sessions, work):
    """A remembered denial stays when another session's transaction end
    gives no units back: 'forget', a token bucket charge committed under
    refund_on_abort = 'all' (its refund record is forgotten at COMMIT);
    'release', a concurrency slot released at COMMIT. Once that session's
    next call has read the replies of its transaction end, the cached
    session's next call still makes no script call (such work used to empty
    every cache). A refund (that session's ROLLBACK of a charge) then does
    empty it: the next call goes to Redis."""
    a = sessions()
    b = sessions(cache=False, refund_on_abort="all")
    r = sessions.redis
    ident, other = new_ident("keep"), new_ident("keepo")
    assert [decide(a, "fixed", ident, 1, 60000)[0] for _ in range(2)] == [True, False]
    scripts = Scripts(r)
    assert decide(a, "fixed", ident, 1, 60000) == (False, 1, 0, 60000, 60000)
    assert scripts.new() == 0

    b.execute("BEGIN")
    if work == "forget":
        assert decide(b, "token_bucket", other, 100, 60000)[:3] == (True, 100, 99)
    else:
        assert b.execute("SELECT (r).allowed FROM rl_concurrency_acquire(%s, 3, 60000) r",
                         (other,)).fetchone() == (True,)
    b.execute("COMMIT")
    # b's next call reads what its transaction end sent
    assert decide(b, "fixed", new_ident("peek"), 5, 60000, 0)[:3] == (True, 5, 5)
    if work == "forget":
        assert decide(b, "token_bucket", other, 100, 60000, 0)[2] == 99  # kept
    else:
        key = rl_key("concurrency", other, lim=3, window_ms=60000)
        assert r.command("ZCARD", key) == 0  # the slot was given back
    scripts.new()
    at(a, 1000)
    assert decide(a, "fixed", ident, 1, 60000) == (False, 1, 0, 59000, 59000)
    assert scripts.new() == 0

    b.execute("BEGIN")
    assert decide(b, "fixed", new_ident("refunded"), 1, 60000)[0] is True
    b.execute("ROLLBACK")
    scripts.new()
    assert decide(a, "fixed", ident, 1, 60000) == (False, 1, 0, 59000, 59000)
    assert scripts.new() == 1


def test_policy_limit_changed(sessions, policies, pg):
    """A remembered denial of a policy (fixed, lim 2) no longer applies once
    the policy's lim is raised to 4 (another limit, on the same key, whose
    count goes on): Redis again, 2 more, then denied and remembered under
    lim 4; lowered back to 2, the first entry applies again; a longer
    window (another key) goes to Redis."""
    a = sessions()
    scripts = Scripts(sessions.redis)
    ident = new_ident("pol")
    policy = policies("fixed", 2, 60000)
    assert [check(a, policy, ident)[0] for _ in range(3)] == [True, True, False]
    assert check(a, policy, ident) == (False, 2, 0, 60000, 60000)
    assert scripts.new() == 3
    pg.execute("UPDATE rl_policy SET lim = 4 WHERE name = %s", (policy,))
    assert [check(a, policy, ident) for _ in range(2)] == \
        [(True, 4, left, 60000, 0) for left in (1, 0)]
    assert check(a, policy, ident) == (False, 4, 0, 60000, 60000)
    assert scripts.new() == 3
    assert check(a, policy, ident) == (False, 4, 0, 60000, 60000)
    assert scripts.new() == 0
    # back to lim 2: the first entry (lim 2, until +60 s) applies again,
    # rightly so: the key holds 4 units
    pg.execute("UPDATE rl_policy SET lim = 2 WHERE name = %s", (policy,))
    at(a, 1000)
    assert check(a, policy, ident) == (False, 2, 0, 59000, 59000)
    assert scripts.new() == 0
    # a longer window is another limit again
    pg.execute("UPDATE rl_policy SET window_ms = 120000 WHERE name = %s", (policy,))
    assert check(a, policy, ident)[1] == 2
    assert scripts.new() == 1


# ------------------------------------------------- what does not use it


def test_batches_and_check_all_neither_use_nor_feed_it(sessions, policies):
    """rl_check_many, rl_check_all and rl_fixed_many on a denial remembered
    by rl_check go to Redis; a denial by a batch is not remembered (the
    next single call goes to Redis, and only its denial is)."""
    a = sessions()
    scripts = Scripts(sessions.redis)
    policy = policies("fixed", 1, 60000)
    ident = new_ident("batch")
    assert [check(a, policy, ident)[0] for _ in range(2)] == [True, False]
    assert check(a, policy, ident)[0] is False
    assert scripts.new() == 2
    rows = a.execute("SELECT allowed FROM rl_check_many(%s, %s::text[], 1)",
                     (policy, [ident, ident])).fetchall()
    assert rows == [(False,), (False,)]
    assert scripts.new() == 1
    row = a.execute("SELECT (r).allowed FROM rl_check_all(%s::text[], %s) r",
                    ([policy], ident)).fetchone()
    assert row == (False,)
    assert scripts.new() == 1

    other = new_ident("batch2")
    rows = a.execute("SELECT allowed FROM rl_fixed_many(%s::text[], 1, 60000, 1)",
                     ([other] * 3,)).fetchall()
    assert rows == [(True,), (False,), (False,)]
    assert scripts.new() == 1
    assert decide(a, "fixed", other, 1, 60000) == (False, 1, 0, 60000, 60000)
    assert scripts.new() == 1
    assert decide(a, "fixed", other, 1, 60000) == (False, 1, 0, 60000, 60000)
    assert scripts.new() == 0


def test_fallback_denial_is_not_remembered(sessions, redis_factory):
    """on_error = 'deny' with Redis down: the fallback denial is not
    remembered; with Redis back (empty), the next call is decided there and
    allowed."""
    r = redis_factory()
    a = sessions(r, on_error="deny")
    ident = new_ident("fb")
    assert decide(a, "fixed", ident, 1, 60000) == (True, 1, 0, 60000, 0)
    r.stop()
    assert decide(a, "fixed", ident, 1, 60000) == (False, 1, 0, 0, 1000)
    r.start()
    scripts = Scripts(r)
    assert decide(a, "fixed", ident, 1, 60000) == (True, 1, 0, 60000, 0)
    assert scripts.new() == 1


def test_without_preloading(unpreloaded_cluster, redis_factory):
    """A server without rl_redis in shared_preload_libraries: the setting is
    ignored with one WARNING per backend (at its first decision), and every
    call goes to Redis."""
    port = unpreloaded_cluster
    r = redis_factory()
    with pg_connect(host="127.0.0.1", port=port, user="postgres", dbname="postgres") as su:
        su.execute("CREATE EXTENSION rl_redis")
    scripts = Scripts(r)
    for _ in range(2):
        conn = pg_connect(host="127.0.0.1", port=port, user="postgres", dbname="postgres")
        try:
            warned = warnings_of(conn)
            use_redis(conn, r, deny_cache="on", test_clock_ms=TEST_CLOCK_MS)
            assert conn.execute("SHOW rl_redis.deny_cache").fetchone()[0] == "on"
            assert warned == []
            ident = new_ident("nopre")
            rows = [decide(conn, "fixed", ident, 1, 60000) for _ in range(21)]
            assert rows == [(True, 1, 0, 60000, 0)] + [(False, 1, 0, 60000, 60000)] * 20
            assert scripts.new() == 21
            assert warned == [NOT_PRELOADED]
        finally:
            conn.close()


def test_only_a_superuser_sets_it(pg, role):
    """SET and set_config of rl_redis.deny_cache by an ordinary role: 42501;
    the setting stays off."""
    with pg_connect(user=role) as conn:
        for query in ("SET rl_redis.deny_cache = on",
                      "SELECT set_config('rl_redis.deny_cache', 'on', false)"):
            state, msg, _ = sqlstate_of(conn, query)
            assert state == "42501", msg
        assert conn.execute("SHOW rl_redis.deny_cache").fetchone()[0] == "off"
    pg.execute("SET rl_redis.deny_cache = on")
    assert pg.execute("SHOW rl_redis.deny_cache").fetchone()[0] == "on"


# ---------------------------------------------------------------- stats


def test_stats_count_cached_denials(sessions, policies):
    """A policy (lim 2): 2 allowed, 1 denied by Redis, 5 denied from the
    cache -> calls 8, allowed 2, denied 6, units 2, 3 round trips; the
    explicit form's row (gcra) grows the same way."""
    a = sessions()
    policy = policies("fixed", 2, 60000)
    ident = new_ident("st")
    assert [check(a, policy, ident)[0] for _ in range(8)] == [True, True] + [False] * 6
    want = dict.fromkeys(COUNTERS, 0)
    want.update(calls=8, allowed=2, denied=6, units_taken=2, round_trips=3)
    assert counts(stats_row(a, policy)) == want

    before = counts(stats_row(a, None, "gcra"))
    assert [decide(a, "gcra", ident, 2, 60000)[0] for _ in range(8)] == [True, True] + [False] * 6
    after = counts(stats_row(a, None, "gcra"))
    diff = {k: after[k] - before[k] for k in after}
    assert diff == dict(dict.fromkeys(after, 0), calls=8, allowed=2, denied=6, units_taken=2,
                        round_trips=3)


def test_track_denials_does_not_count_cached_answers(sessions, policies):
    """track_denials on: one denial by Redis and five from the cache count 1
    in rl_top_denied."""
    a = sessions(track_denials="on")
    policy = policies("fixed", 1, 60000)
    ident = new_ident("td")
    assert [check(a, policy, ident)[0] for _ in range(7)] == [True] + [False] * 6
    top = a.execute("SELECT identity, denials FROM rl_top_denied(%s, '10 minutes', 10)",
                    (policy,)).fetchall()
    assert top == [(ident, 1)]


# ---------------------------------------------------------------- bounded


def test_bounded_to_10000_entries(sessions):
    """12 000 identities (lim 1, taken by one batch) each denied once by a
    single call: no error; the cache was full at the 10 001st and, none
    being expired, dropped them all, so it holds the last 2 000 (those are
    answered without Redis, the 10 000th goes to Redis). Its memory context
    stays small and the backend grows by less than 5 MB."""
    a = sessions()
    scripts = Scripts(sessions.redis)
    base = new_ident("many")
    n = 12000
    idents = ["%s:%d" % (base, i) for i in range(n)]
    rows = a.execute("SELECT count(*) FILTER (WHERE allowed) FROM rl_fixed_many(%s::text[], 1, 60000, 1)",
                     (idents,)).fetchone()
    assert rows == (n,)
    before = backend_bytes(a)
    scripts.new()
    denied = a.execute("SELECT count(*) FILTER (WHERE NOT rl_fixed_allow(%s || ':' || g, 1, 60000)) "
                       "FROM generate_series(0, %s) g", (base, n - 1)).fetchone()[0]
    assert denied == n
    assert scripts.new() == n
    grown = backend_bytes(a) - before
    assert grown < 5 * 1024 * 1024, grown
    assert 0 < cache_context_bytes(a) < 4 * 1024 * 1024, cache_context_bytes(a)

    at(a, 1000)
    for i in (n - 1, n - 1000, CACHE_MAX):
        assert decide(a, "fixed", idents[i], 1, 60000) == (False, 1, 0, 59000, 59000), i
    assert scripts.new() == 0
    assert decide(a, "fixed", idents[CACHE_MAX - 1], 1, 60000) == (False, 1, 0, 59000, 59000)
    assert scripts.new() == 1
    assert decide(a, "fixed", idents[0], 1, 60000) == (False, 1, 0, 59000, 59000)
    assert scripts.new() == 1


def test_full_cache_drops_expired_entries_first(sessions):
    """5 000 denials that expire after 1 s and 5 000 that last a minute fill
    the cache; at +2 s one more denial makes room by dropping only the
    expired ones: the minute-long ones are still answered without Redis.
    All on the frozen clock. The short ones are empty token buckets (1 per
    second, burst 60: a denial's retry is 1 s, the key lives 60 s of real
    time), so that no Redis key expires on the real clock while the 10 000
    calls run (the keys of a 1 s fixed window did, on a loaded machine)."""
    a = sessions()
    scripts = Scripts(sessions.redis)
    short, long_ = new_ident("short"), new_ident("long")
    half = CACHE_MAX // 2
    burst = 60
    ids = ["%s:%d" % (short, i) for i in range(half)]
    assert a.execute("SELECT count(*) FILTER (WHERE allowed) "
                     "FROM rl_token_bucket_many(%s::text[], 1, 1000, %s, %s)",
                     (ids, burst, burst)).fetchone()[0] == half
    assert a.execute("SELECT count(*) FILTER (WHERE NOT (r).allowed AND (r).retry_after_ms = 1000) "
                     "FROM generate_series(0, %s) g, rl_token_bucket(%s || ':' || g, 1, 1000, 1, %s) r",
                     (half - 1, short, burst)).fetchone()[0] == half
    ids = ["%s:%d" % (long_, i) for i in range(half)]
    a.execute("SELECT * FROM rl_fixed_many(%s::text[], 1, 60000, 1)", (ids,))
    assert a.execute("SELECT count(*) FILTER (WHERE NOT rl_fixed_allow(%s || ':' || g, 1, 60000)) "
                     "FROM generate_series(0, %s) g", (long_, half - 1)).fetchone()[0] == half
    scripts.new()
    at(a, 999)  # the short ones still answered from the cache
    assert decide(a, "token_bucket", "%s:0" % short, 1, 1000, burst=burst)[:3] == (False, burst, 0)
    assert scripts.new() == 0
    at(a, 2000)
    extra = new_ident("extra")
    assert [decide(a, "fixed", extra, 1, 60000)[0] for _ in range(2)] == [True, False]
    scripts.new()
    for i in (0, 1, half // 2, half - 1):
        assert decide(a, "fixed", "%s:%d" % (long_, i), 1, 60000) == (False, 1, 0, 58000, 58000), i
    assert decide(a, "fixed", extra, 1, 60000) == (False, 1, 0, 58000, 58000)
    assert scripts.new() == 0
    # the short ones expired: Redis (two tokens back: allowed)
    assert decide(a, "token_bucket", "%s:1" % short, 1, 1000, burst=burst)[0] is True
    assert scripts.new() == 1


# ---------------------------------------------------------------- concurrency


def test_concurrent_sessions_allow_exactly_the_limit(sessions):
    """8 sessions with the cache, 60 calls each on one identity (lim 40,
    frozen clock): exactly 40 allowed, and Redis ran exactly 40 + 8 scripts
    (each session's first denial; the rest from its cache). Then a ninth
    session refunds 5: the 8 sessions, 20 calls each, get exactly 5 more,
    with 5 + 8 scripts."""
    workers = [sessions() for _ in range(8)]
    refunder = sessions(cache=False)
    r = sessions.redis
    ident = new_ident("conc")
    key = rl_key("fixed", ident, lim=40, window_ms=60000)

    def hammer(calls):
        barrier = threading.Barrier(len(workers))
        results = [[] for _ in workers]
        errors = []

        def work(conn, out):
            try:
                barrier.wait(timeout=60)
                for _ in range(calls):
                    out.append(conn.execute("SELECT rl_fixed_allow(%s, 40, 60000)", (ident,)).fetchone()[0])
            except BaseException as e:  # looked at by the main thread
                errors.append(e)

        threads = [threading.Thread(target=work, args=(c, out), daemon=True)
                   for c, out in zip(workers, results)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
        assert not any(t.is_alive() for t in threads), "a session hung"
        assert errors == []
        for out in results:
            assert len(out) == calls
            first_denial = out.index(False)
            assert not any(out[first_denial:]), out  # no admit after a denial
        return sum(sum(out) for out in results)

    scripts = Scripts(r)
    assert hammer(60) == 40
    assert scripts.new() == 40 + 8
    assert fixed_units(r.command("GET", key)) == "40"

    refunder.execute("SELECT rl_fixed_refund(%s, 40, 60000, 5)", (ident,))
    assert fixed_units(r.command("GET", key)) == "35"
    scripts.new()
    assert hammer(20) == 5
    assert scripts.new() == 5 + 8
    assert fixed_units(r.command("GET", key)) == "40"
