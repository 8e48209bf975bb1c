"""The library of Redis functions (issue 22): decisions run as functions of
one library by FCALL, which Redis keeps loaded, instead of scripts that run
their whole text on every call.

  - one library per build, rl_redis_<12 hex digits>, with one function per
    main part, rl_<the same digits>_<part>; a decision is an FCALL, and
    neither EVALSHA nor EVAL is sent while the library is there
  - FUNCTION FLUSH between calls (a restart without persistence is the
    same): the next call, or batch, loads the library again (one FUNCTION
    LOAD) and decides exactly as if nothing had happened
  - the state of a call does not reach the next one, though the library's
    Lua state outlives them: a dry run, the test clock and Redis's clock as
    one call read it
  - an ACL user who may not FUNCTION LOAD: works while the library is
    loaded; without it, a call fails with Redis's NOPERM (08000), and the
    calls of the next second (and a batch) with "Function not found" and a
    hint that says why, the library sent once a second at most; the same
    for a server whose FUNCTION command is renamed away; a user without
    FCALL gets NOPERM
  - a call that ran behind a refused FUNCTION LOAD (the library came from
    elsewhere meanwhile) is decided by its own reply
"""

import re
import time

import psycopg.errors
import pytest

from conftest import QueryThread, fixed_units, new_ident, pg_connect, rl_key, set_gucs, use_redis
from test_cluster_review import FakeServer, basic_reply, decision, r_err

pytestmark = pytest.mark.new_session

MAINS = {"run_one", "run_all", "run_many", "run_refund", "run_forget",
         "concurrency", "denial_note", "denial_top"}
ACL_PASSWORD = "fcall-acl-secret"


def libraries(server):
    """{library name: set of its function names} of FUNCTION LIST."""
    out = {}
    for lib in server.command("FUNCTION", "LIST"):
        fields = dict(zip(lib[::2], lib[1::2]))
        out[fields["library_name"]] = {
            dict(zip(f[::2], f[1::2]))["name"] for f in fields["functions"]}
    return out


def command_calls(server, command, field="calls"):
    """How many times Redis ran command (INFO commandstats; a subcommand
    as "function|load"; field "rejected_calls": refused before it ran)."""
    for line in server.command("INFO", "commandstats").splitlines():
        if line.startswith("cmdstat_%s:" % command):
            fields = dict(f.split("=", 1) for f in line.split(":", 1)[1].split(","))
            return int(fields[field])
    return 0


def fixed(conn, identity, lim=5, window_ms=600000):
    return conn.execute("SELECT (r).allowed, (r).remaining FROM rl_fixed(%s, %s, %s) AS r",
                        (identity, lim, window_ms)).fetchone()


def fixed_many(conn, identities, lim=5, window_ms=600000):
    return conn.execute(
        "SELECT identity, allowed, remaining FROM rl_fixed_many(%s::text[], %s, %s) "
        "ORDER BY identity", (identities, lim, window_ms)).fetchall()


def test_decisions_are_fcalls_of_one_library(pg, redis_factory):
    r = redis_factory()
    use_redis(pg, r, on_error="error")
    identity = new_ident("fcall")
    assert [fixed(pg, identity) for _ in range(3)] == [(True, 4), (True, 3), (True, 2)]
    assert pg.execute("SELECT rl_sliding_allow(%s, 5, 60000)", (identity,)).fetchone()[0] is True
    ids = sorted(new_ident("fcall_many") for _ in range(3))
    assert fixed_many(pg, ids) == [(i, True, 4) for i in ids]

    libs = libraries(r)
    assert len(libs) == 1, libs
    (name, functions), = libs.items()
    m = re.fullmatch(r"rl_redis_([0-9a-f]{12})", name)
    assert m, name
    assert functions == {"rl_%s_%s" % (m.group(1), main) for main in MAINS}
    # loaded once, then only FCALL
    assert command_calls(r, "function|load") == 1
    assert command_calls(r, "fcall") >= 5
    assert command_calls(r, "evalsha") == 0 and command_calls(r, "eval") == 0
    loaded, scripts = pg.execute(
        "SELECT scripts_loaded, scripts FROM rl_redis_connections() "
        "WHERE state <> 'closed'").fetchone()
    assert loaded == scripts > 0


