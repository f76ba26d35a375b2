"""labkit.checks.pipeline: the 1F1B-order and activations-in-flight checks pass
right answers, say "not written yet" for stubs, and name the rank, step or case
of wrong ones, whatever the mistake (a wrong step, a wrong type, an exception)."""

import pytest

from labkit.checks.common import ExerciseError
from labkit.checks.pipeline import check_1f1b_order, check_in_flight


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


def _todo(*args):
    raise NotImplementedError


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
    with pytest.raises(ExerciseError, match=r"rank 0 .*step 0 is 'F0'; each step is "
                       r"a pair"):
        check_1f1b_order(cluster, _strings)
    with pytest.raises(ExerciseError, match=r"rank 0 .*it stops after 11 of 12 "
                       r"steps; next: \('B', 5\)"):
        check_1f1b_order(cluster, _short)
    with pytest.raises(ExerciseError, match=r"rank 2 \(stage 2 of 4, m=6\): your "
                       r"function raised ZeroDivisionError"):
        check_1f1b_order(cluster, _crash)
    with pytest.raises(ExerciseError, match=r"returned None \(NoneType\)"):
        check_1f1b_order(cluster, lambda p, m, rank: None)


def _right(schedule, p, m, stage):
    return m if schedule == "gpipe" else min(p - stage, m)


def _first_stage_only(schedule, p, m, stage):
    return m if schedule == "gpipe" else min(p, m)


def test_in_flight_check(cluster, capsys):
    assert not check_in_flight(cluster, _todo)
    assert "not written yet" in capsys.readouterr().out
    assert check_in_flight(cluster, _right)
    assert "correct" in capsys.readouterr().out
    with pytest.raises(ExerciseError, match=r"1f1b, p=4, m=2, stage 3: you predicted "
                       r"2, the rank held 1 at its peak. Hint: stage s runs p-1-s"):
        check_in_flight(cluster, _first_stage_only)
    with pytest.raises(ExerciseError, match=r"gpipe, p=4, m=2, stage 0: expected a "
                       r"whole number of micro-batches, got 2.0"):
        check_in_flight(cluster, lambda s, p, m, stage: float(m))
    with pytest.raises(ExerciseError, match=r"gpipe, p=4, m=2, stage 0: your "
                       r"function raised KeyError"):
        check_in_flight(cluster, lambda s, p, m, stage: {}[s])
