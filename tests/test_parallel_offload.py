"""labkit.parallel.offload: OffloadedOptimizer trains like the plain optimizer (and
like MasterWeights in bf16), moves (grad_bytes + param_bytes)·Ψ per step as
ZeRO-Offload accounts it, and the memory ledger sees its state in host memory."""

import pickle
from functools import partial

import pytest
import torch

import labkit.ledger as L
from labkit.ledger import on_host
from labkit.numerics import Oracle
from labkit.parallel.offload import HostCopy, OffloadedOptimizer
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


def _train(model, opt, steps=STEPS, rows=slice(None), pieces=1):
    """`steps` steps on the batch's `rows`, the gradient summed from `pieces`
    equal parts (1: at once); the loss in float32, or float64 for a float64
    model."""
    w = next(model.parameters())
    x, y = (t.to(w.device) for t in _data(w.dtype))
    y = y.to(torch.float64 if w.dtype == torch.float64 else torch.float32)
    for _ in range(steps):
        opt.zero_grad()
        for xs, ys in zip(x[rows].chunk(pieces), y[rows].chunk(pieces)):
            (torch.nn.functional.mse_loss(model(xs).to(ys.dtype), ys) / pieces
             ).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _plain(name, dtype=torch.float32, pieces=1):
    """The plain optimizer's training in one process, in `dtype`."""
    cls, kw = OPTS[name]
    model = _model(dtype)
    return _train(model, cls(model.parameters(), **kw), pieces=pieces)


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
    # bitwise on CPU: the same ops on copies
    for i, (a, b) in enumerate(zip(got, ref)):
        assert torch.equal(a, b), (f"{name}, tensor {i}: off by "
                                   f"{(a - b).abs().max():.1e}, bit for bit expected")
    # and training moved every tensor: the comparison means something
    for i, (b, s) in enumerate(zip(ref, start)):
        assert not torch.equal(b, s), f"{name}: tensor {i} did not move"


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
    for what, ours, theirs in (("weights", got, ref),
                               ("masters", opt.master, ref_opt.master)):
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert torch.equal(a, b), (
                f"{name}, {what}, tensor {i}: off by {(a - b).abs().max():.1e}, "
                "bit for bit expected")


@pytest.mark.parametrize("dtype,each_way", [(torch.float32, 4), (BF16, 2)])
def test_bytes_moved_per_step_is_zero_offloads_closed_form(dtype, each_way):
    model = _model(dtype)
    psi = sum(p.numel() for p in model.parameters())
    opt = OffloadedOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
    _train(model, opt, steps=3)
    # ZeRO-Offload (Ren et al. 2021, sec. 4.1): gradients down, parameters up, each
    # in the model's precision: 2Ψ + 2Ψ in mixed precision, 4Ψ + 4Ψ in fp32
    want = [HostCopy(each_way * psi, each_way * psi)] * 3
    assert opt.host_copies == want, f"host copies {opt.host_copies}, {want} expected"
    assert opt.bytes_moved == [2 * each_way * psi] * 3, (
        f"{opt.bytes_moved} B a step, 2 x {each_way}Ψ = {2 * each_way * psi} expected")
    cost = PLACEMENTS["ZeRO-Offload"].cost(psi, 1, grad_bytes=each_way,
                                           param_bytes=each_way)
    assert opt.bytes_moved[-1] == cost.pcie, (
        f"{opt.bytes_moved[-1]} B a step, the calculator's {cost.pcie}")


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
    want = {"Optstate": 12 * psi + _bytes(steps), "Gradient": 4 * psi,
            "Other": 2 * psi if dtype == BF16 else 0, "Temp": 0}
    got = {k: m.host[k] for k in want}
    assert got == want, f"host bytes {got}, {want} expected"
    # device: the model's parameters and gradients, and no optimizer state ever
    want = {"Parameter": _bytes(params),
            "Gradient": _bytes(p.grad for p in params)}
    got = {k: m.current[k] for k in want}
    assert got == want, f"device bytes {got}, {want} expected"
    peaks = [m.peak["Optstate"]] + [s.peak["Optstate"] for s in m.steps]
    assert peaks == [0] * 3, f"device optimizer state peaked at {peaks} B, 0"
    # the step runs on the host: nothing it allocates is device memory
    temp = m.phase_peaks["optimizer"]["Temp"]
    assert temp == 0, f"the step allocated {temp} B on the device"
    # Adam's temporaries, on the host
    assert m.host_peak["Temp"] > 0, "no host temporaries recorded"
    # travels back from a rank
    assert pickle.loads(pickle.dumps(m)).host == m.host, "host bytes lost in pickle"
    h = L.holdings(model, opt)
    assert (h.optstate, h.host) == (0, sum(m.host.values())), (
        f"holdings: {h.optstate} B of state on the device, {h.host} B on "
        f"the host; 0 and the ledger's {sum(m.host.values())} expected")
    # theory.placement agrees on the device side: O Offloaded keeps nothing there
    kept = PLACEMENTS["ZeRO-Offload"].cost(psi, 1).persistent["O"]
    assert kept == 0, f"the calculator keeps {kept} B of O on the device"


