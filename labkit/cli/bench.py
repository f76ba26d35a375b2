"""`python -m labkit bench cluster`: how fast the cluster answers, and how that
compares with the usual way (torch.multiprocessing.spawn + init_process_group per
call), measured in the same run. All numbers here are timings."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

TARGETS = {"first start": 1.5, "first start, prewarmed": 0.2,
           "restart after a fault": 0.3, "warm no-op p50": 1e-3,
           "spawn / no-op": 1000.0, "ring / built-in": 0.8, "live / file only": 1.5}
PRINTED_LINES = 10_000
NOTEBOOK_GAP = 2.0  # seconds between a notebook's import cell and its cluster cell
RESTART_GAP = 6.0  # seconds between the restart figure's faults (a student reads)
RESTARTS = 5


@dataclass(frozen=True)
class Row:
    """One figure of a benchmark, and its target if it has one."""

    name: str
    value: float
    target: float | None = None
    unit: str = "s"
    at_least: bool = False  # the target is a floor (ratios), else a ceiling (times)

    @property
    def status(self) -> str:
        """'ok', 'short' (NaN is short too), or '' without a target."""
        if self.target is None:
            return ""
        if self.at_least:
            hit = self.value >= self.target
        else:
            hit = self.value <= self.target
        return "ok" if hit else "short"


def world_size_problem(what: str, n: int | None) -> str | None:
    """Why `bench what --world-size n` cannot run as asked; None when it can
    (n None: the bench's default)."""
    if n is None:
        return None
    if what == "roofline":
        return (f"--world-size {n}: roofline starts no ranks (it times one GPU's "
                "matrix products); leave the flag out")
    if n < 2:
        return (f"--world-size {n}: at least 2 ranks (every figure here is of ranks "
                "working together)")
    if what == "model-parallel":
        from labkit.cli.bench_pipeline import BLOCKS
        from labkit.cli.bench_tensor_parallel import FFN

        fits = [k for k in range(2, 3 * BLOCKS + 1) if FFN % k == 0 == 3 * BLOCKS % k]
        if n not in fits:
            return (f"--world-size {n}: {_or(fits)} (the MLP's {FFN} hidden features "
                    f"and the pipeline's {3 * BLOCKS} layers split evenly)")
    if what == "expert":
        from labkit.cli.bench_expert import SIZES

        e = SIZES["experts"]
        fits = [k for k in range(2, e + 1) if e % k == 0]
        if n not in fits:
            return f"--world-size {n}: {_or(fits)} (the {e} experts split evenly)"
    return None


def _or(items: list) -> str:
    return ", ".join(map(str, items[:-1])) + f" or {items[-1]}" if len(items) > 1 \
        else str(items[0])


def exit_code(rows: list[Row]) -> int:
    """1 when any figure falls short of its target, else 0."""
    return 1 if any(r.status == "short" for r in rows) else 0


def _fmt(x: float, unit: str, spec: str = "") -> str:
    if unit == "x":
        return f"{x:,{spec or ('.0f' if abs(x) >= 100 else '.2f')}}x"
    return f"{x:{spec or ('.6f' if unit == 's' else '.3f')}} {unit}".rstrip()


def table(rows: list[Row]) -> str:
    """Each figure beside its target, with ok or short."""
    lines = [f"{'measure':<64}{'value':>14}  {'target':<14}status"]
    for r in rows:
        target = ""
        if r.target is not None:
            target = ("≥ " if r.at_least else "≤ ") + _fmt(r.target, r.unit, "g")
        line = f"{r.name:<64}{_fmt(r.value, r.unit):>14}  {target:<14}{r.status}"
        lines.append(line.rstrip())
    short = sum(r.status == "short" for r in rows)
    lines.append(f"\n{short} figure(s) short of target" if short
                 else "\nall targets met")
    return "\n".join(lines)


def _noop(rank, world_size):
    return None


def _fail(rank, world_size):
    if rank == 1:
        raise RuntimeError("injected fault")


def _all_reduce_1m(rank, world_size):
    import torch
    import torch.distributed as dist

    x = torch.ones(1 << 20)
    dist.all_reduce(x)
    return None


def _spawned_rank(rank, world_size, port):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world_size)
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# a notebook's first cells, run by IPython as a kernel runs them (labkit starts
# the forkserver once the importing cell ends), the cluster cell `gap` s later
_FIRST_START = """
import json, time
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
t0 = time.perf_counter()
# a chapter's first cell, its text kept before it runs as a kernel keeps it
shell.run_cell("import labkit, torch", store_history=True).raise_error()
time.sleep({gap})  # the student reads
t1 = time.perf_counter()
shell.run_cell("c = labkit.Cluster({n})", store_history=True).raise_error()
t2 = time.perf_counter()
shell.user_ns["c"].close()
print(json.dumps([t2 - t1, t2 - t0]))
"""


