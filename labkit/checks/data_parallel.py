"""Chapter 05's checks that run ranks: the bucket flush of overlapped all-reduce
and averaging shards of different sizes. The arithmetic exercises (a parameter
server's bytes, how many buckets a step makes) are in data_parallel_arithmetic,
and importable from here too."""

from __future__ import annotations

from contextlib import contextmanager

from labkit.checks.common import (
    NOT_YET,
    PASSED,
    ExerciseError,
    first_wrong,
    rounding_tolerance,
    run_answer,
)
from labkit.checks.data_parallel_arithmetic import (
    check_bucket_count,
    check_bytes_per_step,
)

__all__ = ["check_bucket_count", "check_bucket_flush", "check_bytes_per_step",
           "check_uneven_shards"]


_FLUSH_BUCKETS = (("2.bias", "2.weight"), ("0.bias", "0.weight"))  # backward order


def _small_mlp():
    import torch

    torch.manual_seed(0)  # the same weights on every rank and in the kernel
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(),
                               torch.nn.Linear(5, 3))


def _rows_of(rank: int, n: int, seed: int = 7):
    import torch

    g = torch.Generator().manual_seed(seed + rank)
    return torch.randn(n, 6, generator=g)


def _local_grads(x, dtype: str = "float32") -> dict:
    """This data's gradients of the small MLP (a mean loss), by parameter name, in
    float32 (what a rank computes) or float64 (the exact answer)."""
    import torch

    to = getattr(torch, dtype)
    model = _small_mlp().to(to)
    model(x.to(to)).square().mean().backward()
    return {name: p.grad for name, p in model.named_parameters()}


def _where(got, want, exact):
    """Index (a tuple) of the first element of `got` farther from `exact` (the
    float64 answer) than the float32 reference `want` rounds, or None: the ranks
    add in another order than one process, and round as much (labkit.numerics)."""
    return first_wrong(got, exact, atol=rounding_tolerance(want, exact))


# The hints only name a mistake already found: `_close` recognises one within
# this much of the largest element, far above rounding (~1e-7) and far below
# what tells the mistakes apart (a factor n, one rank's gradient: ~1e-1).
DIAGNOSIS_REL = 1e-4


def _close(a, b) -> bool:
    """A diagnosis, not a pass criterion: `a` is `b` up to DIAGNOSIS_REL of b's
    largest element."""
    tol = DIAGNOSIS_REL * max(b.abs().max().item(), 1e-12)
    return a.shape == b.shape and bool(((a - b).abs() <= tol).all())


def _bucket_flush_worker(rank, world_size, flush):
    from functools import partial

    from labkit.ledger import traffic

    model = _small_mlp()
    named = dict(model.named_parameters())
    ready = [0] * len(_FLUSH_BUCKETS)
    finishes: list = [None] * len(_FLUSH_BUCKETS)
    started: list = [None] * len(_FLUSH_BUCKETS)  # async_op of each all-reduce

    def on_grad(b, t, param):  # a post-accumulate-grad hook, as DataParallel's
        ready[b] += 1
        if ready[b] == len(_FLUSH_BUCKETS[b]):  # the bucket is full: flush it
            with t.phase(f"bucket {b}"), _async_flags() as flags:
                grads = [named[n].grad for n in _FLUSH_BUCKETS[b]]
                finishes[b] = flush(grads, world_size)
            started[b] = flags

    with traffic() as t:
        for b, names in enumerate(_FLUSH_BUCKETS):
            for n in names:
                named[n].register_post_accumulate_grad_hook(partial(on_grad, b, t))
        model(_rows_of(rank, 4)).square().mean().backward()
        returned = [True if callable(f) else type(f).__name__ for f in finishes]
        if all(r is True for r in returned):
            for finish in finishes:  # backward is over: wait for every bucket
                finish()
    calls = [(r.phase, r.op, r.elements) for r in t.records]
    return {n: p.grad.clone() for n, p in named.items()}, returned, calls, started


