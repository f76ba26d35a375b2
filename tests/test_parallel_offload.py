"""labkit.parallel.offload: OffloadedOptimizer trains like the plain optimizer (and
like MasterWeights in bf16), moves (grad_bytes + param_bytes)·Ψ per step as
ZeRO-Offload accounts it, and the memory ledger sees its state in host memory."""

import pickle
from functools import partial

import pytest
import torch

import labkit.ledger as L
from labkit.ledger import on_host
from labkit.parallel.offload import OffloadedOptimizer, Transfer
from labkit.parallel.precision import MasterWeights
from labkit.theory.placement import PLACEMENTS

pytestmark = pytest.mark.numerics  # run again under other CPUs' kernels

BF16 = torch.bfloat16
STEPS = 5
OPTS = {"sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
        "adam": (torch.optim.Adam, {"lr": 1e-2})}


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 4)).to(dtype)  # Ψ = 676


def _data(dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    return torch.randn(32, 16, generator=g).to(dtype), torch.randn(32, 4, generator=g)


def _train(model, opt, steps=STEPS, rows=slice(None)):
    w = next(model.parameters())
    x, y = (t.to(w.device) for t in _data(w.dtype))
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[rows]).float(), y[rows]).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def rel_err(a, b):
    """max |a - b| / max |b| over one tensor."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def _bytes(ts):
    return sum(t.numel() * t.element_size() for t in ts)


@pytest.mark.parametrize("name", list(OPTS))
def test_fp32_training_equals_the_plain_optimizer(name):
    cls, kw = OPTS[name]
    start = [p.detach().clone() for p in _model().parameters()]
    plain = _model()
    ref = _train(plain, cls(plain.parameters(), **kw))
    model = _model()
    got = _train(model, OffloadedOptimizer(model.parameters(), cls, **kw))
    for a, b, s in zip(got, ref, start):
        assert rel_err(a, b) <= 1e-6  # (bitwise on CPU: the same ops on copies)
        assert rel_err(b, s) > 1e-3  # training moved them far more than that


@pytest.mark.parametrize("name", list(OPTS))
def test_bf16_training_equals_master_weights(name):
    cls, kw = OPTS[name]
    ref_model = _model(BF16)
    ref_opt = MasterWeights(ref_model.parameters(), cls, **kw)
    ref = _train(ref_model, ref_opt)
    model = _model(BF16)
    opt = OffloadedOptimizer(model.parameters(), cls, **kw)
    got = _train(model, opt)
    # bitwise: the same upcast, the same fp32 step, the same rounding to bf16; the
    # host only changes where the fp32 copies live (on CUDA the device optimizer
    # may use foreach kernels, and then equality is to fp32 rounding only)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    for a, b in zip(opt.master, ref_opt.master):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype,each_way", [(torch.float32, 4), (BF16, 2)])
def test_bytes_moved_per_step_is_zero_offloads_closed_form(dtype, each_way):
    model = _model(dtype)
    psi = sum(p.numel() for p in model.parameters())
    opt = OffloadedOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
    _train(model, opt, steps=3)
    # ZeRO-Offload (Ren et al. 2021, sec. 4.1): gradients down, parameters up, each
    # in the model's precision: 2Ψ + 2Ψ in mixed precision, 4Ψ + 4Ψ in fp32
    assert opt.transfers == [Transfer(each_way * psi, each_way * psi)] * 3
    assert opt.bytes_moved == [2 * each_way * psi] * 3
    cost = PLACEMENTS["ZeRO-Offload"].cost(psi, 1, grad_bytes=each_way,
                                           param_bytes=each_way)
    assert opt.bytes_moved[-1] == cost.pcie


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("made", ["before", "inside"])
def test_the_ledger_counts_optimizer_state_in_host_memory(dtype, made):
    model = _model(dtype)
    params = list(model.parameters())
    psi = sum(p.numel() for p in params)
    if made == "before":  # found through opt.host_resident()
        opt = OffloadedOptimizer(params, torch.optim.Adam, lr=1e-3)
        led = L.memory(model, opt)
    else:  # made inside the block: counted as host as it is created
        led = L.memory(model)
    with led as m:
        if made == "inside":
            opt = OffloadedOptimizer(params, torch.optim.Adam, lr=1e-3)
        _train(model, opt, steps=2)
    steps = [s["step"] for s in opt.state.values()]
    # host: fp32 master + Adam's m and v = 12 bytes/param (the ZeRO paper's K),
    # the fp32 gradient (4), and in bf16 the 2-byte transfer buffer
    assert m.host["Optstate"] == 12 * psi + _bytes(steps)
    assert m.host["Gradient"] == 4 * psi
    assert m.host["Other"] == (2 * psi if dtype == BF16 else 0)
    assert m.host["Temp"] == 0
    # device: the model's parameters and gradients, and no optimizer state ever
    assert m.current["Parameter"] == _bytes(params)
    assert m.current["Gradient"] == _bytes(p.grad for p in params)
    assert m.peak["Optstate"] == 0 and all(s.peak["Optstate"] == 0 for s in m.steps)
    assert len(m.steps) == 2
    # the step runs on the host: nothing it allocates is device memory
    assert m.phase_peaks["optimizer"]["Temp"] == 0
    assert m.host_peak["Temp"] > 0  # Adam's temporaries, on the host
    assert pickle.loads(pickle.dumps(m)).host == m.host  # travels back from a rank
    h = L.holdings(model, opt)
    assert h.optimizer_state == 0
    assert h.host == sum(m.host.values())
    # theory.placement agrees on the device side: O Offloaded keeps nothing there
    assert PLACEMENTS["ZeRO-Offload"].cost(psi, 1).persistent["O"] == 0


def test_host_counting_by_hand():
    t = torch.ones(256)  # 1 KiB
    with on_host("Optstate"):  # no ledger recording: nothing happens
        torch.zeros(8)
    with L.memory() as m:
        with on_host("Optstate"):
            kept = torch.zeros(512)  # 2 KiB, made in host memory
        L.count_as(t, "Other", host=True)
        assert m.host["Optstate"] == 2048 and m.host["Other"] == 1024
        del kept  # freed: leaves the host count
        assert m.host["Optstate"] == 0 and m.host_peak["Optstate"] == 2048
    assert sum(m.current.values()) == 0 and m.peak["Optstate"] == 0
    with pytest.raises(ValueError, match="category"):
        with on_host("Host"):
            pass


def test_on_a_cpu_only_machine_host_and_device_are_separate_tensors():
    model = _model()
    opt = OffloadedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    _train(model, opt, steps=1)
    device_ptrs = {p.data_ptr() for p in model.parameters()}
    device_ptrs |= {p.grad.data_ptr() for p in model.parameters()}
    host = [t for ts in opt.host_resident().values() for t in ts]
    assert all(t.device.type == "cpu" for t in host)
    assert not device_ptrs & {t.data_ptr() for t in host}  # real copies were made
    assert not any(t.is_pinned() for t in host)  # pinned only for CUDA parameters


def test_state_dict_round_trips_and_mistakes():
    model = _model()
    opt = OffloadedOptimizer(model.parameters(), torch.optim.Adam, lr=1e-2)
    _train(model, opt, steps=2)
    sd = opt.state_dict()
    ref = _train(model, opt, steps=2)
    model2 = _model()
    opt2 = OffloadedOptimizer(model2.parameters(), torch.optim.Adam, lr=1e-2)
    opt2.load_state_dict(sd)
    for a, b in zip(_train(model2, opt2, steps=2), ref):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="closure"):
        opt.step(lambda: 0.0)
    opt.param_groups[0]["lr"] = 0.5  # a scheduler's change reaches the host
    opt.step()
    assert opt.inner.param_groups[0]["lr"] == 0.5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_host_buffers_are_pinned_and_training_matches():
    model = _model(BF16).cuda()
    opt = OffloadedOptimizer(model.parameters(), torch.optim.Adam, lr=1e-2)
    assert all(t.is_pinned() and t.device.type == "cpu"
               for ts in opt.host_resident().values() for t in ts)
    got = _train(model, opt)
    ref_model = _model(BF16)
    ref = _train(ref_model, MasterWeights(ref_model.parameters(), torch.optim.Adam,
                                          lr=1e-2))
    psi = sum(p.numel() for p in model.parameters())
    assert opt.bytes_moved == [4 * psi] * STEPS
    for a, b in zip(got, ref):  # CUDA vs CPU matmuls: within bf16 rounding
        assert rel_err(a.cpu(), b) <= 2**-7


# -- with ZeRO sharding on N ranks: each rank offloads its own 1/N -----------------


def _sharded(rank, world_size, name):
    from labkit.parallel.zero import ShardedOptimizer

    cls, kw = OPTS[name]
    model = _model()
    opt = ShardedOptimizer(model.parameters(),
                           partial(OffloadedOptimizer, optimizer_cls=cls),
                           reduce_scatter_gradients=True, **kw)
    rows = slice(rank * 32 // world_size, (rank + 1) * 32 // world_size)
    params = _train(model, opt, rows=rows)
    return {"params": params, "moved": opt._inner.bytes_moved}


@pytest.mark.parametrize("name", list(OPTS))
def test_sharded_offload_on_four_ranks(cluster, name):
    cls, kw = OPTS[name]
    plain = _model()
    ref = _train(plain, cls(plain.parameters(), **kw))
    psi = sum(p.numel() for p in plain.parameters())
    n = 4
    assert psi % n == 0  # no padding: every rank's slice is exactly Ψ/N
    cost = PLACEMENTS["ZeRO-Offload"].cost(psi, n, grad_bytes=4, param_bytes=4)
    for r in cluster.run(_sharded, name).values:
        for a, b in zip(r["params"], ref):
            # averaged gradients over ranks differ from one batch's in rounding
            assert rel_err(a, b) <= 1e-5
        assert r["moved"] == [8 * psi // n] * STEPS == [cost.pcie] * STEPS


def _sharded_ledger(rank, world_size):
    from labkit.ledger import memory
    from labkit.parallel.zero import ShardedOptimizer

    model = _model()
    # built before the ledger starts, as a chapter does: the ledger must learn from
    # the optimizer which of its tensors live in host memory
    opt = ShardedOptimizer(model.parameters(),
                           partial(OffloadedOptimizer, optimizer_cls=torch.optim.SGD),
                           reduce_scatter_gradients=True, lr=0.1)
    rows = slice(rank * 32 // world_size, (rank + 1) * 32 // world_size)
    with memory(model, opt) as m:
        _train(model, opt, rows=rows)
    return m


def test_sharded_offload_state_is_host_memory_in_the_ledger(cluster):
    psi = sum(p.numel() for p in _model().parameters())
    for m in cluster.run(_sharded_ledger).values:
        # SGD without momentum: the host keeps the fp32 master slice and an fp32
        # copy of the gradient slice, Ψ/N elements each; the device no optimizer state
        assert m.host["Optstate"] == 4 * psi // 4
        assert m.host["Gradient"] == 4 * psi // 4
        assert m.current["Optstate"] == 0 and m.peak["Optstate"] == 0
