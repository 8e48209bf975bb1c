"""Who is being throttled: rl_redis.track_denials and rl_top_denied.

Every denial of a policy is counted per identity in Redis, in one sorted set
per policy and minute (<prefix>denials:{<policy>}:<minute>); rl_top_denied
reads the last minutes back. Written only on a denial, bounded per minute
and per identity, never an error of the decision.
"""

import os
import re
import subprocess
import threading
import uuid

import psycopg
from psycopg import sql
import pytest

from conftest import new_ident, pg_connect, set_gucs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")

# a frozen clock: every call falls in one minute
CLOCK_MS = 1767225600000
MINUTE = CLOCK_MS // 60000


@pytest.fixture
def policy(pg):
    """A fresh fixed-window policy of lim 2 per minute; deleted afterwards."""
    name = "pytest.dn.%s" % uuid.uuid4().hex[:16]
    pg.execute("INSERT INTO rl_policy (name, algorithm, lim, window_ms) VALUES (%s, 'fixed', 2, 60000)",
               (name,))
    yield name
    pg.execute("DELETE FROM rl_policy WHERE name = %s", (name,))


def session(**gucs):
    conn = pg_connect()
    set_gucs(conn, test_clock_ms=CLOCK_MS, retry_interval=0, **gucs)
    return conn


def bucket(policy, minute=MINUTE, prefix="rl:"):
    return "%sdenials:{%s}:%d" % (prefix, policy, minute)


def top(conn, policy, since="10 minutes", n=10):
    return conn.execute("SELECT identity, denials FROM rl_top_denied(%s, %s, %s)",
                        (policy, since, n)).fetchall()


