"""What every data-parallel wrapper checks, written once: its tensors are on a
device its process group can send, and no optimizer steps on gradients the wrapper
has not finished synchronizing."""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

# live wrappers; each has `_ids` (ids of its parameters) and `step_problem()`
_LIVE: weakref.WeakSet = weakref.WeakSet()
_STEP_HOOK = None


def check_devices(module: torch.nn.Module, group, who: str) -> None:
    backend = str(dist.get_backend(group))  # "gloo", "nccl", "cpu:gloo,cuda:nccl"
    ok = ({pair.split(":")[0] for pair in backend.split(",")} if ":" in backend
          else {"cuda"} if backend == "nccl" else {"cpu"})  # gloo: CPU, here
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if t.device.type not in ok:
            fix = ("a meta tensor has no data: materialize the module first"
                   if t.device.type == "meta" else "move the module there first")
            raise ValueError(
                f"{who}: {name!r} is on device {t.device}, but the {backend} "
                f"process group sends {' or '.join(sorted(ok))} tensors; {fix}")


def _check_step(opt, args, kwargs) -> None:
    ids = {id(p) for g in opt.param_groups for p in g["params"]}
    for w in list(_LIVE):
        if not ids.isdisjoint(w._ids):
            problem = w.step_problem()
            if problem:
                raise RuntimeError(problem)


def track(wrapper) -> None:
    """Check optimizer steps on `wrapper`'s parameters from now on."""
    global _STEP_HOOK
    _LIVE.add(wrapper)
    if _STEP_HOOK is None:
        _STEP_HOOK = register_optimizer_step_pre_hook(_check_step)


def forget(wrapper) -> None:
    _LIVE.discard(wrapper)


def release(handles) -> None:
    """Remove an instance's hooks; the global one too once no instance lives."""
    global _STEP_HOOK
    for h in handles:
        h.remove()
    if _STEP_HOOK is not None and not any(True for _ in _LIVE):
        _STEP_HOOK.remove()
        _STEP_HOOK = None
