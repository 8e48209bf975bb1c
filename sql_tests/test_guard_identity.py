"""Guard identities and what a row guard charges (issue 8, items 7, 8, 9).

- A guard's identity does not depend on the writer's session: values of
  other types than integers and text are rendered with fixed settings
  (DateStyle ISO, TimeZone UTC, IntervalStyle postgres, extra_float_digits 1,
  bytea_output hex), so an ordinary role cannot get a fresh counter for the
  same value by changing a setting.
- Several identity columns: each value has '\\' and ':' escaped, then they are
  joined with ':', so ('x:y', 'z') and ('x', 'y:z') are two counters. One
  column: the value as is (shared with rl_check from the application).
- rl_guard fires AFTER INSERT OR UPDATE ... FOR EACH ROW only: a row that
  INSERT ... ON CONFLICT DO NOTHING skips costs nothing, an upsert one unit
  per row, and a BEFORE trigger is refused with 39P01 when it fires (one made
  before 1.6: since then CREATE TRIGGER refuses it, see test_guard_check.py).

The superuser creates the tables, the policies and the guard triggers (the
trust model: rl_guard is not executable by PUBLIC); the writes come from an
ordinary LOGIN role that has only INSERT/SELECT/UPDATE on the tables.
"""

import uuid

import psycopg
from psycopg import sql
import pytest

from conftest import new_ident, pg_connect

RATE_LIMITED = "PT429"
NULL_VALUE_NOT_ALLOWED = "22004"
INVALID_PARAMETER_VALUE = "22023"
TRIGGER_PROTOCOL_VIOLATED = "39P01"


def escape(value):
    """One value of a several-column identity: '\\' -> '\\\\', ':' -> '\\:'."""
    return value.replace("\\", "\\\\").replace(":", "\\:")


class GuardEnv:
    """An ordinary role plus the tables, guards and policies of one test,
    all removed again by cleanup()."""

    def __init__(self, pg):
        self.pg = pg
        self.role = "rl_guard_%s" % uuid.uuid4().hex[:16]
        self.tables = []
        self.policies = []
        self.identities = []
        self.conns = []
        pg.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(self.role)))

    def policy(self, lim, algorithm="sliding", window_ms=60000):
        """A new policy (sliding log by default: exact, no window edge)."""
        name = new_ident("guardpolicy")
        self.pg.execute(
            "INSERT INTO rl_policy (name, algorithm, lim, window_ms) VALUES (%s, %s, %s, %s)",
            (name, algorithm, lim, window_ms),
        )
        self.policies.append(name)
        return name

    def table(self, columns, primary_key="id bigserial PRIMARY KEY"):
        """A new table with the given column definitions, writable by the role."""
        name = "guard_%s" % uuid.uuid4().hex[:16]
        self.pg.execute(
            sql.SQL("CREATE TABLE {} ({}, {})").format(
                sql.Identifier(name), sql.SQL(primary_key), sql.SQL(columns)
            )
        )
        self.tables.append(name)
        self.pg.execute(
            sql.SQL("GRANT INSERT, SELECT, UPDATE ON {} TO {}").format(
                sql.Identifier(name), sql.Identifier(self.role)
            )
        )
        seq = self.pg.execute(
            "SELECT pg_get_serial_sequence(%s, attname) FROM pg_attribute"
            " WHERE attrelid = %s::regclass AND attname = 'id'",
            (name, name),
        ).fetchone()
        if seq is not None and seq[0] is not None:
            self.pg.execute(
                sql.SQL("GRANT USAGE ON SEQUENCE {} TO {}").format(
                    sql.SQL(seq[0]), sql.Identifier(self.role)
                )
            )
        return name

    def guard(self, table, timing, *args, name="guard", checked=True):
        """CREATE TRIGGER <name> <timing> ON table FOR EACH ROW
        EXECUTE FUNCTION rl_guard(args), as the superuser; with checked
        false, unchecked as before 1.6 (the event trigger rl_guard_created
        disabled in the creating transaction only)."""
        create = sql.SQL("CREATE TRIGGER {} {} ON {} FOR EACH ROW EXECUTE FUNCTION rl_guard({})").format(
            sql.Identifier(name),
            sql.SQL(timing),
            sql.Identifier(table),
            sql.SQL(", ").join(sql.Literal(a) for a in args),
        )
        if checked:
            self.pg.execute(create)
            return
        with self.pg.transaction():
            self.pg.execute("ALTER EVENT TRIGGER rl_guard_created DISABLE")
            self.pg.execute(create)
            self.pg.execute("ALTER EVENT TRIGGER rl_guard_created ENABLE")

    def drop_guard(self, table, name="guard"):
        self.pg.execute(
            sql.SQL("DROP TRIGGER {} ON {}").format(sql.Identifier(name), sql.Identifier(table))
        )

    def connect(self):
        """A new autocommit connection as the ordinary role."""
        conn = pg_connect(user=self.role)
        self.conns.append(conn)
        assert conn.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user").fetchone()[0] is False
        return conn

    def remaining(self, policy, identity):
        """What is left of the policy for identity (charges nothing)."""
        self.identities.append(identity)
        return self.pg.execute(
            "SELECT (rl_check(%s, %s, 0)).remaining", (policy, identity)
        ).fetchone()[0]

    def cleanup(self):
        for conn in self.conns:
            conn.close()
        for identity in self.identities:
            try:
                self.pg.execute("SELECT rl_reset(%s)", (identity,))
            except psycopg.Error:
                pass
        for table in self.tables:
            self.pg.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(table)))
        for policy in self.policies:
            self.pg.execute("DELETE FROM rl_policy WHERE name = %s", (policy,))
        self.pg.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(self.role)))


