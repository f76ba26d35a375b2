"""labkit.checks.pipeline: the 1F1B-order and activations-in-flight checks pass
right answers, say "not written yet" for stubs, and name the rank, step or case
of wrong ones, whatever the mistake (a wrong step, a wrong type, an exception
with the student's line, a hang reported in seconds with where each rank
waits)."""

import inspect
import time

import pytest

from labkit.checks.common import ExerciseError
from labkit.checks.pipeline import check_1f1b_order, check_in_flight

pytestmark = pytest.mark.numerics  # run again under other CPUs' kernels


def _one_f_one_b(p, m, rank):
    warm = min(p - 1 - rank, m)
    order = [("F", i) for i in range(warm)]
    for k in range(m - warm):
        order += [("F", warm + k), ("B", k)]
    return order + [("B", k) for k in range(m - warm, m)]


def _gpipe_order(p, m, rank):
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def _backward_first(p, m, rank):  # B before F in the steady state
    order = _one_f_one_b(p, m, rank)
    warm = min(p - 1 - rank, m)
    order[warm], order[warm + 1] = order[warm + 1], order[warm]
    return order


def _strings(p, m, rank):
    return [f"{k}{i}" for k, i in _one_f_one_b(p, m, rank)]


def _short(p, m, rank):
    return _one_f_one_b(p, m, rank)[:-1]


def _crash(p, m, rank):
    if rank == 2:
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

    if rank > 0:
        dist.recv(torch.zeros(1), src=rank - 1)
    return _one_f_one_b(p, m, rank)


def test_1f1b_order_check(cluster, capsys):
    assert not check_1f1b_order(cluster, _todo)
    assert "not written yet" in capsys.readouterr().out
    assert check_1f1b_order(cluster, _one_f_one_b)
    out = capsys.readouterr().out
    assert "correct" in out and "[4, 3, 2, 1]" in out  # held, measured by stage
    with pytest.raises(ExerciseError, match=r"rank 0 \(stage 0 of 4, m=6\), step 4:"
                       r" expected \('B', 0\), got \('F', 4\). Hint: after the "
                       r"warm-up"):
        check_1f1b_order(cluster, _gpipe_order)
    with pytest.raises(ExerciseError, match=r"rank 0 \(stage 0 of 4, m=6\), step 3:"
                       r" expected \('F', 3\), got \('B', 0\)"):
        check_1f1b_order(cluster, _backward_first)
    with pytest.raises(ExerciseError, match=r"rank 0 .*step 0 is 'F0' \(str\); "
                       r"each step is a pair"):
        check_1f1b_order(cluster, _strings)
    with pytest.raises(ExerciseError, match=r"rank 0 .*it stops after 11 of 12 "
                       r"steps; next: \('B', 5\)"):
        check_1f1b_order(cluster, _short)
    with pytest.raises(ExerciseError, match=r"rank 0 .*step 2 is \('F', 2, 0\) "
                       r"\(tuple\); each step is a pair"):
        check_1f1b_order(cluster, lambda p, m, rank: [
            (*s, 0) if k == 2 else s for k, s in enumerate(_one_f_one_b(p, m, rank))])
    with pytest.raises(ExerciseError) as err:
        check_1f1b_order(cluster, _crash)
    assert str(err.value) == (  # only rank 2 raised; the student's line, quoted
        "p=4, m=6: rank 2: your 1F1B order raised ZeroDivisionError: integer "
        f"division or modulo by zero at line {_line(_crash, '1 //')} of "
        "test_checks_pipeline.py, in _crash: `return 1 // (rank - 2)`")
    with pytest.raises(ExerciseError, match=r"rank 0 \(stage 0 of 4, m=6\): your "
                       r"function returned None \(NoneType\)"):
        check_1f1b_order(cluster, lambda p, m, rank: None)
    with pytest.raises(ValueError, match=r"m = 5 micro-batches do not split the "
                       r"check's 12 rows"):
        check_1f1b_order(cluster, _one_f_one_b, m=5)


