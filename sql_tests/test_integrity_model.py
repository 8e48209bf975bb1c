"""Quota integrity (release 1.3, issue 8) checked against an exact model.

Everything here runs on the superuser test clock (rl_redis.test_clock_ms),
so every figure is exact, and under a key prefix of its own
(rl_redis.key_prefix), so keys can be listed and their TTLs checked.

The model (KeyModel) keeps the charges that were allowed on one key, each
with the time it was stamped and whether it still stands, and computes the
state from them with exact arithmetic (fractions.Fraction):

* fixed: units of the charges in the current calendar window;
* sliding: units of the charges with now - window < t;
* sliding_counter: c = units in the current window, p = units in the one
  before, estimate p * (window - into) / window + c;
* token_bucket / gcra: a replay of the standing charges from a full bucket,
  refilling lim per window, never above the capacity (GCRA's TAT is the same
  state: tokens = cap - (tat - now) / interval).

A rollback (transaction, savepoint, exception block) marks the charges it
undoes as not standing. For fixed, sliding and sliding_counter, removing a
charge changes only windows that still count, and for token_bucket / gcra
the replay without it is exactly the spec's "state as if the rolled-back
charges had never been made, the others' allowed charges replayed" -- so the
spec's refund rules are the model's "the state is a function of the charges
that stand".

State stamped later than the clock is read as if now were that stamp (the
spec's "time never runs back"): the model decides at max(now, stamp) and
stamps new charges there.

A note on the test clock inside transactions: SET is transactional, and a
subtransaction abort puts the value back to what it was when the
subtransaction started, *before* the enclosing level aborts. So when the
clock moved on since an inner savepoint was made, a direct ROLLBACK (TO) an
outer level would give the outer charges back on an old clock -- an artefact
of the test clock, not of the extension. The walks below then roll back one
level at a time (ROLLBACK TO the inner savepoint, SET, RELEASE it, ...),
which gives the same charges back at the same moment; a direct multi-level
ROLLBACK (TO) is used whenever the clock has not moved since the inner
savepoints were made.

A refund is written to Redis at the (sub)transaction end without waiting for
its reply (1.3: bounded transaction end); the session reads the reply before
its next command. Another session's call made right after the ROLLBACK may
reach Redis before the refund does, so after every rollback the rolling-back
session itself peeks first (Walk.sync), and only then do others look.

Keys expire in real time, by TTLs computed from the test clock, which jumps
far ahead of the real one: a state written less than about a second (test
clock) before it ends may vanish before the test clock gets there. The walks
therefore never stop in the last second of a window and move bucket clocks
in whole seconds; the key checks of test_first_decision_every_parameter only
insist on a key (and a positive PTTL) when the state matters for 2 s or more,
and on "never -1" always.
"""

import math
import random
import time
import uuid
from fractions import Fraction

import psycopg
import psycopg.errors
import pytest
from psycopg import sql

from conftest import give_back_session, pg_connect, set_gucs, take_session

ALGORITHMS = ["fixed", "sliding", "sliding_counter", "token_bucket", "gcra"]
BUCKETS = ("token_bucket", "gcra")
WINDOW_MS = 60000
# a test clock value on a multiple of 60000 ms (2001-09-09), far from the real clock
BASE_MS = 1000000020000
assert BASE_MS % WINDOW_MS == 0
CLOCK_MAX_MS = 4102444800000  # the test clock's upper end (2100-01-01)
LIM_MAX = 2**31 - 1
WINDOW_MAX_MS = 3153600000000  # 100 years

FIELDS = "(r).allowed, (r).lim, (r).remaining, (r).reset_ms, (r).retry_after_ms"


# ---------------------------------------------------------------- helpers


def new_prefix(tag):
    """A key prefix nobody else uses (no braces, no glob characters)."""
    return "rlim%s%s:" % (tag, uuid.uuid4().hex[:12])


def new_id(tag="i"):
    return "%s-%s" % (tag, uuid.uuid4().hex[:16])


def open_session(prefix, refund="all", clock=None):
    """A superuser autocommit session (take_session) on `prefix` with refund_on_abort."""
    conn = take_session()
    set_gucs(conn, key_prefix=prefix, refund_on_abort=refund, retry_interval=0)
    if clock is not None:
        set_clock(conn, clock)
    return conn


def set_clock(conn, ms):
    conn.execute("SET rl_redis.test_clock_ms = %d" % int(ms))


def call_sql(algorithm, bucket_args):
    """SELECT of rl_<algorithm>(identity, lim, window_ms, cost[, burst])."""
    args = "%s::text, %s::int, %s::bigint, %s::int"
    if bucket_args:
        args += ", %s::int"
    return "SELECT %s FROM rl_%s(%s) AS r" % (FIELDS, algorithm, args)


def decide(conn, algorithm, identity, lim, window_ms, cost, burst=None):
    """(allowed, lim, remaining, reset_ms, retry_after_ms) of the explicit
    function; token_bucket and gcra always get their burst argument (NULL =
    lim)."""
    if algorithm in BUCKETS:
        return conn.execute(
            call_sql(algorithm, True), (identity, lim, window_ms, cost, burst)
        ).fetchone()
    assert burst is None
    return conn.execute(call_sql(algorithm, False), (identity, lim, window_ms, cost)).fetchone()


def call_text(algorithm, identity, lim, window_ms, cost, burst=None):
    """The same call as SQL text (for logs and DO blocks)."""
    args = [sql.Literal(identity).as_string(None), str(lim), str(window_ms), str(cost)]
    if algorithm in BUCKETS:
        args.append("NULL" if burst is None else str(burst))
    return "rl_%s(%s)" % (algorithm, ", ".join(args))


def scan_keys(redis, pattern):
    keys = []
    cursor = "0"
    while True:
        cursor, batch = redis.command("SCAN", cursor, "MATCH", pattern, "COUNT", 10000)
        keys.extend(batch)
        if cursor == "0":
            return sorted(set(keys))


def glob_escape(text):
    out = []
    for ch in text:
        if ch in "*?[]\\":
            out.append("\\")
        out.append(ch)
    return "".join(out)


def keys_of(redis, prefix, identity):
    """Every key under `prefix` whose hash tag is the identity (whatever
    the rest of the key layout)."""
    return scan_keys(redis, glob_escape(prefix) + "*{" + glob_escape(identity) + "}*")


# ---------------------------------------------------------------- the model


class Charge:
    __slots__ = ("t", "cost", "alive")

    def __init__(self, t, cost):
        self.t = t
        self.cost = cost
        self.alive = True

    def __repr__(self):
        return "Charge(t=%d, cost=%d%s)" % (self.t, self.cost, "" if self.alive else ", undone")