@pytest.fixture
def env(pg):
    e = GuardEnv(pg)
    try:
        yield e
    finally:
        e.cleanup()


def sqlstate_of(conn, query, params=None):
    """Runs query; None when it succeeds, else the error's SQLSTATE."""
    try:
        conn.execute(query, params)
    except psycopg.Error as e:
        return e.sqlstate
    return None


def set_session(conn, settings):
    conn.execute("RESET ALL")
    for name, value in settings.items():
        conn.execute(sql.SQL("SET {} = {}").format(sql.Identifier(name), sql.Literal(value)))


# ---------------------------------------------------------------- item 7

# (column type, the value as an SQL expression whose input does not depend on
#  the session, its canonical text, the same value as another expression,
#  the sessions to write it from: the first one's insert passes, the others
#  are denied)
CANONICAL_CASES = [
    (
        "date",
        "make_date(2024, 3, 5)",
        "2024-03-05",
        "make_date(2024, 3, 6)",
        [
            {"DateStyle": "German, DMY"},
            {"DateStyle": "ISO, YMD"},
            {"DateStyle": "SQL, DMY"},
            {"DateStyle": "SQL, MDY"},
            {"DateStyle": "Postgres, MDY"},
        ],
    ),
    (
        "timestamptz",
        "'2024-03-05 12:00:00+00'::timestamptz",
        "2024-03-05 12:00:00+00",
        "'2024-03-05 12:00:01+00'::timestamptz",
        [
            {"TimeZone": "Asia/Tokyo"},
            {"TimeZone": "UTC"},
            {"TimeZone": "America/New_York"},
            {"TimeZone": "Europe/Berlin", "DateStyle": "SQL, DMY"},
            {"TimeZone": "Etc/GMT+3", "DateStyle": "Postgres, MDY"},
        ],
    ),
    (
        "interval",
        "make_interval(days => 1, hours => 2, mins => 3, secs => 4)",
        "1 days 7384000000 us",
        "make_interval(days => 1, hours => 2, mins => 3, secs => 5)",
        [
            {"IntervalStyle": "iso_8601"},
            {"IntervalStyle": "postgres"},
            {"IntervalStyle": "sql_standard"},
            {"IntervalStyle": "postgres_verbose"},
        ],
    ),
    (
        "float8",
        "1.2345678901234567::float8",
        "1.2345678901234567",
        "2.5::float8",
        [
            {"extra_float_digits": "0"},
            {"extra_float_digits": "1"},
            {"extra_float_digits": "-10"},
            {"extra_float_digits": "-15"},
            {"extra_float_digits": "3"},
        ],
    ),
    (
        "float4",
        "1.2345679::float4",
        "1.2345679",
        "2.5::float4",
        [
            {"extra_float_digits": "-3"},
            {"extra_float_digits": "1"},
            {"extra_float_digits": "0"},
            {"extra_float_digits": "3"},
        ],
    ),
    (
        "bytea",
        "'\\x00ff41'::bytea",
        "\\x00ff41",
        "'\\x00ff42'::bytea",
        [
            {"bytea_output": "escape"},
            {"bytea_output": "hex"},
        ],
    ),
]


