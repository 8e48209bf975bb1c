"""rl_redis.idle_timeout: a session's Redis connections are closed once it
has been idle that long (counted from the end of its last transaction), and
the next call opens a new one. Measured on the Redis side with CLIENT LIST."""

import time

from conftest import new_ident, pg_connect, set_gucs


def clients(redis):
    """The ids of the clients connected to redis, but the one asking."""
    lines = redis.command("CLIENT", "LIST").strip().split("\n")
    return sorted(int(l.split("id=")[1].split(" ")[0]) for l in lines if "cmd=client" not in l)


def test_idle_connection_is_closed_and_reopened(redis_factory):
    redis = redis_factory()
    conn = pg_connect()
    try:
        set_gucs(conn, host="127.0.0.1", port=redis.port, retry_interval=0, idle_timeout=800)
        identity = new_ident("idle")
        q = "SELECT rl_fixed_allow(%s, 10, 600000)"
        assert conn.execute(q, (identity,)).fetchone()[0] is True
        first = clients(redis)
        assert len(first) == 1
        # busy within the timeout: the same connection
        for _ in range(3):
            time.sleep(0.1)
            assert conn.execute(q, (identity,)).fetchone()[0] is True
        assert clients(redis) == first
        # idle longer: Redis sees it go
        time.sleep(2.5)
        assert clients(redis) == []
        # the next call connects again, and the count went on
        assert conn.execute("SELECT (rl_fixed(%s, 10, 600000)).remaining", (identity,)).fetchone()[0] == 5
        second = clients(redis)
        assert len(second) == 1 and second != first
    finally:
        conn.close()


def test_no_idle_timeout_keeps_the_connection(redis_factory):
    redis = redis_factory()
    conn = pg_connect()
    try:
        set_gucs(conn, host="127.0.0.1", port=redis.port, retry_interval=0)
        assert conn.execute("SELECT rl_fixed_allow(%s, 10, 600000)", (new_ident("keep"),)).fetchone()[0]
        first = clients(redis)
        time.sleep(1.0)
        assert clients(redis) == first and len(first) == 1
    finally:
        conn.close()


def test_a_long_transaction_is_not_idle(redis_factory):
    """Inside a transaction the connection stays, however long the work
    between two calls; slots and refunds of that transaction still work."""
    redis = redis_factory()
    conn = pg_connect(autocommit=False)
    try:
        set_gucs(conn, host="127.0.0.1", port=redis.port, retry_interval=0, idle_timeout=200,
                 refund_on_abort="all")
        conn.commit()
        identity = new_ident("long")
        q = "SELECT (rl_fixed(%s, 10, 600000)).remaining"
        assert conn.execute(q, (identity,)).fetchone()[0] == 9
        first = clients(redis)
        conn.execute("SELECT pg_sleep(0.8)")
        assert clients(redis) == first
        assert conn.execute(q, (identity,)).fetchone()[0] == 8
        conn.rollback()  # gives both back
        conn.execute("SELECT 1")
        assert conn.execute("SELECT (rl_fixed(%s, 10, 600000, 0)).remaining", (identity,)).fetchone()[0] == 10
        conn.rollback()
    finally:
        conn.close()


def test_other_transactions_do_not_keep_it_open(redis_factory):
    """Transactions that do not call Redis do not count as use: a session
    busy with other work still lets its Redis connection go, and
    rl_redis_connections() says it is closed."""
    redis = redis_factory()
    conn = pg_connect()
    try:
        set_gucs(conn, host="127.0.0.1", port=redis.port, retry_interval=0, idle_timeout=300)
        assert conn.execute("SELECT rl_fixed_allow(%s, 10, 600000)", (new_ident("busy"),)).fetchone()[0]
        assert len(clients(redis)) == 1
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.5:
            conn.execute("SELECT 1")
            time.sleep(0.05)
        assert clients(redis) == []
        assert conn.execute("SELECT state FROM rl_redis_connections()").fetchall() == [("closed",)]
        # turned off: the next idle period keeps it
        set_gucs(conn, idle_timeout=0)
        assert conn.execute("SELECT rl_fixed_allow(%s, 10, 600000)", (new_ident("busy"),)).fetchone()[0]
        time.sleep(1.0)
        assert len(clients(redis)) == 1
    finally:
        conn.close()
