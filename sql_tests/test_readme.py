"""The manual's examples, run: every fenced ```sql, ```sh and ```bash block of
README.md and examples/*/README.md is executed against the servers of the
test run, in document order per file, and what it prints is compared with
the output the document shows, so that the manual cannot drift from the
code. The conventions (README.md, "Testing", says the same):

* Output. A block shows output when the fenced block right after it
  (nothing but blank lines between) is not itself runnable (```, ```text or
  ```json): that block is what running it prints. For SQL: what
  `psql -X -q` prints when the block is fed on its standard input (result
  tables, NOTICE / WARNING / ERROR lines, in order); for a shell block: its
  standard output and error. Trailing whitespace and leading or trailing
  blank lines do not count. A block that shows no output must succeed
  (psql with ON_ERROR_STOP, a shell block with exit status 0); one that
  shows output may show an error.
* Directives: an HTML comment on the lines just before a block (blank lines
  may separate them), applying to that one block:
    <!-- sketch: why -->     not run (it needs a real deployment, a package
                             install, a restart ...): reported as a skipped
                             test with that reason, one per block
    <!-- fresh database -->  runs alone in a new database in which rl_redis
                             is created, dropped afterwards; the document's
                             state is neither used nor changed
    <!-- setup: SQL -->      SQL run (and required to succeed) in the
                             block's database just before it; its output is
                             not compared
  A directive that is not followed by a runnable block, and a fenced block
  whose info string is neither runnable nor an output one, fail
  test_conventions, so that no block is skipped without saying so.
* State. Each file runs in a new database of its own, created for the run
  and dropped at the end, where the document's order builds the state:
  README.md's starts empty (its Install section creates the extension), an
  example's README starts with rl_redis created, as its requirements say.
  Every SQL block is a new psql session. The database sets
  rl_redis.key_prefix to a prefix unique to the file's run and
  rl_redis.test_clock_ms to 1767225600000 (2026-01-01 00:00 UTC): the clock
  stands still, so the times shown are those of calls made at one instant.
  Roles the blocks create, the databases and the run's Redis keys are
  removed at the end.
* Shell blocks run with `bash -e -o pipefail` in a scratch directory, with
  PGHOST/PGPORT/PGUSER/PGDATABASE naming the file's database and a
  `redis-cli` first on PATH that talks to the test run's Redis. The key
  prefix `rl:` written in a shell block stands for the run's prefix: it is
  replaced before running, and the run's prefix is written back as `rl:` in
  what the block prints.

Every block has a deadline of 30 s (its process group is killed then).
"""

import difflib
import glob
import os
import re
import shutil
import signal
import subprocess
import tempfile
import uuid

from psycopg import sql
import pytest

from conftest import control_version, pg_connect, resp_command

# the blocks of a document build on each other: one xdist worker runs them all,
# in document order
pytestmark = pytest.mark.xdist_group("readme")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "examples", "*", "README.md"))
)
# documents whose database starts with the extension created (their
# requirements say so); README.md creates it itself
WITH_EXTENSION = {d for d in DOCS if d != "README.md"}

RUNNABLE = {"sql", "sh", "bash"}
OUTPUT = {"", "text", "json"}
TEST_CLOCK_MS = 1767225600000  # 2026-01-01 00:00:00 UTC
DEADLINE_S = 30
PSQL = shutil.which("psql") or "/usr/bin/psql"
REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"

FENCE_OPEN = re.compile(r"^(?P<indent>[ ]{0,12})(?P<fence>`{3,}|~{3,})[ ]*(?P<info>[^`\s]*)[^`]*$")
DIRECTIVE = re.compile(r"^(sketch:|fresh database\b|setup:)", re.S)


class Block:
    def __init__(self, doc, line, info, text):
        self.doc = doc
        self.line = line          # 1-based line of the opening fence
        self.info = info
        self.text = text
        self.output = None        # shown output, or None
        self.output_line = None
        self.sketch = None        # reason
        self.fresh = False
        self.setup = None         # SQL

    @property
    def id(self):
        return "%s:%d" % (self.doc, self.line)


