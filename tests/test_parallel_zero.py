"""labkit.parallel.zero: ZeRO-1 and ZeRO-2 on 4 gloo ranks against single-process
training of the same model on the same global batch (each rank a quarter of it),
PyTorch's ZeroRedundancyOptimizer beside them; what each rank holds and sends,
measured with the ledgers, against 1/N and theory.zero_traffic."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.models import TiedFrozenNet, TinyGPT, V

from labkit.numerics import Oracle, rel_err
from labkit.theory import zero_traffic

pytestmark = pytest.mark.numerics  # run again under other CPUs' kernels

N = 4
STEPS = 5
BUCKET_MB = 1000 / 2**20  # 250 float32: the small model's groups split in buckets
OPTS = {"sgd": (torch.optim.SGD, {"momentum": 0.9}, (0.1, 0.03, 0.3)),
        "adam": (torch.optim.Adam, {}, (1e-2, 3e-3, 3e-2))}
MODES = {"zero1": {}, "zero1_rs": {"reduce_scatter_gradients": True},
         "zero2": {"stage": 2, "bucket_mib": BUCKET_MB}}


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
                         stage=2, bucket_mib=1e-5)
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


# ------------------------------------------------- parameters that get no gradient
# tests.models.TinyGPT (GPT-2's layout with a tied embedding and head, or Llama's):
# every block's cross_kv is never called, so it never gets a gradient. torch.optim
# skips a parameter whose .grad is None; AdamW's weight decay would otherwise shrink
# it by (1 - lr·wd) a step, and momentum move it.
GPT_STEPS = 3
# eps 1e-6, not AdamW's 1e-8: GPT-2's key bias has a gradient that is zero exactly
# (adding a constant to a row of attention scores leaves its softmax unchanged),
# computed as rounding noise ~1e-9, which Adam with eps 1e-8 turns into steps of up
# to lr: one process's own float32 error was then 2e-4, and 3 steps moved the
# weights only 50x the allowance, too little for Oracle.resolves' 100x
ADAMW = {"lr": 1e-2, "weight_decay": 0.1, "eps": 1e-6}
UNUSED = ("cross_kv.weight", "cross_kv.bias")


def _gpt(llama):
    torch.manual_seed(0)
    model = TinyGPT(llama=llama)
    ids = torch.randint(0, 37, (8, 8), generator=torch.Generator().manual_seed(1))
    return model, ids


def _gpt_reference(llama, dtype=torch.float32, pieces=1):
    """One process, AdamW, the whole batch's gradient summed from `pieces` parts."""
    model, ids = _gpt(llama)
    model.to(dtype)
    o = torch.optim.AdamW(model.parameters(), **ADAMW)
    for _ in range(GPT_STEPS):
        o.zero_grad()
        for part in ids.chunk(pieces):
            (model(input_ids=part, labels=part) / pieces).backward()
        o.step()
    return _snapshot(model), o.state_dict()


def _gpt_train(rank, world_size, llama, mode):
    from labkit.parallel import DataParallel
    from labkit.parallel.zero import ShardedOptimizer

    model, ids = _gpt(llama)
    mine = ids.chunk(world_size)[rank]
    if mode == "torch":  # PyTorch's own: ZeroRedundancyOptimizer over DDP
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        run = DistributedDataParallel(model, find_unused_parameters=True)
        o = ZeroRedundancyOptimizer(model.parameters(),
                                    optimizer_class=torch.optim.AdamW, **ADAMW)
    else:  # ZeRO-1 after labkit's DataParallel has averaged; the others alone
        run = DataParallel(model) if mode == "zero1" else model
        o = ShardedOptimizer(model.parameters(), torch.optim.AdamW, **MODES[mode],
                             **ADAMW)
    for _ in range(GPT_STEPS):
        o.zero_grad()
        run(input_ids=mine, labels=mine).backward()
        if mode == "zero1":
            run.finish_gradient_synchronization()
        o.step()
    out = {"params": _snapshot(model)}
    if mode != "torch":
        out["state_dict"] = o.state_dict()
    return out


