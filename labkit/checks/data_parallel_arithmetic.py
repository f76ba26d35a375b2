"""Chapter 05's arithmetic exercises: the bytes a parameter server and a ring
write per step, and how many buckets DDP's rule makes. Each is held to what the
traffic ledger or DataParallel measured, and to its closed form elsewhere."""

from __future__ import annotations

from labkit.checks.common import (
    NOT_WRITTEN,
    NOT_YET,
    PASSED,
    ExerciseError,
    call_answer,
)


_BYTES_KEYS = ("server", "worker", "ring")
_BYTES_HINTS = {
    "server": "the server writes the S bytes of new weights to each of the N-1 "
              "workers (its own copy needs no sending): (N-1)·S",
    "worker": "a worker writes its own gradient, S bytes, once (to the server)",
    "ring": "ring all-reduce: 2(N-1) steps of S/N bytes, 2(N-1)/N·S",
}


def _bytes_reference(s: float, n: int) -> dict:
    return {"server": (n - 1) * s, "worker": s, "ring": 2 * (n - 1) / n * s}


def check_bytes_per_step(fn, measured: dict | None = None) -> bool:
    """Check a student's `fn(S, n)`: bytes each rank WRITES per step when every rank
    holds S bytes of gradients, as {"server": ..., "worker": ...} for a parameter
    server (rank 0) and its n-1 workers, and {"ring": ...} for each rank of a ring
    all-reduce. `measured` maps (S, n) to what the traffic ledger measured there,
    {"server": b, "worker": [b, ...], "ring": [b, ...]} (per rank), held to 1%
    (gloo's headers); other sizes are held to the closed forms."""
    cases = [(s, n, m) for (s, n), m in (measured or {}).items()]
    cases += [(2 * 7e9, 64, None), (4e6, 2, None), (1.0, 1024, None)]
    for s, n, seen in cases:
        got = call_answer(fn, s, n, what="bytes_per_step")
        if got is NOT_WRITTEN:
            return NOT_YET
        where = f"bytes_per_step(S={s:,.6g}, n={n})"
        if not isinstance(got, dict) or set(got) != set(_BYTES_KEYS):
            keys = sorted(got) if isinstance(got, dict) else type(got).__name__
            raise ExerciseError(f"{where} returned {keys}; return a dict with the "
                                f"keys {list(_BYTES_KEYS)}")
        want = _bytes_reference(s, n)
        for key in _BYTES_KEYS:
            value = got[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ExerciseError(f"{where}[{key!r}] is {value!r}, not a number")
            if seen is not None:  # against the ledger, rank by rank
                ranks = seen[key] if isinstance(seen[key], (list, tuple)) else [
                    seen[key]]
                for i, b in enumerate(ranks):
                    if abs(value - b) > 0.01 * b:
                        who = ("rank 0, the server" if key == "server" else
                               f"worker {i + 1}" if key == "worker" else f"rank {i}")
                        raise ExerciseError(
                            f"{where}[{key!r}] = {value:,.6g} bytes, but the traffic "
                            f"ledger measured {b:,.6g} written by {who} in section 4"
                            f". Hint: {_BYTES_HINTS[key]}")
            # the closed form in float64: 1e-9 absorbs another order's rounding
            if abs(value - want[key]) > 1e-9 * want[key]:
                why = _BYTES_HINTS[key]
                if key == "server" and abs(value - n * s) <= 1e-9 * n * s:
                    why = "that is N·S: the server does not send to itself; " + why
                if key == "ring" and abs(value - 2 * s) <= 1e-9 * s:
                    why = "that is 2S, the limit of large N; " + why
                raise ExerciseError(f"{where}[{key!r}] = {value:,.6g}, expected "
                                    f"{want[key]:,.6g}. Hint: {why}")
    print("correct: the server writes (N-1)·S, each worker S, each ring rank "
          "2(N-1)/N·S" + (", as measured in section 4" if measured else ""))
    return PASSED


def _bucket_count_reference(sizes, cap_bytes) -> int:
    """DDP's rule (and DataParallel's): fill buckets in backward order, close one
    once it holds at least cap_bytes; None: one tensor a bucket."""
    if cap_bytes is None:
        return len(sizes)
    count, held = 0, None
    for b in sizes:
        if held is None or held >= cap_bytes:
            count, held = count + 1, 0
        held += b
    return count


def check_bucket_count(fn, measured: dict | None = None) -> bool:
    """Check a student's `fn(tensor_bytes, bucket_mb)`: how many buckets (so how many
    all-reduces a step) DDP's rule makes from gradients of these sizes, in the
    order backward produces them, with buckets of bucket_mb MiB: a bucket closes
    once it holds at least bucket_mb MiB. `measured` maps (tuple of sizes,
    bucket_mb) to the number of buckets DataParallel made; other cases are held to
    the rule."""
    mib = 2**20
    cases = dict(measured or {})
    for sizes, mb in (((40, 20_480, 2_048, mib, 2_048, mib), 1),
                      ((3 * mib, mib, mib, 5 * mib), 4), ((10, 20, 30), 1),
                      ((mib,) * 6, 2), ((mib // 2,) * 5, 1)):
        cases.setdefault((sizes, mb), _bucket_count_reference(sizes, mb * mib))
    for (sizes, mb), want in cases.items():
        got = call_answer(fn, list(sizes), mb, what="n_buckets")
        if got is NOT_WRITTEN:
            return NOT_YET
        where = f"n_buckets({list(sizes)}, bucket_mb={mb})"
        if isinstance(got, bool) or not isinstance(got, int):
            raise ExerciseError(f"{where} returned {got!r}: return a whole number "
                                "of buckets")
        if got != want:
            source = ("DataParallel made" if (sizes, mb) in (measured or {})
                      else "DDP's rule makes")
            why = ("a bucket closes once it holds AT LEAST bucket_mb MiB, so the "
                   "tensor that crosses the line stays in it and the next tensor "
                   "opens a new one")
            if got == -(-sum(sizes) // (mb * mib)):
                why = ("that is the total divided by the bucket size: tensors are "
                       "never split across buckets; " + why)
            raise ExerciseError(f"{where} = {got}, but {source} {want}. Hint: {why}")
    print("correct: buckets fill in backward order and close at >= bucket_mb MiB"
          + (", as DataParallel measured" if measured else ""))
    return PASSED
