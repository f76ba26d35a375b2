"""Chapter 10's checks: the 1F1B order of passes on one stage, and how many
micro-batches' activations each stage holds at its peak. Both run the student's
function on every rank (common.run_answer: a stub is "not written yet", an
exception is told by rank and the student's line, a hang in seconds by where
each rank waits) and name the rank, the step or the case that is wrong, with
what was expected. Only a right order then drives a real pipeline step."""

from __future__ import annotations


from labkit.checks.common import (
    NOT_YET,
    PASSED,
    ExerciseError,
    compare,
    is_number,
    run_answer,
)

WIDTH, ROWS = 5, 12  # the small model the checks train: 8 layers, 12 rows


def _run(cluster, worker, *args, what: str, case: str):
    """common.run_answer, with the case that ran ("p=4, m=6") leading its error."""
    try:
        return run_answer(cluster, worker, *args, what=what)
    except ExerciseError as err:
        raise ExerciseError(f"{case}: {err}") from None


def _shown(value, limit: int = 60) -> str:
    s = repr(value)
    return s if len(s) <= limit else s[:limit] + "…"


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


def _one_process_grads(dtype: str) -> dict:
    """One process's gradients of the whole batch's loss, in float32 or float64."""
    import torch
    import torch.nn.functional as F

    to = getattr(torch, dtype)
    model, (x, y) = _model().to(to), _batch()
    F.mse_loss(model(x.to(to)), y.to(to)).backward()
    return _grads(model)


def _sizes(p: int, m: int) -> None:
    if not 1 <= p <= 8:
        raise ValueError(f"these checks split an 8-layer model: they need 1 to 8 "
                         f"ranks, not {p}")
    if m < 1 or ROWS % m:
        raise ValueError(f"m = {m} micro-batches do not split the check's {ROWS} "
                         "rows evenly: use m = 1, 2, 3, 4, 6 or 12")


# ---------------------------------------------------------------- exercise 1


def _normalise(order):
    """The answer as [(kind, microbatch)], or a message saying what is wrong
    (runs on the rank: only plain values travel back)."""
    if not isinstance(order, (list, tuple)):
        return None, (f"your function returned {_shown(order)} "
                      f"({type(order).__name__}); return a list of ('F', i) and "
                      "('B', i) pairs")
    out = []
    for k, step in enumerate(order):
        ok = (isinstance(step, (list, tuple)) and len(step) == 2
              and step[0] in ("F", "B") and isinstance(step[1], int)
              and not isinstance(step[1], bool))
        if not ok:
            return None, (f"step {k} is {_shown(step)} ({type(step).__name__}); "
                          "each step is a pair such as ('F', 0) (forward of "
                          "micro-batch 0) or ('B', 0)")
        out.append((step[0], int(step[1])))
    return out, None


def _order_worker(rank, world_size, fn, m):
    from labkit.parallel import stage_order

    order, problem = _normalise(fn(world_size, m, rank))
    want = [(a.kind, a.microbatch) for a in stage_order("1f1b", world_size, m, rank)]
    return {"order": order, "problem": problem, "want": want}


def _pipeline_worker(rank, world_size, orders, m):
    """One real pipeline step of the small model, stage `rank` in `orders[rank]`."""
    import torch.nn.functional as F

    from labkit.parallel import PipelineParallel
    from labkit.parallel import Action

    x, y = _batch()
    pipe = PipelineParallel(_model(), microbatches=m, loss_fn=F.mse_loss)
    pipe.order = [Action(k, i) for k, i in orders[rank]]  # the student's order runs
    pipe.step(x, y)
    return {"grads": _grads(pipe.module), "in_flight": pipe.peak_in_flight}


def _explain(p: int, m: int, rank: int, k: int) -> str:
    warm = min(p - 1 - rank, m)
    if k < warm:
        return (f"stage {rank} starts with p-1-rank = {warm} forwards (warm-up), "
                "before any backward can reach it")
    if k < warm + 2 * (m - warm):
        return ("after the warm-up, each forward is followed by the backward of "
                "the oldest micro-batch still held (one forward, one backward)")
    return "once every forward has run, the remaining backwards follow, in order"


