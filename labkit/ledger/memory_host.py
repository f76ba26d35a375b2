"""The memory ledger's host side: host memory (ZeRO-Offload's optimizer state) is
kept apart, in `host` and `host_peak`, never in the device categories. Storages
created inside `on_host()`, tensors passed to `count_as(t, category, host=True)`,
and what a tracked object's `host_resident()` returns ({category: tensors})."""

from __future__ import annotations

import contextlib

import torch

from labkit.ledger._torch_memtracker import MEMORY_CATEGORIES, category_of, nbytes


class HostMemory:
    """MemoryLedger's host bytes, a mixin: `host`, `host_peak` (by category) and
    which storages live there. Uses the ledger's `current`, `tracker`,
    `_step_depth` and `_apply`."""

    def _start_host(self) -> None:
        # host memory (offloaded state): bytes by category, apart from the device's
        self.host: dict[str, int] = dict.fromkeys(MEMORY_CATEGORIES, 0)
        self.host_peak: dict[str, int] = dict.fromkeys(MEMORY_CATEGORIES, 0)
        self._host: dict = {}  # winfo -> its host category
        self.host_ctx: list = []  # open on_host() blocks: category or None
        self._step_host_new: set = set()
        self._moving = False

    # -- what labkit.probe passes on from a technique --------------------------------

    def count_as(self, t: torch.Tensor, category: str, *, host: bool = False) -> None:
        """labkit.probe.count_as: `t` is held as `category` (on the host: host=True)."""
        if self.tracker is None:  # not started, or stopped
            return
        if host:
            self.to_host(t, category)
        else:
            self.tracker.track_as(t, category)

    @contextlib.contextmanager
    def on_host(self, category: str | None = None):
        """labkit.probe.on_host: storages made in this block are host memory."""
        if self.tracker is None:
            yield
            return
        self.host_ctx.append(category)
        try:
            yield
        finally:
            self.host_ctx.pop()

    def to_host(self, t: torch.Tensor, category: str) -> None:
        """Count `t`'s storages as host memory of `category` from now on."""
        self.host_ctx.append(category)  # a storage first seen now: straight to host
        self._moving = True  # a device one retagged now: not a device peak
        try:
            winfos = self.tracker.track_as(t, category)
        finally:
            self.host_ctx.pop()
            self._moving = False
        for winfo in winfos:
            old, mem = self._host.get(winfo), nbytes(winfo)
            if old == category:
                continue
            if old is None:
                self.current[category_of(winfo)] -= mem
            else:
                self.host[old] -= mem
            self._host[winfo] = category
            self._step_host_new.discard(winfo)
            self._apply(self.host, {category: mem})
        self._observe_host()

    def _observe_host(self) -> None:
        for k, v in self.host.items():
            if v > self.host_peak.get(k, 0):
                self.host_peak[k] = v

    def _is_host(self, winfo, new: bool) -> bool:
        """A host storage, or one made now inside on_host()."""
        return winfo in self._host or (new and bool(self.host_ctx))

    def _change_host(self, winfo, deltas: dict, new: bool, gone: bool) -> None:
        if new:  # made inside on_host(): in a step, Temp until it survives it
            cat = self.host_ctx[-1]
            if cat is None:
                cat = "Temp" if self._step_depth else "Other"
                if self._step_depth:
                    self._step_host_new.add(winfo)
            self._host[winfo] = cat
        self._apply(self.host, {self._host[winfo]: sum(deltas.values())})
        if gone:
            del self._host[winfo]
            self._step_host_new.discard(winfo)
        self._observe_host()

    def _change_moving(self, winfo, deltas: dict, new: bool, gone: bool) -> None:
        """to_host retags a device storage: no device peak."""
        self._apply(self.current, deltas)

    def _host_step_ended(self) -> None:
        """Host storages made in the step that survived it are Optstate."""
        for winfo in self._step_host_new:
            self.host["Temp"] -= nbytes(winfo)
            self.host["Optstate"] += nbytes(winfo)
            self._host[winfo] = "Optstate"
        self._step_host_new = set()
        self._observe_host()
