"""Chapter 02's checks: the two phases of ring all-reduce written from send/recv,
and the message size at which its latency and bandwidth terms are equal.

The phases run on inputs drawn fresh each time (whole numbers, so every order
of adding them is exact in float32) under the traffic ledger, and are held to
the ring's messages: no collective, N-1 sends of one chunk to the right
neighbour, N-1 receives from the left, and no labkit ring.
"""

from __future__ import annotations

import itertools
from fractions import Fraction

from labkit.checks.common import (
    NOT_WRITTEN,
    SHORT_TIMEOUT,
    ExerciseError,
    call_answer,
    check_like,
    finite,
    is_number,
    number_text,
    run_answer,
)
from labkit.checks.verify import (
    fresh_seed,
    own_calls,
    refuse_collectives,
    refuse_own,
    require_ring,
)

# labkit's own rings (comm) and this module's references: never an answer
_OWN = ("labkit.comm.collectives", "labkit.checks.ring:_crossover")


def _plural(k: int, word: str) -> str:
    return f"{k} {word}" + ("" if k == 1 else "s")


def _draw(seed: int, rows: int, n: int, chunk_len: int):
    """`rows` x n chunks of chunk_len whole numbers in [1, 1000), float32: a sum
    of up to thousands of them is exact in float32 in any order."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 1000, (rows, n, chunk_len), generator=g).float()


def _returned_chunks(chunks):
    """What the answer left in `chunks`, as it travels back (tensors cloned)."""
    import torch

    if not isinstance(chunks, list):
        return chunks
    return [c.clone() if isinstance(c, torch.Tensor) else c for c in chunks]


def _chunk_list(rank: int, chunks, n: int):
    if not isinstance(chunks, list) or len(chunks) != n:
        raise ExerciseError(
            f"rank {rank}: `chunks` must stay a list of {n} tensors, got "
            f"{type(chunks).__name__}" + (f" of {len(chunks)}" if isinstance(
                chunks, list) else "") + ": add into the chunks (or replace an "
            "entry), never the list itself")
    return chunks


def _phase_worker(rank, world_size, fn, x):
    """Run one phase on this rank's chunks (x[rank], copied), under the
    traffic ledger and with labkit's own rings watched for."""
    from labkit.ledger import traffic

    chunks = list(x[rank].clone().unbind(0))
    with traffic() as t, own_calls(*_OWN) as own:
        fn(rank, world_size, chunks)
    return _returned_chunks(chunks), t.records, list(own)


def _honest(res, what: str) -> None:
    """Before the values: no labkit ring, no collective, on any rank."""
    for rank, (_, records, own) in enumerate(res):
        refuse_own(f"rank {rank}", own, "ring")
        refuse_collectives(f"rank {rank}", records, what)


def _ring_messages(res, n: int, chunk_len: int, what: str) -> None:
    """After the values: each rank's messages are the ring's."""
    for rank, (_, records, _) in enumerate(res):
        require_ring(f"rank {rank}, the values are right, but", rank, n, records,
                     4 * chunk_len, what)


def _measured(n: int, chunk_len: int) -> str:
    return (f"measured on every rank: {_plural(n - 1, 'message')} of "
            f"{4 * chunk_len} bytes (M/{n}) to its right neighbour, as many from its "
            "left, no collective")


# ---------------------------------------------------------------- reduce-scatter


def check_ring_reduce_scatter(cluster, fn, chunk_len: int = 3, *,
                              timeout: float = SHORT_TIMEOUT) -> None:
    """Check a student's ring reduce-scatter phase.

    `fn(rank, world_size, chunks)` gets this rank's n chunks (tensor views) and
    must, with n-1 ring steps of send/recv, leave in chunks[(rank + 1) % n] the
    sum of that chunk over all ranks.
    """
    n = cluster.world_size
    x = _draw(fresh_seed(), n, n, chunk_len)  # x[rank, chunk]: drawn this run
    res = run_answer(cluster, _phase_worker, fn, x, what="ring steps", timeout=timeout)
    if res is None:
        return
    _honest(res, "a ring reduce-scatter")
    for rank, (chunks, _, _) in enumerate(res):
        c = (rank + 1) % n
        got = _chunk_list(rank, chunks, n)[c]
        want = x[:, c].sum(0)
        check_like(f"rank {rank}, chunk {c}", got, want,
                   "add the received buffer into the chunk in place")
        if not bool((got == want).all()):  # whole numbers: every order is exact
            raise ExerciseError(f"rank {rank}, chunk {c} should hold its sum over "
                                f"all {n} ranks" + _which_sum(got, x[:, c], n))
    _ring_messages(res, n, chunk_len, "a reduce-scatter phase")
    print(f"correct: after {_plural(n - 1, 'step')} every rank r holds the full sum "
          f"of chunk (r+1) % {n}; {_measured(n, chunk_len)}")


