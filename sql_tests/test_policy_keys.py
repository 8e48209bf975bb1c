"""Policy keys carry the numbers their state means something under (issue
19, finding 1, and its review).

Databases (or servers) that share a Redis and rl_redis.key_prefix may each
define a policy of one name with other numbers. Up to 1.5 the key of a
policy was <prefix><algorithm>:{<identity>}:<policy>, so both counted on
one key, each under its own numbers: an ordinary role that called through
both in turn reset the count of the other (30 of 30 allowed under "5 per
60 s"). A policy's key is now

    <prefix><algorithm>:{<identity>}:<policy>:<lim>/<window_ms>[/<burst>]
        token_bucket and gcra: a bucket's level depends on rate and capacity
    <prefix><algorithm>:{<identity>}:<policy>:/<window_ms>
        fixed, sliding and sliding_counter: a count over the window; lim is
        only the threshold each call compares it with
    <prefix>concurrency:{<identity>}:<policy>
        slots: a set of absolute lease ends, compared with lim by number

so numbers that would give a state another meaning count on a key of their
own, on every path (rl_check, rl_check_many, rl_check_all, row and
statement guards, rl_acquire, refunds), while a change of a count's lim
keeps the count (a tightened limit holds at once) and databases whose
policy differs only in lim share one count (slots: whatever the numbers),
each call admitted only under its own database's lim.

The calls come from an ordinary role (SET ROLE from a superuser session,
which sets the test clock between steps; rl_redis.test_clock_ms is
superuser-only).
"""

import uuid

import psycopg
from psycopg import sql
import pytest

from conftest import KEY_KINDS, fixed_units, new_ident, pg_connect, rl_key, set_gucs

# a test clock on a whole minute, not on a multiple of 7 s
BASE_CLOCK_MS = 1000000020000

# per algorithm: the calling database's numbers and the other database's
# (lim, window_ms, burst) for the same policy name
NUMBERS = {
    "fixed": ((5, 60000, None), (5, 7000, None)),
    "sliding": ((5, 60000, None), (5, 7000, None)),
    "sliding_counter": ((5, 60000, None), (5, 7000, None)),
    "token_bucket": ((5, 60000, None), (5, 7000, 8)),
    "gcra": ((5, 60000, None), (5, 7000, 8)),
}


def uid():
    return uuid.uuid4().hex[:12]


@pytest.fixture(scope="module")
def role():
    """An ordinary role, no privileges beyond PUBLIC's."""
    name = "rl_polkeys_%s" % uid()
    with pg_connect() as pg:
        pg.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(name)))
    yield name
    with pg_connect() as pg:
        pg.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (name,))
        pg.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


@pytest.fixture(scope="module")
def other_db():
    """A second database of the test server with the extension, on the same
    Redis and key prefix as the test database."""
    name = "rl_polkeys_%s" % uid()
    with pg_connect() as pg:
        pg.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        with pg_connect(dbname=name) as conn:
            conn.execute("CREATE EXTENSION rl_redis")
        yield name
    finally:
        with pg_connect() as pg:
            pg.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


class Caller:
    """A session of the ordinary role in one database, on the test clock."""

    def __init__(self, role, dbname=None):
        self.role = role
        self.conn = pg_connect(dbname=dbname) if dbname else pg_connect()

    def at(self, clock_ms, **gucs):
        """Sets the test clock (and the superuser settings gucs)."""
        self.conn.execute("RESET ROLE")
        set_gucs(self.conn, test_clock_ms=clock_ms, **gucs)
        self.conn.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(self.role)))

    def allow(self, policy, identity):
        return self.conn.execute("SELECT rl_allow(%s, %s)", (policy, identity)).fetchone()[0]

    def close(self):
        self.conn.close()


@pytest.fixture
def env(role, other_db):
    """Makes policies of one name in both databases, and callers; removes
    them at teardown."""

    class Env:
        def __init__(self):
            self.here = pg_connect()
            self.there = pg_connect(dbname=other_db)
            self.callers = []
            self.names = []

        def policy(self, algorithm, mine, theirs):
            name = new_ident("polkeys")
            for conn, (lim, window_ms, burst) in ((self.here, mine), (self.there, theirs)):
                conn.execute("INSERT INTO rl_policy (name, algorithm, lim, window_ms, burst) "
                             "VALUES (%s, %s, %s, %s, %s)", (name, algorithm, lim, window_ms, burst))
            self.names.append(name)
            return name

        def caller(self, dbname=None):
            c = Caller(role, dbname)
            self.callers.append(c)
            return c

        def cleanup(self):
            for c in self.callers:
                c.close()
            for conn in (self.here, self.there):
                conn.execute("DELETE FROM rl_policy WHERE name = ANY(%s)", (self.names,))
                conn.close()

    e = Env()
    try:
        yield e
    finally:
        e.cleanup()


