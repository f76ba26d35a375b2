"""3D parallelism (三维并行): data, pipeline and tensor parallelism at once, over the
rank grid of `ParallelGroups` (Narayanan et al. 2021, "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM", sec. 2 and 3).

    g = ParallelGroups.build(tp=2, pp=2, dp=2)          # 8 ranks, tp innermost
    run = ThreeD(model, g, microbatches=2)              # this rank's part of it
    opt.zero_grad(); loss = run.step(tokens, targets); opt.step()

Imports labkit.parallel's buckets, models, pipeline_parallel and
sequence_parallel. Every byte travels in exactly one of the tp, pp and dp groups.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from labkit.parallel.buckets import Bucket
from labkit.parallel.models import TinyGPT, TransformerLayer, lm_loss
from labkit.parallel.pipeline_parallel import PipelineParallel, split_layers
from labkit.parallel.sequence_parallel import ParallelTransformerLayer

__all__ = ["ThreeD", "stage_layers"]


def stage_layers(model: TinyGPT, groups, balance=None) -> list[nn.Module]:
    """All of `model`'s modules, this rank's stage (by groups.pp_rank) made
    parallel over groups.tp_group (blocks: ParallelTransformerLayer.from_layer,
    f before each column-parallel layer, g after each row-parallel one) or copied
    (embedding, head); the other stages' modules are left as they are (the
    pipeline drops them)."""
    lo, hi = split_layers(len(model), groups.pp_size, balance)[groups.pp_rank]
    out = list(model)
    for i in range(lo, hi):
        m = model[i]
        out[i] = (ParallelTransformerLayer.from_layer(m, groups.tp_group)
                  if isinstance(m, TransformerLayer) else copy.deepcopy(m))
    return out


class ThreeD(nn.Module):
    """This rank's part of `model` under data x pipeline x tensor parallelism: one
    stage of its layers, 1/tp of each block's heads and MLP columns.
    `step(tokens, targets)` runs one training step's forward and backward over
    the global batch and leaves the averaged gradients in `.grad`; it returns
    the loss of this rank's data shard on the last stage (the mean over its
    micro-batches), None elsewhere.

    Megatron-LM's PTD-P layout; torch has no one class for it (torchtitan
    composes DeviceMesh, pipelining and parallelize_module). Data parallelism
    here is one all-reduce of the stage's gradients after the step: no overlap
    with backward, no ZeRO sharding.
    """

    def __init__(self, model: TinyGPT, groups, *, microbatches: int,
                 schedule: str = "1f1b", balance=None):
        super().__init__()
        if model.heads % groups.tp_size:
            raise ValueError(f"heads = {model.heads} cannot be split over tp = "
                             f"{groups.tp_size} ranks: each needs whole heads")
        self.groups = groups
        self._bucket: Bucket | None = None  # the gradients, sync_gradients's
        self.pipe = PipelineParallel(stage_layers(model, groups, balance),
                                     microbatches=microbatches, loss_fn=lm_loss,
                                     schedule=schedule, group=groups.pp_group,
                                     balance=balance)

    @property
    def module(self) -> nn.Sequential:
        """This stage's layers, under their names in the whole model."""
        return self.pipe.module

    def forward(self, *args, **kwargs):
        raise RuntimeError("ThreeD runs whole steps: call run.step(tokens, targets)")

    def shard(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the global batch: the dp_rank-th of dp equal parts."""
        g, m = self.groups, self.pipe.microbatches
        if batch.shape[0] % (g.dp_size * m):
            raise ValueError(f"a global batch of {batch.shape[0]} rows cannot be "
                             f"split over dp = {g.dp_size} ranks x {m} "
                             f"micro-batches: it must be a multiple of "
                             f"{g.dp_size * m}")
        return batch.tensor_split(g.dp_size)[g.dp_rank]

    def step(self, tokens: torch.Tensor, targets: torch.Tensor):
        loss = self.pipe.step(self.shard(tokens), self.shard(targets))
        self.sync_gradients()
        return loss

    def sync_gradients(self) -> None:
        """Average the stage's gradients over the data-parallel group: one
        all-reduce of all of them, flattened (one bucket)."""
        g = self.groups
        if g.dp_size == 1:
            return
        params = [p for p in self.parameters() if p.grad is not None]
        if self._bucket is None or [id(p) for p in self._bucket.params] != [
                id(p) for p in params]:  # the first step's, or other gradients
            self._bucket = Bucket(0, params, [])
        flat = self._bucket.to_send()  # DataParallel's naive mode, one bucket
        dist.all_reduce(flat, group=g.dp_group)
        flat /= g.dp_size
        self._bucket.received(flat)

    def extra_repr(self) -> str:
        return f"{self.groups}: {self.groups.coords()}"