@pytest.mark.parametrize(
    "coltype,expr,canonical,other_expr,sessions",
    CANONICAL_CASES,
    ids=[c[0] for c in CANONICAL_CASES],
)
def test_identity_does_not_depend_on_session_settings(env, coltype, expr, canonical, other_expr, sessions):
    """Limit 1 per 60 s on a column of coltype: the same value written under
    other settings is the same identity (denied), whatever the session says,
    and that identity is the canonical text (the application's rl_check on it
    sees the charge)."""
    policy = env.policy(1)
    table = env.table("v %s" % coltype)
    env.guard(table, "AFTER INSERT", policy, "v")
    conn = env.connect()
    insert = "INSERT INTO %s (v) VALUES (%s)" % (sql.Identifier(table).as_string(conn), expr)

    results = []
    for settings in sessions:
        set_session(conn, settings)
        results.append(sqlstate_of(conn, insert))
        if len(results) == 1:
            # the guard gave the session its own settings back
            for name, value in settings.items():
                shown = conn.execute(sql.SQL("SHOW {}").format(sql.Identifier(name))).fetchone()[0]
                assert shown == value, (name, shown, value)
    assert results == [None] + [RATE_LIMITED] * (len(sessions) - 1), list(zip(sessions, results))
    assert conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table))).fetchone()[0] == 1

    # the counter charged is the canonical text's, written under odd settings
    assert env.remaining(policy, canonical) == 0

    # another value is another identity, also under the odd settings
    set_session(conn, sessions[-1])
    assert sqlstate_of(conn, "INSERT INTO %s (v) VALUES (%s)"
                       % (sql.Identifier(table).as_string(conn), other_expr)) is None
    assert sqlstate_of(conn, "INSERT INTO %s (v) VALUES (%s)"
                       % (sql.Identifier(table).as_string(conn), other_expr)) == RATE_LIMITED


def test_canonical_settings_inside_a_transaction(env):
    """The fixed settings hold only while the guard renders the identity: a
    SET LOCAL of the writer's transaction is still in force after the write,
    and a later write of the transaction is charged the same identity."""
    policy = env.policy(1)
    table = env.table("d date, n int")
    env.guard(table, "AFTER INSERT OR UPDATE", policy, "d")
    conn = env.connect()
    conn.autocommit = False
    ins = sql.SQL("INSERT INTO {} (d, n) VALUES (make_date(2031, 12, 24), 1)").format(sql.Identifier(table))
    conn.execute("SET LOCAL DateStyle = 'SQL, DMY'")
    conn.execute("SET LOCAL TimeZone = 'Asia/Kolkata'")
    conn.execute(ins)
    assert conn.execute("SHOW DateStyle").fetchone()[0] == "SQL, DMY"
    assert conn.execute("SHOW TimeZone").fetchone()[0] == "Asia/Kolkata"
    assert conn.execute("SELECT make_date(2031, 12, 24)::text").fetchone()[0] == "24/12/2031"
    # the charge of the insert is the canonical text's
    assert env.remaining(policy, "2031-12-24") == 0
    with pytest.raises(psycopg.Error) as exc:
        conn.execute(sql.SQL("UPDATE {} SET n = 2").format(sql.Identifier(table)))
    assert exc.value.sqlstate == RATE_LIMITED
    conn.rollback()
    conn.autocommit = True