def run(steps, policy, identity, here=None, there=None):
    """Runs steps (clock_ms, calls here, calls there) on identity through
    the callers given and returns the decisions (here's, there's)."""
    mine, theirs = [], []
    for clock, n_here, n_there in steps:
        if there is not None:
            there.at(clock)
            theirs += [there.allow(policy, identity) for _ in range(n_there)]
        if here is not None:
            here.at(clock)
            mine += [here.allow(policy, identity) for _ in range(n_here)]
    return mine, theirs


@pytest.mark.parametrize("algorithm", sorted(NUMBERS))
def test_two_databases_same_policy_other_numbers(env, other_db, algorithm):
    """One policy name, 5 per 60 s here and 5 per 7 s (burst 8 for the
    bucket and GCRA) in the other database; an ordinary role calls through both in turn, every 8 s of the
    test clock for 48 s. Each database decides exactly as it would alone:
    the other's calls neither reset nor share its count (1.5 before the
    fix: a fixed window allowed here all 21 calls of 21)."""
    mine, theirs = NUMBERS[algorithm]
    policy = env.policy(algorithm, mine, theirs)
    here, there = env.caller(), env.caller(other_db)
    steps = [(BASE_CLOCK_MS + k * 8000, 3, 2) for k in range(7)]

    both = run(steps, policy, new_ident("polkeys_both"), here, there)
    here_alone = run(steps, policy, new_ident("polkeys_here"), here=here)[0]
    there_alone = run(steps, policy, new_ident("polkeys_there"), there=there)[1]
    assert both == (here_alone, there_alone)
    # 5 at once, 4 refilled in 48 s at most
    assert sum(here_alone) <= 9


def acquire(caller, policy, identity):
    return caller.conn.execute("SELECT rl_acquire_allow(%s, %s)", (policy, identity)).fetchone()[0]


def test_two_databases_same_concurrency_policy_other_numbers(env, other_db, shared_redis):
    """A concurrency policy of one name: 2 slots (60 s lease) here, 3 slots
    (30 s lease) in the other database. The slots are one set, which each
    database compares with its own lim: an acquire is admitted only while
    fewer than the caller's lim are held, through either database (before
    the fix: one set per set of numbers, so 2 + 3 held at once)."""
    policy = env.policy("concurrency", (2, 60000, None), (3, 30000, None))
    here, there = env.caller(), env.caller(other_db)
    identity = new_ident("polkeys_cc")
    key = "rl:concurrency:{%s}:%s" % (identity, policy)
    got = []
    for c in (here, there):
        c.at(BASE_CLOCK_MS)
        c.conn.execute("BEGIN")
    try:
        for caller, lim in [(here, 2)] + [(there, 3)] * 4 + [(here, 2)] * 2:
            held = shared_redis.command("ZCARD", key)
            ok = acquire(caller, policy, identity)
            assert ok == (held < lim)
            got.append(ok)
    finally:
        for c in (here, there):
            c.conn.execute("COMMIT")
    assert got == [True, True, True, False, False, False, False]
    assert shared_redis.command("EXISTS", key) == 0


def test_concurrency_policy_change_never_holds_more_than_lim(env, shared_redis):
    """The owner changes a concurrency policy's lease, then its lim, while
    slots are held: the slots held still count (one set, whatever the
    numbers; a slot's lease is its own end time), so no more than the
    current lim are ever held (before the fix: a lease change gave a new,
    empty set, and 2 x lim slots could be held)."""
    policy = env.policy("concurrency", (2, 60000, None), (2, 60000, None))
    me = env.caller()
    me.at(BASE_CLOCK_MS)
    identity = new_ident("polkeys_cc_change")
    key = "rl:concurrency:{%s}:%s" % (identity, policy)
    me.conn.execute("BEGIN")
    try:
        assert [acquire(me, policy, identity) for _ in range(3)] == [True, True, False]
        env.here.execute("UPDATE rl_policy SET window_ms = 30000 WHERE name = %s", (policy,))
        assert acquire(me, policy, identity) is False
        env.here.execute("UPDATE rl_policy SET lim = 3 WHERE name = %s", (policy,))
        assert [acquire(me, policy, identity) for _ in range(2)] == [True, False]
        assert keys_of(shared_redis, identity) == {key}
        assert shared_redis.command("ZCARD", key) == 3
        env.here.execute("UPDATE rl_policy SET lim = 1 WHERE name = %s", (policy,))
        assert acquire(me, policy, identity) is False
    finally:
        me.conn.execute("COMMIT")
    assert shared_redis.command("EXISTS", key) == 0


