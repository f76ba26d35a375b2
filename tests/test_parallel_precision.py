"""labkit.parallel.precision: MasterWeights keeps fp32 master copies that step in
fp32 (Micikevicius et al. 2018) and writes them back into the bf16 model."""

import pytest
import torch

from labkit.parallel.precision import MasterWeights

pytestmark = pytest.mark.numerics  # run again under other CPUs' kernels

BF16 = torch.bfloat16


def test_small_updates_vanish_in_bf16_but_accumulate_in_the_master():
    # bf16 keeps 8 significant bits: next to 1.0 its spacing is 2**-8 below and
    # 2**-7 above, so 1 - 1e-3 rounds back to 1.0; ten such steps are lost
    lr, steps = 1e-3, 10
    pure = torch.ones(4, dtype=BF16, requires_grad=True)
    low = torch.ones(4, dtype=BF16, requires_grad=True)
    sgd = torch.optim.SGD([pure], lr=lr)
    opt = MasterWeights([low], torch.optim.SGD, lr=lr)
    for _ in range(steps):
        for p, o in ((pure, sgd), (low, opt)):
            p.grad = torch.ones_like(p)
            o.step()
    assert torch.equal(pure.detach(), torch.ones(4, dtype=BF16))
    # the master holds 1 - 10 * 1e-3 to fp32 precision (steps of 1e-3, tol 1e-6)
    assert opt.master[0].dtype == torch.float32
    torch.testing.assert_close(opt.master[0], torch.full((4,), 0.99), rtol=0,
                               atol=1e-6)
    # and the model gets it rounded once: the bf16 nearest 0.99 is 253/256
    assert torch.equal(low.detach(), torch.full((4,), 253 / 256, dtype=BF16))


def test_master_steps_like_fp32_sgd_by_hand_on_the_same_gradients():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 4)).to(BF16)
    params = list(model.parameters())
    lr, mu = 0.05, 0.9
    opt = MasterWeights(params, torch.optim.SGD, lr=lr, momentum=mu)
    start = [p.detach().float() for p in params]
    ref, bufs = [s.clone() for s in start], [None] * len(params)
    x, y = torch.randn(32, 16, dtype=BF16), torch.randn(32, 4)
    for _ in range(5):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x).float(), y).backward()
        for i, p in enumerate(params):  # SGD with momentum, in fp32, by hand
            g = p.grad.float()
            bufs[i] = g if bufs[i] is None else mu * bufs[i] + g
            ref[i] -= lr * bufs[i]
        opt.step()
        for p, m, r in zip(params, opt.master, ref):
            # tolerance 1e-6: far below one step and below bf16's rounding (~1e-3)
            torch.testing.assert_close(m, r, rtol=0, atol=1e-6)
            assert torch.equal(p.detach(), m.to(BF16))  # written back, rounded once
    # the comparison means something: every tensor moved by far more than 1e-6
    assert min((m - s).abs().max().item() for m, s in zip(opt.master, start)) > 1e-3
    # the momentum lives with the masters, in fp32
    assert all(st["momentum_buffer"].dtype == torch.float32
               for st in opt.state.values())


def test_zero_grad_and_bad_input():
    p = torch.ones(3, dtype=BF16, requires_grad=True)
    opt = MasterWeights([p], torch.optim.SGD, lr=0.1)
    p.grad = torch.ones_like(p)
    opt.zero_grad(set_to_none=False)
    assert torch.equal(p.grad, torch.zeros(3, dtype=BF16))
    opt.zero_grad()
    assert p.grad is None
    with pytest.raises(ValueError, match="closure"):
        opt.step(lambda: 0.0)
    with pytest.raises(ValueError, match="no parameters"):
        MasterWeights([])