def test_statement_guard_identity_is_canonical(env):
    """rl_guard_statement renders identities the same way: two rows of one
    date in one statement are one identity charged 2, and the same date from
    a session with another DateStyle is that identity again."""
    policy = env.policy(2)
    table = env.table("d date, tenant text")
    env.pg.execute(
        sql.SQL(
            "CREATE TRIGGER guard AFTER INSERT ON {} REFERENCING NEW TABLE AS new_rows "
            "FOR EACH STATEMENT EXECUTE FUNCTION rl_guard_statement({}, 'tenant, d')"
        ).format(sql.Identifier(table), sql.Literal(policy))
    )
    conn = env.connect()
    tenant = new_ident("stmt")
    ins = sql.SQL("INSERT INTO {} (d, tenant) VALUES (make_date(2030, 1, 2), %s), (make_date(2030, 1, 2), %s)").format(
        sql.Identifier(table)
    )
    set_session(conn, {"DateStyle": "German", "TimeZone": "Asia/Tokyo"})
    assert sqlstate_of(conn, ins, (tenant, tenant)) is None
    assert conn.execute("SHOW DateStyle").fetchone()[0] == "German, DMY"
    assert env.remaining(policy, escape(tenant) + ":2030-01-02") == 0
    set_session(conn, {"DateStyle": "SQL, MDY"})
    assert sqlstate_of(conn, ins, (tenant, tenant)) == RATE_LIMITED


# ---------------------------------------------------------------- item 8


def test_composite_identities_do_not_collide(env):
    """('x:y', 'z') and ('x', 'y:z') are two identities under limit 1; the
    same tuple twice is one."""
    policy = env.policy(1)
    table = env.table("a text, b text")
    env.guard(table, "AFTER INSERT", policy, "a, b")
    conn = env.connect()
    p = new_ident("comp")  # contains ':' itself
    ins = sql.SQL("INSERT INTO {} (a, b) VALUES (%s, %s)").format(sql.Identifier(table))

    assert sqlstate_of(conn, ins, (p + "x:y", "z")) is None
    assert sqlstate_of(conn, ins, (p + "x", "y:z")) is None
    assert sqlstate_of(conn, ins, (p + "x:y", "z")) == RATE_LIMITED
    assert sqlstate_of(conn, ins, (p + "x", "y:z")) == RATE_LIMITED
    assert conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table))).fetchone()[0] == 2

    # the identities are the escaped values joined with ':'
    assert env.remaining(policy, escape(p + "x:y") + ":z") == 0
    assert env.remaining(policy, escape(p + "x") + ":y\\:z") == 0
    assert env.remaining(policy, p + "x:y:z") == 1

    # a backslash is escaped too
    assert sqlstate_of(conn, ins, (p + "q\\", "r")) is None
    assert env.remaining(policy, escape(p) + "q\\\\:r") == 0
    assert sqlstate_of(conn, ins, (p + "q", "\\:r")) is None
    assert env.remaining(policy, escape(p) + "q:\\\\\\:r") == 0

    # a NULL in any identity column is 22004, and charges nothing
    assert sqlstate_of(conn, ins, (p + "n", None)) == NULL_VALUE_NOT_ALLOWED
    assert sqlstate_of(conn, ins, (None, p + "n")) == NULL_VALUE_NOT_ALLOWED
    # two empty values are the identity ':', not an empty one
    assert sqlstate_of(conn, ins, ("", "")) is None
    assert env.remaining(policy, ":") == 0


