"""3D parallelism (三维并行): data, pipeline and tensor parallelism at once, over
the rank grid of `ParallelGroups` (Narayanan et al. 2021, "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM", sec. 2 and 3).

    g = ParallelGroups.build(tp=2, pp=2, dp=2)          # 8 ranks, tp innermost
    torch.manual_seed(0); model = TinyGPT(vocab=64, seq=16, hidden=32, heads=4)
    run = ThreeD(model, g, microbatches=2)              # this rank's part of it
    opt = torch.optim.SGD(run.parameters(), lr=0.1)
    opt.zero_grad(); loss = run.step(tokens, targets); opt.step()

Each rank keeps one stage (pipeline group) of the model's layers, and of every
transformer block in it 1/tp of the attention heads and MLP columns (tensor group,
Megatron's split); embedding, LayerNorms and head stay whole on the tensor ranks
of their stage. `step` takes the global batch, keeps this rank's 1/dp of its
rows, runs the pipeline schedule over its micro-batches, then averages the
stage's gradients over the data-parallel group in one all-reduce of all of them
(flattened). Every byte so travels in exactly one of the three groups:
- tp: 2 all-reduces forward and 2 backward of b·s·h per block and micro-batch;
- pp: one activation b·s·h forward and its gradient back per micro-batch and
  stage boundary (each tensor rank sends its own copy);
- dp: one all-reduce of this rank's gradient shard, 2(dp-1)/dp of it per rank.

`TinyGPT` (models.py) is the single-process reference (an nn.Sequential:
embedding, blocks, head); `stage_layers(model, groups)` is this rank's part of any
TinyGPT, under the same names, so a test compares every weight after training
with one process. Layout: tokens (b, s) in, logits (b, s, V) out, and [s, b, h]
between the modules, so a stage boundary passes a micro-batch's [s, b/m, h]
activation (the micro-batches are cut from the tokens' rows, dim 0).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from labkit.parallel.data_parallel import pack, unpack
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
    """This rank's part of `model` under data x pipeline x tensor parallelism (see
    the module's docstring). `step(tokens, targets)` runs one training step's
    forward and backward over the global batch and leaves the averaged gradients
    in `.grad`; it returns the loss of this rank's data shard on the last stage
    (the mean over its micro-batches), None elsewhere."""

    def __init__(self, model: TinyGPT, groups, *, microbatches: int,
                 schedule: str = "1f1b", balance=None):
        super().__init__()
        if model.heads % groups.tp_size:
            raise ValueError(f"heads = {model.heads} cannot be split over tp = "
                             f"{groups.tp_size} ranks: each needs whole heads")
        self.groups = groups
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
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        flat = pack(grads)  # DataParallel's naive mode with one bucket
        dist.all_reduce(flat, group=g.dp_group)
        flat /= g.dp_size
        unpack(flat, grads)

    def extra_repr(self) -> str:
        return f"{self.groups}: {self.groups.coords()}"
