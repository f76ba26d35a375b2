"""labkit.checks.memory (chapter 04): the SGD-bytes check (real ranks) and the
smallest-N check pass right answers, say "not written yet" for stubs, and fail
each shortcut with its own message: labkit's own table or reference, answers
written down for the old fixed cases, NaN; the usual mistakes are named."""

import math

import pytest
import torch

from labkit import theory
from labkit.checks import memory
from labkit.checks.common import ExerciseError
from labkit.checks.memory import (
    _held,
    _smallest_cases,
    _smallest_n,
    check_optimizer_bytes,
    check_smallest_n,
)


@pytest.fixture(scope="module")
def cluster():
    import labkit

    with labkit.Cluster(2, timeout=20) as c:
        yield c


def _sgd(params, momentum):
    return torch.optim.SGD(params, lr=0.1, momentum=momentum)


def _right(momentum, dtype):
    size = torch.tensor([], dtype=dtype).element_size()
    return {"Parameter": size, "Gradient": size, "Optstate": size if momentum else 0}


def _todo(*args):
    raise NotImplementedError("exercise: SGD")


def test_the_reference_is_private():
    assert not hasattr(memory, "smallest_n_reference"), (
        "chapter 04's answer is importable under a public name")


def test_optimizer_bytes_check(cluster, capsys):
    assert not check_optimizer_bytes(cluster, _sgd, _todo)
    assert "not written yet" in capsys.readouterr().out
    assert not check_optimizer_bytes(cluster, _todo, _right)
    assert "not written yet" in capsys.readouterr().out
    assert check_optimizer_bytes(cluster, _sgd, _right)
    out = capsys.readouterr().out
    assert "correct on 4 cases, the last three drawn this run" in out
    assert "SGD(momentum=0), float32: 4 + 4 + 0 = 8" in out


def _check_fails(cluster, make, predicted, match):
    with pytest.raises(ExerciseError, match=match):
        check_optimizer_bytes(cluster, make, predicted)


def test_optimizer_bytes_names_the_usual_mistakes(cluster):
    def with_state(momentum, dtype):  # "every optimizer keeps a buffer"
        size = torch.tensor([], dtype=dtype).element_size()
        return {"Parameter": size, "Gradient": size, "Optstate": size}

    _check_fails(cluster, _sgd, with_state,
                 r"SGD\(momentum=0\) on float32 parameters, Optstate: you predicted "
                 r"4 bytes per parameter; rank 0 measured 0\.00\. Hint: plain SGD "
                 r"\(momentum 0\) keeps nothing")

    def never_state(momentum, dtype):
        return dict(_right(momentum, dtype), Optstate=0)

    _check_fails(cluster, _sgd, never_state,
                 r"SGD\(momentum=0\.\d+\) on \w+ parameters, Optstate: you predicted "
                 r"0 .*Hint: with momentum 0\.\d+ SGD keeps one buffer")

    def adam_like(momentum, dtype):
        size = torch.tensor([], dtype=dtype).element_size()
        return dict(_right(momentum, dtype), Optstate=2 * size if momentum else 0)

    _check_fails(cluster, _sgd, adam_like, r"Hint: that is Adam's two moments")

    def always_fp32(momentum, dtype):
        return {"Parameter": 4, "Gradient": 4, "Optstate": 4 if momentum else 0}

    _check_fails(cluster, _sgd, always_fp32,
                 r"SGD\(momentum=[\d.]+\) on (bfloat16|float64) parameters, "
                 r"Parameter: you predicted 4 .*Hint: the parameters are "
                 r"(bfloat16|float64), \d bytes a number")

    def written_down(momentum, dtype):  # the chapter's old answer, for every case
        return {"Parameter": 4, "Gradient": 4, "Optstate": 0}

    _check_fails(cluster, _sgd, written_down, r"SGD\(momentum=")


def test_optimizer_bytes_refuses_shortcuts(cluster):
    def labkits(momentum, dtype):
        b = theory.bytes_per_param("sgd-momentum" if momentum else "sgd", "fp32")
        return {"Parameter": b.parameter, "Gradient": b.gradient,
                "Optstate": b.optstate}

    _check_fails(cluster, _sgd, labkits,
                 r"predicted\(0, torch\.float32\): your answer calls labkit\.theory\."
                 r"zero\.bytes_per_param, labkit's own table")
    _check_fails(cluster, _sgd, lambda m, d: dict(_right(m, d), Optstate=math.nan),
                 r"predicted\(0, torch\.float32\)\['Optstate'\] should be a number "
                 r"of bytes per parameter, got nan")
    _check_fails(cluster, _sgd, lambda m, d: [4, 4, 0],
                 r"predicted\(0, torch\.float32\) returned \[4, 4, 0\]; return a dict")
    _check_fails(cluster, lambda params, m: torch.optim.Adam(params), _right,
                 r"rank 0: make_optimizer returned Adam")
    _check_fails(cluster, lambda params, m: torch.optim.SGD(params, lr=0.1), _right,
                 r"make_optimizer\(params, 0\.\d+\) returned SGD with momentum 0; "
                 r"pass the momentum on")
    _check_fails(cluster, lambda params, m: None, _right,
                 r"returned NoneType, not a torch\.optim")


# ------------------------------------------------------------------ smallest N


