"""The size of an identity is bounded on every path (issue 19, finding 2).

rl_redis.max_identity_bytes (superuser-only, default 1 kB) bounds the bytes
of an identity wherever one enters: the explicit algorithm functions (and
their peeks and refunds), policies, several limits, batches, concurrency
slots and their release, rl_reset and the identities the row and
statement guards build. A longer one is refused with 54000
(program_limit_exceeded) before anything is sent: Redis holds no key of
the call afterwards, not even of the short identities of the same batch or
statement. An identity of exactly the bound works.

Each test writes under a key prefix of its own, so "no key" is a SCAN of
that prefix in the shared Redis.
"""

import uuid

import psycopg
from psycopg import sql
import pytest

from conftest import new_ident, pg_connect, set_gucs

PROGRAM_LIMIT_EXCEEDED = "54000"
INSUFFICIENT_PRIVILEGE = "42501"

# every entry path that takes an identity: %(id)s is the identity, %(p)s a
# rate policy, %(cp)s a concurrency policy, {row} and {stmt} tables with a
# row guard and a statement guard
PATHS = [
    ("rl_fixed", "SELECT rl_fixed(%(id)s, 5, 60000)"),
    ("rl_fixed_allow", "SELECT rl_fixed_allow(%(id)s, 5, 60000)"),
    ("rl_fixed peek", "SELECT rl_fixed(%(id)s, 5, 60000, 0)"),
    ("rl_fixed_refund", "SELECT rl_fixed_refund(%(id)s, 5, 60000, 1)"),
    ("rl_sliding", "SELECT rl_sliding(%(id)s, 5, 60000)"),
    ("rl_sliding_counter", "SELECT rl_sliding_counter_allow(%(id)s, 5, 60000)"),
    ("rl_token_bucket", "SELECT rl_token_bucket(%(id)s, 5, 60000, 1, 10)"),
    ("rl_gcra", "SELECT rl_gcra_allow(%(id)s, 5, 60000, 1, 10)"),
    ("rl_check", "SELECT rl_check(%(p)s, %(id)s)"),
    ("rl_allow", "SELECT rl_allow(%(p)s, %(id)s)"),
    ("rl_check peek", "SELECT rl_check(%(p)s, %(id)s, 0)"),
    ("rl_refund", "SELECT rl_refund(%(p)s, %(id)s, 1)"),
    ("rl_check_all", "SELECT rl_check_all(ARRAY[%(p)s], %(id)s)"),
    ("rl_allow_all", "SELECT rl_allow_all(ARRAY[%(p)s], %(id)s)"),
    ("rl_check_many", "SELECT * FROM rl_check_many(%(p)s, ARRAY['short', %(id)s])"),
    ("rl_fixed_many", "SELECT * FROM rl_fixed_many(ARRAY['short', %(id)s], 5, 60000)"),
    ("rl_token_bucket_many",
     "SELECT * FROM rl_token_bucket_many(ARRAY[%(id)s, 'short'], 5, 60000, 1, 10)"),
    ("rl_acquire", "SELECT rl_acquire(%(p_c)s, %(id)s)"),
    ("rl_acquire_allow", "SELECT rl_acquire_allow(%(p_c)s, %(id)s)"),
    ("rl_release", "SELECT rl_release(%(p_c)s, %(id)s)"),
    ("rl_concurrency_acquire", "SELECT rl_concurrency_acquire(%(id)s, 5, 60000)"),
    ("rl_concurrency_acquire_allow", "SELECT rl_concurrency_acquire_allow(%(id)s, 5, 60000)"),
    ("rl_concurrency_release", "SELECT rl_concurrency_release(%(id)s)"),
    ("rl_reset", "SELECT rl_reset(%(id)s)"),
    ("row guard", "INSERT INTO {row} (tenant) VALUES (%(id)s)"),
    ("statement guard", "INSERT INTO {stmt} (tenant) VALUES ('short'), (%(id)s)"),
]


@pytest.fixture(scope="module")
def env():
    """Two policies and two guarded tables, removed at the end."""
    tag = uuid.uuid4().hex[:10]
    names = {"p": "idsize.%s" % tag, "p_c": "idsize.c.%s" % tag,
             "row": "idsize_row_%s" % tag, "stmt": "idsize_stmt_%s" % tag}
    conn = pg_connect()
    try:
        conn.execute("INSERT INTO rl_policy (name, algorithm, lim, window_ms) VALUES"
                     " (%s, 'fixed', 5, 60000), (%s, 'concurrency', 5, 60000)",
                     (names["p"], names["p_c"]))
        for table in ("row", "stmt"):
            conn.execute(sql.SQL("CREATE TABLE {} (tenant text)").format(
                sql.Identifier(names[table])))
        conn.execute(sql.SQL(
            "CREATE TRIGGER g AFTER INSERT ON {} FOR EACH ROW"
            " EXECUTE FUNCTION rl_guard('fixed:5/60000', 'tenant')").format(
                sql.Identifier(names["row"])))
        conn.execute(sql.SQL(
            "CREATE TRIGGER g AFTER INSERT ON {} REFERENCING NEW TABLE AS n"
            " FOR EACH STATEMENT EXECUTE FUNCTION rl_guard_statement({}, 'tenant')").format(
                sql.Identifier(names["stmt"]), sql.Literal(names["p"])))
        yield names
    finally:
        for table in ("row", "stmt"):
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(names[table])))
        conn.execute("DELETE FROM rl_policy WHERE name IN (%s, %s)", (names["p"], names["p_c"]))
        conn.close()


