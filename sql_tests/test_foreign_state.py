"""States that rl_redis could not have written, under its keys: a lying
Redis, another program writing there, a restored dump of garbage. Each is
refused before anything is written (review of issue 22): the call fails
with WRONGTYPE (SQLSTATE 08000, Redis's error in the detail) and the key
is as it was, on every algorithm. A state holds only times below 2^53 µs
(no clock rl_redis uses comes near: that is the year 2255), levels and
backlogs within them, and refund records of two numbers; a value beyond
those used to be taken as a clock far ahead, whose expiry Redis then
refused after the script had written part of the state.

In a batch the refused key's row gets the fallback and no other key loses
or gains a unit; in a several-limits call (rl_check_all) nothing is
written to any limit.
"""

import struct

import psycopg
import psycopg.errors
import pytest

from conftest import fixed_units, level_state, new_ident, rl_key, set_gucs
from redis_topology import made_policies

WINDOW_MS = 60000
BEYOND = 2**53 + 8    # a time (µs) beyond 2^53, exact as a double

# writes KEYS[1] = the bytes ARGV[1] spells in hexadecimal, for 10 minutes
UNHEX = ("redis.call('SET', KEYS[1], (string.gsub(ARGV[1], '..', function(h) "
         "return string.char(tonumber(h, 16)) end)), 'PX', 600000)")


def redis_us(redis):
    """Redis's clock (TIME) in microseconds."""
    sec, usec = redis.command("TIME")
    return int(sec) * 1000000 + int(usec)


def dump(redis, key):
    """What a key holds, to compare before and after: its type and value."""
    kind = redis.command("TYPE", key)
    if kind == "string":
        return kind, redis.command("GET", key)
    if kind == "hash":
        return kind, sorted(redis.command("HGETALL", key))
    if kind == "zset":
        return kind, redis.command("ZRANGE", key, 0, -1, "WITHSCORES")
    return kind, None


def packed(*fields):
    """A writer of a packed string state: fields are (value, bytes) pairs,
    little-endian unsigned integers."""
    data = b"".join(v.to_bytes(n, "little") for v, n in fields)
    return lambda redis, key: redis.command("EVAL", UNHEX, 1, key, data.hex())


# HSETs field v of KEYS[1] to the bytes ARGV[1] spells in hexadecimal, and
# the fields and values that follow; for 10 minutes
UNHEX_LEVEL = ("redis.call('HSET', KEYS[1], 'v', (string.gsub(ARGV[1], '..', function(h) "
               "return string.char(tonumber(h, 16)) end)), unpack(ARGV, 2)) "
               "redis.call('PEXPIRE', KEYS[1], 600000)")


def leveled(level, ts, *fields, raw=None):
    """A writer of a token bucket's or GCRA's hash: field v packs level and
    ts as lua/records.lua does (two little-endian doubles; "NOW" stands for
    Redis's clock, µs), or holds the bytes raw; fields are more fields and
    values (refund records)."""
    def write(redis, key):
        if raw is not None:
            data = raw
        else:
            data = struct.pack("<dd", float(level), redis_us(redis) if ts == "NOW" else float(ts))
        redis.command("EVAL", UNHEX_LEVEL, 1, key, data.hex(), *fields)
    return write


def hash_of(*fields):
    """A writer of a hash of these fields and values, and no other."""
    def write(redis, key):
        redis.command("HSET", key, *fields)
        redis.command("PEXPIRE", key, 600000)
    return write


def scored(score, ended=False):
    """A writer of a sorted set of one member of that score (and, with
    ended, one of score 1: a unit or lease long gone)."""
    def write(redis, key):
        redis.command("ZADD", key, score, "x")
        if ended:
            redis.command("ZADD", key, 1, "old")
        redis.command("PEXPIRE", key, 600000)
    return write


NOW_MS = 1800000000000  # Redis's clock is below this (2027-01-15) for a while

