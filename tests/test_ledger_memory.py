"""The memory ledger against exact counts (numel x element size) of what is held."""

import warnings

import pytest
import torch

import labkit.ledger as L
from labkit.parallel.precision import MasterWeights

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
}
BASES = {"sgd": torch.optim.SGD, "sgd-momentum": torch.optim.SGD,
         "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
KW = {"sgd": {"lr": 0.1}, "sgd-momentum": {"lr": 0.1, "momentum": 0.9},
      "adam": {"lr": 1e-3}, "adamw": {"lr": 1e-3}}


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32),
        torch.nn.ReLU(), torch.nn.Linear(32, 8),
    ).to(dtype)


def _bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def _state_tensors(opt):
    return [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]


def _setup(name, precision):
    if precision == "fp32":
        model = _model()
        return model, OPTIMIZERS[name](model.parameters()), torch.float32
    model = _model(torch.bfloat16)
    return model, MasterWeights(model.parameters(), BASES[name], **KW[name]), \
        torch.bfloat16


@pytest.mark.parametrize("precision", ["fp32", "bf16-master"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_current_bytes_after_a_step_are_exact(name, precision):
    model, opt, dtype = _setup(name, precision)
    x = torch.randn(16, 64, dtype=dtype)
    with L.memory(model, opt) as m:
        model(x).float().sum().backward()
        opt.step()
    params = list(model.parameters())
    assert m.current["Parameter"] == _bytes(params)
    assert m.current["Gradient"] == _bytes(p.grad for p in params)
    optstate = _bytes(_state_tensors(opt))
    if precision == "bf16-master":
        optstate += _bytes(opt.master)  # the fp32 master copy is optimizer state
    assert m.current["Optstate"] == optstate
    assert m.current["Temp"] == 0 and m.current["Activation"] == 0
    h = L.holdings(model, opt)
    assert (h.parameter, h.gradient, h.optstate) == (
        m.current["Parameter"], m.current["Gradient"], m.current["Optstate"])


def _mixed_adam_step():
    model, opt, _ = _setup("adam", "bf16-master")
    with L.memory(model, opt) as m:
        model(torch.randn(16, 64, dtype=torch.bfloat16)).float().sum().backward()
        opt.step()
    return opt, m, sum(p.numel() for p in model.parameters())


def test_adam_mixed_precision_is_16_bytes_per_parameter():
    opt, m, psi = _mixed_adam_step()
    step_counters = _bytes(s["step"] for s in opt.state.values())
    assert m.current["Parameter"] == 2 * psi and m.current["Gradient"] == 2 * psi
    assert m.current["Optstate"] - step_counters == 12 * psi  # master + m + v
    total = (m.current["Parameter"] + m.current["Gradient"] + m.current["Optstate"]
             - step_counters)
    assert total == 16 * psi


def test_step_temporaries_are_temp_not_optimizer_state():
    _, m, psi = _mixed_adam_step()
    # the fp32 gradients live only inside step(): at least 4 bytes/param of Temp there
    assert m.phase_peaks["optimizer"]["Temp"] >= 4 * psi
    assert m.peak["Temp"] >= 4 * psi and m.current["Temp"] == 0
    # and none of it was folded into the state: the state never exceeded its final size
    assert m.peak["Optstate"] == m.current["Optstate"]


def test_activations_peak_in_forward_and_phases_are_labelled():
    model, opt, _ = _setup("sgd", "fp32")
    x = torch.randn(256, 64)
    with L.memory(model, opt) as m:
        loss = model(x).sum()
        with m.phase("my backward"):
            loss.backward()
        opt.step()
    # the ReLU outputs saved for backward: (256,128) + (256,32) floats at least
    assert m.phase_peaks["forward"]["Activation"] >= 4 * 256 * (128 + 32)
    assert "my backward" in m.phase_peaks and "optimizer" in m.phase_peaks
    assert sum(m.at_peak.values()) == m.peak_total >= max(
        sum(s.values()) for s in m.phase_peaks.values())


def _counters(opt):
    return _bytes(s["step"] for s in opt.state.values())


def test_two_adam_steps_in_one_ledger():
    model, opt, _ = _setup("adam", "fp32")
    params = list(model.parameters())
    psi = sum(p.numel() for p in params)
    with L.memory(model, opt) as m:
        for batch in (16, 256):  # the second step is the bigger one
            model(torch.randn(batch, 64)).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=False)  # gradients stay allocated
    assert _counters(opt) == 4 * len(params)  # Adam's fp32 step counters: Optstate
    for cur in (m.current, *(s.current for s in m.steps)):
        assert cur["Parameter"] == cur["Gradient"] == 4 * psi
        assert cur["Optstate"] - _counters(opt) == 8 * psi  # m and v
        assert cur["Temp"] == cur["Activation"] == 0
    first, second = m.steps
    assert m.peak_total == second.peak_total > first.peak_total
    assert all(m.peak[k] >= max(first.peak[k], second.peak[k]) for k in m.peak)
    # the second step's activations: its (256, 128) and (256, 32) ReLU outputs
    assert second.peak["Activation"] >= 4 * 256 * (128 + 32) > first.peak["Activation"]
    assert not m.local_shards


def test_steps_end_at_each_optimizer_step():
    model, opt, _ = _setup("adam", "fp32")
    psi = sum(p.numel() for p in model.parameters())
    with L.memory(model, opt) as m:
        for batch in (8, 64, 8):
            for _ in range(2):  # two micro-batches: two root forwards per step
                model(torch.randn(batch, 64)).sum().backward()
            opt.step()
            opt.zero_grad()  # set_to_none: the step's figures are taken before it
        with torch.no_grad():
            model(torch.randn(4096, 64))  # after the last step: in peak, no step
    assert len(m.steps) == 3
    assert [s.current["Gradient"] for s in m.steps] == [4 * psi] * 3
    assert m.current["Gradient"] == 0
    # each step's peak is its own: the big middle step does not carry over
    acts = [s.peak["Activation"] for s in m.steps]
    assert acts[0] == acts[2] < acts[1]
    assert m.peak["Activation"] >= 4 * 4096 * 128 > max(acts)


def test_a_wrapping_optimizer_is_one_step():
    opt, m, psi = _mixed_adam_step()  # MasterWeights.step runs Adam.step inside
    (step,) = m.steps
    assert step.current == m.current and step.peak["Temp"] >= 4 * psi


def test_gradients_assigned_by_hand_are_gradients():
    model, opt, _ = _setup("sgd", "fp32")
    params = list(model.parameters())
    with L.memory(model, opt) as m:
        for p in params:  # as a hand-made data-parallel all-reduce would
            p.grad = torch.ones_like(p)
        opt.step()
    (step,) = m.steps
    assert step.current["Gradient"] == _bytes(params) == m.current["Gradient"]
    assert step.current["Activation"] == 0 == m.current["Activation"]
    with L.memory(model, opt) as m:  # no step: counted when the block ends
        for p in params:
            p.grad = torch.zeros_like(p)
    assert m.current["Gradient"] == _bytes(params) and m.current["Activation"] == 0


def test_a_gradient_taken_by_an_earlier_hook_is_not_counted_or_warned_about():
    # FSDP's hook sends a full gradient and drops it before MemTracker's own
    # post-accumulate-grad hook reads p.grad: nothing is held, nothing to warn
    model = torch.nn.Linear(8, 8)
    model.weight.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad",
                                                                      None))
    with warnings.catch_warnings(), L.memory(model) as m:
        warnings.simplefilter("error")  # any warning fails the test
        model(torch.ones(2, 8)).sum().backward()
    assert model.weight.grad is None and model.bias.grad is not None
    assert m.current["Gradient"] == model.bias.grad.nbytes, (
        f"Gradient {m.current['Gradient']} B held; only the bias's "
        f"{model.bias.grad.nbytes} B expected")


