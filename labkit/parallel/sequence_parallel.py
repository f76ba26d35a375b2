"""Sequence parallelism (序列并行), Megatron-LM's way (Korthikanti et al. 2022,
sec. 4.2.2): the LayerNorms, dropouts and residual adds that tensor parallelism
leaves replicated run on sequence shards [s/t, b, h]; an all-gather and a
reduce-scatter replace each of tensor parallelism's all-reduces, for the same bytes.

    sp = ParallelTransformerLayer.from_layer(ref, group, sequence_parallel=True)
    y = sp(x_shard)                                     # [s/t, b, h] -> [s/t, b, h]
    y.backward(dy); sync_sequence_parallel_grads(sp, group)   # LayerNorm grads

Imports labkit.parallel's models, tensor_parallel and tensor_parallel_mappings.
"""

from __future__ import annotations


import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labkit.parallel.models import TransformerLayer, check_recompute, split_heads
from labkit.parallel.tensor_parallel import ParallelMLP, ParallelSelfAttention
from labkit.parallel.tensor_parallel_mappings import (
    all_gather_first,
    reduce_scatter_first,
)


class _GatherLinear(torch.autograd.Function):
    """y = all_gather_seq(x) Wᵀ + b, saving only the shard x: backward all-gathers
    it again (Megatron-LM's LinearWithGradAccumulationAndAsyncCommunication)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        return F.linear(all_gather_first(x, group), weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        total = all_gather_first(x, ctx.group)  # (s, b, in), again
        dx = reduce_scatter_first(dy.matmul(weight), ctx.group)  # (s/t, b, in)
        dy2 = dy.reshape(-1, dy.shape[-1])
        dw = dy2.t().matmul(total.reshape(-1, total.shape[-1]))
        db = dy2.sum(0) if ctx.has_bias else None
        return dx, dw, db, None


class ParallelTransformerLayer(TransformerLayer):
    """`TransformerLayer` over the ranks of `group`: heads and the MLP's hidden
    features split by tensor parallelism (tensor_parallel's ParallelSelfAttention
    and ParallelMLP), and with sequence_parallel=True the LayerNorms, dropouts and
    residual adds on sequence shards: [s/t, b, h] -> [s/t, b, h]. Without it,
    [s, b, h] -> [s, b, h], replicated on every rank.

    Megatron-LM's transformer layer with tensor and sequence parallelism (torch's
    own route is DTensor: ColwiseParallel, RowwiseParallel, SequenceParallel);
    unlike Megatron, the LayerNorm gradients are summed by an explicit
    sync_sequence_parallel_grads(). Dropout draws from each rank's own
    generator: without sequence parallelism it acts on replicated tensors, so
    seed every rank alike.
    """

    def __init__(self, hidden: int, heads: int, group=None,
                 ffn_hidden: int | None = None, dropout: float = 0.0,
                 causal: bool = True, sequence_parallel: bool = False,
                 recompute: str = "none", regather: bool = True):
        nn.Module.__init__(self)
        self.group = dist.group.WORLD if group is None else group
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        for p in [*self.ln1.parameters(), *self.ln2.parameters()]:
            p.sequence_parallel = sequence_parallel  # grads: part sums under SP
        self.attn = ParallelSelfAttention(hidden, heads, self.group,
                                          sequence_parallel, causal)
        self.mlp = ParallelMLP(hidden, ffn_hidden or 4 * hidden, self.group,
                               sequence_parallel)
        self.p, self.causal = dropout, causal
        self.sequence_parallel, self.regather = sequence_parallel, regather
        self.recompute = check_recompute(recompute)

    @classmethod
    def from_layer(cls, layer: TransformerLayer, group=None, *,
                   sequence_parallel: bool = False, recompute: str | None = None,
                   regather: bool = True) -> ParallelTransformerLayer:
        """This rank's part of a single-process `layer` (copied): its heads, its
        slice of the MLP, the whole LayerNorms."""
        h, a = layer.attn.q.in_features, layer.attn.heads
        out = cls(h, a, group, layer.mlp.fc1.out_features, layer.p, layer.causal,
                  sequence_parallel, recompute or layer.recompute,
                  regather).to(next(layer.parameters()).dtype)  # before the copies
        out.attn = ParallelSelfAttention.from_attention(layer.attn, out.group,
                                                        sequence_parallel)
        out.mlp = ParallelMLP.from_mlp(layer.mlp, out.group, sequence_parallel)
        with torch.no_grad():
            for mine, theirs in ((out.ln1, layer.ln1), (out.ln2, layer.ln2)):
                mine.weight.copy_(theirs.weight)
                mine.bias.copy_(theirs.bias)
        return out

    def _column(self, linear: nn.Module, x):
        # Megatron's: save the shard (2sbh/t), all-gather it again in backward;
        # regather=False keeps the gathered input, as tensor parallelism does
        if self.sequence_parallel and self.regather:  # keep the shard, not (s, b, h)
            return _GatherLinear.apply(x, linear.weight, linear.bias, self.group)
        return linear(x)

    def _qkv(self, x):  # (s/t or s, b, h) -> three (b, n/t, s, d)
        qkv = self._column(self.attn.qkv, x)  # (s, b, 3h/t)
        return [split_heads(t, self.attn.head_dim) for t in qkv.chunk(3, dim=-1)]


def sequence_parallel_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters that see only a sequence shard: marked `sequence_parallel`."""
    return [p for p in module.parameters() if getattr(p, "sequence_parallel", False)]


@torch.no_grad()
def sync_sequence_parallel_grads(module: nn.Module, group=None) -> int:
    """Sum the gradients of the sequence-parallel parameters (LayerNorms, row-
    parallel biases) over `group`, in one all-reduce; returns the elements summed.
    Call it after backward, before the optimizer steps (Megatron-LM does this in
    finalize_model_grads)."""
    grads = [p.grad for p in sequence_parallel_parameters(module)
             if p.grad is not None]
    if not grads or dist.get_world_size(group) == 1:
        return 0
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))
    return flat.numel()
