"""labkit.parallel.precision: MasterWeights keeps fp32 master copies that step in
fp32 (Micikevicius et al. 2018) and writes them back into the bf16 model."""

import pytest
import torch

from labkit.numerics import Oracle, rel_err
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
    fp32, exact = (torch.ones(4, dtype=d, requires_grad=True)
                   for d in (torch.float32, torch.float64))
    plain = [torch.optim.SGD([p], lr=lr) for p in (fp32, exact)]
    for _ in range(steps):
        for p, o in ((pure, sgd), (low, opt), (fp32, plain[0]), (exact, plain[1])):
            p.grad = torch.ones_like(p)
            o.step()
    assert torch.equal(pure.detach(), torch.ones(4, dtype=BF16)), (
        f"pure bf16 moved to {pure.tolist()}: its steps should all be lost")
    # the master holds 1 - 10 * 1e-3 to fp32 precision: it is plain fp32 SGD, the
    # same operations in the same order (bit for bit), as far from the float64
    # steps as fp32 is
    assert opt.master[0].dtype == torch.float32, opt.master[0].dtype
    assert torch.equal(opt.master[0], fp32.detach()), (
        f"master {opt.master[0].tolist()}, fp32 SGD's {fp32.tolist()}")
    oracle = Oracle(exact.detach(), {"fp32 SGD": fp32.detach()})
    oracle.check(opt.master[0], f"the master after {steps} steps")
    oracle.resolves(torch.ones(4), "the weights before the steps")
    # and the model gets it rounded once: the bf16 nearest 0.99 is 253/256
    assert torch.equal(low.detach(), torch.full((4,), 253 / 256, dtype=BF16)), (
        f"the bf16 weights are {low.tolist()}, 253/256 expected")


def test_master_steps_like_fp32_sgd_by_hand_on_the_same_gradients():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 4)).to(BF16)
    params = list(model.parameters())
    lr, mu = 0.05, 0.9
    opt = MasterWeights(params, torch.optim.SGD, lr=lr, momentum=mu)
    start = [p.detach().float() for p in params]
    # SGD with momentum by hand on the same gradients, in fp32 and float64
    refs = {d: ([s.to(d).clone() for s in start], [None] * len(params))
            for d in (torch.float32, torch.float64)}
    x, y = torch.randn(32, 16, dtype=BF16), torch.randn(32, 4)
    for step in range(5):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x).float(), y).backward()
        for d, (ref, bufs) in refs.items():
            for i, p in enumerate(params):
                g = p.grad.to(d)  # bf16: exact in either
                bufs[i] = g if bufs[i] is None else mu * bufs[i] + g
                ref[i] -= lr * bufs[i]
        opt.step()
        # torch's SGD may fuse lr * buf into the subtraction: as far from float64
        # as the steps by hand in fp32 are, not bit for bit theirs
        oracle = Oracle(refs[torch.float64][0], {"by hand": refs[torch.float32][0]})
        oracle.check(opt.master, f"the masters after step {step + 1}")
        for i, (p, m) in enumerate(zip(params, opt.master)):
            # written back, rounded once
            assert torch.equal(p.detach(), m.to(BF16)), (
                f"step {step + 1}, tensor {i}: the bf16 weight is not its master "
                "rounded to bf16")
    # the comparison means something: every tensor moved far more than allowed
    oracle.resolves(start, "the weights before training")
    for i, (m, s) in enumerate(zip(opt.master, start)):
        moved = rel_err(m, s)
        assert moved > 100 * oracle.allowed, (
            f"tensor {i} moved {moved:.1e}, not more than 100 x the "
            f"{oracle.allowed:.1e} allowed")
    # the momentum lives with the masters, in fp32
    dtypes = {st["momentum_buffer"].dtype for st in opt.state.values()}
    assert dtypes == {torch.float32}, f"momentum buffers in {dtypes}"


def test_zero_grad_and_bad_input():
    p = torch.ones(3, dtype=BF16, requires_grad=True)
    opt = MasterWeights([p], torch.optim.SGD, lr=0.1)
    p.grad = torch.ones_like(p)
    opt.zero_grad(set_to_none=False)
    assert torch.equal(p.grad, torch.zeros(3, dtype=BF16)), p.grad
    opt.zero_grad()
    assert p.grad is None, p.grad
    with pytest.raises(ValueError, match="closure"):
        opt.step(lambda: 0.0)
    with pytest.raises(ValueError, match="no parameters"):
        MasterWeights([])
