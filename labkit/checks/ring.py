"""Chapter 02's checks: the two phases of ring all-reduce written from send/recv,
and its time by the α-β model."""

from __future__ import annotations

from labkit.checks.common import (
    NOT_WRITTEN,
    ExerciseError,
    call_answer,
    check_like,
    run_answer,
)


def _plural(k: int, word: str) -> str:
    return f"{k} {word}" + ("" if k == 1 else "s")


def _contributors(value: float, n: int) -> list[int]:
    bits = int(round(value))
    return [r for r in range(n) if bits >> r & 1]


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


def _uniform(where: str, got, want, hint: str) -> float:
    """The one value every element of chunk tensor `got` holds (after checking its
    type, shape and dtype against `want`)."""
    check_like(where, got, want, hint)
    values = got.tolist()
    if len(set(values)) != 1:
        raise ExerciseError(f"{where}: its elements differ ({values}); a step put a "
                            "different chunk into this one")
    return values[0]


# ---------------------------------------------------------------- reduce-scatter


def _ring_reduce_scatter_worker(rank, world_size, fn, chunk_len):
    import torch

    # rank r contributes 2**r everywhere: a chunk's value spells out whose
    # contributions it holds (bit r set = rank r's value is in the sum)
    x = torch.full((world_size * chunk_len,), float(2 ** rank))
    chunks = list(x.tensor_split(world_size))
    fn(rank, world_size, chunks)
    return _returned_chunks(chunks)


def check_ring_reduce_scatter(cluster, fn, chunk_len: int = 3) -> None:
    """Check a student's ring reduce-scatter phase.

    `fn(rank, world_size, chunks)` gets this rank's n chunks (tensor views) and
    must, with n-1 ring steps of send/recv, leave in chunks[(rank + 1) % n] the
    sum of that chunk over all ranks.
    """
    import torch

    n = cluster.world_size
    res = run_answer(cluster, _ring_reduce_scatter_worker, fn, chunk_len,
                     what="ring steps")
    if res is None:
        return
    everyone = (1 << n) - 1
    want = torch.full((chunk_len,), float(everyone))
    for rank, chunks in enumerate(res):
        c = (rank + 1) % n
        got = _chunk_list(rank, chunks, n)[c]
        value = _uniform(f"rank {rank}, chunk {c}", got, want,
                         "add the received buffer into the chunk in place")
        if value != everyone:
            have = _contributors(value, n)
            missing = sorted(set(range(n)) - set(have))
            raise ExerciseError(
                f"rank {rank}, chunk {c} should hold the sum over all {n} ranks but "
                f"holds ranks {have} (value {value:g}, expected {everyone}); "
                f"missing {missing}. After step s, rank r's copy of the chunk it "
                f"receives should sum s+1 ranks: check which chunk you send "
                f"((rank - step + 1) % n) and which you add into.")
    print(f"correct: after {_plural(n - 1, 'step')} every rank r holds the full sum "
          f"of chunk (r+1) % {n}, and sent {_plural(n - 1, 'chunk')} of M/{n}")


# ---------------------------------------------------------------- all-gather

_STALE = -1.0  # what a chunk not yet completed holds (a partial sum, in real life)


def _complete(c: int) -> float:
    return 10.0 * (c + 1)  # chunk c's complete sum: 10, 20, 30, ...


def _ring_all_gather_worker(rank, world_size, fn, chunk_len):
    import torch

    # as the reduce-scatter leaves it: rank r has chunk (r+1) % n complete
    n = world_size
    x = torch.full((n * chunk_len,), _STALE)
    chunks = list(x.tensor_split(n))
    chunks[(rank + 1) % n].fill_(_complete((rank + 1) % n))
    fn(rank, world_size, chunks)
    return _returned_chunks(chunks)


def _gather_error(rank: int, c: int, value: float, n: int) -> ExerciseError:
    where = f"rank {rank}, chunk {c}"
    owner = (c - 1) % n  # the rank that completed chunk c in the reduce-scatter
    expected = f"expected chunk {c}'s complete sum {_complete(c):g}"
    if value == _STALE:
        why = (f"it still holds the stale partial sum ({_STALE:g}): nothing was ever "
               f"received into it. Chunk {c} starts complete on rank {owner} and "
               f"must travel {_plural((rank - owner) % n, 'step')} to reach rank "
               f"{rank}: check the number of steps and which chunk you receive into "
               f"((rank - step + 1) % n)")
    elif value in [_complete(k) for k in range(n)]:
        k = int(value / 10) - 1
        why = (f"it holds chunk {k}'s sum ({value:g}): the chunk you received into "
               f"is not the one the left neighbour sent (it sends "
               f"(rank - step + 2) % n, so receive into (rank - step + 1) % n)")
    elif (value - _STALE) in [_complete(k) for k in range(n)]:
        why = (f"got {value:g}, the stale value plus a complete sum: this phase "
               f"overwrites (copy or receive straight into the chunk), it does not add")
    else:
        why = f"got {value:g}"
    return ExerciseError(f"{where}: {expected}; {why}")


