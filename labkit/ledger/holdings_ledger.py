"""What a model and optimizer hold right now, counted storage by storage.

A DTensor (FSDP2's sharded parameters, tensor parallelism) counts as the local
tensor this rank holds, its shard; `Holdings.local_shards` says when that happened.
Storage is what is counted: FSDP2 pads a short shard to ceil(rows / n) rows, and
that padding is held too.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from labkit.ledger._torch_memtracker import is_traceable_wrapper_subclass


@dataclass(frozen=True)
class Holdings:
    """Bytes an object graph holds right now (each storage counted once), one
    field per memory category (labkit.conventions' names, lower case)."""

    parameter: int = 0
    buffer: int = 0
    gradient: int = 0
    optstate: int = 0  # m, v, momentum ... and master weights it owns
    local_shards: bool = False  # DTensors were met: each counted by its local shard
    host: int = 0  # held in host memory (offloaded), not in `total`

    @property
    def total(self) -> int:
        return self.parameter + self.buffer + self.gradient + self.optstate


def is_dtensor(t) -> bool:
    """Without importing DTensor (slow) when nothing has made one yet."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors with real storage behind `t`: itself, or a DTensor's local shard
    (any traceable wrapper subclass's inner tensors). A DTensor's own storage is
    not real: touching its data pointer raises."""
    if not is_traceable_wrapper_subclass(t):
        return [t]
    names, _ = t.__tensor_flatten__()
    inner = (getattr(t, n) for n in names)
    return [x for i in inner if isinstance(i, torch.Tensor) for x in plain_tensors(i)]


def storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    return [x.untyped_storage() for x in plain_tensors(t)]


def _storage_bytes(tensors, seen: set) -> int:
    n = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        for st in storages(t):
            key = (st.data_ptr(), st.device)
            if key not in seen:
                seen.add(key)
                n += st.nbytes()
    return n


def holdings(module: torch.nn.Module | None = None,
             optimizer: torch.optim.Optimizer | None = None) -> Holdings:
    """Count what `module` and `optimizer` hold, without tracking anything."""
    seen: set = set()
    params = list(module.parameters()) if module is not None else []
    buffers = list(module.buffers()) if module is not None else []
    p = _storage_bytes(params, seen)
    b = _storage_bytes(buffers, seen)
    # offloaded state (an optimizer's `host_resident()`) is host memory, apart
    on_host = getattr(optimizer, "host_resident", dict)().values()
    h = _storage_bytes([t for ts in on_host for t in ts], seen)
    opt_params, state = [], []
    if optimizer is not None:
        opt_params = [q for g in optimizer.param_groups for q in g["params"]]
        state = [v for s in optimizer.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor)]
    grads = [q.grad for q in [*params, *opt_params] if q.grad is not None]
    g = _storage_bytes(grads, seen)
    o = _storage_bytes(opt_params, seen)  # master weights (model params: seen)
    o += _storage_bytes(state, seen)
    return Holdings(p, b, g, o, has_dtensor(module, optimizer), h)


def has_dtensor(*objs) -> bool:
    """Whether any module, optimizer or tensor among `objs` holds a DTensor."""
    for o in objs:
        ts = [o]
        if isinstance(o, torch.nn.Module):
            ts = [*o.parameters(), *o.buffers()]
            ts += [p.grad for p in o.parameters() if p.grad is not None]
        elif isinstance(o, torch.optim.Optimizer):
            ts = [p for g in o.param_groups for p in g["params"]]
            ts += [v for s in o.state.values() for v in s.values()]
        if any(is_dtensor(t) for t in ts):
            return True
    return False
