"""Context parallelism by all-to-all: DeepSpeed-Ulysses (Jacobs et al. 2023, sec.
3.1). An all-to-all trades each rank's s/N rows of all heads for all s rows of a/N
heads, ordinary attention runs on those, and a second all-to-all trades back.

    q, k, v = (shard_sequence(t, group) for t in (q, k, v))  # (b, a, s/N, d)
    out = ulysses_attention(q, k, v, group, causal=True)     # (b, a, s/N, d)

Imports labkit.parallel's models, reduce_scatter and allgather_attention. The heads
must divide among the ranks (N <= a); causal work needs no balancing here.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from labkit.parallel.allgather_attention import rows_of
from labkit.parallel.reduce_scatter import send_chunks
from labkit.parallel.models import attention


def _to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """(..., a, c, d) on each rank -> (..., a/N, N*c, d): my head group, every
    rank's rows (rank 0's first)."""
    n = dist.get_world_size(group)
    *lead, a, c, d = x.shape
    send = x.reshape(*lead, n, a // n, c, d).movedim(-4, 0)  # (N, ..., a/N, c, d)
    got, _ = send_chunks(send, group)  # got[j]: rank j's rows of my heads
    return got.movedim(0, -3).reshape(*lead, a // n, n * c, d)


def _to_sequence(y: torch.Tensor, group) -> torch.Tensor:
    """(..., a/N, N*c, d) -> (..., a, c, d): the inverse of _to_heads."""
    n = dist.get_world_size(group)
    *lead, g, s, d = y.shape
    send = y.reshape(*lead, g, n, s // n, d).movedim(-3, 0)  # (N, ..., a/N, c, d)
    got, _ = send_chunks(send, group)  # got[j]: head group j of my rows
    return got.movedim(0, -4).reshape(*lead, n * g, s // n, d)


class _SequenceToHeads(torch.autograd.Function):
    """Forward: all-to-all rows -> heads. Backward: all-to-all heads -> rows."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _to_sequence(grad, ctx.group), None


class _HeadsToSequence(torch.autograd.Function):
    """Forward: all-to-all heads -> rows. Backward: all-to-all rows -> heads."""

    @staticmethod
    def forward(ctx, y, group):
        ctx.group = group
        return _to_sequence(y, group)

    @staticmethod
    def backward(ctx, grad):
        return _to_heads(grad, ctx.group), None


def sequence_to_heads(x: torch.Tensor, group=None) -> torch.Tensor:
    """(..., a, s/N, d) -> (..., a/N, s, d), differentiable (one all-to-all each
    way). ValueError when the group's N ranks do not divide the a heads."""
    group = group if group is not None else dist.group.WORLD
    n = dist.get_world_size(group)
    if x.dim() < 3:
        raise ValueError(f"sequence_to_heads: x of shape {tuple(x.shape)}; "
                         "(..., a, s/N, d) expected: heads, this rank's rows, "
                         "head dim")
    a = x.shape[-3]
    if a % n:
        raise ValueError(f"{a} heads are not divisible by the {n} ranks of the "
                         f"group: Ulysses gives every rank a/N whole heads")
    return _SequenceToHeads.apply(x, group)


def heads_to_sequence(y: torch.Tensor, group=None) -> torch.Tensor:
    """(..., a/N, s, d) -> (..., a, s/N, d), differentiable: sequence_to_heads'
    inverse. ValueError when the group's N ranks do not divide the s rows."""
    group = group if group is not None else dist.group.WORLD
    n = dist.get_world_size(group)
    if y.dim() < 3:
        raise ValueError(f"heads_to_sequence: y of shape {tuple(y.shape)}; "
                         "(..., a/N, s, d) expected: this rank's heads, the whole "
                         "sequence, head dim")
    s = y.shape[-2]
    if s % n:
        raise ValueError(f"sequence length {s} is not divisible by the {n} ranks "
                         f"of the group: Ulysses gives every rank s/N rows back, "
                         f"so N must divide s (pad the sequence to a multiple of "
                         f"{n})")
    return _HeadsToSequence.apply(y, group)


def ulysses_attention(q, k, v, group=None, causal: bool = False,
                      scale: float | None = None, balanced: bool = False):
    """Attention of this rank's rows over the whole sequence, by trading rows for
    heads and back.

    q, k, v: (..., a, c, d), c = s/N rows on every rank: chunk r of N
    (shard_sequence) or, with balanced, chunks r and 2N-1-r of 2N
    (shard_balanced). Returns (..., a, c, d), this rank's rows of
    softmax(q k^T * scale [+ causal mask]) v. ValueError when N does not divide
    the a heads."""
    if not (q.shape == k.shape == v.shape) or q.dim() < 3:
        raise ValueError(f"q, k and v must have one shape (..., a, s/N, d), got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    group = group if group is not None else dist.group.WORLD
    n = dist.get_world_size(group)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    qh, kh, vh = (sequence_to_heads(t, group) for t in (q, k, v))  # (.., a/N, s, d)
    # balanced (Llama 3's shards): sort the rows into sequence order for the mask
    if balanced:  # gathered rows are rank 0's two chunks, rank 1's, ...
        s = qh.shape[-2]
        held = torch.cat([rows_of(s, n, j, True) for j in range(n)]).to(qh.device)
        order = torch.argsort(held)  # sequence position -> gathered row
        qh, kh, vh = (t.index_select(-2, order) for t in (qh, kh, vh))
    out = attention(qh, kh, vh, causal=causal, scale=scale)  # (..., a/N, s, d)
    if balanced:
        out = out.index_select(-2, held)  # back to the gathered order
    return heads_to_sequence(out, group)  # (..., a, s/N, d)