def test_1f1b_order_check_reports_a_deadlock_in_seconds(cluster, capsys):
    start = time.monotonic()
    with pytest.raises(ExerciseError) as err:
        check_1f1b_order(cluster, _recv_first)
    took = time.monotonic() - start  # SHORT_TIMEOUT (5 s), not the cluster's 20
    assert took < 15, f"the deadlock was told after {took:.1f} s, under 15 expected"
    lines = str(err.value).splitlines()
    assert lines[0] == ("p=4, m=6: deadlock: rank 1 waits in recv from rank 0, which "
                        "has already returned: the two disagree on how many messages "
                        "pass between them")
    line = _line(_recv_first, "dist.recv")
    for r in (1, 2, 3):  # where each rank waits, on the student's line
        assert (f"  rank {r}: recv from rank {r - 1} at line {line} of "
                "test_checks_pipeline.py, in _recv_first: `dist.recv(torch.zeros(1), "
                "src=rank - 1)`") in lines
    assert "  rank 0: finished" in lines
    assert check_1f1b_order(cluster, _one_f_one_b)  # the ranks came back
    assert "correct" in capsys.readouterr().out


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


def _as_bool(schedule, p, m, stage):  # True where the answer is 1: == 1, not a count
    right = _right(schedule, p, m, stage)
    return True if right == 1 else right


def _one_schedule(schedule, p, m, stage):
    return {"gpipe": m}[schedule]


def _forever(schedule, p, m, stage):
    while True:
        pass


def _gpipe_only(schedule, p, m, stage):
    if schedule == "gpipe":
        return m
    raise NotImplementedError("1F1B")


def test_in_flight_check(cluster, capsys):
    assert not check_in_flight(cluster, _todo)
    assert "not written yet" in capsys.readouterr().out
    assert check_in_flight(cluster, _right)
    assert "correct" in capsys.readouterr().out
    with pytest.raises(ExerciseError, match=r"1f1b, p=4, m=2, stage 3: you predicted "
                       r"2, the rank held 1 at its peak. Hint: stage s runs p-1-s"):
        check_in_flight(cluster, _first_stage_only)
    # any real number equal to the count passes: 4.0, a numpy integer
    assert check_in_flight(cluster, _as_float)
    assert check_in_flight(cluster, _as_numpy)
    assert "correct" in capsys.readouterr().out
    with pytest.raises(ExerciseError, match=r"1f1b, p=4, m=2, stage 3: you predicted "
                       r"2.0, the rank held 1 at its peak"):
        check_in_flight(cluster, lambda s, p, m, stage: float(m))
    with pytest.raises(ExerciseError, match=r"gpipe, p=4, m=2, stage 0: you predicted "
                       r"2.5, the rank held 2"):
        check_in_flight(cluster, lambda s, p, m, stage: m + 0.5)
    with pytest.raises(ExerciseError, match=r"1f1b, p=4, m=2, stage 3: expected a "
                       r"number of micro-batches \(such as 4 or 4.0\), got True "
                       r"\(bool\)"):
        check_in_flight(cluster, _as_bool)
    with pytest.raises(ExerciseError, match=r"gpipe, p=4, m=2, stage 0: expected a "
                       r"number .*got tensor\(2\) \(Tensor\)"):
        check_in_flight(cluster, _as_tensor)
    with pytest.raises(ExerciseError) as err:
        check_in_flight(cluster, _one_schedule)
    assert str(err.value) == (  # the case that raised, every rank, the student's line
        "1f1b, p=4, m=2: ranks 0, 1, 2 and 3: your prediction raised KeyError: "
        f"'1f1b' at line {_line(_one_schedule, 'return')} of test_checks_pipeline.py, "
        "in _one_schedule: `return {\"gpipe\": m}[schedule]`")
    assert not check_in_flight(cluster, _gpipe_only)  # half a stub: not written yet
    assert "not written yet" in capsys.readouterr().out


def test_in_flight_check_reports_an_endless_loop(cluster):
    with pytest.raises(ExerciseError) as err:
        check_in_flight(cluster, _forever)
    lines = str(err.value).splitlines()
    assert lines[0].startswith("gpipe, p=4, m=2: ranks 0, 1, 2 and 3 still running "
                               "after 5 s without waiting on another rank")
    line = _line(_forever, "while True")
    for r in range(4):
        assert (f"  rank {r}: running, not waiting on another rank at line {line} "
                "of test_checks_pipeline.py, in _forever: `while True:`") in lines
