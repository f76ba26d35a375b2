"""`python -m labkit bench strategies`: labkit's data parallelism and ZeRO-1 next to
PyTorch's own on the same model, the same ranks and the same run, interleaved so
machine noise hits both alike. Step times are timings; optimizer state is bytes
(the memory ledger's holdings), not a timing."""

from __future__ import annotations

import os
import statistics

from labkit.cli.bench import Row, exit_code, table

TARGETS = {"DataParallel / DDP": 1.1,
           "ShardedOptimizer / ZeroRedundancyOptimizer": 1.2}
WIDTH, LAYERS, BATCH = 1024, 4, 16  # Ψ = 4 × (1024² + 1024) ≈ 4.2 M parameters


def _model():
    import torch

    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


def _setups():
    """name -> (make(model) -> (module, optimizer, after_backward, after_step))."""
    import torch
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    from labkit.parallel import DataParallel, ShardedOptimizer

    def labkit_dp(model):
        dp = DataParallel(model, bucket_mb=25, first_bucket_mb=1)  # DDP's defaults
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        return dp, opt, dp.finish_gradient_synchronization

    def torch_ddp(model):
        ddp = DDP(model)  # 25 MiB buckets, the first 1 MiB: as ours above
        return ddp, torch.optim.Adam(ddp.parameters(), lr=1e-3), None

    def labkit_zero1(model):  # ZeRO-1 on data parallelism, as PyTorch's below
        dp = DataParallel(model, bucket_mb=25, first_bucket_mb=1)
        opt = ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
        return dp, opt, dp.finish_gradient_synchronization

    def torch_zero1(model):
        ddp = DDP(model)
        opt = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam, lr=1e-3)
        return ddp, opt, None

    return {"DataParallel": labkit_dp, "DDP": torch_ddp,
            "ShardedOptimizer": labkit_zero1, "ZeroRedundancyOptimizer": torch_zero1}


def _time_steps(rank, world_size, name: str, steps: int) -> tuple[float, int]:
    """Median seconds per training step of `name` on this rank, and the bytes of
    optimizer state it holds after them."""
    import time

    import torch
    import torch.distributed as dist

    from labkit import ledger

    module, opt, sync = _setups()[name](_model())
    torch.manual_seed(rank)
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    times = []
    for i in range(steps + 1):  # the first step builds state and buckets: not timed
        dist.barrier()
        t = time.perf_counter()
        torch.nn.functional.mse_loss(module(x), y).backward()
        if sync is not None:
            sync()
        opt.step()
        opt.zero_grad()
        if i:
            times.append(time.perf_counter() - t)
    # ZeroRedundancyOptimizer keeps its shard's state in the optimizer it wraps
    held = ledger.holdings(module, getattr(opt, "optim", opt))
    return statistics.median(times), held.optimizer_state


def bench_strategies(world_size: int = 4, rounds: int = 5, steps: int = 10) -> int:
    import labkit

    n = world_size
    print(f"labkit bench strategies: {n} ranks, {os.cpu_count()} cores, "
          f"{LAYERS} x Linear({WIDTH}, {WIDTH}), Adam (step times are timings)")
    names = list(_setups())
    seconds = {k: [] for k in names}
    state = {}
    with labkit.Cluster(n, timeout=600) as c:
        for r in range(rounds):  # interleaved: each round runs every strategy once
            print(f"  … round {r + 1} of {rounds}", flush=True)
            for name in names:
                res = c.run(_time_steps, name, steps)
                seconds[name].append(max(s for s, _ in res))  # the slowest rank
                state[name] = [b for _, b in res]
    rows = strategy_rows({k: statistics.median(v) for k, v in seconds.items()},
                         state, n)
    print()
    print(table(rows))
    return exit_code(rows)


def strategy_rows(step_s: dict[str, float], state: dict[str, list[int]],
                  n: int) -> list[Row]:
    """Rows: each step time, the two ratios with targets, and optimizer state."""
    rows = [Row(f"{k} step, median of rounds", v) for k, v in step_s.items()]
    for ours, theirs in (("DataParallel", "DDP"),
                         ("ShardedOptimizer", "ZeroRedundancyOptimizer")):
        rows.append(Row(f"{ours} / {theirs}", step_s[ours] / step_s[theirs],
                        TARGETS[f"{ours} / {theirs}"], unit="x"))
    full = max(state["DDP"])
    for k in ("ShardedOptimizer", "ZeroRedundancyOptimizer"):
        worst = max(state[k])
        rows.append(Row(f"{k}: optimizer state, largest rank / DDP's", worst / full,
                        unit="x"))
    rows.append(Row("ShardedOptimizer: largest rank's state x N / DDP's",
                    max(state["ShardedOptimizer"]) * n / full, 1.001, unit="x"))
    return rows
