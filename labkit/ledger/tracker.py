"""PyTorch's MemTracker, subclassed so that every change reaches the memory ledger,
with the two things the ledger adds: re-tagging a storage's category, and a fresh
forward of the root module (the next step) without MemTracker's complaint; and a
gradient another hook already took is skipped, not warned about."""

from __future__ import annotations

import torch

_TRACKER = None


def tracker_class():
    """MemTracker, subclassed to report every change to the ledger. Imported on
    first use: it pulls in DTensor (about 2 s)."""
    global _TRACKER
    if _TRACKER is not None:
        return _TRACKER
    from torch.distributed._tools.mem_tracker import (
        MemTracker,
        _MemRefType,
        _UpdateType,
    )

    class _Tracker(MemTracker):
        def __init__(self, ledger):  # the MemoryLedger it reports to
            super().__init__()
            self._ledger = ledger

        def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None):
            led = self._ledger
            if led is None:  # the block ended: a storage freed later changes nothing
                return
            super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
            mem = winfo.mem_consumed
            if u_type == _UpdateType.ADD:
                led._change(winfo, {winfo.reftype: mem}, new=True)
            elif u_type == _UpdateType.DEL:
                led._change(winfo, {winfo.reftype: -mem}, gone=True)
            elif u_type == _UpdateType.REF:
                led._change(winfo, {old_reftype: -mem, winfo.reftype: mem})
            elif u_type == _UpdateType.SIZE:
                led._change(winfo, {winfo.reftype: mem - old_mem_consumed})

        def _pre_fw_hook(self, module, inputs) -> None:
            # A root module's next forward (the next step or micro-batch):
            # MemTracker refuses it unless its per-module stats, which the ledger
            # does not use, are reset first.
            mt = self._mod_tracker
            others = set(mt.parents) - {mt.get_known_fqn(module)}
            if module in self.memory_tracking and not mt.is_bw and others == {
                    "Global"}:
                self.reset_mod_stats()
            super()._pre_fw_hook(module, inputs)

        def _update_and_maybe_create_winfos(self, t, reftype,
                                            update_existing: bool = False) -> set:
            # MemTracker's post-accumulate-grad hook reads p.grad; a wrapper's
            # hook that ran first may have taken it already (FSDP sends the full
            # gradient and drops it): nothing is held, so nothing to count
            if t is None:
                return set()
            return super()._update_and_maybe_create_winfos(t, reftype,
                                                           update_existing)

        def retag(self, winfo, category: str) -> None:
            old, winfo.reftype = winfo.reftype, _MemRefType(category)
            self._update_snap(_UpdateType.REF, winfo, old_reftype=old)

        def track_as(self, t: torch.Tensor, category: str) -> set:
            return self._update_and_maybe_create_winfos(t, _MemRefType(category))

    _TRACKER = _Tracker
    return _TRACKER
