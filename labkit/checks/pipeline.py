"""Chapter 10's checks: the 1F1B order of passes on one stage, and how many
micro-batches' activations each stage holds at its peak. Both run the student's
function on every rank of the cluster and name the rank, the step or the case
that is wrong, with what was expected."""

from __future__ import annotations

import traceback

from labkit.checks.common import NOT_YET, PASSED, ExerciseError
from labkit.runtime.results import CollectiveTimeout, RankError

TIMEOUT = 20.0  # seconds: a hang is reported, not waited for
WIDTH, ROWS = 5, 12  # the small model the checks train


def _run(cluster, worker, *args, what: str):
    """cluster.run with a short timeout; None (after saying so) while the answer
    still raises NotImplementedError; a failure becomes an ExerciseError."""
    try:
        return cluster.run(worker, *args, timeout=TIMEOUT)
    except CollectiveTimeout as err:
        raise ExerciseError(
            f"the ranks were still running after {TIMEOUT:g} s (a pipeline waiting "
            f"for a pass that never comes); {what} must give every rank a list it "
            "can finish\n" + "\n".join(f"rank {r}: {b}" for r, b in
                                        sorted(err.busy.items()))) from None
    except RankError as err:
        excs = err.exceptions
        if excs and all(isinstance(e, NotImplementedError) for e in excs.values()):
            print("not written yet: replace `raise NotImplementedError` with your "
                  f"{what}, then run this cell again")
            return None
        first = str(err).split("\n")[0]  # the check's own failure, said briefly
        raise ExerciseError(f"the check could not run your {what}: {first}") from None


def _call(fn, *args):
    """("ok", value) or ("raised", "Type: message (line N)"); NotImplementedError
    propagates (the answer is not written yet)."""
    try:
        return "ok", fn(*args)
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001 - any mistake is reported, not raised
        tb = traceback.extract_tb(e.__traceback__)
        where = f" (line {tb[-1].lineno})" if len(tb) > 1 else ""
        return "raised", f"{type(e).__name__}: {e}{where}"


def _model():
    import torch

    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def _batch():
    import torch

    g = torch.Generator().manual_seed(1)
    return torch.randn(ROWS, WIDTH, generator=g), torch.randn(ROWS, WIDTH, generator=g)


def _grads(model_or_stage) -> dict:
    return {k: p.grad.detach().clone() for k, p in model_or_stage.named_parameters()}


# ---------------------------------------------------------------- exercise 1


def _normalise(order):
    """The answer as [(kind, microbatch)], or a message saying what is wrong."""
    if not isinstance(order, (list, tuple)):
        return None, (f"returned {order!r} ({type(order).__name__}); return a list "
                      "of ('F', i) and ('B', i) pairs")
    out = []
    for k, step in enumerate(order):
        ok = (isinstance(step, (list, tuple)) and len(step) >= 2
              and step[0] in ("F", "B") and isinstance(step[1], int)
              and not isinstance(step[1], bool))
        if not ok:
            return None, (f"step {k} is {step!r}; each step is a pair such as "
                          "('F', 0) (forward of micro-batch 0) or ('B', 0)")
        out.append((step[0], step[1]))
    return out, None


def _order_worker(rank, world_size, fn, m):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from labkit.parallel.pipeline_parallel import PipelineParallel
    from labkit.parallel.pipeline_schedules import Action, stage_order

    status, value = _call(fn, world_size, m, rank)
    order, problem = _normalise(value) if status == "ok" else (None, value)
    want = [(a.kind, a.microbatch) for a in stage_order("1f1b", world_size, m, rank)]
    right = torch.tensor([int(order == want)])
    dist.all_reduce(right, op=dist.ReduceOp.MIN)  # run it only if every rank can
    out = {"status": status, "problem": problem, "order": order, "want": want}
    if right.item():
        x, y = _batch()
        pipe = PipelineParallel(_model(), microbatches=m, loss_fn=F.mse_loss)
        pipe.order = [Action(k, i) for k, i in order]  # the student's order runs
        pipe.step(x, y)
        out.update(grads=_grads(pipe.module), in_flight=pipe.peak_in_flight)
    return out


def _explain(p: int, m: int, rank: int, k: int) -> str:
    warm = min(p - 1 - rank, m)
    if k < warm:
        return (f"stage {rank} starts with p-1-rank = {warm} forwards (warm-up), "
                "before any backward can reach it")
    if k < warm + 2 * (m - warm):
        return ("after the warm-up, each forward is followed by the backward of "
                "the oldest micro-batch still held (one forward, one backward)")
    return "once every forward has run, the remaining backwards follow, in order"


