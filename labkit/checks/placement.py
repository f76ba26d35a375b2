"""Chapter 08's checks: place a strategy (P, O, G, A and its collectives) and
predict its bytes, or design one that fits a budget; the check says which state,
which collective, which number or which limit is wrong."""

from __future__ import annotations


from labkit.checks.common import (
    NOT_WRITTEN,
    NOT_YET,
    not_yet,
    PASSED,
    ExerciseError,
    call_answer,
    is_number,
)
from labkit.conventions import STATE_LETTERS
from labkit.theory import Placement

LABELS = {"sent": "bytes sent per step", "pcie": "bytes over PCIe per step"}
DESIGN_KEYS = ("P", "O", "G", "A", "sent", "pcie")


def _compare_placement(what: str, yours, want: Placement) -> None:
    if not isinstance(yours, Placement):
        raise ExerciseError(f"{what}: expected a labkit.theory.Placement, got "
                            f"{yours!r}")
    for s, name in STATE_LETTERS.items():
        if getattr(yours, s) != getattr(want, s):
            raise ExerciseError(
                f"{what}: {s} ({name}) is {getattr(want, s)} in this strategy, "
                f"not {getattr(yours, s)}")
    for sync, label in (("grad_sync", "gradients"), ("param_sync", "parameters")):
        got = getattr(yours, f"resolved_{sync}")()
        need = getattr(want, f"resolved_{sync}")()
        if got != need:
            raise ExerciseError(
                f"{what}: the {label} are synchronised by {need or 'nothing'} in "
                f"this strategy, not by {got or 'nothing'} (set {sync}=)")


def _compare_bytes(what: str, predicted: dict, measured: dict, rel: float,
                   exact) -> None:
    for key, got in measured.items():
        guess = predicted[key]
        if not is_number(guess):
            raise ExerciseError(f"{what}: {key} must be a number, got {guess!r}")
        tol = 0 if key in exact else rel * max(abs(got), 1)
        if abs(guess - got) > tol:
            label = (f"bytes of {STATE_LETTERS[key]}" if key in STATE_LETTERS
                     else LABELS.get(key, "bytes sent per step"))
            off = guess - got
            why = (f"{off:+,.0f} bytes: count every small tensor too (a step "
                   "counter is 4 bytes)" if abs(off) <= 64
                   else f"{guess / max(got, 1):.3g}×" if got
                   else f"{off:+,.0f} bytes")
            within = "to the byte" if key in exact else f"within {rel:.0%}"
            raise ExerciseError(
                f"{what}: you predicted {guess:,.0f} {label} ({key}); the ledgers "
                f"measured {got:,.0f} ({why}); it must match {within}")


def _answer_pair(what: str, fn):
    """Call the student's function: NOT_WRITTEN for a stub, else the pair
    (Placement, predicted bytes) it must return."""
    answer = call_answer(fn, what=f"{what} answer")
    if answer is not NOT_WRITTEN and not (isinstance(answer, tuple)
                                          and len(answer) == 2):
        raise ExerciseError(f"{what}: return a pair (Placement(...), dict of "
                            f"predicted bytes), not {answer!r}")
    return answer


def check_placement(what: str, yours, predicted, want: Placement, measured: dict,
                    rel: float = 0.01, exact=("P", "O", "G")) -> bool:
    """`yours`: the student's Placement; `predicted`: their bytes per rank, a dict
    with "P", "O", "G" (held) and "sent" (bytes per step), each number or None.
    `want` is the strategy's true Placement and `measured` the same keys as the
    ledgers measured them. Bytes held (the keys in `exact`) must agree to the
    byte, as the memory ledger counts them; bytes sent within `rel` (gloo's
    message headers).

    `yours` may also be the student's function returning (Placement, predicted):
    it is called here, and a stub still raising NotImplementedError is "not
    written yet"."""
    if callable(yours) and not isinstance(yours, Placement):
        answer = _answer_pair(what, yours)
        if answer is NOT_WRITTEN:
            return NOT_YET
        yours, predicted = answer
    if yours is None:
        not_yet(f"{what}: not answered yet (replace None with your Placement)")
        return NOT_YET
    _compare_placement(what, yours, want)
    if predicted is not None and not isinstance(predicted, dict):
        raise ExerciseError(f"{what}: the placement is right; predict the bytes as a "
                            f"dict with keys {', '.join(measured)}, not {predicted!r}")
    if predicted is None or any(predicted.get(k) is None for k in measured):
        print(f"{what}: the placement is right; now predict "
              f"{', '.join(k for k in measured)} in bytes")
        return NOT_YET
    _compare_bytes(what, predicted, measured, rel, exact)
    print(f"{what}: placement and bytes right "
          f"({', '.join(f'{k} {measured[k]:,.0f}' for k in measured)})")
    return PASSED


