"""Every use the memory ledger makes of PyTorch's private API, in one place, behind
a version check: MemTracker (torch.distributed._tools.mem_tracker) subclassed so
that every change reaches the ledger, and the test for a tensor subclass that wraps
others (torch.utils._python_dispatch).

Imports torch and labkit.conventions. Tested with the TESTED_TORCH releases (make
test: the lock's 2.13.0; make test-torch: 2.14.1); on another, `check_torch_version`
warns once, and a MemTracker whose private parts moved fails with a clear error.
"""

from __future__ import annotations

import warnings

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from labkit.conventions import MEMORY_CATEGORIES  # MemTracker's _MemRefType values

__all__ = ["MEMORY_CATEGORIES", "TESTED_TORCH", "category_of", "check_torch_version",
           "is_traceable_wrapper_subclass", "nbytes", "tracker_class"]

TESTED_TORCH = ("2.13", "2.14")  # major.minor releases the ledger was tested with
_TESTED = " and ".join(TESTED_TORCH)

_TRACKER = None
_WARNED = []


def check_torch_version(stacklevel: int = 2) -> None:
    """Warn, once per process, when this torch is not a release the ledger was
    tested with."""
    if _WARNED or torch.__version__.split("+")[0].rsplit(".", 1)[0] in TESTED_TORCH:
        return
    _WARNED.append(torch.__version__)
    warnings.warn(
        f"labkit's memory ledger subclasses private parts of PyTorch's MemTracker "
        f"and is tested with torch {_TESTED}; this is torch {torch.__version__}. "
        f"The bytes it files by category (parameters, gradients, optimizer state, "
        f"activations, temporaries) and its peaks may differ from the chapters'; "
        f"what the traffic ledger counts and the closed forms do not depend on it",
        stacklevel=stacklevel + 1)


def nbytes(winfo) -> int:
    """Bytes of the storage MemTracker's record `winfo` stands for."""
    return winfo.mem_consumed


def category_of(winfo) -> str:
    return str(winfo.reftype.value)


def tracker_class():
    """MemTracker, subclassed to report every change to the ledger. Imported on
    first use: it pulls in DTensor, which is slow to import."""
    global _TRACKER
    if _TRACKER is not None:
        return _TRACKER
    try:
        from torch.distributed._tools.mem_tracker import (
            MemTracker,
            _MemRefType,
            _UpdateType,
        )
    except ImportError as e:
        raise RuntimeError(
            f"labkit's memory ledger needs PyTorch's MemTracker as it is in torch "
            f"{_TESTED} (the lock pins 2.13.0); torch "
            f"{torch.__version__} has moved it ({e}). Install the pinned torch "
            "(requirements.lock)") from e
    found = {str(r.value) for r in _MemRefType}
    if found != set(MEMORY_CATEGORIES):
        raise RuntimeError(
            f"labkit's memory ledger counts MemTracker's categories as in torch "
            f"{_TESTED}, {MEMORY_CATEGORIES}; torch {torch.__version__} has "
            f"{tuple(sorted(found))}. Install the pinned torch (requirements.lock)")

    class _Tracker(MemTracker):
        """Adds: every change reported to the ledger, its category a plain
        string; re-tagging a storage's category; a fresh forward of the root
        module without MemTracker's complaint; a gradient another hook already
        took skipped. The ledger holds a winfo only as a key (nbytes, category_of)."""

        def __init__(self, ledger):  # the MemoryLedger it reports to
            super().__init__()
            self.ledger = ledger

        def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None):
            led = self.ledger
            if led is None:  # the block ended: a storage freed later changes nothing
                return
            super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
            mem, cat = winfo.mem_consumed, category_of(winfo)
            if u_type == _UpdateType.ADD:
                led.record_change(winfo, {cat: mem}, new=True)
            elif u_type == _UpdateType.DEL:
                led.record_change(winfo, {cat: -mem}, gone=True)
            elif u_type == _UpdateType.REF:
                led.record_change(winfo, {str(old_reftype.value): -mem, cat: mem})
            elif u_type == _UpdateType.SIZE:
                led.record_change(winfo, {cat: mem - old_mem_consumed})

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

        def in_forward(self) -> bool:
            """A module's forward is running (MemTracker's module tracker)."""
            return len(self._mod_tracker.parents) > 1

        def records(self) -> list:
            """(storage, winfo) of every storage tracked now."""
            return [(st, winfo) for st, (winfo, _) in self._WINFO.items()]

        def retag(self, winfo, category: str) -> None:
            old, winfo.reftype = winfo.reftype, _MemRefType(category)
            self._update_snap(_UpdateType.REF, winfo, old_reftype=old)

        def track_as(self, t: torch.Tensor, category: str) -> set:
            return self._update_and_maybe_create_winfos(t, _MemRefType(category))

    _TRACKER = _Tracker
    return _TRACKER
