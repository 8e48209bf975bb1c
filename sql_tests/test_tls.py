"""TLS to Redis (rl_redis.tls): against a real redis-server --tls-port with
certificates made here by openssl: a working connection, a wrong CA, a wrong
server name, a plain client on a TLS port, client certificates, a hung TLS
server, and the settings' privileges."""

import os
import shutil
import subprocess
import tempfile
import time

import psycopg
import pytest

from conftest import REDIS_CLI, RedisServer, new_ident, pg_connect, rl_key, set_gucs


def openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca(d, name):
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
            "-keyout", name + "-ca.key", "-out", name + "-ca.pem",
            "-subj", "/CN=rl_redis test CA " + name, cwd=d)


def make_cert(d, ca, name, cn, san):
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", name + ".key",
            "-out", name + ".csr", "-subj", "/CN=" + cn, cwd=d)
    with open(os.path.join(d, name + ".ext"), "w") as f:
        f.write("subjectAltName = %s\n" % san)
    openssl("x509", "-req", "-in", name + ".csr", "-CA", ca + "-ca.pem",
            "-CAkey", ca + "-ca.key", "-CAcreateserial", "-days", "2",
            "-extfile", name + ".ext", "-out", name + ".pem", cwd=d)


@pytest.fixture(scope="module")
def certs():
    """A CA with a server and a client certificate, and an unrelated CA.
    Readable by the postgres OS user, which the server runs as."""
    d = tempfile.mkdtemp(prefix="rl_redis_tls.")
    os.chmod(d, 0o755)
    make_ca(d, "good")
    make_ca(d, "other")
    make_cert(d, "good", "server", "localhost", "DNS:localhost, IP:127.0.0.1")
    make_cert(d, "good", "client", "rl_redis client", "DNS:rl-redis-client")
    for f in os.listdir(d):
        os.chmod(os.path.join(d, f), 0o644)
    yield d
    shutil.rmtree(d, ignore_errors=True)


class TlsRedis(RedisServer):
    """conftest's redis-server, listening only on a TLS port (self.port)."""

    def __init__(self, base_dir, name, certs, auth_clients):
        super().__init__(base_dir, name)
        self.certs = certs
        self.auth_clients = auth_clients

    def _argv(self):
        argv = super()._argv()
        argv[argv.index("--port") + 1] = "0"
        return argv + [
            "--tls-port", str(self.port),
            "--tls-cert-file", os.path.join(self.certs, "server.pem"),
            "--tls-key-file", os.path.join(self.certs, "server.key"),
            "--tls-ca-cert-file", os.path.join(self.certs, "good-ca.pem"),
            "--tls-auth-clients", "yes" if self.auth_clients else "no",
        ]

    def _wait_ready(self, deadline):
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            if self.cli("PING", check=False) == "PONG":
                return True
            time.sleep(0.05)
        return False

    def cli(self, *args, check=True):
        """redis-cli over TLS, with the client certificate."""
        r = subprocess.run(
            [REDIS_CLI, "--tls", "--cacert", os.path.join(self.certs, "good-ca.pem"),
             "--cert", os.path.join(self.certs, "client.pem"),
             "--key", os.path.join(self.certs, "client.key"),
             "-h", "127.0.0.1", "-p", str(self.port), *[str(a) for a in args]],
            capture_output=True, text=True, timeout=15,
        )
        if check and r.returncode != 0:
            raise RuntimeError("redis-cli %s failed: %s" % (args, r.stderr))
        return r.stdout.strip()


@pytest.fixture
def tls_redis(certs, redis_factory):
    """tls_redis(auth_clients=False) -> a new TlsRedis, killed at teardown."""
    def start(auth_clients=False):
        server = TlsRedis(redis_factory.base_dir, "tls%d" % len(redis_factory.servers),
                          certs, auth_clients)
        redis_factory.servers.append(server)
        return server.start()

    yield start


def use_tls(conn, server, certs, **gucs):
    gucs.setdefault("tls_ca_file", os.path.join(certs, "good-ca.pem"))
    set_gucs(conn, host="127.0.0.1", port=server.port, tls="on", retry_interval=0, **gucs)


def sliding(conn, identity, lim=3):
    return conn.execute(
        "SELECT (r).allowed, (r).remaining FROM rl_sliding(%s, %s, 600000) AS r",
        (identity, lim),
    ).fetchone()


def test_tls_decisions(pg, tls_redis, certs):
    r = tls_redis()
    use_tls(pg, r, certs)
    identity = new_ident("tls")
    assert [sliding(pg, identity) for _ in range(4)] == [
        (True, 2), (True, 1), (True, 0), (False, 0)]
    assert r.cli("ZCARD", rl_key("sliding", identity, lim=3, window_ms=600000)) == "3"
    server, rtt = pg.execute("SELECT * FROM rl_redis_ping()").fetchone()
    assert server == "127.0.0.1:%d" % r.port and rtt >= 0
    # by name too, checked against the certificate's DNS name
    set_gucs(pg, host="localhost")
    assert sliding(pg, new_ident("tls_name")) == (True, 2)


