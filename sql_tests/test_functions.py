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
    loaded; without it, a call and a batch fail with Redis's NOPERM (08000),
    never "Function not found"
"""

import re
import time

import psycopg.errors
import pytest

from conftest import fixed_units, new_ident, rl_key, set_gucs, use_redis

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


def command_calls(server, command):
    """How many times Redis ran command (INFO commandstats; a subcommand
    as "function|load")."""
    for line in server.command("INFO", "commandstats").splitlines():
        if line.startswith("cmdstat_%s:" % command):
            fields = dict(f.split("=", 1) for f in line.split(":", 1)[1].split(","))
            return int(fields["calls"])
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
    # each call counted once: nothing ran twice
    assert fixed_units(r.command("GET", rl_key("fixed", identity, lim=5, window_ms=600000))) == "3"


def test_call_state_stays_in_its_call(pg, redis_factory):
    """Each function resets what a call keeps (common.lua: new_call): each
    of these fails when the library's functions do not."""
    r = redis_factory()
    use_redis(pg, r, on_error="error")

    # a dry run, then a call: the call writes
    policy = "fcall_%s" % new_ident("p")[-12:]
    pg.execute("INSERT INTO rl_policy (name, algorithm, lim, window_ms) "
               "VALUES (%s, 'fixed', 1, 600000)", (policy,))
    try:
        identity = new_ident("dry")
        assert pg.execute("SELECT (rl_inspect(%s, %s)).allowed", (policy, identity)).fetchone()[0]
        check = "SELECT (rl_check(%s, %s)).allowed"
        assert pg.execute(check, (policy, identity)).fetchone()[0] is True
        assert pg.execute(check, (policy, identity)).fetchone()[0] is False
    finally:
        pg.execute("DELETE FROM rl_policy WHERE name = %s", (policy,))

    # a call on the test clock, then one on Redis's: the second key lives
    # its window (1 s), not the test clock's least 10 s
    set_gucs(pg, test_clock_ms=int(time.time() * 1000))
    assert fixed(pg, new_ident("test_clock"), 5, 1000)[0] is True
    set_gucs(pg, test_clock_ms=0)
    identity = new_ident("real_clock")
    assert fixed(pg, identity, 5, 1000)[0] is True
    ttl = int(r.cli("PTTL", rl_key("fixed", identity, lim=5, window_ms=1000)))
    assert 0 < ttl <= 1000, ttl

    # Redis's clock is read anew by each call: 300 ms later, a window of
    # 200 ms is another one
    identity = new_ident("clock")
    assert fixed(pg, identity, 1, 200) == (True, 0)
    time.sleep(0.3)
    assert fixed(pg, identity, 1, 200) == (True, 0)


def test_acl_user_who_may_not_load_the_library(pg, redis_factory):
    r = redis_factory()
    assert r.cli("ACL", "SETUSER", "noload", "on", ">" + ACL_PASSWORD, "~*",
                 "+@all", "-function") == "OK"
    identity = new_ident("noload")
    ids = sorted(new_ident("noload_many") for _ in range(2))

    # the library is not there: the call fails with Redis's own reason
    use_redis(pg, r, on_error="error", username="noload", password=ACL_PASSWORD)
    for query, params in (("SELECT rl_fixed_allow(%s, 5, 600000)", (identity,)),
                          ("SELECT count(*) FROM rl_fixed_many(%s::text[], 5, 600000)", (ids,))):
        with pytest.raises(psycopg.errors.ConnectionException) as e:
            pg.execute(query, params)
        assert e.value.sqlstate == "08000", repr(e.value)
        assert e.value.diag.message_detail.startswith("NOPERM "), e.value.diag.message_detail
    assert libraries(r) == {}
    assert int(r.cli("EXISTS", rl_key("fixed", identity, lim=5, window_ms=600000))) == 0

    # loaded by another user, it serves this one
    use_redis(pg, r, username="", password="")
    assert fixed(pg, new_ident("loader"))[0] is True
    use_redis(pg, r, on_error="error", username="noload", password=ACL_PASSWORD)
    assert pg.execute("SELECT rl_fixed_allow(%s, 5, 600000)", (identity,)).fetchone()[0] is True
    assert fixed_many(pg, ids) == [(i, True, 4) for i in ids]
