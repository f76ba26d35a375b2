"""labkit.checks.failures (chapter 13's exercises 1 and 2): each check passes a
right answer on the cases it draws, says "not written yet" for a stub, names the
usual slips, and fails every shortcut: labkit's own function (theory's closed
forms, diloco_traffic) or the check's reference, answers written down, grading
switched off (all four checks), NaN. Its references are held to labkit.theory and
the traffic ledger. Exercises 3 and 4: test_checks_failures_hangs.py and
test_checks_failures_resume.py."""

import math

import pytest

from labkit import theory
from labkit.checks import failures, grading
from labkit.checks.common import ExerciseError, NotAnswered
from labkit.checks.failures import (
    check_diloco_bytes,
    check_hung,
    check_interval,
    check_resume,
)


def _stub(*args):
    raise NotImplementedError("exercise")


# ------------------------------------------------------------- my_interval


def _interval(c, gpus, gpu_mtbf_h):
    return math.sqrt(2 * c * gpu_mtbf_h * 3600 / gpus)


def test_interval_right_answer_passes(capsys):
    for _ in range(3):
        assert check_interval(_interval)
    assert ("correct: Young's interval for Llama 3's cluster (a one-minute save: "
            "every 19.3 min) and for 6 clusters drawn this run"
            ) in capsys.readouterr().out


def test_interval_stub_is_not_written_yet(capsys):
    assert not check_interval(_stub)
    assert "not written yet" in capsys.readouterr().out


def test_interval_reference_is_theorys_on_every_draw():
    # theory's young_interval and job_mtbf are held to Young (1974) and to
    # Llama 3's published counts in tests/test_theory_failures.py
    for seed in range(30):
        for c, n, m in failures._interval_cases(seed):
            want = theory.young_interval(c, theory.job_mtbf(m * theory.HOUR, n))
            assert failures._young(c, n, m) == pytest.approx(want, rel=1e-12), (
                seed, c, n, m)


def test_interval_llama3_case_is_the_published_count():
    # Llama 3 (arXiv 2407.21783) sec. 3.3.4: 419 unexpected stops in 54 days
    c, n, m = failures._LLAMA3
    job = m * theory.HOUR / n
    assert job == pytest.approx(54 * theory.DAY / 419, rel=1e-12), job
    assert job == pytest.approx(theory.LLAMA3_FAILURES.job_mtbf, rel=1e-12)
    assert (c, n) == (60.0, 16_384)


def test_interval_cases_are_drawn_fresh():
    drawn = [failures._interval_cases(s) for s in range(30)]
    assert len({str(d[1:]) for d in drawn}) == 30
    assert all(d[0] == failures._LLAMA3 and len(d) == 7 for d in drawn)


def _scaled(f):
    return lambda c, n, m: f(c, n, m, _interval(c, n, m))


def _daly(c, n, m):
    job = m * 3600 / n
    xi = c / (2 * job)
    return math.sqrt(2 * c * job) * (1 + math.sqrt(xi) / 3 + xi / 9) - c


@pytest.mark.parametrize("answer, hint", [
    (lambda c, n, m: math.sqrt(2 * c * m * 3600), "that uses one GPU's MTBF"),
    (lambda c, n, m: math.sqrt(2 * c * m * 3600 * n), "the GPUs multiply the "
                                                      "failures"),
    (lambda c, n, m: math.sqrt(2 * c * m / n), "convert the MTBF to seconds"),
    (lambda c, n, m: math.sqrt(2 * c * m * 60 / n), "an hour is 3600 s"),
    (lambda c, n, m: math.sqrt(c * m * 3600 / n), "the 2 is there because"),
    (_scaled(lambda c, n, m, t: t / 60), "that is in minutes"),
    (_scaled(lambda c, n, m, t: t / 3600), "that is in hours"),
    (lambda c, n, m: 2 * c * m * 3600 / n, "take the square root"),
    (_daly, "that is Daly's higher-order interval"),
    (lambda c, n, m: float("nan"), "not a number an answer can be"),
    (lambda c, n, m: "19 min", "return a number"),
    (lambda c, n, m: (1.0, 2.0), "return a number"),
    # the chapter's Llama 3 case, written down: the draws fail it
    (lambda c, n, m: _interval(60.0, 16_384, failures._LLAMA3[2]), "Hint:"),
])
def test_interval_slips_and_written_down_answers_are_named(answer, hint):
    with pytest.raises(ExerciseError, match="my_interval") as e:
        check_interval(answer)
    assert hint in str(e.value), str(e.value)


def test_interval_labkits_closed_forms_are_refused():
    def young(c, n, m):
        return theory.young_interval(c, m * 3600 / n)

    def job(c, n, m):
        return math.sqrt(2 * c * theory.job_mtbf(m * 3600, n))

    for answer, name in ((young, "young_interval"), (job, "job_mtbf"),
                         (failures._young, "failures._young")):
        with pytest.raises(ExerciseError, match=rf"calls labkit.*{name}, labkit's "
                                                r"own closed forms"):
            check_interval(answer)


def test_interval_exception_is_reported_not_raised():
    with pytest.raises(ExerciseError, match="raised ZeroDivisionError"):
        check_interval(lambda c, n, m: 1 / 0)


# ---------------------------------------------------------- my_diloco_bytes


def _diloco(params, n, h, f):
    full = 2 * (n - 1) / n * 4 * params
    return full / h, full / f