def statement(env, query):
    return sql.SQL(query).format(row=sql.Identifier(env["row"]),
                                 stmt=sql.Identifier(env["stmt"]))


def keys(redis, prefix):
    """The keys under prefix in the shared Redis."""
    found, cursor = [], "0"
    while True:
        cursor, batch = redis.command("SCAN", cursor, "MATCH", prefix + "*", "COUNT", "1000")
        found += batch
        if cursor == "0":
            return found


def session(max_bytes=None):
    """A superuser session under a key prefix of its own."""
    conn = pg_connect()
    prefix = "idsize:%s:" % uuid.uuid4().hex[:12]
    set_gucs(conn, key_prefix=prefix)
    if max_bytes is not None:
        set_gucs(conn, max_identity_bytes=max_bytes)
    return conn, prefix


def identity(nbytes, multibyte=False):
    """A fresh identity of exactly nbytes bytes (UTF-8); with multibyte,
    mostly two-byte characters."""
    head = new_ident("size")
    assert len(head) < nbytes
    fill = nbytes - len(head)
    if multibyte:
        return head + "\u00e9" * (fill // 2) + "x" * (fill % 2)
    return head + "x" * fill


@pytest.mark.parametrize("name,query", PATHS, ids=[p[0] for p in PATHS])
@pytest.mark.parametrize("multibyte", [False, True], ids=["ascii", "utf8"])
def test_one_byte_over_is_refused_and_writes_nothing(env, shared_redis, name, query, multibyte):
    conn, prefix = session(max_bytes=64)
    try:
        args = dict(env, id=identity(65, multibyte))
        with pytest.raises(psycopg.Error) as e:
            conn.execute(statement(env, query), args)
        assert e.value.sqlstate == PROGRAM_LIMIT_EXCEEDED, repr(e.value)
        assert "rl_redis.max_identity_bytes" in e.value.diag.message_primary, repr(e.value)
        assert e.value.diag.message_detail == "The identity is 65 bytes long.", repr(e.value)
        assert keys(shared_redis, prefix) == []
    finally:
        conn.close()


@pytest.mark.parametrize("name,query", PATHS, ids=[p[0] for p in PATHS])
def test_exactly_the_bound_works(env, shared_redis, name, query):
    conn, prefix = session(max_bytes=64)
    try:
        conn.execute(statement(env, query), dict(env, id=identity(64, multibyte=True)))
    finally:
        conn.close()


def test_default_bound_for_an_ordinary_role(pg, env, shared_redis):
    """An ordinary role deciding through a policy: 1 024 bytes work, 1 025
    are refused and write nothing; it may neither raise nor lower the bound."""
    assert pg.execute("SHOW rl_redis.max_identity_bytes").fetchone()[0] == "1kB"
    role = "rl_idsize_%s" % uuid.uuid4().hex[:10]
    pg.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
    try:
        conn, prefix = session()
        try:
            conn.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(role)))
            assert conn.execute("SELECT rl_allow(%s, %s)", (env["p"], identity(1024))).fetchone()[0]
            assert len(keys(shared_redis, prefix)) == 1
            with pytest.raises(psycopg.Error) as e:
                conn.execute("SELECT rl_allow(%s, %s)", (env["p"], identity(1025)))
            assert e.value.sqlstate == PROGRAM_LIMIT_EXCEEDED, repr(e.value)
            assert len(keys(shared_redis, prefix)) == 1
            for value in ("100MB", "1"):
                with pytest.raises(psycopg.Error) as e:
                    conn.execute("SET rl_redis.max_identity_bytes = %s" % sql.quote(value))
                assert e.value.sqlstate == INSUFFICIENT_PRIVILEGE, repr(e.value)
        finally:
            conn.close()
    finally:
        pg.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_setting_range(pg):
    """1 byte to 1 MB, in bytes with units."""
    pg.execute("SET rl_redis.max_identity_bytes = '1MB'")
    assert pg.execute("SELECT setting, unit FROM pg_settings"
                      " WHERE name = 'rl_redis.max_identity_bytes'").fetchone() == ("1048576", "B")
    for value in ("0", "1025kB"):
        with pytest.raises(psycopg.Error) as e:
            pg.execute("SET rl_redis.max_identity_bytes = %s" % sql.quote(value))
        assert e.value.sqlstate == "22023", repr(e.value)
