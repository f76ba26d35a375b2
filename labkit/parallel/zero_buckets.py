"""ZeRO's collectives (zero.py's helpers): the gradient reduce-scatter, bucket by
bucket (the buckets, the reduce-scatter itself, and stage 2's hooks that run it
during backward), and the all-gather of the updated parameters.

Reduce-scatter is reduce_scatter.py's all-to-all and local sum, which takes the
uneven splits of a bucket that straddles two ranks' slices.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from labkit.parallel.buckets import fill
from labkit.parallel.reduce_scatter import send_chunks, sum_chunks


@dataclass(eq=False)
class Bucket:
    """A range of a group's flat buffer, whole parameters (+ padding): the
    gradients reduce-scattered together, through one temporary buffer of the
    bucket's size (the gradients are freed after it, as DeepSpeed's ZeRO-2 frees
    them after its bucket: views into a persistent buffer would keep them all)."""

    start: int
    end: int
    params: list
    ready: int = 0  # parameters whose gradient has arrived in this backward


def make_buckets(params: list, offset: dict, end: int, cap: int) -> list[Bucket]:
    """Whole parameters, at least `cap` elements a bucket (buckets.fill's rule),
    last first (backward's order). The last bucket runs to `end`, padding
    included, so that every rank sends (N-1)*s elements."""
    out = []
    for members in fill(params[::-1], cap, size=lambda p: p.numel()):
        out.append(Bucket(offset[members[-1]], end, members))
        end = offset[members[-1]]
    return out


def reduce_scatter(buf: torch.Tensor, start: int, s: int, out: torch.Tensor,
                   group=None) -> None:
    """Average `buf`, the flat range [start, start + len) of every rank's
    gradients, over ranks; add the part in this rank's range [r*s, (r+1)*s) into
    `out` (s,). In N pieces, so that no rank receives more than about len(buf):
    the owner of a piece gets it from all N ranks before it sums them."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    step = math.ceil(len(buf) / n)
    for c0 in range(start, start + len(buf), step):
        c1 = min(c0 + step, start + len(buf))
        # how much of [c0, c1) falls in each rank's range [q*s, (q+1)*s)
        split = [max(0, min(c1, (q + 1) * s) - max(c0, q * s)) for q in range(n)]
        mine = split[r]
        # the receive buffer is the ZeRO paper's temporary buffer: Temp
        got, _ = send_chunks(buf[c0 - start:c1 - start], group, splits=split,
                             receive=mine, category="Temp")
        if mine:
            at = max(c0, r * s) - r * s
            out[at:at + mine].add_(sum_chunks(got, n, average=True))  # op=AVG
        del got  # before the next piece's buffer exists


GATHERS = ("all_gather", "broadcast")


def gather_slices(flat: torch.Tensor, s: int, how: str, group=None) -> None:
    """In place, every rank's slice flat[q*s:(q+1)*s] from rank q, on every rank:
    one all-gather, or (how="broadcast") N broadcasts, one from each slice's owner,
    all in flight at once, as ZeroRedundancyOptimizer does. Each rank sends its
    slice to the N-1 others either way, (N-1)*s elements; gloo's all-gather is a
    ring whose N-1 steps follow one another, the broadcasts run side by side."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    if how == "all_gather":  # the input is this rank's part of the output
        dist.all_gather_single(flat, flat[r * s:(r + 1) * s], group=group)
        return
    works = [dist.broadcast(flat[q * s:(q + 1) * s], group_src=q, group=group,
                            async_op=True) for q in range(n)]
    for w in works:
        w.wait()


class BucketHooks:
    """Stage 2: call `reduce(key, bucket, keep)` as soon as a bucket's gradients are
    all in; it frees them, all but `keep`'s, which is freed at the next hook (its
    own later hooks, a memory tracker's, may still read its .grad). At the end of
    backward, a bucket only partly in (a parameter unused in this forward) is
    reduced anyway, in the same order on every rank."""

    def __init__(self, reduce):
        self._reduce, self._all, self._handles = reduce, [], []
        self._to_free, self._in_backward = [], False

    def add(self, key, buckets: list[Bucket]) -> None:
        me = weakref.ref(self)  # hooks of a dropped optimizer do nothing
        for b in buckets:
            self._all.append((key, b))
            for p in b.params:
                def ready(p, key=key, b=b):
                    hooks = me()
                    if hooks is not None:
                        hooks._on_grad(p, key, b)
                self._handles.append(p.register_post_accumulate_grad_hook(ready))

    @torch.no_grad()
    def _on_grad(self, p, key, b: Bucket) -> None:
        self._free()
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end)
        b.ready += 1
        if b.ready == len(b.params):
            b.ready = 0
            self._reduce(key, b, p)
            self._to_free.append(p)

    @torch.no_grad()
    def _end(self) -> None:
        for key, b in self._all:
            if b.ready:
                b.ready = 0
                self._reduce(key, b, None)
        self._free()
        self._in_backward = False

    def _free(self) -> None:
        for p in self._to_free:
            p.grad = None
        self._to_free = []

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
