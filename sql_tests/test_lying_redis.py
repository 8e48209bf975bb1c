"""A Redis that lies: a small server on a loopback port that speaks the Redis
protocol and answers every script call with a reply chosen by the test.
Whatever it says, the extension must give a clear error (08P01, "unexpected
reply"), never index past a reply or crash, and the backend must stay
usable with a real Redis afterwards.
"""

import socket
import threading
import time
import uuid

import psycopg
import pytest

from conftest import new_ident, pg_connect, set_gucs

PROTOCOL_VIOLATION = "08P01"


class LyingRedis:
    """Accepts connections; answers PING, AUTH and SELECT normally and every
    other command (FCALL, EVAL, ...) with `reply` (raw RESP bytes)."""

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
                    conn.sendall(self.respond(word, args))
        except OSError:
            pass
        finally:
            conn.close()

    def respond(self, word, args):
        """The raw RESP answer to a command other than PING, AUTH and SELECT."""
        return self.reply

    def close(self):
        self.stop = True
        self.sock.close()


def ints(*values):
    return b"*%d\r\n" % len(values) + b"".join(b":%d\r\n" % v for v in values)


def made_policy(pg, tag, algorithm, lim):
    """A new policy of 60 s windows, deleted when the generator ends."""
    name = "pytest.lie.%s%s" % (tag, uuid.uuid4().hex[:12])
    pg.execute("INSERT INTO rl_policy (name, algorithm, lim, window_ms) VALUES (%s, %s, %s, 60000)",
               (name, algorithm, lim))
    yield name
    pg.execute("DELETE FROM rl_policy WHERE name = %s", (name,))


@pytest.fixture
def policy(pg):
    yield from made_policy(pg, "", "fixed", 10)


def packed(*values):
    """A bulk string of the values as little-endian signed 8-byte integers:
    a decision as lua/common.lua packs it when there are seven."""
    data = b"".join(v.to_bytes(8, "little", signed=True) for v in values)
    return b"$%d\r\n%s\r\n" % (len(data), data)


# one decision: 7 integers packed (allowed, lim, remaining, reset, retry,
# clock, epoch)
ONE = [
    ("too short", packed(1, 10, 9, 0, 0, 1)),
    ("too long", packed(1, 10, 9, 0, 0, 1, 0, 5)),
    ("a short string", b"$2\r\nok\r\n"),
    ("an array of the numbers", ints(1, 10, 9, 0, 0, 1, 0)),
    ("an integer", b":1\r\n"),
    ("allowed neither 0 nor 1", packed(2, 10, 9, 0, 0, 1, 0)),
    ("lim zero", packed(1, 0, 9, 0, 0, 1, 0)),
    ("lim past int32", packed(1, 2**31, 9, 0, 0, 1, 0)),
    ("negative remaining", packed(1, 10, -1, 0, 0, 1, 0)),
    ("remaining past int32", packed(1, 10, 2**31, 0, 0, 1, 0)),
    ("lim not the limit's", packed(1, 11, 9, 0, 0, 1, 0)),
    ("remaining above lim", packed(1, 10, 11, 0, 0, 1, 0)),
    ("negative reset", packed(1, 10, 9, -1, 0, 1, 0)),
    ("reset beyond any wait", packed(1, 10, 9, 2**62, 0, 1, 0)),
    ("retry below -1", packed(0, 10, 0, 5, -2, 1, 0)),
    ("retry beyond any wait", packed(0, 10, 0, 5, 2**62, 1, 0)),
    ("negative clock", packed(1, 10, 9, 0, 0, -1, 0)),
    ("negative epoch", packed(1, 10, 9, 0, 0, 1, -1)),
    ("nil", b"$-1\r\n"),
]