def parse(doc):
    """Returns (runnable blocks, problems) of one Markdown file."""
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        lines = f.read().split("\n")
    blocks = []           # every fenced block, in order
    problems = []
    pending = []          # (line, directive text) waiting for a block
    i = 0

    def close_fence(start, indent, fence):
        """Reads a block's body from line start; returns (text, next index)."""
        body = []
        close = re.compile(r"^[ ]{0,%d}%s%s*[ ]*$" % (max(len(indent), 3), re.escape(fence), re.escape(fence[0])))
        j = start
        while j < len(lines) and not close.match(lines[j]):
            line = lines[j]
            # remove the opening fence's indentation (a block inside a list item)
            k = 0
            while k < len(indent) and k < len(line) and line[k] == " ":
                k += 1
            body.append(line[k:])
            j += 1
        if j >= len(lines):
            problems.append("%s:%d: fenced block is never closed" % (doc, start))
        return "\n".join(body) + "\n", j + 1

    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        m = FENCE_OPEN.match(line)
        if m:
            info = m.group("info").lower()
            text, nxt = close_fence(i + 1, m.group("indent"), m.group("fence"))
            b = Block(doc, i + 1, info, text)
            b.end = nxt - 1       # index of its closing fence
            b.directives = pending
            pending = []
            blocks.append(b)
            i = nxt
            continue
        if stripped.startswith("<!--"):
            start = i
            comment = stripped
            while "-->" not in comment and i + 1 < len(lines):
                i += 1
                comment += "\n" + lines[i].strip()
            body = comment[4:comment.index("-->")].strip() if "-->" in comment else comment[4:]
            if DIRECTIVE.match(body):
                pending.append((start + 1, body))
            i += 1
            continue
        if stripped and pending:
            for ln, text in pending:
                problems.append("%s:%d: directive <!-- %s --> is not followed by a block"
                                % (doc, ln, text.split("\n")[0]))
            pending = []
        i += 1
    for ln, text in pending:
        problems.append("%s:%d: directive <!-- %s --> is not followed by a block" % (doc, ln, text.split("\n")[0]))

    runnable = []
    k = 0
    while k < len(blocks):
        b = blocks[k]
        if b.info not in RUNNABLE and b.info not in OUTPUT:
            problems.append("%s:%d: fenced block tagged %r: tag it sql, sh or bash to run it, "
                            "or text (or leave it untagged) for output and other text"
                            % (doc, b.line, b.info))
        if b.info not in RUNNABLE:
            for ln, text in b.directives:
                problems.append("%s:%d: directive <!-- %s --> precedes a block that is not runnable (%r)"
                                % (doc, ln, text.split("\n")[0], b.info))
            k += 1
            continue
        for ln, text in b.directives:
            if text.startswith("sketch:"):
                b.sketch = text[len("sketch:"):].strip()
                if not b.sketch:
                    problems.append("%s:%d: a sketch needs a reason" % (doc, ln))
            elif text.startswith("fresh database"):
                b.fresh = True
            elif text.startswith("setup:"):
                if b.info != "sql":
                    problems.append("%s:%d: setup is for sql blocks" % (doc, ln))
                b.setup = text[len("setup:"):].strip() + "\n"
        # the output: the next fenced block, if only blank lines separate them
        # and it is not runnable itself
        if k + 1 < len(blocks):
            nb = blocks[k + 1]
            between = lines[b.end + 1:nb.line - 1]
            if nb.info not in RUNNABLE and not nb.directives and all(not x.strip() for x in between):
                b.output = nb.text
                b.output_line = nb.line
                k += 1
        runnable.append(b)
        k += 1
    return runnable, problems


PARSED = {doc: parse(doc) for doc in DOCS}
ALL_BLOCKS = [b for doc in DOCS for b in PARSED[doc][0]]


def test_conventions():
    """Every fenced block is runnable, output or tagged as text, and every
    directive belongs to the runnable block that follows it."""
    problems = [p for doc in DOCS for p in PARSED[doc][1]]
    assert not problems, "\n".join(problems)
    assert any(b.doc == "README.md" for b in ALL_BLOCKS)


