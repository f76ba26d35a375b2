"""Mixed precision with fp32 master weights (Micikevicius et al. 2018, "Mixed
Precision Training"; the ZeRO paper's 2 + 2 + 12 bytes per parameter).

The model keeps low-precision parameters and gradients (bf16: 2 + 2 bytes per
parameter); the optimizer keeps an fp32 master copy plus its own state (Adam's m
and v: 4 + 4 + 4 = 12 bytes). `step()` upcasts the gradients into the master
copies (a temporary fp32 gradient, freed at the end of the step), steps, and
writes the result back into the model's parameters.
"""

from __future__ import annotations

import torch


class MasterWeights(torch.optim.Optimizer):
    """Optimizer over fp32 master copies of low-precision model parameters.

        opt = MasterWeights(model.parameters(), torch.optim.AdamW, lr=1e-3)
    """

    def __init__(self, params, base: type[torch.optim.Optimizer] = torch.optim.AdamW,
                 **kwargs):
        self.low = [p for p in params]
        if not self.low:
            raise ValueError("MasterWeights got no parameters")
        # fp32 master copies: these, not the model's params, are what `base` updates
        self.master = [p.detach().to(torch.float32).clone() for p in self.low]
        self.base = base(self.master, **kwargs)
        super().__init__(self.master, dict(self.base.defaults))
        self.param_groups = self.base.param_groups
        self.state = self.base.state

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("MasterWeights.step does not take a closure")
        for p, m in zip(self.low, self.master):
            m.grad = None if p.grad is None else p.grad.to(torch.float32)
        self.base.step()
        for p, m in zip(self.low, self.master):
            p.copy_(m)  # round the fp32 result into the low-precision model
            m.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.low:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