def test_function_flush_between_calls(pg, redis_factory):
    r = redis_factory()
    use_redis(pg, r, on_error="error")
    identity = new_ident("flush")
    ids = sorted(new_ident("flush_many") for _ in range(3))
    assert [fixed(pg, identity) for _ in range(2)] == [(True, 4), (True, 3)]
    assert fixed_many(pg, ids) == [(i, True, 4) for i in ids]
    assert command_calls(r, "function|load") == 1

    # one call: "Function not found", then FUNCTION LOAD and the call again
    assert r.cli("FUNCTION", "FLUSH") == "OK"
    assert fixed(pg, identity) == (True, 2)
    assert command_calls(r, "function|load") == 2
    # a batch: its calls go again behind one FUNCTION LOAD
    assert r.cli("FUNCTION", "FLUSH") == "OK"
    assert fixed_many(pg, ids) == [(i, True, 3) for i in ids]
    assert command_calls(r, "function|load") == 3
    assert len(libraries(r)) == 1
    # sessions whose connections know the library, at once after a flush:
    # each loads it (one load wins, the others find it there) and decides
    others = [pg_connect() for _ in range(3)]
    try:
        for c in others:
            use_redis(c, r, on_error="error")
            assert fixed(c, new_ident("warm")) == (True, 4)
        assert r.cli("FUNCTION", "FLUSH") == "OK"
        racer = new_ident("race")
        calls = [QueryThread(c, "SELECT (r).allowed FROM rl_fixed(%s, 5, 600000) AS r", (racer,))
                 for c in others]
        for call in calls:
            call.start()
        for call in calls:
            call.join(30)
        assert [(call.error, call.rows) for call in calls] == [(None, [(True,)])] * 3
    finally:
        for c in others:
            c.close()
    assert len(libraries(r)) == 1
    # each call counted once: nothing ran twice
    for who, units in ((identity, "3"), (racer, "3")):
        assert fixed_units(r.command("GET", rl_key("fixed", who, lim=5, window_ms=600000))) == units


def test_call_state_stays_in_its_call(pg, redis_factory):
    """Each function resets what a call keeps (common.lua: new_call): each
    of these fails when the library's functions do not."""
    r = redis_factory()
    use_redis(pg, r, on_error="error")

    # a dry run, then a batch, which does not say whether it is one (the
    # one-key call and the several-limits one do, or read no such flag):
    # the batch writes
    policy = "fcall_%s" % new_ident("p")[-12:]
    pg.execute("INSERT INTO rl_policy (name, algorithm, lim, window_ms) "
               "VALUES (%s, 'fixed', 1, 600000)", (policy,))
    try:
        inspect = "SELECT (rl_inspect(%s, %s)).allowed"
        batch = "SELECT allowed FROM rl_check_many(%s, ARRAY[%s])"
        identity = new_ident("dry")
        assert pg.execute(inspect, (policy, identity)).fetchone()[0] is True
        assert pg.execute(batch, (policy, identity)).fetchone()[0] is True
        assert pg.execute(inspect, (policy, identity)).fetchone()[0] is False
        assert pg.execute(batch, (policy, identity)).fetchone()[0] is False
    finally:
        pg.execute("DELETE FROM rl_policy WHERE name = %s", (policy,))

    # a call on the test clock, then one on Redis's: the second key lives
    # its window (1 s) and the 1 s a fixed window's key outlives it
    # (fixed_window.lua: FIXED_SLACK_MS), not the test clock's least 10 s
    set_gucs(pg, test_clock_ms=int(time.time() * 1000))
    assert fixed(pg, new_ident("test_clock"), 5, 1000)[0] is True
    set_gucs(pg, test_clock_ms=0)
    identity = new_ident("real_clock")
    assert fixed(pg, identity, 5, 1000)[0] is True
    ttl = int(r.cli("PTTL", rl_key("fixed", identity, lim=5, window_ms=1000)))
    assert 0 < ttl <= 2000, ttl

    # Redis's clock is read anew by each call: 300 ms later, a window of
    # 200 ms is another one
    identity = new_ident("clock")
    assert fixed(pg, identity, 1, 200) == (True, 0)
    time.sleep(0.3)
    assert fixed(pg, identity, 1, 200) == (True, 0)


def failing_calls(conn, calls):
    """Runs each (query, params) of calls, each of which must fail with
    08000; returns (started, ended, DETAIL, HINT) of each."""
    seen = []
    for query, params in calls:
        t0 = time.monotonic()
        with pytest.raises(psycopg.errors.ConnectionException) as e:
            conn.execute(query, params)
        assert e.value.sqlstate == "08000", repr(e.value)
        seen.append((t0, time.monotonic(), e.value.diag.message_detail, e.value.diag.message_hint))
    return seen


def assert_refused_once(seen, loads):
    """The library was sent at most once per RL_LOAD_RETRY_MS (1 s) of
    calls, at least once, and every call within 0.9 s of the first one's end
    was answered "Function not found" with the hint that says what to
    allow."""
    assert 1 <= loads <= 1 + int(seen[-1][1] - seen[0][0]), (loads, seen)
    for started, _, detail, hint in seen[1:]:
        if started < seen[0][1] + 0.9:
            assert detail == "ERR Function not found", seen
            assert "FUNCTION LOAD" in hint, hint


