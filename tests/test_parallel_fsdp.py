"""labkit.parallel.fsdp: ZeRO-3 on 4 gloo ranks against single-process training of
the same model on the same global batch (each rank a quarter of it), and against
PyTorch's FSDP2 (fully_shard); what each rank sends and holds, measured with the
ledgers, against 3(N-1)/N of the padded parameters and 1/N of them."""

import math
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.models import D, H, TiedFrozenNet, V

from labkit.numerics import Oracle, rel_err
from labkit.parallel.precision import MasterWeights

pytestmark = pytest.mark.numerics  # run again under other CPUs' kernels

N = 4
STEPS = 5
OPTS = {"sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
        "adam": (torch.optim.Adam, {"lr": 1e-2})}


def _setup():
    torch.manual_seed(0)
    model = TiedFrozenNet()  # its tied weight and `gain`: owned by the root unit
    g = torch.Generator().manual_seed(1)
    tok, y = (torch.randint(0, V, (8, 5), generator=g) for _ in range(2))
    return model, tok, y


def _loss(out, y):
    return F.cross_entropy(out.float().flatten(0, 1), y.flatten())


def _params(model):
    return {k: v.detach().clone()
            for k, v in model.named_parameters(remove_duplicate=False)}


def _reference(opt, dtype=torch.float32, pieces=1):
    """Single-process training on the whole batch, its gradient summed from
    `pieces` equal parts (1: all at once), in `dtype`."""
    model, tok, y = _setup()
    model.to(dtype)
    cls, kw = OPTS[opt]
    o = cls([p for p in model.parameters() if p.requires_grad], **kw)
    for _ in range(STEPS):
        o.zero_grad()
        for ts, ys in zip(tok.chunk(pieces), y.chunk(pieces)):
            (F.cross_entropy(model(ts).flatten(0, 1), ys.flatten()) / pieces
             ).backward()
        o.step()
    return _params(model)


def _oracle(run, *args):
    """labkit.numerics.Oracle of `run(*args, dtype=..., pieces=...)`: exact in
    float64; one process in float32 on the whole batch and on 4 quarters (as the
    ranks split it)."""
    return Oracle(run(*args, dtype=torch.float64),
                  {"whole batch": run(*args), "4 quarters": run(*args, pieces=N)})


def _train(rank, world_size, opt, prefetch=True, wrap=None, root=True):
    import warnings

    from labkit.ledger import overlap_fraction
    from labkit.parallel.fsdp import FullyShardedDataParallel

    model, tok, y = _setup()
    rows = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        fsdp = FullyShardedDataParallel(model, prefetch=prefetch, wrap=wrap,
                                        root=root)
    cls, kw = OPTS[opt]
    o = cls([p for p in fsdp.parameters() if p.requires_grad], **kw)
    for _ in range(STEPS):
        o.zero_grad()
        _loss(fsdp(tok[rows]), y[rows]).backward()
        fsdp.finish_gradient_synchronization()
        o.step()
    return {"full": fsdp.gather_full_params(), "units": fsdp.units,
            "shapes": {k: tuple(p.shape) for k, p in model.named_parameters()},
            "grads": {k: (p.grad.dtype, tuple(p.grad.shape))
                      for k, p in model.named_parameters() if p.grad is not None},
            "scale": model.scale.clone(), "events": fsdp.events,
            "overlap": overlap_fraction(fsdp.events),
            "warnings": [str(w.message) for w in said]}


def _linears(m):
    """Shard up, down and frozen; the tied weight and gain: the root unit's, or
    replicated with root=False."""
    return isinstance(m, nn.Linear) and m.out_features in (D, H)


@pytest.fixture(scope="module")
def trained(cluster):
    runs = {(opt, True, None): (opt, True, None) for opt in OPTS}
    runs["sgd", False, None] = ("sgd", False, None)
    runs["sgd", True, "some"] = ("sgd", True, _linears, False)
    runs["sgd", True, "some, root"] = ("sgd", True, _linears)
    return {k: cluster.run(_train, *a).values for k, a in runs.items()}


@pytest.fixture(scope="module")
def reference():
    return {opt: _oracle(_reference, opt) for opt in OPTS}


