"""Chapter 06's checks: the ZeRO-1 step (reduce-scatter, update the own slice,
all-gather) and ZeRO-2's peak of gradient memory; and `elements_shared`, which
the chapter uses to read off an optimizer which elements of a parameter it
keeps state for."""

from __future__ import annotations

from labkit.checks.common import NOT_YET, PASSED, ExerciseError, run_answer


ZERO1_LR, ZERO1_MOMENTUM = 0.1, 0.9  # the update the ZeRO-1 exercise hands a rank


def elements_shared(p, tensors) -> int:
    """How many of p's elements share storage with one of `tensors` (views of
    one flat buffer, as ShardedOptimizer's slices and its model's parameters
    are): the overlap of their element ranges in that storage."""
    lo, hi = p.storage_offset(), p.storage_offset() + p.numel()
    base = p.untyped_storage().data_ptr()
    return sum(max(0, min(hi, t.storage_offset() + t.numel())
                   - max(lo, t.storage_offset())) for t in tensors
               if t.untyped_storage().data_ptr() == base)


class SliceSGD:
    """SGD with momentum on this rank's slice of a flat vector, as the ZeRO-1
    exercise hands it to a rank: `sgd(p, g)` updates p (s,) in place with the
    averaged gradient g (s,) and keeps the slice's momentum (the state C)."""

    def __init__(self, s: int, dtype=None):
        import torch

        self.s, self.calls = s, 0
        self.momentum = torch.zeros(s, dtype=dtype)

    def __call__(self, p, g) -> None:
        import torch

        for name, t in (("p", p), ("g", g)):
            if tuple(t.shape) != (self.s,):
                raise ValueError(
                    f"sgd({name}=...) got shape {tuple(t.shape)}: it updates this "
                    f"rank's slice only, s = {self.s} elements (a[rank * s:(rank + 1)"
                    " * s] and the averaged gradient of that slice)")
        self.calls += 1
        with torch.no_grad():
            self.momentum.mul_(ZERO1_MOMENTUM).add_(g)
            p.sub_(ZERO1_LR * self.momentum)