def test_one_column_identity_is_the_value_as_is(env):
    """With one column the value is not escaped (the guard and the
    application's rl_check share the counter), while the same value in a
    two-column guard is; NULL is 22004, an empty identity 22023."""
    policy = env.policy(2)
    table = env.table("tenant text, region text")
    env.guard(table, "AFTER INSERT", policy, "tenant", name="one")
    env.guard(table, "AFTER INSERT", policy, "tenant,region", name="two")
    conn = env.connect()
    tenant = new_ident("one") + ":a\\b"
    assert conn.execute("SELECT (rl_check(%s, %s, 1)).allowed", (policy, tenant)).fetchone()[0] is True
    ins = sql.SQL("INSERT INTO {} (tenant, region) VALUES (%s, %s)").format(sql.Identifier(table))
    assert sqlstate_of(conn, ins, (tenant, "eu:west")) is None
    assert env.remaining(policy, tenant) == 0
    assert env.remaining(policy, escape(tenant) + ":eu\\:west") == 1
    assert env.remaining(policy, tenant + ":eu:west") == 2
    assert sqlstate_of(conn, ins, (tenant, "eu:west")) == RATE_LIMITED
    assert sqlstate_of(conn, ins, (None, "x")) == NULL_VALUE_NOT_ALLOWED
    assert sqlstate_of(conn, ins, ("", "x")) == INVALID_PARAMETER_VALUE
    assert conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table))).fetchone()[0] == 1


def test_composite_with_integer_and_date_columns(env):
    """Integers need no escaping; a date under an odd DateStyle is rendered
    canonically and then escaped like any other value."""
    policy = env.policy(1)
    table = env.table("tenant text, user_id int, ts timestamptz")
    env.guard(table, "AFTER INSERT", policy, "tenant, user_id, ts")
    conn = env.connect()
    p = new_ident("mixed")
    set_session(conn, {"DateStyle": "SQL, DMY", "TimeZone": "Asia/Tokyo"})
    ins = sql.SQL("INSERT INTO {} (tenant, user_id, ts) VALUES (%s, %s, '2024-03-05 12:00:00+00')").format(
        sql.Identifier(table)
    )
    assert sqlstate_of(conn, ins, (p, -7)) is None
    assert env.remaining(policy, escape(p) + ":-7:2024-03-05 12\\:00\\:00+00") == 0
    set_session(conn, {"DateStyle": "ISO"})
    assert sqlstate_of(conn, ins, (p, -7)) == RATE_LIMITED


# ---------------------------------------------------------------- item 9


def test_before_trigger_is_refused(env):
    """A BEFORE row guard (and a statement-level one) raises 39P01 with a
    hint, writes nothing and charges nothing."""
    policy = env.policy(5)
    table = env.table("tenant text")
    tenant = new_ident("before")
    conn = env.connect()
    ins = sql.SQL("INSERT INTO {} (tenant) VALUES (%s)").format(sql.Identifier(table))
    for timing in ("BEFORE INSERT", "BEFORE INSERT OR UPDATE"):
        env.guard(table, timing, policy, "tenant", checked=False)
        with pytest.raises(psycopg.Error) as exc:
            conn.execute(ins, (tenant,))
        err = exc.value
        assert err.sqlstate == TRIGGER_PROTOCOL_VIOLATED, repr(err)
        assert err.diag.message_primary == (
            "rl_guard must be fired AFTER INSERT OR UPDATE ... FOR EACH ROW"
        )
        assert "CREATE TRIGGER" in err.diag.message_hint
        assert "AFTER INSERT" in err.diag.message_hint
        env.drop_guard(table)
    with env.pg.transaction():
        env.pg.execute("ALTER EVENT TRIGGER rl_guard_created DISABLE")
        env.pg.execute(
            sql.SQL(
                "CREATE TRIGGER guard AFTER INSERT ON {} FOR EACH STATEMENT "
                "EXECUTE FUNCTION rl_guard({}, 'tenant')"
            ).format(sql.Identifier(table), sql.Literal(policy))
        )
        env.pg.execute("ALTER EVENT TRIGGER rl_guard_created ENABLE")
    assert sqlstate_of(conn, ins, (tenant,)) == TRIGGER_PROTOCOL_VIOLATED
    env.drop_guard(table)
    assert conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table))).fetchone()[0] == 0
    assert env.remaining(policy, tenant) == 5


