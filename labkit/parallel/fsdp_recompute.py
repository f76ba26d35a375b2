"""FullyShardedDataParallel's unit forward hooks, which tell a forward from a
recompute, and the start of backward.

Activation checkpointing (torch.utils.checkpoint, reentrant or not, or
labkit.parallel.checkpointing): a forward that runs inside a backward
(`torch._C._current_graph_task_id() != -1`) is a recompute. A unit's backward
puts its gathered weights into the module, so a recompute of its body (module
hooks outside the checkpoint) computes with them. A unit whose hooks run inside
the recompute (the checkpoint wraps its call, or a module holding several units)
is gathered by the recompute as forward gathers it, and stays gathered until its
backward is over: its backward follows (no second all-gather). A reentrant
checkpoint's inner backward (a new graph task inside ours) is part of the step's
backward. Peak: the shards, the root (whole through forward, and again through
backward), the unit computing and the one prefetched; with units inside a
checkpointed module, all of that module's units, from its recompute until each
one's backward is over.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves

from labkit.parallel import fsdp_hooks as H
from labkit.probe import in_backward


class RecomputeAware:
    """FullyShardedDataParallel's unit forward hooks (a forward or a recompute)
    and the start and end of a backward (its graph tasks), a mixin. Uses the
    wrapper's compute clock (`_spans`), `_gather`, `_release`,
    `_prefetch`, `_reduce`, `_hook`, and its `_order`, `_stack`, `sharded_units`,
    `_spans` and `_backward`."""

    def _pre_forward(self, u: H.Unit, module, args, kwargs):
        recompute = in_backward()  # activation checkpointing
        self._spans.lap(f"{'recompute' if recompute else 'forward'} {u.name}")
        if u not in self._order:
            self._order.append(u)
        self._gather(u)
        later = self._order[self._order.index(u) + 1:]
        if recompute:  # the units after it in forward order that backward needs
            self._prefetch(v for v in later if not v.began and not v.reduced)
        else:
            u.ran = True
            self._stack.append(u)
            self._prefetch(v for v in later if not v.ran)
        self._spans.resume()
        if self.compute_dtype is not None:
            args, kwargs = (H.cast_floating(args, self.compute_dtype),
                            H.cast_floating(kwargs, self.compute_dtype))
        if torch.is_grad_enabled():  # its backward is over once its inputs' is
            args, kwargs = H.after_backward(args, kwargs,
                                            self._hook("_post_backward", u))
        return args, kwargs

    def _post_forward(self, u: H.Unit, module, args, out):
        self._spans.lap()
        if in_backward():
            # a recompute: its backward follows, so it stays gathered until that
            # is over (a non-reentrant recompute that stops early never gets here)
            self._spans.rename("backward")
        else:
            self._stack.remove(u)
            self._release(u)
            self._spans.rename(f"forward {self._stack[-1].name}" if self._stack
                               else "(outside units)")
        if torch.is_grad_enabled():  # its output's gradient: its backward is next
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._hook("_pre_backward", u))
        self._spans.resume()

    def _backward_started(self, _=None, grad=None) -> None:
        """Called by every backward hook; acts once per backward. A reentrant
        checkpoint runs a backward (a new graph task) inside ours: part of it."""
        if self._backward.seen() or not self._backward.enter():  # inside ours
            return
        self._pending = True
        for u in self.sharded_units:
            u.began, u.got, u.reduced = False, set(), False
        self._spans.start("backward")

    def _backward_ended(self) -> None:
        """The outermost graph task ended: send and free what is still due."""
        self._spans.stop()
        for u in self.sharded_units:  # a unit whose backward never said it was over
            if any(p.leaf.grad is not None for p in u.trainable):
                self._reduce(u)
            H.wait_gather(u, self._spans)
            if u.state == "full":
                self._release(u)
