"""Chapter 08's checks: place a strategy (P, O, G, A and its collectives) and
predict its bytes; the check says which state, which collective or which number
is wrong."""

from __future__ import annotations

from labkit.checks.common import (
    NOT_WRITTEN,
    NOT_YET,
    PASSED,
    ExerciseError,
    call_answer,
)
from labkit.theory.placement import Placement

STATES = {"P": "parameters", "O": "optimizer state", "G": "gradients",
          "A": "activations"}


def _compare_placement(what: str, yours, want: Placement) -> None:
    if not isinstance(yours, Placement):
        raise ExerciseError(f"{what}: expected a labkit.theory.Placement, got "
                            f"{yours!r}")
    for s, name in STATES.items():
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
        answer = call_answer(yours, what=f"{what} answer")
        if answer is NOT_WRITTEN:
            return NOT_YET
        if not (isinstance(answer, tuple) and len(answer) == 2):
            raise ExerciseError(f"{what}: return a pair (Placement(...), dict of "
                                f"predicted bytes), not {answer!r}")
        yours, predicted = answer
    if yours is None:
        print(f"{what}: not answered yet (replace None with your Placement)")
        return NOT_YET
    _compare_placement(what, yours, want)
    if predicted is not None and not isinstance(predicted, dict):
        raise ExerciseError(f"{what}: the placement is right; predict the bytes as a "
                            f"dict with keys {', '.join(measured)}, not {predicted!r}")
    if predicted is None or any(predicted.get(k) is None for k in measured):
        print(f"{what}: the placement is right; now predict "
              f"{', '.join(k for k in measured)} in bytes")
        return NOT_YET
    for key, got in measured.items():
        guess = predicted[key]
        if isinstance(guess, bool) or not isinstance(guess, (int, float)):
            raise ExerciseError(f"{what}: {key} must be a number, got {guess!r}")
        tol = 0 if key in exact else rel * max(abs(got), 1)
        if abs(guess - got) > tol:
            label = (f"bytes of {STATES[key]}" if key in STATES
                     else "bytes sent per step")
            off = guess - got
            why = (f"{off:+,.0f} bytes: count every small tensor too (a step "
                   "counter is 4 bytes)" if abs(off) <= 64
                   else f"{guess / max(got, 1):.3g}×")
            within = "to the byte" if key in exact else f"within {rel:.0%}"
            raise ExerciseError(
                f"{what}: you predicted {guess:,.0f} {label} ({key}); the ledgers "
                f"measured {got:,.0f} ({why}); it must match {within}")
    print(f"{what}: placement and bytes right "
          f"({', '.join(f'{k} {measured[k]:,.0f}' for k in measured)})")
    return PASSED
