"""Optimizer-state offload (ZeRO-Offload, Ren et al. 2021, sec. 4): the fp32 master
weights and the optimizer state live in host (CPU) memory, the device keeps only
the model's parameters and gradients; each step sends the gradients down and the
updated parameters up.

    opt = OffloadedOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)

Imports torch and labkit.probe. On a CPU-only machine host and device are one
memory: the copies still run, and the memory ledger counts the host side apart.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from labkit.probe import on_host

HOST = torch.device("cpu")


@dataclass(frozen=True)
class HostCopy:
    """Bytes one step copied between host and device: gradients down (device -> host),
    parameters up (host -> device)."""

    down: int
    up: int

    @property
    def total(self) -> int:
        return self.down + self.up


@dataclass(eq=False)
class _Slot:
    """The host side of one parameter."""

    master: torch.Tensor  # fp32 master weights (the inner optimizer's parameter)
    stage: torch.Tensor  # the model's dtype: gradients come down, parameters go up
    grad: torch.Tensor  # fp32 gradient on the host (`stage` itself when fp32)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class OffloadedOptimizer(torch.optim.Optimizer):
    """`optimizer_cls` steps fp32 master copies kept in host memory.

        opt = OffloadedOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)

    `param_groups` hold your (device) parameters, so lr schedulers work as usual;
    `state` is the host optimizer's (keyed by the masters); `host_copies` has one
    `HostCopy` per step. `pin_memory` defaults to "the parameters are on CUDA".

    DeepSpeed's ZeRO-Offload optimizer (offload_optimizer device "cpu"), except
    that `optimizer_cls` itself steps on the host (no CPU-Adam kernel) and every
    copy is made inside step(), after backward. With ZeRO, pass it as
    ShardedOptimizer's `optimizer_cls`: each rank then offloads its own 1/N.
    """

    def __init__(self, params, optimizer_cls: type[torch.optim.Optimizer], *,
                 pin_memory: bool | None = None, **optimizer_kwargs):
        self._cls, self._pin_arg = optimizer_cls, pin_memory
        self._slots: dict = {}  # device parameter -> _Slot
        self.inner = None  # the host optimizer, made once the groups are known
        self.host_copies: list[HostCopy] = []
        super().__init__(params, dict(optimizer_kwargs))
        self.inner = optimizer_cls(
            [self._host_group(g) for g in self.param_groups], **optimizer_kwargs)
        self.state = self.inner.state

    @property
    def bytes_moved(self) -> list[int]:
        """Bytes over PCIe (or host memory to host memory, CPU-only) per step."""
        return [c.total for c in self.host_copies]

    @property
    def master(self) -> list[torch.Tensor]:
        return [s.master for s in self._slots.values()]

    def host_resident(self) -> dict[str, list[torch.Tensor]]:
        """What lives in host memory, by the memory ledger's categories."""
        state = [v for s in self.inner.state.values() for v in s.values()
                 if torch.is_tensor(v)] if self.inner is not None else []
        slots = list(self._slots.values())
        grads = [s.grad for s in slots]
        stages = [s.stage for s in slots if s.stage is not s.grad]
        return {"Optstate": [s.master for s in slots] + state, "Gradient": grads,
                "Other": stages}  # Other: the transfer buffers of mixed precision

    # -- layout -----------------------------------------------------------------

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        g = self.param_groups[-1]
        for p in g["params"]:
            self._slots[p] = self._make_slot(p)
        if self.inner is not None:  # a group added later
            self.inner.add_param_group(self._host_group(g))

    def _host_group(self, g: dict) -> dict:
        return {**{k: v for k, v in g.items() if k != "params"},
                "params": [self._slots[p].master for p in g["params"]]}

    def _pinned(self, p: torch.Tensor) -> bool:  # pinned: the copies can be async
        if self._pin_arg is not None:
            return self._pin_arg
        return p.device.type == "cuda"

    @torch.no_grad()
    def _make_slot(self, p: torch.Tensor) -> _Slot:
        pin = self._pinned(p)

        def empty(dtype):
            return torch.empty(p.shape, dtype=dtype, device=HOST, pin_memory=pin)

        with on_host("Optstate"):
            master = empty(torch.float32)
            master.copy_(p)  # device -> host once, at the start (not a step's)
        with on_host("Gradient"):
            grad = empty(torch.float32)
        if p.dtype == torch.float32:
            return _Slot(master, grad, grad)
        with on_host("Other"):
            stage = empty(p.dtype)
        return _Slot(master, stage, grad)

    # -- step ---------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        """Copy the gradients down to the host (upcast there in mixed precision),
        step `optimizer_cls` on the fp32 masters, and copy the parameters back up
        in the model's dtype; appends one HostCopy. A parameter without a .grad
        is not stepped."""
        if closure is not None:
            raise ValueError("OffloadedOptimizer.step does not take a closure")
        for g, h in zip(self.param_groups, self.inner.param_groups):
            h.update({k: v for k, v in g.items() if k != "params"})  # lr, ...
        todo = [(p, s) for p, s in self._slots.items() if p.grad is not None]
        down = up = 0
        for p, s in todo:  # gradients: device -> host, in the model's dtype
            s.stage.copy_(p.grad, non_blocking=s.stage.is_pinned())
            down += _nbytes(p.grad)
        if any(p.is_cuda for p, _ in todo):
            torch.cuda.synchronize()  # async copies land before the host reads
        for s in self._slots.values():
            s.master.grad = None
        for _, s in todo:
            if s.stage is not s.grad:
                s.grad.copy_(s.stage)  # upcast on the host
            s.master.grad = s.grad
        with on_host():  # the state the step creates (Adam's m, v) is host memory
            self.inner.step()
        for p, s in todo:  # parameters: host -> device, in the model's dtype
            if s.stage is not s.grad:
                s.stage.copy_(s.master)  # round to bf16/fp16 on the host
                src = s.stage
            else:
                src = s.master
            p.copy_(src, non_blocking=src.is_pinned())
            up += _nbytes(src)
            s.master.grad = None
        self.host_copies.append(HostCopy(down, up))

    # -- checkpoints ----------------------------------------------------------------

    def state_dict(self) -> dict:
        """The host optimizer's, whose parameters are the fp32 masters."""
        return {"inner": copy.deepcopy(self.inner.state_dict()),
                "master": [m.clone() for m in self.master]}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        self.inner.load_state_dict(state_dict["inner"])
        for (p, s), m in zip(self._slots.items(), state_dict["master"]):
            s.master.copy_(m)
            p.copy_(s.master)
