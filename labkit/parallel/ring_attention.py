"""Context parallelism (上下文并行) by ring attention (Liu et al. 2023, "Ring
Attention with Blockwise Transformers for Near-Infinite Context"): rank r holds
chunk r of the sequence, and the key/value chunks travel once around the ring while
every rank attends its queries to each one as it passes.

    q, k, v = (shard_sequence(t, group, dim=-2) for t in (q, k, v))  # (b, a, s/N, d)
    out = ring_attention(q, k, v, group, causal=True)  # this chunk's output rows

Imports labkit.arguments and labkit.parallel.models (its reference). The softmax of
a row is assembled online from each block's `Partial` (max, sum, accumulator).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from labkit.arguments import whole
from labkit.parallel.models import attention  # the oracle: one process, every score

__all__ = ["Partial", "RingBlock", "attention", "block_partial", "merge_partials",
           "ring_attention", "ring_schedule", "shard_sequence"]


class Partial(NamedTuple):
    """Attention of some query rows over some of the keys, not yet normalized.

    acc (..., c, d): sum_j exp(s_ij - m_i) v_j; m (..., c): the row's max score
    so far; l (..., c): sum_j exp(s_ij - m_i). The attention output is acc / l."""

    acc: torch.Tensor
    m: torch.Tensor
    l: torch.Tensor  # noqa: E741


def merge_partials(a: Partial, b: Partial) -> Partial:
    """Two partials over disjoint keys -> the partial over both: rescale each to
    the larger max, then add (online softmax)."""
    m = torch.maximum(a.m, b.m)
    wa, wb = torch.exp(a.m - m), torch.exp(b.m - m)
    return Partial(a.acc * wa[..., None] + b.acc * wb[..., None], m,
                   a.l * wa + b.l * wb)


def block_partial(q, k, v, scale: float, diagonal: bool = False) -> Partial:
    """The partial of queries q (..., c, d) over keys k and values v (..., c', d).
    diagonal=True masks keys after each query (a causal block of the same chunk)."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale  # (..., c, c')
    if diagonal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    m = s.amax(dim=-1)
    p = torch.exp(s - m[..., None])
    return Partial(torch.matmul(p, v), m, p.sum(dim=-1))


# -- the ring ---------------------------------------------------------------------


@dataclass(frozen=True)
class RingBlock:
    """What one rank does at one step: the chunk of keys it holds and whether it
    attends to it ("full", "diagonal": causal mask inside, "skipped")."""

    step: int
    rank: int
    chunk: int
    kind: str


def ring_schedule(n: int, causal: bool = False) -> list[RingBlock]:
    """Every (step, rank) of ring attention on n ranks: rank r holds key chunk
    (r - step) mod n at step `step`."""
    whole(n, "a ring's number of ranks n")
    out = []
    for step in range(n):
        for r in range(n):
            j = (r - step) % n
            kind = ("full" if not causal or j < r else "diagonal" if j == r
                    else "skipped")
            out.append(RingBlock(step, r, j, kind))
    return out


def shard_sequence(x: torch.Tensor, group=None, dim: int = -2) -> torch.Tensor:
    """This rank's contiguous chunk of `x` along `dim` (a copy): rank r of N gets
    rows [r*s/N, (r+1)*s/N). Raises ValueError when N does not divide s."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    s = x.shape[dim]
    if s % n:
        raise ValueError(f"sequence length {s} is not divisible by {n} ranks: "
                         f"every rank needs a chunk of the same length")
    return x.narrow(dim, r * (s // n), s // n).clone()


def _exchange(t: torch.Tensor, group, n: int, r: int):
    """Send t to the right neighbour, receive the left's into a new buffer; the
    requests are in flight when this returns (wait, then read the buffer)."""
    got = torch.empty_like(t)
    return got, [dist.isend(t, group=group, group_dst=(r + 1) % n),
                 dist.irecv(got, group=group, group_src=(r - 1) % n)]


def _wait(reqs) -> None:
    for req in reqs:
        req.wait()


class _RingAttention(torch.autograd.Function):
    """Forward: the K/V chunks go round once, each block's Partial merged in.
    Backward: they go round again, each block's scores recomputed from q, k and
    the saved log-sum-exp (FlashAttention's backward), and each chunk's dK, dV
    travel with it, home after N moves."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, merge_fn):
        n, r = dist.get_world_size(group), dist.get_rank(group)
        kv = torch.stack([k, v])  # one message per step: (2, ..., c, d)
        state = None
        for step in range(n):
            j = (r - step) % n  # the chunk held now
            if step < n - 1:  # the next chunk is on its way while this one computes
                nxt, reqs = _exchange(kv, group, n, r)
            if not causal or j <= r:
                part = block_partial(q, kv[0], kv[1], scale, causal and j == r)
                state = part if state is None else merge_fn(state, part)
            if step < n - 1:
                _wait(reqs)
                kv = nxt
        out = state.acc / state.l[..., None]
        lse = state.m + torch.log(state.l)  # (..., c): all the backward needs
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.scale = group, causal, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, scale = ctx.group, ctx.causal, ctx.scale
        n, r = dist.get_world_size(group), dist.get_rank(group)
        dout = dout.contiguous()
        delta = (dout * out).sum(-1, keepdim=True)  # (..., c, 1): rowsum(dO * O)
        dq = torch.zeros_like(q)
        kv = torch.stack([k, v])
        dkv = torch.zeros_like(kv)  # the gradient of the chunk held, so far
        for step in range(n):
            j = (r - step) % n
            if step < n - 1:
                nxt, reqs = _exchange(kv, group, n, r)
            if not causal or j <= r:
                kj, vj = kv[0], kv[1]
                s = torch.matmul(q, kj.transpose(-1, -2)) * scale
                if causal and j == r:
                    keep = torch.ones(s.shape[-2:], dtype=torch.bool).tril()
                    s = s.masked_fill(~keep, float("-inf"))
                p = torch.exp(s - lse[..., None])  # the softmax, recomputed
                dp = torch.matmul(dout, vj.transpose(-1, -2))
                ds = p * (dp - delta) * scale
                dq += torch.matmul(ds, kj)
                dkv[0] += torch.matmul(ds.transpose(-1, -2), q)
                dkv[1] += torch.matmul(p.transpose(-1, -2), dout)
            if step < n - 1:
                _wait(reqs)
                kv = nxt
            # the chunk's gradient moves on with the chunk; after n moves, home
            got, reqs = _exchange(dkv, group, n, r)
            _wait(reqs)
            dkv = got
        return dq, dkv[0], dkv[1], None, None, None, None


def ring_attention(q, k, v, group=None, causal: bool = False,
                   scale: float | None = None, merge_fn=merge_partials):
    """Attention of this rank's query chunk over the whole sequence, whose key and
    value chunks are spread over the ranks of `group` in rank order.

    q, k, v: (..., s/N, d), the same shape on every rank; returns (..., s/N, d),
    this chunk's rows of softmax(q k^T * scale [+ causal mask]) v. Differentiable:
    gradients reach q, k and v of this rank's chunk. `merge_fn` combines two
    Partials (the online softmax; a chapter's exercise plugs its own in)."""
    if not (q.shape == k.shape == v.shape) or q.dim() < 2:
        raise ValueError(f"q, k and v must have one shape (..., s/N, d), got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    group = group if group is not None else dist.group.WORLD
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _RingAttention.apply(q, k, v, group, causal, scale, merge_fn)
