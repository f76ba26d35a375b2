"""`python -m labkit bench model-parallel`, tensor parallelism: one training step
(forward, backward, SGD) of labkit's ParallelMLP next to the same MLP split by
PyTorch's DTensor (ColwiseParallel on fc1, RowwiseParallel on fc2), on the same
ranks, the same sizes and the same run, interleaved (in alternating order) so
machine noise hits both alike. Step times are timings; the ratio's target is a
ceiling."""

from __future__ import annotations

import os

from labkit.cli.bench import Row, interleaved_medians, median_step

TARGET = 1.2  # ParallelMLP / DTensor MLP, step time
HIDDEN, FFN, SEQ, BATCH = 1024, 4096, 64, 4  # 8.4 M parameters; x is (64, 4, 1024)
NAMES = ("ParallelMLP", "DTensor MLP")
_MESH = {}  # per rank process: the DTensor mesh, built once


def _model(name: str):
    import torch
    import torch.distributed as dist

    from labkit.parallel import MLP, ParallelMLP

    torch.manual_seed(0)
    ref = MLP(HIDDEN, FFN)
    if name == "ParallelMLP":
        return ParallelMLP.from_mlp(ref)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    if "mesh" not in _MESH:
        _MESH["mesh"] = init_device_mesh("cpu", (dist.get_world_size(),))
    return parallelize_module(ref, _MESH["mesh"], {"fc1": ColwiseParallel(),
                                                  "fc2": RowwiseParallel()})


def _time_steps(rank, world_size, name: str, steps: int) -> float:
    """Median seconds of one training step of `name` on this rank."""
    import torch

    model = _model(name)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)  # the same batch on every rank
    x, y = (torch.randn(SEQ, BATCH, HIDDEN, generator=g) for _ in range(2))

    def step():
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    return median_step(step, steps)


def bench_tensor_parallel(world_size: int = 2, rounds: int = 5, steps: int = 10
                          ) -> list[Row]:
    """Rows: each MLP's step time (median over rounds of the slowest rank's
    median), and their ratio with its target (≤ 1.2)."""
    print(f"labkit bench tensor parallel: {world_size} ranks, {os.cpu_count()} "
          f"cores, MLP {HIDDEN} -> {FFN} -> {HIDDEN} on x ({SEQ}, {BATCH}, "
          f"{HIDDEN}), SGD (step times are timings)")
    return tensor_parallel_rows(interleaved_medians(world_size, _time_steps, NAMES,
                                                    rounds, steps))


def tensor_parallel_rows(step_s: dict[str, float]) -> list[Row]:
    rows = [Row(f"{k} step, median of rounds", step_s[k]) for k in NAMES]
    ours, theirs = NAMES
    rows.append(Row(f"{ours} / {theirs}", step_s[ours] / step_s[theirs], TARGET,
                    unit="x"))
    return rows