def test_on_conflict_do_nothing_charges_nothing(env):
    """A row that INSERT ... ON CONFLICT DO NOTHING skips is never charged:
    as a BEFORE trigger (which would see it) the guard refuses to run, as an
    AFTER trigger it does not see it; a new row then still passes under
    limit 1."""
    policy = env.policy(1)
    table = env.table("tenant text", primary_key="k text PRIMARY KEY")
    tenant = new_ident("dn")
    env.pg.execute(sql.SQL("INSERT INTO {} (k, tenant) VALUES ('k1', %s)").format(sql.Identifier(table)), (tenant,))
    conn = env.connect()
    ins = sql.SQL("INSERT INTO {} (k, tenant) VALUES (%s, %s) ON CONFLICT DO NOTHING").format(sql.Identifier(table))

    env.guard(table, "BEFORE INSERT", policy, "tenant", checked=False)
    assert sqlstate_of(conn, ins, ("k1", tenant)) == TRIGGER_PROTOCOL_VIOLATED
    env.drop_guard(table)
    assert env.remaining(policy, tenant) == 1

    env.guard(table, "AFTER INSERT", policy, "tenant")
    for _ in range(3):
        cur = conn.execute(ins, ("k1", tenant))
        assert cur.rowcount == 0
    assert env.remaining(policy, tenant) == 1
    cur = conn.execute(ins, ("k2", tenant))
    assert cur.rowcount == 1
    assert env.remaining(policy, tenant) == 0
    assert sqlstate_of(conn, ins, ("k3", tenant)) == RATE_LIMITED
    # a statement of a skipped row and a new one: only the new one counts
    other = new_ident("dn")
    cur = conn.execute(
        sql.SQL("INSERT INTO {} (k, tenant) VALUES ('k1', %s), ('k4', %s) ON CONFLICT DO NOTHING").format(
            sql.Identifier(table)
        ),
        (other, other),
    )
    assert cur.rowcount == 1
    assert env.remaining(policy, other) == 0
    assert conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table))).fetchone()[0] == 3


def test_upsert_charges_one_per_row(env):
    """INSERT ... ON CONFLICT DO UPDATE with the guard on INSERT OR UPDATE
    charges exactly one unit per row (a BEFORE guard, which fires for the
    proposed row and again for the update, is refused); a plain UPDATE
    charges one per updated row."""
    policy = env.policy(10)
    table = env.table("tenant text, n int", primary_key="k text PRIMARY KEY")
    tenant = new_ident("up")
    env.pg.execute(sql.SQL("INSERT INTO {} (k, tenant, n) VALUES ('k1', %s, 0)").format(sql.Identifier(table)), (tenant,))
    conn = env.connect()
    upsert = sql.SQL(
        "INSERT INTO {} (k, tenant, n) VALUES (%s, %s, 1) ON CONFLICT (k) DO UPDATE SET n = {}.n + 1"
    ).format(sql.Identifier(table), sql.Identifier(table))

    env.guard(table, "BEFORE INSERT OR UPDATE", policy, "tenant", checked=False)
    assert sqlstate_of(conn, upsert, ("k1", tenant)) == TRIGGER_PROTOCOL_VIOLATED
    env.drop_guard(table)
    assert env.remaining(policy, tenant) == 10

    env.guard(table, "AFTER INSERT OR UPDATE", policy, "tenant")
    cur = conn.execute(upsert, ("k1", tenant))  # an update
    assert cur.rowcount == 1
    assert env.remaining(policy, tenant) == 9
    cur = conn.execute(upsert, ("k2", tenant))  # an insert
    assert cur.rowcount == 1
    assert env.remaining(policy, tenant) == 8
    cur = conn.execute(
        sql.SQL(
            "INSERT INTO {} (k, tenant, n) VALUES ('k1', %s, 1), ('k3', %s, 1) "
            "ON CONFLICT (k) DO UPDATE SET n = {}.n + 1"
        ).format(sql.Identifier(table), sql.Identifier(table)),
        (tenant, tenant),
    )
    assert cur.rowcount == 2
    assert env.remaining(policy, tenant) == 6
    # the documented UPDATE semantics: one unit per updated row
    cur = conn.execute(sql.SQL("UPDATE {} SET n = n + 1").format(sql.Identifier(table)))
    assert cur.rowcount == 3
    assert env.remaining(policy, tenant) == 3
    assert conn.execute(
        sql.SQL("SELECT string_agg(k || '=' || n, ',' ORDER BY k) FROM {}").format(sql.Identifier(table))
    ).fetchone()[0] == "k1=3,k2=2,k3=2"


