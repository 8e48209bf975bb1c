"""A Redis that lies: a small server on a loopback port that speaks the Redis
protocol and answers every script call with a reply chosen by the test.
Whatever it says, the extension must give a clear error (08P01, "unexpected
reply"), never index past a reply or crash, and the backend must stay
usable with a real Redis afterwards.
"""

import socket
import threading
import uuid

import psycopg
import pytest

from conftest import new_ident, pg_connect, set_gucs

PROTOCOL_VIOLATION = "08P01"


class LyingRedis:
    """Accepts connections; answers PING, AUTH and SELECT normally and every
    other command (EVALSHA, EVAL, ...) with `reply` (raw RESP bytes)."""

    def __init__(self, reply):
        self.reply = reply
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.stop = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        self.sock.settimeout(0.2)
        while not self.stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            threading.Thread(target=self._client, args=(conn,), daemon=True).start()

    @staticmethod
    def _read_command(f):
        """One RESP array of bulk strings, as a list of bytes; None at EOF."""
        line = f.readline()
        if not line:
            return None
        assert line.startswith(b"*"), line
        args = []
        for _ in range(int(line[1:])):
            size = int(f.readline()[1:])
            args.append(f.read(size + 2)[:-2])
        return args

    def _client(self, conn):
        f = conn.makefile("rb")
        try:
            while True:
                args = self._read_command(f)
                if args is None:
                    return
                word = args[0].upper()
                if word == b"PING":
                    conn.sendall(b"+PONG\r\n")
                elif word in (b"AUTH", b"SELECT"):
                    conn.sendall(b"+OK\r\n")
                else:
                    conn.sendall(self.reply)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self):
        self.stop = True
        self.sock.close()


def ints(*values):
    return b"*%d\r\n" % len(values) + b"".join(b":%d\r\n" % v for v in values)


@pytest.fixture
def policy(pg):
    name = "pytest.lie.%s" % uuid.uuid4().hex[:12]
    pg.execute("INSERT INTO rl_policy (name, algorithm, lim, window_ms) VALUES (%s, 'fixed', 10, 60000)", (name,))
    yield name
    pg.execute("DELETE FROM rl_policy WHERE name = %s", (name,))


# one decision: 7 integers (allowed, lim, remaining, reset, retry, clock, epoch)
ONE = [
    ("too short", ints(1, 10, 9, 0, 0)),
    ("too long", ints(1, 10, 9, 0, 0, 1, 0, 5)),
    ("not an array", b"$2\r\nok\r\n"),
    ("a string element", b"*7\r\n:1\r\n$2\r\n10\r\n:9\r\n:0\r\n:0\r\n:1\r\n:0\r\n"),
    ("lim zero", ints(1, 0, 9, 0, 0, 1, 0)),
    ("negative remaining", ints(1, 10, -1, 0, 0, 1, 0)),
    ("remaining past int32", ints(1, 10, 2**31, 0, 0, 1, 0)),
    ("nil", b"$-1\r\n"),
]

# several limits, n = 1: 6 + 2 integers, the 6th the deciding limit's index (1-based)
MANY = [
    ("index 0", ints(1, 10, 9, 0, 0, 0, 1, 0)),
    ("index past the limits", ints(1, 10, 9, 0, 0, 2, 1, 0)),
    ("index far past", ints(0, 10, 0, 5, 5, 99999, 1, 0)),
    ("negative index", ints(0, 10, 0, 5, 5, -1, 1, 0)),
    ("clocks missing", ints(1, 10, 9, 0, 0, 1)),
]


def _expect_protocol_error(conn, query, params):
    with pytest.raises(psycopg.Error) as exc:
        conn.execute(query, params)
    assert exc.value.sqlstate == PROTOCOL_VIOLATION, exc.value
    assert "unexpected reply" in str(exc.value)


@pytest.mark.parametrize("what, reply", ONE, ids=[w for w, _ in ONE])
def test_bad_decision_reply(policy, what, reply):
    liar = LyingRedis(reply)
    try:
        with pg_connect() as conn:
            set_gucs(conn, host="127.0.0.1", port=liar.port, retry_interval=0)
            _expect_protocol_error(conn, "SELECT rl_check(%s, %s)", (policy, new_ident("lie")))
            # the session is usable, and with a real Redis it decides again
            assert conn.execute("SELECT 1").fetchone() == (1,)
            conn.execute("RESET rl_redis.host")
            conn.execute("RESET rl_redis.port")
            assert conn.execute("SELECT (rl_check(%s, %s)).allowed", (policy, new_ident("lie"))).fetchone() == (True,)
    finally:
        liar.close()


@pytest.mark.parametrize("what, reply", MANY, ids=[w for w, _ in MANY])
def test_bad_several_limits_reply(policy, what, reply):
    """Item 11: the index of the deciding limit is checked before it is used."""
    liar = LyingRedis(reply)
    try:
        with pg_connect() as conn:
            set_gucs(conn, host="127.0.0.1", port=liar.port, retry_interval=0)
            _expect_protocol_error(conn, "SELECT rl_check_all(ARRAY[%s], %s)", (policy, new_ident("lie")))
            assert conn.execute("SELECT 1").fetchone() == (1,)
    finally:
        liar.close()


def test_bad_reply_under_on_error_allow(policy):
    """A lying Redis is a failure like any other: on_error decides."""
    liar = LyingRedis(ints(1, 10, 9))
    try:
        with pg_connect() as conn:
            set_gucs(conn, host="127.0.0.1", port=liar.port, retry_interval=0, on_error="allow")
            assert conn.execute("SELECT (rl_check(%s, %s)).allowed", (policy, new_ident("lie"))).fetchone() == (True,)
            set_gucs(conn, on_error="deny")
            assert conn.execute("SELECT (rl_check(%s, %s)).allowed", (policy, new_ident("lie"))).fetchone() == (False,)
    finally:
        liar.close()