@pytest.mark.parametrize("algorithm,old,new", [
    ("fixed", (5, 60000, None), (8, 30000, None)),
    ("sliding_counter", (5, 60000, None), (8, 30000, None)),
    ("token_bucket", (5, 60000, None), (8, 60000, None)),
    ("gcra", (5, 60000, None), (5, 60000, 8)),
])
def test_changed_numbers_of_the_state_start_a_fresh_count(env, shared_redis, algorithm, old, new):
    """The owner changes numbers that the state means something under (the
    window of a count; the rate or capacity of a bucket): the next call
    counts afresh under the new ones, on their key; the state under the old
    numbers stays until its expiry and counts again if the old numbers come
    back."""
    policy = env.policy(algorithm, old, old)
    me = env.caller()
    me.at(BASE_CLOCK_MS)
    identity = new_ident("polkeys_change")
    old_key = rl_key(algorithm, identity, policy, *old)
    new_key = rl_key(algorithm, identity, policy, *new)
    assert old_key != new_key

    assert [me.allow(policy, identity) for _ in range(6)] == [True] * 5 + [False]
    env.here.execute("UPDATE rl_policy SET lim = %s, window_ms = %s, burst = %s WHERE name = %s",
                     new + (policy,))
    assert [me.allow(policy, identity) for _ in range(9)] == [True] * 8 + [False]
    # a sliding counter's state lives for two windows
    assert 0 < shared_redis.command("PTTL", old_key) <= 2 * 60000
    assert keys_of(shared_redis, identity) == {old_key, new_key}

    env.here.execute("UPDATE rl_policy SET lim = %s, window_ms = %s, burst = %s WHERE name = %s",
                     old + (policy,))
    assert me.allow(policy, identity) is False


def keys_of(redis, identity):
    return set(redis.command("KEYS", "rl:*{%s}*" % identity))


PATHS = ["rl_check", "rl_check_many", "rl_check_all", "row_guard", "statement_guard"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("algorithm,lim,window_ms,burst", [
    ("fixed", 3, 60000, None),
    ("token_bucket", 3, 60000, 7),
])
def test_every_path_counts_on_the_numbered_key(env, shared_redis, path, algorithm, lim,
                                                window_ms, burst):
    """Every way an ordinary role decides a policy writes one key, the one
    that carries the policy's numbers: decisions, batches, several limits
    and both guards share that one counter."""
    policy = env.policy(algorithm, (lim, window_ms, burst), (lim, window_ms, burst))
    identity = new_ident("polkeys_path")
    owner = env.here
    me = env.caller()
    if path in ("row_guard", "statement_guard"):
        table = "rl_polkeys_%s" % uid()
        owner.execute(sql.SQL("CREATE TABLE {} (tenant text NOT NULL)").format(sql.Identifier(table)))
        if path == "row_guard":
            trigger = "AFTER INSERT ON {} FOR EACH ROW EXECUTE FUNCTION rl_guard({}, 'tenant')"
        else:
            trigger = ("AFTER INSERT ON {} REFERENCING NEW TABLE AS n FOR EACH STATEMENT "
                       "EXECUTE FUNCTION rl_guard_statement({}, 'tenant')")
        owner.execute(sql.SQL("CREATE TRIGGER guard " + trigger).format(
            sql.Identifier(table), sql.Literal(policy)))
        owner.execute(sql.SQL("GRANT INSERT ON {} TO {}").format(sql.Identifier(table),
                                                                 sql.Identifier(me.role)))
    query = {
        "rl_check": "SELECT rl_allow(%(p)s, %(i)s)",
        "rl_check_many": "SELECT allowed FROM rl_check_many(%(p)s, ARRAY[%(i)s])",
        "rl_check_all": "SELECT rl_allow_all(ARRAY[%(p)s], %(i)s)",
        "row_guard": "INSERT INTO {t} VALUES (%(i)s)",
        "statement_guard": "INSERT INTO {t} VALUES (%(i)s)",
    }[path]
    try:
        me.at(BASE_CLOCK_MS)
        if path in ("row_guard", "statement_guard"):
            query = sql.SQL(query).format(t=sql.Identifier(table))
        for _ in range(2):
            me.conn.execute(query, {"p": policy, "i": identity})
        key = rl_key(algorithm, identity, policy=policy, lim=lim, window_ms=window_ms, burst=burst)
        assert keys_of(shared_redis, identity) == {key}
        # the key is the one rl_check counts on
        assert me.conn.execute("SELECT (rl_check(%s, %s, 0)).remaining",
                               (policy, identity)).fetchone() == ((burst or lim) - 2,)
    finally:
        if path in ("row_guard", "statement_guard"):
            owner.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(table)))


