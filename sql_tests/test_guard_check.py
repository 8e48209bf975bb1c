"""Guards checked when created (issue 21, item 3).

The event trigger rl_guard_created refuses at CREATE TRIGGER a guard that
would fail at its first write (wrong kind 42P17, missing column 42703,
malformed limit 22023), with the guard's own checks, and warns of a missing
policy (42704: a restore creates triggers before rl_policy's rows);
rl_guard_check() lists the problems of the guards that exist (made before
1.6, or whose policy was deleted since). Triggers that are not guards, a
guard on a partitioned table and pg_dump/pg_restore are not disturbed.
"""
import os
import subprocess
import uuid

import psycopg
import pytest
from psycopg import sql

from conftest import PGBIN, new_ident, pg_connect

INVALID_OBJECT_DEFINITION = "42P17"
UNDEFINED_OBJECT = "42704"
UNDEFINED_COLUMN = "42703"
INVALID_PARAMETER_VALUE = "22023"
ROW_KIND = "rl_guard must be fired AFTER INSERT OR UPDATE ... FOR EACH ROW"
STATEMENT_KIND = ("rl_guard_statement must be fired AFTER ... FOR EACH STATEMENT"
                  " with REFERENCING NEW TABLE")


@pytest.fixture
def table(pg):
    """A new table (tenant text, n int, tokens int) and a policy of 5, both
    dropped afterwards; yields (table, policy)."""
    name = "gc_%s" % uuid.uuid4().hex[:12]
    policy = new_ident("gcpolicy")
    pg.execute(sql.SQL("CREATE TABLE {} (tenant text, n int, tokens int)").format(
        sql.Identifier(name)))
    pg.execute("INSERT INTO rl_policy (name, algorithm, lim, window_ms) VALUES (%s, 'sliding', 5, 60000)",
               (policy,))
    yield name, policy
    pg.execute(sql.SQL("DROP TABLE IF EXISTS {} CASCADE").format(sql.Identifier(name)))
    pg.execute("DELETE FROM rl_policy WHERE name = %s", (policy,))


def create(conn, table, timing, function, args, referencing=""):
    """CREATE TRIGGER guard <events> ON table [referencing] FOR EACH <level>
    EXECUTE FUNCTION function(args...), timing being "<events> FOR EACH
    <level>"."""
    events, level = timing.split(" FOR EACH ")
    conn.execute(sql.SQL("CREATE TRIGGER guard {} ON {} {} FOR EACH {} EXECUTE FUNCTION {}({})").format(
        sql.SQL(events), sql.Identifier(table), sql.SQL(referencing), sql.SQL(level),
        sql.SQL(function), sql.SQL(", ").join(sql.Literal(a) for a in args)))


def refused(conn, table, timing, function, args, referencing=""):
    """The error CREATE TRIGGER raises (and that no trigger was left)."""
    with pytest.raises(psycopg.Error) as exc:
        create(conn, table, timing, function, args, referencing)
    assert conn.execute("SELECT count(*) FROM pg_trigger WHERE tgrelid = %s::regclass",
                        (table,)).fetchone()[0] == 0
    return exc.value


def problems(conn, table):
    """rl_guard_check()'s rows for table, as (trigger, problem)."""
    return conn.execute(
        "SELECT trigger_name, problem FROM rl_guard_check()"
        " WHERE table_name = %s::regclass ORDER BY 1, 2", (table,)).fetchall()


@pytest.mark.parametrize("timing,function,referencing,message", [
    ("BEFORE INSERT FOR EACH ROW", "rl_guard", "", ROW_KIND),
    ("BEFORE INSERT OR UPDATE FOR EACH ROW", "rl_guard", "", ROW_KIND),
    ("AFTER INSERT FOR EACH STATEMENT", "rl_guard", "", ROW_KIND),
    ("AFTER INSERT OR DELETE FOR EACH ROW", "rl_guard", "", ROW_KIND),
    ("AFTER INSERT FOR EACH STATEMENT", "rl_guard_statement", "", STATEMENT_KIND),
    ("AFTER INSERT FOR EACH ROW", "rl_guard_statement", "REFERENCING NEW TABLE AS n", STATEMENT_KIND),
    ("BEFORE INSERT FOR EACH STATEMENT", "rl_guard_statement", "", STATEMENT_KIND),
])
def test_wrong_kind_is_refused(pg, table, timing, function, referencing, message):
    """A guard of the wrong kind is refused with 42P17, a detail and an
    example of the right CREATE TRIGGER in the hint."""
    name, policy = table
    err = refused(pg, name, timing, function, [policy, "tenant"], referencing)
    assert err.sqlstate == INVALID_OBJECT_DEFINITION, repr(err)
    assert err.diag.message_primary == message
    assert err.diag.message_detail
    assert err.diag.message_hint.startswith("For example: CREATE TRIGGER t AFTER INSERT ON tbl ")
    assert function + "('free', 'tenant_id')" in err.diag.message_hint


