"""Collective bandwidth, measured as nccl-tests defines it (all numbers are timings).

For a collective on n ranks moving an array of S bytes in t seconds:
    algbw = S / t          busbw = algbw * factor(op, n)
with S and the factors of nccl-tests (doc/PERFORMANCE.md): all-reduce 2(n-1)/n;
all-gather, reduce-scatter and all-to-all (n-1)/n; broadcast and reduce 1. busbw is
comparable across ops and rank counts: it is the bandwidth each link would need.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from labkit.conventions import BUS_FACTOR

SWEEP_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all",
             "ring_all_reduce")


@dataclass(frozen=True)
class BwPoint:
    op: str
    size: int  # S in bytes
    seconds: float  # per call: the slowest rank's mean
    algbw: float  # bytes/s
    busbw: float  # bytes/s
    iters: int


def _factor(op: str, n: int) -> float:
    return BUS_FACTOR["all_reduce" if op == "ring_all_reduce" else op](n)


def time_collective(rank, world_size, op: str, size: int, *, min_seconds: float = 0.05,
                    max_iters: int = 50) -> tuple[float, int]:
    """Worker: mean seconds per call of `op` on an S-byte float32 array, and the
    number of timed calls. Runs on every rank; ranks agree on the count."""
    import torch
    import torch.distributed as dist

    from labkit.comm.collectives import ring_all_reduce

    numel = max(world_size, size // 4 // world_size * world_size)
    full = torch.ones(numel)
    shard = torch.ones(numel // world_size)

    calls = {
        "all_reduce": lambda: dist.all_reduce(full),
        "ring_all_reduce": lambda: ring_all_reduce(full),
        "all_gather": lambda: dist.all_gather_single(full, shard),
        "reduce_scatter": lambda: dist.reduce_scatter_single(shard, full),
        "broadcast": lambda: dist.broadcast(full, src=0),
        "all_to_all": lambda: dist.all_to_all_single(torch.empty_like(full), full),
    }
    if op not in calls:
        raise ValueError(f"unknown op {op!r}; one of {sorted(calls)}")
    call = calls[op]
    call()  # warm up (connections, buffers)
    dist.barrier()
    t0 = time.perf_counter()
    call()
    first = time.perf_counter() - t0
    # every rank must make the same number of calls: agree on rank 0's estimate;
    # none more where one call already took min_seconds (large arrays): it is the
    # timing, from each rank's own clock
    n = torch.tensor([min(max_iters, int(min_seconds / max(first, 1e-6)))])
    dist.broadcast(n, src=0)
    iters = int(n.item())
    if iters == 0:
        return first, 1
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    return (time.perf_counter() - t0) / iters, iters


def sweep(cluster, ops=SWEEP_OPS, sizes=None, *, progress: bool = True,
          min_seconds: float = 0.05, max_iters: int = 50) -> list[BwPoint]:
    """Time each op at each size on `cluster`'s ranks; one BwPoint per (op, size)."""
    sizes = sizes or [4**k * 1024 for k in range(9)]  # 1 KiB .. 64 MiB
    jobs = [(op, s) for op in ops for s in sizes]
    bar = _progress_bar(len(jobs), progress)
    n = cluster.world_size
    points = []
    try:
        for op, size in jobs:
            res = cluster.run(time_collective, op, size, min_seconds=min_seconds,
                              max_iters=max_iters)
            secs = max(v[0] for v in res)
            S = max(n, size // 4 // n * n) * 4
            points.append(BwPoint(op, S, secs, S / secs, S / secs * _factor(op, n),
                                  res[0][1]))
            bar.update(1)
    finally:
        bar.close()
    return points


def _progress_bar(total: int, enabled: bool):
    if enabled:
        try:
            from tqdm.auto import tqdm

            return tqdm(total=total, desc="timing collectives", leave=False)
        except ImportError:
            pass

    class _Quiet:
        def update(self, k):
            pass

        def close(self):
            pass

    return _Quiet()