def _order_problem(p: int, m: int, rank: int, r: dict) -> str | None:
    """What is wrong with one rank's order, or None."""
    where = f"rank {rank} (stage {rank} of {p}, m={m})"
    if r["problem"]:
        return f"{where}: {r['problem']}"
    got, want = r["order"], r["want"]
    for k, (g, w) in enumerate(zip(got, want)):
        if g != w:
            return (f"{where}, step {k}: expected {w}, got {g}. "
                    f"Hint: {_explain(p, m, rank, k)}")
    if len(got) == len(want):
        return None
    more = (f"{len(got) - len(want)} steps too many, from step {len(want)}: "
            f"{got[len(want)]}" if len(got) > len(want) else
            f"it stops after {len(got)} of {len(want)} steps; next: "
            f"{want[len(got)]}")
    return (f"{where}: {more}. Every micro-batch has one F and one B on every "
            f"stage: {2 * m} steps")


def check_1f1b_order(cluster, fn, m: int = 6) -> bool:
    """Check `fn(p, m, rank)`: stage `rank`'s 1F1B order for m micro-batches, a
    list of ("F", i) and ("B", i). Each rank computes its own; the first wrong
    step is named. A right answer then drives a real pipeline step on the ranks,
    whose gradients must be one process's."""
    p = cluster.world_size
    _sizes(p, m)
    res = _run(cluster, _order_worker, fn, m, what="1F1B order", case=f"p={p}, m={m}")
    if res is None:
        return NOT_YET
    for rank, r in enumerate(res):
        if (problem := _order_problem(p, m, rank, r)) is not None:
            raise ExerciseError(problem)
    ran = cluster.run(_pipeline_worker, [r["order"] for r in res], m)
    ref, exact = (_one_process_grads(dtype) for dtype in ("float32", "float64"))
    for rank, r in enumerate(ran):
        # the micro-batches' gradients are summed in another order than one
        # process's whole batch: as far from float64 as one process's are
        for name, g in r["grads"].items():
            compare(f"rank {rank}: the order is right, but the gradient of {name}",
                    g, ref[name], exact=exact[name],
                    hint="the pipeline step should give one process's gradients")
    held = [r["in_flight"] for r in ran]
    print(f"correct: every stage's {2 * m} passes in 1F1B order; run on {p} real "
          f"ranks they give one process's gradients, holding at most {held} "
          "micro-batches by stage")
    return PASSED


# ---------------------------------------------------------------- exercise 2

CASES = (("gpipe", 2), ("gpipe", 6), ("1f1b", 2), ("1f1b", 6))


def _predict_worker(rank, world_size, fn, schedule, m):
    guess = fn(schedule, world_size, m, rank)
    if is_number(guess):
        return {"value": guess}  # 4, 4.0, numpy.int64(4): any real number
    return {"shown": f"{_shown(guess)} ({type(guess).__name__})"}


def _measure_worker(rank, world_size):
    import torch.nn.functional as F

    from labkit.parallel import PipelineParallel

    x, y = _batch()
    out = {}
    for schedule, m in CASES:
        pipe = PipelineParallel(_model(), microbatches=m, loss_fn=F.mse_loss,
                                schedule=schedule)
        pipe.step(x, y)
        out[schedule, m] = pipe.peak_in_flight
    return out


def check_in_flight(cluster, fn) -> bool:
    """Check `fn(schedule, p, m, stage)`: how many micro-batches' activations
    stage `stage` of p holds at its peak under "gpipe" or "1f1b". It is compared,
    on every rank, with what that rank's real pipeline step held. Any real number
    equal to it passes (4, 4.0, a numpy integer); a bool, a tensor or a string is
    not a count and is named as such."""
    p = cluster.world_size
    _sizes(p, 1)
    guesses = {}
    for schedule, m in CASES:
        res = _run(cluster, _predict_worker, fn, schedule, m, what="prediction",
                   case=f"{schedule}, p={p}, m={m}")
        if res is None:
            return NOT_YET
        guesses[schedule, m] = list(res)
    measured = cluster.run(_measure_worker)
    for (schedule, m) in CASES:
        for rank, r in enumerate(guesses[schedule, m]):
            held = measured[rank][schedule, m]
            case = f"{schedule}, p={p}, m={m}, stage {rank}"
            if "shown" in r:  # None, a bool, a string, a tensor, a list...
                raise ExerciseError(f"{case}: expected a number of micro-batches "
                                    f"(such as 4 or 4.0), got {r['shown']}")
            guess = r["value"]
            if guess != held:
                hint = ("GPipe runs every forward before the first backward" if
                        schedule == "gpipe" else
                        "stage s runs p-1-s forwards, then one more before its "
                        "first backward frees one; never more than m")
                raise ExerciseError(f"{case}: you predicted {guess}, the rank held "
                                    f"{held} at its peak. Hint: {hint}")
    print(f"correct: on all {p} ranks, for GPipe and 1F1B with m = 2 and 6, your "
          "prediction is what each stage held")
    return PASSED