@pytest.mark.parametrize("function,referencing", [
    ("rl_guard", ""), ("rl_guard_statement", "REFERENCING NEW TABLE AS n")])
def test_wrong_arguments_are_refused(pg, table, function, referencing):
    """A missing identity or cost column (42703), a malformed limit, a
    burst where the algorithm has none, a wrong number of arguments (22023)
    are refused. A missing policy is a WARNING (42704, with the hint), not
    an error: a restore creates the triggers before rl_policy's rows; the
    guard is then made, rl_guard_check() lists it and a write fails."""
    name, policy = table
    timing = "AFTER INSERT FOR EACH " + ("STATEMENT" if referencing else "ROW")
    cases = [
        ([policy, "tenant, nope"], UNDEFINED_COLUMN),
        ([policy, "tenant", "nope"], UNDEFINED_COLUMN),
        (["fixed:abc", "tenant"], INVALID_PARAMETER_VALUE),
        (["fixed:0/1000", "tenant"], INVALID_PARAMETER_VALUE),
        (["fixed:5/60000/3", "tenant"], INVALID_PARAMETER_VALUE),
        ([policy], INVALID_PARAMETER_VALUE),
    ]
    for args, sqlstate in cases:
        err = refused(pg, name, timing, function, args, referencing)
        assert err.sqlstate == sqlstate, (args, repr(err))
    notices = []
    pg.add_notice_handler(lambda d: notices.append(
        (d.severity_nonlocalized, d.sqlstate, d.message_primary, d.message_hint)))
    create(pg, name, timing, function, ["missing.policy", "tenant"], referencing)
    assert [n[:3] for n in notices] == [
        ("WARNING", UNDEFINED_OBJECT, 'rate-limit policy "missing.policy" does not exist')]
    assert "rl_guard_check()" in notices[0][3] and "Restores" in notices[0][3]
    assert problems(pg, name) == [("guard", 'rate-limit policy "missing.policy" does not exist')]
    with pytest.raises(psycopg.Error) as exc:
        pg.execute(sql.SQL("INSERT INTO {} (tenant) VALUES ('a')").format(sql.Identifier(name)))
    assert exc.value.sqlstate == UNDEFINED_OBJECT
    pg.execute(sql.SQL("DROP TRIGGER guard ON {}").format(sql.Identifier(name)))
    err = refused(pg, name, timing, function, ["fixed:abc", "tenant"], referencing)
    assert err.diag.message_primary == 'invalid rate limit "fixed:abc"'
    assert "fixed:100/60000" in err.diag.message_detail


