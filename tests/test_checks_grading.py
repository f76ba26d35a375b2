"""labkit.checks.grading: grading, once on, stays on; intact(), the first
line of every locked test cell of the nbgrader build, fails (and puts things
back) when an answer cell replaced a check, a reference, a closed form, a
function's code or defaults, a constant, or switched grading off; and NaN or
inf is never a right answer."""

import sys

import pytest

import labkit.checks
from labkit import theory
from labkit.checks import ExerciseError, NotAnswered, check_answer, graded, intact
from labkit.checks import grading

CHECKS = sorted(n for n in labkit.checks.__all__ if n.startswith("check_"))


@pytest.fixture
def grading_on(monkeypatch):
    """graded() as an assignment's first cell calls it; off again afterwards
    (the tests share one interpreter: only a test may switch it off)."""
    monkeypatch.delenv("NBGRADER_EXECUTION", raising=False)
    graded()
    yield
    grading._graded = False


def test_graded_cannot_be_switched_off(grading_on):
    with pytest.raises(ExerciseError, match="grading is on in this notebook and "
                                            "stays on"):
        graded(False)
    with pytest.raises(NotAnswered, match="not answered yet"):
        check_answer("x", None, 2)


@pytest.mark.parametrize("mode", ["autograde", "validate"])
def test_nbgraders_own_runs_are_graded_whatever_a_cell_did(monkeypatch, mode):
    assert not grading._graded
    monkeypatch.setenv("NBGRADER_EXECUTION", mode)
    assert grading.is_graded()
    with pytest.raises(NotAnswered):
        check_answer("x", None, 2)


def test_intact_passes_when_nothing_changed(grading_on):
    intact()


def test_grading_switched_off_by_its_flag_fails_and_is_switched_on(grading_on):
    grading._graded = False  # what an answer cell could do
    with pytest.raises(ExerciseError, match=r"a cell changed what grading relies "
                                            r"on: grading \(switched off"):
        intact()
    assert grading.is_graded()


@pytest.mark.parametrize("name", CHECKS)
def test_every_check_replaced_in_an_answer_cell_fails_and_is_put_back(grading_on,
                                                                        name):
    real = getattr(labkit.checks, name)
    setattr(labkit.checks, name, lambda *a, **k: print("correct"))
    home = sys.modules[real.__module__]
    setattr(home, name, lambda *a, **k: print("correct"))
    with pytest.raises(ExerciseError, match=rf"labkit.checks.{name}, .*"
                                            rf"{real.__module__}.{name}.*this test "
                                            rf"gives no points"):
        intact()
    assert getattr(labkit.checks, name) is real and getattr(home, name) is real
    intact()  # all back: nothing left to report


def test_a_closed_form_code_swap_defaults_and_constants_are_put_back(grading_on):
    f = theory.zero_memory
    code, defaults = f.__code__, f.__defaults__
    f.__code__ = (lambda *a, **k: 0).__code__
    theory.ring_bytes_per_rank = lambda *a: 0
    ring = sys.modules["labkit.checks.ring"]
    own = ring._OWN
    ring._OWN = ()  # would let labkit's own ring through
    with pytest.raises(ExerciseError) as e:
        intact()
    msg = str(e.value)
    for changed in ("labkit.theory.zero_memory (its code or defaults)",
                    "labkit.theory.ring_bytes_per_rank", "labkit.checks.ring._OWN"):
        assert changed in msg, msg
    assert (f.__code__, f.__defaults__) == (code, defaults)
    assert ring._OWN is own
    assert theory.ring_bytes_per_rank(  # the real one again
        "all_reduce", 8.0, 4) == pytest.approx(12.0)


def test_a_module_replaced_in_sys_modules_is_put_back(grading_on):
    real = sys.modules["labkit.checks.ring"]
    fake = type(sys)("labkit.checks.ring")
    sys.modules["labkit.checks.ring"] = fake
    try:
        with pytest.raises(ExerciseError, match=r"sys.modules\['labkit.checks.ring'"
                                                r"\]"):
            intact()
    finally:
        assert sys.modules["labkit.checks.ring"] is real


