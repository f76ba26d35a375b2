"""labkit.checks.mfu: each check passes a right answer on the cases it draws,
says "not written yet" for a stub, names the usual slips, and fails every
shortcut: labkit's MFU accountant or the check's reference, answers written
down, NaN and inf. Its references are held to labkit.theory.utilisation."""

import math

import pytest

from labkit.checks import mfu as checks
from labkit.checks.common import ExerciseError
from labkit.checks.mfu import MISCOUNT_NAMES, check_miscount, check_mfu
from labkit.theory import utilisation as theory


def _stub(*args):
    raise NotImplementedError("exercise")


# ------------------------------------------------------------------ my_mfu


def _mfu(rate, peak, n, layers, heads, head_dim, seq):
    return rate * (6 * n + 12 * layers * heads * head_dim * seq) / peak


def test_mfu_right_answer_passes(capsys):
    for _ in range(3):
        assert check_mfu(_mfu)
    assert "correct: PaLM 540B's MFU is 46.2 % (published: 46.2 %)" in (
        capsys.readouterr().out)


def test_mfu_stub_is_not_written_yet(capsys):
    assert not check_mfu(_stub)
    assert "not written yet" in capsys.readouterr().out
    assert not check_mfu(lambda *a: None)  # a stub returning None
    assert "not written yet: my_mfu returns None" in capsys.readouterr().out


def test_mfu_reference_is_theorys_on_every_draw():
    # theory.mfu's palm convention is held to PaLM app. B in test_theory_mfu.py
    for seed in range(30):
        for rate, peak, n, layers, heads, head_dim, seq in checks._mfu_cases(seed):
            want = theory.mfu(rate, peak, params=n, layers=layers, heads=heads,
                              head_dim=head_dim, seq_len=seq).value
            got = _mfu(rate, peak, n, layers, heads, head_dim, seq)
            assert got == pytest.approx(want, rel=1e-12), (seed, got, want)
            assert 0.2 < got < 0.65 or (rate, peak) == checks.PALM_540B[:2], got


def test_mfu_cases_are_drawn_fresh():
    drawn = [checks._mfu_cases(s) for s in range(30)]
    assert len({str(d[1:]) for d in drawn}) == 30
    assert all(d[0] == checks.PALM_540B and len(d) == 6 for d in drawn)


def _times(k):
    return lambda *a: k * _mfu(*a)


@pytest.mark.parametrize("answer, hint", [
    (lambda r, p, n, L, H, Q, T: r * 6 * n / p, "that leaves attention out"),
    (lambda r, p, n, L, H, Q, T: r * (6 * n + 6 * L * H * Q * T) / p,
     "that halves attention"),
    (lambda r, p, n, L, H, Q, T: r * (2 * n + 4 * L * H * Q * T) / p,
     "that is the forward pass alone"),
    (lambda r, p, n, L, H, Q, T: r * (2 * n + 12 * L * H * Q * T) / p, "not 2"),
    (lambda r, p, n, L, H, Q, T: r * (4 * n + 12 * L * H * Q * T) / p, "not 4"),
    (lambda r, p, n, L, H, Q, T: r * (8 * n + 16 * L * H * Q * T) / p,
     "hardware FLOPs (HFU)"),
    (lambda r, p, n, L, H, Q, T: r * (6 * n + 12 * L * H * Q) / p,
     "T the sequence length"),
    (_times(100), "not a percentage"),
    (lambda r, p, n, L, H, Q, T: T * _mfu(r, p, n, L, H, Q, T),
     "already per token"),
    (lambda *a: 1 / _mfu(*a), "not the inverse"),
    (lambda *a: float("nan"), "not a number an answer can be"),
    (lambda *a: math.inf, "not a number an answer can be"),
    (lambda *a: "46 %", "return a number"),
    (lambda *a: True, "return a number"),
    # PaLM's published answer written down: the draws fail it
    (lambda *a: 0.462, "Hint:"),
])
def test_mfu_slips_and_written_down_answers_are_named(answer, hint):
    with pytest.raises(ExerciseError, match="my_mfu") as e:
        check_mfu(answer)
    assert hint in str(e.value), str(e.value)


def test_mfu_labkits_accountant_is_refused():
    def own(r, p, n, L, H, Q, T):
        return theory.mfu(r, p, params=n, layers=L, heads=H, head_dim=Q,
                          seq_len=T).value

    def count(r, p, n, L, H, Q, T):
        return r * theory.flops_per_token(params=n, layers=L, heads=H,
                                          head_dim=Q, seq_len=T) / p

    def reference(r, p, n, L, H, Q, T):
        return r * sum(checks._palm_flops(n, L, H, Q, T)) / p

    for answer, name in ((own, "utilisation.mfu"), (count, "flops_per_token"),
                         (reference, "checks.mfu._palm_flops")):
        with pytest.raises(ExerciseError, match=rf"calls labkit.*{name}, labkit's "
                                                r"own MFU accountant"):
            check_mfu(answer)