def test_acl_user_who_may_not_load_the_library(pg, redis_factory):
    r = redis_factory()
    for user, rule in (("noload", "-function"), ("nofcall", "-fcall")):
        assert r.cli("ACL", "SETUSER", user, "on", ">" + ACL_PASSWORD, "~*", "+@all", rule) == "OK"
    identity = new_ident("noload")
    ids = sorted(new_ident("noload_many") for _ in range(2))
    single = ("SELECT rl_fixed_allow(%s, 5, 600000)", (identity,))
    batch = ("SELECT count(*) FROM rl_fixed_many(%s::text[], 5, 600000)", (ids,))

    def rejected_loads():
        return command_calls(r, "function|load", "rejected_calls")

    # the library is not there: a call fails with Redis's own reason, and
    # the calls of the next second, one by one and batches, with "Function
    # not found" and a hint, without the library being sent again
    use_redis(pg, r, on_error="error", username="noload", password=ACL_PASSWORD)
    seen = failing_calls(pg, [single] * 5 + [batch] * 5)
    assert seen[0][2].startswith("NOPERM "), seen[0]
    assert_refused_once(seen, rejected_loads())
    # a batch first, on a new connection: the same from its start
    pg.execute("SELECT rl_redis_disconnect()")
    before = rejected_loads()
    seen = failing_calls(pg, [batch] * 5 + [single] * 5)
    assert seen[0][2] == "ERR Function not found", seen[0]
    assert_refused_once(seen, rejected_loads() - before)
    assert libraries(r) == {}
    assert int(r.cli("EXISTS", rl_key("fixed", identity, lim=5, window_ms=600000))) == 0
    assert pg.execute("SELECT scripts_loaded FROM rl_redis_connections() "
                      "WHERE state <> 'closed'").fetchone()[0] == 0

    # loaded by another user, it serves this one
    use_redis(pg, r, username="", password="")
    assert fixed(pg, new_ident("loader"))[0] is True
    use_redis(pg, r, on_error="error", username="noload", password=ACL_PASSWORD)
    assert pg.execute("SELECT rl_fixed_allow(%s, 5, 600000)", (identity,)).fetchone()[0] is True
    assert fixed_many(pg, ids) == [(i, True, 4) for i in ids]

    # a user without FCALL: Redis's NOPERM, and the connection does not count
    # the library as loaded for it
    use_redis(pg, r, on_error="error", username="nofcall", password=ACL_PASSWORD)
    seen = failing_calls(pg, [single])
    assert seen[0][2].startswith("NOPERM "), seen[0]
    assert pg.execute("SELECT scripts_loaded FROM rl_redis_connections() "
                      "WHERE state <> 'closed'").fetchone()[0] == 0


def fake_redis(fcall_replies, load_reply):
    """A fake Redis (test_cluster_review's FakeServer) that answers its
    FCALLs with fcall_replies in turn (the last one again and again) and
    FUNCTION LOAD with load_reply; .fcalls holds the FCALLs it got."""
    fcalls = []

    def handle(server, args):
        word = args[0].upper()
        if word == "FCALL":
            fcalls.append(args)
            return fcall_replies[min(len(fcalls), len(fcall_replies)) - 1]
        if word == "FUNCTION":
            return load_reply
        return basic_reply(args)

    fake = FakeServer(handle)
    fake.fcalls = fcalls
    return fake


def test_a_server_that_will_not_load_the_library(pg):
    """A fake Redis whose FUNCTION command is renamed away ("unknown
    command"): the library is sent once per second of calls, not with each."""
    fake = fake_redis([r_err("ERR Function not found")],
                      r_err("ERR unknown command 'FUNCTION', with args beginning with: 'LOAD'"))
    try:
        set_gucs(pg, host="127.0.0.1", port=fake.port, on_error="error", retry_interval=0)
        seen = failing_calls(pg, [("SELECT rl_fixed_allow(%s, 5, 600000)", (new_ident("renamed"),))] * 5)
        assert seen[0][2].startswith("ERR unknown command 'FUNCTION'"), seen[0]
        assert_refused_once(seen, fake.count("FUNCTION", "LOAD"))
    finally:
        fake.close()


def test_a_call_that_ran_behind_a_refused_load_is_decided(pg):
    """A fake Redis: the first FCALL finds no function, the FUNCTION LOAD
    behind it is refused (NOPERM), and the FCALL behind that runs (the
    library came from elsewhere meanwhile): the call is decided by its own
    reply (it took its unit), not failed with the load's error."""
    fake = fake_redis([r_err("ERR Function not found"), decision(1, 5, 4)],
                      r_err("NOPERM this user has no permissions to run the 'function|load' command"))
    try:
        set_gucs(pg, host="127.0.0.1", port=fake.port, on_error="error", retry_interval=0)
        row = pg.execute("SELECT (r).allowed, (r).remaining FROM rl_fixed(%s, 5, 600000) AS r",
                         (new_ident("ran"),)).fetchone()
        assert row == (True, 4)
        assert len(fake.fcalls) == 2 and fake.count("FUNCTION", "LOAD") == 1
    finally:
        fake.close()
