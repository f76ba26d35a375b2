"""Chapter 10's checks: the 1F1B order of one stage, the micro-batches a stage
holds at its peak, and the fewest micro-batches that keep the bubble under a limit.

Imports the other check modules; torch and labkit.parallel inside the checks.

References are written here, never labkit's schedules or closed forms (those are
refused while the answer runs); a right 1F1B order then drives a real pipeline
step, whose gradients must be one process's.
"""

from __future__ import annotations

import random
from fractions import Fraction

from labkit.checks.common import (
    NOT_WRITTEN,
    NOT_YET,
    PASSED,
    SHORT_TIMEOUT,
    ExerciseError,
    call_answer,
    compare,
    finite,
    is_number,
    labkit_cluster,
    run_answer,
)
from labkit.checks.verify import fresh_seed, own_calls, refuse_own

WIDTH, LAYERS = 5, 8  # the small model the checks train: 4 x (Linear, Tanh)
# labkit's own schedules, closed forms and pipeline, and this module's
# references: never an answer
_OWN = ("labkit.parallel.pipeline_schedules", "labkit.parallel.pipeline_parallel",
        "labkit.theory.pipeline", "labkit.checks.pipeline:_one_f_one_b",
        "labkit.checks.pipeline:_held", "labkit.checks.pipeline:_fewest")


def _run(cluster, worker, *args, what: str, case: str, timeout: float):
    """common.run_answer, with the case that ran ("p=4, m=6") leading its error."""
    try:
        return run_answer(cluster, worker, *args, what=what, timeout=timeout)
    except ExerciseError as err:
        raise ExerciseError(f"{case}: {err}") from None


def _shown(value, limit: int = 60) -> str:
    s = repr(value)
    return s if len(s) <= limit else s[:limit] + "…"