def test_mfu_exception_is_reported_not_raised():
    with pytest.raises(ExerciseError, match="raised ZeroDivisionError"):
        check_mfu(lambda *a: 1 / 0)


# ----------------------------------------------------------- find_miscount


def _find(report):
    """A right answer, written as a student would."""
    r = report
    flops = 6 * r["params"] + 12 * r["layers"] * r["heads"] * r["head_dim"] * (
        r["seq_len"])
    mfu = r["tokens_per_second"] * flops / r["peak_flops"]
    ratio = r["flops_per_token"] / flops
    if math.isclose(ratio, r["seq_len"], rel_tol=1e-9):
        return "per_sequence", mfu
    if not math.isclose(ratio, 1, rel_tol=1e-9):
        return "attention_twice", mfu
    if math.isclose(r["reported_mfu"], 100 * mfu, rel_tol=1e-9):
        return "percent", mfu
    if 0.2 <= mfu / r["gpus"] <= 0.7:
        return "job_tokens", mfu / r["gpus"]
    return "low_peak", mfu / 2


def test_miscount_right_answer_passes(capsys):
    for _ in range(3):
        assert check_miscount(_find)
    assert "correct: you named the miscount" in capsys.readouterr().out


def test_miscount_stub_is_not_written_yet(capsys):
    assert not check_miscount(_stub)
    assert "not written yet" in capsys.readouterr().out
    assert not check_miscount(lambda r: None)
    assert "not written yet: find_miscount returns None" in capsys.readouterr().out


def test_miscount_reports_are_over_100_and_drawn_fresh():
    drawn = [checks._miscount_cases(s) for s in range(40)]
    assert len({str(d) for d in drawn}) == 40
    for cases in drawn:
        assert {name for _, name, _ in cases} == set(MISCOUNT_NAMES)
        for report, name, true in cases:
            assert report["reported_mfu"] > 1, (name, report)
            assert 0.3 <= true <= 0.65, (name, true)
            # labkit's diagnosis finds the seeded one, at the run's true MFU
            found = {m.name: m.corrected for m in theory.likely_miscounts(
                report["reported_mfu"], params=report["params"],
                layers=report["layers"], heads=report["heads"],
                head_dim=report["head_dim"], seq_len=report["seq_len"],
                gpus=report["gpus"])}
            assert found[name] == pytest.approx(true, rel=1e-9), (name, found)


def _written_down(report):
    return "per_sequence", 0.45


@pytest.mark.parametrize("answer, words", [
    (_written_down, "Hint:"),
    (lambda r: (_find(r)[0], float("nan")), "not a number an answer can be"),
    (lambda r: (_find(r)[0], math.inf), "not a number an answer can be"),
    (lambda r: ("flops", 0.4), "the name is one of"),
    (lambda r: _find(r)[1], "return (name, corrected MFU)"),
    (lambda r: (_find(r)[0], 100 * _find(r)[1]), "not a percentage"),
    (lambda r: (_find(r)[0], r["reported_mfu"]), "that is the reported MFU"),
    (lambda r: ("job_tokens" if _find(r)[0] == "low_peak" else "low_peak",
                _find(r)[1]), "Hint:"),
])
def test_miscount_shortcuts_and_slips_fail_by_name(answer, words):
    with pytest.raises(ExerciseError, match="find_miscount") as e:
        check_miscount(answer)
    assert words in str(e.value), str(e.value)


def test_miscount_job_tokens_against_low_peak_is_explained():
    # the two whose inputs are off: only the typical band tells them apart
    def swapped(r):
        name, value = _find(r)
        other = {"job_tokens": "low_peak", "low_peak": "job_tokens"}
        return other.get(name, name), value

    with pytest.raises(ExerciseError, match="only one lands in a typical MFU"):
        check_miscount(swapped)


def test_miscount_labkits_diagnosis_is_refused():
    def own(r):
        best = theory.likely_miscounts(
            r["reported_mfu"], params=r["params"], layers=r["layers"],
            heads=r["heads"], head_dim=r["head_dim"], seq_len=r["seq_len"],
            gpus=r["gpus"])[0]
        return best.name, best.corrected

    for answer, name in ((own, "likely_miscounts"),
                         (checks._diagnose, "checks.mfu._diagnose")):
        with pytest.raises(ExerciseError, match=rf"calls labkit.*{name}"):
            check_miscount(answer)
