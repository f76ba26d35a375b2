"""Chapter 07's arithmetic exercises: the share of the weights a rank holds at its
peak under FSDP with prefetch, and the fewest units that fit a budget when the
shards are fp32 and the units are gathered in a compute dtype (on cases drawn
fresh each run, against exact fractions, and as the memory ledger measured)."""

from __future__ import annotations

import random
from fractions import Fraction

from labkit.checks.common import (
    NOT_WRITTEN,
    NOT_YET,
    PASSED,
    ExerciseError,
    call_answer,
    is_whole,
)
from labkit.checks.verify import fresh_seed, own_calls, refuse_own


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


# -------------------------------------------------------- the fewest units

_OWN_UNITS = ("labkit.theory.placement", "labkit.theory.zero",
              "labkit.checks.fsdp_arithmetic:_min_units")


def _min_units(psi, n, budget, shard_bytes, compute_bytes) -> int | None:
    """The fewest equal units U with shards + two whole units in the compute
    dtype, shard_bytes·psi/n + 2·compute_bytes·psi/U, within `budget` (exact, in
    fractions); None when the shards alone fill it."""
    import math

    psi, budget = Fraction(psi), Fraction(budget)
    room = budget - shard_bytes * psi / n
    if room <= 0:
        return None
    return max(1, math.ceil(2 * compute_bytes * psi / room))


def _units_cases(seed: int) -> list[tuple]:
    """Budgets drawn inside the interval of one answer (5% to 95% of the way to
    the next), so that a float computation rounds to the same whole number."""
    rng = random.Random(seed)
    cases = [(70e9, 64, 10e9, 4, 2)]  # 70B, fp32 shards, bf16 units, 10 GB
    for _ in range(6):
        n, units = rng.choice([2, 4, 8, 64, 512]), rng.randint(1, 300)
        psi = float(rng.randint(10**6, 10**11))
        sb, cb = rng.choice([(4, 2), (4, 4), (2, 2), (4, 1)])
        need = 2 * cb * psi / units  # two whole units of this many
        more = 2 * cb * psi / (units - 1) - need if units > 1 else need
        budget = sb * psi / n + need + rng.uniform(0.05, 0.95) * more
        cases.append((psi, n, float(budget), sb, cb))
    n = rng.choice([4, 8, 64])
    psi = float(n * rng.randint(10**5, 10**9))
    cases.append((psi, n, 4 * psi / n, 4, 2))  # the shards exactly fill it: None
    cases.append((psi, n, 4 * psi / n * rng.uniform(0.3, 0.99), 4, 2))
    return cases


def check_min_units(fn, measured: dict | None = None) -> bool:
    """`fn(psi, n, budget, shard_bytes, compute_bytes)`: the fewest equal FSDP
    units a model of psi parameters must be cut into so that one rank's weights at
    their peak fit in `budget` bytes: its shards, 1/n of the model in
    shard_bytes per parameter (the fp32 master shards), plus two whole units
    gathered in the compute dtype, compute_bytes per parameter (the one
    computing and the one prefetched); None when even the shards do not fit.
    Cases are drawn fresh each run; `measured`: {(psi, n, budget, shard_bytes,
    compute_bytes): units} where the budget is a peak the memory ledger measured
    with that many units. labkit's closed forms are refused."""
    cases = [(*k, seen) for k, seen in (measured or {}).items()]
    cases += [(*case, None) for case in _units_cases(fresh_seed())]
    for psi, n, budget, sb, cb, seen in cases:
        where = (f"min_units(psi={psi:,.6g}, n={n}, budget={budget:,.6g}, "
                 f"shard_bytes={sb}, compute_bytes={cb})")
        with own_calls(*_OWN_UNITS) as own:
            got = call_answer(fn, psi, n, budget, sb, cb, what="min_units")
        refuse_own(where, own, "closed forms (or this check's reference)")
        if got is NOT_WRITTEN:
            return NOT_YET
        want = _min_units(psi, n, budget, sb, cb)
        if seen is not None and want != seen:  # the measurement is the arbiter
            want = seen
        if want is None:
            if got is not None:
                raise ExerciseError(
                    f"{where} = {got!r}, expected None: the shards alone, "
                    f"shard_bytes·psi/n = {sb * psi / n:,.6g} bytes, already fill "
                    "the budget, so no number of units is enough")
            continue
        if got is None or not is_whole(got):
            raise ExerciseError(
                f"{where} returned {got!r}: return a whole number of units" + (
                    f" (None only when the shards alone, {sb * psi / n:,.6g} "
                    "bytes, fill the budget)" if got is None else ""))
        got = int(got)
        if got != want:
            source = ("the memory ledger measured that peak with"
                      if seen is not None else "expected")
            raise ExerciseError(f"{where} = {got}, but {source} {want}. "
                                + _units_hint(psi, n, budget, sb, cb, got))
    seen = len(measured or {})
    print(f"correct on {len(cases) - seen} cases drawn this run"
          + (f" and the {seen} the memory ledger measured" if seen else "")
          + ": the fp32 shards plus two whole units in the compute dtype fit the "
          "budget, with the fewest units; e.g. 70B on 64 ranks, 10 GB, bf16 "
          f"units: {_min_units(70e9, 64, 10e9, 4, 2)} units")
    return PASSED


def _units_hint(psi, n, budget, sb, cb, got: int) -> str:
    """Name the mistake: what formula gives the answer's number here."""
    import math

    def units(shard, whole, k=2, rounding=math.ceil):
        room = Fraction(budget) - shard * Fraction(psi) / n
        return None if room <= 0 else max(1, rounding(k * whole * Fraction(psi)
                                                      / room))

    why = ("at the peak a rank holds its shards, shard_bytes·psi/n, plus two whole "
           "units in the compute dtype, 2·compute_bytes·psi/U; solve shards + "
           "2·compute_bytes·psi/U <= budget for the smallest whole U (round up)")
    near = [
        (units(sb, cb, k=1), "That counts one whole unit; at the peak a rank holds "
                             "two units' worth (the one computing and the one "
                             "prefetched, or one unit twice while it is copied "
                             "out of its all-gather's buffer). "),
        (units(cb, cb), "That counts the shards in the compute dtype: they are "
                        "the fp32 master shards the optimizer steps, shard_bytes "
                        "each; only the gathered units are in compute_bytes. "),
        (units(sb, sb), "That counts the gathered units in shard_bytes: FSDP "
                        "gathers them in the compute dtype, compute_bytes each "
                        "(half the bytes in bf16). "),
        (units(sb, cb, rounding=math.floor), "That rounds down: fewer units are "
                                             "larger, so round U up. "),
    ]
    if got == 0:
        return "A model is at least one unit. " + why
    for v, text in near:
        if v is not None and got == v:
            return text + why
    return why