def test_denials_counted_exactly_across_sessions(pg, policy, shared_redis):
    """4 sessions, 3 identities: each identity's denials in Redis and in
    rl_top_denied equal the denials the sessions saw, most denied first."""
    idents = [new_ident("dn%d" % i) for i in range(3)]
    calls = {idents[0]: 12, idents[1]: 7, idents[2]: 3}
    seen = {i: 0 for i in idents}
    lock = threading.Lock()

    def worker(k):
        conn = session(track_denials="on")
        try:
            for identity, count in calls.items():
                for _ in range(count // 4 + (1 if k < count % 4 else 0)):
                    allowed = conn.execute("SELECT rl_allow(%s, %s)", (policy, identity)).fetchone()[0]
                    if not allowed:
                        with lock:
                            seen[identity] += 1
        finally:
            conn.close()

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {i: calls[i] - 2 for i in idents}
    got = top(pg_connect_clock(), policy)
    assert got == [(idents[0], 10), (idents[1], 5), (idents[2], 1)]
    assert int(float(shared_redis.command("ZSCORE", bucket(policy), idents[1]))) == 5
    ttl = shared_redis.command("PTTL", bucket(policy))
    assert 86400000 < ttl <= 86400000 + 60000  # a day after its minute (of the frozen clock)


def pg_connect_clock():
    conn = pg_connect()
    set_gucs(conn, test_clock_ms=CLOCK_MS)
    return conn


def test_nothing_written_when_off_or_allowed(pg, policy, shared_redis):
    conn = session()  # track_denials is off by default
    identity = new_ident("off")
    assert [conn.execute("SELECT rl_allow(%s, %s)", (policy, identity)).fetchone()[0]
            for _ in range(4)] == [True, True, False, False]
    assert shared_redis.command("EXISTS", bucket(policy)) == 0
    set_gucs(conn, track_denials="on")
    other = new_ident("allowed")
    assert conn.execute("SELECT rl_allow(%s, %s)", (policy, other)).fetchone()[0] is True
    assert shared_redis.command("EXISTS", bucket(policy)) == 0
    assert top(conn, policy) == []


def test_top_denied_says_when_denials_are_not_counted(pg, policy):
    """rl_top_denied with rl_redis.track_denials off answers what Redis
    holds (nothing, or what was counted before) and says, in a NOTICE, that
    denials are not being counted, with the setting in its hint; with the
    setting on it says nothing."""
    conn = session()
    notices = []
    conn.add_notice_handler(lambda d: notices.append(
        (d.severity_nonlocalized, d.message_primary, d.message_detail, d.message_hint)))
    assert top(conn, policy) == []
    assert notices == [("NOTICE", "denials are not being counted",
                        "rl_redis.track_denials is off in this session.",
                        "A superuser sets rl_redis.track_denials = on to count them.")], notices
    set_gucs(conn, track_denials="on")
    notices.clear()
    assert top(conn, policy) == []
    assert notices == [], notices


def test_n_and_since(pg, policy):
    conn = session(track_denials="on")
    idents = [new_ident("n%d" % i) for i in range(5)]
    for k, identity in enumerate(idents):
        for _ in range(2 + k + 1):
            conn.execute("SELECT rl_allow(%s, %s)", (policy, identity))
    assert top(conn, policy, n=2) == [(idents[4], 5), (idents[3], 4)]
    assert len(top(conn, policy, since="0")) == 5  # the current minute
    # the minute before holds nothing
    set_gucs(conn, test_clock_ms=CLOCK_MS + 60000)
    assert top(conn, policy, since="0") == []
    assert top(conn, policy, since="1 minute", n=1) == [(idents[4], 5)]
    assert top(conn, policy, since="1 day -1 hour", n=1) == [(idents[4], 5)]


@pytest.mark.parametrize("args, state", [
    (("{p}", "2 days", 1), "22023"),
    (("{p}", "-1 minute", 1), "22023"),
    (("{p}", "1 hour", 0), "22023"),
    (("{p}", "1 hour", 10001), "22023"),
    (("{p}", None, 1), "22004"),
    (("nope.%s" % uuid.uuid4().hex[:8], "1 hour", 1), "42704"),
])
def test_bad_arguments(pg, policy, args, state):
    args = tuple(policy if a == "{p}" else a for a in args)
    with pytest.raises(psycopg.Error) as e:
        pg.execute("SELECT * FROM rl_top_denied(%s, %s, %s)", args)
    assert e.value.sqlstate == state


def test_long_identity_is_bounded(pg, policy, shared_redis):
    """A 1 MB identity is counted as its first 100 bytes and a hash: the
    member stays short, and two long identities with the same beginning
    stay apart."""
    conn = session(track_denials="on", max_identity_bytes="1MB")
    a = "x" * 1000000 + "a"
    b = "x" * 1000000 + "b"
    for identity in (a, a, a, b, b, b):
        conn.execute("SELECT rl_allow(%s, %s)", (policy, identity))
    got = top(conn, policy)
    assert [d for _, d in got] == [1, 1]
    assert all(len(i) < 130 and i.startswith("x" * 100 + "...#") for i, _ in got)
    assert got[0][0] != got[1][0]
    assert shared_redis.command("MEMORY", "USAGE", bucket(policy)) < 10000


def test_bucket_is_bounded(pg, policy, shared_redis):
    """A minute's set holds at most 10 000 identities: the next new one is
    counted under (other), a known one still under its own name."""
    key = bucket(policy)
    args = []
    for i in range(10000):
        args += [1, "filler%d" % i]
    shared_redis.command("ZADD", key, *args)
    conn = session(track_denials="on")
    newcomer = new_ident("new")
    for _ in range(3):
        conn.execute("SELECT rl_allow(%s, %s)", (policy, newcomer))
    for _ in range(3):
        conn.execute("SELECT rl_allow(%s, %s)", (policy, "filler7"))
    assert shared_redis.command("ZCARD", key) == 10001
    assert int(float(shared_redis.command("ZSCORE", key, "(other)"))) == 1
    assert shared_redis.command("ZSCORE", key, newcomer) is None
    assert int(float(shared_redis.command("ZSCORE", key, "filler7"))) == 2


def test_redis_failure_keeps_the_denial(pg, policy, redis_factory):
    """When counting fails (the Redis of the decision is gone right after the
    decision is impossible to stage; here a Redis whose denials key is of
    the wrong type), the call still answers its decision, with one WARNING."""
    server = redis_factory()
    conn = pg_connect()
    set_gucs(conn, host="127.0.0.1", port=server.port, test_clock_ms=CLOCK_MS,
             retry_interval=0, track_denials="on")
    notices = []
    conn.add_notice_handler(lambda d: notices.append(d.message_primary))
    server.command("SET", bucket(policy), "not a sorted set")
    identity = new_ident("fail")
    got = [conn.execute("SELECT rl_allow(%s, %s)", (policy, identity)).fetchone()[0]
           for _ in range(5)]
    assert got == [True, True, False, False, False]
    assert [n for n in notices if "could not count a denial" in n] == \
        ['could not count a denial of policy "%s" for rl_top_denied' % policy]


def test_privileges(pg, policy):
    role = "rl_dn_%s" % uuid.uuid4().hex[:12]
    pg.execute(sql.SQL("CREATE ROLE {} LOGIN IN ROLE pg_read_all_stats").format(sql.Identifier(role)))
    try:
        with pg_connect(user=role) as conn:
            with pytest.raises(psycopg.Error) as e:
                conn.execute("SELECT * FROM rl_top_denied(%s, '1 hour', 1)", (policy,))
            assert e.value.sqlstate == "42501"
            with pytest.raises(psycopg.Error) as e:
                conn.execute("SET rl_redis.track_denials = on")
            assert e.value.sqlstate == "42501"
    finally:
        pg.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def key_kinds_of_the_sources():
    """The kinds of key rl_redis names, as its sources list them: each
    algorithm's key kind and its name (the kind of its earlier layouts,
    src/algorithms.h), the concurrency slots' and the denial counts'
    (src/keys.c)."""
    with open(os.path.join(ROOT, "src", "algorithms.h")) as f:
        algorithms = re.findall(r'^RL_ALGORITHM\((\w+), \w+, "([\w.]+)"', f.read(), re.M)
    with open(os.path.join(ROOT, "src", "keys.c")) as f:
        keys_c = f.read()
    kinds = {k for a in algorithms for k in a}
    kinds |= set(re.findall(r'"%s([\w.]+):\{', keys_c))  # appendStringInfo(buf, "%sdenials:{...", prefix)
    kinds |= {k for k in re.findall(r'"([\w.]+)", identity\)', keys_c)}  # rl_append_key_head(..., "concurrency", ...)
    assert "concurrency" in kinds and "denials" in kinds, kinds
    return [name for name, _ in algorithms], kinds


def test_readme_uninstall_loop_deletes_every_kind_of_key(pg, policy, redis_factory):
    """README, Uninstalling: the loop that deletes rl_redis's keys under a
    prefix names every kind of key rl_redis makes (the sources' list, so
    that a new kind cannot be left out), and deletes a key of each: every
    algorithm's (explicit and policy keys), the layouts of 1.5 and before
    (written here by hand: this release writes only the new ones), the
    concurrency slots and the denial counts. Run on a prefix of its own, on
    a Redis of its own: the loop SCANs the whole keyspace, which on the
    shared Redis holds what the other tests wrote (it took 20-30 s there)."""
    algorithms, kinds = key_kinds_of_the_sources()
    with open(README) as f:
        loop = re.search(r"^for kind in .*?^done$", f.read(), re.M | re.S).group(0)
    listed = re.match(r"for kind in ([^;]*);", loop).group(1).split()
    assert sorted(listed) == sorted(kinds), (listed, kinds)

    redis = redis_factory()
    prefix = "rl_dn_%s:" % uuid.uuid4().hex[:12]
    slots = "pytest.dn.slots.%s" % uuid.uuid4().hex[:12]
    pg.execute("INSERT INTO rl_policy (name, algorithm, lim, window_ms) VALUES (%s, 'concurrency', 2, 60000)",
               (slots,))
    conn = session(track_denials="on", key_prefix=prefix, host="127.0.0.1", port=redis.port)
    identity = new_ident("uninstall")
    try:
        conn.execute("BEGIN")  # the concurrency slot is held until the transaction ends
        for name in algorithms:
            assert conn.execute(sql.SQL("SELECT {}(%s, 5, 60000)").format(sql.Identifier("rl_%s_allow" % name)),
                                (identity,)).fetchone()[0]
        assert [conn.execute("SELECT rl_allow(%s, %s)", (policy, identity)).fetchone()[0]
                for _ in range(3)] == [True, True, False]
        assert conn.execute("SELECT rl_acquire_allow(%s, %s)", (slots, identity)).fetchone()[0]
        for name in algorithms:  # 1.5's keys
            redis.command("SET", "%s%s:{%s}:5/60000" % (prefix, name, identity), "1")
        written = redis.command("KEYS", prefix + "*")
        assert {re.match(re.escape(prefix) + r"([\w.]+):\{", k).group(1) for k in written} == kinds, written
        subprocess.run(["bash", "-e", "-o", "pipefail", "-c",
                        loop.replace('"rl:', '"' + prefix).replace("redis-cli", "redis-cli -p %d" % redis.port)],
                       check=True, timeout=30)
        assert redis.command("KEYS", prefix + "*") == []
        conn.execute("COMMIT")
    finally:
        conn.close()
        pg.execute("DELETE FROM rl_policy WHERE name = %s", (slots,))
    assert redis.command("KEYS", prefix + "*") == []
