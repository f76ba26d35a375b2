"""What every exercise check shares: the error it raises, "not written yet", and
checking a number."""

from __future__ import annotations

from labkit.runtime.results import RankError


class ExerciseError(AssertionError):
    """The exercise's answer is wrong; the message says where and why."""


def run_answer(cluster, worker, *args, what: str = "answer"):
    """Run a student's answer on the ranks; None (after saying so) while it still
    raises NotImplementedError, its RankResults once written."""
    try:
        return cluster.run(worker, *args)
    except RankError as err:
        if _not_written(err):
            print("not written yet: replace `raise NotImplementedError` with your "
                  f"{what}, then run this cell again")
            return None
        raise


def _not_written(err: RankError) -> bool:
    return bool(err.exceptions) and all(
        isinstance(e, NotImplementedError) for e in err.exceptions.values())


def check_answer(what: str, yours, expected, hint: str = "", rel: float = 1e-9) -> bool:
    """Compare a student's number with the expected one.

    None means "not answered yet": it says so and returns False without failing.
    A wrong answer raises ExerciseError with the hint; a right one prints a line.
    """
    if yours is None:
        print(f"{what}: not answered yet (replace None with your answer)")
        return False
    if isinstance(yours, bool) or not isinstance(yours, (int, float)):
        raise ExerciseError(f"{what}: expected a number, got {yours!r}")
    if abs(yours - expected) > rel * max(abs(expected), 1e-300):
        msg = f"{what}: {yours:,.6g} is not right"
        raise ExerciseError(msg + (f". Hint: {hint}" if hint else ""))
    print(f"{what}: {yours:,.6g} is right")
    return True
