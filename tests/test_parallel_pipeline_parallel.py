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

from labkit.parallel.events import Span
from labkit.parallel.pipeline_parallel import bubble_fractions, split_layers
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


def _reference():
    """One process, the whole batch: the first step's gradients (weights and
    input) and, step by step, the loss; the weights after STEPS SGD steps."""
    model, (x, y) = _model(), _batch()
    x.requires_grad_()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], None
    for _ in range(STEPS):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if grads is None:
            grads = {k: p.grad.clone() for k, p in model.named_parameters()}
            grads["input"] = x.grad.clone()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads,
            "params": {k: p.detach().clone() for k, p in model.named_parameters()}}


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
    return _reference()


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("key", RUNS, ids=lambda k: f"p{k[0]}-{k[1]}-m{k[2]}")
def test_matches_single_process_training(trained, reference, key):
    p = key[0]
    res = trained[key]
    for r in res:
        lo, hi = split_layers(8, p, BALANCE[p])[r["stage"]]
        names = {k for k in reference["params"] if lo <= int(k.split(".")[0]) < hi}
        assert set(r["params"]) == names  # the stage keeps its layers, by name
        # fp32: the m micro-batches' gradients are summed in another order than
        # one process's whole-batch matmul (measured ~6e-8): 1e-6 relative
        for k in names:
            assert rel_err(r["grads"][k], reference["grads"][k]) <= 1e-6, k
            assert rel_err(r["params"][k], reference["params"][k]) <= 1e-6, k
        if r["stage"] == 0:
            assert rel_err(r["grads"]["input"], reference["grads"]["input"]) <= 1e-6
        if r["stage"] == p - 1:  # the loss of the whole batch, step by step
            assert r["losses"] == pytest.approx(reference["losses"], rel=1e-6)
        else:
            assert r["losses"] == [None] * STEPS
    start = {k: v.detach() for k, v in _model().named_parameters()}
    assert all(rel_err(reference["params"][k], v) > 1e-3 for k, v in start.items())


@pytest.mark.parametrize("key", [k for k in RUNS if k[0] > 1],
                         ids=lambda k: f"p{k[0]}-{k[1]}-m{k[2]}")
def test_spans_follow_the_schedule(trained, key):
    p, schedule, m = key
    for pipeline in PIPELINES[p]:
        _check_spans([trained[key][g] for g in pipeline], p, schedule, m)


PIPELINES = {4: [[0, 1, 2, 3]], 2: [[0, 2], [1, 3]]}  # global ranks, by stage


def _check_spans(res, p, schedule, m):
    assert [r["stage"] for r in res] == list(range(p))
    by_stage = {r["stage"]: r["events"] for r in res}
    for s, evs in by_stage.items():
        want = stage_order(schedule, p, m, s)
        compute = [e.name for e in evs if e.kind == "compute"]
        assert compute == [f"{'forward' if a.kind == 'F' else 'backward'} "
                           f"{a.microbatch}" for a in want]
        names = [e.name for e in evs]
        for i in range(m):  # receive before using, send after producing
            if s > 0:
                assert names.index(f"recv activation {i}") < names.index(
                    f"forward {i}") < names.index(f"send gradient {i}")
            if s < p - 1:
                assert names.index(f"forward {i}") < names.index(
                    f"send activation {i}")
                assert names.index(f"recv gradient {i}") < names.index(
                    f"backward {i}")
        spans = [e for e in evs if e.kind == "compute"]
        assert all(a.end <= b.start for a, b in zip(spans, spans[1:]))
    # one clock on one machine: micro-batch i's forward on stage s starts after
    # stage s-1's ended, and its backward after stage s+1's backward ended
    at = {(s, e.name): e for s, evs in by_stage.items() for e in evs}
    for s in range(1, p):
        for i in range(m):
            assert at[s, f"forward {i}"].start >= at[s - 1, f"forward {i}"].end
            assert at[s - 1, f"backward {i}"].start >= at[s, f"backward {i}"].end
    held = [r["held"] for r in res]
    if schedule == "1f1b":
        assert held == [min(p - s, m) for s in range(p)]
    else:
        assert held == [m] * p


def test_one_stage_per_rank_runs_no_communication(trained):
    for r in trained[1, "1f1b", 3]:
        assert {e.kind for e in r["events"]} == {"compute"}
        assert r["order"] == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2),
                              ("B", 2)]


def test_bubble_fractions_from_spans():
    # stage 0 computes 0-1 and 3-4, stage 1 1-3: window 0-4
    events = {0: [Span("compute", "forward 0", 0.0, 1.0),
                  Span("comm", "recv gradient 0", 1.0, 3.0),
                  Span("compute", "backward 0", 3.0, 4.0)],
              1: [Span("compute", "forward 0", 1.0, 2.0),
                  Span("compute", "backward 0", 2.0, 3.0)]}
    assert bubble_fractions(events) == [0.5, 0.5]
    with pytest.raises(ValueError, match="no compute"):
        bubble_fractions({0: []})


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
    assert held == k
    # per micro-batch stage 0 keeps its ReLU's output (also the tensor it sends);
    # while a forward runs, its Linear's output exists until the ReLU is done
    assert peak == (k + 1) * unit


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
    for r in res:
        assert r["ours"].keys() == r["theirs"].keys() and r["ours"]
        for k, g in r["ours"].items():
            assert rel_err(g, r["theirs"][k]) <= 1e-6, k
    assert rel_err(res[-1]["loss"], res[-1]["their_loss"]) <= 1e-6
    assert res[-1]["loss"].item() == pytest.approx(reference["losses"][0], rel=1e-6)


# ------------------------------------------------------------------------ errors


def test_split_layers():
    assert split_layers(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert split_layers(8, 2, [3, 5]) == [(0, 3), (3, 8)]
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
    make = lambda **kw: PipelineParallel(  # noqa: E731
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
        assert "balance must be 4 integers" in r["layers"]
        assert "schedule must be one of ('gpipe', '1f1b')" in r["schedule"]
        assert "microbatches must be an integer >= 1, got 0" in r["m"]
        assert r["rows"] == "a batch of 12 rows cannot be cut into 5 equal " \
                            "micro-batches"
        assert "pipe.step(x, target)" in r["call"]
    assert "the last stage needs target with 12 rows" in res[-1]["target"]
