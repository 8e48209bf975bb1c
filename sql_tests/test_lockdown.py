"""The README's privileges, function by function (issue 19, finding 7, and
its review, findings 1 and 7).

The privilege table of README.md's "Granting access" section is the one
statement of who may execute what: every function of the extension (found
through pg_depend) must be named in exactly one of its rows, and the rows
say which are PUBLIC's by default (a "who" naming `PUBLIC`), which of those
stay PUBLIC's after the section's lockdown block ("after the lockdown"),
and which pg_read_all_stats may execute (a "who" naming it). The tests
check a fresh install against the table, run the block (taken from
README.md as it is, with its roles renamed to ones of the test's own) and
check that a role granted nothing can execute only what the table leaves
open, while the application role may call every decision function, the
batch ones included.

An ALTER EXTENSION UPDATE creates its new functions with their default
privileges (1.4 to 1.5: rl_check_many for PUBLIC), so the README says to
run the block again after every update: a database locked down under 1.4,
updated, and locked down again with the current block has the privileges
of a fresh install locked down.
"""

import contextlib
import re
import uuid

import psycopg
from psycopg import sql
import pytest

from conftest import control_version, pg_connect, readme_privileges, readme_section

INSUFFICIENT_PRIVILEGE = "42501"
ROLES = ("app", "support", "table_owner", "limits_admin")

# the lockdown block of the 1.4 README (released; the six functions)
LOCKDOWN_1_4 = """
GRANT EXECUTE ON FUNCTION
    rl_fixed(text, integer, bigint, integer),
    rl_fixed_allow(text, integer, bigint, integer),
    rl_sliding(text, integer, bigint, integer),
    rl_sliding_allow(text, integer, bigint, integer),
    rl_sliding_counter(text, integer, bigint, integer),
    rl_sliding_counter_allow(text, integer, bigint, integer),
    rl_token_bucket(text, integer, bigint, integer, integer),
    rl_token_bucket_allow(text, integer, bigint, integer, integer),
    rl_gcra(text, integer, bigint, integer, integer),
    rl_gcra_allow(text, integer, bigint, integer, integer),
    rl_concurrency_acquire(text, integer, bigint),
    rl_concurrency_acquire_allow(text, integer, bigint)
  TO app;
REVOKE EXECUTE ON FUNCTION
    rl_check(text, text, integer), rl_allow(text, text, integer),
    rl_check_all(text[], text, integer), rl_allow_all(text[], text, integer),
    rl_acquire(text, text), rl_acquire_allow(text, text)
  FROM PUBLIC;
GRANT EXECUTE ON FUNCTION
    rl_check(text, text, integer), rl_allow(text, text, integer),
    rl_check_all(text[], text, integer), rl_allow_all(text[], text, integer),
    rl_acquire(text, text), rl_acquire_allow(text, text)
  TO app;
GRANT EXECUTE ON FUNCTION rl_reset(text), rl_refund(text, text, integer) TO support;
GRANT EXECUTE ON FUNCTION rl_guard(), rl_guard_statement() TO table_owner;
GRANT INSERT, UPDATE, DELETE ON rl_policy TO limits_admin;
"""


def table(procs):
    """{regprocedure: its Row} for the functions procs ({regprocedure:
    oid}); each function must be named by exactly one row."""
    rows = readme_privileges()
    found = {}
    for proc in procs:
        name = proc.split("(")[0]
        named = [r for r in rows if name in r.names]
        assert len(named) == 1, "%s is named by %d rows of the README's privilege table" % (
            proc, len(named))
        found[proc] = named[0]
    return found


def readme_lockdown():
    """The setup directive and the SQL block of README.md's "Granting
    access" section."""
    m = re.search(r"^<!-- setup: (.*?) -->\n```sql\n(.*?)^```", readme_section("Granting access"),
                  re.M | re.S)
    assert m, "the Granting access section has no setup directive and SQL block"
    return m.group(1), m.group(2)


def renamed(text, names):
    """text with the README's roles replaced by the test's."""
    return re.sub(r"\b(%s)\b" % "|".join(ROLES), lambda m: names[m.group(1)], text)


@contextlib.contextmanager
def new_database(version=None):
    """A new database with rl_redis (of version, or the default one), and
    names for roles of the test's own; all dropped afterwards."""
    tag = uuid.uuid4().hex[:10]
    db = "rl_lockdown_%s" % tag
    names = {r: "rl_%s_%s" % (r, tag) for r in ROLES + ("nobody",)}
    admin = pg_connect()
    admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(db)))
    conn = pg_connect(dbname=db)
    try:
        if version:
            conn.execute(sql.SQL("CREATE EXTENSION rl_redis VERSION {}").format(sql.Literal(version)))
        else:
            conn.execute("CREATE EXTENSION rl_redis")
        yield conn, names
    finally:
        conn.close()
        admin.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(db)))
        for role in names.values():
            admin.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))
        admin.close()


@pytest.fixture
def database():
    with new_database() as d:
        yield d


