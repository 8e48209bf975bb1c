"""A hot standby made with pg_basebackup from the test cluster: every
decision function works on it (the state is in Redis), and the primary and
the replica share one quota."""

import os
import shutil
import subprocess
import time
import uuid

import psycopg
import pytest

from conftest import PGBIN, as_owner, free_port, new_ident, pg_connect, start_on_free_port

# one replica for the module's tests, on one xdist worker
pytestmark = pytest.mark.xdist_group("replica")


@pytest.fixture(scope="module")
def replica():
    """Port of a streaming replica of the test cluster, stopped afterwards."""
    datadir = os.path.join(os.environ["RL_DIR"], "replica-%s" % uuid.uuid4().hex[:8])
    port = free_port()
    subprocess.run(
        as_owner([
            os.path.join(PGBIN, "pg_basebackup"), "-h", "127.0.0.1",
            "-p", os.environ["PGPORT"], "-U", "postgres", "-D", datadir,
            "-R", "-X", "stream", "--no-sync", "--checkpoint=fast",
        ]),
        check=True, capture_output=True, timeout=120,
    )
    conf = os.path.join(datadir, "postgresql.auto.conf")
    with open(conf, "a") as f:
        f.write("port = %d\n" % port)
    port = start_on_free_port(datadir, datadir + ".log", conf, port)
    try:
        yield port
    finally:
        subprocess.run(
            as_owner([os.path.join(PGBIN, "pg_ctl"), "-D", datadir,
                      "-m", "immediate", "-w", "stop"]),
            capture_output=True, timeout=60,
        )
        shutil.rmtree(datadir, ignore_errors=True)


def wait_replayed(primary, standby, timeout=30.0):
    """Waits until the standby has replayed everything the primary wrote."""
    lsn = primary.execute("SELECT pg_current_wal_lsn()").fetchone()[0]
    deadline = time.monotonic() + timeout
    while True:
        done = standby.execute(
            "SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (lsn,)
        ).fetchone()[0]
        if done:
            return
        assert time.monotonic() < deadline, "the replica did not catch up"
        time.sleep(0.1)


def test_replica_shares_the_quota(pg, replica):
    standby = pg_connect(port=replica)
    try:
        assert standby.execute("SELECT pg_is_in_recovery()").fetchone()[0] is True
        identity = new_ident("replica")
        query = "SELECT rl_sliding_allow(%s, 5, 600000)"
        got = []
        for i in range(8):
            conn = pg if i % 2 == 0 else standby
            got.append(conn.execute(query, (identity,)).fetchone()[0])
        assert got == [True] * 5 + [False] * 3
        # every algorithm answers on the standby
        for fn in ("rl_fixed", "rl_sliding_counter", "rl_token_bucket", "rl_gcra"):
            row = standby.execute(
                "SELECT (r).allowed, (r).remaining FROM %s(%%s, 3, 600000) AS r" % fn,
                (identity,),
            ).fetchone()
            assert row == (True, 2), (fn, row)
    finally:
        standby.close()


def test_replica_policies_and_read_only(pg, replica):
    standby = pg_connect(port=replica)
    try:
        name = "replica_%s" % new_ident().split(":")[-1][:12]
        pg.execute(
            "INSERT INTO rl_policy (name, algorithm, lim, window_ms) VALUES (%s, 'fixed', 2, 600000)",
            (name,),
        )
        try:
            wait_replayed(pg, standby)
            identity = new_ident("replica_policy")
            got = [
                standby.execute("SELECT rl_allow(%s, %s)", (name, identity)).fetchone()[0],
                pg.execute("SELECT rl_allow(%s, %s)", (name, identity)).fetchone()[0],
                standby.execute("SELECT rl_allow(%s, %s)", (name, identity)).fetchone()[0],
            ]
            assert got == [True, True, False]
            # a policy change on the primary reaches an open standby session
            pg.execute("UPDATE rl_policy SET lim = 5 WHERE name = %s", (name,))
            wait_replayed(pg, standby)
            row = standby.execute(
                "SELECT (r).allowed, (r).lim FROM rl_check(%s, %s) AS r", (name, identity)
            ).fetchone()
            assert row == (True, 5)
            # the standby itself takes no writes, policies included
            with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
                standby.execute("DELETE FROM rl_policy WHERE name = %s", (name,))
        finally:
            pg.execute("DELETE FROM rl_policy WHERE name = %s", (name,))
    finally:
        standby.close()
