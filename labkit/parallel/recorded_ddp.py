"""PyTorch's DistributedDataParallel, recording its own timeline: chapter 05 draws
it beside labkit's `DataParallel`, whose `.events` it fills the same way.

Imports torch and labkit.probe. DDP records nothing itself, so two hooks note the
times without changing what it sends: a hook on the output's gradient that queues
an autograd callback, and a communication hook around DDP's default allreduce_hook.
"""

from __future__ import annotations

import time

import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_leaves

from labkit.probe import Span

__all__ = ["RecordedDDP", "record_backward", "recording_hook"]


def recording_hook(events: list, bucket):
    """DDP's default communication hook (÷N, all-reduce), noting in `events` a
    Span from the moment DDP hands the bucket over to its future's completion."""
    t0, name = time.perf_counter(), f"all_reduce bucket {bucket.index()}"

    def done(fut):  # runs when the bucket's all-reduce completes
        events.append(Span("comm", name, t0, time.perf_counter(),
                           bucket.buffer().nbytes))
        return fut.value()
    return allreduce_hook(None, bucket).then(done)


def record_backward(events: list, output):
    """Note in `events` a "backward" Span from the moment the first gradient of
    `output` (a tensor, or a tuple, list or dict of them) arrives to the end of
    autograd's pass; returns `output`."""
    seen = set()  # graph tasks already timed (several outputs, one backward)

    def started(grad):
        task = torch._C._current_graph_task_id()
        if task in seen:
            return
        seen.add(task)
        # queued as backward starts, before DDP queues its own callback: it runs
        # before DDP waits for its buckets
        t0 = time.perf_counter()
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: events.append(Span("compute", "backward", t0,
                                       time.perf_counter())))
    for t in tree_leaves(output):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(started)
    return output


class RecordedDDP(DistributedDataParallel):
    """PyTorch's DDP, recording the spans of its last step in `.events`, as
    labkit's DataParallel does (same arguments as DDP).

    torch.nn.parallel.DistributedDataParallel itself (a subclass); it differs
    only in `.events` and in taking DDP's one communication hook, so
    register_comm_hook cannot be called on it again."""

    def __init__(self, module, **kwargs):
        super().__init__(module, **kwargs)
        self.events: list = []
        self.register_comm_hook(self.events, recording_hook)

    def forward(self, *args, **kwargs):
        self.events.clear()  # a new step
        return record_backward(self.events, super().forward(*args, **kwargs))
