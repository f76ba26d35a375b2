"""Tensor parallelism (张量并行), Megatron-LM's way (Shoeybi et al. 2019, sec. 3):
each of t ranks of a group keeps 1/t of every weight matrix of a layer and computes
on the whole batch.

    fc1 = ColumnParallelLinear(h, 4*h, group)        # W split by output rows
    fc2 = RowParallelLinear(4*h, h, group)           # W split by input columns
    y = fc2(F.gelu(fc1(x)))                          # x, y: whole, on every rank

Imports labkit.parallel's models and tensor_parallel_mappings. Every rank draws the
whole layer and keeps its slice, so with one seed the t slices are one process's.
"""

from __future__ import annotations

import math
import threading
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labkit.parallel import guards
from labkit.parallel.models import (
    MLP,
    SelfAttention,
    attention,
    head_dim_of,
    merge_heads,
    split_heads,
)
from labkit.parallel.tensor_parallel_mappings import (
    copy_to_tensor_model_parallel_region,
    divide,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)

__all__ = [
    "ColumnParallelLinear", "ParallelMLP", "ParallelSelfAttention",
    "RowParallelLinear", "copy_to_tensor_model_parallel_region",
    "divide", "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region", "scatter_to_tensor_model_parallel_region",
]


def _group_of(group, who: str):
    guards.require_process_group(who)
    group = dist.group.WORLD if group is None else group
    return group, dist.get_world_size(group), dist.get_rank(group)


_COPYING = threading.local()  # .on: a from_* builds the layer, draws nothing


@contextmanager
def _copying():
    """Layers built inside take their tensors from a one-process module next."""
    was = getattr(_COPYING, "on", False)
    _COPYING.on = True
    try:
        yield
    finally:
        _COPYING.on = was


def _whole_linear(in_features: int, out_features: int, bias: bool):
    """The (weight, bias) nn.Linear(in_features, out_features) draws now from the
    global generator, as its reset_parameters does (kaiming_uniform_ with
    a=sqrt(5), then a uniform bias, bound 1/sqrt(in)); uninitialised inside
    _copying(), where nothing is drawn."""
    w = torch.empty(out_features, in_features)
    b = torch.empty(out_features) if bias else None
    if not getattr(_COPYING, "on", False):
        nn.init.kaiming_uniform_(w, a=math.sqrt(5))
        if b is not None:
            bound = 1 / math.sqrt(in_features) if in_features > 0 else 0.0
            nn.init.uniform_(b, -bound, bound)
    return w, b


def _part(t: torch.Tensor, dim: int, index: int, parts: int) -> nn.Parameter:
    """Part `index` of `parts` of t along dim, in its own contiguous storage."""
    return nn.Parameter(t.chunk(parts, dim)[index].clone(
        memory_format=torch.contiguous_format))


