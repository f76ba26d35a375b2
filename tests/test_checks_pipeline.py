"""labkit.checks.pipeline (chapter 10): the 1F1B-order, activations-in-flight and
bubble checks pass right answers, say "not written yet" for stubs, and name the
case, rank or step of wrong ones, whatever the mistake (a wrong step, a wrong
type, an exception with the student's line, a hang reported in seconds with
where each rank waits). They fail the shortcuts: labkit's own schedules and
closed forms, answers written down for the chapter's or the old fixed cases,
NaN."""

import inspect
import time

import pytest

from labkit.checks.common import ExerciseError
from labkit.checks.pipeline import (
    check_1f1b_order,
    check_bubble_budget,
    check_in_flight,
)

# a right answer is compared with one process within the Oracle's rounding, which
# other CPUs' kernels move: those tests are marked numerics (run again by `make
# test-cpus`). A mistake, shortcut, deadlock or exception differs by far more than
# rounding: those are not.


def _one_f_one_b(p, m, rank):
    warm = min(p - 1 - rank, m)
    order = [("F", i) for i in range(warm)]
    for k in range(m - warm):
        order += [("F", warm + k), ("B", k)]
    return order + [("B", k) for k in range(m - warm, m)]


def _warmup(w):
    """1F1B's shape with a warm-up of w(p, m, rank) forwards, unclipped."""
    def order(p, m, rank):
        warm = w(p, m, rank)
        out = [("F", i) for i in range(warm)]
        for k in range(m - warm):
            out += [("F", warm + k), ("B", k)]
        return out + [("B", k) for k in range(m - warm, m)]
    return order


def _gpipe_order(p, m, rank):
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def _backward_first(p, m, rank):  # B before F in the steady state
    order = _one_f_one_b(p, m, rank)
    warm = min(p - 1 - rank, m)
    if warm < m:
        order[warm], order[warm + 1] = order[warm + 1], order[warm]
    return order


def _strings(p, m, rank):
    return [f"{k}{i}" for k, i in _one_f_one_b(p, m, rank)]


def _short(p, m, rank):
    return _one_f_one_b(p, m, rank)[:-1]


def _own_stage(p, rank):
    """True where the function runs for this rank's own stage of the cluster's
    pipeline (the drawn cases run on rank 0 too, for any p and rank)."""
    import torch.distributed as dist

    return (dist.is_initialized() and p == dist.get_world_size()
            and rank == dist.get_rank())


def _crash(p, m, rank):
    if rank == 2 and _own_stage(p, rank):
        return 1 // (rank - 2)
    return _one_f_one_b(p, m, rank)


def _line(fn, text: str) -> int:
    """The line of this file on which `fn` has `text`."""
    lines, start = inspect.getsourcelines(fn)
    return start + next(k for k, line in enumerate(lines) if text in line)


def _todo(*args):
    raise NotImplementedError


def _recv_first(p, m, rank):  # waits for a message no rank sends
    import torch
    import torch.distributed as dist

    if rank > 0 and _own_stage(p, rank):
        dist.recv(torch.zeros(1), src=rank - 1)
    return _one_f_one_b(p, m, rank)


@pytest.mark.numerics
def test_a_right_1f1b_order_passes(cluster, capsys):
    assert not check_1f1b_order(cluster, _todo)
    assert "not written yet" in capsys.readouterr().out
    assert check_1f1b_order(cluster, _one_f_one_b)
    out = capsys.readouterr().out
    assert "correct: every stage's order right on 8 (p, m, rank) drawn this run" in out
    assert "micro-batches by stage" in out  # held, measured by stage


