"""FullyShardedDataParallel's gradient side: a gradient, once in, is held whole
while sync is off, or reduce-scattered with its unit's.

Gradient accumulation over k micro-batches (global batch = micro-batch × k × N):
each backward reduce-scatters by default, so shard.grad sums them, holding 1/N of
the gradients (4Ψ/N) for k reduce-scatters a step. set_requires_gradient_sync(
False) (as FSDP2's; or `with fsdp.no_sync():`) keeps each unit's whole gradient
instead, summed in fp32 across backwards, and sends nothing; the next backward
with sync on (or finish) sends the sum: one reduce-scatter a step, for holding
every unit's whole gradient (4Ψ) between micro-batches, as DDP's no_sync does.
"""

from __future__ import annotations

import contextlib

import torch

from labkit.parallel import fsdp_hooks as H
from labkit.probe import count_as


class GradientAccumulation:
    """FullyShardedDataParallel's gradient side, a mixin: `_sync` (each backward
    reduce-scatters) and `_held` (whole fp32 gradients, by parameter). Uses the
    wrapper's `sharded_units`, `group`, `world_size`, `_reductions`, `_fold`,
    `_release` and compute clock (`_spans`)."""

    def _start_holding(self) -> None:
        self._sync = True  # reduce-scatter in each backward
        self._held: dict[H.Sharded, torch.Tensor] = {}  # whole fp32 gradients

    def set_requires_gradient_sync(self, requires: bool) -> None:
        """False: the next backwards keep each unit's whole gradient (fp32,
        summed across backwards) and send nothing; True (the default): each
        backward reduce-scatters, the held sums included. finish sends what is
        still held. Every rank must set the same."""
        self._sync = bool(requires)

    @contextlib.contextmanager
    def no_sync(self):
        """`with fsdp.no_sync(): loss.backward()`: that backward sends nothing."""
        before, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = before

    def _grad_ready(self, u: H.Unit, leaf) -> None:
        """A gradient of `u` is in (post-accumulate-grad): with sync off, hold it;
        once the unit has every one, send them."""
        self._spans.lap()
        u.got.add(id(leaf))
        if not self._sync:  # hold it, whole, in fp32: sent in a later backward
            p = next(p for p in u.trainable if p.leaf is leaf)
            with torch.no_grad():
                if p in self._held:
                    self._held[p].add_(leaf.grad)
                else:
                    self._held[p] = leaf.grad.to(torch.float32)
            count_as(self._held[p], "Gradient")
            leaf.grad = None
        if len(u.got) == len(u.trainable):  # every one: send them now
            self._reduce(u)
            if len(u.trainable) == len(u.params):  # no frozen one still needed
                self._release(u)  # before the reduce-scatter allocates: a lower
        self._spans.resume()  # peak

    @torch.no_grad()
    def _reduce(self, u: H.Unit, force: bool = False) -> None:
        """Reduce-scatter the gradients `u`'s parameters have, with what was held
        for them (each rank has the same ones, in the same order: see fsdp.py's
        docstring); with sync off, nothing (finish: force)."""
        u.reduced = True
        if not (self._sync or force):
            return
        for p in u.trainable:  # the held sum and this backward's, as one
            held = self._held.pop(p, None)
            if held is not None:
                if p.leaf.grad is not None:
                    held.add_(p.leaf.grad)
                p.leaf.grad = held.to(p.full.dtype)  # on the wire as forward's
        send = [p for p in u.trainable if p.leaf.grad is not None]
        if not send:
            return
        self._fold()  # at most one unit's reduce-scatter in flight
        self._reductions = H.launch_reduce(send, self.group, self.world_size,
                                           u.name)

    def _send_held(self) -> None:
        """finish: send what set_requires_gradient_sync(False) still holds."""
        for u in self.sharded_units:  # unit order: the same on every rank
            if any(p in self._held for p in u.trainable):
                self._reduce(u, force=True)