def test_facts_the_prose_states():
    """What the README says in prose and a test can read: the package name
    dpkg-buildpackage writes (the version of debian/changelog, which is the
    control file's default_version), the number of functions that
    DROP EXTENSION drops (the extension's members in pg_depend), and the
    objects PostgreSQL 17 counts where the upgrade test counts those of 15."""
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    with open(os.path.join(ROOT, "debian", "changelog")) as f:
        package_version = re.match(r"rl-redis \(([^)]+)\)", f.readline()).group(1)
    assert package_version.startswith(control_version() + ".")
    named = set(re.findall(r"postgresql-15-rl-redis_([0-9.]+)_amd64\.deb", readme))
    assert named == {package_version}, named
    with pg_connect() as conn:
        functions = conn.execute(
            "SELECT count(*) FROM pg_depend WHERE classid = 'pg_proc'::regclass AND deptype = 'e' "
            "AND refobjid = (SELECT oid FROM pg_extension WHERE extname = 'rl_redis')").fetchone()[0]
    stated = re.findall(r"the (\d+) functions", readme)
    assert stated == [str(functions)], (stated, functions)

    # Supported versions: PostgreSQL 17 also records as members the row
    # type of the extension's tables and views and every member type's
    # array type, which the upgrade test leaves out (as this query does, so
    # that it counts on every version what 15 and 16 record)
    with open(os.path.join(ROOT, "expected", "upgrade.out")) as f:
        counted = int(re.search(r"AS objects FROM objects_new;\n objects \n-+\n +(\d+)\n", f.read()).group(1))
    with pg_connect() as conn:
        members, implicit = conn.execute(
            "WITH m AS (SELECT d.classid, d.objid, t.typarray FROM pg_depend d"
            "             LEFT JOIN pg_type t ON d.classid = 'pg_type'::regclass AND t.oid = d.objid"
            "             LEFT JOIN pg_class c ON c.oid = t.typrelid"
            "            WHERE d.refclassid = 'pg_extension'::regclass AND d.deptype = 'e'"
            "              AND d.refobjid = (SELECT oid FROM pg_extension WHERE extname = 'rl_redis')"
            "              AND (t.oid IS NULL OR (t.typcategory <> 'A' AND coalesce(c.relkind, 'c') = 'c'))) "
            "SELECT (SELECT count(*) FROM m), "
            "       (SELECT count(*) + count(nullif(t.typarray, 0)) FROM m JOIN pg_class c "
            "          ON m.classid = 'pg_class'::regclass AND c.oid = m.objid JOIN pg_type t ON t.oid = c.reltype) "
            "     + (SELECT count(nullif(typarray, 0)) FROM m)").fetchone()
    assert members == counted, (members, counted)
    stated = re.findall(r"\((\d+) objects instead of (\d+)\)", readme)
    assert stated == [(str(counted + implicit), str(counted))], (stated, counted, implicit)


# ---------------------------------------------------------------- running


def _normalize(text):
    lines = [l.rstrip() for l in text.replace("\t", "    ").split("\n")]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _run(argv, input_text, env, cwd):
    """Runs argv in its own process group; returns (exit status, output).
    Kills the group at the deadline."""
    proc = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env=env, cwd=cwd, start_new_session=True, text=True, encoding="utf-8", errors="replace",
    )
    try:
        out, _ = proc.communicate(input_text, timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out
    finally:
        # whatever the block left running in the background
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return proc.returncode, out


class DocRun:
    """One file's run: its database, key prefix, scratch directory."""

    def __init__(self, doc, scratch):
        tag = uuid.uuid4().hex[:8]
        self.doc = doc
        self.prefix = "rdm%s:" % tag
        self.dbname = "readme_%s_%s" % (re.sub(r"[^a-z0-9]+", "_", doc.lower()).strip("_")[:30], tag)
        self.databases = []
        self.scratch = os.path.join(scratch, tag)
        os.makedirs(self.scratch)
        self.create_database(self.dbname, doc in WITH_EXTENSION)

    def create_database(self, name, extension):
        with pg_connect() as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            self.databases.append(name)
            for setting, value in (("rl_redis.key_prefix", self.prefix),
                                   ("rl_redis.test_clock_ms", str(TEST_CLOCK_MS))):
                conn.execute(sql.SQL("ALTER DATABASE {} SET {} = {}").format(
                    sql.Identifier(name), sql.Identifier(*setting.split(".")), sql.Literal(value)))
        if extension:
            with pg_connect(dbname=name) as conn:
                conn.execute("CREATE EXTENSION rl_redis")

    def drop_database(self, name):
        with pg_connect() as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        self.databases.remove(name)

    def env(self, dbname, bindir):
        env = dict(os.environ)
        env.update(PGDATABASE=dbname, PGUSER="postgres", PSQLRC="/dev/null",
                   PGCLIENTENCODING="UTF8", PAGER="cat", PSQL_PAGER="cat",
                   PATH=bindir + os.pathsep + env.get("PATH", ""))
        env.pop("PGOPTIONS", None)
        return env

    def cleanup(self):
        for name in list(self.databases):
            self.drop_database(name)
        port = int(os.environ["RL_REDIS_PORT"])
        cursor = "0"
        while True:
            cursor, keys = resp_command(["SCAN", cursor, "MATCH", self.prefix + "*", "COUNT", "1000"], port=port)
            if keys:
                resp_command(["UNLINK"] + keys, port=port)
            if cursor == "0":
                break
        shutil.rmtree(self.scratch, ignore_errors=True)


@pytest.fixture(scope="module")
def docs(request):
    """The runs of the files (made on first use), cleaned up at the end."""
    scratch = tempfile.mkdtemp(prefix="readme_", dir=os.environ.get("RL_DIR") or None)
    os.chmod(scratch, 0o755)
    bindir = os.path.join(scratch, "bin")
    os.makedirs(bindir)
    with open(os.path.join(bindir, "redis-cli"), "w") as f:
        f.write('#!/bin/sh\nexec %s -h 127.0.0.1 -p "$RL_REDIS_PORT" "$@"\n' % REDIS_CLI)
    os.chmod(os.path.join(bindir, "redis-cli"), 0o755)
    with pg_connect() as conn:
        roles_before = {r for (r,) in conn.execute("SELECT rolname FROM pg_roles")}
    state = {"runs": {}, "bindir": bindir, "scratch": scratch, "skipped": [], "ran": 0}
    try:
        yield state
    finally:
        for run in state["runs"].values():
            run.cleanup()
        # only the roles the documents create: other tests running beside
        # this module create roles of their own meanwhile
        theirs = set()
        for doc in DOCS:
            with open(os.path.join(ROOT, doc)) as f:
                theirs |= set(re.findall(r"CREATE ROLE\s+(\w+)", f.read()))
        with pg_connect() as conn:
            for (role,) in conn.execute("SELECT rolname FROM pg_roles").fetchall():
                if role not in roles_before and role in theirs:
                    conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))
        shutil.rmtree(scratch, ignore_errors=True)
        _report(request.config, state["ran"], state["skipped"])