def test_diloco_right_answer_passes_and_says_what_was_measured(cluster, capsys):
    for _ in range(2):
        assert check_diloco_bytes(cluster, _diloco)
    out = capsys.readouterr().out
    assert ("correct: your bytes are what every rank's traffic ledger measured in "
            "the outer all-reduces of two DiLoCo runs on 4 ranks") in out, out


def test_diloco_stub_is_not_written_yet(cluster, capsys):
    assert not check_diloco_bytes(cluster, _stub)
    assert "not written yet" in capsys.readouterr().out


def test_diloco_reference_is_theorys():
    for seed in range(30):
        measured, computed = failures._diloco_cases(seed)
        settings = computed + [(failures._params(c), 4, c["h"], c["f"])
                               for c in measured]
        for params, n, h, f in settings:
            t = theory.diloco_traffic(4 * params, n, h, f)
            avg, peak = failures._diloco_exact(params, n, h, f)
            assert (float(avg), float(peak)) == pytest.approx(
                (t.average, t.peak), rel=1e-12), (params, n, h, f)


def test_diloco_cases_tell_the_slips_apart():
    for seed in range(30):
        measured, computed = failures._diloco_cases(seed)
        assert [c["f"] for c in measured][0] == 1 and measured[1]["f"] > 1
        assert measured[1]["h"] > measured[1]["f"]  # average below the peak
        for c in measured:  # equal fragments: a whole number of layers each
            assert c["layers"] % c["f"] == 0 and c["h"] % c["f"] == 0
        assert any(1 < f < h and n > 2 for _, n, h, f in computed), computed
    assert len({str(failures._diloco_cases(s)) for s in range(30)}) == 30


def _slip(avg=None, peak=None):
    def answer(params, n, h, f):
        a, p = _diloco(params, n, h, f)
        full = a * h
        env = {"a": a, "p": p, "full": full, "n": n, "h": h, "f": f}
        return (eval(avg, env) if avg else a), (eval(peak, env) if peak else p)
    return answer


@pytest.mark.parametrize("answer, hint", [
    (_slip(avg="full"), "the average is its bytes / H"),
    (_slip(avg="full / (h * f)"), "the fragments do not lower the average"),
    (_slip(peak="full"), "the peak is the all-reduce's bytes / F"),
    (_slip(peak="a"), "that is the average; the peak is the busiest step"),
    (_slip(avg="a * n / (2 * (n - 1))", peak="p * n / (2 * (n - 1))"),
     "a ring all-reduce sends 2(N-1)/N of the payload"),
    (_slip(avg="a / 2", peak="p / 2"), "(N-1)/N is a reduce-scatter's share"),
    (_slip(avg="a / 2", peak="p / 2"), "not 2"),  # bf16: the same number
    (_slip(avg="a / 4", peak="p / 4"), "that counts values, not bytes"),
    (lambda *a: (float("nan"), 1.0), "not a number an answer can be"),
    (lambda *a: 1.0, "return a pair (average, peak)"),
    (lambda *a: (1.0, "2 MB"), "return a number"),
])
def test_diloco_slips_are_named_against_the_ledger(cluster, answer, hint):
    with pytest.raises(ExerciseError, match="my_diloco_bytes") as e:
        check_diloco_bytes(cluster, answer)
    assert hint in str(e.value), str(e.value)
    if "a number" not in hint and "pair" not in hint:  # the ranks ran first
        assert "(its traffic ledger, DiLoCo.OUTER_PHASE)" in str(e.value)


def test_diloco_written_down_and_labkits_own_are_refused(cluster):
    fixed = {(1000, 4, 4, 2): _diloco(1000, 4, 4, 2)}
    with pytest.raises(ExerciseError, match=r"my_diloco_bytes.*Hint:"):
        check_diloco_bytes(cluster, lambda *a: fixed.get(a, (0.0, 0.0)))

    def priced(params, n, h, f):
        t = theory.diloco_traffic(4 * params, n, h, f)
        return t.average, t.peak

    def measured(params, n, h, f):
        from labkit.ledger import traffic

        with traffic():
            pass
        return _diloco(params, n, h, f)

    def ran(params, n, h, f):
        cluster.run(lambda r, w: None)
        return _diloco(params, n, h, f)

    for answer, name in ((priced, "diloco_traffic"), (measured, "traffic_ledger"),
                         (ran, "Cluster.run"), (lambda *a: tuple(map(
                             float, failures._diloco_exact(*a))), "_diloco_exact")):
        with pytest.raises(ExerciseError, match=rf"calls labkit.*{name}"):
            check_diloco_bytes(cluster, answer)


# ------------------------------------------------------------------ grading


@pytest.fixture
def grading_on(monkeypatch):
    monkeypatch.delenv("NBGRADER_EXECUTION", raising=False)
    grading.graded()
    yield
    grading._graded = False


def test_grading_switched_off_scores_nothing(cluster, grading_on, capsys):
    calls = [lambda: check_interval(_stub),
             lambda: check_diloco_bytes(cluster, _stub),
             lambda: check_hung(cluster, _stub),
             lambda: check_resume(cluster, _stub, _stub)]
    for call in calls:  # graded: a stub is no points
        with pytest.raises(NotAnswered):
            call()
    grading._graded = False  # what an answer cell could do
    assert not calls[0]()  # a stub then says "not written yet"...
    with pytest.raises(ExerciseError, match=r"grading \(switched off"):
        grading.intact()  # ...and the locked test cell scores nothing
    with pytest.raises(NotAnswered):
        calls[0]()  # and grading is back on
