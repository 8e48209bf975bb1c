"""The packed states of the fixed window (fixed.2) and the sliding-window
counter (sliding_counter.2), byte for byte (lua/fixed_window.lua,
lua/sliding_counter.lua; README, "Key layout in Redis").

A fixed window's state is n and l in k bytes each (k = 1 to 4, the fewest
that hold both), then the key's epoch in 7: 9 to 15 bytes, an odd length.
The epoch is Redis's clock when the window's state was made, so on Redis's
clock the window's number is floor(epoch / window_us); on the test clock it
need not be, and every state written there holds the window's number too
(8 more bytes: 17 to 23). The window's first write on Redis's clock sets
the key's expiry, its later ones keep it. Any other length is not a fixed window's state: WRONGTYPE, among them
22, the layout of earlier 1.6 builds (n, w, e, l in 4, 7, 7 and 4 bytes),
whose window number would otherwise be read as an epoch.
A sliding counter's state is 26 bytes: its window's number is that of its
clock stamp ts.

The real-clock tests use a window of 10^12 ms (window 1 runs from 2001-09-09
to 2033-05-18), so no window ends while they run.
"""

import psycopg
import psycopg.errors
import pytest

from conftest import fixed_state, new_ident, rl_key, set_gucs
from redis_topology import made_policies

HUGE_WINDOW_MS = 10**12
HUGE_WINDOW_US = HUGE_WINDOW_MS * 1000
# a test clock on a whole minute (2001-09-09), far from the real clock
BASE_CLOCK_MS = 1000000020000

# writes KEYS[1] = struct.pack(ARGV[1], ARGV[2], ...), for 10 minutes
PACK = "redis.call('SET', KEYS[1], struct.pack(ARGV[1], unpack(ARGV, 2)), 'PX', 600000)"


def redis_us(redis):
    """Redis's clock (TIME) in microseconds."""
    sec, usec = redis.command("TIME")
    return int(sec) * 1000000 + int(usec)


def raw(redis, key):
    """The bytes a key holds."""
    return redis.command("GET", key).encode(errors="surrogateescape")


def fixed(pg, identity, lim, window_ms, cost=1):
    """rl_fixed(...) as (allowed, remaining)."""
    return pg.execute("SELECT allowed, remaining FROM rl_fixed(%s, %s, %s, %s)",
                      (identity, lim, window_ms, cost)).fetchone()


def counter_state(redis, key):
    """A sliding counter's state: (c, p, ts, epoch, lim) and its length."""
    b = raw(redis, key)
    fields = [int.from_bytes(b[i:i + n], "little")
              for i, n in ((0, 4), (4, 4), (8, 7), (15, 7), (22, 4))]
    return tuple(fields), len(b)


@pytest.fixture
def policy(pg):
    """policy(lim, window_ms) -> a new fixed-window policy's name; deleted
    at teardown."""
    make = made_policies(pg, "t_packed")
    new = next(make)
    yield lambda lim, window_ms: new("fixed", lim, window_ms)
    next(make, None)


@pytest.mark.parametrize("lim, cost, k", [
    (5, 5, 1), (255, 255, 1), (256, 1, 2), (65535, 65535, 2), (65536, 1, 3),
    (16777215, 3, 3), (16777216, 1, 4), (2147483647, 2147483647, 4)])
def test_fixed_state_takes_the_fewest_bytes(pg, shared_redis, lim, cost, k):
    """On Redis's clock the state is n, l in k bytes each and the epoch in
    7, k the fewest bytes that hold lim (up to 2^31 - 1); the epoch is
    Redis's clock of the call that made it, in the window."""
    identity = new_ident("packed_width")
    key = rl_key("fixed", identity, lim=lim, window_ms=HUGE_WINDOW_MS)
    before = redis_us(shared_redis)
    assert fixed(pg, identity, lim, HUGE_WINDOW_MS, cost) == (True, lim - cost)
    after = redis_us(shared_redis)
    n, l, epoch, w = fixed_state(shared_redis.command("GET", key))
    assert (len(raw(shared_redis, key)), n, l, w) == (2 * k + 7, cost, lim, None)
    assert before <= epoch <= after
    assert epoch // HUGE_WINDOW_US == before // HUGE_WINDOW_US == 1
    shared_redis.command("DEL", key)


