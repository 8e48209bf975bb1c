"""The size of an identity is bounded on every path (issue 19, finding 2).

rl_redis.max_identity_bytes (superuser-only, default 1 kB) bounds the bytes
of an identity wherever one can make state: the explicit algorithm
functions (and their peeks), policies, several limits, batches, concurrency
slots and the identities the row and statement guards build. A longer one
is refused with 54000 (program_limit_exceeded) before anything is sent:
Redis holds no key of the call afterwards, not even of the short
identities of the same batch or statement. An identity of exactly the
bound works.

What only touches state that exists (releasing a slot, refunds, rl_reset)
is bounded by the setting's largest value (1 MB) instead: a bound lowered
after a slot was taken or units charged does not keep them (issue 19
review, finding 5), and a refund of a key that does not exist makes none.

Each test writes under a key prefix of its own, so "no key" is a SCAN of
that prefix in the shared Redis.
"""

import uuid

import psycopg
from psycopg import sql
import pytest

from conftest import new_ident, pg_connect, set_gucs, vm_hwm_kb

PROGRAM_LIMIT_EXCEEDED = "54000"
INSUFFICIENT_PRIVILEGE = "42501"
LARGEST_BOUND = 1024 * 1024

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

# the paths that only touch state that exists: bounded by LARGEST_BOUND
EXISTING = {"rl_fixed_refund", "rl_refund", "rl_release", "rl_concurrency_release", "rl_reset"}
BOUNDED = [p for p in PATHS if p[0] not in EXISTING]


def too_long(e, length, limit, guard=False):
    """Whether e is the error of an identity of length bytes over limit."""
    detail = "The identity is %s%d bytes long; the limit is %d bytes." % (
        "at least " if guard else "", length, limit)
    return (e.sqlstate == PROGRAM_LIMIT_EXCEEDED
            and e.diag.message_primary == "identity is too long"
            and e.diag.message_detail == detail
            and "rl_redis.max_identity_bytes" in (e.diag.message_hint or ""))


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


@pytest.mark.parametrize("name,query", BOUNDED, ids=[p[0] for p in BOUNDED])
@pytest.mark.parametrize("multibyte", [False, True], ids=["ascii", "utf8"])
def test_one_byte_over_is_refused_and_writes_nothing(env, shared_redis, name, query, multibyte):
    conn, prefix = session(max_bytes=64)
    try:
        args = dict(env, id=identity(65, multibyte))
        with pytest.raises(psycopg.Error) as e:
            conn.execute(statement(env, query), args)
        assert too_long(e.value, 65, 64, guard="guard" in name), repr(e.value)
        assert keys(shared_redis, prefix) == []
    finally:
        conn.close()


@pytest.mark.parametrize("name,query", sorted(p for p in PATHS if p[0] in EXISTING))
def test_existing_state_paths_take_any_identity_state_can_have(env, shared_redis, name, query):
    """Over the setting, a release, refund or reset of state that does not
    exist works and makes no key; over the setting's largest value it is
    refused like any other."""
    conn, prefix = session(max_bytes=64)
    try:
        conn.execute(statement(env, query), dict(env, id=identity(2000)))
        assert keys(shared_redis, prefix) == []
        with pytest.raises(psycopg.Error) as e:
            conn.execute(statement(env, query), dict(env, id=identity(LARGEST_BOUND + 1)))
        assert too_long(e.value, LARGEST_BOUND + 1, LARGEST_BOUND), repr(e.value)
    finally:
        conn.close()


REFUNDS = [
    ("fixed", "rl_fixed(%(id)s, 5, 60000, 3)", "rl_fixed_refund(%(id)s, 5, 60000, 3)"),
    ("sliding", "rl_sliding(%(id)s, 5, 60000, 3)", "rl_sliding_refund(%(id)s, 5, 60000, 3)"),
    ("sliding_counter", "rl_sliding_counter(%(id)s, 5, 60000, 3)",
     "rl_sliding_counter_refund(%(id)s, 5, 60000, 3)"),
    ("token_bucket", "rl_token_bucket(%(id)s, 5, 60000, 3)",
     "rl_token_bucket_refund(%(id)s, 5, 60000, 3)"),
    ("gcra", "rl_gcra(%(id)s, 5, 60000, 3)", "rl_gcra_refund(%(id)s, 5, 60000, 3)"),
    ("policy", "rl_check(%(p)s, %(id)s, 3)", "rl_refund(%(p)s, %(id)s, 3)"),
]


