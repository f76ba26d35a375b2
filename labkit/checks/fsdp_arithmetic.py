"""Chapter 07's arithmetic exercises: the share of the weights a rank holds at its
peak under FSDP with prefetch, and the fewest units that fit a budget. Each is
held to what the memory ledger measured, and to its closed form elsewhere."""

from __future__ import annotations

from labkit.checks.common import (
    NOT_WRITTEN,
    NOT_YET,
    PASSED,
    ExerciseError,
    call_answer,
)


def check_peak_share(fn, measured: dict[tuple[int, int], float]) -> bool:
    """`fn(n_ranks, n_units)`: the fraction of a model's whole fp32 weights one rank
    holds at its peak under FSDP with prefetch, for `n_units` equal units on
    `n_ranks` ranks. `measured`: {(n_ranks, n_units): the fraction a memory
    ledger measured}; the answer must match those within 0.1% and the closed
    form (its shards, plus the unit computing and the one prefetched, whole)
    for other sizes."""
    cases = dict(measured)
    for n, u in ((2, 8), (4, 32), (8, 8), (64, 96)):
        cases.setdefault((n, u), 1 / n + 2 / u)
    for (n, u), want in cases.items():
        got = call_answer(fn, n, u, what="peak share")
        if got is NOT_WRITTEN:
            return NOT_YET
        if isinstance(got, bool) or not isinstance(got, (int, float)):
            raise ExerciseError(f"peak_share({n}, {u}) returned {got!r}: return a "
                                "number, the fraction of the whole fp32 weights")
        # 0.1%: the ledger's fractions are byte counts of whole tensors, the
        # closed form's an ideal; not a rounding
        if abs(got - want) > 1e-3 * want:
            source = ("the memory ledger measured" if (n, u) in measured
                      else "expected")
            raise ExerciseError(
                f"peak_share({n}, {u}) = {got:.4g}, but {source} {want:.4g}. Hint: "
                "between units a rank keeps 1/N of every unit; at the peak one unit "
                "is computing and, with prefetch, the next is already gathered, "
                "both whole")
    print("correct: the shards (1/N of every unit) plus two whole units, as the "
          "ledger measured" + (f" for {sorted(measured)}" if measured else ""))
    return PASSED


def _min_units_reference(psi: float, n: int, budget: float, eb: float):
    import math

    whole = eb * psi
    room = budget - whole / n
    return None if room <= 0 else max(1, math.ceil(2 * whole / room))


def check_min_units(fn, measured: dict | None = None) -> bool:
    """`fn(psi, n, budget, elem_bytes)`: the fewest equal FSDP units a model of psi
    parameters must be cut into so that one rank's weights at their peak (its
    shards, 1/n of the model, plus two whole units: the one computing and the one
    prefetched) fit in `budget` bytes; None when even the shards do not fit.
    `measured`: {(psi, n, budget, elem_bytes): units} where the budget is a peak
    the memory ledger measured with that many units; other cases are held to the
    closed form."""
    cases = dict(measured or {})
    for case in ((70e9, 64, 10e9, 2), (7.5e9, 8, 16e9, 2), (1_000, 4, 1_251, 4),
                 (1_000, 4, 1_000, 4), (8e9, 8, 2e9, 2), (4, 2, 100, 4)):
        cases.setdefault(case, _min_units_reference(*case))
    for (psi, n, budget, eb), want in cases.items():
        got = call_answer(fn, psi, n, budget, eb, what="min_units")
        if got is NOT_WRITTEN:
            return NOT_YET
        where = f"min_units(psi={psi:,.6g}, n={n}, budget={budget:,.6g}, " \
                f"elem_bytes={eb})"
        if want is None:
            if got is not None:
                raise ExerciseError(
                    f"{where} = {got!r}, expected None: the shards alone, "
                    f"elem_bytes·psi/n = {eb * psi / n:,.6g} bytes, already fill "
                    "the budget, so no number of units is enough")
            continue
        if isinstance(got, bool) or not isinstance(got, int):
            raise ExerciseError(f"{where} returned {got!r}: return a whole number "
                                "of units (or None)")
        if got != want:
            source = ("the memory ledger measured that peak with"
                      if (psi, n, budget, eb) in (measured or {}) else "expected")
            whole, shards = eb * psi, eb * psi / n
            why = ("at the peak a rank holds its shards, elem_bytes·psi/n, plus two "
                   "whole units, 2·elem_bytes·psi/U; solve shards + 2·whole/U <= "
                   "budget for the smallest whole U (round up)")
            if got > 0 and abs(shards + whole / got - budget) < abs(
                    shards + 2 * whole / got - budget) and got == -(
                    -whole // (budget - shards)):
                why = ("that counts one whole unit; with prefetch the next unit is "
                       "whole too: two units. " + why)
            raise ExerciseError(f"{where} = {got}, but {source} {want}. Hint: {why}")
    print("correct: the shards plus two whole units fit the budget, with the "
          "fewest units" + (" — as the ledger measured" if measured else ""))
    return PASSED
