"""Context parallelism (上下文并行) by all-gathering keys and values, as Llama 3
trained at 128K tokens (Llama Team 2024, sec. 3.3.2): every rank all-gathers the
whole sequence's keys and values and attends its own query rows to all of them.

    q, k, v = (shard_balanced(t, group) for t in (q, k, v))  # (b, a, s/N, d)
    out = allgather_attention(q, k, v, group, causal=True)  # this rank's rows

Imports labkit.parallel's models and reduce_scatter. The mask is built from each
row's position in the sequence, so Llama 3's balanced layout (chunks r and 2N-1-r
of 2N) and ring attention's contiguous one are the same code.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from labkit.parallel.models import attention
from labkit.parallel.reduce_scatter import send_chunks, sum_chunks


def balanced_rows(s: int, n: int, r: int) -> torch.Tensor:
    """The positions of the rows rank r of n holds in Llama 3's layout: chunk r,
    then chunk 2n-1-r, of 2n chunks of s/(2n) rows. ValueError if 2n does not
    divide s."""
    if s % (2 * n):
        raise ValueError(f"sequence length {s} is not divisible by 2 x {n} ranks "
                         f"= {2 * n} chunks: every rank needs two equal chunks")
    c = s // (2 * n)
    return torch.cat([torch.arange(r * c, (r + 1) * c),
                      torch.arange((2 * n - 1 - r) * c, (2 * n - r) * c)])


def contiguous_rows(s: int, n: int, r: int) -> torch.Tensor:
    """The positions of the rows rank r holds in ring_attention's layout."""
    if s % n:
        raise ValueError(f"sequence length {s} is not divisible by {n} ranks: "
                         f"every rank needs a chunk of the same length")
    return torch.arange(r * (s // n), (r + 1) * (s // n))


def rows_of(s: int, n: int, r: int, balanced: bool) -> torch.Tensor:
    return balanced_rows(s, n, r) if balanced else contiguous_rows(s, n, r)


def shard_balanced(x: torch.Tensor, group=None, dim: int = -2) -> torch.Tensor:
    """This rank's rows of `x` along `dim` in Llama 3's layout (a copy):
    chunks r and 2N-1-r of 2N."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    return x.index_select(dim, balanced_rows(x.shape[dim], n, r).to(x.device))


def causal_work(s: int, n: int, balanced: bool = True) -> list[int]:
    """Query-key pairs each of n ranks scores under a causal mask: a row at
    position p attends to p + 1 keys. Contiguous chunks: the last rank does
    2n - 1 times the first's; balanced: all the same."""
    return [int((rows_of(s, n, r, balanced) + 1).sum()) for r in range(n)]


# -- the collectives, as autograd functions ---------------------------------------


class _GatherRows(torch.autograd.Function):
    """All-gather forward, reduce-scatter backward: (m, ...) on each rank ->
    (N, m, ...), rank j's tensor at [j]."""

    @staticmethod
    def forward(ctx, x, group):
        n = dist.get_world_size(group)
        ctx.group, ctx.n = group, n
        out = x.new_empty(n * x.numel())
        dist.all_gather_single(out, x.contiguous().view(-1), group=group)
        return out.view(n, *x.shape)  # (N, m, ...)

    @staticmethod
    def backward(ctx, grad):  # (N, m, ...): this rank's share of every rank's rows
        n, shape = ctx.n, grad.shape[1:]
        # row block j goes to rank j; each rank adds the N shares of its own rows
        # (reduce_scatter.py's all-to-all: the traffic ledger lists it as all_to_all)
        got, _ = send_chunks(grad.reshape(n * shape[0], *shape[1:]), ctx.group)
        return sum_chunks(got, n), None  # (m, ...)


def attention_at(q, k, v, q_pos, k_pos, causal: bool, scale: float):
    """softmax(q k^T * scale) v where a query at position q_pos[i] sees the keys
    at k_pos[j] <= q_pos[i] (causal) or all of them: (..., c, d), (..., s, d)."""
    return attention(q, k, v, causal=causal, scale=scale,
                     positions=(q_pos, k_pos))  # (..., c, d)


def allgather_attention(q, k, v, group=None, causal: bool = False,
                        scale: float | None = None, balanced: bool = True):
    """Attention of this rank's query rows over the whole sequence, whose key
    and value rows are spread over the ranks of `group`.

    q, k, v: (..., c, d), c = s/N rows on every rank: chunks r and 2N-1-r of 2N
    (balanced, Llama 3's layout: shard_balanced) or chunk r of N (ring
    attention's: shard_sequence). Returns (..., c, d), this rank's rows of
    softmax(q k^T * scale [+ causal mask]) v. Differentiable: the gradients of
    k and v are reduce-scattered back to the ranks that hold those rows."""
    if not (q.shape == k.shape == v.shape) or q.dim() < 2:
        raise ValueError(f"q, k and v must have one shape (..., s/N, d), got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    group = group if group is not None else dist.group.WORLD
    n, r = dist.get_world_size(group), dist.get_rank(group)
    s = n * q.shape[-2]
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    # the whole sequence's K and V stay held for backward (GQA keeps them small)
    every = _GatherRows.apply(torch.stack([k, v]), group)  # (N, 2, ..., c, d)
    kv = every.movedim(0, -3).flatten(-3, -2)  # (2, ..., s, d): rank 0's rows first
    k_pos = torch.cat([rows_of(s, n, j, balanced) for j in range(n)])  # (s,)
    return attention_at(q, kv[0], kv[1], rows_of(s, n, r, balanced), k_pos,
                         causal, scale)