@pytest.mark.parametrize("answer, message", [
    (_gpipe_order, r"stage \d+ of p=\d+, m=\d+: that is GPipe's order, every "
                   r"forward before the first backward"),
    # (with one forward-backward pair in the steady state, that is a warm-up
    # one forward short)
    (_backward_first, r"stage \d+ of p=\d+, m=\d+(, step \d+: expected \('F', "
                      r"\d+\), got \('B', 0\)|: your order has a warm-up of)"),
    (_strings, r"stage \d+ of p=\d+, m=\d+: step 0 is 'F0' \(str\); each step is "
               r"a pair"),
    (_short, r"stage \d+ of p=\d+, m=\d+: it stops after \d+ of \d+ steps; next: "
             r"\('B', \d+\)"),
    (lambda p, m, rank: [(*s, 0) if k == 0 else s for k, s in enumerate(
        _one_f_one_b(p, m, rank))], r"step 0 is \('[FB]', 0, 0\) \(tuple\)"),
    (lambda p, m, rank: None, r"your function returned None \(NoneType\)"),
    # the warm-up not cut to m: micro-batches that do not exist
    (_warmup(lambda p, m, r: p - 1 - r), r"micro-batch -?\d+ does not exist: there "
                                         r"are m = \d+"),
    # (a warm-up of m - 1 is GPipe's order)
    (_warmup(lambda p, m, r: min(p - r, m)), r"(your order has a warm-up of \d+ "
                                             r"forwards?; stage \d+ runs "
                                             r"min\(p-1-rank, m\) = \d+|that is "
                                             r"GPipe's order)"),
    (_warmup(lambda p, m, r: min(r, m)), r"(Stage 0 is the first stage, the one "
                                         r"with the longest warm-up|that is GPipe's "
                                         r"order)"),
])
def test_wrong_1f1b_orders_are_named(cluster, answer, message):
    with pytest.raises(ExerciseError, match=message):
        check_1f1b_order(cluster, answer)


def test_shortcuts_to_the_1f1b_order_fail(cluster):
    def labkits(p, m, rank):
        from labkit.parallel import stage_order

        return [(a.kind, a.microbatch) for a in stage_order("1f1b", p, m, rank)]

    def the_checks(p, m, rank):
        from labkit.checks.pipeline import _one_f_one_b as reference

        return reference(p, m, rank)

    def the_old_fixed_case(p, m, rank):  # p = 4, m = 6 written down, else GPipe's
        return _one_f_one_b(4, 6, rank) if (p, m) == (4, 6) else _gpipe_order(
            p, m, rank)

    with pytest.raises(ExerciseError, match=r"my_1f1b_order\(\d+, \d+, \d+\): your "
                       r"answer calls labkit.parallel.pipeline_schedules.stage_order, "
                       r"labkit's own schedules"):
        check_1f1b_order(cluster, labkits)
    with pytest.raises(ExerciseError, match=r"calls labkit.checks.pipeline."
                       r"_one_f_one_b, labkit's own schedules"):
        check_1f1b_order(cluster, the_checks)
    with pytest.raises(ExerciseError, match=r"that is GPipe's order"):
        check_1f1b_order(cluster, the_old_fixed_case)


def test_an_exception_on_one_rank_names_it_and_the_line(cluster):
    with pytest.raises(ExerciseError) as err:
        check_1f1b_order(cluster, _crash)
    assert str(err.value).endswith(  # only rank 2 raised; the student's line, quoted
        "rank 2: your 1F1B order raised ZeroDivisionError: integer "
        f"division or modulo by zero at line {_line(_crash, '1 //')} of "
        "test_checks_pipeline.py, in _crash: `return 1 // (rank - 2)`")
    assert str(err.value).startswith("p=4, m=")


def test_1f1b_order_check_reports_a_deadlock_in_seconds(cluster, capsys):
    start = time.monotonic()
    with pytest.raises(ExerciseError) as err:
        check_1f1b_order(cluster, _recv_first, timeout=2)
    took = time.monotonic() - start  # the 2 s asked for, not the cluster's 20
    assert took < 15, f"the deadlock was told after {took:.1f} s, under 15 expected"
    lines = str(err.value).splitlines()
    assert lines[0].endswith(": deadlock: rank 1 waits in recv from rank 0, which "
                             "has already returned: the two disagree on how many "
                             "messages pass between them"), lines[0]
    line = _line(_recv_first, "dist.recv")
    for r in (1, 2, 3):  # where each rank waits, on the student's line
        assert (f"  rank {r}: recv from rank {r - 1} at line {line} of "
                "test_checks_pipeline.py, in _recv_first: `dist.recv(torch.zeros(1), "
                "src=rank - 1)`") in lines
    assert "  rank 0: finished" in lines
    assert check_1f1b_order(cluster, _one_f_one_b)  # the ranks came back
    assert "correct" in capsys.readouterr().out


# ---------------------------------------------------------------- in flight


def _right(schedule, p, m, stage):
    return m if schedule == "gpipe" else min(p - stage, m)


def _first_stage_only(schedule, p, m, stage):
    return m if schedule == "gpipe" else min(p, m)


def _as_tensor(schedule, p, m, stage):
    import torch

    return torch.tensor(_right(schedule, p, m, stage))


def _as_float(schedule, p, m, stage):
    return float(_right(schedule, p, m, stage))


def _as_numpy(schedule, p, m, stage):
    import numpy as np

    return np.int64(_right(schedule, p, m, stage))