def test_acquire_holds_its_slot_on_the_policy_key(env, shared_redis):
    """rl_acquire takes its slot on <prefix>concurrency:{<identity>}:<policy>,
    a key without numbers."""
    policy = env.policy("concurrency", (2, 60000, None), (2, 60000, None))
    identity = new_ident("polkeys_slot")
    me = env.caller()
    me.at(BASE_CLOCK_MS)
    me.conn.execute("BEGIN")
    assert me.conn.execute("SELECT rl_acquire_allow(%s, %s)", (policy, identity)).fetchone() == (True,)
    key = "rl:concurrency:{%s}:%s" % (identity, policy)
    assert rl_key("concurrency", identity, policy=policy, lim=2, window_ms=60000) == key
    assert keys_of(shared_redis, identity) == {key}
    assert shared_redis.command("ZCARD", key) == 1
    me.conn.execute("COMMIT")
    assert keys_of(shared_redis, identity) == set()


def test_reset_deletes_policy_keys_of_every_format(env, shared_redis):
    """rl_reset deletes the identity's policy keys of this version and of
    earlier ones (<prefix><algorithm>:{<identity>}:<policy>, which this
    version no longer reads), and no key of another identity."""
    policy = env.policy("fixed", (5, 60000, None), (5, 60000, None))
    identity, other = new_ident("polkeys_reset"), new_ident("polkeys_reset")
    for i in (identity, other):
        shared_redis.command("HSET", "rl:fixed:{%s}:%s" % (i, policy), "n", "1")
        shared_redis.command("PEXPIRE", "rl:fixed:{%s}:%s" % (i, policy), "60000")
        assert env.here.execute("SELECT rl_allow(%s, %s)", (policy, i)).fetchone() == (True,)
        assert len(keys_of(shared_redis, i)) == 2
    env.here.execute("SELECT rl_reset(%s)", (identity,))
    assert keys_of(shared_redis, identity) == set()
    assert keys_of(shared_redis, other) == {
        "rl:fixed:{%s}:%s" % (other, policy),
        rl_key("fixed", other, policy=policy, lim=5, window_ms=60000)}
    env.here.execute("SELECT rl_reset(%s)", (other,))


@pytest.mark.parametrize("algorithm", ["fixed", "sliding_counter"])
def test_earlier_layout_is_not_read_and_reset_deletes_it(env, shared_redis, algorithm):
    """Release 1.5 kept a fixed window's and a sliding counter's state in a
    hash under the kind fixed / sliding_counter; this one packs it in a
    string under fixed.2 / sliding_counter.2, so that a session still
    running 1.5 never meets a key it cannot read. A used-up 1.5 hash of the
    same identity and limit is not read (the first call starts a new count:
    remaining lim - 1) and stays a hash, and rl_reset deletes both."""
    identity = new_ident("layout_" + algorithm)
    old = "rl:%s:{%s}:5/60000" % (algorithm, identity)
    fields = ["w", "0", "n", "5", "c", "5", "ts", "0", "e", "1", "l", "5/60000/0"]
    shared_redis.command("HSET", old, *fields)
    shared_redis.command("PEXPIRE", old, "60000")
    assert env.here.execute("SELECT remaining FROM rl_%s(%%s, 5, 60000)" % algorithm,
                            (identity,)).fetchone() == (4,)
    new = rl_key(algorithm, identity, lim=5, window_ms=60000)
    assert new == "rl:%s.2:{%s}:5/60000" % (algorithm, identity)
    assert (shared_redis.command("TYPE", old), shared_redis.command("TYPE", new)) == ("hash", "string")
    assert keys_of(shared_redis, identity) == {old, new}
    env.here.execute("SELECT rl_reset(%s)", (identity,))
    assert keys_of(shared_redis, identity) == set()


WINDOW_ALGORITHMS = ["fixed", "sliding", "sliding_counter"]


