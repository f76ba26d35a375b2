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

TARGETS = {"first start": 1.5, "restart after a fault": 0.3, "warm no-op p50": 1e-3}


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


_FIRST_START = """
import json, time
t0 = time.perf_counter()
import labkit                  # a chapter's first cell: starts the rank forkserver
import torch
t1 = time.perf_counter()
c = labkit.Cluster({n})
t2 = time.perf_counter()
c.close()
print(json.dumps([t2 - t1, t2 - t0]))
"""


def _first_start(n: int, prewarm: bool) -> tuple[float, float]:
    """(Cluster(n) seconds, interpreter-to-ready seconds) in a fresh interpreter."""
    env = dict(os.environ, LABKIT_PREWARM="1" if prewarm else "0")
    out = subprocess.run([sys.executable, "-c", _FIRST_START.format(n=n)],
                         capture_output=True, text=True, env=env, timeout=300,
                         check=True)
    return tuple(json.loads(out.stdout.strip().splitlines()[-1]))


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _progress(msg: str) -> None:
    print(f"  … {msg}", file=sys.stderr, flush=True)


def bench_cluster(world_size: int = 4, calls: int = 2000) -> int:
    import torch.multiprocessing as mp

    import labkit

    n = world_size
    print(f"labkit bench cluster: {n} ranks, {os.cpu_count()} cores (all timings)")
    _progress("first start, in fresh interpreters")
    warm = sorted(_first_start(n, prewarm=True) for _ in range(3))[1]
    cold = _first_start(n, prewarm=False)

    with labkit.Cluster(n) as c:
        from labkit.runtime import forkserver

        # measure the steady state, not the forkserver's imports when idle
        forkserver.shared().wait_preloaded()
        _progress(f"{calls} warm no-op calls")
        for _ in range(50):
            c.run(_noop)
        noop = []
        for _ in range(calls):
            t = time.perf_counter()
            c.run(_noop)
            noop.append(time.perf_counter() - t)
        p50, p99 = _pct(noop, 0.5), _pct(noop, 0.99)

        _progress("restart after a fault (10 faults)")
        restarts = []
        for _ in range(10):
            try:
                c.run(_fail)
            except labkit.RankError:
                pass
            t = time.perf_counter()
            c.run(_noop)  # restarts the ranks, then runs
            restarts.append(time.perf_counter() - t)
        restart = statistics.median(restarts)

        _progress("1M-float all_reduce round trips")
        c.run(_all_reduce_1m)
        ar = []
        for _ in range(30):
            t = time.perf_counter()
            c.run(_all_reduce_1m)
            ar.append(time.perf_counter() - t)
        ar50 = _pct(ar, 0.5)

    _progress("the usual way: torch.multiprocessing.spawn per call (3 times)")
    spawn = []
    for _ in range(3):
        t = time.perf_counter()
        mp.spawn(_spawned_rank, args=(n, _free_port()), nprocs=n, join=True)
        spawn.append(time.perf_counter() - t)
    spawn_s = statistics.median(spawn)

    rows = [
        ("first start: Cluster() after `import labkit, torch` (notebook)", warm[0],
         TARGETS["first start"]),
        ("  same, interpreter start to ranks ready", warm[1], None),
        ("first start, forkserver not prewarmed (its torch import)", cold[0], None),
        ("restart after a fault (+ one no-op call)", restart,
         TARGETS["restart after a fault"]),
        ("warm no-op round trip, p50", p50, TARGETS["warm no-op p50"]),
        ("warm no-op round trip, p99", p99, None),
        ("1M-float all_reduce round trip, p50", ar50, None),
        ("torch.multiprocessing.spawn + init_process_group, per call", spawn_s, None),
    ]
    ok = True
    print(f"\n{'measure':<62}{'seconds':>12}  target")
    for name, secs, target in rows:
        mark = ""
        if target is not None:
            hit = secs <= target
            ok &= hit
            mark = f"≤ {target:g} s {'ok' if hit else 'MISSED'}"
        print(f"{name:<62}{secs:>12.6f}  {mark}")
    ratio = spawn_s / p50
    hit = ratio >= 1000
    ok &= hit
    print(f"\nspawn per call / warm no-op p50 = {ratio:,.0f}x  "
          f"(target ≥ 1000x: {'ok' if hit else 'MISSED'})")
    print("all targets met" if ok else "some targets missed")
    return 0


def bench_ring(world_size: int = 4, size: int = 16 << 20, rounds: int = 5) -> int:
    """The from-scratch ring all-reduce's busbw vs PyTorch's, same ranks, same run,
    alternating the two so that machine noise hits both alike."""
    import labkit
    from labkit.comm.bandwidth import time_collective
    from labkit.runtime import forkserver
    from labkit.theory import bus_factor

    n = world_size
    factor = bus_factor("all_reduce", n)
    print(f"labkit bench ring: {n} ranks, {size / 2**20:g} MiB all-reduce, "
          f"{rounds} rounds (all timings)")
    busbw: dict[str, list[float]] = {"all_reduce": [], "ring_all_reduce": []}
    with labkit.Cluster(n) as c:
        forkserver.shared().wait_preloaded()
        for k in range(rounds):
            _progress(f"round {k + 1} of {rounds}")
            for op in busbw:
                res = c.run(time_collective, op, size, min_seconds=0.5, max_iters=50)
                secs = max(v[0] for v in res)
                busbw[op].append(size / secs * factor)
    med = {op: statistics.median(v) for op, v in busbw.items()}
    for op, v in busbw.items():
        print(f"{op:<18} busbw median {med[op] / 1e9:.3f} GB/s  "
              f"(rounds: {', '.join(f'{x / 1e9:.3f}' for x in v)})")
    ratio = med["ring_all_reduce"] / med["all_reduce"]
    print(f"\nring / built-in busbw = {ratio:.2f}  (target ≥ 0.8: "
          f"{'ok' if ratio >= 0.8 else 'MISSED'})")
    return 0