def test_smallest_n_reference_matches_zero_memory():
    cases = _smallest_cases(1) + _smallest_cases(2)
    for name, psi, cap in cases:
        for stage in range(4):
            n = _smallest_n(psi, stage, cap)
            case = f"{name} (Ψ = {psi:.3g}, {cap:.3g} B), stage {stage}"
            if n is None:
                held = theory.zero_memory(psi, 10**9, stage)
                assert held > cap, f"{case}: no N, but 10^9 ranks hold {held:.3g} B"
                continue
            held = theory.zero_memory(psi, n, stage)
            assert held <= cap, f"{case}: N = {n} holds {held:.3g} B, over {cap:.3g}"
            assert held == float(_held(psi, n, stage)), f"{case}: {held} B"
            fewer = n == 1 or theory.zero_memory(psi, n - 1, stage)
            assert fewer is True or fewer > cap, (
                f"{case}: N - 1 = {n - 1} holds {fewer:.3g} B, within {cap:.3g}")
    n = _smallest_n(70e9, 3, 80e9)  # 16 * 70e9 / 14 = 80e9 exactly
    assert n == 14, f"70B under ZeRO-3: N = {n}, 14 expected"
    n = _smallest_n(theory.param_count("llama3-70b"), 3, 80e9)
    assert n == 15, f"Llama 3 70B under ZeRO-3: N = {n}, 15 expected"


def test_smallest_cases_are_drawn_afresh_and_varied():
    a, b = _smallest_cases(1), _smallest_cases(2)
    assert a[:2] == b[:2] and a[2:] != b[2:], "the chapter's cases, then fresh ones"
    for seed in range(10):
        found = {s: [_smallest_n(psi, s, cap) for _, psi, cap in _smallest_cases(seed)]
                 for s in range(4)}
        for s in range(4):  # every stage has a case that fits and, but 3, one that not
            assert any(v is not None for v in found[s]), (seed, s, found)
            assert s == 3 or None in found[s], (seed, s, found)
        assert any(v and v > 1 for v in found[1]), (seed, found)


def _right_n(psi, stage, capacity):
    for n in range(1, 10_000):
        if theory.zero_memory(psi, n, stage) <= capacity:
            return n
    return None


def _solution(psi, stage, capacity):  # the chapter's solution cell
    if theory.zero_memory(psi, 10**12, stage) > capacity:
        return None
    n = 1
    while theory.zero_memory(psi, n, stage) > capacity:
        n += 1
    return n


def _powers_of_two(psi, stage, capacity):
    n = 1
    while n < 10_000:
        if theory.zero_memory(psi, n, stage) <= capacity:
            return n
        n *= 2
    return None


def _no_none(psi, stage, capacity):
    return _right_n(psi, stage, capacity) or 10_000


def _one_short(psi, stage, capacity):
    n = _right_n(psi, stage, capacity)
    return n - 1 if n and n > 1 else n


def _strict(psi, stage, capacity):
    for n in range(1, 10_000):
        if theory.zero_memory(psi, n, stage) < capacity:
            return n
    return None


def _written_down(psi, stage, capacity):  # the old fixed cases' answers
    if stage < 3:
        return None
    return {70e9: 14, float(theory.param_count("llama3-70b")): 15, 7.5e9: 2,
            float(theory.param_count("gpt2-small")): 1}.get(float(psi), 1)


def test_smallest_n_check(capsys):
    def todo(psi, stage, capacity):
        raise NotImplementedError("exercise: smallest N")

    assert not check_smallest_n(todo)
    assert "not written yet" in capsys.readouterr().out
    for right in (_right_n, _solution):
        assert check_smallest_n(right)
    out = capsys.readouterr().out
    assert "correct on 28 cases, 20 of them drawn this run" in out
    assert "from N = 14 under ZeRO-3, Llama 3 70B from N = 15" in out
    with pytest.raises(ExerciseError, match=r"_powers_of_two\(7e\+10, stage=3, "
                       r"capacity=8e\+10\) for Ψ = 70e9 returned 16, expected 14: N = "
                       r"14 already fits \(80\.00 GB per device; N = 13 keeps 86\.15 "
                       r"GB\) \(N need not be a power of two\)"):
        check_smallest_n(_powers_of_two)
    with pytest.raises(ExerciseError, match=r"stage=2, capacity=8e\+10\) for Ψ = 70e9 "
                       r"returned 10000, but no N fits: stage 2 keeps the 2Ψ of "
                       r"parameters"):
        check_smallest_n(_no_none)
    with pytest.raises(ExerciseError, match=r"returned 13, expected 14: at N = 13 each "
                       r"device keeps 86\.15 GB, more than 80 GB"):
        check_smallest_n(_one_short)
    with pytest.raises(ExerciseError, match=r"returned 15, expected 14: at N = 14 each "
                       r"device keeps exactly 80 GB, which fits: 'at most capacity' "
                       r"includes equal"):
        check_smallest_n(_strict)
    with pytest.raises(ExerciseError, match=r"returned 14\.5: return a whole number"):
        check_smallest_n(lambda psi, stage, capacity: 14.5)
    with pytest.raises(ExerciseError, match=r"returned nan: return a whole number"):
        check_smallest_n(lambda psi, stage, capacity: math.nan)

    def divides(psi, stage, capacity):
        return capacity // (stage - 3)

    with pytest.raises(ExerciseError, match=r"stage=3, capacity=8e\+10\) for Ψ = 70e9: "
                       r"your function raised ZeroDivisionError: .* in divides: "
                       r"`return capacity // \(stage - 3\)`"):
        check_smallest_n(divides)


def test_smallest_n_refuses_shortcuts():
    with pytest.raises(ExerciseError, match=r"for a model drawn this run returned "):
        check_smallest_n(_written_down)

    def reference(psi, stage, capacity):
        from labkit.checks.memory import _smallest_n as ref

        return ref(psi, stage, capacity)

    with pytest.raises(ExerciseError, match=r"your answer calls labkit\.checks\.memory"
                       r"\._smallest_n, labkit's own smallest N"):
        check_smallest_n(reference)
