"""labkit.parallel.activation_checkpointing: checkpointed blocks give the plain model's
gradients, hold fewer activations in forward (closed form below) and pay for it
with exactly one more forward of the checkpointed layers in backward."""

import time

import pytest
import torch
from torch import nn

import labkit.ledger as L
from labkit.parallel.activation_checkpointing import (
    ActivationCheckpointed,
    StepTime,
    activation_checkpoint,
    count_flops,
    time_step,
)

pytestmark = pytest.mark.numerics  # run again under other CPUs' kernels

B, D, LAYERS = 32, 64, 8
UNIT = B * D * 4  # one (B, D) fp32 activation


def _stack(dropout: float = 0.0):
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [nn.Linear(D, D), nn.ReLU()]
        if dropout:
            layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers)


def _x():
    return torch.randn(B, D, generator=torch.Generator().manual_seed(1))


def _grads(model, x):
    torch.manual_seed(2)  # dropout draws the same masks in both runs
    model(x).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("every,last", [(2, True), (4, True), (4, False), (6, True)])
def test_gradients_are_the_plain_models(every, last, dropout):
    per = 3 if dropout else 2  # modules per layer
    plain = _stack(dropout)
    ref = _grads(plain, _x())
    plain.zero_grad()
    # the same parameters
    ck = activation_checkpoint(plain, every=every * per, last=last)
    assert [id(p) for p in ck.parameters()] == [id(p) for p in plain.parameters()], (
        "activation_checkpoint() must keep the very same parameter objects")
    got = _grads(ck, _x())
    for a, b in zip(got, ref):
        # bitwise: the recompute repeats the same ops, in the same order
        assert torch.equal(a, b), (f"every={every}, last={last}: a gradient is off "
                                   f"by {(a - b).abs().max():.1e}, not bit for bit")
    # and they mean something
    assert all(g.abs().max() > 0 for g in ref), "a reference gradient is all zeros"


def _forward_and_step_peaks(model):
    x = _x()  # made outside: the ledger would count it as an activation
    with L.memory(model) as m:
        out = model(x)
        forward = m.peak["Activation"]
        out.sum().backward()
    return forward, m.peak["Activation"]


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_activation_peaks_against_the_closed_form(k):
    # Plain: each Linear saves its input, each ReLU its output (PyTorch's ReLU keeps
    # its result, not a separate mask) and that output is the next Linear's input:
    # one (B, D) tensor per layer, L of them, plus the Linear output that lives
    # until its ReLU is done: (L + 1) units at the end of forward.
    plain_fwd, plain_step = _forward_and_step_peaks(_stack())
    assert plain_fwd == plain_step == (LAYERS + 1) * UNIT, (
        f"plain peaks {plain_fwd:,}, {plain_step:,} B; (L + 1) x {UNIT:,} expected")
    # Blocks of k layers keep only their inputs: the L/k block outputs (each the
    # next block's input; the last is the model's output), plus the same transient.
    ck_fwd, ck_step = _forward_and_step_peaks(
        activation_checkpoint(_stack(), every=2 * k))
    assert ck_fwd == (LAYERS // k + 1) * UNIT, (
        f"k={k}: forward peak {ck_fwd:,} B, (L/k + 1) x {UNIT:,} expected")
    # In backward one block at a time is rebuilt: its k layers on top of the kept
    # L/k (Chen et al. 2016, sec. 4), and the scalar loss (8 bytes as counted).
    extra = ck_step - (LAYERS // k + k + 1) * UNIT
    assert extra in range(0, 16), (f"k={k}: step peak {ck_step:,} B, (L/k + k + 1) x "
                                   f"{UNIT:,} plus under 16 B expected")
    if k == 1:  # a block of one Linear + ReLU saves nothing in this stack
        assert ck_fwd == plain_fwd, f"k=1: {ck_fwd:,} B, plain {plain_fwd:,}"
    else:
        assert ck_fwd < plain_fwd, f"k={k}: {ck_fwd:,} B, not below {plain_fwd:,}"


def test_recompute_costs_exactly_one_more_forward():
    x = _x()
    plain = count_flops(_stack(), x)
    F = 2 * B * D * D * LAYERS  # 2 FLOPs per multiply-add, L Linear layers
    assert plain.forward == F, f"plain forward {plain.forward:,} FLOPs, {F:,}"
    # backward: grad of input and of weight per layer, less the first layer's input
    # gradient (x needs none)
    want = 2 * F - 2 * B * D * D
    assert plain.backward == want, f"plain backward {plain.backward:,}, {want:,}"
    every = count_flops(activation_checkpoint(_stack(), every=4), x)
    got, want = (every.forward, every.backward), (F, plain.backward + F)
    assert got == want, f"checkpointed forward, backward {got}, {want} expected"
    # the last block (4 of 8 layers) run plainly: half a forward more, not one
    lazy = count_flops(activation_checkpoint(_stack(), every=8, last=False), x)
    want = plain.backward + F // 2
    assert lazy.backward == want, f"lazy backward {lazy.backward:,}, {want:,}"


class _Slow(torch.autograd.Function):
    """Sleeps a known time in forward and another in backward."""

    @staticmethod
    def forward(ctx, x):
        time.sleep(0.02)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(0.05)
        return g


class _SlowModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(D))
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return _Slow.apply(x * self.w)


def test_timing_helper_times_forward_and_backward_apart():
    # sleeps give lower bounds that hold on any machine (a sleep never ends
    # early): 20 ms of forward, 50 ms of backward, each repeat; swapped or
    # summed in the wrong place, backward's would fall short
    m = _SlowModule()
    t = time_step(m, _x(), repeats=2)
    assert isinstance(t, StepTime), t
    assert m.calls == 2, f"{m.calls} forwards for repeats=2"
    assert t.forward >= 0.02 and t.backward >= 0.05, (
        f"forward {t.forward:.3f} s, backward {t.backward:.3f} s; at least the "
        "0.020 and 0.050 s they sleep expected")
    assert m.w.grad is None, "time_step leaves the gradients it made set"


def test_checkpointed_module_and_bad_input():
    lin = nn.Linear(D, D)
    wrapped = ActivationCheckpointed(lin)
    with torch.no_grad():  # nothing to save: runs plainly
        assert torch.equal(wrapped(_x()), lin(_x())), "not bit for bit the Linear's"
    with pytest.raises(TypeError, match="ActivationCheckpointed"):
        activation_checkpoint(lin)
    with pytest.raises(ValueError, match="every"):
        activation_checkpoint(_stack(), every=0)
