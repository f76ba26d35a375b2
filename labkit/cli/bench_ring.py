"""`python -m labkit bench ring`: chapter 02's from-scratch ring all-reduce against
PyTorch's, on the same ranks in the same run (bus bandwidth; all timings)."""

from __future__ import annotations

import statistics

from labkit.cli.bench import TARGETS, Row, exit_code, progress, table


def ring_rows(busbw_median: dict[str, float]) -> list[Row]:
    """bench ring's figures (bytes/s) as rows; the ratio has a target."""
    rows = [Row(f"{op} busbw, median", v / 1e9, unit="GB/s")
            for op, v in busbw_median.items()]
    ratio = busbw_median["ring_all_reduce"] / busbw_median["all_reduce"]
    rows.append(Row("ring / built-in busbw", ratio, TARGETS["ring / built-in"],
                    unit="", at_least=True))
    return rows


def bench_ring(world_size: int = 4, size: int = 16 << 20, rounds: int = 5) -> int:
    """The from-scratch ring all-reduce's busbw vs PyTorch's, same ranks, same run,
    alternating the two so that machine noise hits both alike."""
    import labkit
    from labkit.comm import time_collective
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
            progress(f"round {k + 1} of {rounds}")
            for op in busbw:
                res = c.run(time_collective, op, size, min_seconds=0.5, max_iters=50)
                secs = max(v[0] for v in res)
                busbw[op].append(size / secs * factor)
    for op, v in busbw.items():
        print(f"{op:<18} busbw by round: {', '.join(f'{x / 1e9:.3f}' for x in v)} GB/s")
    rows = ring_rows({op: statistics.median(v) for op, v in busbw.items()})
    print()
    print(table(rows))
    return exit_code(rows)
