"""Chapter 01's checks: all-to-all from point-to-point calls, a reduce-scatter that
sends (N-1)/N·M where gloo's sends twice that, and the ring's bytes per rank."""

from __future__ import annotations

from labkit.checks.common import (
    NOT_WRITTEN,
    ExerciseError,
    call_answer,
    check_like,
    first_wrong,
    run_answer,
)

# ------------------------------------------------------------------ all-to-all
#
# Element t of chunk j on rank i holds 100*i + 10*j + t: any value says which
# rank it started on, in which chunk and where in it.

_A2A_CHUNK = 2


def _a2a_input(rank: int, n: int, k: int = _A2A_CHUNK):
    import torch

    return torch.tensor([100.0 * rank + 10 * j + t for j in range(n) for t in range(k)])


def _a2a_worker(rank, world_size, fn):
    import torch

    from labkit.ledger import traffic

    x = _a2a_input(rank, world_size)
    with traffic() as t:
        out = fn(rank, world_size, x.clone())
    if isinstance(out, torch.Tensor):
        out = out.detach().clone()
    return out, sorted({r.op for r in t.records})


def _origin(v: float) -> str:
    i, rest = divmod(int(round(v)), 100)
    j, t = divmod(rest, 10)
    return f"element {t} of rank {i}'s chunk {j}"


def check_all_to_all(cluster, fn) -> None:
    """Check a student's all-to-all built from send/recv.

    `fn(rank, world_size, x)` gets this rank's x, n equal chunks, and returns a new
    tensor like x whose chunk i is chunk `rank` of rank i's x, using only
    point-to-point calls (isend/irecv, send/recv). A mistake is told by rank,
    chunk and element, with where the value came from.
    """
    n = cluster.world_size
    res = run_answer(cluster, _a2a_worker, fn, what="all-to-all")
    if res is None:
        return
    k = _A2A_CHUNK
    for rank, (out, ops) in enumerate(res):
        want = _a2a_input(0, n).clone()
        for i in range(n):  # chunk i: rank i's chunk `rank`
            want[i * k:(i + 1) * k] = _a2a_input(i, n)[rank * k:(rank + 1) * k]
        check_like(f"rank {rank}", out, want,
                   "return a new tensor with x's shape and dtype")
        bad = first_wrong(out, want)
        if bad is not None:
            (e,) = bad
            got = float(out[e])
            raise ExerciseError(
                f"rank {rank}, chunk {e // k}, element {e % k}: got {got:g}, expected "
                f"{float(want[e]):g}; it holds {_origin(got)}, expected "
                f"{_origin(float(want[e]))}. Chunk j of rank i goes to rank j and "
                "lands there as chunk i: send x.chunk(n)[dst] to each dst, and put "
                "what rank src sends at position src")
        if set(ops) - {"send", "recv"}:
            raise ExerciseError(
                f"rank {rank}: the values are right, but it called "
                f"{sorted(set(ops) - {'send', 'recv'})}: build it from isend/irecv "
                "(or send/recv) alone")
    print(f"correct: every rank r ended with chunk r of every rank, in rank order, "
          f"from point-to-point calls alone ({n - 1} sends per rank)")


# ------------------------------------------------------- reduce-scatter, cheaply

_RS_NUMEL = 1 << 16  # 256 KiB of float32: a few hundred bytes of headers is < 1%


def _rs_input(rank: int, n: int, numel: int = _RS_NUMEL):
    import torch

    # rank-dependent and position-dependent whole numbers, at most 1000 N + 96:
    # their sum over N ranks, in any order, is a whole number far below 2**24,
    # exact in float32, so the check compares exactly
    return torch.arange(numel, dtype=torch.float32) % 97 + 1000.0 * (rank + 1)


def _rs_worker(rank, world_size, fn, numel):
    import torch

    from labkit.ledger import traffic

    x = _rs_input(rank, world_size, numel)
    with traffic() as t:
        out = fn(rank, world_size, x.clone())
    if isinstance(out, torch.Tensor):
        out = out.detach().clone()
    return out, t.written, sorted({r.op for r in t.records})


def _rs_why(got, rank: int, n: int, numel: int) -> str:
    """What a wrong reduce-scatter result is instead, if it is something simple."""
    import torch

    s = numel // n
    chunks = [[_rs_input(q, n, numel)[c * s:(c + 1) * s] for c in range(n)]
              for q in range(n)]
    total = [sum(chunks[q][c] for q in range(n)) for c in range(n)]
    candidates = {"the average over ranks, not the sum": total[rank] / n,
                  "this rank's own chunk, not summed over ranks": chunks[rank][rank]}
    for c in range(n):
        if c != rank:
            candidates[f"the sum of chunk {c}, not chunk {rank}"] = total[c]
    # a diagnosis, not the pass criterion: the sums are exact, the average is one
    # division off by a rounding (6e-8 relative); 1e-6 relative tells them all
    # apart (they differ by whole numbers)
    for why, t in candidates.items():
        if tuple(got.shape) == tuple(t.shape) and torch.allclose(got, t, rtol=1e-6,
                                                                  atol=0):
            return f": it holds {why}"
    return ""