@pytest.mark.parametrize("opt", list(OPTS))
def test_matches_single_process_training(trained, reference, opt):
    oracle, start = reference[opt], _params(_setup()[0])
    # the ranks add 4 quarter-batch gradients in another order than one process:
    # as far from float64 as one process is (labkit.numerics); the untrained
    # weights are far outside that
    oracle.resolves(start, f"{opt}: the untrained model")
    for rank, r in enumerate(trained[opt, True, None]):
        where = f"{opt}, rank {rank}"
        assert r["full"].keys() == oracle.exact.keys(), (where, sorted(r["full"]))
        for k, v in r["full"].items():
            assert v.shape == start[k].shape and v.dtype == torch.float32, (
                f"{where}: {k} is {v.dtype} {tuple(v.shape)}, expected float32 "
                f"{tuple(start[k].shape)}")
        oracle.check(r["full"], where)
        for k, want in (("head.weight", r["full"]["embed.weight"]),
                        ("frozen.weight", start["frozen.weight"])):
            assert torch.equal(r["full"][k], want), (
                f"{where}: {k} is not bit for bit the tied or frozen original")
        # a buffer: not trained
        assert torch.equal(r["scale"], _setup()[0].scale), f"{where}: scale moved"
        for k in ("embed.weight", "down.bias", "gain"):
            moved = rel_err(r["full"][k], start[k])
            assert moved > 100 * oracle.allowed, (
                f"{where}: {k} moved {moved:.1e}, not more than 100 x the "
                f"{oracle.allowed:.1e} allowed")


def test_each_rank_holds_a_padded_quarter_of_each_parameter(trained):
    r = trained["sgd", True, None][0]
    # the root owns the tied weight and gain; embed and head own nothing then
    assert r["units"] == ["(root)", "up", "down", "frozen"], r["units"]
    sizes = {"embed.weight": V * D, "up.weight": H * D, "up.bias": H,
             "down.weight": D * H, "down.bias": D, "gain": 2,
             "frozen.weight": D * D, "frozen.bias": D}
    shapes = {k: (math.ceil(v / N),) for k, v in sizes.items()}
    assert r["shapes"] == shapes, f"shard shapes {r['shapes']}, {shapes} expected"
    # every trainable shard has an fp32 gradient of its own shape; frozen: none
    grads = {k: (torch.float32, (math.ceil(v / N),))
             for k, v in sizes.items() if not k.startswith("frozen")}
    assert r["grads"] == grads, f"gradients {r['grads']}, {grads} expected"


def test_prefetch_changes_timing_not_results(trained):
    # the same operations in the same order, only started earlier: bit for bit
    for rank, (on, off) in enumerate(zip(trained["sgd", True, None],
                                         trained["sgd", False, None])):
        differ = [k for k, v in on["full"].items()
                  if not torch.equal(v, off["full"][k])]
        assert not differ, f"rank {rank}: {differ} differ with and without prefetch"


