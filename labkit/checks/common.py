"""What every exercise check shares: running a student's answer (on the ranks or
here), the error it raises, "not written yet", and comparing numbers and tensors.

Imports the other check modules and labkit.runtime; torch, labkit.ledger,
labkit.numerics and labkit.units only inside functions.

Whatever goes wrong comes back as one `ExerciseError` in plain words (which ranks,
the student's line, got and expected), never a traceback per rank; NaN and inf
are always wrong answers.
"""

from __future__ import annotations

import numbers
import traceback

from labkit.checks.explain import (
    at_line,
    deadlock_message,
    failure_message,
    hint_for,
    not_written,
    student_frame,
)
from labkit.checks.grading import is_graded
from labkit.checks.watch import watched
from labkit.runtime import Cluster, ClusterClosed, CollectiveTimeout, RankError

SHORT_TIMEOUT = 5.0  # seconds: a check's ranks do tiny work; longer is a deadlock


class ExerciseError(AssertionError):
    """The exercise's answer is wrong; the message says where and why."""

    def _render_traceback_(self):  # IPython shows the message, not the check's frames
        return [f"{type(self).__name__}: {self}"]


class Checked:
    """What a check returns: true when the answer passed, false while it is not
    written yet. It shows nothing in a notebook (the check has printed its
    verdict), so a check cell never ends in a stray True or False."""

    __slots__ = ("passed",)

    def __init__(self, passed: bool):
        self.passed = bool(passed)

    def __bool__(self) -> bool:
        return self.passed

    def __repr__(self) -> str:
        return f"Checked(passed={self.passed})"

    def _ipython_display_(self) -> None:
        pass


PASSED, NOT_YET = Checked(True), Checked(False)


class NotAnswered(ExerciseError):
    """Under graded(): the exercise is still its stub, or its answer still None."""


def not_yet(message: str) -> None:
    """Say that an exercise has no answer yet; under graded(), fail with it."""
    if is_graded():
        raise NotAnswered(f"{message} (graded: no answer yet is no points)")
    print(message)


def _not_yet(what: str) -> None:
    not_yet(f"not written yet: replace `raise NotImplementedError(...)` with your "
            f"{what}, then run this cell again")


# ------------------------------------------------------------ running answers


def run_answer(cluster, worker, *args, what: str = "answer",
               timeout: float = SHORT_TIMEOUT, prepare: bool = True):
    """Run `worker(rank, world_size, *args)`, which calls the student's answer, on
    the ranks; its RankResults once it works, None (after saying so) while the
    answer still raises NotImplementedError. An exception or a deadlock becomes
    an ExerciseError that says what happened on which rank, at which line.
    prepare=False skips the warm-up call (_prepare) for workers that use no
    ledger and import nothing of their own."""
    labkit_cluster(cluster)
    if prepare:
        modules = {getattr(f, "__module__", None) for f in (worker, *args)
                   if callable(f)}
        try:
            cluster.run(_prepare, sorted(modules - {None, "__main__"}))
        except ClusterClosed as err:  # e.g. a chapter's last cell closed it
            raise ExerciseError(f"the check needs running ranks, but {err}") from None
    try:
        return cluster.run(watched, worker, *args, timeout=timeout)
    except ClusterClosed as err:
        raise ExerciseError(f"the check needs running ranks, but {err}") from None
    except CollectiveTimeout as err:
        raise ExerciseError(deadlock_message(err, cluster.world_size,
                                             timeout)) from None
    except RankError as err:
        if not_written(err):
            _not_yet(what)
            return None
        raise ExerciseError(failure_message(err, what)) from None


def labkit_cluster(cluster):
    """`cluster`, once sure it is labkit's own Cluster (its run() unreplaced):
    an answer cell could rebind the name the check cells pass in to an object
    whose run() returns whatever passes."""
    if type(cluster) is not Cluster or "run" in vars(cluster):
        raise ExerciseError(
            f"the check runs answers on the chapter's labkit.Cluster, but "
            f"`cluster` is now {type(cluster).__name__} {_short(cluster)}: run the "
            "cell that starts it (`cluster = labkit.Cluster(...)`) and never "
            "rebind the name")
    return cluster


def _prepare(rank, world_size, modules: list[str]) -> None:
    """Import what a check's worker uses, so that the short timeout measures only
    the student's code: the modules of functions passed by reference, and what a
    rank's first collective under a traffic ledger imports (sympy, through torch:
    seconds on a busy machine; the forkserver preloads it only once idle)."""
    import importlib

    import torch
    import torch.distributed as dist

    from labkit.ledger import traffic

    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:  # shipped by value, then: nothing to import
            pass
    with traffic():
        dist.all_reduce(torch.zeros(1))