@pytest.mark.parametrize("algorithm", WINDOW_ALGORITHMS)
def test_changed_lim_keeps_the_count(env, shared_redis, algorithm):
    """The state of a fixed, sliding or sliding_counter policy is a count
    over its window; lim is only the threshold it is compared with, so the
    key carries window_ms alone (<policy>:/<window_ms>). Tightening 8 -> 5
    during abuse denies at once, as the 8 taken still count; raising 5 -> 9
    admits one more, not 9 (before the fix: a fresh quota after each
    change)."""
    policy = env.policy(algorithm, (8, 60000, None), (8, 60000, None))
    me = env.caller()
    me.at(BASE_CLOCK_MS)
    identity = new_ident("polkeys_tighten")

    assert [me.allow(policy, identity) for _ in range(9)] == [True] * 8 + [False]
    env.here.execute("UPDATE rl_policy SET lim = 5 WHERE name = %s", (policy,))
    assert [me.allow(policy, identity) for _ in range(3)] == [False] * 3
    env.here.execute("UPDATE rl_policy SET lim = 9 WHERE name = %s", (policy,))
    assert [me.allow(policy, identity) for _ in range(3)] == [True, False, False]
    assert keys_of(shared_redis, identity) == {
        "rl:%s:{%s}:%s:/60000" % (KEY_KINDS.get(algorithm, algorithm), identity, policy)}