def _zero1_data(numel: int, n: int, steps: int):
    """The exercise's flat parameters (padded to n*s, zeros past numel) and every
    rank's gradient at every step: float64, the same in every process."""
    import torch

    s = -(-numel // n)

    def flat(seed):
        x = torch.zeros(n * s, dtype=torch.float64)
        x[:numel] = torch.randn(numel, dtype=torch.float64,
                                generator=torch.Generator().manual_seed(seed))
        return x

    return flat(0), [[flat(1 + k * n + r) for r in range(n)] for k in range(steps)]


def _zero1_worker(rank, world_size, fn, numel, steps):
    from labkit.ledger import traffic

    a, grads = _zero1_data(numel, world_size, steps)
    sgd = SliceSGD(a.numel() // world_size, a.dtype)
    out = []
    for k in range(steps):
        before = sgd.calls
        with traffic() as t:
            fn(rank, world_size, a, grads[k][rank].clone(), sgd)
        out.append({"a": a.clone(), "C": sgd.momentum.clone(),
                    "calls": sgd.calls - before, "ops": {r.op for r in t.records}})
    return out


# The exercise runs in float64 (_zero1_data): the ranks' sums of N gradients in
# another order differ from one process's by a few units of float64 rounding
# (~1e-16 relative, a few steps ~1e-15). 1e-9 of the largest element absorbs that
# a million times over on any CPU and is far below any mistake (a missing
# average, a stale slice: order 1).
def _first_wrong(got, want, rel: float = 1e-9):
    """Index of the first element of `got` that differs from `want`, or None."""
    tol = rel * max(float(want.abs().max()), 1e-12)
    bad = ((got - want).abs() > tol).nonzero()
    return None if len(bad) == 0 else int(bad[0])


def _same(x: float, y: float) -> bool:  # float64, as _first_wrong above
    return abs(x - y) <= 1e-9 * max(1.0, abs(y))


def _zero1_momentum_error(where, rank, i, s, n, got, want, prev, grads, mean):
    """Say what a wrong momentum element was updated with, if we can tell."""
    j = rank * s + i
    used = got - ZERO1_MOMENTUM * prev  # the gradient this element was given
    known = {"the sum over ranks, not the average: divide by world_size (or reduce "
             "with op=ReduceOp.AVG)": n * mean[j],
             "this rank's own gradient, not the average over ranks: reduce-scatter "
             "e first": grads[rank][j]}
    known.update({f"the average of rank {q}'s slice, not of this rank's: keep "
                  "elements [rank*s, (rank+1)*s) of the gradient": mean[q * s + i]
                  for q in range(n) if q != rank})
    why = next((w for w, g in known.items() if _same(used, float(g))), "")
    return ExerciseError(
        f"{where}, tensor C (the momentum of rank {rank}'s slice), element {i} "
        f"(element {j} of the model): got {got:.6g}, expected {want:.6g}"
        + (f"; it was updated with {why}" if why else ""))


def check_zero1_step(cluster, fn, numel: int = 1021, steps: int = 2) -> bool:
    """Check a student's ZeRO-1 step on flat tensors.

    `fn(rank, world_size, a, e, sgd)`: a (N*s,) the parameters, the same on every
    rank, padded with zeros; e (N*s,) this rank's own gradient; sgd(p, g) the
    optimizer of this rank's slice (SliceSGD). It must reduce-scatter e (averaged),
    update a[rank*s:(rank+1)*s] with sgd, and all-gather a, in place. A mistake is
    reported by step, rank, tensor and first wrong element, with what it holds.
    """
    n = cluster.world_size
    res = run_answer(cluster, _zero1_worker, fn, numel, steps,
                     what="reduce-scatter, update and all-gather")
    if res is None:
        return NOT_YET
    a, grads = _zero1_data(numel, n, steps)
    s, c = a.numel() // n, a.new_zeros(a.numel())
    for k in range(steps):
        mean = sum(grads[k]) / n
        prev_a, prev_c = a, c
        c = ZERO1_MOMENTUM * prev_c + mean
        a = prev_a - ZERO1_LR * c
        for rank, got in enumerate(r[k] for r in res):
            where = f"step {k + 1}, rank {rank}"
            if got["calls"] != 1:
                raise ExerciseError(f"{where}: sgd was called {got['calls']} times; "
                                    "call it once a step, on this rank's slice")
            mine = slice(rank * s, (rank + 1) * s)
            i = _first_wrong(got["C"], c[mine])
            if i is not None:
                raise _zero1_momentum_error(
                    where, rank, i, s, n, float(got["C"][i]), float(c[mine][i]),
                    float(prev_c[mine][i]), grads[k], mean)
            j = _first_wrong(got["a"], a)
            if j is not None:
                q, stale = j // s, _same(float(got["a"][j]), float(prev_a[j]))
                why = ("; each rank updates a[rank*s:(rank+1)*s] in place (a "
                       "view of a) with its own slice of the averaged gradient, and "
                       "the all-gather puts the slices back in rank order"
                       if not stale else
                       "; it still holds its value from before the step: this rank's "
                       "own update never reached a" if q == rank else
                       f"; it still holds its value from before the step: the "
                       f"all-gather did not bring rank {q}'s updated slice here")
                raise ExerciseError(
                    f"{where}, tensor a (the parameters), element {j} (in rank {q}'s "
                    f"slice [{q * s}, {(q + 1) * s})): got {float(got['a'][j]):.6g}, "
                    f"expected {float(a[j]):.6g}{why}")
    for rank, r in enumerate(res):
        if any("all_reduce" in st["ops"] for st in r):
            raise ExerciseError(
                f"rank {rank}: the values are right, but it all-reduced the "
                "gradient: each rank needs only its own slice of the average, so "
                "reduce-scatter it: all-reduce then all-gather sends 3(N-1)/N of the "
                "parameters per step, reduce-scatter then all-gather 2(N-1)/N (on "
                "NCCL; gloo's reduce-scatter itself sends all-reduce bytes, which is "
                "why ShardedOptimizer writes it as an all-to-all)")
    print(f"correct: each rank averaged only its slice of the gradient ({s} of "
          f"{n * s} elements), updated it with its own momentum and all-gathered "
          f"the parameters; {steps} steps match one process to 1e-9")
    return PASSED


def _zero2_peak_reference(psi: int, n: int, bucket: int, elem_bytes: int) -> int:
    return elem_bytes * (-(-psi // n) + bucket)


def check_zero2_peak(fn, measured: dict | None = None) -> bool:
    """Check a student's `fn(psi, n, bucket, elem_bytes)`: the peak of the gradient
    bytes one rank holds in ZeRO-2, for psi parameters on n ranks, buckets of
    `bucket` gradient elements (the largest one) and elem_bytes per element.
    `measured` maps (psi, n, bucket, elem_bytes) to the memory ledger's peak
    Gradient on rank 0, held exactly; other sizes are held to the closed form: the
    rank's slice of the averaged gradient, ceil(psi/n) elements, plus one bucket
    of full gradients in flight. The convention asked for is ShardedOptimizer's:
    a bucket is reduced as soon as it is full and waited for (one synchronous
    bucket); a double-buffered answer (two buckets) fails, and is named as such."""
    from labkit.checks.common import NOT_WRITTEN, call_answer

    cases = [(k, v) for k, v in (measured or {}).items()]
    cases += [((k, None)) for k in ((7_500_000_000, 64, 50_000_000, 2),
                                    (1021, 4, 100, 4), (10, 3, 4, 2))]
    for (psi, n, bucket, eb), seen in cases:
        got = call_answer(fn, psi, n, bucket, eb, what="peak_gradient_bytes")
        if got is NOT_WRITTEN:
            return NOT_YET
        where = f"peak_gradient_bytes(psi={psi:,}, n={n}, bucket={bucket:,}, " \
                f"elem_bytes={eb})"
        if isinstance(got, bool) or not isinstance(got, (int, float)):
            raise ExerciseError(f"{where} returned {got!r}, not a number of bytes")
        want = _zero2_peak_reference(psi, n, bucket, eb)
        if seen is not None and got != seen:
            raise ExerciseError(
                f"{where} = {got:,.6g} bytes, but the memory ledger measured a peak "
                f"of {seen:,} bytes of Gradient on rank 0"
                + _zero2_why(fn))
        if abs(got - want) > 1e-9 * want:
            raise ExerciseError(f"{where} = {got:,.6g}, expected {want:,}"
                                + _zero2_why(fn))
    print("correct: a ZeRO-2 rank's gradients peak at its slice, ceil(Ψ/N) elements, "
          "plus one bucket of full gradients in flight"
          + (" — as measured" if measured else ""))
    return PASSED


def _zero2_why(fn) -> str:
    """Name the mistake from fn's answer at sizes where every likely mistake gives
    a different number (the measured sizes do not: there a one-layer bucket and a
    rank's slice are the same size)."""
    psi, n, bucket, eb = 1021, 4, 100, 2
    try:
        got = fn(psi, n, bucket, eb)
    except Exception:  # noqa: BLE001  (the main check reports it)
        return ""
    known = {**dict.fromkeys((eb * -(-psi // n), eb * psi / n, eb * (psi // n)),
                             "that is the slice alone: while backward fills a "
                             "bucket, the full gradients of that bucket are held "
                             "too, until it is reduced"),
             eb * psi: "that is every gradient: ZeRO-2 frees each bucket once it is "
             "sent",
             eb * (-(-psi // n) + 2 * bucket): "that is two buckets: right for a "
             "double-buffered ZeRO-2, which fills the next bucket while one is in "
             "flight; the exercise asks for ShardedOptimizer's, which reduces each "
             "bucket as soon as it is full and waits for it before backward goes "
             "on, so one bucket of full gradients at a time",
             **dict.fromkeys((eb * (psi / n + bucket), eb * (psi // n + bucket)),
                             "close: the slice is ceil(psi/n) elements (the flat "
                             "buffer is padded to n equal slices)"),
             **dict.fromkeys((-(-psi // n) + bucket, psi / n + bucket,
                              psi // n + bucket),
                             "that counts elements: multiply by elem_bytes")}
    for value, why in known.items():
        if isinstance(got, (int, float)) and abs(got - value) <= 1e-9 * value:
            return f"; {why}"
    return (". Hint: this rank's slice of the averaged gradient, plus the one bucket "
            "of full gradients backward is filling")