NOT_WRITTEN = object()  # what call_answer returns for a stub


def call_answer(fn, *args, what: str = "answer"):
    """Call a student's plain function here (no ranks): its value; NOT_WRITTEN
    (after saying so) for a stub; ExerciseError naming the student's line if it
    raises anything else."""
    try:
        return fn(*args)
    except NotImplementedError:
        _not_yet(what)
        return NOT_WRITTEN
    except Exception as e:  # noqa: BLE001  (told to the student, never a traceback)
        frames = [(f.filename, f.lineno, f.name)
                  for f in traceback.extract_tb(e.__traceback__)]
        raise ExerciseError(f"your {what} raised {type(e).__name__}: {e}"
                            + at_line(student_frame(frames)) + hint_for(
                                type(e).__name__, str(e))) from None


# ------------------------------------------------------------------ comparing


def close_to(got: float, want, rel: float = 1e-9) -> bool:
    """got (a float64 formula) within `rel` of want (a float or an exact
    Fraction): the same operations in another order differ in the 16th digit;
    a slip by whole factors."""
    want = float(want)
    return abs(got - want) <= rel * abs(want) if want else abs(got) <= 1e-300


def slips_named(got: float, want, slips, otherwise):
    """The hint of every slip (value, why) that `got` equals and the right answer
    does not; two slips can give one number on a drawn case, and then both are
    named ("; or: "). `otherwise` when none is."""
    named = list(dict.fromkeys(why for v, why in slips
                               if not close_to(float(v), want)
                               and close_to(got, v)))
    return "; or: ".join(named) if named else otherwise


def as_number(what: str, got) -> float:
    """The student's number as a float; ExerciseError for a non-number, NaN or
    inf."""
    if not is_number(got):
        raise ExerciseError(f"{what} returned {got!r} ({type(got).__name__}); "
                            "return a number")
    finite(what, got)
    return float(got)



def number_text(x: float, what: str) -> str:
    """352,321,536 B (336.0 MiB) for bytes, 352,321,536 for a whole number, else
    six significant digits: never 3.52322e+08 for a count a student typed (bytes
    from 1 KiB up are shown whole: a fraction of a byte there is rounding)."""
    is_bytes = "byte" in what.lower()
    whole = (is_whole(x) or is_bytes and abs(x) >= 1024) and abs(x) < 1e18
    text = f"{x:,.0f}" if whole else f"{x:,.6g}"
    if is_bytes:
        from labkit.units import human_bytes

        text += f" B ({human_bytes(x)})" if abs(x) >= 1024 else " B"
    return text


def is_whole(x) -> bool:
    """A student's number that is a whole number (4, 4.0, numpy's 4; not NaN,
    inf or True), however large."""
    if not is_number(x):
        return False
    if isinstance(x, numbers.Integral):
        return True
    return is_finite(x) and float(x).is_integer()


def is_number(x) -> bool:
    """A student's numeric answer: int, float or numpy's numbers; not a bool
    (True is an int to Python, never an answer) and not a tensor."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def finite(what: str, x) -> None:
    """ExerciseError if the number x is NaN, infinite or past float's range: never
    a right answer (a NaN compares False with everything, so `abs(x - want) >
    tol` passes it)."""
    if isinstance(x, numbers.Integral) and not is_finite(x):
        raise ExerciseError(f"{what}: a number with {len(str(abs(x)))} digits is "
                            "past any float (about 1.8e308): compute it from the "
                            "inputs")
    if not is_finite(x):
        raise ExerciseError(f"{what}: {x!r} is not a number an answer can be "
                            "(NaN or infinite); compute it from the inputs")


def is_finite(x) -> bool:
    """A number a float can hold: not NaN, not inf, not an int past 1.8e308."""
    import math

    try:
        return math.isfinite(x)
    except (OverflowError, TypeError):
        return False


def check_answer(what: str, yours, expected, hint: str = "", rel: float = 1e-9) -> None:
    """Compare a student's number with the expected one: a line saying it is right,
    "not answered yet" for None, ExerciseError with the hint when it is wrong.
    (rel: closed forms in float64 agree to far better than 1e-9; a wrong formula
    is off by whole factors.)"""
    if yours is None:
        not_yet(f"{what}: not answered yet (replace None with your answer)")
        return
    if not is_number(yours):
        raise ExerciseError(f"{what}: expected a number, got {yours!r}")
    # int and float, and numpy's numbers as Python's (np.int64(4) is 4)
    yours = int(yours) if isinstance(yours, numbers.Integral) else float(yours)
    finite(what, yours)
    if not abs(yours - expected) <= rel * max(abs(expected), 1e-300):
        msg = f"{what}: {number_text(yours, what)} is not right"
        raise ExerciseError(msg + (f". Hint: {hint}" if hint else ""))
    print(f"{what}: {number_text(yours, what)} is right")


def check_like(where: str, got, want, hint: str = "") -> None:
    """ExerciseError unless `got` is a tensor of `want`'s shape and dtype."""
    import torch

    tail = f". Hint: {hint}" if hint else ""
    if not isinstance(got, torch.Tensor):
        raise ExerciseError(f"{where}: expected a tensor of shape {tuple(want.shape)}, "
                            f"got {type(got).__name__} {_short(got)}{tail}")
    if tuple(got.shape) != tuple(want.shape):
        raise ExerciseError(f"{where}: shape {tuple(got.shape)}, expected "
                            f"{tuple(want.shape)}{tail}")
    if got.dtype != want.dtype:
        raise ExerciseError(f"{where}: dtype {got.dtype}, expected {want.dtype}{tail}")