def _which_sum(got, column, n: int) -> str:
    """What a wrong chunk holds instead, told by whose values are in it (any
    subset of the ranks' copies of that chunk, summed), or by its elements."""
    for k in range(n - 1, -1, -1):
        for ranks in itertools.combinations(range(n), k):
            part = column[list(ranks)].sum(0) if ranks else column[0] * 0
            if bool((got == part).all()):
                missing = sorted(set(range(n)) - set(ranks))
                held = (f"rank {ranks[0]}'s copy" if len(ranks) == 1 else
                        f"the sum of ranks {list(ranks)}' copies")
                return (f", but holds {held} only (missing {missing}). After "
                        "step s a rank's copy of the chunk it receives into "
                        "should sum s+1 ranks: check which chunk you send "
                        "((rank - step + 1) % n) and which you add into "
                        "((rank - step) % n)")
    return (f": got {got.tolist()}, expected {column.sum(0).tolist()}, which is "
            "no sum of the ranks' copies (added twice? averaged?)")


# ---------------------------------------------------------------- all-gather


def check_ring_all_gather(cluster, fn, chunk_len: int = 3, *,
                          timeout: float = SHORT_TIMEOUT) -> None:
    """Check a student's ring all-gather phase.

    `fn(rank, world_size, chunks)` gets this rank's n chunks: chunks[(rank+1) % n]
    holds that chunk's complete sum, the others stale partial sums. With n-1 ring
    steps it must leave every chunk complete on every rank, overwriting.
    """
    n = cluster.world_size
    drawn = _draw(fresh_seed(), n + 1, n, chunk_len)
    complete, stale = drawn[n], drawn[:n]  # complete[c]; stale[rank, c]
    start = stale.clone()
    for r in range(n):  # as the reduce-scatter leaves it: (r+1) % n complete
        start[r, (r + 1) % n] = complete[(r + 1) % n]
    res = run_answer(cluster, _phase_worker, fn, start, what="all-gather steps",
                     timeout=timeout)
    if res is None:
        return
    _honest(res, "a ring all-gather")
    for rank, (chunks, _, _) in enumerate(res):
        _chunk_list(rank, chunks, n)
        for c in range(n):
            check_like(f"rank {rank}, chunk {c}", chunks[c], complete[c],
                       "receive into the chunk itself (or copy into it)")
            if not bool((chunks[c] == complete[c]).all()):
                raise _gather_error(rank, c, chunks[c], complete, start[rank, c], n)
    _ring_messages(res, n, chunk_len, "an all-gather phase")
    print(f"correct: after {_plural(n - 1, 'step')} every rank holds all {n} "
          f"complete chunks; {_measured(n, chunk_len)}")


def _gather_error(rank: int, c: int, got, complete, stale, n: int) -> ExerciseError:
    where = f"rank {rank}, chunk {c}: expected chunk {c}'s complete sum"
    owner = (c - 1) % n  # the rank that completed chunk c in the reduce-scatter
    if bool((got == stale).all()):
        why = (f"it still holds its stale partial sum: nothing was ever received "
               f"into it. Chunk {c} starts complete on rank {owner} and must "
               f"travel {_plural((rank - owner) % n, 'step')} to reach rank {rank}: "
               "check the number of steps and which chunk you receive into "
               "((rank - step + 1) % n)")
    elif any(bool((got == complete[k]).all()) for k in range(n)):
        k = next(k for k in range(n) if bool((got == complete[k]).all()))
        why = (f"it holds chunk {k}'s complete sum: the chunk you received into is "
               f"not the one the left neighbour sent (it sends (rank - step + 2) % "
               "n, so receive into (rank - step + 1) % n)")
    elif bool((got == stale + complete[c]).all()):
        why = ("it holds the stale partial sum plus the complete one: this phase "
               "overwrites (receive straight into the chunk, or copy), it does "
               "not add")
    else:
        why = f"got {got.tolist()}, expected {complete[c].tolist()}"
    return ExerciseError(f"{where}; {why}")