def test_a_class_method_replaced_is_put_back(grading_on):
    from labkit.checks.zero import SliceSGD

    real = SliceSGD.__call__
    SliceSGD.__call__ = lambda self, p, g: None
    with pytest.raises(ExerciseError, match=r"labkit.checks.zero.SliceSGD.__call__|"
                                            r"SliceSGD.__call__"):
        intact()
    assert SliceSGD.__call__ is real


def test_a_constant_emptied_in_place_is_refilled(grading_on):
    from labkit.theory import zero

    table = zero._OPT_STATE
    kept = dict(table)
    table.clear()  # Adam's 8 bytes gone: the reference of chapter 04 changes
    with pytest.raises(ExerciseError, match=r"labkit.theory.zero._OPT_STATE \(its "
                                            r"contents\)"):
        intact()
    assert table == kept


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_and_inf_are_wrong_answers(bad):
    """`abs(x - want) > tol` is False for NaN: the old check_answer said 'nan is
    right', and under graded() that earned the points."""
    with pytest.raises(ExerciseError, match=r"x: .* is not a number an answer can "
                                            r"be \(NaN or infinite\)"):
        check_answer("x", bad, 3.0)


def test_the_clusters_run_replaced_is_put_back(grading_on):
    from labkit.runtime import Cluster

    real = Cluster.run
    Cluster.run = lambda self, fn, *a, **k: None  # every check would see nothing
    with pytest.raises(ExerciseError, match=r"labkit.runtime.cluster.Cluster.run"):
        intact()
    assert Cluster.run is real


class _FakeCluster:
    world_size = 4

    def run(self, fn, *args, **kwargs):
        return [None] * 4


def test_a_check_refuses_a_cluster_that_is_not_labkits():
    """An answer cell could rebind `cluster`, which the check cells pass in, to
    an object whose run() returns what passes."""
    from labkit.checks import check_ring_reduce_scatter

    with pytest.raises(ExerciseError, match=r"the check runs answers on the "
                                            r"chapter's labkit.Cluster, but "
                                            r"`cluster` is now"):
        check_ring_reduce_scatter(_FakeCluster(), lambda r, n, c: None)


def test_a_cluster_whose_run_was_replaced_on_it_is_refused(cluster):
    from labkit.checks import check_ring_reduce_scatter

    cluster.run = lambda fn, *a, **k: [None] * 4
    try:
        with pytest.raises(ExerciseError, match=r"`cluster` is now Cluster"):
            check_ring_reduce_scatter(cluster, lambda r, n, c: None)
    finally:
        del cluster.run


def test_a_number_past_floats_range_is_a_wrong_answer():
    """10**400 is an int Python holds, but no float: it is said, not an
    OverflowError from inside labkit."""
    with pytest.raises(ExerciseError, match=r"x: a number with 401 digits is past "
                                            r"any float"):
        check_answer("x", 10**400, 3.0)


def _answer_checks():
    """Every check whose one argument is the student's function (no ranks)."""
    import inspect

    out = []
    for name in CHECKS:
        f = getattr(labkit.checks, name)
        need = [p for p in inspect.signature(f).parameters.values()
                if p.default is p.empty and p.kind is not p.VAR_KEYWORD]
        if len(need) == 1:
            out.append(name)
    return out


_SHAPES = {"a number": lambda b: b, "a pair": lambda b: (b, b),
           "a list": lambda b: [b] * 3, "a method and bytes": lambda b: ("ring", b),
           "a dict": lambda b: dict.fromkeys(("server", "worker", "ring", "tp", "pp",
                                              "cp", "dp"), b)}


@pytest.mark.parametrize("name", _answer_checks())
def test_nan_inf_and_numbers_past_float_are_wrong_in_every_shape(name):
    """What a function answer returns, NaN, inf, -1e300 or 10**400 in any shape
    a check expects, is an ExerciseError that says so, never a crash inside
    labkit (an OverflowError, a ValueError) and never a pass."""
    check = getattr(labkit.checks, name)
    for bad in (float("nan"), float("inf"), -1e300, 10**400):
        for shape, make in _SHAPES.items():
            value = make(bad)
            try:
                check(lambda *a, **k: value)  # noqa: B023 (called right here)
            except ExerciseError:
                continue
            pytest.fail(f"{name} passed {shape} of {bad!r:.12}")
