"""labkit.checks.three_d.check_ring_seconds: a right answer passes, a stub is
"not written yet", and each common slip is named (no ranks: a closed form)."""

import pytest

from labkit import theory
from labkit.checks.common import ExerciseError
from labkit.checks.three_d import check_ring_seconds


def right(op, size, n, nodes, cl):
    inter = theory.latency_steps(op, nodes) if nodes > 1 else 0
    bw = cl.intra_bw if nodes == 1 else cl.inter_bw
    return ((theory.latency_steps(op, n) - inter) * cl.alpha_intra
            + inter * cl.alpha_inter + theory.ring_bytes_per_rank(op, size, n) / bw)


def test_right_answer_passes(capsys):
    assert check_ring_seconds(right)
    assert "correct" in capsys.readouterr().out


def test_stub_is_not_written_yet(capsys):
    def stub(*args):
        raise NotImplementedError("exercise: the α-β seconds of a ring")

    assert not check_ring_seconds(stub)
    assert "not written yet" in capsys.readouterr().out


def _bytes_only(op, size, n, nodes, cl):
    return theory.ring_bytes_per_rank(op, size, n) / (
        cl.intra_bw if nodes == 1 else cl.inter_bw)


def _all_network_alpha(op, size, n, nodes, cl):  # every step at alpha_inter
    bw = cl.intra_bw if nodes == 1 else cl.inter_bw
    return (theory.latency_steps(op, n) * cl.alpha_inter
            + theory.ring_bytes_per_rank(op, size, n) / bw)


def _nvlink_everywhere(op, size, n, nodes, cl):  # bytes at intra_bw across nodes
    inter = theory.latency_steps(op, nodes) if nodes > 1 else 0
    return ((theory.latency_steps(op, n) - inter) * cl.alpha_intra
            + inter * cl.alpha_inter
            + theory.ring_bytes_per_rank(op, size, n) / cl.intra_bw)


@pytest.mark.parametrize("answer, where, hint", [
    (_bytes_only, "n=8, nodes=1", "the bytes alone: every ring step also pays α"),
    (_all_network_alpha, "n=8, nodes=1", "every step paid the network's α"),
    (_nvlink_everywhere, "n=16, nodes=2", "at the network's inter_bw"),
    (lambda *a: 2 * right(*a), "n=8, nodes=1", "theory.latency_steps(op, n)"),
    (lambda *a: "fast", "n=8, nodes=1", "return seconds, a number"),
])
def test_each_slip_is_named(answer, where, hint):
    with pytest.raises(ExerciseError, match="my_ring_seconds") as e:
        check_ring_seconds(answer)
    assert where in str(e.value) and hint in str(e.value)


def test_an_exception_is_reported_not_raised():
    with pytest.raises(ExerciseError, match="raised ZeroDivisionError"):
        check_ring_seconds(lambda *a: 1 / 0)
