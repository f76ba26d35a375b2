"""The memory ledger's optimizer steps: tensors created inside `optimizer.step()`
count as Temp unless they survive the step; survivors become Optstate (Adam's m
and v) or Gradient (a `.grad` that stays), and the peaks inside the step are
recomputed with those final categories. `steps` has a `Step` per outermost
`optimizer.step()`."""

from __future__ import annotations

from dataclasses import dataclass, field

from labkit.ledger._torch_memtracker import MEMORY_CATEGORIES
from labkit.ledger.holdings_ledger import storages


@dataclass(frozen=True)
class Step:
    """One training step: from the end of the previous `optimizer.step()` (or the
    start of the block) to the end of this one. Bytes by category."""

    peak: dict[str, int] = field(default_factory=dict)  # each category's maximum
    at_peak: dict[str, int] = field(default_factory=dict)  # when the total peaked
    current: dict[str, int] = field(default_factory=dict)  # as optimizer.step() ends

    @property
    def peak_total(self) -> int:
        return sum(self.at_peak.values())


class OptimizerSteps:
    """MemoryLedger's step side, a mixin: `steps`, and the changes inside
    `optimizer.step()` logged to be replayed once it ends. Uses the ledger's
    `current`, `tracker`, `_phases`, `_phase`, `_apply`, `_observe`,
    `_tag_grads` and `_host_step_ended`."""

    def _start_steps(self) -> None:
        self.steps: list[Step] = []
        self._step_depth = 0
        self._step_log: list = []  # (winfo, deltas, phase) inside optimizer.step()
        self._step_new: set = set()
        self._step_gone: set = set()
        self._step_start: dict[str, int] = {}
        self._step_peak: dict[str, int] = dict.fromkeys(MEMORY_CATEGORIES, 0)
        self._step_at_peak: dict[str, int] = dict.fromkeys(MEMORY_CATEGORIES, 0)

    def _change_in_step(self, winfo, deltas: dict, new: bool, gone: bool) -> None:
        """Inside optimizer.step(): new storages are Temp until they survive it."""
        if new and "Optstate" in deltas:
            deltas = {"Temp": deltas.pop("Optstate"), **deltas}
            self._step_new.add(winfo)
        elif winfo in self._step_new:
            deltas = {("Temp" if k == "Optstate" else k): v
                      for k, v in deltas.items()}
        if gone:
            self._step_gone.add(winfo)
        self._step_log.append((winfo, deltas, self._phase()))
        self._apply(self.current, deltas)

    def _step_pre(self, opt, args, kwargs) -> None:
        self._step_depth += 1
        if self._step_depth == 1:
            self._step_start = dict(self.current)
            self._step_log, self._step_new, self._step_gone = [], set(), set()
            self._step_host_new = set()
            if not self._phases:
                self._observe(self.current, "optimizer")
            self._tag_grads([opt])

    def _step_post(self, opt, args, kwargs) -> None:
        self._step_depth -= 1
        if self._step_depth:
            return
        survivors = self._step_new - self._step_gone
        # replay the step with survivors as Optstate, so its peaks are right
        snap = dict(self._step_start)
        for winfo, deltas, phase in self._step_log:
            if winfo in survivors:
                deltas = {("Optstate" if k == "Temp" else k): v
                          for k, v in deltas.items()}
            self._apply(snap, deltas)
            self._observe(snap, phase)
        self.current = {k: snap.get(k, 0) for k in MEMORY_CATEGORIES}
        self._step_log, self._step_new, self._step_gone = [], set(), set()
        # a survivor that is some parameter's .grad (a kept fp32 master grad) is a
        # Gradient, not optimizer state
        params = [p for g in opt.param_groups for p in g["params"]]
        grad_ptrs = {st.data_ptr() for p in params if p.grad is not None
                     for st in storages(p.grad)}
        for st, winfo in self.tracker.records():
            if winfo in survivors and st.data_ptr() in grad_ptrs:
                self.tracker.retag(winfo, "Gradient")
        self._host_step_ended()
        self.steps.append(Step(dict(self._step_peak), dict(self._step_at_peak),
                               dict(self.current)))
        self._step_peak, self._step_at_peak = dict(self.current), dict(self.current)