@pytest.mark.parametrize("name,charge,refund", REFUNDS, ids=[r[0] for r in REFUNDS])
def test_lowered_bound_keeps_refunds(env, shared_redis, name, charge, refund):
    """Units charged under a 2 kB bound for a 1 500-byte identity are given
    back after the bound was lowered to 1 kB; a refund of a key that does
    not exist (under that identity, or a longer one) makes none."""
    conn, prefix = session(max_bytes="2kB")
    try:
        args = dict(env, id=identity(1500))
        assert conn.execute("SELECT (%s).remaining" % charge, args).fetchone()[0] == 2
        assert len(keys(shared_redis, prefix)) == 1
        set_gucs(conn, max_identity_bytes="1kB")
        assert conn.execute("SELECT (%s).remaining" % refund, args).fetchone()[0] == 5
        assert keys(shared_redis, prefix) == []
        assert conn.execute("SELECT (%s).remaining" % refund, args).fetchone()[0] == 5
        assert conn.execute("SELECT (%s).remaining" % refund,
                            dict(env, id=identity(3000))).fetchone()[0] == 5
        assert keys(shared_redis, prefix) == []
    finally:
        conn.close()


@pytest.mark.parametrize("acquire,release", [
    ("rl_acquire_allow(%(p_c)s, %(id)s)", "rl_release(%(p_c)s, %(id)s)"),
    ("rl_concurrency_acquire_allow(%(id)s, 1, 60000)", "rl_concurrency_release(%(id)s)"),
], ids=["policy", "explicit"])
def test_lowered_bound_keeps_releases(env, acquire, release):
    """A slot taken under a 2 kB bound for a 1 500-byte identity is given
    back, before its transaction ends, after the bound was lowered to 1 kB:
    another session can take it."""
    conn, _ = session(max_bytes="2kB")
    other = pg_connect()
    try:
        set_gucs(other, key_prefix=conn.execute("SHOW rl_redis.key_prefix").fetchone()[0],
                 max_identity_bytes="2kB")
        args = dict(env, id=identity(1500))
        lim = 5 if "p_c" in acquire else 1
        conn.execute("BEGIN")  # the slots belong to the transaction
        for _ in range(lim):
            assert conn.execute("SELECT " + acquire, args).fetchone()[0] is True
        assert other.execute("SELECT " + acquire, args).fetchone()[0] is False
        conn.execute("SET LOCAL rl_redis.max_identity_bytes = '1kB'")
        assert conn.execute("SELECT " + release, args).fetchone()[0] is True
        assert other.execute("SELECT " + acquire, args).fetchone()[0] is True
        conn.execute("COMMIT")
    finally:
        other.close()
        conn.close()


def test_lowered_bound_keeps_reset(env, shared_redis):
    """rl_reset deletes the state of a 1 500-byte identity made under a 2 kB
    bound after the bound was lowered to 1 kB."""
    conn, prefix = session(max_bytes="2kB")
    try:
        args = dict(env, id=identity(1500))
        conn.execute("SELECT rl_fixed(%(id)s, 5, 60000), rl_check(%(p)s, %(id)s)", args)
        assert len(keys(shared_redis, prefix)) == 2
        set_gucs(conn, max_identity_bytes="1kB")
        conn.execute("SELECT rl_reset(%(id)s)", args)
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
            assert too_long(e.value, 1025, 1024), repr(e.value)
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


def test_statement_guard_keeps_no_long_identity(env):
    """A statement guard keeps of each identity at most a few bytes past the
    bound, and frees what it read of a row before the next one: 20 rows of
    4 MB identities that cost nothing (not checked, not charged) grow the
    backend's peak memory by far less than their 80 MB, inserted (the
    transition table holds the values as they are) or updated (it holds
    TOAST pointers). Until the identity was checked at the decision rather
    than as it was built, the first too-long row failed the statement; then
    every row's whole identity was kept, and an update's detoasted values
    too, until the statement's end (about 80 MB and 160 MB here)."""
    table = "idsize_mem_%s" % uuid.uuid4().hex[:10]
    conn, _ = session()
    try:
        conn.execute(sql.SQL("CREATE TABLE {} (tenant text, units int)").format(
            sql.Identifier(table)))
        for event in ("INSERT", "UPDATE"):
            conn.execute(sql.SQL(
                "CREATE TRIGGER {} AFTER " + event + " ON {} REFERENCING NEW TABLE AS n"
                " FOR EACH STATEMENT EXECUTE FUNCTION rl_guard_statement('fixed:5/60000',"
                " 'tenant', 'units')").format(sql.Identifier("g_" + event.lower()),
                                              sql.Identifier(table)))
        insert = sql.SQL("INSERT INTO {} SELECT i || repeat('x', 4000000), 0"
                         " FROM generate_series(1, %s) i").format(sql.Identifier(table))
        conn.execute(insert, (1,))  # the library, the guard, one row's buffers
        pid = conn.info.backend_pid
        before = vm_hwm_kb(pid)
        conn.execute(insert, (20,))
        inserted = vm_hwm_kb(pid) - before
        before = vm_hwm_kb(pid)
        conn.execute(sql.SQL("UPDATE {} SET units = 0").format(sql.Identifier(table)))
        updated = vm_hwm_kb(pid) - before
        assert (inserted < 30 * 1024, updated < 30 * 1024) == (True, True), (
            "peak memory grew by %d MB (insert) and %d MB (update)"
            % (inserted // 1024, updated // 1024))
    finally:
        conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(table)))
        conn.close()
