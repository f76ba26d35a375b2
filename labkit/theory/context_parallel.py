"""Bytes a rank sends per attention layer under context parallelism, forward and
backward, for the three ways labkit.parallel runs it: ring attention, Ulysses'
all-to-alls and Llama 3's all-gather of keys and values.

s: sequence length, b: sequences per micro-batch, h: the query heads' width on
this rank (heads x head dim; / TP under tensor parallelism), cp_size (n in the
formulas): ranks in the context-parallel group, dtype_bytes: bytes per element.
Keys and values are h wide too, unless GQA gives them kv_heads of the heads:
then h * kv_heads / heads. Ring collectives throughout
(collective_cost.ring_bytes_per_rank).
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.theory._validate import check_counts
from labkit.theory.collective_cost import ring_bytes_per_rank

CP_METHODS = ("ring", "ulysses", "all-gather")


@dataclass(frozen=True)
class ContextTraffic:
    """Bytes one rank sends in one attention layer's forward and backward."""

    method: str
    forward: float
    backward: float

    @property
    def total(self) -> float:
        return self.forward + self.backward


def _kv_width(h: int, heads: int | None, kv_heads: int | None) -> float:
    if (heads is None) != (kv_heads is None):
        raise ValueError("give both heads and kv_heads (GQA), or neither")
    if heads is None:
        return h
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"kv_heads = {kv_heads} must divide heads = {heads}")
    return h * kv_heads / heads


def ring_traffic(s: int, b: int, h: int, cp_size: int, dtype_bytes: int = 2, *,
                 heads: int | None = None,
                 kv_heads: int | None = None) -> ContextTraffic:
    """labkit's ring attention (parallel.ring_attention): forward n-1 messages of
    a K and V chunk (2 b s/n kv-width elements); backward n-1 of K, V again and
    n of their gradients, which travel with them and end at home."""
    check_counts(s=s, b=b, h=h, cp_size=cp_size, dtype_bytes=dtype_bytes)
    chunk = 2 * b * s / cp_size * _kv_width(h, heads, kv_heads) * dtype_bytes
    if cp_size == 1:  # one rank: nothing travels
        return ContextTraffic("ring", 0.0, 0.0)
    return ContextTraffic("ring", (cp_size - 1) * chunk, (2 * cp_size - 1) * chunk)


def ulysses_traffic(s: int, b: int, h: int, cp_size: int, dtype_bytes: int = 2, *,
                    heads: int | None = None,
                    kv_heads: int | None = None) -> ContextTraffic:
    """DeepSpeed-Ulysses (Jacobs et al. 2023, sec. 3.2): all-to-alls of this
    rank's [s/n, b, width] tensors, each sending (n-1)/n of it. Forward q, k, v
    in and the output back; backward the output's gradient in and q's, k's,
    v's back. Per link the paper counts 4Nh/P forward (q, k, v: 3Nh, output: Nh,
    over P): a rank sends (P-1)/P of that, P-1 of the P shares. With GQA the
    kv_heads must divide among the n ranks too (fewer are replicated, which
    sends more than this counts)."""
    check_counts(s=s, b=b, h=h, cp_size=cp_size, dtype_bytes=dtype_bytes)
    kv = _kv_width(h, heads, kv_heads)
    rows = b * s / cp_size * dtype_bytes
    one_way = sum(ring_bytes_per_rank("all_to_all", rows * w, cp_size)
                  for w in (h, kv, kv, h))
    return ContextTraffic("ulysses", one_way, one_way)


def allgather_traffic(s: int, b: int, h: int, cp_size: int, dtype_bytes: int = 2, *,
                      heads: int | None = None, kv_heads: int | None = None,
                      gathers: int = 1) -> ContextTraffic:
    """Llama 3's context parallelism (Llama Team 2024, sec. 3.3.2): forward an
    all-gather of the whole sequence's K and V; backward a reduce-scatter of
    their gradients. gathers=2: gathered again for a recomputed forward (full
    recomputation), counted in backward."""
    check_counts(s=s, b=b, h=h, cp_size=cp_size, dtype_bytes=dtype_bytes,
                 gathers=gathers)
    kv = 2 * b * s * _kv_width(h, heads, kv_heads) * dtype_bytes
    gather = ring_bytes_per_rank("all_gather", kv, cp_size)
    return ContextTraffic("all-gather", gather,
                          ring_bytes_per_rank("reduce_scatter", kv, cp_size)
                          + (gathers - 1) * gather)


def context_parallel_traffic(s: int, b: int, h: int, cp_size: int,
                             dtype_bytes: int = 2, *, heads: int | None = None,
                             kv_heads: int | None = None
                             ) -> dict[str, ContextTraffic]:
    """The three side by side: {"ring": ..., "ulysses": ..., "all-gather": ...}."""
    kw = dict(heads=heads, kv_heads=kv_heads)
    return {"ring": ring_traffic(s, b, h, cp_size, dtype_bytes, **kw),
            "ulysses": ulysses_traffic(s, b, h, cp_size, dtype_bytes, **kw),
            "all-gather": allgather_traffic(s, b, h, cp_size, dtype_bytes, **kw)}
