"""Memory ledger: bytes a rank holds, by category, current and peak.

    with labkit.ledger.memory(model, optimizer) as m:
        for x in batches:
            model(x).sum().backward(); optimizer.step(); optimizer.zero_grad()
    m.current["Optstate"], m.peak["Activation"], m.at_peak, m.steps[0].peak

Imports torch and labkit.ledger's own modules. Built on PyTorch's MemTracker (every
private call in _torch_memtracker.py): Gradient is what a rank keeps from backward
to the optimizer step, each value once; buffers made only to move it are Temp.
"""

from __future__ import annotations

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from labkit.ledger._torch_memtracker import (
    MEMORY_CATEGORIES,
    check_torch_version,
    tracker_class,
)
from labkit.ledger.common import Ledger, current_phase
from labkit.ledger.holdings_ledger import Holdings, has_dtensor, holdings
from labkit.ledger.memory_host import HostMemory
from labkit.ledger.memory_steps import OptimizerSteps, Step

__all__ = ["MEMORY_CATEGORIES", "Holdings", "MemoryLedger", "Step", "holdings",
           "memory"]


class MemoryLedger(HostMemory, OptimizerSteps, Ledger):
    """Bytes by category: `current`, `peak` (each category's own maximum),
    `at_peak` (the breakdown when the total peaked), `phase_peaks` and `steps`
    (one `Step` per outermost `optimizer.step()`)."""

    kind = "memory"
    fields = ("current", "peak", "at_peak", "phase_peaks", "steps", "local_shards",
              "cuda_peak", "cuda_start", "host", "host_peak")  # what pickles

    def __init__(self, *tracked):
        super().__init__()
        self._tracked = [t for t in tracked if t is not None]
        self.current: dict[str, int] = dict.fromkeys(MEMORY_CATEGORIES, 0)
        self.peak: dict[str, int] = dict.fromkeys(MEMORY_CATEGORIES, 0)
        self.at_peak: dict[str, int] = dict.fromkeys(MEMORY_CATEGORIES, 0)
        self.phase_peaks: dict[str, dict[str, int]] = {}
        self.local_shards = False  # DTensors were met: counted by local shard
        self.cuda_peak: int | None = None  # the CUDA allocator's own peak, on GPUs
        self.cuda_start: int | None = None  # ... and what it held as the block began
        self.tracker = None
        self._handles: list = []
        self._start_steps()  # steps, and what happens inside optimizer.step()
        self._start_host()  # host, host_peak: offloaded state, apart

    # -- public -----------------------------------------------------------------

    @property
    def total(self) -> int:
        return sum(self.current.values())

    @property
    def peak_total(self) -> int:
        return sum(self.at_peak.values())

    def __repr__(self) -> str:
        cur = ", ".join(f"{k}={v}" for k, v in self.current.items() if v)
        note = "; DTensors by local shard" if self.local_shards else ""
        return (f"MemoryLedger(current: {cur or 'nothing'}; "
                f"peak total={self.peak_total}; {len(self.steps)} steps{note})")

    # -- context ----------------------------------------------------------------

    def __enter__(self):
        self._claim()
        try:
            self.local_shards = has_dtensor(*self._tracked)
            self.tracker = tracker_class()(self)
            self.tracker.track_external(*self._tracked)
            for opt in self._tracked:
                if isinstance(opt, torch.optim.Optimizer):
                    self._track_master_weights(opt)
            for obj in self._tracked:
                for category, ts in getattr(obj, "host_resident", dict)().items():
                    for t in ts:
                        self.to_host(t, category)
            self._handles = [register_optimizer_step_pre_hook(self._step_pre)]
            self.tracker.__enter__()  # registers MemTracker's own step hooks
            self._handles.append(register_optimizer_step_post_hook(self._step_post))
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.reset_peak_memory_stats()
                self.cuda_start = torch.cuda.memory_allocated()
        except BaseException:
            self._remove_hooks()
            raise
        return self

    def __exit__(self, *exc):
        try:
            self._tag_grads(self._tracked)
            self.local_shards |= has_dtensor(*self._tracked)
        finally:
            try:
                self.tracker.__exit__(*exc)
            finally:
                self._remove_hooks()
                if torch.cuda.is_available() and torch.cuda.is_initialized():
                    self.cuda_peak = torch.cuda.max_memory_allocated()
                self._let_go()
        return False

    def _let_go(self) -> None:
        """Drop every reference to what was tracked: a ledger kept for its numbers
        must not keep the model, its gradients or the optimizer's state alive."""
        if self.tracker is not None:
            self.tracker.ledger = None  # its storages' finalizers may still fire
        self._tracked, self.tracker = [], None
        self._host, self._step_log = {}, []
        self._step_new, self._step_gone, self._step_host_new = set(), set(), set()

    def _remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._release()

    def _track_master_weights(self, opt: torch.optim.Optimizer) -> None:
        """Parameters the optimizer owns that are not the model's (fp32 master
        weights) are Optstate, as in the ZeRO paper's K = 12 bytes/param."""
        model_params = {id(p) for m in self._tracked if isinstance(m, torch.nn.Module)
                        for p in m.parameters()}
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) not in model_params:
                    self.tracker.track_as(p, "Optstate")
                    if p.grad is not None:
                        self.tracker.track_as(p.grad, "Gradient")

    def _tag_grads(self, objs) -> None:
        """Every `.grad` a tracked model or optimizer holds is a Gradient, also
        one assigned by hand, which MemTracker's autograd hooks do not see."""
        for o in objs:
            if isinstance(o, torch.nn.Module):
                params = o.parameters()
            elif isinstance(o, torch.optim.Optimizer):
                params = (p for g in o.param_groups for p in g["params"])
            else:
                continue
            for p in params:
                if p.grad is not None:
                    self.tracker.track_as(p.grad, "Gradient")

    # -- bookkeeping --------------------------------------------------------------

    def _phase(self) -> str:
        in_forward = self.tracker is not None and self.tracker.in_forward()
        return current_phase(self._phases, bool(self._step_depth), in_forward)

    def _phase_entered(self) -> None:
        self._observe(self.current, self._phases[-1])  # a phase allocating nothing

    def record_change(self, winfo, deltas: dict, new: bool = False, gone: bool = False):
        """MemTracker saw a storage made (new), freed (gone), resized or retagged:
        `deltas` is bytes by category. One route for each kind of memory."""
        if self._is_host(winfo, new):
            route = self._change_host  # host memory (memory_host.py)
        elif self._moving:
            route = self._change_moving  # to_host retags a device storage
        elif self._step_depth:
            route = self._change_in_step  # inside optimizer.step() (memory_steps)
        else:
            route = self._change_device
        route(winfo, deltas, new, gone)

    def _change_device(self, winfo, deltas: dict, new: bool, gone: bool) -> None:
        self._apply(self.current, deltas)
        self._observe(self.current, self._phase())

    @staticmethod
    def _apply(snap: dict, deltas: dict) -> None:
        for k, v in deltas.items():
            snap[k] = snap.get(k, 0) + v

    def _observe(self, snap: dict, phase: str) -> None:
        """Raise the block's and this step's peaks to `snap` where it is higher."""
        total = sum(snap.values())
        for peak in (self.peak, self._step_peak):
            for k, v in snap.items():
                if v > peak.get(k, 0):
                    peak[k] = v
        if total > sum(self.at_peak.values()):
            self.at_peak = dict(snap)
        if total > sum(self._step_at_peak.values()):
            self._step_at_peak = dict(snap)
        best = self.phase_peaks.get(phase)
        if best is None or total > sum(best.values()):
            self.phase_peaks[phase] = dict(snap)


def memory(*tracked) -> MemoryLedger:
    """A ledger of the memory this process holds, by category.

    Pass the model(s), optimizer(s) and tensors created before the block, so they
    are counted from the start; everything created inside is tracked by itself.
    Works in a plain process too (no process group needed).
    """
    check_torch_version(stacklevel=2)
    return MemoryLedger(*tracked)