def first_wrong(got, want, *, rel: float = 0.0, atol: float = 0.0):
    """Index (a tuple) of the first element of `got` not within atol + rel·|want|
    of `want` (NaN is wrong), or None; both tensors of one shape."""
    import torch

    diff = (got.double() - want.double()).abs()
    bad = ~(diff <= atol + rel * want.double().abs())
    if not bool(bad.any()):
        return None
    flat = int(bad.reshape(-1).nonzero()[0])
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), want.shape))


# How far a right answer in float32 may be from the exact (float64) result: as far
# as the check's own float32 reference is, FACTOR (labkit.numerics) times over,
# since a student's sums run in another order and round as differently as two
# orders in one process do. ROUNDING_UNITS units of rounding of the dtype, times
# the largest element, is the least allowed: a reference that happens to round
# exactly would otherwise allow nothing. Where the result is a sum whose terms
# cancel (a mean of gradients over ranks), an answer's rounding is a unit of the
# terms, not of the small result: `scale` is then the largest term. A real
# mistake (a missing or doubled term) is off by a sizeable fraction of an element.
ROUNDING_UNITS = 4


def rounding_tolerance(want, exact, scale: float | None = None) -> float:
    """The largest difference from `exact` (the reference computed in float64)
    that an answer in `want`'s dtype may have, element by element: FACTOR times
    the float32 reference `want`'s own largest difference from `exact`, at least
    ROUNDING_UNITS units of rounding times `scale` (the largest term of the sums
    that made the result; by default exact's largest element)."""
    import torch

    from labkit.numerics import FACTOR

    if exact.numel() == 0:
        return 0.0
    exact = exact.detach().double()
    own = (want.detach().double() - exact).abs().max().item()
    unit = torch.finfo(want.dtype).eps / 2 if want.dtype.is_floating_point else 0.0
    if scale is None:
        scale = exact.abs().max().item()
    return FACTOR * max(own, ROUNDING_UNITS * unit * scale)


def wrong_element(got, want, exact, scale: float | None = None):
    """(index, got, expected, allowed) of the first element of `got` farther from
    `exact` than rounding_tolerance(want, exact, scale) (NaN and inf are wrong),
    or None. `want` is the float32 reference, `exact` the same computed in
    float64."""
    tol = rounding_tolerance(want, exact, scale)
    i = first_wrong(got, exact, atol=tol)
    return None if i is None else (i, float(got[i]), float(exact[i]), tol)


def compare(where: str, got, want, *, hint: str = "", rel: float = 0.0,
            atol: float = 0.0, name=None, exact=None) -> None:
    """ExerciseError unless tensor `got` equals tensor `want` (same type, shape and
    dtype; every element within atol + rel·|want|). With `exact`, `want` computed
    in float64: every element within rounding_tolerance(want, exact) of it, the
    float32 reference's own rounding, instead. The message gives `where`, the
    first wrong element (named by `name(index)` if given), got and expected."""
    check_like(where, got, want, hint)
    if exact is not None:
        idx = first_wrong(got, exact, atol=rounding_tolerance(want, exact))
        want = exact
    else:
        idx = first_wrong(got, want, rel=rel, atol=atol)
    if idx is not None:
        label = name(idx) if name else f"element {list(idx)}"
        raise ExerciseError(f"{where}, {label}: got {float(got[idx]):.6g}, expected "
                            f"{float(want[idx]):.6g}" + (f". Hint: {hint}" if hint
                                                          else ""))


def _short(x, limit: int = 60) -> str:
    s = repr(x)
    return s if len(s) <= limit else s[:limit] + "…"
