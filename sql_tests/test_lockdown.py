"""The README's privileges, function by function (issue 19, finding 7).

PRIVILEGES below has one row per function of the extension: whether PUBLIC
may execute it on a fresh install, and whether it is one that decides,
takes or gives back a slot, refunds or resets (what the README's lockdown
for untrusted roles must leave to no role granted nothing). The test
enumerates the extension's functions from pg_depend, so a new function
cannot be added without its row here.

It then runs the README's "Granting access" block (taken from README.md as
it is, with its roles renamed to ones of the test's own) in a new database
and checks that a role granted nothing can call none of the closed
functions, while the application role may call every decision function,
the batch ones included.
"""

import os
import re
import uuid

import psycopg
from psycopg import sql
import pytest

from conftest import pg_connect

INSUFFICIENT_PRIVILEGE = "42501"

# regprocedure: (PUBLIC may execute on a fresh install, closed by the lockdown)
PRIVILEGES = {
    # decisions through policies: every role, until the lockdown
    "rl_check(text,text,integer)": (True, True),
    "rl_allow(text,text,integer)": (True, True),
    "rl_check_all(text[],text,integer)": (True, True),
    "rl_allow_all(text[],text,integer)": (True, True),
    "rl_check_many(text,text[],integer)": (True, True),
    # slots of concurrency policies, and giving back one's own explicit slot
    "rl_acquire(text,text)": (True, True),
    "rl_acquire_allow(text,text)": (True, True),
    "rl_release(text,text)": (True, True),
    "rl_concurrency_release(text)": (True, True),
    # explicit limits, refunds, reset: granted only
    "rl_fixed(text,integer,bigint,integer)": (False, True),
    "rl_fixed_allow(text,integer,bigint,integer)": (False, True),
    "rl_fixed_refund(text,integer,bigint,integer)": (False, True),
    "rl_fixed_many(text[],integer,bigint,integer)": (False, True),
    "rl_sliding(text,integer,bigint,integer)": (False, True),
    "rl_sliding_allow(text,integer,bigint,integer)": (False, True),
    "rl_sliding_refund(text,integer,bigint,integer)": (False, True),
    "rl_sliding_many(text[],integer,bigint,integer)": (False, True),
    "rl_sliding_counter(text,integer,bigint,integer)": (False, True),
    "rl_sliding_counter_allow(text,integer,bigint,integer)": (False, True),
    "rl_sliding_counter_refund(text,integer,bigint,integer)": (False, True),
    "rl_sliding_counter_many(text[],integer,bigint,integer)": (False, True),
    "rl_token_bucket(text,integer,bigint,integer,integer)": (False, True),
    "rl_token_bucket_allow(text,integer,bigint,integer,integer)": (False, True),
    "rl_token_bucket_refund(text,integer,bigint,integer,integer)": (False, True),
    "rl_token_bucket_many(text[],integer,bigint,integer,integer)": (False, True),
    "rl_gcra(text,integer,bigint,integer,integer)": (False, True),
    "rl_gcra_allow(text,integer,bigint,integer,integer)": (False, True),
    "rl_gcra_refund(text,integer,bigint,integer,integer)": (False, True),
    "rl_gcra_many(text[],integer,bigint,integer,integer)": (False, True),
    "rl_concurrency_acquire(text,integer,bigint)": (False, True),
    "rl_concurrency_acquire_allow(text,integer,bigint)": (False, True),
    "rl_refund(text,text,integer)": (False, True),
    "rl_reset(text)": (False, True),
    # guard triggers (a guard, once created, charges every writer)
    "rl_guard()": (False, True),
    "rl_guard_statement()": (False, True),
    "rl_policy_changed()": (False, True),
    # neither decides nor takes anything
    "rl_headers(rl_result,text)": (True, False),
    "rl_redis_ping()": (True, False),
    # statistics and denials: pg_read_all_stats, superusers
    "rl_top_denied(text,interval,integer)": (False, False),
    "rl_redis_stats_rows()": (False, False),
    "rl_redis_stats_scope()": (False, False),
    "rl_redis_rtt_bounds()": (False, False),
    "rl_redis_stats_reset()": (False, False),
    "rl_redis_metrics()": (False, False),
    "rl_redis_connections()": (False, False),
}

