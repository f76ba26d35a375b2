"""Activation checkpointing (激活重计算; Chen et al. 2016), as
torch.utils.checkpoint.checkpoint with use_reentrant=False: a checkpointed block
keeps only its input in forward and runs its forward again in backward.

    model = activation_checkpoint(nn.Sequential(*layers), every=2)  # blocks of 2 layers
    ActivationCheckpointed(block)  # one module

Imports torch and labkit.arguments. The recompute stops once it has rebuilt what
backward needs, so a block's trailing ops whose outputs backward never reads are
not run again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as _torch_checkpoint
from torch.utils.flop_counter import FlopCounterMode

from labkit.arguments import whole


class ActivationCheckpointed(nn.Module):
    """Forward: `module`'s, keeping only its inputs; backward: recompute, then
    `module`'s backward. Same parameters (the very objects) as `module`."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        if not torch.is_grad_enabled():  # nothing to save: a plain forward
            return self.module(*args, **kwargs)
        # non-reentrant: inputs that need no grad, keyword arguments and autograd
        # hooks all work; the random state is restored, so dropout draws alike
        return _torch_checkpoint(self.module, *args, use_reentrant=False, **kwargs)


def activation_checkpoint(model: nn.Sequential, every: int = 1, *,
               last: bool = True) -> nn.Sequential:
    """`model`'s layers in blocks of `every`, each block ActivationCheckpointed; a new
    nn.Sequential over the same layer objects (so the same parameters). With
    last=False the final block runs plainly: its activations would be rebuilt at
    once anyway, so checkpointing it buys no memory and costs a forward."""
    if not isinstance(model, nn.Sequential):
        raise TypeError("activation_checkpoint() splits an nn.Sequential into blocks; "
                        f"for a "
                        f"{type(model).__name__}, wrap the submodules you choose in "
                        "ActivationCheckpointed(...) instead")
    whole(every, "every")
    layers = list(model)
    blocks = [layers[i:i + every] for i in range(0, len(layers), every)]
    out = [ActivationCheckpointed(nn.Sequential(*b)) for b in blocks]
    if not last and out:
        out[-1] = out[-1].module
    return nn.Sequential(*out)


# -- what it costs: FLOPs (exact) and time (a timing, never asserted) -------------


@dataclass(frozen=True)
class Flops:
    """FLOPs of one training step as FlopCounterMode counts them (matmuls,
    convolutions, attention: 2 per multiply-add; element-wise ops are not counted)."""

    forward: int
    backward: int

    @property
    def total(self) -> int:
        return self.forward + self.backward


def count_flops(model: nn.Module, *inputs) -> Flops:
    """Forward and backward FLOPs of `model(*inputs).sum()`, counted apart."""
    with FlopCounterMode(display=False) as fwd:
        out = model(*inputs)
    loss = out.float().sum()
    with FlopCounterMode(display=False) as bwd:
        loss.backward()
    return Flops(fwd.get_total_flops(), bwd.get_total_flops())


@dataclass(frozen=True)
class StepTime:
    """Seconds for forward and backward, best of `repeats` (a timing: it varies)."""

    forward: float
    backward: float


def time_step(model: nn.Module, *inputs, repeats: int = 3) -> StepTime:
    """Best-of-`repeats` forward and backward times of `model(*inputs).sum()`."""
    best_f = best_b = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        loss = model(*inputs).float().sum()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        best_f, best_b = min(best_f, t1 - t0), min(best_b, t2 - t1)
        model.zero_grad(set_to_none=True)
    return StepTime(best_f, best_b)