class ColumnParallelLinear(nn.Module):
    """Y = X Wᵀ + b with W (out, in) split by output rows: this rank keeps rows
    [r*out/t, (r+1)*out/t) of W and b. Forward: f (or, sequence_parallel, the
    all-gather of the sequence shard), then the local matmul; the output is this
    rank's slice of the features (..., out/t), or with gather_output=True the
    whole (..., out), all-gathered.

    Megatron-LM's ColumnParallelLinear (torch's DTensor counterpart:
    ColwiseParallel); unlike Megatron's, it takes its process group as an
    argument, and every rank draws the whole nn.Linear and keeps its rows (as
    Megatron with use_cpu_initialization), so one seed gives one process's layer.
    """

    def __init__(self, in_features: int, out_features: int, group=None,
                 bias: bool = True, gather_output: bool = False,
                 sequence_parallel: bool = False):
        super().__init__()
        self.group, self.tp_size, self.tp_rank = _group_of(
            group, "ColumnParallelLinear")
        if gather_output and sequence_parallel:
            raise ValueError("ColumnParallelLinear: gather_output=True and "
                             "sequence_parallel=True do not go together (the "
                             "output of a sequence-parallel pair stays split)")
        self.in_features, self.out_features = in_features, out_features
        self.out_per_rank = divide(out_features, self.tp_size, "out_features")
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        # one process's layer (the rank holds the whole weight for a moment)
        w, b = _whole_linear(in_features, out_features, bias)
        self.weight = _part(w, 0, self.tp_rank, self.tp_size)  # this rank's rows
        self.bias = None if b is None else _part(b, 0, self.tp_rank, self.tp_size)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, **kw) -> ColumnParallelLinear:
        """This rank's rows of a single-process `linear` (copied, in its dtype)."""
        with _copying():
            layer = cls(linear.in_features, linear.out_features, group,
                        bias=linear.bias is not None, **kw)
        layer = layer.to(dtype=linear.weight.dtype)
        rows = slice(layer.tp_rank * layer.out_per_rank,
                     (layer.tp_rank + 1) * layer.out_per_rank)
        with torch.no_grad():
            layer.weight.copy_(linear.weight[rows])
            if layer.bias is not None:
                layer.bias.copy_(linear.bias[rows])
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:  # (s/t, b, in) -> (s, b, in)
            x = gather_from_sequence_parallel_region(x, self.group)
        else:
            x = copy_to_tensor_model_parallel_region(x, self.group)  # f
        y = F.linear(x, self.weight, self.bias)  # (..., in) -> (..., out/t)
        if self.gather_output:
            y = gather_from_tensor_model_parallel_region(y, self.group)
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"({self.out_per_rank} on this rank of {self.tp_size}), "
                f"bias={self.bias is not None}, gather_output={self.gather_output}, "
                f"sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """Y = X Wᵀ + b with W (out, in) split by input columns: this rank keeps
    columns [r*in/t, (r+1)*in/t) of W and the whole b. Forward: the local matmul
    on this rank's slice of the input features (with input_is_parallel=False the
    whole input is sliced first), then g (or, sequence_parallel, a reduce-scatter
    to the sequence shard), then the bias, once, after the reduction. With
    sequence_parallel the bias sees a sequence shard only: its gradient must be
    all-reduced over the group (the bias carries `sequence_parallel = True`).

    Megatron-LM's RowParallelLinear (torch's DTensor counterpart:
    RowwiseParallel); unlike Megatron's, it takes its process group as an
    argument and draws the whole nn.Linear on every rank, keeping its columns.
    """

    def __init__(self, in_features: int, out_features: int, group=None,
                 bias: bool = True, input_is_parallel: bool = True,
                 sequence_parallel: bool = False):
        super().__init__()
        self.group, self.tp_size, self.tp_rank = _group_of(group, "RowParallelLinear")
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel=True needs "
                             "input_is_parallel=True (the input is already split)")
        self.in_features, self.out_features = in_features, out_features
        self.in_per_rank = divide(in_features, self.tp_size, "in_features")
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel
        w, b = _whole_linear(in_features, out_features, bias)  # one process's
        self.weight = _part(w, 1, self.tp_rank, self.tp_size)  # this rank's columns
        self.bias = None if b is None else nn.Parameter(b)  # whole
        if self.bias is not None:
            self.bias.sequence_parallel = sequence_parallel

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, **kw) -> RowParallelLinear:
        """This rank's columns of a single-process `linear`, and its whole bias
        (copied, in its dtype)."""
        with _copying():
            layer = cls(linear.in_features, linear.out_features, group,
                        bias=linear.bias is not None, **kw)
        layer = layer.to(dtype=linear.weight.dtype)
        cols = slice(layer.tp_rank * layer.in_per_rank,
                     (layer.tp_rank + 1) * layer.in_per_rank)
        with torch.no_grad():
            layer.weight.copy_(linear.weight[:, cols])
            if layer.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:  # (..., in) -> (..., in/t)
            x = scatter_to_tensor_model_parallel_region(x, self.group)
        partial = F.linear(x, self.weight)  # (..., in/t) -> (..., out), a part sum
        if self.sequence_parallel:  # (s, b, out) -> (s/t, b, out)
            y = reduce_scatter_to_sequence_parallel_region(partial, self.group)
        else:
            y = reduce_from_tensor_model_parallel_region(partial, self.group)  # g
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} ({self.in_per_rank} on this rank "
                f"of {self.tp_size}), out_features={self.out_features}, "
                f"bias={self.bias is not None}, "
                f"input_is_parallel={self.input_is_parallel}, "
                f"sequence_parallel={self.sequence_parallel}")


# -- the parallel blocks ----------------------------------------------------------


class ParallelMLP(nn.Module):
    """MLP split over the group: fc1 column-parallel, GeLU on this rank's ffn/t
    features, fc2 row-parallel. One all-reduce forward (g), one backward (f);
    with sequence_parallel an all-gather and a reduce-scatter each way instead.
    Megatron-LM's ParallelMLP, with a plain GeLU (no fused bias-GeLU, no SwiGLU).
    """

    def __init__(self, hidden: int, ffn_hidden: int, group=None,
                 sequence_parallel: bool = False):
        super().__init__()
        self.fc1 = ColumnParallelLinear(hidden, ffn_hidden, group,
                                        sequence_parallel=sequence_parallel)
        self.fc2 = RowParallelLinear(ffn_hidden, hidden, group,
                                     sequence_parallel=sequence_parallel)

    @classmethod
    def from_mlp(cls, mlp: MLP, group=None, sequence_parallel: bool = False
                 ) -> ParallelMLP:
        """This rank's part of a single-process `MLP` (or any module with Linear
        fc1 and fc2)."""
        with _copying():
            out = cls(mlp.fc1.in_features, mlp.fc1.out_features, group,
                      sequence_parallel)
        kw = {"sequence_parallel": sequence_parallel}
        out.fc1 = ColumnParallelLinear.from_linear(mlp.fc1, group, **kw)
        out.fc2 = RowParallelLinear.from_linear(mlp.fc2, group, **kw)
        return out

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))  # (.., h) -> (.., f/t) -> (.., h)


class ParallelSelfAttention(nn.Module):
    """Self-attention with its heads split over the group, [s, b, h] -> [s, b, h]
    (with sequence_parallel, [s/t, b, h] -> [s/t, b, h]). q, k and v are one
    column-parallel layer `qkv` (h -> 3h, this rank's rows: the q, then k, then v
    features of its heads), so the input passes one f; this rank computes
    attention for its heads/t heads; `proj` is row-parallel (one g).

    Megatron-LM's ParallelAttention, except that `qkv`'s rows are all q, then k,
    then v of this rank's heads (Megatron interleaves q, k, v head by head) and
    the attention is models.attention, written out, not a fused kernel.
    """

    def __init__(self, hidden: int, heads: int, group=None,
                 sequence_parallel: bool = False, causal: bool = True):
        super().__init__()
        _, tp, tp_rank = _group_of(group, "ParallelSelfAttention")
        self.head_dim = head_dim_of(hidden, heads)
        self.local_heads = divide(heads, tp, "heads")
        with _copying():
            self.qkv = ColumnParallelLinear(hidden, 3 * hidden, group,
                                            sequence_parallel=sequence_parallel)
        # one process's q, k and v (SelfAttention's, in its order): this rank's
        # heads' rows of each, one after another
        drawn = [_whole_linear(hidden, hidden, True) for _ in "qkv"]
        with torch.no_grad():
            self.qkv.weight.copy_(torch.cat([w.chunk(tp)[tp_rank] for w, _ in drawn]))
            self.qkv.bias.copy_(torch.cat([b.chunk(tp)[tp_rank] for _, b in drawn]))
        self.hidden, self.heads, self.causal = hidden, heads, causal
        self.proj = RowParallelLinear(hidden, hidden, group,
                                      sequence_parallel=sequence_parallel)

    @classmethod
    def from_attention(cls, attn: SelfAttention, group=None,
                       sequence_parallel: bool = False) -> ParallelSelfAttention:
        """This rank's heads of a single-process `SelfAttention` (in its dtype)."""
        hidden = attn.q.in_features
        with _copying():
            out = cls(hidden, hidden // attn.head_dim, group, sequence_parallel,
                      attn.causal)
        out = out.to(dtype=attn.q.weight.dtype)
        r, k = out.qkv.tp_rank, hidden // out.qkv.tp_size
        mine = slice(r * k, (r + 1) * k)  # this rank's heads' features
        with torch.no_grad():
            out.qkv.weight.copy_(torch.cat([m.weight[mine]
                                            for m in (attn.q, attn.k, attn.v)]))
            out.qkv.bias.copy_(torch.cat([m.bias[mine]
                                          for m in (attn.q, attn.k, attn.v)]))
        out.proj = RowParallelLinear.from_linear(attn.proj, group,
                                                 sequence_parallel=sequence_parallel)
        return out

    def forward(self, x):  # (s, b, h), or (s/t, b, h) with sequence_parallel
        qkv = self.qkv(x)  # (s, b, 3h/t): the whole sequence (gathered if parallel)
        q, k, v = (split_heads(t, self.head_dim)
                   for t in qkv.chunk(3, dim=-1))  # (b, n/t, s, d) each
        o = attention(q, k, v, self.causal)  # (b, n/t, s, d)
        return self.proj(merge_heads(o))  # (s, b, h/t) -> (s, b, h) or (s/t, b, h)

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden}, heads={self.heads} ({self.local_heads} on "
                f"this rank), causal={self.causal}")
