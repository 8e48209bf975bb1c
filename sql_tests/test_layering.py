"""The layering that src/rl_redis.h states is true of the built objects.

rl_redis.h lists the files of the extension in an order and says that each
calls only files listed above it (no circle). This test reads that list,
runs `nm` on each object of the Makefile's OBJS (src/*.o, which `make test`
builds before the tests run), maps every undefined symbol of an object to
the object that defines it, and fails for each symbol a file takes from a
file listed below it. A total order that every reference goes up is
also free of cycles, so that is checked too. It also checks that the
functions README.md's "How it works" table names are defined where it says.
It needs no server.
"""

import glob
import os
import re
import subprocess

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
HEADER = os.path.join(ROOT, "src", "rl_redis.h")


def stated_order():
    """The files rl_redis.h's first comment lists, in its order (base names)."""
    with open(HEADER) as f:
        text = f.read()
    comment = text[:text.index("*/")]
    return re.findall(r"^ \* src/(\w+)\.[ch]\b", comment, re.M)


def built_objects():
    """The base names of the Makefile's OBJS (src/NAME.o)."""
    with open(os.path.join(ROOT, "Makefile")) as f:
        text = f.read()
    objs = re.search(r"^OBJS\s*=((?:.*\\\n)*.*)$", text, re.M).group(1)
    return re.findall(r"src/(\w+)\.o", objs)


def symbols(names):
    """{name: (the global symbols src/NAME.o defines, those it uses
    undefined)}, from one nm run over all of them (one nm per object costs
    some 100 ms of start-up each)."""
    out = subprocess.run(["nm", "-A"] + [os.path.join(ROOT, "src", n + ".o") for n in names],
                         capture_output=True, text=True, check=True).stdout
    found = {name: (set(), set()) for name in names}
    for line in out.splitlines():
        path, rest = line.split(":", 1)
        defined, used = found[os.path.basename(path)[:-2]]
        fields = rest.split()
        if len(fields) == 2 and fields[0] == "U":
            used.add(fields[1])
        elif len(fields) == 3 and fields[1] in "BCDGRTV":
            defined.add(fields[2])
    return found


def test_every_object_is_listed():
    """Each object the Makefile builds has its place in rl_redis.h's list."""
    order = stated_order()
    assert len(order) == len(set(order)), "rl_redis.h lists a file twice"
    missing = [name for name in built_objects() if name not in order]
    assert not missing, "rl_redis.h does not list: %s" % ", ".join(missing)


def test_files_call_only_files_listed_above():
    """No object uses a symbol of an object listed below it."""
    order = stated_order()
    place = {name: i for i, name in enumerate(order)}
    names = built_objects()
    for name in names:
        obj = os.path.join(ROOT, "src", name + ".o")
        if not os.path.exists(obj):
            pytest.fail("src/%s.o does not exist: build first (make, or make test, "
                        "which builds before it tests)" % name)
        for source in (os.path.join(ROOT, "src", name + ".c"), HEADER):
            if os.path.getmtime(obj) < os.path.getmtime(source):
                pytest.fail("src/%s.o is older than %s: build first (make)"
                            % (name, os.path.relpath(source, ROOT)))
    definer = {}
    found = symbols(names)
    used = {name: found[name][1] for name in names}
    for name in names:
        for symbol in found[name][0]:
            assert symbol not in definer, "%s is defined in src/%s.o and src/%s.o" % (
                symbol, definer[symbol], name)
            definer[symbol] = name
    wrong = sorted(
        "src/%s.c uses %s of src/%s.c, listed below it" % (name, symbol, definer[symbol])
        for name in names
        for symbol in used[name]
        if symbol in definer and place[definer[symbol]] > place[name]
    )
    assert not wrong, "the layering rl_redis.h states is not kept:\n" + "\n".join(wrong)


README = os.path.join(ROOT, "README.md")


def how_it_works_cells():
    """The file:function column of README.md's "How it works" table, a cell
    per row (header and rule left out)."""
    with open(README) as f:
        text = f.read()
    start = text.index("\n## How it works\n")
    end = text.index("\n## ", start + 1)
    rows = [line for line in text[start:end].splitlines() if line.startswith("|")]
    cells = [re.match(r"^\|.*\|(.*)\|\s*$", row).group(1).strip() for row in rows]
    return cells[2:]


def defines(path, name):
    """Whether the source file at path (under ROOT) defines the function
    name: a C definition starts a line with it (the return type is on the
    line above), a Lua one is `[local] function name(` or `name = function`."""
    with open(os.path.join(ROOT, path)) as f:
        text = f.read()
    n = re.escape(name)
    if path.endswith(".lua"):
        pattern = r"^\s*(?:local\s+)?function\s+%s\s*\(|^\s*%s\s*=\s*function\b" % (n, n)
    else:
        pattern = r"^%s\(" % n
    return re.search(pattern, text, re.M) is not None


def test_how_it_works_names_what_exists():
    """Each `file:function` in README.md's "How it works" table is defined in
    that file, each other file it names exists, each bare C function name
    (`rl_route_all`, after a `file:function`) is defined in a file of src/,
    and each bare name after a Lua file's `file:function` in that Lua file,
    so that the map of promises to code cannot rot."""
    sources = [os.path.relpath(p, ROOT)
               for p in sorted(glob.glob(os.path.join(ROOT, "src", "*.c")))]
    cells = how_it_works_cells()
    assert len(cells) >= 10, "README.md's How it works table was not found"
    wrong = []
    checked = 0
    for cell in cells:
        last = None
        for token in re.findall(r"`([^`]+)`", cell):
            named = re.match(r"^((?:src|lua)/[\w.]+):([\w.]+)$", token)
            if named:
                path, name = named.groups()
                last = path
                checked += 1
                if not os.path.exists(os.path.join(ROOT, path)):
                    wrong.append("%s: no file %s" % (token, path))
                elif not defines(path, name):
                    wrong.append("%s: %s does not define %s" % (token, path, name))
            elif re.match(r"^(?:src|lua|sql|sql_tests)/", token):
                if not glob.glob(os.path.join(ROOT, token)):
                    wrong.append("%s: no such file" % token)
            elif re.match(r"^rl_\w+$", token):
                checked += 1
                if not any(defines(path, token) for path in sources):
                    wrong.append("%s: no file of src/ defines it" % token)
            elif last is not None and last.endswith(".lua") and \
                    re.match(r"^[a-z_][\w.]*$", token):
                checked += 1
                if not defines(last, token):
                    wrong.append("%s: %s does not define it" % (token, last))
    assert checked >= 20, "too few names found in the How it works table"
    assert not wrong, "README.md's How it works table names what is not there:\n" + \
        "\n".join(wrong)
