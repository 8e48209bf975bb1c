"""The circuit breaker: after a failure to reach Redis, calls within
rl_redis.retry_interval get the on_error decision at once, without touching
the network; one warning per outage; the recovery is logged."""

import os
import time

import psycopg
import pytest

from conftest import new_ident, rl_key, use_redis
from test_faults import allow, collect_notices, timed_error, warnings_of

ALLOW = "SELECT rl_sliding_allow(%s, 1000, 600000)"


def postgres_log():
    """The test cluster's server log (sql_tests/lib.sh writes it there)."""
    with open(os.path.join(os.environ["RL_DIR"], "postgres.log"), errors="replace") as f:
        return f.read()


def test_open_breaker_skips_a_hung_redis(pg, redis_factory):
    r = redis_factory()
    use_redis(pg, r, on_error="allow", command_timeout=300, retry_interval=60000)
    identity = new_ident("breaker_hung")
    notices = collect_notices(pg)
    assert allow(pg, identity) is True

    r.pause()
    t0 = time.monotonic()
    assert allow(pg, identity) is True  # waits command_timeout once
    first = time.monotonic() - t0
    assert 0.25 <= first <= 1.5, first

    t0 = time.monotonic()
    results = [allow(pg, identity) for _ in range(200)]
    rest = time.monotonic() - t0
    assert results == [True] * 200
    # 200 calls that each waited 300 ms would take a minute: none did
    assert rest < 5.0, rest
    assert len(warnings_of(notices)) == 1, notices
    r.resume()


def test_breaker_fails_fast_then_retries(pg, redis_factory):
    r = redis_factory()
    use_redis(pg, r, on_error="error", retry_interval=60000)
    identity = new_ident("breaker_retry")
    assert allow(pg, identity) is True
    r.stop()

    err, _ = timed_error(pg, ALLOW, (identity,))
    assert err.sqlstate == "08001", repr(err)
    assert "not retried" not in str(err)
    # within the interval: the same failure, without trying
    r.start()
    err, elapsed = timed_error(pg, ALLOW, (identity,))
    assert err.sqlstate == "08001", repr(err)
    assert "not retried for rl_redis.retry_interval" in str(err), str(err)
    # once the interval has passed, the next call tries and succeeds
    pg.execute("SET rl_redis.retry_interval = 1")
    time.sleep(0.05)
    assert allow(pg, identity) is True
    assert int(r.cli("EXISTS", rl_key("sliding", identity, lim=1000, window_ms=600000))) == 1


def test_one_warning_per_outage_and_recovery_logged(pg, redis_factory):
    r = redis_factory()
    use_redis(pg, r, on_error="deny", retry_interval=0)
    identity = new_ident("breaker_warn")
    notices = collect_notices(pg)
    assert allow(pg, identity) is True

    r.stop()
    # every call tries (retry_interval 0) but the outage is reported once
    assert [allow(pg, identity) for _ in range(5)] == [False] * 5
    assert len(warnings_of(notices)) == 1, notices
    assert "Requests are denied" in warnings_of(notices)[0].message_detail

    r.start()
    assert allow(pg, identity) is True
    port = r.port
    deadline = time.monotonic() + 10
    while "connection to Redis at 127.0.0.1:%d restored after" % port not in postgres_log():
        assert time.monotonic() < deadline, "recovery was not logged"
        time.sleep(0.1)

    # a second outage is reported again
    r.stop()
    assert allow(pg, identity) is False
    assert len(warnings_of(notices)) == 2, notices


def test_ping_always_tries(pg, redis_factory):
    r = redis_factory()
    use_redis(pg, r, on_error="allow", retry_interval=60000)
    identity = new_ident("breaker_ping")
    r.stop()
    assert allow(pg, identity) is True
    r.start()
    assert allow(pg, identity) is True  # breaker open: not tried
    assert int(r.cli("EXISTS", rl_key("sliding", identity, lim=1000, window_ms=600000))) == 0
    server, rtt = pg.execute("SELECT * FROM rl_redis_ping()").fetchone()
    assert server == "127.0.0.1:%d" % r.port and rtt >= 0
    assert allow(pg, identity) is True
    assert int(r.cli("EXISTS", rl_key("sliding", identity, lim=1000, window_ms=600000))) == 1
