"""`python -m labkit bench pipeline`: one 1F1B training step of labkit's
PipelineParallel next to PyTorch's own (torch.distributed.pipelining: PipelineStage
and Schedule1F1B) on the same stages, the same micro-batches, the same ranks and
the same run, interleaved round by round so machine noise hits both alike. Every
number here is a timing."""

from __future__ import annotations

import os

from labkit.cli.bench import Row, interleaved_medians, median_step

TARGET = 1.2  # labkit's step / PyTorch's, at most
NAMES = ("PipelineParallel 1F1B", "torch Schedule1F1B")
WIDTH, HIDDEN, BLOCKS, BATCH, MICRO = 512, 2048, 4, 64, 4


def _model():
    import torch

    torch.manual_seed(0)
    layers = []
    for _ in range(BLOCKS):  # an MLP block: out to 4x, back; 3 layers each
        layers += [torch.nn.Linear(WIDTH, HIDDEN), torch.nn.ReLU(),
                   torch.nn.Linear(HIDDEN, WIDTH)]
    return torch.nn.Sequential(*layers)


def _time_steps(rank, world_size, name: str, steps: int) -> float:
    """Median seconds of one training step (pipeline forward and backward, SGD
    step) on this rank; the first step (shapes, buffers) is not timed."""

    import torch
    import torch.nn.functional as F

    from labkit.parallel import PipelineParallel, split_layers

    g = torch.Generator().manual_seed(1)
    x, y = (torch.randn(BATCH, WIDTH, generator=g) for _ in range(2))
    if name == NAMES[0]:
        pipe = PipelineParallel(_model(), microbatches=MICRO, loss_fn=F.mse_loss)
        params, run = pipe.parameters(), lambda: pipe.step(x, y)
    else:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        lo, hi = split_layers(3 * BLOCKS, world_size)[rank]
        stage = PipelineStage(_model()[lo:hi], rank, world_size, torch.device("cpu"))
        sched = Schedule1F1B(stage, MICRO, loss_fn=F.mse_loss)
        last = rank == world_size - 1
        params = stage.submod.parameters()

        def run():
            if rank == 0:
                sched.step(x)
            elif last:
                sched.step(target=y, losses=[])
            else:
                sched.step()
    opt = torch.optim.SGD(params, lr=1e-3)

    def step():
        run()
        opt.step()
        opt.zero_grad()

    return median_step(step, steps)


def bench_pipeline(world_size: int = 2, rounds: int = 5, steps: int = 10) -> list[Row]:
    """Rows: each implementation's step (median over rounds of the slowest rank's
    median step) and labkit's over PyTorch's, with its target."""
    print(f"labkit bench pipeline: {world_size} stages, {os.cpu_count()} cores, "
          f"{BLOCKS} x MLP({WIDTH} -> {HIDDEN} -> {WIDTH}), batch {BATCH} in "
          f"{MICRO} micro-batches, 1F1B (step times are timings)")
    return pipeline_rows(interleaved_medians(world_size, _time_steps, NAMES, rounds,
                                             steps))


def pipeline_rows(step_s: dict[str, float]) -> list[Row]:
    """Each step time, and labkit's over PyTorch's with its target."""
    rows = [Row(f"{k} step, median of rounds", v) for k, v in step_s.items()]
    rows.append(Row("1F1B pipeline / torch Schedule1F1B", step_s[NAMES[0]] /
                    step_s[NAMES[1]], TARGET, unit="x"))
    return rows
