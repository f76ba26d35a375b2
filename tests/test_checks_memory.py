"""labkit.checks.memory: the optimizer-bytes check (real ranks) and the smallest-N
check pass right answers, say "not written yet" for stubs, and name what is wrong."""

import pytest
import torch

from labkit import theory
from labkit.checks.common import ExerciseError
from labkit.checks.memory import (
    check_optimizer_bytes,
    check_smallest_n,
    smallest_n_reference,
)


@pytest.fixture(scope="module")
def cluster():
    import labkit

    with labkit.Cluster(2, timeout=20) as c:
        yield c


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def _momentum(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _adam(params):
    return torch.optim.Adam(params)


def _todo(params):
    raise NotImplementedError("exercise: SGD")


PLAIN = {"Parameter": 4, "Gradient": 4, "Optstate": 0}


def test_optimizer_bytes_check(cluster, capsys):
    assert not check_optimizer_bytes(cluster, _todo, PLAIN)
    assert "not written yet" in capsys.readouterr().out
    assert not check_optimizer_bytes(cluster, _sgd, dict(PLAIN, Optstate=None))
    assert "Optstate not filled in yet" in capsys.readouterr().out
    assert check_optimizer_bytes(cluster, _sgd, PLAIN)
    assert "4 + 4 + 0 = 8 bytes per parameter" in capsys.readouterr().out
    assert check_optimizer_bytes(cluster, _momentum, dict(PLAIN, Optstate=4))
    with pytest.raises(ExerciseError, match=r"rank 0, Optstate: you predicted 8 bytes "
                       r"per parameter; the rank measured 0\.00 with your "
                       r"SGD\(momentum=0\)"):
        check_optimizer_bytes(cluster, _sgd, dict(PLAIN, Optstate=8))
    with pytest.raises(ExerciseError, match=r"measured 4\.00 with your "
                       r"SGD\(momentum=0\.9\)"):
        check_optimizer_bytes(cluster, _momentum, PLAIN)
    with pytest.raises(ExerciseError, match=r"rank 0: make_optimizer returned Adam"):
        check_optimizer_bytes(cluster, _adam, PLAIN)
    with pytest.raises(ExerciseError, match=r"returned NoneType, not a torch\.optim"):
        check_optimizer_bytes(cluster, lambda params: None, PLAIN)


def test_smallest_n_reference_matches_zero_memory():
    for psi in (70e9, float(theory.param_count("llama3-70b")), 7.5e9, 1e9):
        for stage in range(4):
            n = smallest_n_reference(psi, stage, 80e9)
            case = f"Ψ = {psi:.3g}, stage {stage}"
            if n is None:
                held = theory.zero_memory(psi, 10**9, stage)
                assert held > 80e9, f"{case}: no N, but 10^9 ranks hold {held:.3g} B"
                continue
            held = theory.zero_memory(psi, n, stage)
            assert held <= 80e9, f"{case}: N = {n} holds {held:.3g} B, over 80 GB"
            fewer = n == 1 or theory.zero_memory(psi, n - 1, stage)
            assert fewer is True or fewer > 80e9, (
                f"{case}: N - 1 = {n - 1} holds {fewer:.3g} B, within 80 GB already")
    n = smallest_n_reference(70e9, 3, 80e9)  # 16 * 70e9 / 14 = 80e9 exactly
    assert n == 14, f"70B under ZeRO-3: N = {n}, 14 expected"
    n = smallest_n_reference(theory.param_count("llama3-70b"), 3, 80e9)
    assert n == 15, f"Llama 3 70B under ZeRO-3: N = {n}, 15 expected"


def _right(psi, stage, capacity):
    for n in range(1, 10_000):
        if theory.zero_memory(psi, n, stage) <= capacity:
            return n
    return None


def _powers_of_two(psi, stage, capacity):
    n = 1
    while n < 10_000:
        if theory.zero_memory(psi, n, stage) <= capacity:
            return n
        n *= 2
    return None


def _no_none(psi, stage, capacity):
    return _right(psi, stage, capacity) or 10_000


def _one_short(psi, stage, capacity):
    n = _right(psi, stage, capacity)
    return n - 1 if n and n > 1 else n


def test_smallest_n_check(capsys):
    def todo(psi, stage, capacity):
        raise NotImplementedError("exercise: smallest N")

    assert not check_smallest_n(todo)
    assert "not written yet" in capsys.readouterr().out
    assert check_smallest_n(_right)
    assert "from N = 14 under ZeRO-3, Llama 3 70B from N = 15" in (
        capsys.readouterr().out)
    with pytest.raises(ExerciseError, match=r"_powers_of_two\(7e\+10, stage=3\) for "
                       r"Ψ = 70e9 returned 16, expected 14: N = 14 already fits "
                       r"\(80\.00 GB per device; N = 13 keeps 86\.15 GB\) \(N need "
                       r"not be a power of two\)"):
        check_smallest_n(_powers_of_two)
    with pytest.raises(ExerciseError, match=r"stage=2\) for Ψ = 70e9 returned 10000, "
                       r"but no N fits: stage 2 keeps the 2Ψ of parameters"):
        check_smallest_n(_no_none)
    with pytest.raises(ExerciseError, match=r"returned 13, expected 14: at N = 13 each "
                       r"device keeps 86\.15 GB, more than 80 GB"):
        check_smallest_n(_one_short)
    with pytest.raises(ExerciseError, match=r"returned 14\.5: return a whole number"):
        check_smallest_n(lambda psi, stage, capacity: 14.5)
    def divides(psi, stage, capacity):
        return capacity // (stage - 3)

    with pytest.raises(ExerciseError, match=r"stage=3\) for Ψ = 70e9: your function "
                       r"raised ZeroDivisionError: .* in divides: `return capacity "
                       r"// \(stage - 3\)`"):
        check_smallest_n(divides)