def check_design(what: str, yours, budget: dict, run, *, fixed: dict | None = None,
                 rel: float = 0.01) -> bool:
    """A placement designed to fit a budget, and its bytes predicted.

    `yours`: the student's function returning (Placement, predicted), predicted a
    dict with DESIGN_KEYS: "P", "O", "G", "A" the bytes one rank holds on the
    device (P and O after the step, G at its peak, A when forward ends), "sent"
    the bytes it sends per step and "pcie" the bytes it moves to or from host
    memory per step. `budget`: the most "device" (P + O + G + A), "sent" and
    "pcie" may be (a missing or None limit: none); sent gets `rel` more, for
    gloo's headers. `fixed`: states whose mode is prescribed, e.g. {"A":
    "Replicated"}. `run(placement)` runs it on the ranks and returns the
    measured dict (same keys); it raises ValueError for a placement it cannot
    run, and the message is passed on. Any placement that trains correctly, fits
    and is predicted right passes: held bytes and pcie to the byte, sent within
    `rel`."""
    answer = _answer_pair(what, yours)
    if answer is NOT_WRITTEN:
        return NOT_YET
    pl, predicted = answer
    if not isinstance(pl, Placement):
        raise ExerciseError(f"{what}: expected a labkit.theory.Placement, got {pl!r}")
    for s, mode in (fixed or {}).items():
        if getattr(pl, s) != mode:
            raise ExerciseError(f"{what}: {s} ({STATE_LETTERS[s]}) must be {mode} "
                                f"here, not {getattr(pl, s)}")
    verdict = pl.check()
    if not verdict.ok:
        raise ExerciseError(f"{what}: this placement does not train what one "
                            f"process trains: {'; '.join(verdict.problems)}")
    if not isinstance(predicted, dict) or set(predicted) != set(DESIGN_KEYS):
        raise ExerciseError(f"{what}: predict the bytes as a dict with keys "
                            f"{', '.join(DESIGN_KEYS)}, not {predicted!r}")
    try:
        measured = run(pl)
    except ValueError as e:
        raise ExerciseError(f"{what}: {e}") from None
    device = sum(measured[s] for s in "POGA")
    held = ", ".join(f"{s} {measured[s]:,.0f}" for s in "POGA")
    for key, got, slack in (("device", device, 0), ("sent", measured["sent"], rel),
                            ("pcie", measured["pcie"], 0)):
        limit = budget.get(key)
        if limit is not None and got > limit * (1 + slack):
            extra = f" ({held})" if key == "device" else ""
            amount = (f"holds {got:,.0f} bytes on the device{extra}" if key ==
                      "device" else f"moves {got:,.0f} {LABELS[key]}")
            raise ExerciseError(
                f"{what}: measured on the ranks, your placement {amount}; the "
                f"budget allows {limit:,.0f}: which state could live elsewhere?")
    _compare_bytes(what, predicted, {k: measured[k] for k in DESIGN_KEYS}, rel,
                   exact=("P", "O", "G", "A", "pcie"))
    print(f"{what}: fits ({device:,.0f} of {budget['device']:,.0f} bytes on the "
          f"device) and your bytes are right ({held}, sent {measured['sent']:,.0f},"
          f" PCIe {measured['pcie']:,.0f})")
    return PASSED
