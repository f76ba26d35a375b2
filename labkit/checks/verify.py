"""What a check verifies besides the answer's values: that the answer did the work.

- `fresh_seed()`: a check draws its inputs anew each time it runs (a seed from
  the operating system's randomness), so values written down from one run fail
  the next, and computes its reference from them in the same run;
- `own_calls(...)`: records every call into labkit functions that are the
  exercise's answer (labkit's own implementation, or the check's reference)
  while the student's code runs, here or on a rank; `refuse_own` turns one
  into the error "that is labkit's own ...; write it yourself";
- `messages(records)`, `require_ring(...)`: what a rank sent and received, from a
  traffic ledger's records, held to the pattern an exercise asks for (a ring:
  N-1 messages of one chunk, each to the right neighbour only; no collective).
May import every layer below the checks.
"""

from __future__ import annotations

import contextlib
import importlib
import secrets
import sys

from labkit.checks.common import ExerciseError


def fresh_seed() -> int:
    """A seed no one can know before the check runs: inputs drawn from it differ
    in every run, so an answer fitted to one run's values fails the next."""
    return secrets.randbits(31)


# ------------------------------------------------------------- labkit's own code


def _targets(targets) -> dict[str, tuple[str, str]]:
    """{code file: (module, qualname prefix)} for targets "module" (every
    function in it) or "module:qualname" (that function, a class's methods)."""
    out = {}
    for target in targets:
        module, _, qual = target.partition(":")
        mod = importlib.import_module(module)
        out.setdefault(mod.__file__, []).append((module, qual))
    return out


@contextlib.contextmanager
def own_calls(*targets: str):
    """Record, in the list it yields, each of `targets` the block calls (on this
    thread, however it was imported or renamed): "module" stands for every
    function defined in that module, "module:qualname" for one function (or a
    class's methods). Works here and on a rank."""
    files = _targets(targets)
    seen: list[str] = []
    previous = sys.getprofile()

    def profile(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        for module, qual in files.get(code.co_filename, ()):
            name = code.co_qualname
            if not qual or name == qual or name.startswith(qual + "."):
                label = f"{module}.{name}"
                if label not in seen:
                    seen.append(label)

    sys.setprofile(profile)
    try:
        yield seen
    finally:
        sys.setprofile(previous)


def refuse_own(where: str, seen: list[str], what: str) -> None:
    """ExerciseError naming the first of `seen` (what own_calls recorded): the
    answer called labkit's own `what` instead of writing it."""
    if seen:
        raise ExerciseError(
            f"{where}: your answer calls {seen[0]}, labkit's own {what}; the "
            "exercise is to write it yourself (read labkit's code if it helps, "
            "then close it)")


# ---------------------------------------------------------------- messages


def messages(records) -> tuple[list[tuple[int, int]], list[tuple[int, int]],
                                 list[str]]:
    """One rank's traffic records as (sends, recvs, collectives): (peer, bytes)
    for each send and each recv, in order, and the op of every other call."""
    sends = [(r.peer, r.payload_bytes) for r in records if r.op == "send"]
    recvs = [(r.peer, r.payload_bytes) for r in records if r.op == "recv"]
    other = [r.op for r in records if r.op not in ("send", "recv")]
    return sends, recvs, other


def _ordinal(k: int) -> str:
    return {1: "1st", 2: "2nd", 3: "3rd"}.get(k, f"{k}th")


def refuse_collectives(where: str, records, what: str) -> None:
    """ExerciseError if this rank's records hold any collective: `what` (a ring,
    an all-to-all from send/recv) is point-to-point messages alone."""
    other = messages(records)[2]
    if other:
        raise ExerciseError(
            f"{where}: it called {sorted(set(other))}; {what} is point-to-point "
            "messages alone (isend/irecv or send/recv), no collective")


def require_ring(where: str, rank: int, n: int, records, chunk_bytes: int,
                 what: str) -> None:
    """ExerciseError unless this rank's records are one ring phase: no
    collective, N-1 sends of `chunk_bytes` each to the right neighbour, N-1
    receives of as many bytes from the left one."""
    refuse_collectives(where, records, what)
    sends, recvs, _ = messages(records)
    right, left = (rank + 1) % n, (rank - 1) % n
    for name, got, peer, direction in (("sent", sends, right, "to its right"),
                                       ("received", recvs, left, "from its left")):
        if len(got) != n - 1:
            raise ExerciseError(
                f"{where}: it {name} {len(got)} message{'s' * (len(got) != 1)}; "
                f"{what} on {n} ranks takes {n - 1} steps, one message "
                f"{direction} neighbour per step")
        for k, (p, nbytes) in enumerate(got, 1):
            if p != peer:
                raise ExerciseError(
                    f"{where}: its {_ordinal(k)} message was {name} "
                    f"{'to' if name == 'sent' else 'from'} rank {p}; in a ring each "
                    f"rank talks only to its neighbours, rank {rank} {direction} "
                    f"neighbour, rank {peer}")
            if nbytes != chunk_bytes:
                raise ExerciseError(
                    f"{where}: its {_ordinal(k)} message {name} was {nbytes:,} "
                    f"bytes; each step moves one chunk, M/N = {chunk_bytes:,} bytes")