def _one_schedule(schedule, p, m, stage):
    return {"gpipe": m}[schedule]


def _forever(schedule, p, m, stage):
    while True:
        pass


def _gpipe_only(schedule, p, m, stage):
    if schedule == "gpipe":
        return m
    raise NotImplementedError("1F1B")


@pytest.mark.numerics
def test_a_right_prediction_passes(cluster, capsys):
    assert not check_in_flight(cluster, _todo)
    assert "not written yet" in capsys.readouterr().out
    assert check_in_flight(cluster, _right)
    assert "your prediction is what each stage's real step held" in (
        capsys.readouterr().out)
    # any real number equal to the count passes: 4.0, a numpy integer
    assert check_in_flight(cluster, _as_float)
    assert check_in_flight(cluster, _as_numpy)
    assert not check_in_flight(cluster, _gpipe_only)  # half a stub: not written yet
    assert "not written yet" in capsys.readouterr().out


@pytest.mark.parametrize("answer, message", [
    (_first_stage_only, r"1f1b'?, p=\d+, m=\d+, stage[ =]\d+.*: you predicted \d+, "
                        r"\d+ expected; that is stage 0's count"),
    (lambda s, p, m, stage: m if s == "gpipe" else p - stage,
     r"you predicted \d+, \d+ expected; with m = \d+ micro-batches a stage cannot "
     r"hold more than m"),
    (lambda s, p, m, stage: p if s == "gpipe" else min(p - stage, m),
     r"gpipe'?, p=.*GPipe runs all m forwards before its first backward"),
    (lambda s, p, m, stage: m if s == "gpipe" else min(p - 1 - stage, m),
     r"runs p-1-s = \d+ forwards of warm-up, then one more"),
    (lambda s, p, m, stage: m + 0.5, r"you predicted \d+.5, \d+ expected"),
    (lambda s, p, m, stage: True, r"expected a number of micro-batches \(such as 4 "
                                  r"or 4.0\), got True \(bool\)"),
    (_as_tensor, r"expected a number .*got tensor\(\d+\) \(Tensor\)"),
    (lambda s, p, m, stage: float("nan"), r"nan is not a number an answer can be"),
])
def test_wrong_predictions_are_named(cluster, answer, message):
    with pytest.raises(ExerciseError, match=message):
        check_in_flight(cluster, answer)


def test_shortcuts_to_the_prediction_fail(cluster):
    def labkits(schedule, p, m, stage):
        from labkit.parallel import peak_in_flight, stage_order

        return peak_in_flight(stage_order(schedule, p, m, stage))

    def theory(schedule, p, m, stage):
        from labkit.theory import activations_in_flight

        return activations_in_flight(schedule, p - stage, m)

    def the_old_cases(schedule, p, m, stage):  # p = 4, m = 2 and 6, written down
        if p != 4:
            return 0
        return {("gpipe", 2): 2, ("gpipe", 6): 6, ("1f1b", 2): min(4 - stage, 2),
                ("1f1b", 6): 4 - stage}.get((schedule, m), 0)

    with pytest.raises(ExerciseError, match=r"calls labkit.parallel."
                       r"pipeline_schedules.stage_order, labkit's own schedules"):
        check_in_flight(cluster, labkits)
    with pytest.raises(ExerciseError, match=r"calls labkit.theory.pipeline."
                       r"activations_in_flight, labkit's own schedules \(or their "
                       r"closed forms\)"):
        check_in_flight(cluster, theory)
    with pytest.raises(ExerciseError, match=r"you predicted 0, \d+ expected"):
        check_in_flight(cluster, the_old_cases)


def test_an_exception_and_an_endless_loop_are_told(cluster):
    with pytest.raises(ExerciseError) as err:
        check_in_flight(cluster, _one_schedule)
    assert str(err.value) == (  # the case that raised, the student's line
        f"{str(err.value).split(':')[0]}: rank 0: your prediction raised KeyError: "
        f"'1f1b' at line {_line(_one_schedule, 'return')} of test_checks_pipeline.py, "
        "in _one_schedule: `return {\"gpipe\": m}[schedule]`")
    assert str(err.value).startswith("my_in_flight('1f1b', p=")
    with pytest.raises(ExerciseError) as err:
        check_in_flight(cluster, _forever, timeout=2)
    lines = str(err.value).splitlines()
    assert "rank 0 still running after 2 s without waiting on another rank" in (
        lines[0])
    line = _line(_forever, "while True")
    assert (f"  rank 0: running, not waiting on another rank at line {line} "
            "of test_checks_pipeline.py, in _forever: `while True:`") in lines
    assert check_in_flight(cluster, _right)  # the ranks came back