def test_modules_wrap_leaves_out_stay_replicated(trained, reference):
    # root=False: what no selected module owns stays whole, and is said once
    for rank, r in enumerate(trained["sgd", True, "some"]):
        assert r["units"] == ["up", "down", "frozen"], r["units"]
        shapes = {k: r["shapes"][k] for k in ("embed.weight", "gain", "up.weight")}
        # embed and gain replicated, whole; up's weight sharded
        assert shapes == {"embed.weight": (V, D), "gain": (2,),
                          "up.weight": (H * D // N,)}, shapes
        assert len(r["warnings"]) == 1, r["warnings"]
        said = r["warnings"][0]
        for part in ("2 parameter(s)", "embed.weight = head.weight (156 elements, "
                     "624 B)", "gain (2 elements, 8 B)"):
            assert part in said, f"rank {rank}: {part!r} not in the warning {said!r}"
        reference["sgd"].check(r["full"], f"some modules wrapped, rank {rank}")


def test_the_root_unit_takes_what_no_module_wrapped(trained, reference):
    # root=True (the default): the root owns the tied weight and gain; nothing
    # is replicated, nothing said
    for rank, r in enumerate(trained["sgd", True, "some, root"]):
        assert r["units"] == ["(root)", "up", "down", "frozen"], r["units"]
        shapes = {k: r["shapes"][k] for k in ("embed.weight", "gain")}
        assert shapes == {"embed.weight": (V * D // N,), "gain": (1,)}, shapes
        assert r["warnings"] == [], r["warnings"]
        reference["sgd"].check(r["full"], f"root unit, rank {rank}")


def test_spans_are_recorded(trained):
    for key in (("sgd", True, None), ("sgd", False, None)):
        for r in trained[key]:
            names = {e.name.split()[0] for e in r["events"]}
            assert {"forward", "backward", "all_gather", "reduce_scatter"} <= names, (
                names)
            assert all(e.end >= e.start for e in r["events"]), (
                "a span ends before it starts")
            # how much of the communication overlaps compute is a timing: not
            # asserted


# ------------------------------------------------------- bf16 and PyTorch's FSDP2


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 21), nn.ReLU(), nn.Linear(21, 7), nn.ReLU(),
                         nn.Linear(7, 3))


def _mlp_data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 10, generator=g), torch.randn(8, 3, generator=g)


def _one_process(make, steps=3, dtype=torch.float32, pieces=1):
    """make()'s model trained by SGD in one process on the whole batch, its
    gradient summed from `pieces` equal parts: in float32 or float64, or in bf16
    with fp32 master weights (MasterWeights: compute in bf16, step in fp32, as
    compute_dtype=bf16 does). The weights, by name."""
    m = make()
    names = [k for k, _ in m.named_parameters()]
    x, y = _mlp_data()
    m.to(dtype)
    o = (MasterWeights(m.parameters(), torch.optim.SGD, lr=0.1)
         if dtype == torch.bfloat16 else torch.optim.SGD(m.parameters(), lr=0.1))
    for _ in range(steps):
        o.zero_grad()
        for xs, ys in zip(x.chunk(pieces), y.chunk(pieces)):
            out = m(xs.to(dtype))
            out = out.float() if dtype == torch.bfloat16 else out
            (F.mse_loss(out, ys.to(out.dtype)) / pieces).backward()
        o.step()
    if dtype == torch.bfloat16:
        return dict(zip(names, (w.clone() for w in o.master)))
    return _params(m)


def _moved(oracle, start):
    """The same Oracle for what training moved the weights by: bf16 keeps 8 bits,
    so its error is a sizeable part of the update, and a small one of the
    weights."""
    def minus(w):
        return {k: v - start[k].to(v.dtype) for k, v in w.items()}

    return Oracle(minus(oracle.exact),
                  {n: minus(w) for n, w in oracle.one_process.items()},
                  dtype=oracle.dtype)


def _oracles(make):
    """make()'s model after 3 SGD steps: an Oracle of the weights from float32
    runs (whole batch, 4 quarters as the ranks split it, 8 rows as _accumulate
    does), the same for the update, one from bf16 runs for the update, and the
    start."""
    exact = _one_process(make, dtype=torch.float64)
    start = _params(make())
    fp32, bf16 = (Oracle(exact, {
        "whole batch": _one_process(make, dtype=dtype),
        "4 quarters": _one_process(make, dtype=dtype, pieces=N),
        "8 rows": _one_process(make, dtype=dtype, pieces=8)}, dtype=dtype)
        for dtype in (torch.float32, torch.bfloat16))
    return fp32, _moved(fp32, start), _moved(bf16, start), start


@pytest.fixture(scope="module")
def mlp_oracles():
    return _oracles(_mlp)


def _mlp_train(rank, world_size, how, steps=3):
    m = _mlp()
    x, y = _mlp_data()
    rows = slice(rank * 2, rank * 2 + 2)
    if how == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        for layer in m:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        wrapped, sync = m, None
    else:
        from labkit.parallel.fsdp import FullyShardedDataParallel

        dtype = torch.bfloat16 if how == "bf16" else None
        wrapped = FullyShardedDataParallel(m, compute_dtype=dtype)
        sync = wrapped.finish_gradient_synchronization
    o = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    dtypes = set()
    for _ in range(steps):
        o.zero_grad()
        out = wrapped(x[rows])
        dtypes.add(out.dtype)
        F.mse_loss(out.float(), y[rows]).backward()
        if sync:
            sync()
        o.step()
    if how == "fsdp2":
        full = {k: p.full_tensor().detach().clone() for k, p in m.named_parameters()}
    else:
        full = wrapped.gather_full_params()
    return {"full": full, "dtypes": dtypes,
            "kept": {(p.dtype, p.grad.dtype) for p in m.parameters()}}


@pytest.fixture(scope="module")
def mlp_runs(cluster):
    return {how: cluster.run(_mlp_train, how).values
            for how in ("fp32", "bf16", "fsdp2")}


def test_agrees_with_pytorchs_fsdp2(mlp_runs, mlp_oracles):
    oracle = mlp_oracles[0]
    oracle.resolves(mlp_oracles[3], "the untrained MLP")
    for rank, (ours, theirs) in enumerate(zip(mlp_runs["fp32"], mlp_runs["fsdp2"])):
        # both as far from float64 as one process, so within 2x that of each other
        oracle.check(ours["full"], f"ours, rank {rank}")
        oracle.check(theirs["full"], f"FSDP2, rank {rank}")


def _check_bf16(oracles, full, where):
    """bf16 keeps 8 bits: each weight, activation and gradient it holds is
    rounded by up to 2^-9 relative, so the update is off by many of those: the
    bf16 Oracle holds it to what one process computing in bf16 is off by. And the
    update is farther from float64 than fp32's allows by 100x: bf16 really ran."""
    _, fp32, bf16, start = oracles
    update = {k: v - start[k] for k, v in full.items()}
    bf16.check(update, where + ": the update, bf16")
    err = rel_err(update, fp32.exact)
    assert err > 100 * fp32.allowed, (
        f"{where}: the update is {err:.1e} from float64, not more than 100 x the "
        f"{fp32.allowed:.1e} that fp32 is allowed: did bf16 run?")


def test_bf16_compute_keeps_fp32_shards_and_gradients(mlp_runs, mlp_oracles):
    for rank, r in enumerate(mlp_runs["bf16"]):
        # computed in bf16, stored in fp32
        assert r["dtypes"] == {torch.bfloat16}, (rank, r["dtypes"])
        assert r["kept"] == {(torch.float32, torch.float32)}, (rank, r["kept"])
        _check_bf16(mlp_oracles, r["full"], f"rank {rank}")


def _normed():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 21), nn.LayerNorm(21), nn.ReLU(),
                         nn.Linear(21, 3))