# a batch of two keys: one packed decision per key (or an error element)
OK = packed(1, 10, 9, 0, 0, 1, 0)
BATCH = [
    ("one decision for two keys", b"*1\r\n" + OK),
    ("three decisions for two keys", b"*3\r\n" + OK + OK + OK),
    ("one decision of allowed 2", b"*2\r\n" + OK + packed(2, 10, 9, 0, 0, 1, 0)),
    ("one decision of 55 bytes", b"*2\r\n" + OK + b"$55\r\n" + b"\0" * 55 + b"\r\n"),
    ("one decision an integer", b"*2\r\n" + OK + b":1\r\n"),
    ("seven integers per key", ints(1, 10, 9, 0, 0, 1, 0, 1, 10, 9, 0, 0, 1, 0)),
    ("not an array", OK),
]

# several limits, n = 1: 6 + 3 integers: allowed, lim, remaining, reset,
# retry, the deciding limit's index (1-based), then the limit's clock,
# epoch and own verdict
MANY = [
    ("index 0", ints(1, 10, 9, 0, 0, 0, 1, 0, 1)),
    ("index past the limits", ints(1, 10, 9, 0, 0, 2, 1, 0, 1)),
    ("index far past", ints(0, 10, 0, 5, 5, 99999, 1, 0, 0)),
    ("negative index", ints(0, 10, 0, 5, 5, -1, 1, 0, 0)),
    ("clocks missing", ints(1, 10, 9, 0, 0, 1)),
    ("the old eight integers", ints(1, 10, 9, 0, 0, 1, 1, 0)),
    ("lim not the limit's", ints(1, 11, 9, 0, 0, 1, 1, 0, 1)),
    ("remaining above lim", ints(1, 10, 11, 0, 0, 1, 1, 0, 1)),
    ("negative reset", ints(0, 10, 0, -5, 5, 1, 1, 0, 0)),
    ("retry beyond any wait", ints(0, 10, 0, 5, 2**62, 1, 1, 0, 0)),
    ("allowed neither 0 nor 1", ints(2, 10, 9, 0, 0, 1, 1, 0, 1)),
    ("verdict neither 0 nor 1", ints(1, 10, 9, 0, 0, 1, 1, 0, 2)),
    ("negative clock", ints(1, 10, 9, 0, 0, 1, -1, 0, 1)),
    ("negative epoch", ints(1, 10, 9, 0, 0, 1, 1, -1, 1)),
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


@pytest.mark.parametrize("query, reply", [
    ("SELECT allowed, remaining FROM rl_check(%s, %s)", packed(1, 10, 9, 0, 0, 1, 0)),
    ("SELECT allowed, remaining FROM rl_check_all(ARRAY[%s], %s)", ints(1, 10, 9, 0, 0, 1, 1, 0, 1)),
], ids=["one", "several"])
def test_true_reply_is_taken(policy, query, reply):
    """The replies the lies above are made from are taken as they are: each
    lie fails for its own fault."""
    liar = LyingRedis(reply)
    try:
        with pg_connect() as conn:
            set_gucs(conn, host="127.0.0.1", port=liar.port, retry_interval=0)
            assert conn.execute(query, (policy, new_ident("true"))).fetchone() == (True, 9)
    finally:
        liar.close()


@pytest.mark.parametrize("what, reply", BATCH, ids=[w for w, _ in BATCH])
def test_bad_batch_reply(policy, what, reply):
    """A batch's reply is read whole before any of its decisions is taken:
    any element that is not a decision of the limit (nor an error) makes
    the whole call a protocol violation."""
    liar = LyingRedis(reply)
    try:
        with pg_connect() as conn:
            set_gucs(conn, host="127.0.0.1", port=liar.port, retry_interval=0)
            _expect_protocol_error(conn, "SELECT * FROM rl_check_many(%s, %s)",
                                   (policy, [new_ident("lie1"), new_ident("lie2")]))
            assert conn.execute("SELECT 1").fetchone() == (1,)
    finally:
        liar.close()


def test_batch_error_element_is_that_key_alone(policy):
    """An error in place of one key's decision (a key Redis could not
    decide) gives that key on_error's decision and the other key its own."""
    liar = LyingRedis(b"*2\r\n" + packed(1, 10, 7, 0, 0, 1, 0) + b"-WRONGTYPE a lie\r\n")
    try:
        with pg_connect() as conn:
            set_gucs(conn, host="127.0.0.1", port=liar.port, retry_interval=0, on_error="deny")
            conn.execute("SET client_min_messages = error")
            rows = conn.execute("SELECT allowed, remaining FROM rl_check_many(%s, %s)",
                                (policy, [new_ident("lie1"), new_ident("lie2")])).fetchall()
            assert rows == [(True, 7), (False, 0)]
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


# rl_concurrency_holders(policy) walks the policy's keys with SCAN: what a
# lying Redis says to SCAN must neither hang the backend beyond a cancel nor
# leave a reply in flight for the next caller, nor grow its memory without
# bound.


class ScriptedRedis(LyingRedis):
    """Answers each command word with answer(word, args, n) (raw RESP
    bytes; it may sleep first), n counting the calls of that word."""

    def __init__(self, answer):
        self.answer = answer
        self.counts = {}
        super().__init__(b"-ERR unexpected\r\n")

    def respond(self, word, args):
        n = self.counts.get(word, 0)
        self.counts[word] = n + 1
        return self.answer(word, args, n)


def bulk(b):
    return b"$%d\r\n%s\r\n" % (len(b), b)


def scan_reply(cursor, keys):
    return b"*2\r\n" + bulk(cursor) + b"*%d\r\n" % len(keys) + b"".join(bulk(k) for k in keys)


def holders_redis(scan, lease_end=None):
    """A ScriptedRedis for rl_concurrency_holders: SCAN answered by scan(n)
    (n counting the SCANs), TIME a fixed clock, ZRANGE one holder (backend
    4242) whose lease ends at lease_end (µs; without it, an error), any
    other command "-ERR stop here"."""
    def answer(word, args, n):
        if word == b"SCAN":
            return scan(n)
        if word == b"TIME":
            return b"*2\r\n$10\r\n1700000000\r\n$1\r\n0\r\n"
        if word == b"ZRANGE" and lease_end is not None:
            return b"*2\r\n" + bulk(b"4242:x") + bulk(b"%d" % lease_end)
        return b"-ERR stop here\r\n"

    return ScriptedRedis(answer)


@pytest.fixture
def cc_policy(pg):
    yield from made_policy(pg, "cc.", "concurrency", 2)


def holders_cancelled(conn, policy, timeout, bound_s):
    """rl_concurrency_holders(policy) under statement_timeout = timeout ends
    in 57014 within bound_s seconds."""
    conn.execute("SELECT set_config('statement_timeout', %s, false)", (timeout,))
    started = time.monotonic()
    with pytest.raises(psycopg.errors.QueryCanceled):
        conn.execute("SELECT * FROM rl_concurrency_holders(%s)", (policy,))
    assert time.monotonic() - started < bound_s
    conn.execute("RESET statement_timeout")


def test_holders_scan_cursor_never_ends_is_cancelled_and_session_clean(cc_policy):
    """A Redis whose SCAN never returns cursor 0: the walk is cancelled by
    statement_timeout, and the session then lists holders again."""
    liar = holders_redis(lambda n: scan_reply(b"1", []))
    try:
        with pg_connect() as conn:
            set_gucs(conn, host="127.0.0.1", port=liar.port, retry_interval=0)
            holders_cancelled(conn, cc_policy, "1s", 5)
            conn.execute("RESET rl_redis.host")
            conn.execute("RESET rl_redis.port")
            assert conn.execute("SELECT count(*) FROM rl_concurrency_holders(%s)", (cc_policy,)).fetchone() == (0,)
    finally:
        liar.close()


def _rss_kb(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def test_holders_scan_memory_per_key_is_small(cc_policy):
    """300 SCAN steps of 1000 keys of the policy's (identities of a few
    bytes), then an error to the first ZRANGE: the walk keeps what it found
    until it ends, and must keep it compactly. It kept a StringInfo (over
    1 KB) per key: 300 000 keys grew the backend by over 300 MB, and a Redis
    that lies about SCAN grows it until the statement is cancelled."""
    prefix = b"rl:concurrency:{"
    suffix = b"}:" + cc_policy.encode()
    steps = 300

    liar = holders_redis(lambda n: scan_reply(
        b"1" if n < steps - 1 else b"0",
        [prefix + b"id%d.%d" % (n, i) + suffix for i in range(1000)]))
    try:
        with pg_connect() as conn:
            pid = conn.info.backend_pid
            set_gucs(conn, host="127.0.0.1", port=liar.port, retry_interval=0)
            conn.execute("SET statement_timeout = '60s'")
            before = _rss_kb(pid)
            peak = [before]
            done = threading.Event()

            def watch():
                while not done.is_set():
                    try:
                        peak[0] = max(peak[0], _rss_kb(pid))
                    except OSError:
                        return
                    time.sleep(0.02)

            t = threading.Thread(target=watch)
            t.start()
            try:
                with pytest.raises(psycopg.Error) as exc:
                    conn.execute("SELECT * FROM rl_concurrency_holders(%s)", (cc_policy,))
            finally:
                done.set()
                t.join()
            assert "stop here" in str(exc.value), exc.value
            assert liar.counts[b"SCAN"] == steps
            grown_mb = (peak[0] - before) / 1024
            assert grown_mb < 100, "backend grew by %.0f MB for %d keys" % (grown_mb, steps * 1000)
    finally:
        liar.close()


def test_holders_cancel_while_scan_reply_in_flight(cc_policy):
    """A SCAN whose reply comes after the statement was cancelled: that
    reply never reaches the next call (which lists nobody)."""
    key = b"rl:concurrency:{stale}:" + cc_policy.encode()

    def scan(n):
        if n == 0:
            time.sleep(2.5)
            return scan_reply(b"0", [key])
        return scan_reply(b"0", [])

    liar = holders_redis(scan, 99999999999999999)
    try:
        with pg_connect() as conn:
            set_gucs(conn, host="127.0.0.1", port=liar.port, retry_interval=0, command_timeout=10000)
            holders_cancelled(conn, cc_policy, "500ms", 2)
            time.sleep(2.5)  # the late reply has arrived by now
            assert conn.execute("SELECT identity FROM rl_concurrency_holders(%s)", (cc_policy,)).fetchall() == []
            assert liar.counts[b"SCAN"] == 2
    finally:
        liar.close()


def test_holders_scan_duplicates_and_foreign_keys(cc_policy):
    """SCAN may return a key twice (and a migrating key is on two masters):
    each identity is listed once; keys the encoding does not make (a '%'
    alone, another policy's suffix, an empty tag) are not identities'."""
    p = cc_policy.encode()
    a = b"rl:concurrency:{a%25b}:" + p
    b = b"rl:concurrency:{x%7By%7D}:" + p
    foreign = [b"rl:concurrency:{a%b}:" + p, b"rl:concurrency:{}:" + p,
               b"rl:concurrency:{z}:" + p + b"x", b"rl:concurrency:{z}}:" + p]

    liar = holders_redis(
        lambda n: scan_reply(b"7", [a] + foreign) if n == 0 else scan_reply(b"0", [b, a]),
        1800000000000000)
    try:
        with pg_connect() as conn:
            set_gucs(conn, host="127.0.0.1", port=liar.port, retry_interval=0)
            rows = conn.execute("SELECT identity, backend_pid FROM rl_concurrency_holders(%s) ORDER BY 1",
                                (cc_policy,)).fetchall()
            assert rows == [("a%b", 4242), ("x{y}", 4242)]
            assert liar.counts[b"ZRANGE"] == 2
    finally:
        liar.close()