@pytest.fixture(scope="module")
def gpt(cluster):
    out = {}
    for llama in (False, True):
        exact = _gpt_reference(llama, torch.float64)
        runs = {"whole batch": _gpt_reference(llama),
                "4 quarters": _gpt_reference(llama, pieces=N)}
        out[llama] = {
            "start": _snapshot(_gpt(llama)[0]), "plain": runs["whole batch"][1],
            "oracle": Oracle(exact[0], {k: r[0] for k, r in runs.items()}),
            "state": {k: Oracle({i: st[k] for i, st in exact[1]["state"].items()},
                                {n: {i: st[k] for i, st in r[1]["state"].items()}
                                 for n, r in runs.items()})
                      for k in ("exp_avg", "exp_avg_sq")},
            "runs": {mode: cluster.run(_gpt_train, llama, mode).values
                     for mode in [*MODES, "torch"]}}
    return out


@pytest.mark.parametrize("llama", [False, True], ids=["gpt2", "llama"])
@pytest.mark.parametrize("mode", list(MODES))
def test_a_parameter_without_gradient_is_not_stepped(gpt, llama, mode):
    g = gpt[llama]
    oracle, start = g["oracle"], g["start"]
    oracle.resolves(start, "TinyGPT untrained")
    unused = [k for k in start if k.endswith(UNUSED)]
    assert len(unused) == 4, unused
    # ours, and PyTorch's ZeroRedundancyOptimizer over DDP in the same run
    for who, runs in ((mode, g["runs"][mode]), ("torch", g["runs"]["torch"])):
        for rank, r in enumerate(runs):
            oracle.check(r["params"], f"{who}, llama={llama}, rank {rank}, "
                         f"{GPT_STEPS} AdamW steps")
            for k in unused:  # weight decay did not touch them
                assert torch.equal(r["params"][k], start[k]), (
                    f"{who}, rank {rank}: {k} moved by "
                    f"{rel_err(r['params'][k], start[k]):.1e}, expected bit for bit")
    for rank, r in enumerate(g["runs"][mode]):
        # the saved state is what AdamW saves: none for cross_kv, m and v of the
        # others as one process's
        sd, plain = r["state_dict"], g["plain"]
        assert sd["state"].keys() == plain["state"].keys(), (
            f"{mode}, rank {rank}: state for {sorted(sd['state'])}, AdamW has it "
            f"for {sorted(plain['state'])}")
        for k, o in g["state"].items():
            o.check({i: st[k] for i, st in sd["state"].items()},
                    f"{mode}, rank {rank}: AdamW's {k}")
    first = g["runs"][mode][0]["params"]
    for rank, r in enumerate(g["runs"][mode][1:], 1):
        differ = [k for k, v in r["params"].items() if not torch.equal(v, first[k])]
        assert not differ, f"{mode}: rank {rank}'s {differ} differ from rank 0's"


def _skipped_sometimes(rank, world_size, mode):
    from labkit.parallel.zero import ShardedOptimizer

    torch.manual_seed(0)
    a, b, c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
    o = ShardedOptimizer([*a.parameters(), *b.parameters()], torch.optim.AdamW,
                         lr=0.1, weight_decay=0.1, **MODES[mode])
    o.add_param_group({"params": list(c.parameters())})  # never used: a group alone
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))
    held = []
    for i in range(3):
        o.zero_grad()
        h = a(x) if i == 1 else b(a(x))  # b is not used in step 1
        h.square().mean().backward()
        if mode == "zero1":
            _average_grads(a)
            _average_grads(b)
        before = [_snapshot(b), o.state_dict()["state"]]
        o.step()
        held.append((before, [_snapshot(b), o.state_dict()["state"]]))
    return held, _snapshot(c)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_skipped_step_leaves_values_and_state_and_counts_the_slices_steps(
        cluster, mode):
    torch.manual_seed(0)
    c_start = _snapshot([nn.Linear(4, 4) for _ in range(3)][2])
    for rank, (held, c) in enumerate(cluster.run(_skipped_sometimes, mode).values):
        (b0, s0), (b1, s1) = held[1]  # step 1, where b got no gradient
        assert all(torch.equal(b0[k], b1[k]) for k in b0), (
            f"{mode}, rank {rank}: b moved in the step it got no gradient")
        for i in (2, 3):  # b's weight and bias: m and v as they were
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(s0[i][k], s1[i][k]), (
                    f"{mode}, rank {rank}: b's {k} changed in the step it was skipped")
        # the counter is the slice's: 3 for b too, where torch.optim's would be 2
        steps = [held[2][1][1][i]["step"].item() for i in range(4)]
        assert steps == [3.0] * 4, f"{mode}, rank {rank}: steps {steps}, 3 expected"
        assert not ({4, 5} & held[2][1][1].keys()), (  # c: a group never stepped
            f"{mode}, rank {rank}: state saved for c, which never got a gradient")
        assert all(torch.equal(c[k], c_start[k]) for k in c), (
            f"{mode}, rank {rank}: c, never used, moved")