def shared_count_model(algorithm, window_ms, calls):
    """What one shared count decides for calls [(clock_ms, lim)], each call
    of one unit admitted only when the count allows it under the caller's
    own lim: fixed, the units in the call's window; sliding, the units of
    the last window_ms; sliding_counter, the previous window's units
    weighted by its overlap plus the current window's."""
    admitted = []
    out = []
    for clock, lim in calls:
        idx = clock // window_ms
        if algorithm == "fixed":
            used = sum(1 for t in admitted if t // window_ms == idx)
        elif algorithm == "sliding":
            used = sum(1 for t in admitted if t > clock - window_ms)
        else:
            into = clock - idx * window_ms
            cur = sum(1 for t in admitted if t // window_ms == idx)
            prev = sum(1 for t in admitted if t // window_ms == idx - 1)
            used = prev * (window_ms - into) / window_ms + cur
        ok = used + 1 <= lim + 1e-9
        if ok:
            admitted.append(clock)
        out.append(ok)
    return out


@pytest.mark.parametrize("algorithm", WINDOW_ALGORITHMS)
def test_two_databases_same_window_other_lims_share_one_count(env, other_db, algorithm):
    """One policy name, 5 per 60 s here and 3 per 60 s in the other
    database: both count on one key, and each call is admitted only when
    the shared count allows it under the calling database's own lim, so
    neither admits more than its lim in any window, whatever the other
    does. The calls come every 8 s of the test clock for 72 s, across a
    window's end (before the fix: two counts, 5 and 3 per window)."""
    policy = env.policy(algorithm, (5, 60000, None), (3, 60000, None))
    here, there = env.caller(), env.caller(other_db)
    identity = new_ident("polkeys_share")
    calls = []
    got = []
    for k in range(10):
        clock = BASE_CLOCK_MS + k * 8000
        for caller, lim, n in ((there, 3, 1), (here, 5, 2)):
            caller.at(clock)
            for _ in range(n):
                calls.append((clock, lim))
                got.append(caller.allow(policy, identity))
    assert got == shared_count_model(algorithm, 60000, calls)
    assert sum(got) < len(got)


def test_refund_after_a_lim_change_gives_back_nothing(env, shared_redis):
    """A transaction takes 3 units under 5 per 60 s; the policy becomes 8
    per 60 s (the same key) and another session takes 1 under it; the
    transaction rolls back. The key was last written under another lim, so
    its units can no longer be told apart and the refund gives back
    nothing: never too much."""
    policy = env.policy("fixed", (5, 60000, None), (5, 60000, None))
    me, other = env.caller(), env.caller()
    me.at(BASE_CLOCK_MS, refund_on_abort="all")
    other.at(BASE_CLOCK_MS)
    identity = new_ident("polkeys_refund")
    key = "rl:fixed.2:{%s}:%s:/60000" % (identity, policy)

    me.conn.execute("BEGIN")
    assert [me.allow(policy, identity) for _ in range(3)] == [True] * 3
    env.here.execute("UPDATE rl_policy SET lim = 8 WHERE name = %s", (policy,))
    assert other.allow(policy, identity) is True
    me.conn.execute("ROLLBACK")
    assert fixed_units(shared_redis.command("GET", key)) == "4"
    assert other.conn.execute("SELECT (rl_check(%s, %s, 0)).remaining",
                              (policy, identity)).fetchone() == (4,)


@pytest.mark.parametrize("algorithm", ["token_bucket", "gcra"])
def test_burst_equal_to_lim_is_no_burst(env, other_db, shared_redis, algorithm):
    """A burst of NULL and a burst equal to lim are the same capacity, so
    one key: <lim>/<window_ms> without the burst, for explicit arguments
    and for a policy (before the fix: two keys, two buckets)."""
    pg = env.here
    pg.execute("SELECT set_config('rl_redis.test_clock_ms', %s, false)", (str(BASE_CLOCK_MS),))
    identity = new_ident("polkeys_burst")
    q = "SELECT (rl_%s(%%s, 5, 60000, 1, %%s)).remaining" % algorithm
    assert pg.execute(q, (identity, 5)).fetchone() == (4,)
    assert pg.execute(q, (identity, None)).fetchone() == (3,)
    assert keys_of(shared_redis, identity) == {"rl:%s:{%s}:5/60000" % (KEY_KINDS.get(algorithm, algorithm), identity)}

    policy = env.policy(algorithm, (5, 60000, None), (5, 60000, 5))
    here, there = env.caller(), env.caller(other_db)
    here.at(BASE_CLOCK_MS)
    there.at(BASE_CLOCK_MS)
    identity = new_ident("polkeys_burst")
    assert [here.allow(policy, identity) for _ in range(3)] == [True] * 3
    assert [there.allow(policy, identity) for _ in range(3)] == [True, True, False]
    assert keys_of(shared_redis, identity) == {
        "rl:%s:{%s}:%s:5/60000" % (KEY_KINDS.get(algorithm, algorithm), identity, policy)}


def test_refund_after_burst_set_to_lim_gives_back(env, shared_redis):
    """A token bucket policy without a burst gets burst = lim (the same
    capacity, the same key) while a transaction that charged it is open,
    and another session charges under the new row: the rollback still
    gives back what the transaction took, as the key's state was written
    under the same limit."""
    policy = env.policy("token_bucket", (5, 60000, None), (5, 60000, None))
    me, other = env.caller(), env.caller()
    me.at(BASE_CLOCK_MS, refund_on_abort="all")
    other.at(BASE_CLOCK_MS)
    identity = new_ident("polkeys_burst_refund")
    me.conn.execute("BEGIN")
    assert [me.allow(policy, identity) for _ in range(3)] == [True] * 3
    env.here.execute("UPDATE rl_policy SET burst = 5 WHERE name = %s", (policy,))
    assert other.allow(policy, identity) is True
    me.conn.execute("ROLLBACK")
    assert keys_of(shared_redis, identity) == {
        "rl:token_bucket.2:{%s}:%s:5/60000" % (identity, policy)}
    assert other.conn.execute("SELECT (rl_check(%s, %s, 0)).remaining",
                              (policy, identity)).fetchone() == (4,)


@pytest.mark.parametrize("spec,message", [
    ("fixed:5/60000/3", "algorithm fixed takes no burst"),
    ("sliding:5/60000/5", "algorithm sliding takes no burst"),
    ("sliding_counter:5/60000/0", "algorithm sliding_counter takes no burst"),
    ("token_bucket:5/60000/0", "burst must be greater than zero"),
    ("gcra:5/60000/-2", "burst must be greater than zero"),
])
def test_guard_spec_burst_checked_as_the_functions_do(env, spec, message):
    """A guard's explicit limit takes a burst only for token_bucket and gcra,
    and only a positive one, refused with 22023 and the message the SQL
    functions give (before the fix: a fixed window's burst made another key
    for one decision, and a burst of 0 was taken as none), since 1.6 at
    CREATE TRIGGER."""
    table = "rl_polkeys_%s" % uid()
    owner = env.here
    owner.execute(sql.SQL("CREATE TABLE {} (tenant text NOT NULL)").format(sql.Identifier(table)))
    try:
        with pytest.raises(psycopg.Error) as exc:
            owner.execute(sql.SQL("CREATE TRIGGER guard AFTER INSERT ON {} FOR EACH ROW "
                                  "EXECUTE FUNCTION rl_guard({}, 'tenant')").format(
                sql.Identifier(table), sql.Literal(spec)))
        assert (exc.value.sqlstate, exc.value.diag.message_primary) == ("22023", message)
    finally:
        owner.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(table)))