def check_ring_all_gather(cluster, fn, chunk_len: int = 3) -> None:
    """Check a student's ring all-gather phase.

    `fn(rank, world_size, chunks)` gets this rank's n chunks: chunks[(rank+1) % n]
    holds that chunk's complete sum, the others stale partial sums. With n-1 ring
    steps it must leave every chunk complete on every rank, overwriting.
    """
    import torch

    n = cluster.world_size
    res = run_answer(cluster, _ring_all_gather_worker, fn, chunk_len,
                     what="all-gather steps")
    if res is None:
        return
    for rank, chunks in enumerate(res):
        _chunk_list(rank, chunks, n)
        for c in range(n):
            want = torch.full((chunk_len,), _complete(c))
            value = _uniform(f"rank {rank}, chunk {c}", chunks[c], want,
                             "receive into the chunk itself (or copy into it)")
            if value != _complete(c):
                raise _gather_error(rank, c, value, n)
    print(f"correct: after {_plural(n - 1, 'step')} every rank holds all {n} "
          f"complete chunks; each sent {_plural(n - 1, 'chunk')} of M/{n}")


# ---------------------------------------------------------------- α-β time

_TIME_CASES = ((4, 1e9, 5e-6, 50e9), (1024, 1e9, 5e-6, 50e9), (8, 4096, 10e-6, 25e9),
               (2, 1e6, 0.0, 1e9))


def _time_hint(n: int, size: float, alpha: float, beta: float, got: float) -> str:
    steps, per_rank = 2 * (n - 1), 2 * (n - 1) / n * size
    near = {
        "only the latency term, steps × α": steps * alpha,
        "only the bandwidth term, bytes / β": per_rank / beta,
        "(N-1) steps, as if it were one phase; all-reduce has two": (n - 1) * alpha
        + per_rank / beta,
        "2S/β: each rank sends 2(N-1)/N·S, not 2S": steps * alpha + 2 * size / beta,
        "S/β: each rank sends 2(N-1)/N·S, not S": steps * alpha + size / beta,
        "one step's latency: the 2(N-1) steps run one after another": alpha
        + per_rank / beta,
    }
    for why, t in near.items():
        if abs(got - t) <= 1e-9 * max(abs(t), 1e-300):
            return f"; that is {why}"
    return ""


def check_ring_time(fn) -> None:
    """Check a student's α-β time of ring all-reduce.

    `fn(n, size, alpha, beta)` returns the seconds a ring all-reduce of `size`
    bytes takes on n ranks: 2(n-1) steps of latency alpha (seconds) plus the bytes
    each rank sends over bandwidth beta (bytes/second).
    """
    from labkit import theory

    for n, size, alpha, beta in _TIME_CASES:
        got = call_answer(fn, n, size, alpha, beta, what="α-β time")
        if got is NOT_WRITTEN:
            return
        want = theory.alpha_beta_time("all_reduce", size, n, alpha, beta)
        case = (f"N = {n}, S = {size:g} B, α = {alpha * 1e6:g} µs, "
                f"β = {beta / 1e9:g} GB/s")
        if isinstance(got, bool) or not isinstance(got, (int, float)):
            raise ExerciseError(f"{case}: expected a number of seconds, got "
                                f"{type(got).__name__} {got!r}")
        # a formula in float64: another order of the same operations differs
        # in the 16th digit; 1e-9 relative absorbs that and nothing else
        if abs(got - want) > 1e-9 * want:
            raise ExerciseError(f"{case}: got {got:.6g} s, expected {want:.6g} s"
                                + _time_hint(n, size, alpha, beta, got))
    n, size, alpha, beta = _TIME_CASES[1]
    latency = 2 * (n - 1) * alpha
    total = theory.alpha_beta_time("all_reduce", size, n, alpha, beta)
    print(f"correct: e.g. N = {n}, 1 GB at α = 5 µs, β = 50 GB/s takes "
          f"{total * 1e3:.2f} ms, of which latency {latency * 1e3:.2f} ms "
          f"({latency / total:.1%})")
