import ast
import inspect
import os
import re
import textwrap
import time
from collections import Counter

import psutil
import pytest

from labkit.runtime.platform import start_method

# tests of the fork start's own machinery (a forkserver that imported torch hands
# over to a successor): the portable start (LABKIT_START=portable) has none
FORK_ONLY = pytest.mark.skipif(
    start_method() != "fork", reason="the fork start's hand-over; the portable "
    "start's forkserver imports nothing (its spares do)")


def alive(pid: int) -> bool:
    """True while the process exists and is not a zombie.

    A thread-group leader shows as a zombie while its other threads still exit
    (and hold its files open); use `reaped` below when that matters.
    """
    try:
        return psutil.Process(pid).status() not in _DEAD
    except psutil.NoSuchProcess:
        return False


_DEAD = (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)


def reaped(pid: int) -> bool:
    return not psutil.pid_exists(pid)


def wait_gone(pids, seconds: float, *, until_reaped: bool = False) -> list[int]:
    """Wait until every pid is gone; return those still alive after `seconds`."""
    end = time.monotonic() + seconds
    while True:
        left = [p for p in pids if (not reaped(p) if until_reaped else alive(p))]
        if not left or time.monotonic() > end:
            return left
        time.sleep(0.02)


@pytest.fixture(scope="module")
def cluster():
    import labkit

    with labkit.Cluster(4, timeout=20) as c:
        yield c


def descendants_of(pid: int) -> list[int]:
    """Children, their children, ... (ranks may be forked by a successor); not
    zombies."""
    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    return [k.pid for k in kids if alive(k.pid)]


# ------------------------------------------------------- the fast inner loop
# `make check` runs the tests that start no process: no ranks, no kernel, no
# torchrun, no notebook. A test is marked "ranks" here when it, a fixture it uses
# or a module-level function either calls (transitively, within its module) starts
# one; a test left unmarked that starts one anyway fails (the guard below), so the
# split cannot drift silently.
_STARTS = re.compile(r"\bCluster\(|\bsubprocess\b|\bPopen\b|torchrun|KernelManager|"
                     r"start_new_kernel|nbval|default_cluster|forkserver|\bspawn\(|"
                     r"run_cell_magic|%%ranks|NotebookClient")
_ALWAYS = {"cluster"}  # fixtures that are ranks themselves


def _starts_processes(item) -> bool:
    if _ALWAYS & set(item.fixturenames):
        return True
    module = inspect.getmodule(item.function)
    funcs = [item.function]
    for name in set(item.fixturenames) - {"_no_process_unless_marked"}:
        for fd in item._fixtureinfo.name2fixturedefs.get(name, ()):
            funcs.append(fd.func)
    seen = set()
    while funcs:
        f = funcs.pop()
        if f in seen:
            continue
        seen.add(f)
        try:
            src = textwrap.dedent(inspect.getsource(f))
        except (OSError, TypeError):
            continue
        if _STARTS.search(src):
            return True
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.Name):
                g = getattr(module, node.id, None)
                if inspect.isfunction(g) and inspect.getmodule(g) is module:
                    funcs.append(g)
    return False


def pytest_collection_modifyitems(config, items):
    for item in items:
        if not isinstance(item, pytest.Function):  # a notebook's cell (nbval), in
            continue                               # a session with both (test-cpus)
        if _starts_processes(item):
            item.add_marker(pytest.mark.ranks)
        if item.path.name.startswith("test_runtime_"):
            item.add_marker(pytest.mark.runtime)
    _longest_first(items)


def _longest_first(items) -> None:
    """Files by how many slow tests they hold (whole notebooks, a browser,
    torchrun, network namespaces), then by how many tests. pytest-xdist hands out
    whole files in this order (`--dist loadfile --no-loadscope-reorder`): a file
    that takes minutes starts early instead of running alone at the end while
    the other workers wait. Each file's tests keep their order (a stable sort)."""
    per_file = Counter(item.path for item in items)
    slow = Counter(item.path for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: (-slow[item.path], -per_file[item.path]))


@pytest.fixture(autouse=True)
def _no_process_unless_marked(request, monkeypatch):
    """A test not marked "ranks" that starts a process fails, naming the mark."""
    if request.node.get_closest_marker("ranks") or \
            request.node.get_closest_marker("slow"):
        yield
        return

    def refuse(*args, **kwargs):
        raise AssertionError(
            f"{request.node.nodeid} starts a process but is not marked 'ranks' "
            "(tests/conftest.py: _STARTS): `make check` would run it")

    import subprocess

    from labkit.runtime import forkserver

    # every Popen, however imported (asyncio's too), and a bare fork
    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
    monkeypatch.setattr(os, "fork", refuse)
    monkeypatch.setattr(forkserver, "shared", refuse)
    yield
