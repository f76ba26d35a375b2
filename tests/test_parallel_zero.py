"""labkit.parallel.zero: ZeRO-1 and ZeRO-2 on 4 gloo ranks against single-process
training of the same model on the same global batch (each rank a quarter of it),
PyTorch's ZeroRedundancyOptimizer beside them; what each rank holds and sends,
measured with the ledgers, against 1/N and theory.zero_traffic."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.models import TiedFrozenNet, V

from labkit.numerics import Oracle, rel_err
from labkit.theory import zero_traffic

pytestmark = pytest.mark.numerics  # run again under other CPUs' kernels

N = 4
STEPS = 5
BUCKET_MB = 1000 / 2**20  # 250 float32: the small model's groups split in buckets
OPTS = {"sgd": (torch.optim.SGD, {"momentum": 0.9}, (0.1, 0.03, 0.3)),
        "adam": (torch.optim.Adam, {}, (1e-2, 3e-3, 3e-2))}
MODES = {"zero1": {}, "zero1_rs": {"reduce_scatter_gradients": True},
         "zero2": {"stage": 2, "bucket_mb": BUCKET_MB}}


def _groups(model, opt):
    # TiedFrozenNet's 795 trainable elements in groups of 481, 312 and 2 (the
    # last leaves two of four ranks nothing)
    lr = OPTS[opt][2]
    m = model
    return [{"params": [m.embed.weight, m.up.weight, m.up.bias,
                        *m.frozen.parameters()], "lr": lr[0]},
            {"params": list(m.down.parameters()), "lr": lr[1]},
            {"params": [m.gain], "lr": lr[2]}]


def _setup():
    torch.manual_seed(0)
    model = TiedFrozenNet()
    g = torch.Generator().manual_seed(1)
    tok, y = (torch.randint(0, V, (8, 5), generator=g) for _ in range(2))
    return model, tok, y


def _loss(model, tok, y):
    return F.cross_entropy(model(tok).flatten(0, 1), y.flatten())


def _snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _reference(opt, steps=STEPS, dtype=torch.float32, pieces=1):
    """Single-process training on the whole batch, its gradient summed from
    `pieces` equal parts (1: all at once), in `dtype`."""
    model, tok, y = _setup()
    model.to(dtype)
    cls, kw, _ = OPTS[opt]
    o = cls(_groups(model, opt), **kw)
    for i in range(steps):
        _schedule(o, i)
        o.zero_grad()
        for ts, ys in zip(tok.chunk(pieces), y.chunk(pieces)):
            (_loss(model, ts, ys) / pieces).backward()
        o.step()
    return _snapshot(model), o.state_dict()


def _oracles(opt, steps=STEPS):
    """labkit.numerics.Oracle of the weights, and of each kind of optimizer state
    ("exp_avg", "exp_avg_sq": every parameter's together): the exact answer in
    float64; one process in float32 on the whole batch, on 4 quarters (as the
    ranks split it) and on 8 single rows (as _corners accumulates)."""
    runs = {"whole batch": 1, "4 quarters": N, "8 rows": 8}
    exact = _reference(opt, steps, torch.float64)
    fp32 = {name: _reference(opt, steps, pieces=k) for name, k in runs.items()}

    def state(sd, key):
        return {i: st[key] for i, st in sd["state"].items()}

    out = {"params": Oracle(exact[0], {n: r[0] for n, r in fp32.items()})}
    for key in ("exp_avg", "exp_avg_sq") if opt == "adam" else ():
        out[key] = Oracle(state(exact[1], key),
                          {n: state(r[1], key) for n, r in fp32.items()})
    return out


def _schedule(o, i):
    if i == 2:  # what an lr scheduler does: change a group's lr between steps
        o.param_groups[0]["lr"] *= 0.5


def _average_grads(model):
    import torch.distributed as dist

    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)


def _train(rank, world_size, mode, opt, steps=STEPS):
    from labkit.parallel.zero import ShardedOptimizer

    model, tok, y = _setup()
    rows = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)
    cls, kw, _ = OPTS[opt]
    *groups, last = _groups(model, opt)
    if mode == "torch":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        o = ZeroRedundancyOptimizer(groups, optimizer_class=cls, **kw)
    else:
        o = ShardedOptimizer(groups, cls, **MODES[mode], **kw)
    o.add_param_group(last)  # a group added later: the oracle has it from the start
    grads_after_backward = []
    for i in range(steps):
        _schedule(o, i)
        o.zero_grad()
        _loss(model, tok[rows], y[rows]).backward()
        grads_after_backward.append(sum(p.grad is not None
                                        for p in model.parameters()))
        if mode in ("zero1", "torch"):
            _average_grads(model)
        o.step()
    out = {"params": _snapshot(model), "grads": grads_after_backward}
    if mode != "torch":
        out["state_dict"] = o.state_dict()
    return out


@pytest.fixture(scope="module")
def trained(cluster):
    return {(mode, opt): cluster.run(_train, mode, opt).values
            for mode in [*MODES, "torch"] for opt in OPTS}


@pytest.fixture(scope="module")
def reference():
    return {opt: _oracles(opt) for opt in OPTS}


@pytest.mark.parametrize("opt", list(OPTS))
@pytest.mark.parametrize("mode", [*MODES, "torch"])
def test_matches_single_process_training(trained, reference, mode, opt):
    oracle = reference[opt]["params"]
    start = _snapshot(_setup()[0])
    # the ranks add 4 quarter-batch gradients in another order than one process:
    # as far from float64 as one process is (labkit.numerics); the untrained
    # weights are far outside that
    oracle.resolves(start, f"{opt}: the untrained model")
    for rank, r in enumerate(trained[mode, opt]):
        oracle.check(r["params"], f"{mode}, {opt}, rank {rank}")
        # the frozen layer and the buffer did not move; everything else did
        for k in ("frozen.weight", "scale"):
            assert torch.equal(r["params"][k], start[k]), (
                f"{mode}, {opt}, rank {rank}: {k} is not bit for bit its start")
        for k in ("embed.weight", "down.bias", "gain"):
            moved = rel_err(r["params"][k], start[k])
            assert moved > 100 * oracle.allowed, (
                f"{mode}, {opt}, rank {rank}: {k} moved {moved:.1e}, not more than "
                f"100 x the {oracle.allowed:.1e} allowed")
    # the all-gather leaves every rank the very same parameters
    first = trained[mode, opt][0]["params"]
    for rank, r in enumerate(trained[mode, opt][1:], 1):
        differ = [k for k, v in r["params"].items() if not torch.equal(v, first[k])]
        assert not differ, f"{mode}, {opt}: rank {rank}'s {differ} differ from rank 0's"


@pytest.mark.parametrize("opt", list(OPTS))
def test_zero1_agrees_with_pytorchs_zero_redundancy_optimizer(trained, opt):
    # same averaged gradients, same element-wise update: equal to the last bit
    ours, theirs = trained["zero1", opt][0], trained["torch", opt][0]
    for k, v in ours["params"].items():
        assert torch.equal(v, theirs["params"][k]), (
            f"{opt}: {k} differs from ZeroRedundancyOptimizer's by "
            f"{(v - theirs['params'][k]).abs().max():.1e}, expected bit for bit")


def test_stage2_frees_every_full_gradient(trained):
    for r in trained["zero2", "adam"]:
        # backward leaves no .grad on any rank
        assert r["grads"] == [0] * STEPS, f"stage 2: .grad left per step {r['grads']}"
    for r in trained["zero1_rs", "adam"]:
        # 6 trainable tensors: ZeRO-1 keeps them
        assert r["grads"] == [6] * STEPS, f"ZeRO-1: .grad per step {r['grads']}, 6"


@pytest.mark.parametrize("mode", list(MODES))
def test_state_dict_is_the_plain_optimizers(trained, reference, mode):
    oracles = reference["adam"]
    ref = _reference("adam")[1]  # one process's, for the keys and the step counts
    for rank, r in enumerate(trained[mode, "adam"]):
        sd = r["state_dict"]
        assert sd["param_groups"] == ref["param_groups"], (
            f"{mode}, rank {rank}: param_groups {sd['param_groups']} differ from "
            f"one process's {ref['param_groups']}")
        assert sd["state"].keys() == ref["state"].keys(), (
            f"{mode}, rank {rank}: state for {sorted(sd['state'])}, expected "
            f"{sorted(ref['state'])}")
        for i, st in sd["state"].items():
            assert st.keys() == ref["state"][i].keys(), (
                f"{mode}, rank {rank}, parameter {i}: {sorted(st)}")
            assert torch.equal(st["step"], ref["state"][i]["step"]), (
                f"{mode}, rank {rank}, parameter {i}: step {st['step']}, expected "
                f"{ref['state'][i]['step']}")
        for k in ("exp_avg", "exp_avg_sq"):  # every parameter's together
            oracles[k].check({i: st[k] for i, st in sd["state"].items()},
                             f"{mode}, rank {rank}: Adam's {k}")


@pytest.mark.parametrize("mode", list(MODES))
def test_a_state_dict_round_trips_and_a_plain_one_loads(cluster, reference, mode):
    three, sd3 = _reference("adam", 3)
    for rank, r in enumerate(cluster.run(_resume, mode, three, sd3).values):
        # ours, saved after 3 steps and loaded into a new optimizer: same 5 steps
        differ = [k for k, v in r["resumed"].items()
                  if not torch.equal(v, r["straight"][k])]
        assert not differ, (f"{mode}, rank {rank}: resumed {differ} differ from 5 "
                            "straight steps, expected bit for bit")
        # plain Adam's, saved by one process, loaded on 4 ranks: the oracle's 5 steps
        reference["adam"]["params"].check(
            r["from_plain"], f"{mode}, rank {rank}: plain Adam's state dict loaded")


def _resume(rank, world_size, mode, params3, plain_sd3):
    from labkit.parallel.zero import ShardedOptimizer

    def run(steps, params=None, sd=None, start=0):
        model, tok, y = _setup()
        if params is not None:
            model.load_state_dict(params)
        rows = slice(rank * 2, rank * 2 + 2)
        o = ShardedOptimizer(_groups(model, "adam"), torch.optim.Adam, **MODES[mode])
        if sd is not None:
            o.load_state_dict(sd)
        for i in range(start, start + steps):
            _schedule(o, i)
            o.zero_grad()
            _loss(model, tok[rows], y[rows]).backward()
            if mode == "zero1":
                _average_grads(model)
            o.step()
        return model, o

    straight = _snapshot(run(5)[0])
    model, o = run(3)
    sd = o.state_dict()
    resumed = _snapshot(run(2, _snapshot(model), sd, start=3)[0])
    from_plain = _snapshot(run(2, params3, plain_sd3, start=3)[0])
    return {"straight": straight, "resumed": resumed, "from_plain": from_plain}


def _corners(rank, world_size):
    from labkit.parallel.zero import ShardedOptimizer

    # stage 2 with two micro-batches a step: both backwards add into the slice
    model, tok, y = _setup()
    o = ShardedOptimizer(_groups(model, "adam"), torch.optim.Adam, **MODES["zero2"])
    for i in range(STEPS):
        _schedule(o, i)
        for row in (2 * rank, 2 * rank + 1):
            (_loss(model, tok[row:row + 1], y[row:row + 1]) / 2).backward()
        o.step()  # no zero_grad(): step() consumed the slice
    out = {"accumulated": _snapshot(model)}
    # a parameter this forward does not use: its bucket is reduced at the end of
    # backward, with zeros, on every rank alike
    torch.manual_seed(0)
    lin, unused = nn.Linear(3, 2), nn.Parameter(torch.ones(5))
    before = lin.weight.detach().clone()
    o = ShardedOptimizer([unused, lin.weight, lin.bias], torch.optim.SGD, lr=0.1,
                         stage=2, bucket_mb=1e-5)
    lin(torch.full((1, 3), float(rank))).sum().backward()
    o.step()
    out["unused"] = unused.detach().clone()
    out["before"], out["after"] = before, lin.weight.detach().clone()
    return out


def _one_sgd_step(dtype):
    """d(sum)/dW = x: averaged over ranks, x = 1.5; one process's SGD moves W by
    -0.1 * 1.5, in `dtype`."""
    torch.manual_seed(0)
    lin = nn.Linear(3, 2).to(dtype)
    lin.weight.grad = torch.full_like(lin.weight, 1.5)
    torch.optim.SGD([lin.weight], lr=0.1).step()
    return lin.weight.detach().clone()


def test_accumulation_and_an_unused_parameter_in_stage2(cluster, reference):
    oracle = reference["adam"]["params"]
    moved = Oracle(_one_sgd_step(torch.float64),
                   {"one process": _one_sgd_step(torch.float32)})
    for rank, r in enumerate(cluster.run(_corners).values):
        # two micro-batches a rank: the batch's gradient summed from 8 rows
        oracle.check(r["accumulated"], f"stage 2, 2 micro-batches, rank {rank}")
        assert torch.equal(r["unused"], torch.ones(5)), (
            f"rank {rank}: the unused parameter moved to {r['unused'].tolist()}")
        moved.resolves(r["before"], "the weight before the step")
        moved.check(r["after"], f"rank {rank}: one SGD step with x averaged to 1.5")


# ---------------------------------------------------------------- memory, traffic
W = 512  # the notes' four layers L1-L4 on four ranks G0-G3


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(W, W), nn.ReLU(), nn.Linear(W, W), nn.ReLU(),
                         nn.Linear(W, W), nn.ReLU(), nn.Linear(W, 10))


PSI = 3 * (W * W + W) + W * 10 + 10  # 793098 elements, not a multiple of 4
MLP_BUCKET_MB = 1.0  # 262144 float32: buckets L3+L4, L2, L1
MLP_MODES = {"dp": None, **MODES,
             "zero2": {"stage": 2, "bucket_mb": MLP_BUCKET_MB}}


def _measure(rank, world_size, mode):
    from labkit import ledger
    from labkit.parallel.zero import ShardedOptimizer

    model = _mlp()
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(16, W, generator=g), torch.randint(0, 10, (16,), generator=g)
    if mode == "dp":
        o = torch.optim.Adam(model.parameters(), lr=1e-3)
    else:
        o = ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3,
                             **MLP_MODES[mode])

    def step():
        o.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if mode in ("dp", "zero1"):
            _average_grads(model)
        o.step()

    with ledger.memory(model, o) as m:  # the first step: Adam's state is born
        step()
    with ledger.traffic() as t:
        step()
    return {"memory": m, "traffic": t, "holdings": ledger.holdings(model, o)}


@pytest.fixture(scope="module")
def measured(cluster):
    return {mode: cluster.run(_measure, mode).values for mode in MLP_MODES}


def _slices(psi, n):
    """Real elements of each rank's equal range of the zero-padded flat buffer."""
    s = math.ceil(psi / n)
    return s, [min(s, max(0, psi - r * s)) for r in range(n)]


def test_optimizer_state_per_rank_is_one_nth(measured):
    s, real = _slices(PSI, N)
    assert (s, real) == (198275, [198275, 198275, 198275, 198273]), (s, real)
    # unsharded Adam: m and v, 8 bytes per parameter, + a 4-byte step per tensor
    for r in measured["dp"]:
        held = r["memory"].current["Optstate"]
        assert held == 8 * PSI + 4 * 8, f"dp: {held:,} B of state, 8Ψ + 32 expected"
    for mode in MODES:
        for rank, r in enumerate(measured[mode]):
            # m and v of this rank's slice, + one step counter for its one group
            want = 8 * real[rank] + 4
            held = r["memory"].current["Optstate"]
            assert held == want, f"{mode}, rank {rank}: {held:,} B, {want:,} expected"
            held = r["holdings"].optimizer_state
            assert held == want, (f"{mode}, rank {rank}: holdings {held:,} B, "
                                  f"{want:,} expected")
        # together, the ranks hold one copy: the unsharded m and v, split in 4
        total = sum(r["memory"].current["Optstate"] - 4 for r in measured[mode])
        assert total == 8 * PSI, f"{mode}: m and v {total:,} B in all, 8Ψ expected"


def test_stage2_holds_a_quarter_of_the_gradient(measured):
    s, _ = _slices(PSI, N)
    bucket = W * W + W + W * 10 + 10  # the largest: L3 and L4
    for mode in ("dp", "zero1", "zero1_rs"):
        for r in measured[mode]:  # every gradient, whole
            peak = r["memory"].peak["Gradient"]
            assert peak == 4 * PSI, f"{mode}: gradient peak {peak:,} B, 4Ψ expected"
    for r in measured["zero2"]:
        peak = r["memory"].peak["Gradient"]
        # this rank's averaged slice (padding included) and, at most, the full
        # gradients of one bucket waiting to be reduce-scattered
        assert 4 * s < peak <= 4 * (s + bucket), (
            f"gradient peak {peak:,} B, expected in ({4 * s:,}, {4 * (s + bucket):,}]")
        left = r["memory"].current["Gradient"]  # step() consumed the slice
        assert left == 0, f"{left:,} B of gradient left after step(), 0 expected"
        # the reduce-scatter's temporaries scale with the bucket, not the model:
        # the bucket packed, the pieces received from N ranks (gloo may hold one
        # or two earlier buffers a moment late: seen up to 3.4 buckets in all)
        # and their sum
        temp = bucket + 3 * (bucket + N) + math.ceil(bucket / N)
        assert r["memory"].peak["Temp"] <= 4 * temp, (
            f"temporaries peaked at {r['memory'].peak['Temp']:,} B, at most "
            f"{4 * temp:,} allowed")


def test_traffic_per_rank_is_that_of_an_all_reduce(measured):
    s, _ = _slices(PSI, N)
    padded = N * s  # 793100: the 2 elements of padding travel too
    theory = zero_traffic(padded, N, stage=2, elem_bytes=4)
    share = (N - 1) / N * 4 * padded
    assert theory == {"reduce_scatter (gradients)": share,
                      "all_gather (parameters)": share}, (theory, share)
    # wire bytes are the payload plus gloo's headers, a few hundred bytes a call:
    # well under the 1% allowed below
    for mode in ("zero1_rs", "zero2"):
        for r in measured[mode]:
            t = r["traffic"]
            # reduce-scatter = all-to-all + local sum: (N-1)/N of the gradients
            for op in ("all_to_all", "all_gather"):
                sent = t.total("wire_bytes", op=op)
                assert abs(sent - share) <= 0.01 * share, (
                    f"{mode}: {op} wrote {sent:,} B, (N-1)/N·4·padded = "
                    f"{share:,.0f} ± 1% expected")
            assert set(t.by_op()) == {"all_to_all", "all_gather"}, t.by_op()
    # the same bytes as data parallelism's all-reduce, 2(N-1)/N * 4 * PSI
    dp_formula = 2 * (N - 1) / N * 4 * PSI
    for mode in ("dp", "zero1_rs", "zero2"):
        for r in measured[mode]:
            sent = r["traffic"].total("wire_bytes")
            assert abs(sent - dp_formula) <= 0.01 * dp_formula, (
                f"{mode}: wrote {sent:,} B, 2(N-1)/N·4Ψ = {dp_formula:,.0f} ± 1%")
    # pure ZeRO-1 after the caller's all-reduce: 3(N-1)/N, half as much again
    for r in measured["zero1"]:
        sent = r["traffic"].total("wire_bytes")
        assert abs(sent - 3 * share) <= 0.01 * share, (
            f"zero1: wrote {sent:,} B, 3(N-1)/N·4·padded = {3 * share:,.0f} ± 1%")


# ------------------------------------------------------------------------- errors


def test_bad_arguments_and_no_process_group():
    p = [nn.Parameter(torch.ones(3))]
    from labkit.parallel.zero import ShardedOptimizer

    with pytest.raises(ValueError, match="stage 1 or 2"):
        ShardedOptimizer(p, torch.optim.SGD, stage=3)
    with pytest.raises(ValueError, match="stage 2 always"):
        ShardedOptimizer(p, torch.optim.SGD, stage=2, reduce_scatter_gradients=False)
    with pytest.raises(ValueError, match="bucket_mb"):
        ShardedOptimizer(p, torch.optim.SGD, bucket_mb=0)
    with pytest.raises(RuntimeError, match="process group"):
        ShardedOptimizer(p, torch.optim.SGD, lr=0.1)


def _mistakes(rank, world_size):
    from labkit.parallel.zero import ShardedOptimizer

    def error(fn):
        try:
            fn()
        except (RuntimeError, ValueError) as e:
            return str(e)

    sgd = torch.optim.SGD
    meta = [nn.Parameter(torch.ones(3, device="meta"))]
    mixed = [nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3).double())]
    out = {"device": error(lambda: ShardedOptimizer(meta, sgd, lr=0.1)),
           "dtypes": error(lambda: ShardedOptimizer(mixed, sgd, lr=0.1))}
    for stage in (1, 2):
        lin = nn.Linear(3, 2)
        out[f"early{stage}"] = error(ShardedOptimizer(lin.parameters(), sgd, lr=0.1,
                                                      stage=stage).step)
    lin = nn.Linear(3, 2)
    o = ShardedOptimizer(lin.parameters(), sgd, lr=0.1, stage=2)
    lin(torch.ones(1, 3)).sum().backward()
    lin.weight.grad = torch.ones_like(lin.weight)  # an all-reduce by hand, say
    out["by_hand"] = error(o.step)
    return out


def test_mistakes_say_what_happened(cluster):
    for r in cluster.run(_mistakes).values:
        assert "is on meta" in r["device"] and "gloo" in r["device"], r["device"]
        assert "one dtype" in r["dtypes"], r["dtypes"]
        assert "before backward" in r["early1"] and "before backward" in r["early2"], (
            r["early1"], r["early2"])
        assert "set outside backward" in r["by_hand"], r["by_hand"]