@contextmanager
def _async_flags():
    """Note, for each dist.all_reduce called inside, whether it was asynchronous
    (async_op=True): a flush that waits would hide nothing under backward."""
    import torch.distributed as dist

    flags, real = [], dist.all_reduce

    def recording(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        flags.append(bool(async_op))
        return real(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = recording
    try:
        yield flags
    finally:
        dist.all_reduce = real


def check_bucket_flush(cluster, flush) -> bool:
    """Check a student's bucket flush, the heart of bucketed all-reduce.

    `flush(grads, world_size)` is called during backward as soon as every gradient
    of a bucket is ready. It must start one asynchronous all-reduce of the bucket's
    gradients flattened into one tensor, and return a function `finish()` that,
    called after backward, waits for it and leaves in each tensor of `grads` its
    mean over the ranks. The check runs it on the cluster's ranks (a small MLP,
    two buckets, different data on every rank) and compares every gradient with
    the mean of the ranks' gradients computed here, in one process.
    """
    n = cluster.world_size
    res = run_answer(cluster, _bucket_flush_worker, flush, what="flush")
    if res is None:
        return NOT_YET
    local = [_local_grads(_rows_of(r, 4)) for r in range(n)]
    local64 = [_local_grads(_rows_of(r, 4), "float64") for r in range(n)]
    sizes = dict(_small_mlp().named_parameters())
    for rank, (grads, returned, calls, started) in enumerate(res):
        for b, ok in enumerate(returned):
            if ok is not True:
                raise ExerciseError(
                    f"rank {rank}, bucket {b}: flush returned {ok}, not a function; "
                    "it must return a function finish() that waits for the "
                    "all-reduce and writes the mean back into the gradients")
        for b, names in enumerate(_FLUSH_BUCKETS):
            mine = [(op, k) for phase, op, k in calls if phase == f"bucket {b}"]
            numel = sum(sizes[name].numel() for name in names)
            if [op for op, _ in mine] != ["all_reduce"]:
                raise ExerciseError(
                    f"rank {rank}, bucket {b} ({', '.join(names)}): flush made "
                    f"{[op for op, _ in mine] or 'no collective'}; a bucket goes as "
                    "ONE all_reduce of its gradients flattened into one tensor "
                    "(torch.cat of g.reshape(-1)), started in flush, not in finish")
            if mine[0][1] != numel:
                raise ExerciseError(
                    f"rank {rank}, bucket {b}: the all-reduce carried {mine[0][1]} "
                    f"elements, but the bucket's gradients hold {numel}")
            if False in started[b]:  # (calls we could not see are let be)
                raise ExerciseError(
                    f"rank {rank}, bucket {b} ({', '.join(names)}): flush waited for "
                    "its all-reduce (called without async_op=True), so backward "
                    "stopped until the bytes arrived and nothing was overlapped. "
                    "Start it with dist.all_reduce(flat, async_op=True), keep the "
                    "work it returns, and call work.wait() in finish()")
        for b, names in enumerate(_FLUSH_BUCKETS):
            for name in names:
                want = sum(local[r][name] for r in range(n)) / n
                exact = sum(local64[r][name] for r in range(n)) / n
                got = grads[name]
                at = _where(got, want, exact)
                if at is None:
                    continue
                where = (f"rank {rank}, bucket {b}, tensor {name!r}, element "
                         f"{list(at)}: got {got[at].item():.6g}, expected the mean "
                         f"over ranks {want[at].item():.6g}")
                if _close(got, n * want):
                    why = f"that is {n}x the mean: divide the sum by world_size"
                elif _close(got, local[rank][name]):
                    why = ("that is this rank's own gradient: the mean never "
                           "reached it. In finish, wait, then copy each slice of "
                           "the flat result back into its tensor in place "
                           "(g.copy_(...)), in the order you flattened them")
                else:
                    why = ("check that you split the flat tensor back in the order "
                           "you flattened it, with each tensor's numel and shape")
                raise ExerciseError(f"{where}; {why}")
    print(f"correct: every bucket went as one all-reduce during backward, and all "
          f"{n} ranks hold the mean gradient in every tensor")
    return PASSED


def _uneven_sizes(n: int) -> list[int]:
    return [1 + (5 * r) % 7 for r in range(n)]  # 4 ranks: 1, 6, 4, 2 examples


def _uneven_worker(rank, world_size, sync, total_known=True):
    from labkit.ledger import traffic

    sizes = _uneven_sizes(world_size)
    model = _small_mlp()
    model(_rows_of(rank, sizes[rank])).square().mean().backward()
    grads = [p.grad for p in model.parameters()]
    with traffic() as t:
        if total_known:
            sync(grads, sizes[rank], sum(sizes), world_size)
        else:  # each rank knows only its own count
            sync(grads, sizes[rank], world_size)
    reduced = any(r.op == "all_reduce" for r in t.records)
    return {n: p.grad.clone() for n, p in model.named_parameters()}, reduced


def check_uneven_shards(cluster, sync, total_known: bool = True) -> bool:
    """Check a student's gradient sync for shards of different sizes.

    Rank r holds n_local examples of a global batch of n_global (4 ranks: 1, 6, 4
    and 2), and its gradients are of its own mean loss. `sync(grads, n_local,
    n_global, world_size)` must leave in each tensor of `grads`, on every rank, the
    gradient of the mean loss over the whole global batch, which the check
    computes here in one process. total_known=False: the ranks are not told
    n_global, `sync(grads, n_local, world_size)` must find it (an all-reduce of
    the counts) before it weights.
    """
    import torch

    n = cluster.world_size
    res = run_answer(cluster, _uneven_worker, sync, total_known, what="sync")
    if res is None:
        return NOT_YET
    sizes = _uneven_sizes(n)
    everything = torch.cat([_rows_of(r, sizes[r]) for r in range(n)])
    full = _local_grads(everything)
    full64 = _local_grads(everything, "float64")
    local = [_local_grads(_rows_of(r, sizes[r])) for r in range(n)]
    for rank, (grads, reduced) in enumerate(res):
        for name, want in full.items():
            got = grads[name]
            at = _where(got, want, full64[name])
            if at is None:
                continue
            plain = sum(g[name] for g in local) / n
            where = (f"rank {rank} (holding {sizes[rank]} of {sum(sizes)} examples), "
                     f"tensor {name!r}, element {list(at)}: got {got[at].item():.6g}, "
                     f"expected the full-batch gradient {want[at].item():.6g}")
            if _close(got, plain):
                why = ("that is the plain mean of the ranks' gradients, right only "
                       "for equal shards: weight each rank's gradient by its share "
                       "of the batch, n_local / n_global, then sum")
            elif _close(got, n * plain):
                why = ("that is the plain sum of the ranks' gradients: weight each "
                       "rank's gradient by n_local / n_global before the sum")
            elif _close(got, want / n):
                why = (f"that is 1/{n} of it: the weighted sum is already the mean, "
                       "so do not divide by world_size as well")
            elif _close(got, local[rank][name]) and reduced:
                why = ("that is this rank's own gradient: your all-reduce ran, but "
                       "not on these tensors. Change each gradient in place "
                       "(g.mul_(...), dist.all_reduce(g)); g = g * w makes a new "
                       "tensor the model never sees")
            elif _close(got, local[rank][name]):
                why = "that is this rank's own gradient: no all-reduce reached it"
            elif not total_known and _close(got, want * sum(sizes)
                                            / (n * sizes[rank])):
                why = (f"that is the weighting with B = world_size × n_local = "
                       f"{n * sizes[rank]}: the shards differ, so no rank can "
                       "compute B from its own count; all-reduce the counts "
                       "(a one-element tensor) to find it")
            elif not total_known:
                why = ("find B = the sum of every rank's n_local (an all-reduce of "
                       "a one-element tensor), weight by n_local / B, all-reduce "
                       "the gradients (sum), in place")
            else:
                why = "weight by n_local / n_global, all-reduce (sum), in place"
            raise ExerciseError(f"{where}; {why}")
    print(f"correct: with shards of {sizes} examples every rank holds the "
          "full-batch gradient")
    return PASSED