def _model(seed: int):
    import torch

    torch.manual_seed(seed)
    layers = []
    for _ in range(LAYERS // 2):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def _batch(seed: int, rows: int):
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    return torch.randn(rows, WIDTH, generator=g), torch.randn(rows, WIDTH, generator=g)


def _grads(model_or_stage) -> dict:
    return {k: p.grad.detach().clone() for k, p in model_or_stage.named_parameters()}


def _one_process_grads(dtype: str, seed: int, rows: int, pieces: int = 1) -> dict:
    """One process's gradients of the whole batch's loss, in float32 or float64,
    added up from `pieces` equal micro-batches in turn (as a pipeline adds them)."""
    import torch
    import torch.nn.functional as F

    to = getattr(torch, dtype)
    model, (x, y) = _model(seed).to(to), _batch(seed, rows)
    for xs, ys in zip(x.to(to).tensor_split(pieces), y.to(to).tensor_split(pieces)):
        (F.mse_loss(model(xs), ys) / pieces).backward()
    return _grads(model)


def _farther(a, b, exact):
    """Of two float32 runs, the one farther from float64: the rounding a third
    order of the same sums may have (common.rounding_tolerance)."""
    return max(a, b, key=lambda g: (g.double() - exact).abs().max().item())


def _world(p: int) -> None:
    if not 1 <= p <= LAYERS:
        raise ValueError(f"these checks split an {LAYERS}-layer model: they need 1 "
                         f"to {LAYERS} ranks, not {p}")


# ---------------------------------------------------------------- the references


def _one_f_one_b(p: int, m: int, rank: int) -> list[tuple[str, int]]:
    """Stage `rank`'s 1F1B order, built from its rule rather than its phases: run
    the next forward while forwards remain and fewer than p - rank micro-batches
    are held (a stage never holds more), else the backward of the oldest held."""
    order, held, nxt = [], [], 0
    while nxt < m or held:
        if nxt < m and len(held) < p - rank:
            order.append(("F", nxt))
            held.append(nxt)
            nxt += 1
        else:
            order.append(("B", held.pop(0)))
    return order


def _gpipe(m: int) -> list[tuple[str, int]]:
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def _held(schedule: str, p: int, m: int, stage: int) -> int:
    """The most micro-batches `stage` holds at once, counted along its order."""
    order = _gpipe(m) if schedule == "gpipe" else _one_f_one_b(p, m, stage)
    held = peak = 0
    for kind, _ in order:
        held += 1 if kind == "F" else -1
        peak = max(peak, held)
    return peak


# ---------------------------------------------------------------- exercise 1


def _normalise(order):
    """The answer as [(kind, microbatch)], or a message saying what is wrong
    (runs on a rank too: only plain values travel back)."""
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


def _order_cases(seed: int) -> list[tuple[int, int, int]]:
    """(p, m, rank): the first stage, the last, a stage whose warm-up m cuts
    short, and others, drawn from `seed`."""
    rng = random.Random(seed)
    cases = []
    for _ in range(5):
        p = rng.randint(2, 12)
        cases.append((p, rng.randint(1, 3 * p), rng.randrange(p)))
    p = rng.randint(3, 12)
    rank = rng.randrange(p - 2)
    cases += [(p, rng.randint(p, 3 * p), 0), (p, rng.randint(1, 2 * p), p - 1),
              (p, rng.randint(1, p - 2 - rank), rank)]  # m < p - 1 - rank
    return cases


def _with_warmup(m: int, w: int) -> list[tuple[str, int]]:
    """1F1B's shape with a warm-up of w forwards (0 <= w <= m)."""
    order = [("F", i) for i in range(w)]
    for k in range(m - w):
        order += [("F", w + k), ("B", k)]
    return order + [("B", k) for k in range(m - w, m)]


def _order_problem(p: int, m: int, rank: int, got, problem) -> str | None:
    """What is wrong with one stage's order, or None."""
    where = f"stage {rank} of p={p}, m={m}"
    if problem:
        return f"{where}: {problem}"
    want = _one_f_one_b(p, m, rank)
    if got == want:
        return None
    warm = min(p - 1 - rank, m)
    outside = [i for _, i in got if not 0 <= i < m]
    if outside:
        why = (f"micro-batch {outside[0]} does not exist: there are m = {m}, "
               "numbered 0 to m-1")
        if p - 1 - rank > m:
            why += (f". Stage {rank} would run p-1-rank = {p - 1 - rank} forwards "
                    f"of warm-up, but there are only {m}: the warm-up is "
                    "min(p-1-rank, m)")
        return f"{where}: {why}"
    if got == _gpipe(m) and warm < m:
        return (f"{where}: that is GPipe's order, every forward before the first "
                f"backward; in 1F1B stage {rank} runs {warm} forwards of warm-up "
                "(p-1-rank), then one forward, one backward")
    for w in range(m + 1):
        if w != warm and got == _with_warmup(m, w):
            why = f"stage {rank} runs min(p-1-rank, m) = {warm}" + (
                ": the last stage computes the loss, so each micro-batch's "
                "backward can follow its forward at once" if rank == p - 1 else
                f": its first backward arrives only once the {p - 1 - rank} "
                "stages after it have run their forwards")
            if w == min(rank, m):
                why += (". Stage 0 is the first stage, the one with the longest "
                        "warm-up; the last stage has none")
            elif w == min(p - rank, m):
                why += (". The forward after the warm-up belongs to the steady "
                        "state: one forward, then one backward")
            return (f"{where}: your order has a warm-up of "
                    f"{w} forward{'s' * (w != 1)}; {why}")
    for k, (g, w) in enumerate(zip(got, want)):
        if g != w:
            return (f"{where}, step {k}: expected {w}, got {g}. "
                    f"Hint: {_explain(p, m, rank, k)}")
    more = (f"{len(got) - len(want)} steps too many, from step {len(want)}: "
            f"{got[len(want)]}" if len(got) > len(want) else
            f"it stops after {len(got)} of {len(want)} steps; next: "
            f"{want[len(got)]}")
    return (f"{where}: {more}. Every micro-batch has one F and one B on every "
            f"stage: {2 * m} steps")


def _explain(p: int, m: int, rank: int, k: int) -> str:
    warm = min(p - 1 - rank, m)
    if k < warm:
        return (f"stage {rank} starts with p-1-rank = {warm} forwards (warm-up), "
                "before any backward can reach it")
    if k < warm + 2 * (m - warm):
        return ("after the warm-up, each forward is followed by the backward of "
                "the oldest micro-batch still held (one forward, one backward)")
    return "once every forward has run, the remaining backwards follow, in order"


def _order_worker(rank, world_size, fn, p, m, stage):
    """The answer for (p, m, stage), on rank 0 only (a drawn case); with p None,
    every rank's own stage of the cluster's pipeline."""
    if p is not None and rank != 0:
        return None
    with own_calls(*_OWN) as own:
        order = fn(world_size, m, rank) if p is None else fn(p, m, stage)
    order, problem = _normalise(order)
    return {"order": order, "problem": problem, "own": list(own)}


def _pipeline_worker(rank, world_size, orders, m, seed, rows):
    """One real pipeline step of the small model, stage `rank` in `orders[rank]`."""
    import torch.nn.functional as F

    from labkit.parallel import Action, PipelineParallel

    x, y = _batch(seed, rows)
    pipe = PipelineParallel(_model(seed), microbatches=m, loss_fn=F.mse_loss)
    pipe.order = [Action(k, i) for k, i in orders[rank]]  # the student's order runs
    pipe.step(x, y)
    return {"grads": _grads(pipe.module), "in_flight": pipe.peak_in_flight}


def check_1f1b_order(cluster, fn, *, timeout: float = SHORT_TIMEOUT) -> bool:
    """Check `fn(p, m, rank)`: stage `rank`'s 1F1B order for m micro-batches, a
    list of ("F", i) and ("B", i). Called (on rank 0) on (p, m, rank) drawn
    fresh each run, then on every rank of the cluster, for its own stage, with
    an m drawn too; labkit's own schedules are refused. The first wrong step is
    named, or the mistake (GPipe's order, a warm-up of the wrong length). A
    right answer then drives a real pipeline step on the ranks, whose gradients
    must be one process's."""
    p = cluster.world_size
    _world(p)
    rng = random.Random(fresh_seed())
    for q, m, rank in _order_cases(rng.getrandbits(31)):
        case = f"my_1f1b_order({q}, {m}, {rank})"
        res = _run(cluster, _order_worker, fn, q, m, rank, what="1F1B order",
                   case=case, timeout=timeout)
        if res is None:
            return NOT_YET
        refuse_own(case, res[0]["own"], "schedules")
        problem = _order_problem(q, m, rank, res[0]["order"], res[0]["problem"])
        if problem is not None:
            raise ExerciseError(problem)
    m, seed = rng.randint(1, 2 * p), rng.getrandbits(31)
    rows = m * rng.randint(1, 3)
    res = _run(cluster, _order_worker, fn, None, m, None, what="1F1B order",
               case=f"p={p}, m={m}", timeout=timeout)
    if res is None:
        return NOT_YET
    for rank, r in enumerate(res):
        refuse_own(f"rank {rank}", r["own"], "schedules")
        if (problem := _order_problem(p, m, rank, r["order"], r["problem"])):
            raise ExerciseError(f"rank {rank}: {problem}")
    ran = cluster.run(_pipeline_worker, [r["order"] for r in res], m, seed, rows)
    exact = _one_process_grads("float64", seed, rows)
    whole, parts = (_one_process_grads("float32", seed, rows, k) for k in (1, m))
    for rank, r in enumerate(ran):
        # the micro-batches' gradients are summed in another order than one
        # process's whole batch: as far from float64 as one process's are, the
        # whole batch at once or the same micro-batches in turn
        for name, g in r["grads"].items():
            compare(f"rank {rank}: the order is right, but the gradient of {name}",
                    g, _farther(whole[name], parts[name], exact[name]),
                    exact=exact[name],
                    hint="the pipeline step should give one process's gradients")
    held = [r["in_flight"] for r in ran]
    print(f"correct: every stage's order right on 8 (p, m, rank) drawn this run; "
          f"on {p} real ranks with m = {m} (drawn too) your orders gave one "
          f"process's gradients, holding at most {held} micro-batches by stage")
    return PASSED


# ---------------------------------------------------------------- exercise 2

SCHEDULES = ("gpipe", "1f1b")


def _in_flight_cases(seed: int) -> list[tuple[str, int, int, int]]:
    rng = random.Random(seed)
    cases = []
    for schedule in SCHEDULES * 3:
        p = rng.randint(2, 16)
        cases.append((schedule, p, rng.randint(1, 3 * p), rng.randrange(p)))
    p = rng.randint(4, 16)
    cases.append(("1f1b", p, rng.randint(1, p // 2), 0))  # m < p - stage
    return cases


def _in_flight_hint(schedule: str, p: int, m: int, stage: int, got) -> str:
    if schedule == "gpipe":
        near = {"GPipe runs all m forwards before its first backward, on every "
                "stage: it holds m, whatever p": (p, min(p, m), p - stage,
                                                  min(p - stage, m))}
    else:
        near = {
            f"stage {stage} runs p-1-s = {p - 1 - stage} forwards of warm-up, then "
            "one more before its first backward frees one": (p - 1 - stage,
                                                             min(p - 1 - stage, m)),
            f"with m = {m} micro-batches a stage cannot hold more than m: min(p-s, "
            "m)": (p - stage,),
            "that is stage 0's count; stage s starts backward s forwards sooner":
                (p, min(p, m)),
            "stage 0 is the first stage: it holds the most (p-s), the last the "
            "fewest": (stage + 1, min(stage + 1, m)),
            "that is GPipe's count; 1F1B starts backward after p-1-s forwards": (m,),
        }
    want = _held(schedule, p, m, stage)
    for why, values in near.items():
        if got in values and got != want:
            return f"; {why}"
    return ""


def _predict_worker(rank, world_size, fn, cases, p=None):
    """The answer for each (schedule, m) with this rank as the stage of the
    cluster's pipeline; with p given, for one drawn (schedule, p, m, stage), on
    rank 0 only."""
    if p is not None and rank != 0:
        return None
    out = []
    for case in cases:
        with own_calls(*_OWN) as own:
            guess = (fn(case[0], world_size, case[1], rank) if p is None else
                     fn(*case))
        shown = (None if is_number(guess) else
                 f"{_shown(guess)} ({type(guess).__name__})")
        out.append({"value": guess if shown is None else None, "shown": shown,
                    "own": list(own)})
    return out


def _measure_worker(rank, world_size, cases, seed):
    import torch.nn.functional as F

    from labkit.parallel import PipelineParallel

    out = []
    for schedule, m in cases:
        x, y = _batch(seed, 2 * m)
        pipe = PipelineParallel(_model(seed), microbatches=m, loss_fn=F.mse_loss,
                                schedule=schedule)
        pipe.step(x, y)
        out.append(pipe.peak_in_flight)
    return out


def _compare_count(case: str, guess, want, hint: str) -> None:
    finite(case, guess)
    if guess != want:
        raise ExerciseError(f"{case}: you predicted {guess}, {want} expected{hint}")


def check_in_flight(cluster, fn, *, timeout: float = SHORT_TIMEOUT) -> bool:
    """Check `fn(schedule, p, m, stage)`: how many micro-batches' activations
    stage `stage` of p holds at its peak under "gpipe" or "1f1b". Called (on
    rank 0) on cases drawn fresh each run, against a count along this module's
    own orders; then on every rank of the cluster for both schedules and two m
    drawn this run (one below p, one not), against what that rank's real
    pipeline step held. labkit's own schedules and closed forms are refused.
    Any real number equal to it passes (4, 4.0, a numpy integer); a bool, a
    tensor or a string is not a count and is named as such."""
    p = cluster.world_size
    _world(p)
    rng = random.Random(fresh_seed())
    for schedule, q, m, stage in _in_flight_cases(rng.getrandbits(31)):
        case = f"my_in_flight({schedule!r}, p={q}, m={m}, stage={stage})"
        res = _run(cluster, _predict_worker, fn, [(schedule, q, m, stage)], q,
                   what="prediction", case=case, timeout=timeout)
        if res is None:
            return NOT_YET
        r = res[0][0]
        refuse_own(case, r["own"], "schedules (or their closed forms)")
        if r["shown"] is not None:
            raise ExerciseError(f"{case}: expected a number of micro-batches (such "
                                f"as 4 or 4.0), got {r['shown']}")
        _compare_count(case, r["value"], _held(schedule, q, m, stage),
                       _in_flight_hint(schedule, q, m, stage, r["value"]))
    ms = (rng.randint(1, p - 1) if p > 1 else 1, rng.randint(p, 2 * p))
    cases = [(s, m) for m in ms for s in SCHEDULES]
    res = _run(cluster, _predict_worker, fn, cases, what="prediction",
               case=f"p={p}, m = {ms[0]} and {ms[1]}", timeout=timeout)
    if res is None:
        return NOT_YET
    measured = labkit_cluster(cluster).run(_measure_worker, cases,
                                           rng.getrandbits(31))
    for rank, guesses in enumerate(res):
        for (schedule, m), r in zip(cases, guesses):
            case = f"{schedule}, p={p}, m={m}, stage {rank}"
            refuse_own(case, r["own"], "schedules (or their closed forms)")
            if r["shown"] is not None:  # None, a bool, a string, a tensor, a list
                raise ExerciseError(f"{case}: expected a number of micro-batches "
                                    f"(such as 4 or 4.0), got {r['shown']}")
            held = measured[rank][cases.index((schedule, m))]
            _compare_count(f"{case} (the rank's real step held {held})", r["value"],
                           held, _in_flight_hint(schedule, p, m, rank, r["value"]))
    print(f"correct on 7 cases drawn this run, and on all {p} ranks, for GPipe and "
          f"1F1B with m = {ms[0]} and {ms[1]} (drawn too): your prediction is what "
          "each stage's real step held")
    return PASSED


# ---------------------------------------------------------------- exercise 3

CHAPTER_CASE = (8, 10)  # p = 8 stages, a bubble under 10%


def _fewest(p: int, percent: int) -> tuple[int, Fraction]:
    """The fewest m with (p-1)/(m+p-1) < percent/100, exactly, and GPipe's
    stage 0 activations over 1F1B's for it: m over min(p, m)."""
    m = 1
    while 100 * (p - 1) >= percent * (m + p - 1):
        m += 1
    return m, Fraction(m, min(p, m))


def _bubble_cases(seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    cases = [CHAPTER_CASE]
    for _ in range(3):
        cases.append((rng.randint(2, 32), rng.randint(1, 50)))
    cases.append((rng.randint(3, 32), rng.randint(51, 90)))  # m < p: 1F1B holds m
    while True:  # a limit the bubble meets exactly at some m: "under" is strict
        p = rng.randint(2, 32)
        ks = [k for k in range(1, 91) if 100 * (p - 1) % k == 0
              and 100 * (p - 1) // k > p - 1]
        if ks:
            cases.append((p, rng.choice(ks)))
            return cases


def _m_hint(p: int, percent: int, got) -> str:
    want = _fewest(p, percent)[0]
    at_most = next(m for m in range(1, 100 * p) if 100 * (p - 1) <= percent * (
        m + p - 1))
    of_ideal = next(m for m in range(1, 100 * p) if 100 * (p - 1) < percent * m)
    if got == at_most != want:
        return (f"; at m = {got} the bubble is exactly {percent}%, which is not "
                "under it")
    if got == of_ideal != want:
        return ("; (p-1)/m is the bubble over the ideal time; the share of the step "
                "is (p-1)/(m+p-1)")
    if got == want - 1:
        return f"; at m = {got} the bubble is {(p - 1) / (got + p - 1):.2%}"
    return ""


def _ratio_hint(p: int, m: int, got: float) -> str:
    near = {
        f"1F1B's stage 0 holds min(p, m): with m = {m} < p = {p} it holds all m, "
        "as GPipe does": Fraction(m, p) if m < p else None,
        "that is 1F1B's over GPipe's; the exercise asks GPipe's over 1F1B's":
            Fraction(min(p, m), m),
        "1F1B's stage 0 holds p-1 of warm-up and one more before its first "
        "backward: min(p, m)": Fraction(m, max(p - 1, 1)) if m >= p else None,
    }
    for why, v in near.items():
        if v is not None and v != Fraction(m, min(p, m)) and abs(got - float(v)) <= (
                1e-9 * float(v)):
            return f"; {why}"
    return ""


def check_bubble_budget(fn) -> bool:
    """Check `fn(p, percent)`: a pair (m, ratio), the fewest micro-batches m with
    which 1F1B on p stages idles less than `percent`% of the step, and for that
    m how many times 1F1B's activations GPipe's stage 0 holds. Called on the
    chapter's case (p = 8, 10%) and cases drawn fresh each run, against this
    module's exact references; labkit's own closed forms are refused."""
    cases = _bubble_cases(fresh_seed())
    for p, percent in cases:
        where = f"fewest_microbatches(p={p}, percent={percent})"
        with own_calls(*_OWN) as own:
            got = call_answer(fn, p, percent, what="micro-batches and ratio")
        refuse_own(where, own, "pipeline closed forms")
        if got is NOT_WRITTEN:
            return NOT_YET
        if not (isinstance(got, (tuple, list)) and len(got) == 2):
            raise ExerciseError(f"{where}: return a pair (m, ratio), not "
                                f"{_shown(got)}")
        m, ratio = got
        want_m, want_ratio = _fewest(p, percent)
        for name, v in (("m", m), ("the ratio", ratio)):
            if not is_number(v):
                raise ExerciseError(f"{where}: {name} must be a number, got "
                                    f"{_shown(v)} ({type(v).__name__})")
            finite(f"{where}: {name}", v)
        if m != want_m:
            raise ExerciseError(f"{where}: m = {m}, expected {want_m}"
                                + _m_hint(p, percent, m))
        if not abs(float(ratio) - float(want_ratio)) <= 1e-9 * float(want_ratio):
            raise ExerciseError(f"{where}: the ratio is {float(ratio):g}, expected "
                                f"{float(want_ratio):g} at m = {m}"
                                + _ratio_hint(p, m, float(ratio)))
    m, ratio = _fewest(*CHAPTER_CASE)
    print(f"correct on {len(cases)} cases, {len(cases) - 1} of them drawn this run: "
          f"with p = 8, 1F1B idles under 10% from m = {m} on, and there GPipe's "
          f"stage 0 holds {float(ratio):g} times 1F1B's activations")
    return PASSED