def test_right_guards_are_accepted(pg, table):
    """A row guard and a statement guard, on a policy or an explicit limit,
    are created by a non-superuser who may, charge as before, and
    rl_guard_check() finds nothing wrong."""
    name, policy = table
    role = "gc_%s" % uuid.uuid4().hex[:12]
    pg.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
    try:
        pg.execute(sql.SQL("ALTER TABLE {} OWNER TO {}").format(sql.Identifier(name), sql.Identifier(role)))
        pg.execute(sql.SQL("GRANT EXECUTE ON FUNCTION rl_guard(), rl_guard_statement() TO {}").format(
            sql.Identifier(role)))
        with pg_connect(user=role) as conn:
            create(conn, name, "AFTER INSERT OR UPDATE FOR EACH ROW", "rl_guard", [policy, "tenant"])
            conn.execute(sql.SQL("CREATE TRIGGER guard2 AFTER INSERT ON {} REFERENCING NEW TABLE AS n"
                                 " FOR EACH STATEMENT EXECUTE FUNCTION rl_guard_statement("
                                 "'sliding:10/60000', 'tenant, n', 'tokens')").format(sql.Identifier(name)))
            with pytest.raises(psycopg.Error) as exc:
                conn.execute(sql.SQL("CREATE TRIGGER bad BEFORE INSERT ON {} FOR EACH ROW"
                                     " EXECUTE FUNCTION rl_guard({}, 'tenant')").format(
                                         sql.Identifier(name), sql.Literal(policy)))
            assert exc.value.sqlstate == INVALID_OBJECT_DEFINITION, repr(exc.value)
        tenant = "gcok_%s" % uuid.uuid4().hex  # no ':' to escape in "tenant:n"
        pg.execute(sql.SQL("INSERT INTO {} VALUES (%s, 1, 3)").format(sql.Identifier(name)), (tenant,))
        assert pg.execute("SELECT (rl_check(%s, %s, 0)).remaining", (policy, tenant)).fetchone()[0] == 4
        assert pg.execute("SELECT (rl_sliding(%s, 10, 60000, 0)).remaining",
                          (tenant + ":1",)).fetchone()[0] == 7
        assert problems(pg, name) == []
        with pg_connect(user=role) as conn:
            assert problems(conn, name) == []
    finally:
        pg.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(name)))
        pg.execute(sql.SQL("REVOKE ALL ON FUNCTION rl_guard(), rl_guard_statement() FROM {}").format(
            sql.Identifier(role)))
        pg.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_check_lists_deleted_policy_and_unchecked_guard(pg, table):
    """rl_guard_check() lists a guard whose policy was deleted after it was
    created, and the problems of guards created while the event trigger was
    disabled (one row per problem: the kind, then the arguments)."""
    name, policy = table
    create(pg, name, "AFTER INSERT FOR EACH ROW", "rl_guard", [policy, "tenant"])
    assert problems(pg, name) == []
    pg.execute("DELETE FROM rl_policy WHERE name = %s", (policy,))
    assert problems(pg, name) == [("guard", 'rate-limit policy "%s" does not exist' % policy)]
    pg.execute(sql.SQL("DROP TRIGGER guard ON {}").format(sql.Identifier(name)))
    with pg.transaction():
        pg.execute("ALTER EVENT TRIGGER rl_guard_created DISABLE")
        pg.execute(sql.SQL("CREATE TRIGGER a BEFORE INSERT ON {} FOR EACH ROW"
                           " EXECUTE FUNCTION rl_guard('fixed:5/60000', 'tenant')").format(sql.Identifier(name)))
        pg.execute(sql.SQL("CREATE TRIGGER b AFTER INSERT ON {} FOR EACH STATEMENT"
                           " EXECUTE FUNCTION rl_guard_statement('gone', 'nope')").format(sql.Identifier(name)))
        pg.execute(sql.SQL("CREATE TRIGGER c AFTER INSERT ON {} FOR EACH ROW"
                           " EXECUTE FUNCTION rl_guard('fixed:5/60000', 'tenant, nope')").format(sql.Identifier(name)))
        pg.execute("ALTER EVENT TRIGGER rl_guard_created ENABLE")
    assert pg.execute("SELECT evtenabled FROM pg_event_trigger WHERE evtname = 'rl_guard_created'").fetchone()[0] == "O"
    assert problems(pg, name) == [
        ("a", ROW_KIND),
        ("b", 'rate-limit policy "gone" does not exist'),
        ("b", STATEMENT_KIND),
        ("c", 'column "nope" of relation "%s" does not exist' % name),
    ]


def test_other_triggers_are_untouched(pg, table):
    """A trigger that is not a guard is created as before, whatever its
    kind and arguments, and rl_guard_check() does not list it."""
    name, _ = table
    fn = "gc_fn_%s" % uuid.uuid4().hex[:8]
    pg.execute(sql.SQL("CREATE FUNCTION {}() RETURNS trigger LANGUAGE plpgsql AS"
                       " 'BEGIN RETURN NEW; END'").format(sql.Identifier(fn)))
    try:
        pg.execute(sql.SQL("CREATE TRIGGER other BEFORE INSERT ON {} FOR EACH ROW"
                           " EXECUTE FUNCTION {}('no_such_policy', 'nope')").format(
                               sql.Identifier(name), sql.Identifier(fn)))
        pg.execute(sql.SQL("INSERT INTO {} VALUES ('x', 1, 1)").format(sql.Identifier(name)))
        assert problems(pg, name) == []
    finally:
        pg.execute(sql.SQL("DROP FUNCTION {}() CASCADE").format(sql.Identifier(fn)))