def check_1f1b_order(cluster, fn, m: int = 6) -> bool:
    """Check `fn(p, m, rank)`: stage `rank`'s 1F1B order for m micro-batches, a
    list of ("F", i) and ("B", i). Each rank computes its own; the first wrong
    step is named. A right answer then drives a real pipeline step on the ranks,
    whose gradients must be one process's."""
    import torch
    import torch.nn.functional as F

    p = cluster.world_size
    res = _run(cluster, _order_worker, fn, m, what="1F1B order")
    if res is None:
        return NOT_YET
    for rank, r in enumerate(res):
        if r["status"] == "raised":
            raise ExerciseError(f"rank {rank} (stage {rank} of {p}, m={m}): your "
                                f"function raised {r['problem']}")
        if r["problem"]:
            raise ExerciseError(f"rank {rank} (stage {rank} of {p}, m={m}): "
                                f"{r['problem']}")
        got, want = r["order"], r["want"]
        for k, (g, w) in enumerate(zip(got, want)):
            if g != w:
                raise ExerciseError(
                    f"rank {rank} (stage {rank} of {p}, m={m}), step {k}: expected "
                    f"{w}, got {g}. Hint: {_explain(p, m, rank, k)}")
        if len(got) != len(want):
            more = (f"{len(got) - len(want)} steps too many, from step "
                    f"{len(want)}: {got[len(want)]}" if len(got) > len(want) else
                    f"it stops after {len(got)} of {len(want)} steps; next: "
                    f"{want[len(got)]}")
            raise ExerciseError(f"rank {rank} (stage {rank} of {p}, m={m}): {more}. "
                                "Every micro-batch has one F and one B on every "
                                f"stage: {2 * m} steps")
    model, (x, y) = _model(), _batch()
    F.mse_loss(model(x), y).backward()
    ref = _grads(model)
    for rank, r in enumerate(res):
        for name, g in r["grads"].items():
            if not torch.allclose(g, ref[name], rtol=1e-5, atol=1e-7):
                raise ExerciseError(f"rank {rank}: the order is right but the "
                                    f"gradient of {name} is not one process's")
    held = [r["in_flight"] for r in res]
    print(f"correct: every stage's {2 * m} passes in 1F1B order; run on {p} real "
          f"ranks they give one process's gradients, holding at most {held} "
          "micro-batches by stage")
    return PASSED


# ---------------------------------------------------------------- exercise 2

CASES = (("gpipe", 2), ("gpipe", 6), ("1f1b", 2), ("1f1b", 6))


def _in_flight_worker(rank, world_size, fn):
    import torch.nn.functional as F

    from labkit.parallel.pipeline_parallel import PipelineParallel

    x, y = _batch()
    out = {}
    for schedule, m in CASES:
        pipe = PipelineParallel(_model(), microbatches=m, loss_fn=F.mse_loss,
                                schedule=schedule)
        pipe.step(x, y)
        out[schedule, m] = (pipe.peak_in_flight,
                            _call(fn, schedule, world_size, m, rank))
    return out


def check_in_flight(cluster, fn) -> bool:
    """Check `fn(schedule, p, m, stage)`: how many micro-batches' activations
    stage `stage` of p holds at its peak under "gpipe" or "1f1b". It is compared,
    on every rank, with what that rank's real pipeline step held."""
    p = cluster.world_size
    res = _run(cluster, _in_flight_worker, fn, what="prediction")
    if res is None:
        return NOT_YET
    for (schedule, m) in CASES:
        for rank, r in enumerate(res):
            measured, (status, guess) = r[schedule, m]
            case = f"{schedule}, p={p}, m={m}, stage {rank}"
            if status == "raised":
                raise ExerciseError(f"{case}: your function raised {guess}")
            if isinstance(guess, bool) or not isinstance(guess, int):
                raise ExerciseError(f"{case}: expected a whole number of "
                                    f"micro-batches, got {guess!r}")
            if guess != measured:
                hint = ("GPipe runs every forward before the first backward" if
                        schedule == "gpipe" else
                        "stage s runs p-1-s forwards, then one more before its "
                        "first backward frees one; never more than m")
                raise ExerciseError(f"{case}: you predicted {guess}, the rank held "
                                    f"{measured} at its peak. Hint: {hint}")
    print(f"correct: on all {p} ranks, for GPipe and 1F1B with m = 2 and 6, your "
          "prediction is what each stage held")
    return PASSED
