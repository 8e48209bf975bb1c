"""Many sessions hammering the same identity, and real-clock window tests.

All of these use the shared Redis that postgresql.conf points at.
"""

import threading
import time

import pytest

from conftest import give_back_session, new_ident, pg_connect, same_fixed_window, take_session

THREADS = 16
CALLS_PER_THREAD = 20
LONG_WINDOW_MS = 600000

ALGORITHMS = ["rl_fixed_allow", "rl_sliding_allow"]


def hammer(jobs, threads=THREADS, calls=CALLS_PER_THREAD):
    """Runs `threads` threads, each with its own connection, all starting at
    the same moment. Call i of thread t runs jobs(t, i) -> (sql, params) and
    the boolean results are counted per sql+params[0].

    Returns {(sql, identity): allowed_count}."""
    conns = [take_session() for _ in range(threads)]
    barrier = threading.Barrier(threads)
    results = [dict() for _ in range(threads)]
    errors = []

    def worker(t):
        try:
            conn = conns[t]
            barrier.wait(timeout=60)
            for i in range(calls):
                query, params = jobs(t, i)
                row = conn.execute(query, params).fetchone()
                assert row is not None and isinstance(row[0], bool), row
                key = (query, params[0])
                results[t][key] = results[t].get(key, 0) + (1 if row[0] else 0)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    ths = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    try:
        for th in ths:
            th.start()
        for th in ths:
            th.join(timeout=300)
        assert not any(th.is_alive() for th in ths), "worker threads hung"
    finally:
        for c in conns:
            give_back_session(c)
    assert errors == [], errors
    total = {}
    for r in results:
        for k, v in r.items():
            total[k] = total.get(k, 0) + v
    return total



def peek_remaining(conn, func, identity, lim, window_ms):
    """remaining of a cost-0 call (a peek, consumes nothing)."""
    base = func.replace("_allow", "")
    row = conn.execute(
        "SELECT (r).remaining FROM %s(%%s, %%s, %%s, 0) AS r" % base,
        (identity, lim, window_ms),
    ).fetchone()
    return row[0]


@pytest.mark.parametrize("func", ALGORITHMS)
@pytest.mark.parametrize("cost, expected", [(1, 100), (3, 33)])
def test_many_sessions_one_identity(pg, shared_redis, func, cost, expected):
    lim = 100
    assert THREADS * CALLS_PER_THREAD * cost > lim * 2  # plenty of contention

    query = "SELECT %s(%%s, %%s, %%s, %%s)" % func

    def run():
        identity = new_ident("conc")
        total = hammer(lambda t, i: (query, (identity, lim, LONG_WINDOW_MS, cost)))
        # denied calls consumed nothing: exactly lim - allowed*cost are left
        remaining = peek_remaining(pg, func, identity, lim, LONG_WINDOW_MS)
        # and one more call of that cost is denied (for cost 3: 1 left < 3)
        again = pg.execute(query, (identity, lim, LONG_WINDOW_MS, cost)).fetchone()[0]
        return total[(query, identity)], remaining, again

    if func == "rl_fixed_allow":
        allowed, remaining, again = same_fixed_window(shared_redis, LONG_WINDOW_MS, run)
    else:
        allowed, remaining, again = run()

    assert allowed == expected
    assert remaining == lim - expected * cost
    assert again is False