def check_cheap_reduce_scatter(cluster, fn, numel: int = _RS_NUMEL) -> None:
    """Check a student's reduce-scatter that sends (N-1)/N·M per rank.

    `fn(rank, world_size, x)` gets this rank's x (numel divisible by N) and returns
    a tensor of numel/N: chunk `rank` of the sum of every rank's x. Right values are
    not enough: each rank must write about (N-1)/N·M bytes to its sockets, not the
    2(N-1)/N·M of gloo's reduce_scatter (an all-reduce underneath).
    """
    n = cluster.world_size
    if numel % n:
        raise ValueError(f"numel {numel} is not divisible by {n} ranks")
    res = run_answer(cluster, _rs_worker, fn, numel, what="reduce-scatter")
    if res is None:
        return
    s, m = numel // n, 4 * numel
    total = sum(_rs_input(q, n, numel) for q in range(n))
    for rank, (out, _, _) in enumerate(res):
        want = total[rank * s:(rank + 1) * s]
        hint = f"return chunk {rank} of the sum, {s} elements of float32"
        check_like(f"rank {rank}", out, want, hint)
        bad = first_wrong(out, want)  # whole numbers: every sum order is exact
        if bad is not None:
            raise ExerciseError(
                f"rank {rank}, element {list(bad)}: got {float(out[bad]):g}, expected "
                f"{float(want[bad]):g}{_rs_why(out, rank, n, numel)}. Hint: {hint}")
    ring = (n - 1) / n * m
    for rank, (_, written, ops) in enumerate(res):
        if written is None:
            print("(bytes not checked: this machine does not count socket writes)")
            break
        if abs(written - ring) > 0.02 * ring:
            ratio = written / ring
            raise ExerciseError(
                f"rank {rank}: the values are right, but it wrote {written:,} bytes "
                f"({ratio:.2f} × (N-1)/N·M = {ring:,.0f}) using {ops}"
                + (": that is an all-reduce's traffic, which gloo's reduce_scatter "
                   "sends too. Send each rank only its own chunk (all_to_all_single "
                   "or isend/irecv) and add up what arrives"
                   if abs(ratio - 2) < 0.1 else ""))
    print(f"correct: chunk r of the sum on every rank r, and each rank wrote "
          f"{res[0][1]:,} bytes = (N-1)/N·M to within 2% (gloo's reduce_scatter: "
          f"2(N-1)/N·M)")


# ------------------------------------------------------------ bytes per rank

_BYTES_CASES = (("all_reduce", 1e9, 8), ("reduce_scatter", 1e9, 8),
                ("all_gather", 1e9, 8), ("all_reduce", 4 * 2**20, 4),
                ("all_gather", 6e6, 2), ("reduce_scatter", 1e6, 1000))


def check_bytes_per_rank(fn) -> None:
    """Check a student's `fn(op, size, n)`: the bytes each rank sends in the ring
    algorithm of `op` ("all_reduce", "reduce_scatter" or "all_gather") on an array
    of `size` bytes over n ranks."""
    from labkit import theory

    for op, size, n in _BYTES_CASES:
        got = call_answer(fn, op, size, n, what="bytes per rank")
        if got is NOT_WRITTEN:
            return
        want = theory.ring_bytes_per_rank(op, size, n)
        case = f"{op} of S = {size:,.0f} B on N = {n}"
        if isinstance(got, bool) or not isinstance(got, (int, float)):
            raise ExerciseError(f"{case}: expected a number of bytes, got "
                                f"{type(got).__name__} {got!r}")
        # a formula in float64: another order of the same operations differs
        # in the 16th digit; 1e-9 relative absorbs that and nothing else
        if abs(got - want) <= 1e-9 * want:
            continue
        steps = 2 * (n - 1) if op == "all_reduce" else n - 1
        near = {size * steps: f"{steps} steps of the whole array S; each step "
                              "sends one chunk, S/N",
                size * steps / n / 2: "half of it: all-reduce is two phases",
                2 * size * steps / n: "twice too much: only all-reduce has two "
                                      "phases",
                size * (2 if op == "all_reduce" else 1): "the large-N limit; keep "
                                                          "the (N-1)/N"}
        why = next((w for v, w in near.items() if abs(got - v) <= 1e-9 * v), "")
        raise ExerciseError(f"{case}: got {got:,.6g} bytes, expected {want:,.6g}"
                            + (f" ({why})" if why else "")
                            + ". Hint: the ring sends one chunk of S/N per step, "
                            f"{steps} steps")
    print("correct: all-reduce 2(N-1)/N·S, reduce-scatter and all-gather (N-1)/N·S "
          "per rank; with N = 8 and 1 GB: 1.75 GB and 0.875 GB")
