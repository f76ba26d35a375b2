"""Chapter 06's checks: the ZeRO-1 step (reduce-scatter, update the own slice,
all-gather), run on data drawn fresh each run under the traffic ledger and held
to those two collectives; ZeRO-2's peak of gradient memory, on cases drawn fresh
each run and as the memory ledger measured it; and `elements_shared`, which the
chapter uses to read off an optimizer which elements of a parameter it keeps
state for."""

from __future__ import annotations

import random

from labkit.checks.common import (
    NOT_WRITTEN,
    NOT_YET,
    PASSED,
    SHORT_TIMEOUT,
    ExerciseError,
    call_answer,
    finite,
    is_number,
    run_answer,
)
from labkit.checks.verify import fresh_seed, own_calls, refuse_own

ZERO1_LR, ZERO1_MOMENTUM = 0.1, 0.9  # the update the ZeRO-1 exercise hands a rank
# labkit's own ZeRO (its reduce-scatter, buckets, all-gather) and rings
_OWN = ("labkit.parallel.zero", "labkit.parallel.zero_buckets",
        "labkit.parallel.reduce_scatter", "labkit.comm.collectives")


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


def _zero1_data(numel: int, n: int, steps: int, seed: int):
    """The exercise's flat parameters (padded to n*s, zeros past numel) and every
    rank's gradient at every step, drawn from `seed`: float64, the same in every
    process."""
    import torch

    s = -(-numel // n)
    g = torch.Generator().manual_seed(seed)

    def flat():
        x = torch.zeros(n * s, dtype=torch.float64)
        x[:numel] = torch.randn(numel, dtype=torch.float64, generator=g)
        return x

    a = flat()
    return a, [[flat() for _ in range(n)] for _ in range(steps)]


def _zero1_worker(rank, world_size, fn, numel, steps, seed):
    from labkit.ledger import traffic

    a, grads = _zero1_data(numel, world_size, steps, seed)
    sgd = SliceSGD(a.numel() // world_size, a.dtype)
    out = []
    with own_calls(*_OWN) as own:
        for k in range(steps):
            before = sgd.calls
            with traffic() as t:
                fn(rank, world_size, a, grads[k][rank].clone(), sgd)
            out.append({"a": a.clone(), "C": sgd.momentum.clone(),
                        "calls": sgd.calls - before,
                        "ops": [(r.op, r.elements) for r in t.records]})
    return out, list(own)


# The exercise runs in float64 (_zero1_data): the ranks' sums of N gradients in
# another order differ from one process's by a few units of float64 rounding
# (~1e-16 relative, a few steps ~1e-15). 1e-9 of the largest element absorbs that
# a million times over on any CPU and is far below any mistake (a missing
# average, a stale slice: order 1).
def _first_wrong(got, want, rel: float = 1e-9):
    """Index of the first element of `got` that differs from `want` (NaN and inf
    differ from everything), or None."""
    tol = rel * max(float(want.abs().max()), 1e-12)
    bad = (~((got - want).abs() <= tol)).nonzero()
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


def check_zero1_step(cluster, fn, numel: int = 1021, steps: int = 2, *,
                     timeout: float = SHORT_TIMEOUT) -> bool:
    """Check a student's ZeRO-1 step on flat tensors.

    `fn(rank, world_size, a, e, sgd)`: a (N*s,) the parameters, the same on every
    rank, padded with zeros; e (N*s,) this rank's own gradient; sgd(p, g) the
    optimizer of this rank's slice (SliceSGD). It must reduce-scatter e (averaged),
    update a[rank*s:(rank+1)*s] with sgd, and all-gather a, in place. The data is
    drawn fresh each run; each step runs under the traffic ledger. A mistake is
    reported by step, rank, tensor and first wrong element, with what it holds;
    then each rank is held to one reduce-scatter of e (on gloo, an all-to-all and
    a local sum count as one) and one all-gather of a, N*s elements each, and
    nothing else: no all-reduce, no labkit ZeRO.
    """
    n = cluster.world_size
    seed = fresh_seed()
    res = run_answer(cluster, _zero1_worker, fn, numel, steps, seed,
                     what="reduce-scatter, update and all-gather", timeout=timeout)
    if res is None:
        return NOT_YET
    for rank, (_, own) in enumerate(res):
        refuse_own(f"rank {rank}", own, "ZeRO (or ring)")
    a, grads = _zero1_data(numel, n, steps, seed)
    s, c = a.numel() // n, a.new_zeros(a.numel())
    for k in range(steps):
        mean = sum(grads[k]) / n
        prev_a, prev_c = a, c
        c = ZERO1_MOMENTUM * prev_c + mean
        a = prev_a - ZERO1_LR * c
        for rank, got in enumerate(r[0][k] for r in res):
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
    for rank, (r, _) in enumerate(res):
        for k, st in enumerate(r):
            _zero1_calls(f"step {k + 1}, rank {rank}: the values are right, but",
                         st["ops"], n, s)
    print(f"correct: on data drawn this run, each rank averaged only its slice of "
          f"the gradient ({s} of {n * s} elements), updated it with its own momentum "
          f"and all-gathered the parameters; {steps} steps match one process to "
          f"1e-9; measured on every rank, each step: one reduce-scatter of e and "
          f"one all-gather of a, {n * s} elements each, nothing else")
    return PASSED


def _zero1_calls(where: str, calls, n: int, s: int) -> None:
    """One step's collectives: a reduce-scatter of e, an all-gather of a."""
    ops = [op for op, _ in calls if op != "barrier"]
    scattered = sum(k for op, k in calls if op in ("reduce_scatter", "all_to_all"))
    gathered = sum(k for op, k in calls if op == "all_gather")
    if "all_reduce" in ops:
        raise ExerciseError(
            f"{where} it all-reduced: each rank needs only its own slice of the "
            "averaged gradient, so reduce-scatter it: all-reduce then all-gather "
            "sends 3(N-1)/N of the parameters per step, reduce-scatter then "
            "all-gather 2(N-1)/N (on NCCL; gloo's reduce-scatter itself sends "
            "all-reduce bytes, which is why ShardedOptimizer writes it as an "
            "all-to-all)")
    by_hand = sorted({op for op in ops if op in ("reduce", "broadcast")})
    if by_hand:
        raise ExerciseError(
            f"{where} it called {by_hand}: section 3's steward picture by hand (a "
            "reduce to each steward, a broadcast from each); the exercise asks for "
            "the two collectives they add up to, one reduce-scatter of e "
            "(dist.reduce_scatter_single) and one all-gather of a "
            "(dist.all_gather_single)")
    other = sorted(set(ops) - {"reduce_scatter", "all_to_all", "all_gather"})
    if other:
        raise ExerciseError(
            f"{where} it called {other}; a ZeRO-1 step is one reduce-scatter of "
            "the gradient and one all-gather of the parameters")
    if not scattered and gathered > n * s:
        raise ExerciseError(
            f"{where} it all-gathered {gathered:,} elements, every rank's whole "
            f"gradient as well as a: each rank needs only its slice of the average, "
            "which a reduce-scatter brings it for 1/N of those bytes")
    if scattered != n * s:
        raise ExerciseError(
            f"{where} its reduce-scatter carried {scattered:,} elements; it takes "
            f"all of e, N·s = {n * s:,} elements, once a step"
            + (" (it made none)" if not scattered else ""))
    if gathered != n * s:
        raise ExerciseError(
            f"{where} its all-gather carried {gathered:,} elements; it fills all "
            f"of a, N·s = {n * s:,} elements, once a step"
            + (" (it made none)" if not gathered else ""))


# ---------------------------------------------------- ZeRO-2's gradient peak

_OWN_PEAK = ("labkit.theory.zero", "labkit.parallel.zero_buckets",
             "labkit.parallel.buckets", "labkit.checks.zero:_buckets",
             "labkit.checks.zero:_zero2_peak")


def _buckets(numels, cap: int) -> list[int]:
    """The elements of each bucket DDP's rule fills from `numels` (in order; a
    bucket closes once it holds at least `cap` elements, the last one as it is),
    found from the running total: a bucket ends where the total since the last
    end first reaches cap."""
    out, start, total = [], 0, 0
    for k in numels:
        total += k
        if total - start >= cap:
            out.append(total - start)
            start = total
    if total > start:
        out.append(total - start)
    return out


def _zero2_peak(numels, n: int, cap: int, elem_bytes: int) -> int:
    """A ZeRO-2 rank's gradient bytes at their peak: its slice of the averaged
    gradient, ceil(psi/n) elements (held throughout backward), plus the full
    gradients of the largest bucket, which it holds while backward fills it."""
    return elem_bytes * (-(-sum(numels) // n) + max(_buckets(numels, cap)))


def _peak_cases(seed: int) -> list[tuple[tuple[int, ...], int, int, int]]:
    # first a case where each usual mistake gives its own number
    cases = [((30, 300, 250, 400, 40, 380, 300, 320, 400, 390, 10, 350, 90), 3,
              1000, 2)]
    rng = random.Random(seed)
    for _ in range(6):
        layers = rng.randint(2, 8)
        numels = []
        for _ in range(layers):  # a layer: its bias, then its weight (backward)
            a, b = rng.randint(8, 600), rng.randint(8, 600)
            numels += [b, a * b]
        cap = rng.randint(max(numels) // 2, 3 * max(numels))
        cases.append((tuple(numels), rng.choice([2, 3, 4, 8, 64]), cap,
                      rng.choice([2, 4])))
    return cases


def _peak_where(numels, n, cap, eb) -> str:
    return (f"peak_gradient_bytes({_short(list(numels))}, n={n}, bucket={cap:,}, "
            f"elem_bytes={eb})")


def check_zero2_peak(fn, measured: dict | None = None) -> bool:
    """Check a student's `fn(tensor_numels, n, bucket, elem_bytes)`: the most
    gradient bytes one ZeRO-2 rank holds, for gradients of these sizes (elements,
    in the order backward produces them) on n ranks, buckets filled by DDP's rule
    (whole tensors, in order; a bucket closes once it holds at least `bucket`
    elements) and elem_bytes per element: its slice of the averaged gradient,
    ceil(sum/n) elements, plus the full gradients of the largest bucket. Cases
    are drawn fresh each run; `measured` maps (tensor_numels, n, bucket,
    elem_bytes) to the memory ledger's peak of Gradient on rank 0, held exactly.
    labkit's bucket builders and ZeRO formulas are refused."""
    cases = [(tuple(k[0]), *k[1:], seen) for k, seen in (measured or {}).items()]
    cases += [(*case, None) for case in _peak_cases(fresh_seed())]
    for numels, n, cap, eb, seen in cases:
        where = _peak_where(numels, n, cap, eb)
        with own_calls(*_OWN_PEAK) as own:
            got = call_answer(fn, list(numels), n, cap, eb,
                              what="peak_gradient_bytes")
        refuse_own(where, own, "bucket builder or ZeRO formula (or this check's "
                   "reference)")
        if got is NOT_WRITTEN:
            return NOT_YET
        if not is_number(got):
            raise ExerciseError(f"{where} returned {got!r}, not a number of bytes")
        finite(where, got)
        want = _zero2_peak(numels, n, cap, eb)
        if seen is not None and got != seen:
            raise ExerciseError(
                f"{where} = {got:,.6g} bytes, but the memory ledger measured a peak "
                f"of {seen:,} bytes of Gradient on rank 0"
                + _zero2_why(numels, n, cap, eb, got))
        if not abs(got - want) <= 1e-9 * want:
            raise ExerciseError(f"{where} = {got:,.6g} bytes, expected {want:,}"
                                + _zero2_why(numels, n, cap, eb, got))
    seen = len(measured or {})
    print(f"correct on {len(cases) - seen} cases drawn this run"
          + (f" and the {seen} the memory ledger measured" if seen else "")
          + ": a ZeRO-2 rank's gradients peak at its slice, ceil(Ψ/N) elements, "
          "plus the largest bucket DDP's rule makes, whole")
    return PASSED


def _rule_variants(numels, cap: int) -> dict[str, list[int]]:
    """The buckets a mistaken rule makes: closing only above the cap, never
    exceeding it, filled from the other end."""
    strict, at_most, held = [], [], None
    for k in numels:
        if held is None or sum(held) > cap:
            held = []
            strict.append(held)
        held.append(k)
    held = None
    for k in numels:
        if held is None or sum(held) + k > cap:
            held = []
            at_most.append(held)
        held.append(k)
    return {"strict": [sum(b) for b in strict], "at_most": [sum(b) for b in at_most],
            "reversed": _buckets(list(reversed(numels)), cap)}


def _zero2_why(numels, n: int, cap: int, eb: int, got: float) -> str:
    """Name the mistake: what the answer equals at this case."""
    psi, s = sum(numels), -(-sum(numels) // n)
    buckets = _buckets(numels, cap)
    big = max(buckets)
    rules = _rule_variants(numels, cap)
    known = [
        (eb * (s + cap), "that is the slice plus the cap: a bucket closes once it "
                         "holds AT LEAST `bucket` elements, so the tensor that "
                         "crosses the line stays in it and a bucket can be larger "
                         "than the cap; the largest bucket is what counts"),
        (eb * (s + 2 * big), "that is two of the largest bucket: right for a "
                             "double-buffered ZeRO-2, which fills the next bucket "
                             "while one is in flight; the exercise asks for "
                             "ShardedOptimizer's, which reduces each bucket as "
                             "soon as it is full and waits for it, so one bucket "
                             "of full gradients at a time"),
        (eb * (s + buckets[0]), "that is the slice plus the first bucket; every "
                                "bucket is held whole in turn: the largest counts"),
        (eb * (s + buckets[-1]), "that is the slice plus the last bucket; every "
                                 "bucket is held whole in turn: the largest counts"),
        (eb * (s + max(numels)), "that is the slice plus the largest tensor: a "
                                 "bucket holds whole tensors until it reaches the "
                                 "cap, often several"),
        (eb * (s + max(rules["strict"])), "that is the largest bucket if a bucket "
                                          "closed only ABOVE the cap: it closes "
                                          "once it holds at least `bucket`"),
        (eb * (s + max(rules["at_most"])), "that is the largest bucket if buckets "
                                           "never exceeded the cap: the tensor "
                                           "that crosses it stays in the bucket"),
        (eb * (s + max(rules["reversed"])), "that is the buckets filled from the "
                                            "other end: tensor_numels is already "
                                            "in the order backward produces them"),
        (eb * s, "that is the slice alone: while backward fills a bucket, its "
                 "full gradients are held too, until it is reduced"),
        (eb * psi / n, "that is the slice alone (and not rounded up): while "
                       "backward fills a bucket, its full gradients are held too"),
        (eb * psi, "that is every gradient: ZeRO-2 frees each bucket once it is "
                   "sent"),
        (eb * (psi / n + big), "close: the slice is ceil(psi/n) elements (the flat "
                               "buffer is padded to n equal slices)"),
        (eb * (psi // n + big), "close: the slice is ceil(psi/n) elements (the "
                                "flat buffer is padded to n equal slices)"),
        (s + big, "that counts elements: multiply by elem_bytes"),
    ]
    for value, why in known:
        if abs(got - value) <= 1e-9 * value:
            return f"; {why}"
    return (". Hint: this rank's slice of the averaged gradient, plus the largest "
            "bucket of full gradients backward fills (buckets by chapter 05's rule)")


def _short(numels: list) -> str:
    text = repr(numels)
    return text if len(text) <= 60 else text[:57] + "...]"
