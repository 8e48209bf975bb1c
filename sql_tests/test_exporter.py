"""The two routes to Prometheus give one set of metrics (README, "Metrics for
Prometheus"): Debian's prometheus-postgres-exporter, run with the README's
queries file against a real server, serves exactly the samples that
rl_redis_metrics() returns there (names, types, labels and values; the
exporter adds its `server` label), and every metric the README's alert
rules use is in both.

The server is one of the test's own, so that no other test's decisions
change its statistics between the two reads.
"""

import os
import re
import shutil
import subprocess
import urllib.request


from conftest import free_port, new_ident, wait_for

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
EXPORTER = shutil.which("prometheus-postgres-exporter") or "/usr/bin/prometheus-postgres-exporter"


def readme():
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def section(doc, heading):
    """The text of the README section under `heading` (up to the next
    heading of the same or a higher level)."""
    level = len(heading) - len(heading.lstrip("#"))
    start = doc.index(heading + "\n")
    end = re.compile(r"^#{1,%d} " % level, re.M).search(doc, start + len(heading))
    return doc[start:end.start() if end else len(doc)]


def queries_file(doc):
    """The README's postgres_exporter queries file: the fenced block of
    "Metrics for Prometheus" that starts with `rl_redis:`."""
    blocks = re.findall(r"^```text\n(.*?)^```", section(doc, "### Metrics for Prometheus"),
                        re.S | re.M)
    found = [b for b in blocks if b.startswith("rl_redis:\n")]
    assert len(found) == 1, blocks
    return found[0]


def alert_metrics(doc):
    """The metric names the README's alert rules use."""
    names = set(re.findall(r"\brl_redis_[a-z_]+", section(doc, "### Alerting suggestions")))
    assert names, "no metric in the alert rules"
    return names


SAMPLE = re.compile(r'^(rl_redis_[a-z_]+)(?:\{(.*)\})? (\S+)$')
LABEL = re.compile(r'([a-z_]+)="((?:[^"\\]|\\.)*)"')


def parse(text, drop=()):
    """{(name, frozenset of labels): float} of the rl_redis_* samples, and
    {family: type} of their # TYPE lines."""
    samples, types = {}, {}
    for line in text.splitlines():
        m = re.match(r"^# TYPE (rl_redis_[a-z_]+) (\w+)$", line)
        if m:
            types[m.group(1)] = m.group(2)
            continue
        m = SAMPLE.match(line)
        if not m:
            continue
        labels = frozenset((k, v) for k, v in LABEL.findall(m.group(2) or "") if k not in drop)
        key = (m.group(1), labels)
        assert key not in samples, line
        samples[key] = float(m.group(3))
    return samples, types


def make_statistics(server):
    """Decisions of every outcome on the server: allowed and denied, through
    a policy and explicit arguments, one refund and one failed call that
    on_error allows."""
    policy = "exp_" + new_ident("p").rsplit(":", 1)[1][:12]
    ident = new_ident("exp")
    with server.connect() as conn:
        conn.execute("INSERT INTO rl_policy (name, algorithm, lim, window_ms) VALUES (%s, 'fixed', 2, 60000)",
                     (policy,))
        assert [conn.execute("SELECT rl_allow(%s, %s)", (policy, ident)).fetchone()[0]
                for _ in range(3)] == [True, True, False]
        conn.execute("SELECT rl_token_bucket_allow(%s, 5, 1000)", (ident,))
        conn.execute("SELECT rl_refund(%s, %s)", (policy, ident))
        closed = free_port()
        conn.execute("SET rl_redis.port = %d" % closed)
        conn.execute("SET rl_redis.on_error = 'allow'")
        conn.execute("SET client_min_messages = error")
        assert conn.execute("SELECT rl_fixed_allow(%s, 5, 1000)", (ident,)).fetchone()[0] is True


def scrape(port, timeout=60.0):
    """The exporter's /metrics once it serves the queries' metrics."""
    def get():
        try:
            with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=5) as r:
                body = r.read().decode()
        except OSError:
            return None
        return body if re.search(r"^rl_redis_", body, re.M) else None
    return wait_for(get, timeout, "the exporter's rl_redis metrics", interval=0.2)


def test_exporter_and_function_give_the_same_metrics(private_server, tmp_path):
    server = private_server
    doc = readme()
    assert os.access(EXPORTER, os.X_OK), \
        "%s is missing: sql_tests/install_deps.sh installs prometheus-postgres-exporter" % EXPORTER
    make_statistics(server)
    queries = tmp_path / "rl_redis_queries.yaml"
    queries.write_text(queries_file(doc))
    port = free_port()
    env = dict(os.environ, DATA_SOURCE_NAME="host=127.0.0.1 port=%d user=postgres dbname=postgres "
               "sslmode=disable" % server.port)
    log = open(tmp_path / "exporter.log", "w")
    proc = subprocess.Popen([EXPORTER, "--extend.query-path=%s" % queries,
                             "--web.listen-address=127.0.0.1:%d" % port,
                             "--disable-default-metrics", "--disable-settings-metrics"],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        body = scrape(port)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()
    assert re.search(r"^pg_exporter_user_queries_load_error\{.*\} 0$", body, re.M), \
        (body[:2000], (tmp_path / "exporter.log").read_text()[-2000:])
    with server.connect() as conn:
        function = conn.execute("SELECT rl_redis_metrics()").fetchone()[0]

    exported, exported_types = parse(body, drop=("server",))
    own, own_types = parse(function)
    assert exported == own, sorted(set(exported.items()) ^ set(own.items()))
    assert exported_types == own_types
    # every outcome made above shows, so that equal means something
    got = {name for (name, _), v in own.items() if v > 0}
    assert {"rl_redis_allowed_total", "rl_redis_denied_total", "rl_redis_units_refunded_total",
            "rl_redis_errors_by_kind_total", "rl_redis_fallback_allow_total",
            "rl_redis_rtt_seconds_bucket"} <= got, got
    names = {name for name, _ in own}
    assert alert_metrics(doc) <= names, alert_metrics(doc) - names