def _offloaded_alike(rank, world_size):
    from functools import partial

    from labkit.parallel import OffloadedOptimizer
    from labkit.parallel.zero import ShardedOptimizer

    out = []
    for inner in (torch.optim.AdamW, partial(OffloadedOptimizer,
                                             optimizer_cls=torch.optim.AdamW)):
        torch.manual_seed(0)
        a, b = nn.Linear(4, 4), nn.Linear(4, 4)
        o = ShardedOptimizer([*a.parameters(), *b.parameters()], inner, lr=0.1,
                             weight_decay=0.1, reduce_scatter_gradients=True)
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))
        b_after = []
        for i in range(3):
            o.zero_grad()
            (a(x) if i == 1 else b(a(x))).square().mean().backward()
            o.step()
            b_after.append(_snapshot(b))
        out.append((_snapshot(nn.ModuleList([a, b])), b_after))
    return out


def test_an_offloaded_master_copy_is_put_back_too(cluster):
    # OffloadedOptimizer steps an fp32 master copy on the host and copies it into
    # the slice: had b's master kept step 1's weight decay, step 2 would bring it
    # back into b. Same arithmetic as AdamW in place: the same bits
    res = cluster.run(_offloaded_alike).values
    for rank, ((plain, b_plain), (offloaded, b_off)) in enumerate(res):
        for name, b in (("in place", b_plain), ("offloaded", b_off)):
            assert all(torch.equal(b[0][k], b[1][k]) for k in b[0]), (
                f"rank {rank}, {name}: b moved in step 1, where it got no gradient")
        differ = [k for k in plain if not torch.equal(plain[k], offloaded[k])]
        assert not differ, f"rank {rank}: offloaded {differ} differ from in place"


def _plain_state_loads(rank, world_size, plain):
    from labkit.parallel.zero import ShardedOptimizer

    model, _ = _gpt(False)
    o = ShardedOptimizer(model.parameters(), torch.optim.AdamW, **ADAMW)
    o.load_state_dict(plain)  # AdamW's, from one process: no state for cross_kv
    return o.state_dict()


def test_a_plain_state_dict_without_state_for_unused_parameters_loads(cluster, gpt):
    plain = gpt[False]["plain"]
    for rank, sd in enumerate(cluster.run(_plain_state_loads, plain).values):
        # each rank keeps its slice; state_dict() gathers it back: the same bits
        assert sd["state"].keys() == plain["state"].keys(), (
            f"rank {rank}: state for {sorted(sd['state'])}")
        for i, st in plain["state"].items():
            for k, v in st.items():
                assert torch.equal(sd["state"][i][k], v), (
                    f"rank {rank}: parameter {i}'s {k} differs after a round trip")


# ---------------------------------------------------------------- memory, traffic
W = 512  # the notes' four layers L1-L4 on four ranks G0-G3


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(W, W), nn.ReLU(), nn.Linear(W, W), nn.ReLU(),
                         nn.Linear(W, W), nn.ReLU(), nn.Linear(W, 10))