@pytest.mark.parametrize("lim, k", [(300, 2), (2147483647, 4)])
def test_fixed_count_above_lim_keeps_its_width(pg, shared_redis, policy, lim, k):
    """A policy takes lim, its lim becomes 5 and an administrator gives 1
    back: the count (lim - 1) is above the lim the state is written under,
    and k is the width that holds the count."""
    name = policy(lim, HUGE_WINDOW_MS)
    identity = new_ident("packed_above")
    key = rl_key("fixed", identity, policy=name, lim=lim, window_ms=HUGE_WINDOW_MS)
    assert pg.execute("SELECT allowed, remaining FROM rl_check(%s, %s, %s)",
                      (name, identity, lim)).fetchone() == (True, 0)
    epoch = fixed_state(shared_redis.command("GET", key))[2]
    pg.execute("UPDATE rl_policy SET lim = 5 WHERE name = %s", (name,))
    assert pg.execute("SELECT allowed, remaining FROM rl_refund(%s, %s, 1)",
                      (name, identity)).fetchone() == (True, 0)
    assert len(raw(shared_redis, key)) == 2 * k + 7
    assert fixed_state(shared_redis.command("GET", key)) == (lim - 1, 5, epoch, None)
    assert pg.execute("SELECT allowed, remaining FROM rl_check(%s, %s, 1)",
                      (name, identity)).fetchone() == (False, 0)
    shared_redis.command("DEL", key)


