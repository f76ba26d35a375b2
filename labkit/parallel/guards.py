"""What every data-parallel wrapper checks, written once: its tensors are on a
device its process group can send, no optimizer steps on gradients the wrapper
has not finished synchronizing, and which backward is running (`Backward`)."""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

# live wrappers; each has `param_ids` (ids of its parameters) and `step_problem()`
_LIVE: weakref.WeakSet = weakref.WeakSet()
_STEP_HOOK = None


def require_process_group(who: str) -> None:
    """RuntimeError unless torch.distributed has a process group: `who` is built
    in the kernel, outside the ranks."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{who} needs a torch.distributed process group: build it "
                           "inside a function you run on the ranks (cluster.run(fn))")


def positive_mib(value, name: str, none_means: str | None = None) -> None:
    """ValueError unless `value` (a size in MiB) is > 0; None is allowed where
    `none_means` says what it means."""
    if value is None and none_means is not None:
        return
    if value is None or isinstance(value, bool) or not value > 0:
        also = f" (or None: {none_means})" if none_means else ""
        raise ValueError(f"{name} must be > 0 MiB{also}, got {value!r}")


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
        if not ids.isdisjoint(w.param_ids):
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


class Backward:
    """The backward now running, as the autograd graph tasks it is made of: a
    reentrant checkpoint runs a backward (a new graph task) inside ours, which is
    part of ours. `seen()`: this task is already part of it; `enter()` records
    it and is True for the outermost one; when that ends, `owner.<on_end>()`
    runs (the owner held weakly: a running backward keeps no wrapper alive)."""

    def __init__(self, owner, on_end: str):
        self._owner, self._on_end = weakref.ref(owner), on_end
        self._tasks: list[int] = []

    @property
    def running(self) -> bool:
        return bool(self._tasks)

    def seen(self) -> bool:
        return torch._C._current_graph_task_id() in self._tasks

    def enter(self) -> bool:
        task = torch._C._current_graph_task_id()
        queue = torch.autograd.Variable._execution_engine.queue_callback
        queue(lambda: self._ended(task))  # runs when `task` ends
        self._tasks.append(task)
        return len(self._tasks) == 1

    def reset(self) -> None:
        self._tasks = []

    def _ended(self, task: int) -> None:
        if task in self._tasks:
            self._tasks.remove(task)
            owner = self._owner()
            if not self._tasks and owner is not None:
                getattr(owner, self._on_end)()