@pytest.mark.parametrize(
    "coltype, first, others",
    [
        ("numeric", "7", ["7.0", "7.000", "07"]),
        ("interval", "'1 day'", ["'24 hours'", "'1440 minutes'", "'0.5 days 12 hours'"]),
        ("float8", "0", ["-0", "'-0'::float8"]),
        ("money", "1", ["'1.00'", "'$1.00'", "1.001"]),
    ],
)
def test_equal_values_share_one_identity(env, coltype, first, others):
    """Review finding: values that compare equal (7 and 7.0 in numeric,
    '1 day' and '24 hours' in interval, 0 and -0) are one tenant for SQL
    (row-level security, unique keys), so they are one identity: under a
    limit of 1 only the first write passes."""
    policy = env.policy(1)
    table = env.table("tenant %s NOT NULL" % coltype)
    env.guard(table, "AFTER INSERT", policy, "tenant")
    conn = env.connect()
    name = sql.Identifier(table).as_string(conn)
    assert sqlstate_of(conn, "INSERT INTO %s (tenant) VALUES (%s)" % (name, first)) is None
    for value in others:
        assert sqlstate_of(conn, "INSERT INTO %s (tenant) VALUES (%s)" % (name, value)) == RATE_LIMITED, value


@pytest.mark.parametrize(
    "coltype",
    ["jsonb", "text COLLATE rl_ci", "int[]"],
)
def test_types_whose_equal_values_differ_in_text_are_refused(env, pg, coltype):
    """Second review: jsonb ('1' and '1.0' are equal), text under a
    nondeterministic collation ('acme' and 'ACME'), arrays: equal values
    with different text would be different identities, so a guard on such
    a column is refused (42804) at CREATE TRIGGER, and at its first write
    (a guard made before 1.6), before anything is charged."""
    pg.execute("CREATE COLLATION IF NOT EXISTS rl_ci (provider = icu, locale = 'und-u-ks-level2', deterministic = false)")
    policy = env.policy(2)
    table = env.table("tenant %s NOT NULL" % coltype)
    with pytest.raises(psycopg.Error) as exc:
        env.guard(table, "AFTER INSERT", policy, "tenant")
    assert exc.value.sqlstate == "42804", repr(exc.value)
    env.guard(table, "AFTER INSERT", policy, "tenant", checked=False)
    conn = env.connect()
    name = sql.Identifier(table).as_string(conn)
    value = {"jsonb": "'1'", "text COLLATE rl_ci": "'acme'", "int[]": "'{1}'"}[coltype]
    assert sqlstate_of(conn, "INSERT INTO %s (tenant) VALUES (%s)" % (name, value)) == "42804"


@pytest.mark.parametrize(
    "coltype, value",
    [("date", "'2024-01-02'"), ("uuid", "'00000000-0000-0000-0000-000000000001'"),
     ("bytea", "'\\x01'"), ("boolean", "true"), ("timestamptz", "now()")],
)
def test_types_with_one_text_per_value_are_accepted(env, coltype, value):
    policy = env.policy(1)
    table = env.table("tenant %s NOT NULL" % coltype)
    env.guard(table, "AFTER INSERT", policy, "tenant")
    conn = env.connect()
    name = sql.Identifier(table).as_string(conn)
    assert sqlstate_of(conn, "INSERT INTO %s (tenant) VALUES (%s)" % (name, value)) is None