def _normed_train(rank, world_size, dtype, steps=3):
    from labkit.parallel.fsdp import FullyShardedDataParallel

    m = _normed()
    x, y = _mlp_data()
    seen = []
    m[1].register_forward_hook(lambda mod, args, out: seen.append(
        (args[0].dtype, mod.weight.dtype, out.dtype)))
    wrapped = FullyShardedDataParallel(m, compute_dtype=dtype, root=False,
                                       wrap=lambda mod: isinstance(mod, nn.Linear))
    o = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    for _ in range(steps):
        o.zero_grad()
        F.mse_loss(wrapped(x[rank * 2:rank * 2 + 2]).float(),
                   y[rank * 2:rank * 2 + 2]).backward()
        wrapped.finish_gradient_synchronization()
        o.step()
    return {"full": wrapped.gather_full_params(), "seen": set(seen),
            "norm": {(p.dtype, p.grad.dtype, type(p)) for p in m[1].parameters()}}


def test_bf16_reaches_modules_left_out_of_wrap(cluster):
    # a LayerNorm outside every unit stays replicated, fp32, and still computes in
    # bf16: it gets bf16 inputs from the unit before it, and mixing them with fp32
    # weights would fail; its weight gradients come back fp32 and are all-reduced
    oracles = _oracles(_normed)
    for rank, r in enumerate(cluster.run(_normed_train, torch.bfloat16).values):
        bf16 = (torch.bfloat16,) * 3
        assert r["seen"] == {bf16}, f"rank {rank}: LayerNorm saw {r['seen']}"
        fp32 = (torch.float32, torch.float32, nn.Parameter)
        assert r["norm"] == {fp32}, f"rank {rank}: LayerNorm kept {r['norm']}"
        _check_bf16(oracles, r["full"], f"LayerNorm left out, rank {rank}")
    # and fp32 is unchanged
    for rank, r in enumerate(cluster.run(_normed_train, None).values):
        assert r["seen"] == {(torch.float32,) * 3}, (rank, r["seen"])
        oracles[0].check(r["full"], f"LayerNorm left out, fp32, rank {rank}")


# ------------------------------------------------------------- traffic, memory
W = 512


def _big():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(W, W), nn.ReLU(), nn.Linear(W, W), nn.ReLU(),
                         nn.Linear(W, W), nn.ReLU(), nn.Linear(W, 10))


PADDED = 3 * (W * W + W) + W * 10 + 12  # the last bias: 10 elements padded to 12
LARGEST = W * W + W  # the largest unit, whole, in elements