PSI = 3 * (W * W + W) + W * 10 + 10  # 793098 elements, not a multiple of 4
MLP_BUCKET_MB = 1.0  # 262144 float32: buckets L3+L4, L2, L1
MLP_MODES = {"dp": None, **MODES,  # stage 2 gathers with one all-gather, the
             "zero2": {"stage": 2, "bucket_mib": MLP_BUCKET_MB,  # others as gloo's
                       "gather": "all_gather"}}  # default: a broadcast per rank


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
            held = r["holdings"].optstate
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


def test_one_rule_for_gradients_buffers_are_temporaries(measured):
    # the memory ledger's rule (labkit/ledger/memory_ledger.py): Gradient is what a rank
    # keeps between backward and step(); copies made to move gradients (buckets,
    # send and receive buffers) and what step() makes and uses are Temp. So no
    # mode books a buffer as Activation: every mode's Activation peak is the
    # forward's own, the same as without ZeRO
    act = {mode: sorted({r["memory"].peak["Activation"] for r in measured[mode]})
           for mode in MLP_MODES}
    assert all(v == act["dp"] for v in act.values()), (
        f"Activation peaks by mode {act}; the forward's {act['dp']} everywhere "
        "expected")
    s, _ = _slices(PSI, N)
    for rank, r in enumerate(measured["zero2"]):  # in step(): only its slice
        step = r["memory"].phase_peaks["optimizer"]["Gradient"]
        assert step == 4 * s, (f"zero2, rank {rank}: {step:,} B of Gradient in "
                               f"step(), its slice 4s = {4 * s:,} expected")


def test_traffic_per_rank_is_that_of_an_all_reduce(measured):
    s, _ = _slices(PSI, N)
    padded = N * s  # 793100: the 2 elements of padding travel too
    theory = zero_traffic(padded, N, stage=2, elem_bytes=4)
    share = (N - 1) / N * 4 * padded
    assert theory == {"reduce_scatter (gradients)": share,
                      "all_gather (parameters)": share}, (theory, share)
    # wire bytes are the payload plus gloo's headers, a few hundred bytes a call:
    # well under the 1% allowed below
    for mode, gather in (("zero1_rs", "broadcast"), ("zero2", "all_gather")):
        for r in measured[mode]:
            t = r["traffic"]
            # reduce-scatter = all-to-all + local sum: (N-1)/N of the gradients;
            # the parameters' gather, N broadcasts or an all-gather: (N-1)/N too
            for op in ("all_to_all", gather):
                sent = t.sum("wire_bytes", op=op)
                assert abs(sent - share) <= 0.01 * share, (
                    f"{mode}: {op} wrote {sent:,} B, (N-1)/N·4·padded = "
                    f"{share:,.0f} ± 1% expected")
            assert set(t.by_op()) == {"all_to_all", gather}, (
                f"{mode}: collectives {sorted(t.by_op())}, all_to_all and {gather} "
                "expected")
    # the same bytes as data parallelism's all-reduce, 2(N-1)/N * 4 * PSI
    dp_formula = 2 * (N - 1) / N * 4 * PSI
    for mode in ("dp", "zero1_rs", "zero2"):
        for r in measured[mode]:
            sent = r["traffic"].sum("wire_bytes")
            assert abs(sent - dp_formula) <= 0.01 * dp_formula, (
                f"{mode}: wrote {sent:,} B, 2(N-1)/N·4Ψ = {dp_formula:,.0f} ± 1%")
    # pure ZeRO-1 after the caller's all-reduce: 3(N-1)/N, half as much again
    for r in measured["zero1"]:
        sent = r["traffic"].sum("wire_bytes")
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
    with pytest.raises(ValueError, match="bucket_mib"):
        ShardedOptimizer(p, torch.optim.SGD, bucket_mib=0)
    with pytest.raises(ValueError, match="gather must be one of"):
        ShardedOptimizer(p, torch.optim.SGD, gather="ring")
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
