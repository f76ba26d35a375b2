"""The portable start (labkit/runtime/platform.py), forced here on Linux: a
forkserver that never imports torch, whose ranks come from spares that import it
after the fork. What a macOS student runs; CI also runs every runtime test and
chapters 00-02 with LABKIT_START=portable."""

import subprocess
import sys

import psutil
import pytest

import labkit
from labkit.runtime import forkserver, platform

pytestmark = pytest.mark.ranks


def _has(rank, world_size, names):
    import sys

    return {n: n in sys.modules for n in names}


def _fail(rank, world_size):
    if rank == 1:
        raise RuntimeError("injected fault")


def test_start_is_chosen_by_platform_and_refuses_nonsense(monkeypatch):
    monkeypatch.delenv("LABKIT_START", raising=False)
    assert platform.start_method() == ("fork" if platform.LINUX else "portable")
    monkeypatch.setenv("LABKIT_START", "portable")
    assert platform.start_method() == "portable"
    assert platform.start_method("fork") == "fork"  # an argument beats the setting
    with pytest.raises(ValueError, match="'auto', 'fork' or 'portable', not 'spawn'"):
        labkit.Cluster(2, start="spawn")


def test_the_forkserver_imports_no_torch_and_a_fault_restarts_the_ranks():
    with labkit.Cluster(2, start="portable", timeout=60) as c:
        assert c.run(lambda rank, world_size: rank).values == [0, 1]
        server = forkserver.shared("portable")
        assert server.start == "portable"
        # its own modules: no torch there, ever (fork after torch is what's unsafe)
        maps = open(f"/proc/{server.pid}/maps").read() if platform.LINUX else ""
        assert "libtorch" not in maps, "the portable forkserver loaded libtorch"
        old = set(c.pids.values())
        assert {psutil.Process(p).ppid() for p in old} == {server.pid}
        assert c.run(_has, ["torch", "cloudpickle"]).values == [
            {"torch": True, "cloudpickle": True}] * 2
        with pytest.raises(labkit.RankError, match="rank 1 raised RuntimeError: "
                                                   "injected fault"):
            c.run(_fail)
        assert c.run(lambda rank, world_size: rank).values == [0, 1]
        assert not old & set(c.pids.values()), "the restart reused a rank"


_RESTART_FROM_SPARES = """
import time, psutil, labkit
from labkit.runtime import forkserver

def fail(rank, world_size):
    if rank == 1:
        raise RuntimeError("injected fault")

with labkit.Cluster(2, start="START") as c:
    c.run(lambda rank, world_size: None)
    try:
        c.run(fail)
    except labkit.RankError:
        pass
    server = psutil.Process(forkserver.shared("START").pid)
    end = time.monotonic() + 60
    ready, spares = [], []
    while time.monotonic() < end:  # until every spare has torch loaded
        time.sleep(0.2)
        spares = [p for p in server.children() if p.pid not in c.pids.values()]
        ready = [p.pid for p in spares
                 if any("libtorch" in m.path for m in p.memory_maps())]
        if len(ready) >= 2 and len(ready) == len(spares):
            break
    t = time.perf_counter()
    c.run(lambda rank, world_size: None)  # restarts, then runs
    took = time.perf_counter() - t
    print("RESULT", (sorted(ready), sorted(c.pids.values()), round(took, 3)))
"""


@pytest.mark.parametrize("start", ["portable", "fork"])
def test_a_restart_takes_the_spares_that_wait_with_torch_imported(start):
    """Once the forkserver has idled, spares fork (and, portable, import torch);
    a restart then takes them instead of forking ranks (its time is `bench
    cluster`'s, not asserted here). In a fresh interpreter, whose forkserver
    serves this cluster alone."""
    if start == "fork" and not platform.LINUX:
        pytest.skip("the fork start is Linux's")
    code = _RESTART_FROM_SPARES.replace("START", start)
    out = subprocess.run([sys.executable, "-c", code],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    ready, ranks, took = eval(out.stdout.split("RESULT", 1)[1])
    print(f"restart from spares: {took:.3f} s (a timing)")
    assert len(ready) >= 2, f"spares with torch imported after 60 s: {ready}"
    assert set(ranks) <= set(ready), (
        f"the restart forked new ranks {ranks} instead of taking the spares {ready}")