# ------------------------------------------------------ latency = bandwidth


def _crossover(n: int, alpha: float, beta: float) -> Fraction:
    """S with 2(n-1)·α = 2(n-1)/n·S/β, exactly (Fractions of the floats given)."""
    return n * Fraction(alpha) * Fraction(beta)


def _crossover_cases(seed: int) -> list[tuple[int, float, float]]:
    import random

    rng = random.Random(seed)
    cases = [(1024, 5e-6, 50e9)]  # the chapter's question: NDR InfiniBand, 1024
    for _ in range(5):
        cases.append((rng.randint(2, 4096), rng.uniform(1e-6, 30e-6),
                      rng.uniform(10e9, 900e9)))
    return cases


def _crossover_hint(n: int, alpha: float, beta: float, got: float) -> str:
    near = {
        "α·β: the N is missing (a ring rank sends (N-1)/N·S in 2(N-1) steps, "
        "S/N a step)": alpha * beta,
        "(N-1)·α·β: compare 2(N-1) steps of α with 2(N-1)/N·S/β; the (N-1) "
        "cancel": (n - 1) * alpha * beta,
        "N·α·β/2: both terms count 2(N-1), the 2 cancels too": n * alpha * beta / 2,
        "2N·α·β: both terms count 2(N-1), the 2 cancels too": 2 * n * alpha * beta,
        "N·α/β: β is bytes per second, so S = (time) × β": n * alpha / beta,
        "N²·α·β: each step sends S/N, not S/N²": n * n * alpha * beta,
    }
    for why, v in near.items():
        if abs(got - v) <= 1e-9 * abs(v):
            return f"; that is {why}"
    return ""


def check_crossover(fn) -> None:
    """Check a student's `fn(n, alpha, beta)`: the all-reduce size S, in bytes,
    at which a ring's latency term 2(n-1)·α equals its bandwidth term
    2(n-1)/n·S/β. Cases are drawn fresh each run; labkit's own α-β functions
    are refused."""
    cases = _crossover_cases(fresh_seed())
    for n, alpha, beta in cases:
        with own_calls("labkit.theory.collective_cost", *_OWN) as own:
            got = call_answer(fn, n, alpha, beta, what="crossover size")
        refuse_own(f"crossover_bytes({n}, {alpha:.3g}, {beta:.3g})", own,
                   "α-β model (or this check's reference)")
        if got is NOT_WRITTEN:
            return
        case = (f"N = {n}, α = {alpha * 1e6:.3g} µs, β = {beta / 1e9:.4g} GB/s")
        if not is_number(got):
            raise ExerciseError(f"{case}: expected a number of bytes, got "
                                f"{type(got).__name__} {got!r}")
        finite(case, got)
        want = float(_crossover(n, alpha, beta))
        # float64 formula against the exact one: another order of the same
        # operations differs in the 16th digit; 1e-9 relative absorbs that only
        if not abs(got - want) <= 1e-9 * want:
            raise ExerciseError(f"{case}: got {number_text(got, 'bytes')}, expected "
                                f"{number_text(want, 'bytes')}"
                                + _crossover_hint(n, alpha, beta, got))
    n, alpha, beta = cases[0]
    s = float(_crossover(n, alpha, beta))
    print(f"correct on {len(cases)} cases drawn this run: at N = {n}, α = 5 µs, "
          f"β = 50 GB/s, an all-reduce smaller than {s / 1e6:,.0f} MB spends longer "
          "in latency than in moving bytes")