def functions(conn):
    """{regprocedure: oid} of every function of the extension."""
    rows = conn.execute(
        "SELECT p.oid::regprocedure::text, p.oid FROM pg_depend d JOIN pg_proc p ON p.oid = d.objid"
        " WHERE d.classid = 'pg_proc'::regclass AND d.deptype = 'e'"
        " AND d.refclassid = 'pg_extension'::regclass"
        " AND d.refobjid = (SELECT oid FROM pg_extension WHERE extname = 'rl_redis')").fetchall()
    return dict(rows)


def may(conn, role, oid):
    return conn.execute("SELECT has_function_privilege(%s, %s::oid, 'EXECUTE')",
                        (role, oid)).fetchone()[0]


def call(conn, oid):
    """A call of the function with NULL arguments (the privilege is checked
    before any argument is)."""
    types = conn.execute("SELECT array(SELECT format_type(t, NULL) FROM unnest(proargtypes) t),"
                         " oid::regproc::text FROM pg_proc WHERE oid = %s", (oid,)).fetchone()
    args = sql.SQL(", ").join(sql.SQL("NULL::" + t) for t in types[0])
    return sql.SQL("SELECT {}({})").format(sql.SQL(types[1]), args)


def lock_down(conn, names, block):
    """Runs a lockdown block with the test's roles, and makes the role
    granted nothing."""
    conn.execute(renamed(block, names))
    conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(names["nobody"])))


def check_locked_down(conn, names):
    """After the README's lockdown: a role granted nothing may execute only
    what the table leaves open after it (and calling the rest is refused),
    the application may decide every way, batches included, and support
    and the table owner have their functions."""
    nobody = names["nobody"]
    procs = functions(conn)
    rows = table(procs)
    for proc, oid in procs.items():
        assert may(conn, nobody, oid) == rows[proc].open_after_lockdown, proc
    conn.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(nobody)))
    for proc, oid in procs.items():
        if rows[proc].open_after_lockdown or proc.endswith("()"):
            continue
        with pytest.raises(psycopg.Error) as e:
            conn.execute(call(conn, oid))
        assert e.value.sqlstate == INSUFFICIENT_PRIVILEGE, (proc, repr(e.value))
    conn.execute("RESET ROLE")
    application = [proc for proc, row in rows.items()
                   if (row.public and not row.open_after_lockdown) or row.may.startswith("take")]
    assert "rl_check_many(text,text[],integer)" in application
    assert "rl_gcra_many(text[],integer,bigint,integer,integer)" in application
    for proc in application:
        assert may(conn, names["app"], procs[proc]), proc
    for proc in ("rl_reset(text)", "rl_refund(text,text,integer)"):
        assert may(conn, names["support"], procs[proc]), proc
    for proc in ("rl_guard()", "rl_guard_statement()"):
        assert may(conn, names["table_owner"], procs[proc]), proc


def test_every_function_is_in_the_privilege_table(database):
    conn, _ = database
    rows = table(functions(conn))
    assert len(rows) == len(functions(conn))
    # every row that names functions names functions of the extension
    names = {proc.split("(")[0] for proc in rows}
    for row in readme_privileges():
        stray = {n for n in row.names - names if n not in ("rl_policy", "rl_redis_stats")}
        assert stray == set(), (row.who, stray)


def test_fresh_install_privileges(database):
    conn, names = database
    conn.execute(sql.SQL("CREATE ROLE {}").format(sql.Identifier(names["nobody"])))
    procs = functions(conn)
    rows = table(procs)
    for proc, oid in procs.items():
        assert may(conn, names["nobody"], oid) == rows[proc].public, proc
        assert may(conn, "pg_read_all_stats", oid) == (
            rows[proc].public or rows[proc].read_all_stats), proc


def test_readme_lockdown_leaves_nothing_to_a_role_granted_nothing(database):
    conn, names = database
    setup, block = readme_lockdown()
    conn.execute(renamed(setup, names))
    lock_down(conn, names, block)
    check_locked_down(conn, names)


def test_lockdown_again_after_update_from_1_4():
    """A database locked down as the 1.4 README said gets rl_check_many for
    PUBLIC with ALTER EXTENSION UPDATE (the update creates it with the
    default privileges); the current block, run again as the README's
    upgrade section says, closes it: the privileges of a fresh install
    locked down."""
    upgrading = readme_section("Upgrading from 1.4")
    assert "(#granting-access)" in upgrading and "again" in upgrading, upgrading
    with new_database("1.4") as (conn, names):
        setup, block = readme_lockdown()
        conn.execute(renamed(setup, names))
        lock_down(conn, names, LOCKDOWN_1_4)
        conn.execute("ALTER EXTENSION rl_redis UPDATE")
        assert conn.execute("SELECT extversion FROM pg_extension"
                            " WHERE extname = 'rl_redis'").fetchone()[0] == control_version()
        procs = functions(conn)
        assert may(conn, names["nobody"], procs["rl_check_many(text,text[],integer)"])
        conn.execute(renamed(block, names))
        check_locked_down(conn, names)