# (name, algorithm, the SQL function, writer)
CASES = [
    ("fixed_epoch", "fixed", "rl_fixed", packed((1, 1), (10, 1), (BEYOND, 7))),
    ("fixed_epoch_all_ones", "fixed", "rl_fixed", packed((1, 4), (10, 4), (2**56 - 1, 7))),
    ("fixed_window_number", "fixed", "rl_fixed",
     packed((1, 1), (10, 1), (NOW_MS * 1000, 7), (BEYOND // (WINDOW_MS * 1000) + 1, 8))),
    ("fixed_window_number_all_ones", "fixed", "rl_fixed",
     packed((1, 1), (10, 1), (NOW_MS * 1000, 7), (2**64 - 1, 8))),
    ("counter_ts", "sliding_counter", "rl_sliding_counter",
     packed((1, 4), (0, 4), (BEYOND, 7), (NOW_MS * 1000, 7), (10, 4))),
    ("counter_epoch", "sliding_counter", "rl_sliding_counter",
     packed((1, 4), (0, 4), (NOW_MS * 1000, 7), (2**56 - 1, 7), (10, 4))),
    ("bucket_ts", "token_bucket", "rl_token_bucket", leveled(5, "1e300")),
    ("bucket_ts_inf", "token_bucket", "rl_token_bucket", leveled(5, "inf")),
    ("bucket_level_negative", "token_bucket", "rl_token_bucket", leveled("-1e300", "NOW")),
    ("bucket_level_nan", "token_bucket", "rl_token_bucket", leveled("nan", "NOW")),
    ("bucket_level_short", "token_bucket", "rl_token_bucket", leveled(0, 0, raw=b"5" * 15)),
    ("bucket_level_text", "token_bucket", "rl_token_bucket", leveled(0, 0, raw=b"5")),
    ("bucket_record", "token_bucket", "rl_token_bucket",
     leveled(5, "NOW", "k", 1, "s:abc", "garbage")),
    ("gcra_backlog", "gcra", "rl_gcra", leveled("1e300", "NOW")),
    ("gcra_ts", "gcra", "rl_gcra", leveled(1000, "1e300")),
    ("gcra_level_long", "gcra", "rl_gcra", leveled(0, 0, raw=b"\0" * 17)),
    ("gcra_level_empty", "gcra", "rl_gcra", leveled(0, 0, raw=b"")),
    ("gcra_record", "gcra", "rl_gcra",
     leveled(1000, "NOW", "k", 1, "s:abc", "1:nan")),
    ("bucket_records_without_level", "token_bucket", "rl_token_bucket",
     hash_of("k", 1, "s:abc", "garbage")),
    ("gcra_records_without_level", "gcra", "rl_gcra", hash_of("k", 1, "s:abc", "1:5")),
    ("gcra_string", "gcra", "rl_gcra",
     lambda redis, key: redis.command("SET", key, "1e300", "PX", 600000)),
    ("sliding_score", "sliding", "rl_sliding", scored("+inf")),
    ("sliding_score_beyond", "sliding", "rl_sliding", scored(str(BEYOND))),
    ("concurrency_lease", "concurrency", "rl_concurrency_acquire", scored("+inf")),
    ("concurrency_lease_and_an_ended_one", "concurrency", "rl_concurrency_acquire",
     scored("+inf", ended=True)),
]


def refused(pg, call):
    """Runs call(); asserts it fails with WRONGTYPE (08000)."""
    with pytest.raises(psycopg.errors.ConnectionException) as err:
        call()
    assert err.value.sqlstate == "08000"
    assert err.value.diag.message_detail.startswith(
        "WRONGTYPE Operation against a key holding the wrong kind of value"), \
        err.value.diag.message_detail


@pytest.mark.parametrize("name, algorithm, function, write", CASES, ids=[c[0] for c in CASES])
def test_state_beyond_any_clock_is_refused(pg, shared_redis, name, algorithm, function, write):
    """One call on each such state: WRONGTYPE, the key unchanged (type,
    value, and an expiry no longer than the 10 minutes it was given)."""
    identity = new_ident("foreign_" + name)
    key = rl_key(algorithm, identity, lim=10, window_ms=WINDOW_MS)
    write(shared_redis, key)
    before = dump(shared_redis, key)
    refused(pg, lambda: pg.execute("SELECT * FROM %s(%%s, 10, %d)" % (function, WINDOW_MS),
                                   (identity,)))
    assert dump(shared_redis, key) == before
    assert 0 < int(shared_redis.command("PTTL", key)) <= 600000
    shared_redis.command("DEL", key)


@pytest.mark.parametrize("algorithm, function, write", [
    ("fixed", "rl_fixed_many", packed((1, 1), (10, 1), (NOW_MS * 1000, 7), (2**64 - 1, 8))),
    ("token_bucket", "rl_token_bucket_many", leveled(5, "NOW", "k", 1, "s:abc", "x")),
], ids=["fixed", "token_bucket"])
def test_batch_refuses_the_foreign_state_only(pg, shared_redis, algorithm, function, write):
    """A batch of three identities, the second's key a foreign state:
    under on_error = 'deny' its row is the fallback's denial and its key
    stays as it was; the first and the third are charged one unit each (the
    batch's script went on past the refused key, and wrote nothing for
    it)."""
    idents = [new_ident("foreign_many") for _ in range(3)]
    keys = [rl_key(algorithm, i, lim=10, window_ms=WINDOW_MS) for i in idents]
    write(shared_redis, keys[1])
    before = dump(shared_redis, keys[1])
    set_gucs(pg, on_error="deny")
    rows = pg.execute("SELECT identity, allowed, remaining FROM %s(%%s, 10, %d)"
                      % (function, WINDOW_MS), (idents,)).fetchall()
    assert rows == [(idents[0], True, 9), (idents[1], False, 0), (idents[2], True, 9)]
    assert dump(shared_redis, keys[1]) == before
    if algorithm == "fixed":
        assert [fixed_units(shared_redis.command("GET", keys[i])) for i in (0, 2)] == ["1", "1"]
    else:
        assert [level_state(shared_redis.command("HGET", keys[i], "v"))[0] for i in (0, 2)] == \
            pytest.approx([9, 9], abs=0.01)
    shared_redis.command("DEL", *keys)


@pytest.fixture
def policies(pg):
    """policies(algorithm, lim, window_ms) -> a new policy's name; deleted
    at teardown."""
    yield from made_policies(pg, "t_foreign")


@pytest.mark.parametrize("order", ["fixed_first", "bucket_first"])
def test_several_limits_write_nothing_when_one_state_is_foreign(pg, shared_redis, policies, order):
    """rl_check_all over a fixed window (no key yet) and a token bucket
    whose refund record is not two numbers: WRONGTYPE, and neither key is
    written, in either order of the policies (the bucket's records used to
    be read only once the fixed window's state was written)."""
    names = [policies(a, 10, WINDOW_MS) for a in ("fixed", "token_bucket")]
    identity = new_ident("foreign_all")
    fixed_key = rl_key("fixed", identity, policy=names[0], lim=10, window_ms=WINDOW_MS)
    bucket_key = rl_key("token_bucket", identity, policy=names[1], lim=10,
                        window_ms=WINDOW_MS)
    leveled(5, "NOW", "k", 1, "s:abc", "garbage")(shared_redis, bucket_key)
    before = dump(shared_redis, bucket_key)
    ordered = names if order == "fixed_first" else names[::-1]
    refused(pg, lambda: pg.execute("SELECT * FROM rl_check_all(%s, %s)", (ordered, identity)))
    assert shared_redis.command("EXISTS", fixed_key) == 0
    assert dump(shared_redis, bucket_key) == before
    shared_redis.command("DEL", bucket_key)


@pytest.mark.parametrize("order", ["log_first", "fixed_first"])
def test_several_limits_leave_a_sliding_log_as_it_was(pg, shared_redis, policies, order):
    """Review: rl_check_all over a sliding log (one unit that has left its
    window, one still in it) and a fixed window whose state is foreign:
    WRONGTYPE, and the log keeps both members (its decide used to drop the
    unit that had left before the fixed window refused its state). The
    limits are decided in the order given: with the fixed window first it
    refuses before the log is read, and only log_first would have seen the
    unit dropped."""
    names = [policies(a, 10, WINDOW_MS) for a in ("sliding", "fixed")]
    identity = new_ident("foreign_all_log")
    log_key = rl_key("sliding", identity, policy=names[0], lim=10, window_ms=WINDOW_MS)
    fixed_key = rl_key("fixed", identity, policy=names[1], lim=10, window_ms=WINDOW_MS)
    now = redis_us(shared_redis)
    shared_redis.command("ZADD", log_key, now - 2 * WINDOW_MS * 1000, "old", now - 1000000, "new")
    shared_redis.command("PEXPIRE", log_key, 600000)
    shared_redis.command("SET", fixed_key, "x" * 22, "PX", 600000)
    before = dump(shared_redis, log_key)
    ordered = names if order == "log_first" else names[::-1]
    refused(pg, lambda: pg.execute("SELECT * FROM rl_check_all(%s, %s)", (ordered, identity)))
    assert dump(shared_redis, log_key) == before
    assert shared_redis.command("GET", fixed_key) == "x" * 22
    shared_redis.command("DEL", log_key, fixed_key)


@pytest.mark.parametrize("corrupt", [0, 1])
def test_commit_forgets_every_other_key_past_a_foreign_record(pg, shared_redis, corrupt):
    """Review: a transaction charges two token buckets of one identity (one
    hash slot: one forget call for both) under refund_on_abort = 'all';
    before it commits, one key gets a refund record that is no record of
    rl_redis's. At the commit the other key's record is forgotten all the
    same (the forget script used to stop at the refused key), and the
    refused key stays as it was."""
    identity = new_ident("foreign_forget")
    keys = [rl_key("token_bucket", identity, lim=lim, window_ms=WINDOW_MS) for lim in (10, 20)]
    set_gucs(pg, refund_on_abort="all")
    with pg.transaction():
        for lim in (10, 20):
            pg.execute("SELECT rl_token_bucket(%s, %s, %s)", (identity, lim, WINDOW_MS))
        assert all(any(f.startswith("s:") for f in shared_redis.command("HKEYS", k))
                   for k in keys)
        shared_redis.command("HSET", keys[corrupt], "s:zz", "-1:5")
        before = dump(shared_redis, keys[corrupt])
    other = keys[1 - corrupt]
    assert [f for f in shared_redis.command("HKEYS", other) if f.startswith("s:")] == []
    assert shared_redis.command("HGET", other, "k") == "0"
    assert dump(shared_redis, keys[corrupt]) == before
    shared_redis.command("DEL", *keys)