def test_fixed_state_on_the_test_clock_holds_its_window(pg, shared_redis):
    """On the test clock the state holds the window's number (17 bytes at
    lim 5); a call in the next window makes a new epoch."""
    identity = new_ident("packed_test_clock")
    key = rl_key("fixed", identity, lim=5, window_ms=60000)
    set_gucs(pg, test_clock_ms=BASE_CLOCK_MS)
    before = redis_us(shared_redis)
    assert [fixed(pg, identity, 5, 60000) for _ in range(2)] == [(True, 4), (True, 3)]
    after = redis_us(shared_redis)
    assert len(raw(shared_redis, key)) == 17
    n, l, epoch, w = fixed_state(shared_redis.command("GET", key))
    assert (n, l, w) == (2, 5, BASE_CLOCK_MS // 60000)
    assert before <= epoch <= after

    set_gucs(pg, test_clock_ms=BASE_CLOCK_MS + 60000)
    assert fixed(pg, identity, 5, 60000) == (True, 4)
    n, l, epoch2, w = fixed_state(shared_redis.command("GET", key))
    assert (n, l, w) == (1, 5, BASE_CLOCK_MS // 60000 + 1)
    assert after <= epoch2 <= redis_us(shared_redis)
    shared_redis.command("DEL", key)


def test_fixed_write_in_its_window_keeps_the_expiry(pg, shared_redis, policy):
    """On Redis's clock the window's first write sets the key's expiry (the
    window's end) and the later writes of that window keep it (SET ...
    KEEPTTL): a charge, and an administrator's refund. A marker expiry set
    in between is still there after both."""
    name = policy(10, HUGE_WINDOW_MS)
    identity = new_ident("packed_keep")
    key = rl_key("fixed", identity, policy=name, lim=10, window_ms=HUGE_WINDOW_MS)
    check = "SELECT allowed, remaining FROM rl_check(%s, %s, %s)"
    assert pg.execute(check, (name, identity, 1)).fetchone() == (True, 9)
    assert int(shared_redis.command("PTTL", key)) > 10**11   # the window's end, in 2033
    shared_redis.command("PEXPIRE", key, 600000)
    assert pg.execute(check, (name, identity, 2)).fetchone() == (True, 7)
    assert pg.execute("SELECT allowed, remaining FROM rl_refund(%s, %s, 1)",
                      (name, identity)).fetchone() == (True, 8)
    assert 0 < int(shared_redis.command("PTTL", key)) <= 600000
    assert fixed_state(shared_redis.command("GET", key))[:2] == (2, 10)
    shared_redis.command("DEL", key)


def test_fixed_key_outlives_its_window_by_a_second(pg, shared_redis):
    """The expiry the window's first write sets is 1 s after the window's
    end (reset_ms from now), as the later writes keep it."""
    identity = new_ident("packed_slack")
    key = rl_key("fixed", identity, lim=10, window_ms=HUGE_WINDOW_MS)
    reset_ms = pg.execute("SELECT reset_ms FROM rl_fixed(%s, 10, %s)",
                          (identity, HUGE_WINDOW_MS)).fetchone()[0]
    pttl = int(shared_redis.command("PTTL", key))
    assert reset_ms < pttl <= reset_ms + 1000, (reset_ms, pttl)
    shared_redis.command("DEL", key)


def test_fixed_test_clock_state_sets_its_expiry_anew(pg, shared_redis):
    """On the test clock every write takes the long form, even where its
    epoch gives its window's number (the clock set to Redis's own), and
    sets the expiry anew (it lives 10 s of real time at least); a write on
    Redis's clock over such a state, in the same window, sets it anew as
    well, and from then on the short form."""
    identity = new_ident("packed_clock_keep")
    key = rl_key("fixed", identity, lim=5, window_ms=HUGE_WINDOW_MS)
    set_gucs(pg, test_clock_ms=redis_us(shared_redis) // 1000)
    assert fixed(pg, identity, 5, HUGE_WINDOW_MS) == (True, 4)
    n, l, epoch, w = fixed_state(shared_redis.command("GET", key))
    assert (len(raw(shared_redis, key)), n, l, w) == (17, 1, 5, epoch // HUGE_WINDOW_US)
    shared_redis.command("PEXPIRE", key, 600000)
    assert fixed(pg, identity, 5, HUGE_WINDOW_MS) == (True, 3)
    assert int(shared_redis.command("PTTL", key)) > 10**11
    assert len(raw(shared_redis, key)) == 17
    shared_redis.command("PEXPIRE", key, 600000)
    set_gucs(pg, test_clock_ms=0)
    assert fixed(pg, identity, 5, HUGE_WINDOW_MS) == (True, 2)
    assert int(shared_redis.command("PTTL", key)) > 10**11
    assert (fixed_state(shared_redis.command("GET", key)), len(raw(shared_redis, key))) == \
        ((3, 5, epoch, None), 9)
    shared_redis.command("DEL", key)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_fixed_reads_every_length(pg, shared_redis, k):
    """A state of each width and form is read (3 units of 10 used) and
    written back in the fewest bytes: the short form when its epoch lies in
    its window, else the one that holds the window's number."""
    ints = "<I%dI%dI7" % (k, k)
    now = redis_us(shared_redis)
    identity = new_ident("packed_read")
    key = rl_key("fixed", identity, lim=10, window_ms=HUGE_WINDOW_MS)
    cases = [
        # (written: format and fields, expected state after one unit)
        ((ints, 3, 10, now - 1000000), (4, 10, now - 1000000, None), 9),
        ((ints + "I8", 3, 10, 5, 1), (4, 10, 5, 1), 17),
        ((ints + "I8", 3, 10, now - 1000000, 1), (4, 10, now - 1000000, None), 9),
    ]
    for written, state, length in cases:
        shared_redis.command("EVAL", PACK, 1, key, *written)
        assert len(raw(shared_redis, key)) == (2 * k + 7 if len(written) == 4 else 2 * k + 15)
        assert fixed(pg, identity, 10, HUGE_WINDOW_MS) == (True, 6)
        assert (fixed_state(shared_redis.command("GET", key)), len(raw(shared_redis, key))) == \
            (state, length)
    shared_redis.command("DEL", key)


def test_fixed_test_clock_form_of_an_earlier_window_starts_afresh(pg, shared_redis):
    """A state written on the test clock in window 0 is read on Redis's
    clock (window 1): a new window, a new epoch, the short form."""
    identity = new_ident("packed_earlier")
    key = rl_key("fixed", identity, lim=10, window_ms=HUGE_WINDOW_MS)
    shared_redis.command("EVAL", PACK, 1, key, "<I1I1I7I8", 9, 10, 5, 0)
    before = redis_us(shared_redis)
    assert fixed(pg, identity, 10, HUGE_WINDOW_MS) == (True, 9)
    n, l, epoch, w = fixed_state(shared_redis.command("GET", key))
    assert (n, l, w, len(raw(shared_redis, key))) == (1, 10, None, 9)
    assert before <= epoch <= redis_us(shared_redis)
    shared_redis.command("DEL", key)


def test_fixed_clock_step_back_keeps_the_window(pg, shared_redis):
    """A short-form state whose epoch lies in window 2 (2033: Redis's clock
    stepped back since) is decided in window 2: its units count, the epoch
    stays, and the waits count from the later clock."""
    identity = new_ident("packed_step_back")
    key = rl_key("fixed", identity, lim=10, window_ms=HUGE_WINDOW_MS)
    epoch = 2 * HUGE_WINDOW_US + 7
    shared_redis.command("EVAL", PACK, 1, key, "<I1I1I7", 3, 10, epoch)
    before = redis_us(shared_redis)
    allowed, remaining, reset_ms = pg.execute(
        "SELECT allowed, remaining, reset_ms FROM rl_fixed(%s, 10, %s)",
        (identity, HUGE_WINDOW_MS)).fetchone()
    after = redis_us(shared_redis)
    assert (allowed, remaining) == (True, 6)
    # the whole of window 2, plus the step back (ms, rounded up)
    assert HUGE_WINDOW_MS + -(-(2 * HUGE_WINDOW_US - after) // 1000) <= reset_ms <= \
        HUGE_WINDOW_MS + -(-(2 * HUGE_WINDOW_US - before) // 1000)
    assert (fixed_state(shared_redis.command("GET", key)), len(raw(shared_redis, key))) == \
        ((4, 10, epoch, None), 9)
    shared_redis.command("DEL", key)


@pytest.mark.parametrize("length", [0, 1, 7, 8, 10, 14, 16, 18, 20, 22, 24, 25, 26, 33])
def test_fixed_state_of_another_length_is_wrongtype(pg, shared_redis, length):
    """A string of a length neither form has (an even one, or an odd one
    outside 9 to 15 and 17 to 23) is not read: WRONGTYPE, and it stays."""
    identity = new_ident("packed_wrong")
    key = rl_key("fixed", identity, lim=10, window_ms=60000)
    shared_redis.command("SET", key, "x" * length, "PX", "600000")
    with pytest.raises(psycopg.errors.ConnectionException) as err:
        fixed(pg, identity, 10, 60000)
    assert err.value.sqlstate == "08000"
    assert err.value.diag.message_detail.startswith(
        "WRONGTYPE Operation against a key holding the wrong kind of value"), err.value.diag.message_detail
    assert shared_redis.command("GET", key) == "x" * length
    shared_redis.command("DEL", key)


def test_sliding_counter_state_is_26_bytes(pg, shared_redis):
    """c, p, ts, epoch and l: the window's number is that of ts, on Redis's
    clock and on the test clock; the next window's call finds the counts
    moved to the previous window."""
    identity = new_ident("packed_counter")
    key = rl_key("sliding_counter", identity, lim=5, window_ms=HUGE_WINDOW_MS)
    before = redis_us(shared_redis)
    pg.execute("SELECT rl_sliding_counter(%s, 5, %s, 2)", (identity, HUGE_WINDOW_MS))
    after = redis_us(shared_redis)
    (c, p, ts, epoch, l), length = counter_state(shared_redis, key)
    assert (c, p, l, length) == (2, 0, 5, 26)
    assert before <= ts == epoch <= after
    shared_redis.command("DEL", key)

    key = rl_key("sliding_counter", identity, lim=5, window_ms=60000)
    set_gucs(pg, test_clock_ms=BASE_CLOCK_MS + 30000)
    before = redis_us(shared_redis)
    assert pg.execute("SELECT allowed, remaining FROM rl_sliding_counter(%s, 5, 60000)",
                      (identity,)).fetchone() == (True, 4)
    after = redis_us(shared_redis)
    (c, p, ts, epoch, l), length = counter_state(shared_redis, key)
    assert (c, p, ts, l, length) == (1, 0, (BASE_CLOCK_MS + 30000) * 1000, 5, 26)
    assert before <= epoch <= after
    # the next window, 30 s in: the previous count weighs half
    set_gucs(pg, test_clock_ms=BASE_CLOCK_MS + 90000)
    assert pg.execute("SELECT allowed, remaining FROM rl_sliding_counter(%s, 5, 60000)",
                      (identity,)).fetchone() == (True, 3)
    assert counter_state(shared_redis, key) == ((1, 1, (BASE_CLOCK_MS + 90000) * 1000, epoch, 5), 26)
    shared_redis.command("DEL", key)


@pytest.mark.parametrize("length", [22, 25, 27, 33])
def test_sliding_counter_state_of_another_length_is_wrongtype(pg, shared_redis, length):
    """A string of any other length than 26 is not read: WRONGTYPE, and it
    stays."""
    identity = new_ident("packed_counter_wrong")
    key = rl_key("sliding_counter", identity, lim=5, window_ms=60000)
    shared_redis.command("SET", key, "x" * length, "PX", "600000")
    with pytest.raises(psycopg.errors.ConnectionException) as err:
        pg.execute("SELECT rl_sliding_counter(%s, 5, 60000)", (identity,))
    assert err.value.sqlstate == "08000"
    assert err.value.diag.message_detail.startswith("WRONGTYPE "), err.value.diag.message_detail
    assert shared_redis.command("GET", key) == "x" * length
    shared_redis.command("DEL", key)


def test_fixed_state_of_the_earlier_22_byte_layout_is_wrongtype(pg, shared_redis):
    """Review: a state that earlier 1.6 builds wrote (n, w, e, l in 4, 7, 7
    and 4 bytes: 22) used to have the length of a test-clock form, so its
    window's number was read as an epoch and its epoch as a window's number
    about 191 000 years ahead, locking the identity out. It is refused
    (WRONGTYPE) and left as it was."""
    identity = new_ident("packed_old")
    key = rl_key("fixed", identity, lim=10, window_ms=60000)
    now = redis_us(shared_redis)
    shared_redis.command("EVAL", PACK, 1, key, "<I4I7I7I4", 3, now // 60000000, now, 10)
    before = raw(shared_redis, key)
    assert len(before) == 22
    with pytest.raises(psycopg.errors.ConnectionException) as err:
        fixed(pg, identity, 10, 60000)
    assert err.value.sqlstate == "08000"
    assert err.value.diag.message_detail.startswith("WRONGTYPE "), err.value.diag.message_detail
    assert raw(shared_redis, key) == before
    shared_redis.command("DEL", key)