def test_works_without_a_process_group_and_refuses_nesting():
    import torch.distributed as dist

    assert not dist.is_initialized()
    model = _model()
    with L.memory(model) as m:
        with pytest.raises(RuntimeError, match="nested"):
            with L.memory(model):
                pass
    assert m.current["Parameter"] == _bytes(model.parameters())
    with L.memory(model) as again:  # the guard is released on exit
        pass
    assert again.current == m.current


def _global_hook_counts():
    from torch.nn.modules import module as nn_module
    from torch.optim import optimizer as optim

    return (
        len(nn_module._global_forward_pre_hooks),
        len(nn_module._global_forward_hooks),
        len(nn_module._global_backward_pre_hooks),
        len(nn_module._global_backward_hooks),
        len(optim._global_optimizer_pre_hooks),
        len(optim._global_optimizer_post_hooks),
        torch._C._len_torch_dispatch_stack(),
    )


def test_leaving_the_block_removes_every_hook():
    model, opt, _ = _setup("adam", "fp32")
    before = _global_hook_counts()
    resize = torch.UntypedStorage.resize_
    with L.memory(model, opt):
        assert _global_hook_counts() != before
        model(torch.randn(4, 64)).sum().backward()
        opt.step()
    assert _global_hook_counts() == before
    assert torch.UntypedStorage.resize_ is resize
    for p in model.parameters():
        assert not p._backward_hooks and not p._post_accumulate_grad_hooks


def test_ledger_travels_by_pickle():
    import pickle

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with L.memory(model, opt) as m:
        model(torch.randn(4, 64)).sum().backward()
        opt.step()
    back = pickle.loads(pickle.dumps(m))
    assert back.current == m.current and back.at_peak == m.at_peak
    assert back.steps == m.steps and len(back.steps) == 1
    assert back.phase_peaks == m.phase_peaks and not back._tracked


def test_a_kept_ledger_lets_the_optimizer_go_and_keeps_its_numbers():
    """Kept for its numbers (to chart them), a ledger does not keep the optimizer
    or its state alive (on a GPU, 8 of Adam's 16 bytes per parameter); freeing them
    later changes nothing in it. (The parameters themselves outlive the block:
    PyTorch's MemTracker keeps them, with or without labkit: torch 2.13.)"""
    import gc
    import weakref

    model, opt, _ = _setup("adam", "fp32")
    with L.memory(model, opt) as m:
        model(torch.randn(16, 64)).sum().backward()
        opt.step()
    before = (dict(m.current), dict(m.peak), m.peak_total)
    gone = [weakref.ref(t) for t in (*_state_tensors(opt), opt)]
    del model, opt
    gc.collect()
    assert [r() for r in gone] == [None] * len(gone)
    assert (dict(m.current), dict(m.peak), m.peak_total) == before
    assert before[0]["Optstate"] > 0
