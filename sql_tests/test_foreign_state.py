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

import psycopg
import psycopg.errors
import pytest

from conftest import fixed_units, new_ident, rl_key, set_gucs

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


def hashed(*fields):
    """A writer of a hash state; "NOW" stands for Redis's clock (µs)."""
    def write(redis, key):
        now = redis_us(redis)
        values = [now if f == "NOW" else f for f in fields]
        redis.command("HSET", key, *values)
        redis.command("PEXPIRE", key, 600000)
    return write


def scored(score):
    """A writer of a sorted set of one member of that score."""
    def write(redis, key):
        redis.command("ZADD", key, score, "x")
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
    ("bucket_ts", "token_bucket", "rl_token_bucket", hashed("t", 5, "ts", "1e300")),
    ("bucket_ts_inf", "token_bucket", "rl_token_bucket", hashed("t", 5, "ts", "inf")),
    ("bucket_level_negative", "token_bucket", "rl_token_bucket",
     hashed("t", "-1e300", "ts", "NOW")),
    ("bucket_level_nan", "token_bucket", "rl_token_bucket", hashed("t", "nan", "ts", "NOW")),
    ("bucket_record", "token_bucket", "rl_token_bucket",
     hashed("t", 5, "ts", "NOW", "k", 1, "s:abc", "garbage")),
    ("gcra_backlog", "gcra", "rl_gcra", hashed("b", "1e300", "ts", "NOW")),
    ("gcra_ts", "gcra", "rl_gcra", hashed("b", 1000, "ts", "1e300")),
    ("gcra_record", "gcra", "rl_gcra",
     hashed("b", 1000, "ts", "NOW", "k", 1, "s:abc", "1:nan")),
    ("gcra_string_tat", "gcra", "rl_gcra",
     lambda redis, key: redis.command("SET", key, "1e300", "PX", 600000)),
    ("sliding_score", "sliding", "rl_sliding", scored("+inf")),
    ("sliding_score_beyond", "sliding", "rl_sliding", scored(str(BEYOND))),
    ("concurrency_lease", "concurrency", "rl_concurrency_acquire", scored("+inf")),
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
    ("token_bucket", "rl_token_bucket_many", hashed("t", 5, "ts", "NOW", "k", 1, "s:abc", "x")),
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
        assert [float(shared_redis.command("HGET", keys[i], "t")) for i in (0, 2)] == \
            pytest.approx([9, 9], abs=0.01)
    shared_redis.command("DEL", *keys)


@pytest.fixture
def two_policies(pg):
    """A fixed-window and a token-bucket policy with unique names, 10 per
    minute; deleted afterwards."""
    names = [new_ident("foreign_fixed"), new_ident("foreign_bucket")]
    pg.execute("INSERT INTO rl_policy (name, algorithm, lim, window_ms) VALUES "
               "(%s, 'fixed', 10, %s), (%s, 'token_bucket', 10, %s)",
               (names[0], WINDOW_MS, names[1], WINDOW_MS))
    yield names
    pg.execute("DELETE FROM rl_policy WHERE name = ANY(%s)", (names,))


@pytest.mark.parametrize("order", ["fixed_first", "bucket_first"])
def test_several_limits_write_nothing_when_one_state_is_foreign(pg, shared_redis, two_policies,
                                                                 order):
    """rl_check_all over a fixed window (no key yet) and a token bucket
    whose refund record is not two numbers: WRONGTYPE, and neither key is
    written, in either order of the policies (the bucket's records used to
    be read only once the fixed window's state was written)."""
    identity = new_ident("foreign_all")
    fixed_key = rl_key("fixed", identity, policy=two_policies[0], lim=10, window_ms=WINDOW_MS)
    bucket_key = rl_key("token_bucket", identity, policy=two_policies[1], lim=10,
                        window_ms=WINDOW_MS)
    hashed("t", 5, "ts", "NOW", "k", 1, "s:abc", "garbage")(shared_redis, bucket_key)
    before = dump(shared_redis, bucket_key)
    policies = two_policies if order == "fixed_first" else two_policies[::-1]
    refused(pg, lambda: pg.execute("SELECT * FROM rl_check_all(%s, %s)", (policies, identity)))
    assert shared_redis.command("EXISTS", fixed_key) == 0
    assert dump(shared_redis, bucket_key) == before
    shared_redis.command("DEL", bucket_key)