_FIRST_RESTART = """
import json, time
import labkit
import torch


def noop(rank, world_size):
    return None


def fail(rank, world_size):
    if rank == 1:
        raise RuntimeError("injected fault")


c = labkit.Cluster({n})
c.run(noop)
time.sleep({idle})  # idle, as a student's kernel is soon after its first cluster
try:
    c.run(fail)
except labkit.RankError:
    pass
t = time.perf_counter()
c.run(noop)  # restarts the ranks, then runs
print(json.dumps(time.perf_counter() - t))
c.close()
"""


def _fresh(script: str, prewarm: bool, start: str):
    """Run `script` in a fresh interpreter; its last line of output, as JSON."""
    env = dict(os.environ, LABKIT_PREWARM="1" if prewarm else "0",
               LABKIT_START=start)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True,
                         text=True, env=env, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"benchmark subprocess failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _first_start(n: int, gap: float, start: str, prewarm: bool = True
                 ) -> tuple[float, float]:
    """(Cluster(n) seconds, interpreter-to-ready seconds) in a fresh IPython,
    the cluster cell `gap` s after the cell `import labkit, torch`."""
    return tuple(_fresh(_FIRST_START.format(n=n, gap=gap), prewarm, start))


def _first_restart(n: int, idle: float, start: str) -> float:
    """Seconds for the first restart after a fault (+ one no-op) in a fresh
    interpreter (forkserver prewarmed, as in a kernel), `idle` s after one call."""
    return _fresh(_FIRST_RESTART.format(n=n, idle=idle), True, start)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def median_step(step, steps: int) -> float:
    """Median seconds of `steps` calls of step() on this rank, every rank starting
    each call together (a barrier before it); one call first, untimed: it
    allocates buffers and builds state (optimizer, buckets)."""
    import torch.distributed as dist

    times = []
    for i in range(steps + 1):
        dist.barrier()
        t = time.perf_counter()
        step()
        if i:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def interleaved_medians(world_size: int, worker, names, rounds: int, steps: int
                        ) -> dict[str, float]:
    """{name: median over rounds of the slowest rank's `worker(rank, n, name,
    steps)` seconds} (workers time their steps with median_step). Each round
    runs every name once, in alternating order, so a slow stretch of a shared
    machine falls on all of them alike."""
    import labkit

    seconds: dict[str, list[float]] = {k: [] for k in names}
    with labkit.Cluster(world_size, timeout=600) as c:
        for r in range(rounds):
            progress(f"round {r + 1} of {rounds}")
            for name in list(names)[::-1] if r % 2 else names:
                seconds[name].append(max(c.run(worker, name, steps)))
    return {k: statistics.median(v) for k, v in seconds.items()}


def progress(msg: str) -> None:
    """What a benchmark is doing now, a line on stderr (the tables go to stdout)."""
    print(f"  … {msg}", file=sys.stderr, flush=True)


def bench_cluster(world_size: int = 4, calls: int = 2000) -> int:
    """Time the cluster (first start, restarts after a fault, warm no-op calls,
    all_reduce round trips, printed lines watched and not) against
    torch.multiprocessing.spawn, for each start method this platform has (fork
    and portable on Linux), print the tables; exit_code of their rows."""
    import torch.multiprocessing as mp

    from labkit.runtime import available_starts

    n = world_size
    print(f"labkit bench cluster: {n} ranks, {os.cpu_count()} cores (all timings)")
    progress("the usual way: torch.multiprocessing.spawn per call (3 times)")
    spawn = []
    for _ in range(3):
        t = time.perf_counter()
        mp.spawn(_spawned_rank, args=(n, _free_port()), nprocs=n, join=True)
        spawn.append(time.perf_counter() - t)
    spawn_s = statistics.median(spawn)
    rows = []
    for start in available_starts():
        figures = _cluster_figures(n, calls, start)
        these = cluster_rows(**figures, spawn=spawn_s, start=start)
        print(f"\nstart={start!r}" + (" (the fast path)" if start == "fork" else
                                      " (macOS's: no fork after importing torch)"))
        print(table(these))
        rows += these
    return exit_code(rows)