def test_tls_connection_is_reused(pg, tls_redis, certs):
    r = tls_redis()
    use_tls(pg, r, certs)
    identity = new_ident("tls_reuse")
    sliding(pg, identity, 100)
    before = int(r.cli("INFO", "stats").split("total_connections_received:")[1].split()[0])
    for _ in range(20):
        sliding(pg, identity, 100)
    after = int(r.cli("INFO", "stats").split("total_connections_received:")[1].split()[0])
    # redis-cli's own INFO connection is the only new one
    assert after - before == 1, (before, after)


def test_tls_wrong_ca(pg, tls_redis, certs):
    r = tls_redis()
    use_tls(pg, r, certs, tls_ca_file=os.path.join(certs, "other-ca.pem"))
    with pytest.raises(psycopg.Error) as exc:
        sliding(pg, new_ident("tls_wrong_ca"))
    assert exc.value.sqlstate == "08001"
    assert "certificate verify failed" in str(exc.value), str(exc.value)
    # the same session works once the setting is right
    set_gucs(pg, tls_ca_file=os.path.join(certs, "good-ca.pem"))
    assert sliding(pg, new_ident("tls_fixed_ca")) == (True, 2)


def test_tls_wrong_server_name(pg, tls_redis, certs):
    r = tls_redis()
    use_tls(pg, r, certs, tls_server_name="redis.example.com")
    with pytest.raises(psycopg.Error) as exc:
        sliding(pg, new_ident("tls_wrong_name"))
    assert exc.value.sqlstate == "08001"
    assert "certificate verify failed" in str(exc.value), str(exc.value)


def test_tls_missing_ca_file(pg, tls_redis, certs):
    r = tls_redis()
    use_tls(pg, r, certs, tls_ca_file="/nonexistent/ca.pem")
    with pytest.raises(psycopg.Error) as exc:
        sliding(pg, new_ident("tls_no_ca"))
    assert exc.value.sqlstate == "F0000"
    assert "rl_redis.tls_ca_file" in str(exc.value)


def test_plain_client_on_tls_port(pg, tls_redis, certs):
    r = tls_redis()
    set_gucs(pg, host="127.0.0.1", port=r.port, tls="off", retry_interval=0,
             command_timeout=1000)
    t0 = time.monotonic()
    with pytest.raises(psycopg.Error) as exc:
        sliding(pg, new_ident("tls_plain"))
    assert exc.value.sqlstate in ("08006", "08P01"), repr(exc.value)
    assert time.monotonic() - t0 < 3.0


def test_tls_client_certificate(pg, tls_redis, certs):
    r = tls_redis(auth_clients=True)
    use_tls(pg, r, certs)
    with pytest.raises(psycopg.Error) as exc:
        sliding(pg, new_ident("tls_no_client_cert"))
    assert exc.value.sqlstate in ("08001", "08006"), repr(exc.value)
    set_gucs(pg, tls_cert_file=os.path.join(certs, "client.pem"),
             tls_key_file=os.path.join(certs, "client.key"))
    assert sliding(pg, new_ident("tls_client_cert")) == (True, 2)


def test_tls_hung_server_and_cancel(pg, tls_redis, certs):
    r = tls_redis()
    use_tls(pg, r, certs)
    identity = new_ident("tls_hung")
    assert sliding(pg, identity, 100) == (True, 99)
    r.pause()
    pg.execute("SET statement_timeout = '300ms'")
    t0 = time.monotonic()
    with pytest.raises(psycopg.errors.QueryCanceled):
        sliding(pg, identity, 100)
    assert time.monotonic() - t0 < 1.0
    pg.execute("RESET statement_timeout")
    r.resume()
    # the abandoned connection is not reused: the reply belongs to this call
    # (lim is echoed back; an explicit limit is a key of its own, so lim 777
    # starts from a full allowance)
    row = pg.execute(
        "SELECT (r).allowed, (r).lim, (r).remaining FROM rl_sliding(%s, 777, 600000) AS r",
        (identity,),
    ).fetchone()
    assert row == (True, 777, 776), row
    # lim 100 counts the first call, this one, and the cancelled call if it
    # ran once Redis woke
    assert sliding(pg, identity, 100) in ((True, 98), (True, 97))


def test_tls_settings_are_superuser_only(pg):
    role = "rl_tls_%s" % new_ident().split(":")[-1][:12]
    pg.execute('CREATE ROLE "%s" LOGIN' % role)
    # 1.3: the explicit-argument functions are granted by an administrator
    pg.execute('GRANT EXECUTE ON FUNCTION rl_fixed_allow(text, integer, bigint, integer) TO "%s"'
               % role)
    conn = pg_connect(user=role)
    try:
        conn.execute("SELECT rl_fixed_allow('tls_priv', 1000, 1000)")  # loads the library
        for setting, value in (("tls", "off"), ("tls_ca_file", "/tmp/x"),
                               ("tls_cert_file", "/tmp/x"), ("tls_key_file", "/tmp/x"),
                               ("tls_server_name", "x")):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute("SET rl_redis.%s = '%s'" % (setting, value))
        for hidden in ("tls_ca_file", "tls_cert_file", "tls_key_file"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute("SHOW rl_redis.%s" % hidden)
    finally:
        conn.close()
        pg.execute('DROP OWNED BY "%s"' % role)  # and its privileges
        pg.execute('DROP ROLE "%s"' % role)
