"""labkit.parallel.pipeline_parallel: GPipe and 1F1B on real gloo ranks against
single-process training of the same model on the same batch (loss, the input's
gradient, every weight's gradient, several SGD steps); on 4 stages over the
world, 2 stages over groups {0, 2} and {1, 3} (two pipelines at once, peers named
through the group), and 1 stage per rank; the spans each rank records against
its schedule; the activations held against theory; PyTorch's own pipelining."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from labkit.numerics import Oracle, rel_err
from labkit.ledger import Span
from labkit.parallel.pipeline_parallel import bubble_of_total_by_rank, split_layers
from labkit.parallel.pipeline_schedules import stage_order
from labkit.theory.pipeline import activations_in_flight

pytestmark = pytest.mark.numerics  # run again under other CPUs' kernels

ROWS, STEPS, LR = 12, 3, 0.1
BALANCE = {4: [2, 2, 2, 2], 2: [3, 5], 1: [8]}  # 8 layers; 3 + 5: uneven stages


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 7), nn.Tanh(),
                         nn.Linear(7, 9), nn.Tanh(), nn.Linear(9, 5), nn.Tanh())


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(ROWS, 6, generator=g), torch.randn(ROWS, 5, generator=g)


def _one_process(dtype=torch.float32, pieces=1):
    """One process, the whole batch, its loss and gradient summed from `pieces`
    equal micro-batches (1: at once), in `dtype`: the first step's gradients
    (weights and input) and, step by step, the loss; the weights after STEPS SGD
    steps."""
    model, (x, y) = _model().to(dtype), _batch()
    x, y = x.to(dtype).requires_grad_(), y.to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], None
    for _ in range(STEPS):
        opt.zero_grad()
        loss = sum(F.mse_loss(model(xs), ys) / pieces
                   for xs, ys in zip(x.chunk(pieces), y.chunk(pieces)))
        loss.backward()
        if grads is None:
            grads = {k: p.grad.clone() for k, p in model.named_parameters()}
            grads["input"] = x.grad.clone()
        opt.step()
        losses.append(loss.detach())
    return {"losses": torch.stack(losses), "grads": grads,
            "params": {k: p.detach().clone() for k, p in model.named_parameters()}}


class _Reference:
    """The exact answer (float64) and one process's float32 runs on the whole
    batch and on 3, 4 and 6 micro-batches, as the pipelines cut it."""

    def __init__(self):
        self.exact = _one_process(torch.float64)
        self.runs = {"whole batch": _one_process()}
        self.runs.update({f"{m} micro-batches": _one_process(pieces=m)
                          for m in (3, 4, 6)})
        self.losses = self.runs["whole batch"]["losses"].tolist()
        self.params = self.runs["whole batch"]["params"]

    def oracle(self, key, names=None):
        """labkit.numerics.Oracle of `key` ("grads", "params", "losses"), of the
        tensors named `names` only if given."""
        def part(run):
            return run[key] if names is None else {k: run[key][k] for k in names}
        return Oracle(part(self.exact), {n: part(r) for n, r in self.runs.items()})


def _group(how):
    import torch.distributed as dist

    if how == 4:
        return None  # the world
    if how == 2:  # two pipelines of two stages: ranks {0, 2} and {1, 3}
        return dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])[0]
    return dist.new_subgroups_by_enumeration([[r] for r in range(4)])[0]


def _train(rank, world_size, p, schedule, m):
    from labkit.parallel.pipeline_parallel import PipelineParallel

    group = _group(p)
    x, y = _batch()
    x.requires_grad_()
    pipe = PipelineParallel(_model(), microbatches=m, loss_fn=F.mse_loss,
                            schedule=schedule, group=group, balance=BALANCE[p])
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    losses, grads = [], None
    for _ in range(STEPS):
        opt.zero_grad()
        loss = pipe.step(x, y)
        if grads is None:
            grads = {k: p.grad.clone() for k, p in pipe.module.named_parameters()}
            if pipe.is_first:
                grads["input"] = x.grad.clone()
        opt.step()
        losses.append(None if loss is None else loss.item())
    return {"stage": pipe.stage, "losses": losses, "grads": grads,
            "params": {k: v.detach().clone()
                       for k, v in pipe.module.named_parameters()},
            "events": pipe.events, "held": pipe.peak_in_flight,
            "order": [(a.kind, a.microbatch) for a in pipe.order]}


RUNS = [(p, s, m) for p in (4, 2) for s in ("gpipe", "1f1b") for m in (1, 3, 6)]
RUNS += [(1, "1f1b", 3), (1, "gpipe", 1)]


@pytest.fixture(scope="module")
def trained(cluster):
    return {key: cluster.run(_train, *key).values for key in RUNS}


@pytest.fixture(scope="module")
def reference():
    return _Reference()


@pytest.mark.parametrize("key", RUNS, ids=lambda k: f"p{k[0]}-{k[1]}-m{k[2]}")
def test_matches_single_process_training(trained, reference, key):
    p = key[0]
    res = trained[key]
    start = {k: v.detach() for k, v in _model().named_parameters()}
    weights = reference.oracle("params")
    weights.resolves(start, "the untrained model")
    for k, v in start.items():  # every tensor moved
        moved = rel_err(reference.params[k], v)
        assert moved > 100 * weights.allowed, (
            f"{k} moved {moved:.1e}, not more than 100 x the {weights.allowed:.1e} "
            "allowed")
    for r in res:
        where = f"p={p}, {key[1]}, m={key[2]}, stage {r['stage']}"
        lo, hi = split_layers(8, p, BALANCE[p])[r["stage"]]
        names = {k for k in reference.params if lo <= int(k.split(".")[0]) < hi}
        # the stage keeps its layers, by name
        assert set(r["params"]) == names, (where, sorted(r["params"]))
        # the m micro-batches' gradients are summed in another order than one
        # process's whole-batch matmul: as far from float64 as one process's
        grads = names | ({"input"} if r["stage"] == 0 else set())
        reference.oracle("grads", grads).check(
            {k: r["grads"][k] for k in grads}, f"{where}: first step's gradients")
        reference.oracle("params", names).check(r["params"], f"{where}: weights")
        if r["stage"] == p - 1:  # the loss of the whole batch, step by step
            reference.oracle("losses").check(torch.tensor(r["losses"]),
                                             f"{where}: losses")
        else:
            assert r["losses"] == [None] * STEPS, (where, r["losses"])


@pytest.mark.parametrize("key", [k for k in RUNS if k[0] > 1],
                         ids=lambda k: f"p{k[0]}-{k[1]}-m{k[2]}")
def test_spans_follow_the_schedule(trained, key):
    p, schedule, m = key
    for pipeline in PIPELINES[p]:
        _check_spans([trained[key][g] for g in pipeline], p, schedule, m)


PIPELINES = {4: [[0, 1, 2, 3]], 2: [[0, 2], [1, 3]]}  # global ranks, by stage


def _check_spans(res, p, schedule, m):
    stages = [r["stage"] for r in res]
    assert stages == list(range(p)), f"stages {stages}, 0 to {p - 1} expected"
    by_stage = {r["stage"]: r["events"] for r in res}
    for s, evs in by_stage.items():
        want = stage_order(schedule, p, m, s)
        compute = [e.name for e in evs if e.kind == "compute"]
        assert compute == [f"{'forward' if a.kind == 'F' else 'backward'} "
                           f"{a.microbatch}" for a in want], compute
        names = [e.name for e in evs]
        for i in range(m):  # receive before using, send after producing
            if s > 0:
                assert names.index(f"recv activation {i}") < names.index(
                    f"forward {i}") < names.index(f"send gradient {i}"), (s, names)
            if s < p - 1:
                assert names.index(f"forward {i}") < names.index(
                    f"send activation {i}"), (s, names)
                assert names.index(f"recv gradient {i}") < names.index(
                    f"backward {i}"), (s, names)
        spans = [e for e in evs if e.kind == "compute"]
        assert all(a.end <= b.start for a, b in zip(spans, spans[1:])), (
            f"stage {s}: compute spans overlap")
    # one clock on one machine: micro-batch i's forward on stage s starts after
    # stage s-1's ended, and its backward after stage s+1's backward ended
    at = {(s, e.name): e for s, evs in by_stage.items() for e in evs}
    for s in range(1, p):
        for i in range(m):
            a, b = at[s, f"forward {i}"], at[s - 1, f"forward {i}"]
            assert a.start >= b.end, (f"stage {s}'s forward {i} started at "
                                      f"{a.start}, before stage {s - 1}'s "
                                      f"ended, {b.end}")
            a, b = at[s - 1, f"backward {i}"], at[s, f"backward {i}"]
            assert a.start >= b.end, (f"stage {s - 1}'s backward {i} started at "
                                      f"{a.start}, before stage {s}'s ended, {b.end}")
    held = [r["held"] for r in res]
    want = [min(p - s, m) for s in range(p)] if schedule == "1f1b" else [m] * p
    assert held == want, f"{schedule}: micro-batches held {held}, {want} expected"


def test_one_stage_per_rank_runs_no_communication(trained):
    for r in trained[1, "1f1b", 3]:
        kinds = {e.kind for e in r["events"]}
        assert kinds == {"compute"}, f"spans of kinds {kinds}, compute only expected"
        assert r["order"] == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2),
                              ("B", 2)], r["order"]


def test_bubble_of_total_by_rank_from_spans():
    # stage 0 computes 0-1 and 3-4, stage 1 1-3: window 0-4
    events = {0: [Span("compute", "forward 0", 0.0, 1.0),
                  Span("comm", "recv gradient 0", 1.0, 3.0),
                  Span("compute", "backward 0", 3.0, 4.0)],
              1: [Span("compute", "forward 0", 1.0, 2.0),
                  Span("compute", "backward 0", 2.0, 3.0)]}
    got = bubble_of_total_by_rank(events)
    assert got == [0.5, 0.5], f"bubble fractions {got}, [0.5, 0.5] expected"
    with pytest.raises(ValueError, match="no compute"):
        bubble_of_total_by_rank({0: []})


# ------------------------------------------------------------- activations held
W, B = 16, 8  # four (Linear, ReLU) pairs: one pair per stage on 4 ranks


def _held(rank, world_size, schedule, m):
    from labkit import ledger
    from labkit.parallel.pipeline_parallel import PipelineParallel

    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [nn.Linear(W, W), nn.ReLU()]
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(B, W, generator=g), torch.randn(B, W, generator=g)
    pipe = PipelineParallel(layers, microbatches=m, loss_fn=F.mse_loss,
                            schedule=schedule)
    pipe.step(x, y)  # the first step also sends each stage's output shape
    with ledger.memory(pipe.module, x, y) as mem:
        pipe.step(x, y)
    return mem.peak["Activation"], pipe.peak_in_flight


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_first_stage_holds_what_theory_says(cluster, schedule):
    m = 8
    peak, held = cluster.run(_held, schedule, m)[0]
    unit = B // m * W * 4  # one micro-batch's (rows, W) fp32 tensor
    k = activations_in_flight(schedule, 4, m)
    assert held == k, f"{schedule}: {held} micro-batches held, theory's {k}"
    # per micro-batch stage 0 keeps its ReLU's output (also the tensor it sends);
    # while a forward runs, its Linear's output exists until the ReLU is done
    assert peak == (k + 1) * unit, (f"{schedule}: activation peak {peak:,} B, "
                                    f"(k + 1) x {unit:,} = {(k + 1) * unit:,} expected")


# ------------------------------------------------------------ PyTorch's pipelining


def _torch_pipelining(rank, world_size, schedule, m):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from labkit.parallel.pipeline_parallel import PipelineParallel

    x, y = _batch()
    ours = PipelineParallel(_model(), microbatches=m, loss_fn=F.mse_loss,
                            schedule=schedule)
    loss = ours.step(x, y)
    lo, hi = split_layers(8, world_size)[rank]
    stage = PipelineStage(_model()[lo:hi], rank, world_size, torch.device("cpu"))
    cls = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
    sched, losses = cls(stage, m, loss_fn=F.mse_loss), []
    if rank == 0:
        sched.step(x)
    elif rank == world_size - 1:
        sched.step(target=y, losses=losses)
    else:
        sched.step()
    theirs = {k: p.grad for k, p in stage.submod.named_parameters()}
    return {"ours": {k: p.grad for k, p in ours.module.named_parameters()},
            "theirs": theirs, "loss": loss,
            "their_loss": torch.stack(losses).mean().detach() if losses else None}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_agrees_with_torch_distributed_pipelining(cluster, reference, schedule):
    res = cluster.run(_torch_pipelining, schedule, 4).values
    # both as far from float64 as one process: within 2x that of each other
    for stage, r in enumerate(res):
        assert r["ours"].keys() == r["theirs"].keys() and r["ours"], (
            stage, sorted(r["ours"]), sorted(r["theirs"]))
        oracle = reference.oracle("grads", set(r["ours"]))
        for who in ("ours", "theirs"):
            oracle.check(r[who], f"{schedule}, stage {stage}: {who} gradients")
    loss = reference.oracle("losses")
    loss = Oracle(loss.exact[0], {n: v[0] for n, v in loss.one_process.items()})
    for who in ("loss", "their_loss"):
        loss.check(res[-1][who], f"{schedule}: the first step's {who}")


# ------------------------------------------------------------------------ errors


def test_split_layers():
    assert split_layers(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)], split_layers(8, 4)
    assert split_layers(8, 2, [3, 5]) == [(0, 3), (3, 8)], split_layers(8, 2, [3, 5])
    with pytest.raises(ValueError, match="7 layers cannot be cut into 2 equal "
                       "stages"):
        split_layers(7, 2)
    with pytest.raises(ValueError, match=r"balance must be 2 integers >= 1 summing "
                       r"to 8 layers, got \[4, 3\]"):
        split_layers(8, 2, [4, 3])
    with pytest.raises(ValueError, match="summing to 3"):
        split_layers(3, 4, [1, 1, 1, 0])


def test_no_process_group():
    from labkit.parallel.pipeline_parallel import PipelineParallel

    with pytest.raises(RuntimeError, match="process group"):
        PipelineParallel(_model(), microbatches=2, loss_fn=F.mse_loss)


def _mistakes(rank, world_size):
    from labkit.parallel.pipeline_parallel import PipelineParallel

    def error(fn):
        try:
            fn()
        except (RuntimeError, ValueError) as e:
            return str(e)

    x, y = _batch()
    make = lambda **kw: PipelineParallel(
        _model(), **{"microbatches": 4, "loss_fn": F.mse_loss, **kw})
    out = {"layers": error(lambda: make(balance=[2, 2, 2])),
           "schedule": error(lambda: make(schedule="zb-h1")),
           "m": error(lambda: make(microbatches=0)),
           "rows": error(lambda: make(microbatches=5).step(x, y)),
           "call": error(lambda: make()(x))}
    if rank == world_size - 1:  # checked before any send: the others do not wait
        out["target"] = error(lambda: make().step(x, None))
    return out


def test_mistakes_say_what_happened(cluster):
    res = cluster.run(_mistakes).values
    for r in res:
        assert "balance must be 4 integers" in r["layers"], r["layers"]
        assert "schedule must be one of ('gpipe', '1f1b')" in r["schedule"], (
            r["schedule"])
        assert "microbatches must be an integer >= 1, got 0" in r["m"], r["m"]
        assert r["rows"] == "a batch of 12 rows cannot be cut into 5 equal " \
                            "micro-batches", r["rows"]
        assert "pipe.step(x, target)" in r["call"], r["call"]
    assert "the last stage needs target with 12 rows" in res[-1]["target"], (
        res[-1]["target"])