# ---------------------------------------------------------------- exercise 3


def _fewest(p, percent):
    m = 1
    while 100 * (p - 1) >= percent * (m + p - 1):
        m += 1
    return m, m / min(p, m)


def test_a_right_bubble_budget_passes(capsys):
    assert not check_bubble_budget(_todo)
    assert "not written yet" in capsys.readouterr().out
    assert check_bubble_budget(_fewest)
    assert ("with p = 8, 1F1B idles under 10% from m = 64 on, and there GPipe's "
            "stage 0 holds 8 times 1F1B's activations") in capsys.readouterr().out
    assert check_bubble_budget(lambda p, pct: list(_fewest(p, pct)))


def _with(m_of, ratio_of=lambda p, m: m / min(p, m)):
    def answer(p, percent):
        m = m_of(p, percent)
        return m, ratio_of(p, m)
    return answer


@pytest.mark.parametrize("answer, message", [
    # at exactly 10% the bubble is not under it: the chapter's case tells
    (_with(lambda p, pct: next(m for m in range(1, 10**4)
                               if 100 * (p - 1) <= pct * (m + p - 1))),
     r"fewest_microbatches\(p=8, percent=10\): m = 63, expected 64; at m = 63 the "
     r"bubble is exactly 10%, which is not under it"),
    (_with(lambda p, pct: next(m for m in range(1, 10**4)
                               if 100 * (p - 1) < pct * m)),
     r"\(p-1\)/m is the bubble over the ideal time"),
    # 1F1B's stage 0 holds min(p, m): m/p is wrong where m < p (drawn every run)
    (_with(lambda p, pct: _fewest(p, pct)[0], lambda p, m: m / p),
     r"the ratio is [\d.]+, expected 1 at m = \d+; 1F1B's stage 0 holds min\(p, m\)"),
    (_with(lambda p, pct: _fewest(p, pct)[0], lambda p, m: min(p, m) / m),
     r"the ratio is 0.125, expected 8 at m = 64; that is 1F1B's over GPipe's"),
    (lambda p, pct: 64, r"return a pair \(m, ratio\), not 64"),
    (lambda p, pct: (64, float("nan")), r"the ratio: nan is not a number"),
    (lambda p, pct: ("64", 8), r"m must be a number, got '64' \(str\)"),
    # the chapter's pair, written down, fails the cases drawn this run
    (lambda p, pct: (64, 8.0), r"fewest_microbatches\(p=\d+, percent=\d+\): (m = "
                               r"64, expected \d+|the ratio is 8, expected)"),
])
def test_wrong_bubble_budgets_are_named(answer, message):
    with pytest.raises(ExerciseError, match=message):
        check_bubble_budget(answer)


def test_labkits_closed_forms_are_refused():
    def labkits(p, percent):
        from labkit.theory import activations_in_flight, pipeline_bubble

        m = next(m for m in range(1, 10**4)
                 if pipeline_bubble(p, m).of_total < percent / 100)
        return m, (activations_in_flight("gpipe", p, m)
                   / activations_in_flight("1f1b", p, m))

    with pytest.raises(ExerciseError, match=r"fewest_microbatches\(p=8, percent=10\): "
                       r"your answer calls labkit.theory.pipeline.pipeline_bubble, "
                       r"labkit's own pipeline closed forms"):
        check_bubble_budget(labkits)


def test_the_reference_is_stage_order_and_the_closed_form():
    """The checks' own references agree with labkit's schedules and formulas,
    written independently (a rule, a count, a loop in whole numbers)."""
    from fractions import Fraction

    from labkit.checks.pipeline import _fewest as fewest
    from labkit.checks.pipeline import _held, _one_f_one_b as reference
    from labkit.parallel import peak_in_flight, stage_order
    from labkit.theory import pipeline_bubble

    for p in range(1, 13):
        for m in range(1, 30):
            for r in range(p):
                want = stage_order("1f1b", p, m, r)
                assert reference(p, m, r) == [(a.kind, a.microbatch) for a in want]
                for s in ("gpipe", "1f1b"):
                    assert _held(s, p, m, r) == peak_in_flight(stage_order(s, p, m, r))
    for p in range(2, 33):
        for pct in range(1, 91):
            m, _ = fewest(p, pct)
            assert Fraction(p - 1, m + p - 1) < Fraction(pct, 100) <= Fraction(
                p - 1, m + p - 2), (p, pct, m)
            assert pipeline_bubble(p, m).of_total < pct / 100 + 1e-12