def test_host_counting_by_hand():
    t = torch.ones(256)  # 1 KiB
    with on_host("Optstate"):  # no ledger recording: nothing happens
        torch.zeros(8)
    with L.memory() as m:
        with on_host("Optstate"):
            kept = torch.zeros(512)  # 2 KiB, made in host memory
        L.count_as(t, "Other", host=True)
        got = (m.host["Optstate"], m.host["Other"])
        assert got == (2048, 1024), f"host Optstate, Other: {got}, (2048, 1024)"
        del kept  # freed: leaves the host count
        got = (m.host["Optstate"], m.host_peak["Optstate"])
        assert got == (0, 2048), f"host Optstate now, at peak: {got}, (0, 2048)"
    got = (sum(m.current.values()), m.peak["Optstate"])
    assert got == (0, 0), f"device bytes, Optstate peak: {got}, (0, 0) expected"
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
    assert all(t.device.type == "cpu" for t in host), "a host tensor is not on the CPU"
    # real copies were made
    assert not device_ptrs & {t.data_ptr() for t in host}, (
        "a host tensor shares memory with the device")
    # pinned only for CUDA parameters
    assert not any(t.is_pinned() for t in host), "a host tensor is pinned"


def test_state_dict_round_trips_and_mistakes():
    model = _model()
    opt = OffloadedOptimizer(model.parameters(), torch.optim.Adam, lr=1e-2)
    _train(model, opt, steps=2)
    sd = opt.state_dict()
    ref = _train(model, opt, steps=2)
    model2 = _model()
    opt2 = OffloadedOptimizer(model2.parameters(), torch.optim.Adam, lr=1e-2)
    opt2.load_state_dict(sd)
    for i, (a, b) in enumerate(zip(_train(model2, opt2, steps=2), ref)):
        assert torch.equal(a, b), f"tensor {i}: resumed is not bit for bit straight"
    with pytest.raises(ValueError, match="closure"):
        opt.step(lambda: 0.0)
    opt.param_groups[0]["lr"] = 0.5  # a scheduler's change reaches the host
    opt.step()
    lr = opt.inner.param_groups[0]["lr"]
    assert lr == 0.5, f"the host optimizer's lr is {lr}, 0.5 expected"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_host_buffers_are_pinned_and_training_matches():
    model = _model(BF16).cuda()
    opt = OffloadedOptimizer(model.parameters(), torch.optim.Adam, lr=1e-2)
    assert all(t.is_pinned() and t.device.type == "cpu"
               for ts in opt.host_resident().values() for t in ts), (
        "a host buffer is not pinned CPU memory")
    got = _train(model, opt)
    ref_model = _model(BF16)
    ref = _train(ref_model, MasterWeights(ref_model.parameters(), torch.optim.Adam,
                                          lr=1e-2))
    psi = sum(p.numel() for p in model.parameters())
    assert opt.bytes_moved == [4 * psi] * STEPS, (opt.bytes_moved, 4 * psi)
    # CUDA vs CPU matmuls: both as far from float64 as bf16 on the CPU is
    oracle = Oracle(_plain("adam", torch.float64), {"CPU, bf16": ref},
                    dtype=torch.bfloat16)
    oracle.check([a.cpu() for a in got], "CUDA, bf16, Adam")


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
    return {"params": params, "moved": opt.optim.bytes_moved}


@pytest.mark.parametrize("name", list(OPTS))
def test_sharded_offload_on_four_ranks(cluster, name):
    psi = sum(p.numel() for p in _model().parameters())
    n = 4
    assert psi % n == 0, psi  # no padding: every rank's slice is exactly Ψ/N
    cost = PLACEMENTS["ZeRO-Offload"].cost(psi, n, grad_bytes=4, param_bytes=4)
    # averaged gradients over ranks differ from one batch's in rounding: as far
    # from float64 as one process's (whole batch, or 4 quarters as the ranks)
    oracle = Oracle(_plain(name, torch.float64),
                    {"whole batch": _plain(name), "4 quarters": _plain(name, pieces=n)})
    start = [p.detach() for p in _model().parameters()]
    oracle.resolves(start, f"{name}: the untrained model")
    for rank, r in enumerate(cluster.run(_sharded, name).values):
        oracle.check(r["params"], f"{name}, rank {rank}")
        moved = [8 * psi // n] * STEPS
        assert r["moved"] == moved == [cost.pcie] * STEPS, (
            f"rank {rank}: {r['moved']} B a step, 8Ψ/N = {8 * psi // n} and the "
            f"calculator's {cost.pcie} expected")


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
        got = (m.host["Optstate"], m.host["Gradient"])
        assert got == (psi, psi), f"host Optstate, Gradient: {got}, 4Ψ/4 each"
        got = (m.current["Optstate"], m.peak["Optstate"])
        assert got == (0, 0), f"device Optstate now, at peak: {got}, (0, 0)"