def _cluster_figures(n: int, calls: int, start: str) -> dict:
    import labkit

    progress(f"start={start}: first start, in fresh IPython shells")
    warm = sorted(_first_start(n, NOTEBOOK_GAP, start) for _ in range(3))[1]
    cold = sorted(_first_start(n, 0, start) for _ in range(3))[1]
    unwarmed = _first_start(n, 0, start, prewarm=False)
    progress(f"start={start}: first restart after a fault, in fresh interpreters "
             "(idle 1.5-2.5 s)")
    # the worst of three idle times: the forkserver's idle-time work (imports,
    # spares) starts 1-2 s after it serves a cluster; a restart must not wait
    first_restart = max(_first_restart(n, idle, start) for idle in (1.5, 2.0, 2.5))

    with labkit.Cluster(n, start=start) as c:
        from labkit.runtime import forkserver

        # measure the steady state, not the forkserver's imports when idle
        forkserver.shared(start).wait_preloaded()
        progress(f"{calls} warm no-op calls")
        for _ in range(50):
            c.run(_noop)
        noop = []
        for _ in range(calls):
            t = time.perf_counter()
            c.run(_noop)
            noop.append(time.perf_counter() - t)
        p50, p99 = _pct(noop, 0.5), _pct(noop, 0.99)

        progress(f"restart after a fault ({RESTARTS} faults, {RESTART_GAP:g} s apart)")
        restarts = []
        for _ in range(RESTARTS):
            time.sleep(RESTART_GAP)  # a student reads the error
            try:
                c.run(_fail)
            except labkit.RankError:
                pass
            t = time.perf_counter()
            c.run(_noop)  # restarts the ranks, then runs
            restarts.append(time.perf_counter() - t)
        restart = statistics.median(restarts)

        progress("1M-float all_reduce round trips")
        c.run(_all_reduce_1m)
        ar = []
        for _ in range(30):
            t = time.perf_counter()
            c.run(_all_reduce_1m)
            ar.append(time.perf_counter() - t)
        ar50 = _pct(ar, 0.5)

        progress(f"{PRINTED_LINES:,} printed lines per rank, watched and not (x5)")
        printing = {"file": [], "live": []}
        for _ in range(5):  # alternating, so machine noise hits both alike
            for how in ("file", "live"):
                printing[how].append(_print_lines(c, live=how == "live"))
    return dict(warm=warm, cold=cold, unwarmed=unwarmed[0],
                first_restart=first_restart, restart=restart,
                p50=p50, p99=p99, ar50=ar50,
                file_s=statistics.median(printing["file"]),
                live_s=statistics.median(printing["live"]))


def cluster_rows(*, warm: tuple[float, float], cold: tuple[float, float],
                 first_restart: float, restart: float, p50: float, p99: float,
                 ar50: float, spawn: float, file_s: float, live_s: float,
                 start: str = "fork", unwarmed: float | None = None) -> list[Row]:
    """bench cluster's figures (seconds) as rows, with their targets. The start
    and restart targets are the fork start's; the portable start's are printed
    (its ranks import torch themselves: what holds is said in the README)."""
    t = TARGETS
    fast = start == "fork"
    return [
        Row(f"first start: cluster cell {NOTEBOOK_GAP:g} s after `import labkit, "
            "torch` (IPython)", warm[0], t["first start, prewarmed"] if fast else None),
        Row("  same, interpreter start to ranks ready", warm[1]),
        Row("first start: cluster cell right after `import labkit, torch`",
            cold[0], t["first start"] if fast else None),
        *([Row("  same, forkserver not prewarmed (LABKIT_PREWARM=0)", unwarmed)]
          if unwarmed is not None else []),
        Row("first restart after a fault in a fresh process (+ no-op), worst",
            first_restart, t["restart after a fault"] if fast else None),
        Row(f"restart after a fault (+ one no-op call) {RESTART_GAP:g} s after "
            "the last", restart, t["restart after a fault"] if fast else None),
        Row("warm no-op round trip, p50", p50, t["warm no-op p50"]),
        Row("warm no-op round trip, p99", p99),
        Row("1M-float all_reduce round trip, p50", ar50),
        Row("torch.multiprocessing.spawn + init_process_group, per call", spawn),
        Row("spawn per call / warm no-op p50", spawn / p50, t["spawn / no-op"],
            unit="x", at_least=True),
        Row(f"{PRINTED_LINES:,} lines per rank, printed to files only", file_s),
        Row("  same, shown live as they come", live_s),
        Row("  live / files only", live_s / file_s, t["live / file only"], unit="x"),
    ]


def _print_many(rank, world_size, lines):
    for i in range(lines):
        print(f"step {i}: nothing to report")


class _Frontend:
    """Stands in for a notebook watching a call: takes every picture it is sent."""

    def __init__(self):
        self.frames = 0

    def __call__(self, bundle, final=False):
        self.frames += 1


def _print_lines(c, live: bool) -> float:
    """Seconds for a call whose ranks print PRINTED_LINES lines each, with the
    live view on (a stand-in frontend) or off (the transcript to a null stdout)."""
    import contextlib

    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
        t = time.perf_counter()
        res = c.run(_print_many, PRINTED_LINES,
                    publish=_Frontend() if live else False)
        seconds = time.perf_counter() - t
    if any(out.count("\n") != PRINTED_LINES for out in res.outputs.values()):
        raise RuntimeError("printed lines went missing")  # all of them, in every run
    return seconds