def _measure(rank, world_size):
    from labkit import ledger
    from labkit.parallel.fsdp import FullyShardedDataParallel

    model = _big()
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(16, W, generator=g), torch.randint(0, 10, (16,), generator=g)
    fsdp = FullyShardedDataParallel(model)
    o = torch.optim.SGD(fsdp.parameters(), lr=1e-3)

    def step():
        o.zero_grad()
        F.cross_entropy(fsdp(x), y).backward()
        fsdp.finish_gradient_synchronization()
        o.step()

    step()  # the first forward records the order prefetch follows
    with ledger.memory(fsdp, o) as m:
        step()
    with ledger.traffic() as t:
        step()
    return {"memory": m, "traffic": t}


@pytest.fixture(scope="module")
def measured(cluster):
    return cluster.run(_measure).values


def test_traffic_is_three_times_n_minus_1_over_n_of_the_padded_parameters(measured):
    share = (N - 1) / N * 4 * PADDED  # one all-gather, or one reduce-scatter
    for r in measured:
        t = r["traffic"]
        assert set(t.by_op()) == {"all_gather", "all_to_all"}, t.by_op()
        # wire bytes: the payload plus gloo's headers, a few hundred bytes a call,
        # well under the 1% allowed
        for op, times in (("all_gather", 2),  # forward + backward
                          ("all_to_all", 1),  # the reduce-scatter
                          (None, 3)):
            sent = t.sum("wire_bytes", op=op) if op else t.sum("wire_bytes")
            assert abs(sent - times * share) <= 0.01 * times * share, (
                f"{op or 'in all'}: wrote {sent:,} B, {times} x (N-1)/N·4·padded = "
                f"{times * share:,.0f} ± 1% expected")


def test_each_rank_holds_a_quarter_and_at_most_two_units_whole(measured):
    shards = 4 * PADDED // N
    for r in measured:
        m = r["memory"]
        held = m.current["Parameter"]  # after the step: shards only
        assert held == shards, f"{held:,} B of parameters held, {shards:,} expected"
        # at the peak: the shards, the unit computing and the one prefetched
        peak, most = m.peak["Parameter"], shards + 2 * 4 * LARGEST
        assert shards < peak <= most, (f"parameter peak {peak:,} B, expected in "
                                       f"({shards:,}, {most:,}]")


# ------------------------------------------------------------------------- errors


def test_no_process_group():
    from labkit.parallel.fsdp import FullyShardedDataParallel

    with pytest.raises(RuntimeError, match="process group"):
        FullyShardedDataParallel(nn.Linear(2, 2))


def _mistakes(rank, world_size):
    from labkit.parallel import guards
    from labkit.parallel.fsdp import FullyShardedDataParallel

    def error(fn):
        try:
            fn()
        except (RuntimeError, ValueError) as e:
            return str(e)

    out = {"meta": error(lambda: FullyShardedDataParallel(
               nn.Linear(2, 2, device="meta"))),
           "nothing": error(lambda: FullyShardedDataParallel(
               _mlp(), wrap=lambda m: isinstance(m, nn.Conv1d), root=False)),
           "dtype": error(lambda: FullyShardedDataParallel(
               _mlp(), compute_dtype=torch.int8))}
    fsdp = FullyShardedDataParallel(_mlp())
    o = torch.optim.SGD(fsdp.parameters(), lr=0.1)
    fsdp(torch.ones(2, 10)).sum().backward()
    out["early"] = error(o.step)
    fsdp.finish_gradient_synchronization()
    out["after"] = error(o.step)
    fsdp.close()
    out["hook_left"] = fsdp in guards._LIVE or any(
        m._forward_pre_hooks or m._forward_hooks for m in fsdp.module.modules())
    return out


def test_mistakes_say_what_happened(cluster):
    for r in cluster.run(_mistakes).values:
        assert "is on device meta" in r["meta"] and "gloo" in r["meta"], r["meta"]
        assert "selected no module" in r["nothing"], r["nothing"]
        assert "floating dtype" in r["dtype"], r["dtype"]
        assert "finish_gradient_synchronization() before" in r["early"], r["early"]
        assert r["after"] is None and not r["hook_left"], (r["after"], r["hook_left"])


