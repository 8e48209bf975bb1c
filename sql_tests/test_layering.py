"""The layering that src/rl_redis.h states is true of the built objects.

rl_redis.h lists the files of the extension in an order and says that each
calls only files listed above it (no circle). This test reads that list,
runs `nm` on each object of the Makefile's OBJS (src/*.o, which `make test`
builds before the tests run), maps every undefined symbol of an object to
the object that defines it, and fails for each symbol a file takes from a
file listed below it. A total order that every reference goes up is
also free of cycles, so that is checked too. It needs no server.
"""

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