# the application role's functions: every decision, batches included
APPLICATION = [f for f, (_, closed) in PRIVILEGES.items()
               if closed and not f.startswith(("rl_guard", "rl_policy_changed", "rl_reset",
                                               "rl_refund"))
               and "_refund(" not in f]

ROLES = ("app", "support", "table_owner", "limits_admin")


def readme_lockdown():
    """The setup directive and the SQL block of README.md's "Granting
    access" section."""
    with open(os.path.join(os.path.dirname(__file__), "..", "README.md"), encoding="utf-8") as f:
        readme = f.read()
    section = re.search(r"^### Granting access\n(.*?)^##? ", readme, re.M | re.S)
    assert section, "README.md has no Granting access section"
    m = re.search(r"^<!-- setup: (.*?) -->\n```sql\n(.*?)^```", section.group(1), re.M | re.S)
    assert m, "the Granting access section has no setup directive and SQL block"
    return m.group(1), m.group(2)


def renamed(text, names):
    """text with the README's roles replaced by the test's."""
    return re.sub(r"\b(%s)\b" % "|".join(ROLES), lambda m: names[m.group(1)], text)


@pytest.fixture
def database():
    """A new database with rl_redis, and roles of the test's own; all dropped."""
    tag = uuid.uuid4().hex[:10]
    db = "rl_lockdown_%s" % tag
    names = {r: "rl_%s_%s" % (r, tag) for r in ROLES + ("nobody",)}
    admin = pg_connect()
    admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(db)))
    conn = pg_connect(dbname=db)
    try:
        conn.execute("CREATE EXTENSION rl_redis")
        yield conn, names
    finally:
        conn.close()
        admin.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(db)))
        for role in names.values():
            admin.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))
        admin.close()


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


def test_every_function_has_a_row(database):
    conn, _ = database
    found = set(functions(conn))
    assert found - set(PRIVILEGES) == set(), "functions without a row in PRIVILEGES"
    assert set(PRIVILEGES) - found == set(), "rows of PRIVILEGES without a function"


def test_fresh_install_privileges(database):
    conn, names = database
    conn.execute(sql.SQL("CREATE ROLE {}").format(sql.Identifier(names["nobody"])))
    for proc, oid in functions(conn).items():
        assert may(conn, names["nobody"], oid) == PRIVILEGES[proc][0], proc


def test_readme_lockdown_leaves_nothing_to_a_role_granted_nothing(database):
    conn, names = database
    setup, block = readme_lockdown()
    conn.execute(renamed(setup, names))
    conn.execute(renamed(block, names))
    nobody = names["nobody"]
    conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(nobody)))
    procs = functions(conn)
    for proc, oid in procs.items():
        public, closed = PRIVILEGES[proc]
        assert may(conn, nobody, oid) == (public and not closed), proc
    # and calling them, as that role, is refused
    conn.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(nobody)))
    for proc, oid in procs.items():
        if not PRIVILEGES[proc][1] or proc.endswith("()"):
            continue
        with pytest.raises(psycopg.Error) as e:
            conn.execute(call(conn, oid))
        assert e.value.sqlstate == INSUFFICIENT_PRIVILEGE, (proc, repr(e.value))
    conn.execute("RESET ROLE")
    # the application may decide every way, batches included
    for proc in APPLICATION:
        assert may(conn, names["app"], procs[proc]), proc
    for proc in ("rl_reset(text)", "rl_refund(text,text,integer)"):
        assert may(conn, names["support"], procs[proc]), proc
    for proc in ("rl_guard()", "rl_guard_statement()"):
        assert may(conn, names["table_owner"], procs[proc]), proc