class KeyModel:
    """The exact state of one key, as a function of its standing charges."""

    def __init__(self, algorithm, lim, window_ms, burst=None):
        self.alg = algorithm
        self.lim = lim
        self.window = window_ms
        self.cap = burst if (algorithm in BUCKETS and burst is not None) else lim
        self.rate = Fraction(lim, window_ms)  # units per ms
        self.charges = []
        self.stamp = None

    def effective(self, now):
        return now if self.stamp is None else max(now, self.stamp)

    def standing(self):
        return [ch for ch in self.charges if ch.alive]

    def tokens(self, now):
        cap = Fraction(self.cap)
        tok = cap
        last = None
        for ch in self.standing():
            if last is not None:
                tok = min(cap, tok + self.rate * (ch.t - last))
            tok -= ch.cost
            assert tok >= 0, "replay made a standing charge impossible"
            last = ch.t
        if last is not None:
            tok = min(cap, tok + self.rate * (now - last))
        return tok

    def decide(self, now, cost):
        """(allowed, remaining) of a call of `cost` at `now`; no change."""
        now = self.effective(now)
        lim, W = self.lim, self.window
        live = self.standing()
        if self.alg in ("fixed", "sliding"):
            if self.alg == "fixed":
                used = sum(ch.cost for ch in live if ch.t // W == now // W)
            else:
                used = sum(ch.cost for ch in live if ch.t > now - W)
            ok = used + cost <= lim
            return ok, max(lim - (used + cost if ok else used), 0)
        if self.alg == "sliding_counter":
            k = now // W
            c = sum(ch.cost for ch in live if ch.t // W == k)
            p = sum(ch.cost for ch in live if ch.t // W == k - 1)
            weight = Fraction(W - (now - k * W), W)

            def estimate(cur):
                return p * weight + cur

            ok = estimate(c + cost) <= lim
            cur = c + cost if ok else c
            return ok, max(math.floor(lim - estimate(cur)), 0)
        tok = self.tokens(now)
        ok = tok >= cost
        return ok, math.floor(tok - cost if ok else tok)

    def charge(self, now, cost):
        """Applies a call; returns (allowed, remaining, Charge or None)."""
        ok, remaining = self.decide(now, cost)
        ch = None
        if ok and cost > 0:
            t = self.effective(now)
            ch = Charge(t, cost)
            self.charges.append(ch)
            self.stamp = t
        return ok, remaining, ch

    @staticmethod
    def undo(charges):
        for ch in charges:
            ch.alive = False


# ---------------------------------------------------------------- fixtures


class Policies:
    def __init__(self):
        self.names = []

    def create(self, conn, algorithm, lim, window_ms, burst=None):
        name = "pytest.integ.%s" % uuid.uuid4().hex[:16]
        conn.execute(
            "INSERT INTO rl_policy (name, algorithm, lim, window_ms, burst) VALUES (%s, %s, %s, %s, %s)",
            (name, algorithm, lim, window_ms, burst),
        )
        self.names.append(name)
        return name

    def cleanup(self):
        if self.names:
            with pg_connect() as conn:
                conn.execute("DELETE FROM rl_policy WHERE name = ANY(%s)", (self.names,))


@pytest.fixture
def policies():
    p = Policies()
    try:
        yield p
    finally:
        p.cleanup()


@pytest.fixture
def tables():
    """tables(conn) -> a new table name (id serial, tenant text); dropped at teardown."""
    names = []

    def make(conn):
        name = "rl_integ_%s" % uuid.uuid4().hex[:12]
        conn.execute("CREATE TABLE %s (id serial PRIMARY KEY, tenant text NOT NULL)" % name)
        names.append(name)
        return name

    try:
        yield make
    finally:
        if names:
            with pg_connect() as conn:
                for name in names:
                    conn.execute("DROP TABLE IF EXISTS %s" % name)


@pytest.fixture
def sessions():
    """sessions(prefix, refund='all', clock=None) -> a session (take_session);
    all given back at teardown."""
    opened = []

    def make(prefix, refund="all", clock=None):
        conn = open_session(prefix, refund, clock)
        opened.append(conn)
        return conn

    try:
        yield make
    finally:
        for conn in opened:
            give_back_session(conn)


def peek(conn, algorithm, identity, lim, window_ms, burst=None):
    return decide(conn, algorithm, identity, lim, window_ms, 0, burst)


# ---------------------------------------------------------------- 1. exact refunds


def policy_peek(conn, policy, identity):
    return conn.execute(
        "SELECT %s FROM rl_check(%%s, %%s, 0) AS r" % FIELDS, (policy, identity)
    ).fetchone()


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("guard", ["row", "statement"])
def test_guard_rollback_gives_back_exactly(sessions, policies, tables, algorithm, guard):
    """Item 1: BEGIN; INSERT 5 guarded rows; ROLLBACK -> rl_check(policy,
    tenant, 0) says 10 again (default refund_on_abort = guards). Also a
    savepoint rolled back and an exception block."""
    prefix = new_prefix("g")
    conn = sessions(prefix, refund="guards", clock=BASE_MS + 1000)
    policy = policies.create(conn, algorithm, 10, WINDOW_MS)
    table = tables(conn)
    if guard == "row":
        conn.execute(
            "CREATE TRIGGER g AFTER INSERT ON %s FOR EACH ROW "
            "EXECUTE FUNCTION rl_guard('%s', 'tenant')" % (table, policy)
        )
    else:
        conn.execute(
            "CREATE TRIGGER g AFTER INSERT ON %s REFERENCING NEW TABLE AS n "
            "FOR EACH STATEMENT EXECUTE FUNCTION rl_guard_statement('%s', 'tenant')" % (table, policy)
        )
    tenant = new_id("tenant")
    insert = "INSERT INTO %s (tenant) SELECT %%s FROM generate_series(1, %%s)" % table

    def remaining():
        return policy_peek(conn, policy, tenant)[:3]

    assert remaining() == (True, 10, 10)
    conn.execute("BEGIN")
    conn.execute(insert, (tenant, 5))
    assert remaining() == (True, 10, 5)
    conn.execute("ROLLBACK")
    assert remaining() == (True, 10, 10), "the rolled-back rows' units were not all given back"

    # savepoint: 3 kept, 2 rolled back, commit
    conn.execute("BEGIN")
    conn.execute(insert, (tenant, 3))
    conn.execute("SAVEPOINT a")
    conn.execute(insert, (tenant, 2))
    assert remaining() == (True, 10, 5)
    conn.execute("ROLLBACK TO SAVEPOINT a")
    assert remaining() == (True, 10, 7)
    conn.execute("COMMIT")
    assert remaining() == (True, 10, 7)

    # an exception block that catches its error gives back its rows' units
    conn.execute(
        "DO $$ BEGIN INSERT INTO %s (tenant) SELECT %s FROM generate_series(1, 2); "
        "RAISE EXCEPTION 'undo'; EXCEPTION WHEN raise_exception THEN NULL; END $$"
        % (table, sql.Literal(tenant).as_string(conn))
    )
    assert remaining() == (True, 10, 7)
    assert conn.execute("SELECT count(*) FROM %s" % table).fetchone()[0] == 3


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_explicit_rollback_gives_back_exactly(sessions, algorithm):
    """Item 1, explicit calls under refund_on_abort = 'all': three allowed
    calls rolled back leave the quota at 10."""
    conn = sessions(new_prefix("e"), refund="all", clock=BASE_MS + 1000)
    identity = new_id()
    allow = "SELECT rl_%s_allow(%%s::text, %%s::int, %%s::bigint)" % algorithm
    conn.execute("BEGIN")
    for _ in range(3):
        assert conn.execute(allow, (identity, 10, WINDOW_MS)).fetchone()[0] is True
    assert peek(conn, algorithm, identity, 10, WINDOW_MS)[:3] == (True, 10, 7)
    conn.execute("ROLLBACK")
    assert peek(conn, algorithm, identity, 10, WINDOW_MS)[:3] == (True, 10, 10)
    # and a committed transaction keeps its charges
    conn.execute("BEGIN")
    assert conn.execute(allow, (identity, 10, WINDOW_MS)).fetchone()[0] is True
    conn.execute("COMMIT")
    assert peek(conn, algorithm, identity, 10, WINDOW_MS)[:3] == (True, 10, 9)


@pytest.mark.parametrize("algorithm", BUCKETS)
def test_overlapping_rollbacks_never_give_back_too_much(sessions, algorithm):
    """Review finding: two transactions A (4) and B (6) empty a bucket of
    10 per 10 s; 5 s later (5 refilled) C takes 5 and commits; then B and A
    roll back. Had A and B never charged, the bucket would have been full
    at C and hold 5 now: the two rollbacks together give back at most that,
    whatever their order (1.3 before the fix gave 9)."""
    for order in ("BA", "AB"):
        prefix = new_prefix("ov")
        a, b, c = sessions(prefix), sessions(prefix), sessions(prefix)
        identity = new_id()
        t0 = BASE_MS
        for conn in (a, b, c):
            set_clock(conn, t0)
        a.execute("BEGIN")
        assert decide(a, algorithm, identity, 10, 10000, 4)[:3] == (True, 10, 6)
        b.execute("BEGIN")
        assert decide(b, algorithm, identity, 10, 10000, 6)[:3] == (True, 10, 0)
        set_clock(c, t0 + 5000)
        assert decide(c, algorithm, identity, 10, 10000, 5)[:3] == (True, 10, 0)
        first, second = (b, a) if order == "BA" else (a, b)
        set_clock(first, t0 + 5000)
        set_clock(second, t0 + 5000)
        first.execute("ROLLBACK")
        second.execute("ROLLBACK")
        assert peek(c, algorithm, identity, 10, 10000)[:3] == (True, 10, 5), order


@pytest.mark.parametrize("algorithm", BUCKETS)
def test_committed_transactions_do_not_push_out_a_long_ones_refund(sessions, algorithm):
    """Review finding: A takes 100 of 1000 and stays open; 40 short
    transactions each take 1 and commit; A rolls back -> its 100 come back
    (the committed ones' refund records are forgotten at their commit, so
    they do not push A's out)."""
    prefix = new_prefix("lg")
    a, c = sessions(prefix), sessions(prefix)
    identity = new_id()
    for conn in (a, c):
        set_clock(conn, BASE_MS)
    a.execute("BEGIN")
    assert decide(a, algorithm, identity, 1000, 600000, 100)[:3] == (True, 1000, 900)
    for i in range(40):
        c.execute("BEGIN")
        assert decide(c, algorithm, identity, 1000, 600000, 1)[:3] == (True, 1000, 899 - i)
        c.execute("COMMIT")
    a.execute("ROLLBACK")
    assert peek(c, algorithm, identity, 1000, 600000)[:3] == (True, 1000, 960)


@pytest.mark.parametrize("algorithm", ["fixed", "sliding_counter"])
def test_refund_does_not_reach_a_new_life_of_the_key(sessions, shared_redis, algorithm):
    """Review finding: A takes 8 of 10 and stays open; the key is lost
    (FLUSHALL, eviction, rl_reset: here DEL); C takes 8 and commits; A rolls
    back -> C's 8 still count (remaining 2, not 10)."""
    prefix = new_prefix("lf")
    a, c = sessions(prefix), sessions(prefix)
    identity = new_id()
    for conn in (a, c):
        set_clock(conn, BASE_MS + 1000)
    a.execute("BEGIN")
    assert decide(a, algorithm, identity, 10, WINDOW_MS, 8)[:3] == (True, 10, 2)
    for key in keys_of(shared_redis, prefix, identity):
        shared_redis.command("DEL", key)
    assert decide(c, algorithm, identity, 10, WINDOW_MS, 8)[:3] == (True, 10, 2)
    a.execute("ROLLBACK")
    assert peek(c, algorithm, identity, 10, WINDOW_MS)[:3] == (True, 10, 2)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_state_outlives_a_clock_step_back(sessions, shared_redis, algorithm):
    """Review finding: after the clock steps back by 20 s, a charge's state
    must live as long as it counts on Redis's (earlier) clock: its TTL is 20 s
    longer than the same charge made without the step back."""
    prefix = new_prefix("tt")
    conn = sessions(prefix)
    plain, stepped = new_id("p"), new_id("s")
    t = BASE_MS + 1000
    set_clock(conn, t)
    decide(conn, algorithm, plain, 10, WINDOW_MS, 1)
    decide(conn, algorithm, stepped, 10, WINDOW_MS, 1)
    decide(conn, algorithm, plain, 10, WINDOW_MS, 1)
    set_clock(conn, t - 20000)
    decide(conn, algorithm, stepped, 10, WINDOW_MS, 1)
    [plain_key] = keys_of(shared_redis, prefix, plain)
    [stepped_key] = keys_of(shared_redis, prefix, stepped)
    gap = shared_redis.command("PTTL", stepped_key) - shared_redis.command("PTTL", plain_key)
    assert 19000 <= gap <= 21000, gap


@pytest.mark.parametrize("window_ms", [60000, WINDOW_MAX_MS])
def test_sliding_log_lives_one_window_on_redis_clock(sessions, shared_redis, window_ms):
    """A sliding log charged on Redis's own clock expires one window after
    the charge, also for a window of 100 years (its expiry is the caller's
    text of window_ms, not a number Redis formats), and a charge of several
    units as well; on the test clock a 1 s window lives the test clock's
    10 s at least."""
    prefix = new_prefix("sl")
    conn = sessions(prefix)
    for identity, cost in [(new_id("one"), 1), (new_id("three"), 3)]:
        assert decide(conn, "sliding", identity, 10, window_ms, cost)[:3] == (True, 10, 10 - cost)
        [key] = keys_of(shared_redis, prefix, identity)
        pttl = shared_redis.command("PTTL", key)
        assert window_ms - 5000 <= pttl <= window_ms, (identity, pttl)
    clock_prefix = new_prefix("sc")
    on_clock = sessions(clock_prefix, clock=BASE_MS)
    identity = new_id("clock")
    assert decide(on_clock, "sliding", identity, 10, 1000, 1)[:3] == (True, 10, 9)
    [key] = keys_of(shared_redis, clock_prefix, identity)
    assert 5000 <= shared_redis.command("PTTL", key) <= 10000


@pytest.mark.parametrize("algorithm", BUCKETS)
def test_many_released_savepoints_keep_the_transactions_refund(sessions, algorithm):
    """A transaction that charges one key in 100 exception blocks that are
    left normally (each a released savepoint) and then rolls back gives
    back all 101 units: its released savepoints' records, not its own, make
    room when a key holds too many."""
    prefix = new_prefix("rs")
    conn = sessions(prefix)
    identity = new_id()
    set_clock(conn, BASE_MS)
    call = call_text(algorithm, identity, 1000, 600000, 1)
    conn.execute("BEGIN")
    conn.execute("SELECT " + call)
    conn.execute("DO $$ BEGIN FOR i IN 1 .. 100 LOOP BEGIN PERFORM %s; "
                 "EXCEPTION WHEN OTHERS THEN RAISE; END; END LOOP; END $$" % call)
    assert peek(conn, algorithm, identity, 1000, 600000)[:3] == (True, 1000, 899)
    conn.execute("ROLLBACK")
    assert peek(conn, algorithm, identity, 1000, 600000)[:3] == (True, 1000, 1000)


# ---------------------------------------------------------------- 2. property walks


class Level:
    __slots__ = ("name", "created", "charges")

    def __init__(self, name, created):
        self.name = name
        self.created = created  # the clock when it began (its GUC start value)
        self.charges = []


class Actor:
    def __init__(self, name, conn):
        self.name = name
        self.conn = conn
        self.levels = None  # None: no transaction; [0] = the top level
        self.aborted = False


class Conservative(Exception):
    """A token bucket or GCRA walk where the implementation gave back less
    than the model: the refund records of transactions that overlapped a
    refill are lowered together to the deficit (never too much, see
    lua/common.lua), so a rollback after such a refill may give back less
    than "as if never charged". Ends the walk; never a failure."""


class Mismatch(AssertionError):
    pass


# clock steps (ms): inside a window, to its end, across one or two windows,
# enough to refill any bucket used here
DT_CHOICES = [1, 1000, 2000, 3000, 5000, 6000, 9000, 15000, 20000, 29000, 30000,
              31000, 45000, 59000, 60000, 61000, 90000, 120000, 150000, 400000]

WALK_PARAMS = {
    "fixed": [(10, 60000, None), (5, 60000, None), (3, 60000, None)],
    "sliding": [(10, 60000, None), (5, 60000, None)],
    "sliding_counter": [(10, 60000, None), (5, 60000, None), (12, 60000, None)],
    "token_bucket": [(10, 60000, None), (10, 60000, 4), (4, 60000, 10), (12, 60000, 6)],
    "gcra": [(10, 60000, None), (10, 60000, 4), (4, 60000, 10), (12, 60000, 6)],
}


class Walk:
    """One seeded random sequence of two sessions' transactions on one key,
    checked against KeyModel after every step."""

    def __init__(self, algorithm, seed, a, b, observer, steps):
        self.rng = random.Random(seed * 7919 + ALGORITHMS.index(algorithm))
        self.alg = algorithm
        self.seed = seed
        self.steps = steps
        self.lim, self.window, self.burst = self.rng.choice(WALK_PARAMS[algorithm])
        self.model = KeyModel(algorithm, self.lim, self.window, self.burst)
        self.cap = self.model.cap
        self.identity = "walk-%d-%s" % (seed, uuid.uuid4().hex[:8])
        self.now = BASE_MS + self.rng.choice([0, 1000, 30000, 58000, 58999])
        self.actors = [Actor("A", a), Actor("B", b)]
        self.observer = observer
        self.sp = 0
        self.log = [
            "-- %s lim %d window %d burst %s, identity %r, refund_on_abort = all, clock starts at %d"
            % (algorithm, self.lim, self.window, self.burst, self.identity, self.now)
        ]

    # -- plumbing

    def note(self, text):
        self.log.append(text)

    def run(self, actor, text, params=None, clock=True):
        if clock:
            set_clock(actor.conn, self.now)
        self.note("%s: %s" % (actor.name, text if params is None else text % tuple(map(repr, params))))
        return actor.conn.execute(text, params)

    def fail(self, what):
        raise Mismatch(
            "%s seed %d: %s\nsequence (clock = test_clock_ms of every session):\n  %s"
            % (self.alg, self.seed, what, "\n  ".join(self.log[-80:]))
        )

    def check(self, when):
        set_clock(self.observer, self.now)
        got = peek(self.observer, self.alg, self.identity, self.lim, self.window, self.burst)
        want = self.model.decide(self.now, 0)
        self.note("   peek at %d: got remaining %d (allowed %s), model %d" % (self.now, got[2], got[0], want[1]))
        if (got[0], got[1], got[2]) != (want[0], self.cap, want[1]):
            self.below_model(got[0], got[2], want[0], want[1])
            self.fail("after %s: peek (allowed, lim, remaining) = %r, model %r" % (when, got[:3], (want[0], self.cap, want[1])))

    def sync(self, actor):
        """A peek in the session that rolled back. The refund of a rollback
        is written to Redis at the (sub)transaction end without waiting for
        its reply, which the session reads before its next command; another
        session's call can reach Redis first (Redis reads a long EVAL in
        pieces and serves other clients in between). Once the rolling-back
        session's own next call has returned, the refund has been applied."""
        set_clock(actor.conn, self.now)
        got = peek(actor.conn, self.alg, self.identity, self.lim, self.window, self.burst)
        want = self.model.decide(self.now, 0)
        self.note("%s: peek (sync) -> remaining %d, model %d" % (actor.name, got[2], want[1]))
        if (got[0], got[2]) != want:
            self.below_model(got[0], got[2], want[0], want[1])
            self.fail("%s's own peek after its rollback: %r, model %r" % (actor.name, got[:3], want))

    def below_model(self, got_allowed, got_remaining, want_allowed, want_remaining):
        """For the token bucket and GCRA, a result below the model (denied
        where the model allows, or fewer units left) is the conservative
        side: end the walk as Conservative. Anything above the model is a
        forged unit and fails."""
        if self.alg not in BUCKETS:
            return
        if (got_allowed, got_remaining) == (want_allowed, want_remaining):
            return
        if (not got_allowed and want_allowed) or \
                (got_allowed == want_allowed and got_remaining < want_remaining):
            self.note("   conservative: below the model from here on")
            raise Conservative()

    def pick_cost(self):
        c = self.rng.choice([0, 1, 1, 1, 1, 2, 2, 3, self.cap // 2, self.cap, self.cap + 1])
        return max(c, 0)

    def undo(self, charges, why):
        if charges:
            self.note("   (%s gives back %s)" % (why, charges))
        KeyModel.undo(charges)

    # -- steps

    def advance(self):
        dt = self.rng.choice(DT_CHOICES)
        if dt < 1000 and self.alg in BUCKETS:
            dt = 1000
        self.now += dt
        dt += self.margin()
        self.now += self.margin()
        self.note("-- clock +%d -> %d" % (dt, self.now))

    def margin(self):
        """Keys expire in real time, by TTLs taken from the test clock: a
        state written less than a second (of test clock) before it ends
        could vanish before the test clock gets there. So the clock never
        stops in the last second of a window (fixed: a key that ends with
        its window), and bucket states are always 1000 ms multiples apart
        (tokens are then multiples of 1/15 or more away from full)."""
        if self.now % self.window > self.window - 1000:
            return 1000
        return 0

    def begin(self, actor):
        self.run(actor, "BEGIN", clock=False)
        actor.levels = [Level(None, self.now)]

    def charge(self, actor):
        cost = self.pick_cost()
        set_clock(actor.conn, self.now)
        text = "SELECT * FROM " + call_text(self.alg, self.identity, self.lim, self.window, cost, self.burst)
        got = decide(actor.conn, self.alg, self.identity, self.lim, self.window, cost, self.burst)
        ok, remaining, ch = self.model.charge(self.now, cost)
        self.note("%s: %s -> allowed %s remaining %d (model %s %d)" % (actor.name, text, got[0], got[2], ok, remaining))
        if (got[0], got[1], got[2]) != (ok, self.cap, remaining):
            self.below_model(got[0], got[2], ok, remaining)
            self.fail("charge of %d: (allowed, lim, remaining) = %r, model %r" % (cost, got[:3], (ok, self.cap, remaining)))
        if ch is not None and actor.levels is not None:
            actor.levels[-1].charges.append(ch)

    def do_block(self, actor):
        """A PL/pgSQL exception block around a charge, rolled back (it
        raises) or left normally (its charge goes to the enclosing level)."""
        cost = self.pick_cost()
        undo = self.rng.random() < 0.6
        body = "PERFORM %s; %s" % (
            call_text(self.alg, self.identity, self.lim, self.window, cost, self.burst),
            "RAISE EXCEPTION 'undo';" if undo else "",
        )
        self.run(actor, "DO $$ BEGIN %s EXCEPTION WHEN raise_exception THEN NULL; END $$" % body)
        ok, remaining, ch = self.model.charge(self.now, cost)
        if ch is not None:
            if undo:
                self.undo([ch], "exception block")
            elif actor.levels is not None:
                actor.levels[-1].charges.append(ch)
        self.sync(actor)

    def savepoint(self, actor):
        self.sp += 1
        name = "s%d" % self.sp
        self.run(actor, "SAVEPOINT " + name)
        actor.levels.append(Level(name, self.now))

    def release(self, actor):
        i = self.rng.randrange(1, len(actor.levels))
        self.run(actor, "RELEASE SAVEPOINT " + actor.levels[i].name)
        for lvl in actor.levels[i:]:
            actor.levels[i - 1].charges.extend(lvl.charges)
        del actor.levels[i:]

    def unwind_to(self, actor, i):
        """Rolls back the levels above i one at a time when the clock moved
        since they began (see the module docstring)."""
        levels = actor.levels
        if all(levels[k].created == self.now for k in range(i + 1, len(levels))):
            return
        for k in range(len(levels) - 1, i, -1):
            self.run(actor, "ROLLBACK TO SAVEPOINT " + levels[k].name)
            self.undo(levels[k].charges, "rollback to " + levels[k].name)
            self.run(actor, "RELEASE SAVEPOINT " + levels[k].name)
            del levels[k]

    def rollback_to(self, actor):
        i = self.rng.randrange(1, len(actor.levels))
        self.unwind_to(actor, i)
        self.run(actor, "ROLLBACK TO SAVEPOINT " + actor.levels[i].name)
        for lvl in actor.levels[i:]:
            self.undo(lvl.charges, "rollback to " + actor.levels[i].name)
            lvl.charges = []
        del actor.levels[i + 1:]
        self.sync(actor)

    def commit(self, actor):
        self.run(actor, "COMMIT")
        actor.levels = None

    def rollback(self, actor):
        self.unwind_to(actor, 0)
        self.run(actor, "ROLLBACK")
        for lvl in actor.levels:
            self.undo(lvl.charges, "rollback")
        actor.levels = None
        self.sync(actor)

    def error(self, actor):
        """An error aborts the innermost level at once (its charges come back
        then); the session rolls back the failed level (a whole transaction,
        or ROLLBACK TO the innermost savepoint, which gives nothing more
        back) and syncs."""
        set_clock(actor.conn, self.now)
        self.note("%s: SELECT 1 / 0  -- error" % actor.name)
        try:
            actor.conn.execute("SELECT 1 / 0")
        except psycopg.errors.DivisionByZero:
            pass
        else:
            raise AssertionError("no error")
        innermost = actor.levels[-1]
        self.undo(innermost.charges, "error")
        innermost.charges = []
        actor.aborted = True
        self.recover(actor)
        self.sync(actor)

    def recover(self, actor):
        if len(actor.levels) == 1:
            self.run(actor, "ROLLBACK", clock=False)
            actor.levels = None
        else:
            self.run(actor, "ROLLBACK TO SAVEPOINT " + actor.levels[-1].name, clock=False)
        actor.aborted = False

    def step(self):
        rng = self.rng
        if rng.random() < 0.22:
            self.advance()
            return "clock step"
        actor = rng.choice(self.actors)
        if actor.aborted:
            self.recover(actor)
            return "recover"
        if actor.levels is None:
            x = rng.random()
            if x < 0.65:
                self.begin(actor)
                self.charge(actor)
                return "begin + charge"
            if x < 0.9:
                self.charge(actor)
                return "autocommit charge"
            self.do_block(actor)
            return "exception block"
        choices = [(self.charge, 40), (self.savepoint, 12), (self.commit, 9),
                   (self.rollback, 10), (self.error, 4), (self.do_block, 6)]
        if len(actor.levels) > 1:
            choices += [(self.rollback_to, 12), (self.release, 8)]
        fn = rng.choices([c[0] for c in choices], [c[1] for c in choices])[0]
        fn(actor)
        return fn.__name__

    def play(self):
        for n in range(self.steps):
            what = self.step()
            self.check("step %d (%s)" % (n, what))
        # end every open transaction, then let everything refill
        for actor in self.actors:
            if actor.aborted:
                self.recover(actor)
            if actor.levels is not None:
                (self.commit if self.rng.random() < 0.5 else self.rollback)(actor)
                self.check("end of %s's transaction" % actor.name)
        self.now += 3 * self.window
        self.note("-- clock +%d -> %d" % (3 * self.window, self.now))
        self.check("three windows later")
        if self.model.decide(self.now, 0) != (True, self.cap):
            self.fail("model not back to full")

    def close(self):
        for actor in self.actors:
            try:
                if actor.conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                    actor.conn.execute("ROLLBACK")
            except psycopg.Error:
                pass


WALK_SEEDS = 40
WALK_STEPS = 30


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_refund_model_walk(sessions, algorithm):
    """Item 2: seeded random interleavings of two sessions' transactions
    (charges, savepoints, RELEASE, ROLLBACK TO, errors, exception blocks,
    COMMIT, ROLLBACK) with the clock moving, checked after every step
    against the exact model. Every failing seed is reported with its
    sequence."""
    prefix = new_prefix("w")
    a, b, observer = sessions(prefix), sessions(prefix), sessions(prefix)
    failures = []
    conservative = 0
    t0 = time.monotonic()
    for seed in range(WALK_SEEDS):
        walk = Walk(algorithm, seed, a, b, observer, WALK_STEPS)
        try:
            walk.play()
        except Mismatch as e:
            failures.append(str(e))
        except Conservative:
            conservative += 1
        finally:
            walk.close()
    print("%s: %d seeds x %d steps in %.1f s, %d failed, %d ended below the model"
          % (algorithm, WALK_SEEDS, WALK_STEPS, time.monotonic() - t0, len(failures), conservative))
    # most walks must stay exact: only overlaps with a refill may end one
    assert conservative <= WALK_SEEDS // 4, "%d of %d walks ended below the model" % (conservative, WALK_SEEDS)
    if failures:
        pytest.fail("%d of %d seeds differ from the model; the first:\n%s"
                    % (len(failures), WALK_SEEDS, failures[0]))


# ---------------------------------------------------------------- 3. no refund of a passed window


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_refund_never_gives_back_a_passed_window(sessions, algorithm):
    """Item 12: lim 5; A charges 5 in a transaction; the clock moves on (to
    the next window; two windows for sliding_counter, whose previous window
    still counts; a full refill for token_bucket / gcra); B charges 5 and
    commits; A rolls back -> still 0 left: 10 units can never be used in
    one window."""
    prefix = new_prefix("p")
    a, b = sessions(prefix), sessions(prefix)
    identity = new_id()
    lim = 5
    t0 = BASE_MS + 10000
    t1 = t0 + (2 * WINDOW_MS if algorithm == "sliding_counter" else WINDOW_MS)
    set_clock(a, t0)
    a.execute("BEGIN")
    set_clock(a, t0)
    assert decide(a, algorithm, identity, lim, WINDOW_MS, 5)[:3] == (True, 5, 0)
    set_clock(b, t1)
    assert decide(b, algorithm, identity, lim, WINDOW_MS, 5)[:3] == (True, 5, 0)  # autocommit
    set_clock(a, t1)
    a.execute("ROLLBACK")
    assert peek(a, algorithm, identity, lim, WINDOW_MS)[:3] == (True, 5, 0), \
        "the rollback gave back units of a window (or refill) that had passed"
    assert peek(b, algorithm, identity, lim, WINDOW_MS)[:3] == (True, 5, 0), \
        "the rollback gave back units of a window (or refill) that had passed"
    assert decide(b, algorithm, identity, lim, WINDOW_MS, 1)[:3] == (False, 5, 0)


def test_sliding_counter_refund_from_previous_window(sessions):
    """Units taken in the previous window come off the previous count: A
    takes 5 at the end of window N; at the middle of N+1 (weight 1/2, estimate
    2.5) B takes 2; A rolls back -> estimate 2, remaining 3."""
    prefix = new_prefix("sc")
    a, b = sessions(prefix), sessions(prefix)
    identity = new_id()
    t0 = BASE_MS + 59000
    t1 = BASE_MS + WINDOW_MS + 30000
    set_clock(a, t0)
    a.execute("BEGIN")
    set_clock(a, t0)
    assert decide(a, "sliding_counter", identity, 5, WINDOW_MS, 5)[:3] == (True, 5, 0)
    set_clock(b, t1)
    assert decide(b, "sliding_counter", identity, 5, WINDOW_MS, 0)[:3] == (True, 5, 2)
    assert decide(b, "sliding_counter", identity, 5, WINDOW_MS, 2)[:3] == (True, 5, 0)
    set_clock(a, t1)
    a.execute("ROLLBACK")
    assert peek(a, "sliding_counter", identity, 5, WINDOW_MS)[:3] == (True, 5, 3)
    assert peek(b, "sliding_counter", identity, 5, WINDOW_MS)[:3] == (True, 5, 3)


def test_guard_refund_never_gives_back_a_passed_window(sessions, policies, tables):
    """Item 12 through a row guard (default refund_on_abort = guards): 5 rows
    in window N rolled back after another session committed 5 rows in N+1
    leave N+1 at 5 of 5."""
    prefix = new_prefix("gp")
    a = sessions(prefix, refund="guards")
    b = sessions(prefix, refund="guards")
    policy = policies.create(a, "fixed", 5, WINDOW_MS)
    table = tables(a)
    a.execute("CREATE TRIGGER g AFTER INSERT ON %s FOR EACH ROW "
              "EXECUTE FUNCTION rl_guard('%s', 'tenant')" % (table, policy))
    tenant = new_id("tenant")
    insert = "INSERT INTO %s (tenant) SELECT %%s FROM generate_series(1, 5)" % table
    t0, t1 = BASE_MS + 10000, BASE_MS + WINDOW_MS + 10000
    set_clock(a, t0)
    a.execute("BEGIN")
    set_clock(a, t0)
    a.execute(insert, (tenant,))
    set_clock(b, t1)
    b.execute(insert, (tenant,))
    set_clock(a, t1)
    a.execute("ROLLBACK")
    assert policy_peek(a, policy, tenant)[:3] == (True, 5, 0)
    assert policy_peek(b, policy, tenant)[:3] == (True, 5, 0)
    with pytest.raises(psycopg.Error) as excinfo:
        b.execute("INSERT INTO %s (tenant) VALUES (%%s)" % table, (tenant,))
    assert excinfo.value.sqlstate == "PT429"


# ---------------------------------------------------------------- 4. time never runs back


STEP_BACK_FORWARD = [0, 1000, 5000, 6000, 30000, 58000, 59000, 60000, 61000, 62000,
                     90000, 120000, 121000, 181000, 400000]


def expect(conn, model, algorithm, identity, now, cost, what, log):
    set_clock(conn, now)
    got = decide(conn, algorithm, identity, model.lim, model.window, cost)
    ok, remaining, _ = model.charge(now, cost)
    log.append("clock %d: %s -> %s %d (model %s %d)" % (
        now, call_text(algorithm, identity, model.lim, model.window, cost), got[0], got[2], ok, remaining))
    assert (got[0], got[2]) == (ok, remaining), "%s: got %r, model %r\n  %s" % (
        what, got[:3], (ok, remaining), "\n  ".join(log))
    return got


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("offset,back", [(2000, 5000), (2000, 61000), (30000, 5000), (30000, 61000)])
@pytest.mark.parametrize("variant", ["full", "partial"])
def test_time_never_runs_back(sessions, algorithm, offset, back, variant):
    """Item 16: at T (offset ms into a window) take the whole limit (full) or
    6 of 10 (partial); set the clock `back` ms earlier: the state is read as
    of T, so nothing beyond the limit is admitted (partial: exactly the 4
    left, stamped at T); then forward again, every result as the model's."""
    conn = sessions(new_prefix("b"))
    identity = new_id()
    lim = 10
    model = KeyModel(algorithm, lim, WINDOW_MS)
    T = BASE_MS + offset
    log = []
    if variant == "full":
        for n in range(lim):
            expect(conn, model, algorithm, identity, T, 1, "charge %d at T" % n, log)
    else:
        expect(conn, model, algorithm, identity, T, 6, "charge 6 at T", log)
    expect(conn, model, algorithm, identity, T, 0, "peek at T", log)

    back_at = T - back
    expect(conn, model, algorithm, identity, back_at, 0, "peek at T - %d" % back, log)
    if variant == "full":
        for cost in (1, lim, 1):
            got = expect(conn, model, algorithm, identity, back_at, cost,
                         "charge %d at T - %d" % (cost, back), log)
            assert got[0] is False
    else:
        for n in range(4):
            got = expect(conn, model, algorithm, identity, back_at, 1,
                         "charge 1 (%d) at T - %d" % (n, back), log)
            assert got[0] is True
        got = expect(conn, model, algorithm, identity, back_at, 1, "charge 1 beyond at T - %d" % back, log)
        assert got[0] is False
    for d in STEP_BACK_FORWARD:
        expect(conn, model, algorithm, identity, T + d, 0, "peek at T + %d" % d, log)
        expect(conn, model, algorithm, identity, T + d, 1, "charge 1 at T + %d" % d, log)


# ---------------------------------------------------------------- 5. every accepted parameter


def log_uniform(rng, lo, hi):
    if lo >= hi:
        return lo
    x = int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))
    return min(max(x, lo), hi)


def gen_case(rng, algorithm):
    """(lim, window_ms, burst, cost, valid) over the accepted space, plus
    bursts just outside the refill constraint for token_bucket / gcra."""
    lim_hi = 10000 if algorithm == "sliding" else LIM_MAX
    lim = rng.choice([1, 2, 3, lim_hi, lim_hi - 1, log_uniform(rng, 1, lim_hi), log_uniform(rng, 1, lim_hi)])
    window = rng.choice([1, 2, 1000, 60000, WINDOW_MAX_MS, WINDOW_MAX_MS - 1,
                         log_uniform(rng, 1, WINDOW_MAX_MS), log_uniform(rng, 1, WINDOW_MAX_MS)])
    burst = None
    valid = True
    if algorithm in BUCKETS and rng.random() < 0.8:
        bmax = min(LIM_MAX, lim * WINDOW_MAX_MS // window)
        if bmax < LIM_MAX and rng.random() < 0.25:
            burst = rng.choice([bmax + 1, log_uniform(rng, bmax + 1, LIM_MAX), LIM_MAX])
            valid = False
        else:
            burst = rng.choice([1, bmax, max(bmax - 1, 1), log_uniform(rng, 1, bmax), lim if lim <= bmax else bmax])
    cap = burst if burst is not None else lim
    cost = rng.choice([0, 1, cap, max(cap - 1, 0), cap // 2, rng.randint(0, cap)])
    if algorithm == "sliding":
        cost = min(cost, 2000)  # one log entry per unit: keep the test quick
    return lim, window, burst, cost, valid


FIRST_CASES = 120


def state_ms(algorithm, lim, window, cost, now):
    """How long (ms) the state of a first call of `cost` at `now` matters:
    to the window's end (fixed), one window (sliding), to the end of the
    next window (sliding_counter), until the cost has refilled (buckets)."""
    if algorithm == "fixed":
        return window - now % window
    if algorithm == "sliding":
        return window
    if algorithm == "sliding_counter":
        return 2 * window - now % window
    return Fraction(cost * window, lim)


@pytest.mark.parametrize("clock", [BASE_MS, CLOCK_MAX_MS])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_first_decision_every_parameter(sessions, shared_redis, algorithm, clock):
    """Item 6: on fresh identities over the accepted parameter space the
    first call never errors, is allowed when cost <= capacity, leaves
    capacity - cost, and every key it writes has a TTL; a burst that cannot
    refill within 100 years is 22023 and writes nothing."""
    prefix = new_prefix("f")
    conn = sessions(prefix, clock=clock)
    rng = random.Random(ALGORITHMS.index(algorithm) * 1000003 + clock % 1000003)
    failures = []
    for n in range(FIRST_CASES):
        lim, window, burst, cost, valid = gen_case(rng, algorithm)
        cap = burst if burst is not None else lim
        identity = "first-%d-%s" % (n, uuid.uuid4().hex[:8])
        text = "%s at clock %d" % (call_text(algorithm, identity, lim, window, cost, burst), clock)
        if algorithm not in BUCKETS:
            burst = None
        try:
            got = decide(conn, algorithm, identity, lim, window, cost, burst)
        except psycopg.Error as e:
            got = None
            if valid or e.sqlstate != "22023":
                failures.append("%s: error %s %s" % (text, e.sqlstate, str(e).splitlines()[0]))
        else:
            if not valid:
                failures.append("%s: %r, expected SQLSTATE 22023 (burst %d cannot refill in 100 years)"
                                % (text, got, burst))
            elif (got[0], got[1], got[2], got[4]) != (True, cap, cap - cost, 0):
                failures.append("%s: (allowed, lim, remaining, retry_after_ms) = %r, expected %r"
                                % (text, (got[0], got[1], got[2], got[4]), (True, cap, cap - cost, 0)))
        keys = keys_of(shared_redis, prefix, identity)
        if not valid and keys:
            failures.append("%s: rejected call wrote %r" % (text, keys))
        # the TTL a written state needs at least (real time, taken from the
        # test clock); below 2 s the key may be gone before we look
        long_lived = valid and cost > 0 and state_ms(algorithm, lim, window, cost, clock) >= 2000
        if long_lived and got is not None and got[0] and not keys:
            failures.append("%s: allowed with cost %d but no key was written" % (text, cost))
        for key in keys:
            pttl = shared_redis.command("PTTL", key)
            if pttl == -1 or (long_lived and not pttl > 0):
                failures.append("%s: key %r has PTTL %r" % (text, key, pttl))
    # nothing under the prefix is left without an expiry
    for key in scan_keys(shared_redis, glob_escape(prefix) + "*"):
        pttl = shared_redis.command("PTTL", key)
        if pttl == -1:
            failures.append("key %r has PTTL %r" % (key, pttl))
    assert not failures, "%d problems:\n%s" % (len(failures), "\n".join(failures[:25]))


def test_refill_constraint_regressions(sessions, shared_redis):
    """Item 6, named cases."""
    prefix = new_prefix("r")
    conn = sessions(prefix, clock=BASE_MS)
    for algorithm, identity, args in [
        ("token_bucket", "x", (1, WINDOW_MAX_MS, 10000000, 10000000)),
        ("gcra", "g", (1, WINDOW_MAX_MS, 3000, 3000)),
    ]:
        with pytest.raises(psycopg.Error) as excinfo:
            decide(conn, algorithm, identity, args[0], args[1], args[2], args[3])
        assert excinfo.value.sqlstate == "22023", (algorithm, args, str(excinfo.value))
        assert keys_of(shared_redis, prefix, identity) == []
    got = decide(conn, "gcra", "g2", 1, WINDOW_MAX_MS, 1, 1)
    assert (got[0], got[1], got[2], got[4]) == (True, 1, 0, 0)
    keys = keys_of(shared_redis, prefix, "g2")
    assert keys
    for key in keys:
        assert shared_redis.command("PTTL", key) > 0, key
    # the next unit comes back after 100 years
    got = decide(conn, "gcra", "g2", 1, WINDOW_MAX_MS, 1, 1)
    assert (got[0], got[2]) == (False, 0) and 0 < got[4] <= WINDOW_MAX_MS


def test_first_decision_exact_remaining(sessions):
    """Item 6, named cases: the first call's remaining is capacity - cost
    exactly, also when one unit is left of a large capacity (a rounding
    edge of (tolerance - backlog) / interval)."""
    conn = sessions(new_prefix("x"), clock=BASE_MS)
    for algorithm in BUCKETS:
        for lim, window, cost, burst in [
            (1000000000, 1000, 999999999, None),
            (300000000, 60000, 299999999, None),
            (115782052, 335964556, 115782051, None),
            (429, 1000, 2147483645, 2147483646),
        ]:
            cap = burst if burst is not None else lim
            identity = new_id()
            got = decide(conn, algorithm, identity, lim, window, cost, burst)
            assert (got[0], got[1], got[2]) == (True, cap, cap - cost), \
                (call_text(algorithm, identity, lim, window, cost, burst), got)
            # the unit left is there: a call of 1 at the same moment gets it
            got = decide(conn, algorithm, identity, lim, window, 1, burst)
            assert (got[0], got[1], got[2]) == (True, cap, cap - cost - 1), \
                ("then " + call_text(algorithm, identity, lim, window, 1, burst), got)


# The keys of KEYS that have no expiry.
WITHOUT_TTL = """local out = {}
for _, key in ipairs(KEYS) do
  if redis.call('PTTL', key) == -1 then out[#out + 1] = key end
end
return out"""


@pytest.mark.parametrize("algorithm", BUCKETS)
def test_sub_millisecond_state_keeps_a_ttl(sessions, shared_redis, algorithm):
    """Item 6: a state that is back to full in less than a millisecond
    (2147483646 per 2 ms, cost 1) under refund_on_abort = all, where the
    call also writes a refund record: no key may ever be left without a TTL.
    Each call has a small chance (about 1 in 2000 on the test machine) of
    leaving one, so up to 12000 calls are made, in pipelined batches,
    stopping at the first key without a TTL."""
    prefix = new_prefix("t")
    conn = sessions(prefix, refund="all", clock=BASE_MS)
    q = call_sql(algorithm, True)
    without_ttl = []
    calls = 0
    while calls < 12000 and not without_ttl:
        with conn.pipeline():
            for _ in range(3000):
                conn.execute(q, (new_id(), 2147483646, 2, 1, 2147483646))
        calls += 3000
        keys = scan_keys(shared_redis, glob_escape(prefix) + "*")
        # (a key written on the test clock lives at least 10 s: they are all
        # still there, so they are checked in one round trip)
        without_ttl = shared_redis.command("EVAL", WITHOUT_TTL, len(keys), *keys) if keys else []
    assert without_ttl == [], "after %d calls, %d keys without TTL, e.g. %r = %r" % (
        calls, len(without_ttl), without_ttl[0], shared_redis.command("HGETALL", without_ttl[0]))


EXACT_PARAMS = [
    (10000000, 1000, 1000000000),    # 1e7 per s, interval 0.1 us
    (100000000, 1000, 2147483647),   # 1e8 per s, interval 0.01 us
    (10, 60000, None),               # ordinary
    (3, 10000, 5),                   # interval 3333333.33 us
]


@pytest.mark.parametrize("params", EXACT_PARAMS, ids=lambda p: "%d_%d_%s" % p)
@pytest.mark.parametrize("algorithm", BUCKETS)
def test_decisions_agree_with_exact_arithmetic(sessions, algorithm, params):
    """Item 6 ("results agree with exact integer arithmetic"), also at
    rates above 10^6 per second: a seeded walk of calls on whole
    milliseconds, every (allowed, remaining) compared with the exact model.

    Keys expire in real time by TTLs taken from the test clock, so every
    write here leaves a state that needs at least 2 s (test clock) to refill:
    a key can then only vanish once the test clock has passed the moment
    its state is full anyway (the walk's clock runs far faster than real
    time)."""
    lim, window, burst = params
    conn = sessions(new_prefix("xa"), refund="off")
    identity = new_id()
    model = KeyModel(algorithm, lim, window, burst)
    cap = model.cap
    min_deficit = max(1, -(-lim * 2000 // window))  # units refilled in 2 s, rounded up
    assert min_deficit < cap
    rng = random.Random(lim + window + (burst or 0) + 17 * BUCKETS.index(algorithm))
    now = BASE_MS + 1000
    log = []
    for step in range(150):
        now += rng.choice([0, 0, 1, 2, 3, 7, 50, 200, 1000])
        set_clock(conn, now)
        left = model.decide(now, 0)[1]
        cost = rng.choice([0, 1, left, left + 1, left - 1, rng.randint(1, cap), cap])
        if 0 < cost <= left:
            cost = max(cost, left - (cap - min_deficit))  # leaves >= min_deficit to refill
        cost = max(0, min(cap, cost))
        got = decide(conn, algorithm, identity, lim, window, cost, burst)
        ok, remaining, _ = model.charge(now, cost)
        log.append("clock %d: %s -> %r (model %s %d)" % (
            now, call_text(algorithm, identity, lim, window, cost, burst), got[:3], ok, remaining))
        assert (got[0], got[1], got[2]) == (ok, cap, remaining), "step %d differs from the model:\n  %s" % (
            step, "\n  ".join(log[-8:]))


# ---------------------------------------------------------------- 6. retry_after_ms is never early


RETRY_PARAMS = [
    (2000000000, 1000, None),       # 2e9 per s
    (2000000000, 1000, 500000000),
    (3000000, 1, None),             # 3e9 per s
    (2147483647, 1, None),          # 2.1e12 per s
    (2147483647, 1000, 1000),
    (10, 60000, None),
    (3, 1000, None),
    (7, 1000, 3),
    (100, 86400000, 250),
    (1000, 1000, 1),
]
RETRY_STEPS = 300
# The walk is on the frozen clock; a key written on it lives at least 10 s of
# real time (common.lua), so the state survives from one call to the next
# even at limits whose whole refill is a millisecond.


@pytest.mark.parametrize("params", RETRY_PARAMS, ids=lambda p: "%d_%d_%s" % p)
@pytest.mark.parametrize("algorithm", BUCKETS)
def test_retry_after_is_never_early(sessions, algorithm, params):
    """Item 18: a random walk of denials; after each denial with
    retry_after_ms = r, the same call r ms later is allowed."""
    lim, window, burst = params
    cap = burst if burst is not None else lim
    conn = sessions(new_prefix("ra"))
    identity = new_id()
    rng = random.Random(lim * 31 + window * 7 + (burst or 0) + BUCKETS.index(algorithm))
    refill_ms = cap * window / lim  # time to refill the whole capacity
    per_ms = lim / window
    now = BASE_MS + rng.randrange(1000)
    denials = 0
    log = []
    for step in range(RETRY_STEPS):
        dt = rng.choice([0, 1, 2, 7, int(refill_ms * 0.001), int(refill_ms * 0.01),
                         int(refill_ms * 0.1), int(refill_ms * 0.3)])
        now += dt
        set_clock(conn, now)
        left = peek(conn, algorithm, identity, lim, window, burst)[2]
        how = rng.random()
        if how < 0.3:
            cost = rng.randint(1, cap)
        elif how < 0.55:
            cost = left + rng.randint(1, 3)
        elif how < 0.85:
            # just over a whole number of ms of refill: the rounding edge
            cost = left + int(rng.randint(1, 3) * per_ms) + rng.randint(1, 3)
        else:
            cost = cap
        cost = max(1, min(cost, cap))
        got = decide(conn, algorithm, identity, lim, window, cost, burst)
        log.append("clock %d: %s -> %r" % (now, call_text(algorithm, identity, lim, window, cost, burst), got))
        if got[0]:
            continue
        denials += 1
        r = got[4]
        assert r >= 1, "denied call of cost %d <= capacity %d has retry_after_ms %r\n  %s" % (
            cost, cap, r, "\n  ".join(log[-10:]))
        now += r
        set_clock(conn, now)
        again = decide(conn, algorithm, identity, lim, window, cost, burst)
        log.append("clock %d: %s -> %r" % (now, call_text(algorithm, identity, lim, window, cost, burst), again))
        assert again[0] is True, "retry_after_ms %d was early: the same call %d ms later was denied %r\n  %s" % (
            r, r, again, "\n  ".join(log[-10:]))
        assert now <= CLOCK_MAX_MS
    print("%s %r: %d denials in %d steps" % (algorithm, params, denials, step + 1))
    assert denials >= 20