def test_partitioned_table(pg, table):
    """A guard on a partitioned table is checked once and cloned on its
    partitions (existing and attached later), which then charge; a wrong
    one is refused."""
    _, policy = table
    name = "gc_part_%s" % uuid.uuid4().hex[:8]
    pg.execute(sql.SQL("CREATE TABLE {} (tenant text, n int) PARTITION BY LIST (n)").format(sql.Identifier(name)))
    try:
        pg.execute(sql.SQL("CREATE TABLE {} PARTITION OF {} FOR VALUES IN (1)").format(
            sql.Identifier(name + "_1"), sql.Identifier(name)))
        err = refused(pg, name, "AFTER INSERT FOR EACH ROW", "rl_guard", [policy, "nope"])
        assert err.sqlstate == UNDEFINED_COLUMN
        create(pg, name, "AFTER INSERT FOR EACH ROW", "rl_guard", [policy, "tenant"])
        pg.execute(sql.SQL("CREATE TABLE {} PARTITION OF {} FOR VALUES IN (2)").format(
            sql.Identifier(name + "_2"), sql.Identifier(name)))
        tenant = new_ident("gcpart")
        pg.execute(sql.SQL("INSERT INTO {} VALUES (%s, 1), (%s, 2)").format(sql.Identifier(name)),
                   (tenant, tenant))
        assert pg.execute("SELECT (rl_check(%s, %s, 0)).remaining", (policy, tenant)).fetchone()[0] == 3
        assert pg.execute(
            "SELECT count(*) FROM rl_guard_check() WHERE table_name::text LIKE %s", (name + "%",)
        ).fetchone()[0] == 0
    finally:
        pg.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(name)))


@pytest.mark.parametrize("jobs", [1, 4])
def test_dump_and_restore(pg, jobs):
    """pg_dump of a database with a policy and guards of both kinds
    restores (also in parallel) with the guards: the policies' data is
    there before the triggers are created."""
    src = "gc_src_%s" % uuid.uuid4().hex[:8]
    dst = "gc_dst_%s" % uuid.uuid4().hex[:8]
    dump = os.path.join(os.environ["RL_DIR"], src + ".dump")
    pg.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(src)))
    pg.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dst)))
    try:
        with pg_connect(dbname=src) as conn:
            conn.execute("CREATE EXTENSION rl_redis")
            conn.execute("INSERT INTO rl_policy (name, algorithm, lim, window_ms) VALUES ('dump.p', 'fixed', 3, 60000)")
            for i in range(8):
                conn.execute(sql.SQL("CREATE TABLE {} (tenant text)").format(sql.Identifier("t%d" % i)))
                create(conn, "t%d" % i, "AFTER INSERT FOR EACH ROW", "rl_guard", ["dump.p", "tenant"])
                conn.execute(sql.SQL("CREATE TRIGGER s AFTER INSERT ON {} REFERENCING NEW TABLE AS n"
                                     " FOR EACH STATEMENT EXECUTE FUNCTION rl_guard_statement('dump.p', 'tenant')"
                                     ).format(sql.Identifier("t%d" % i)))
        env = dict(os.environ)
        subprocess.run([os.path.join(PGBIN, "pg_dump"), "-Fc", "-f", dump, "-d", src],
                       check=True, capture_output=True, timeout=120, env=env)
        out = subprocess.run([os.path.join(PGBIN, "pg_restore"), "-j", str(jobs), "-d", dst,
                              "--exit-on-error", dump],
                             capture_output=True, timeout=120, env=env, text=True)
        assert out.returncode == 0, out.stderr
        with pg_connect(dbname=dst) as conn:
            assert conn.execute(
                "SELECT count(*) FROM pg_trigger WHERE tgfoid IN ('rl_guard()'::regprocedure,"
                " 'rl_guard_statement()'::regprocedure)").fetchone()[0] == 16
            assert conn.execute("SELECT count(*) FROM rl_guard_check()").fetchone()[0] == 0
    finally:
        for db in (src, dst):
            pg.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(db)))
        if os.path.exists(dump):
            os.remove(dump)


def test_check_waits_for_no_lock_on_a_table_it_may_not_read(pg, table):
    """An ordinary role granted nothing on a guarded table calls
    rl_guard_check() while another session holds ACCESS EXCLUSIVE on that
    table: it must answer without waiting for a table it may not read
    (bounded here by lock_timeout, whose expiry is 55P03): it says that
    table was not checked."""
    name, policy = table
    create(pg, name, "AFTER INSERT FOR EACH ROW", "rl_guard", [policy, "tenant"])
    pg.execute(sql.SQL("REVOKE ALL ON {} FROM PUBLIC").format(sql.Identifier(name)))
    role = "gc_role_%s" % uuid.uuid4().hex[:8]
    pg.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
    holder = pg_connect()
    user = pg_connect(user=role)
    try:
        assert user.execute("SELECT has_table_privilege(%s, 'SELECT')", (name,)).fetchone()[0] is False
        holder.autocommit = False
        holder.execute(sql.SQL("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE").format(sql.Identifier(name)))
        user.execute("SET lock_timeout = '2s'")
        rows = user.execute("SELECT table_name::text, trigger_name, problem FROM rl_guard_check()"
                            " WHERE table_name = %s::regclass", (name,)).fetchall()
        assert rows == [(name, "guard", "not checked: another session holds a lock on the table")]
    finally:
        holder.close()
        user.close()
        pg.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))