@pytest.mark.parametrize("func", ALGORITHMS)
def test_identities_have_independent_quotas(pg, shared_redis, func):
    lim_a, lim_b = 40, 70
    query = "SELECT %s(%%s, %%s, %%s)" % func

    def run():
        a, b = new_ident("indepA"), new_ident("indepB")
        # even threads hit A, odd threads hit B, all at the same time
        total = hammer(
            lambda t, i: (query, (a, lim_a, LONG_WINDOW_MS))
            if t % 2 == 0
            else (query, (b, lim_b, LONG_WINDOW_MS))
        )
        return a, b, total

    if func == "rl_fixed_allow":
        a, b, total = same_fixed_window(shared_redis, LONG_WINDOW_MS, run)
    else:
        a, b, total = run()

    assert total[(query, a)] == lim_a
    assert total[(query, b)] == lim_b

    # sequentially: exhausting C leaves a fresh D untouched
    def seq():
        c, d = new_ident("indepC"), new_ident("indepD")
        got_c = [pg.execute(query, (c, 3, LONG_WINDOW_MS)).fetchone()[0] for _ in range(4)]
        got_d = [pg.execute(query, (d, 3, LONG_WINDOW_MS)).fetchone()[0] for _ in range(4)]
        return got_c, got_d

    if func == "rl_fixed_allow":
        got_c, got_d = same_fixed_window(shared_redis, LONG_WINDOW_MS, seq)
    else:
        got_c, got_d = seq()
    assert got_c == [True, True, True, False]
    assert got_d == [True, True, True, False]


def wait_for_redis_clock(redis, until_ms, timeout=30.0):
    """Polls the Redis clock (what the scripts use) until it reads until_ms."""
    deadline = time.monotonic() + timeout
    while redis.time_ms() < until_ms:
        assert time.monotonic() < deadline, "the Redis clock never reached %d" % until_ms
        time.sleep(0.02)


# The two tests below are the real-clock smoke tests of the windows (every
# other test freezes time with rl_redis.test_clock_ms): short windows, and an
# attempt whose calls took too long on a loaded machine (so that the window
# moved under them) is run again with a fresh identity rather than judged.


def test_sliding_real_clock(pg, shared_redis):
    """lim 3 per 400 ms: four calls well inside one window give three
    admits and a denial; once the window has passed the newest of them (on
    the Redis clock) the old entries are gone: three fit again, then
    denied."""
    window = 400
    margin = 150  # the calls of one phase must fit in window - margin
    query = "SELECT rl_sliding_allow(%s, 3, %s)"
    for _ in range(6):
        identity = new_ident("slide")
        t0 = shared_redis.time_ms()
        got = [pg.execute(query, (identity, window)).fetchone()[0] for _ in range(4)]
        t1 = shared_redis.time_ms()
        if t1 - t0 >= window - margin:
            continue  # not all four inside one window: try again
        wait_for_redis_clock(shared_redis, t1 + window + 50)
        t2 = shared_redis.time_ms()
        after = [pg.execute(query, (identity, window)).fetchone()[0] for _ in range(4)]
        t3 = shared_redis.time_ms()
        if t3 - t2 < window - margin:
            break
    else:
        pytest.fail("4 calls never fitted in %d ms" % (window - margin))
    assert got == [True, True, True, False]
    # the old entries are gone: 3 fit, then denied again
    assert after == [True, True, True, False]


def test_fixed_real_clock(pg, shared_redis):
    """lim 3 per 400 ms: four calls inside one window of the Redis clock
    give three admits and a denial; in the next window a call is allowed."""
    window = 400
    query = "SELECT rl_fixed_allow(%s, 3, %s)"
    for _ in range(6):
        # start early in a window of the Redis clock
        into = shared_redis.time_ms() % window
        if into > 100:
            wait_for_redis_clock(shared_redis, shared_redis.time_ms() - into + window + 10)
        identity = new_ident("fixed")
        t0 = shared_redis.time_ms()
        got = [pg.execute(query, (identity, window)).fetchone()[0] for _ in range(4)]
        t1 = shared_redis.time_ms()
        if t0 // window == t1 // window:
            break
    else:
        pytest.fail("4 calls never fitted in one %d ms window" % window)
    assert got == [True, True, True, False]
    # the next window of the Redis clock, with a margin
    wait_for_redis_clock(shared_redis, (t1 // window + 1) * window + 50)
    assert pg.execute(query, (identity, window)).fetchone()[0] is True