def _accumulate(rank, world_size, hold=False):
    """Two micro-batches of one row per rank and step: each reduce-scattered
    (hold=False), or the first's whole gradient held and sent with the second's
    (set_requires_gradient_sync). Step 2 under the traffic ledger, step 3 under
    the memory ledger."""
    from labkit import ledger
    from labkit.parallel.fsdp import FullyShardedDataParallel

    m = _mlp()
    x, y = _mlp_data()
    fsdp = FullyShardedDataParallel(m)
    o = torch.optim.SGD(fsdp.parameters(), lr=0.1)
    out = {}
    for step in range(3):
        watch = {1: ledger.traffic, 2: lambda: ledger.memory(fsdp, o)}.get(step)
        with watch() if watch else nullcontext() as seen:
            o.zero_grad()
            for last, row in enumerate((2 * rank, 2 * rank + 1)):
                fsdp.set_requires_gradient_sync(not hold or bool(last))
                (F.mse_loss(fsdp(x[row:row + 1]), y[row:row + 1]) / 2).backward()
            fsdp.finish_gradient_synchronization()
            o.step()
        if watch:
            out[("traffic", "memory")[step - 1]] = seen
    with torch.no_grad():  # evaluation: gathers and frees, no backward hooks
        out["eval"] = fsdp(x)
    out.update(full=fsdp.gather_full_params(),
               held=sum(p.numel() for p in m.parameters()))
    return out


@pytest.fixture(scope="module")
def accumulated(cluster):
    return {hold: cluster.run(_accumulate, hold).values for hold in (False, True)}


def test_accumulation_over_micro_batches_and_evaluation(accumulated, mlp_oracles):
    oracle = mlp_oracles[0]
    x, _ = _mlp_data()

    def evaluate(weights, dtype=torch.float32):
        m = _mlp().to(dtype)
        m.load_state_dict(weights)
        with torch.no_grad():
            return m(x.to(dtype))

    # the trained model's output: the weights' rounding and the forward's
    evaluated = Oracle(evaluate(oracle.exact, torch.float64),
                       {n: evaluate(w) for n, w in oracle.one_process.items()})
    held = sum(math.ceil(p.numel() / N) for p in _mlp().parameters())
    for hold, runs in accumulated.items():
        how = "held, sent once" if hold else "sent each"
        for rank, r in enumerate(runs):
            # two micro-batches of one row: the gradient summed from 8 parts
            oracle.check(r["full"], f"2 micro-batches ({how}), rank {rank}")
            evaluated.check(r["eval"], f"evaluation after training ({how}), "
                                       f"rank {rank}")
            # the shards only, once the forward is over: ceil(numel / 4) each
            assert r["held"] == held, (f"rank {rank}: {r['held']} elements held "
                                       f"after forward, the shards' {held} expected")


def test_held_gradients_cost_memory_and_save_reduce_scatters(accumulated):
    psi = sum(p.numel() for p in _mlp().parameters())
    padded = sum(math.ceil(p.numel() / N) * N for p in _mlp().parameters())
    share = (N - 1) / N * 4 * padded  # one reduce-scatter of every gradient
    for hold, runs in accumulated.items():
        sends = 1 if hold else 2  # reduce-scatters a step: once, or per micro-batch
        for rank, r in enumerate(runs):
            # one all-to-all per unit (3 Linears) and reduce-scatter; the
            # ledger's bus bytes, S(N-1)/N a call, leave out gloo's headers (a few
            # hundred bytes a call, more than this small MLP's payload)
            ops = r["traffic"].by_op()["all_to_all"]
            calls, sent = ops["calls"], ops["bus_bytes"]
            assert (calls, sent) == (3 * sends, sends * share), (
                f"hold={hold}, rank {rank}: {calls:g} all-to-alls, {sent:,.0f} B; "
                f"{sends} reduce-scatters of 3 units, {sends * share:,.0f} B "
                "expected")
            peak = r["memory"].peak["Gradient"]
            print(f"hold={hold}, rank {rank}: {sent:,} B reduce-scattered, "
                  f"Gradient peak {peak:,} B (4Ψ = {4 * psi:,} B)")
            if hold:  # every unit's whole gradient, fp32, between micro-batches
                assert peak >= 4 * psi, (
                    f"rank {rank}: Gradient peak {peak:,} B, the whole gradients' "
                    f"4Ψ = {4 * psi:,} B at least expected")
            else:  # the shards' 1/N, plus at most one unit's whole gradient in
                # flight, sent and received (if those count as Gradient)
                unit = max(sum(math.ceil(p.numel() / N) * N for p in m.parameters())
                           for m in _mlp() if isinstance(m, nn.Linear))
                most = 4 * padded // N + 2 * 4 * unit
                assert peak <= most, (
                    f"rank {rank}: Gradient peak {peak:,} B, at most the shards' "
                    f"4Ψ/N plus one unit's gradient sent and received, {most:,} B, "
                    "expected")