def _report(config, ran, skipped):
    """Lists the sketches in the terminal summary (pytest -q shows only a
    count of skipped tests)."""
    lines = ["%d blocks run, %d sketches not run%s" % (ran, len(skipped), ":" if skipped else "")]
    lines += ["  %s (%s): %s" % (b.id, b.info, b.sketch) for b in skipped]

    class Summary:
        @staticmethod
        def pytest_terminal_summary(terminalreporter):
            terminalreporter.write_sep("-", "README examples")
            for line in lines:
                terminalreporter.write_line(line)

    if not config.pluginmanager.has_plugin("rl_readme_summary"):
        config.pluginmanager.register(Summary(), "rl_readme_summary")


def _sql(run, text, dbname, bindir, on_error_stop):
    return _run([PSQL, "-X", "-q", "-v", "ON_ERROR_STOP=%d" % on_error_stop],
                text, run.env(dbname, bindir), run.scratch)


def _fail(b, what, status, got):
    pytest.fail("%s (%s block) %s; exit status %s, it printed:\n%s" % (b.id, b.info, what, status, got),
                pytrace=False)


@pytest.mark.parametrize("block", ALL_BLOCKS, ids=[b.id for b in ALL_BLOCKS])
def test_block(block, docs):
    b = block
    if b.sketch is not None:
        docs["skipped"].append(b)
        pytest.skip("%s: sketch: %s" % (b.id, b.sketch))
    run = docs["runs"].get(b.doc)
    if run is None:
        run = docs["runs"][b.doc] = DocRun(b.doc, docs["scratch"])
    bindir = docs["bindir"]
    docs["ran"] += 1

    dbname = run.dbname
    if b.fresh:
        dbname = "%s_%d" % (run.dbname, b.line)
        run.create_database(dbname, True)
    try:
        if b.setup:
            status, out = _sql(run, b.setup, dbname, bindir, 1)
            if status != 0:
                _fail(b, "setup failed", status, out)
        if b.info == "sql":
            status, out = _sql(run, b.text, dbname, bindir, 0 if b.output is not None else 1)
        else:
            text = re.sub(r"(?<![A-Za-z0-9_.-])rl:", run.prefix, b.text)
            script = os.path.join(run.scratch, "block_%d.sh" % b.line)
            with open(script, "w") as f:
                f.write(text)
            status, out = _run(["bash", "-e", "-o", "pipefail", script], "", run.env(dbname, bindir), run.scratch)
            out = out.replace(run.prefix, "rl:")
    finally:
        if b.fresh:
            run.drop_database(dbname)

    if status is None:
        _fail(b, "did not finish within %d s" % DEADLINE_S, status, out)
    if b.output is None:
        if status != 0:
            _fail(b, "failed", status, out)
        return
    shown, got = _normalize(b.output), _normalize(out)
    if shown != got:
        diff = "\n".join(difflib.unified_diff(
            shown, got, "shown at %s:%d" % (b.doc, b.output_line), "printed by the block at %s" % b.id,
            lineterm=""))
        pytest.fail("%s (%s block): the output differs from the one shown:\n%s" % (b.id, b.info, diff),
                    pytrace=False)
    if b.info != "sql" and status != 0:
        _fail(b, "printed the output shown but failed", status, out)
