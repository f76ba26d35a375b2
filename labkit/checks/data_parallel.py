"""Chapter 05's checks: the bucket flush of overlapped all-reduce, and averaging
shards of different sizes."""

from __future__ import annotations

from labkit.checks.common import NOT_YET, PASSED, ExerciseError, run_answer


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


def _local_grads(x) -> dict:
    """This data's gradients of the small MLP (a mean loss), by parameter name."""
    model = _small_mlp()
    model(x).square().mean().backward()
    return {name: p.grad for name, p in model.named_parameters()}


def _where(got, want, rel: float = 1e-5):
    """Index (a tuple) of the first element that differs, or None."""
    import torch

    tol = rel * max(want.abs().max().item(), 1e-12)
    bad = ((got - want).abs() > tol).reshape(-1).nonzero()
    if len(bad) == 0:
        return None
    flat = int(bad[0])
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), want.shape))


def _close(a, b, rel: float = 1e-5) -> bool:
    return a.shape == b.shape and _where(a, b, rel) is None


def _bucket_flush_worker(rank, world_size, flush):
    from functools import partial

    from labkit.ledger import traffic

    model = _small_mlp()
    named = dict(model.named_parameters())
    ready = [0] * len(_FLUSH_BUCKETS)
    finishes: list = [None] * len(_FLUSH_BUCKETS)

    def on_grad(b, t, param):  # a post-accumulate-grad hook, as DataParallel's
        ready[b] += 1
        if ready[b] == len(_FLUSH_BUCKETS[b]):  # the bucket is full: flush it
            with t.phase(f"bucket {b}"):
                grads = [named[n].grad for n in _FLUSH_BUCKETS[b]]
                finishes[b] = flush(grads, world_size)

    with traffic() as t:
        for b, names in enumerate(_FLUSH_BUCKETS):
            for n in names:
                named[n].register_post_accumulate_grad_hook(partial(on_grad, b, t))
        model(_rows_of(rank, 4)).square().mean().backward()
        returned = [f if f is None else callable(f) for f in finishes]
        if all(returned):
            for finish in finishes:  # backward is over: wait for every bucket
                finish()
    calls = [(r.phase, r.op, r.elements) for r in t.records]
    return {n: p.grad.clone() for n, p in named.items()}, returned, calls


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
    sizes = dict(_small_mlp().named_parameters())
    for rank, (grads, returned, calls) in enumerate(res):
        for b, ok in enumerate(returned):
            if ok is not True:
                raise ExerciseError(
                    f"rank {rank}, bucket {b}: flush returned {ok!r}; it must return "
                    "a function finish() that waits for the all-reduce and writes "
                    "the mean back into the gradients")
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
        for b, names in enumerate(_FLUSH_BUCKETS):
            for name in names:
                want = sum(local[r][name] for r in range(n)) / n
                got = grads[name]
                at = _where(got, want)
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


def _uneven_worker(rank, world_size, sync):
    sizes = _uneven_sizes(world_size)
    model = _small_mlp()
    model(_rows_of(rank, sizes[rank])).square().mean().backward()
    grads = [p.grad for p in model.parameters()]
    sync(grads, sizes[rank], sum(sizes), world_size)
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def check_uneven_shards(cluster, sync) -> bool:
    """Check a student's gradient sync for shards of different sizes.

    Rank r holds n_local examples of a global batch of n_global (4 ranks: 1, 6, 4
    and 2), and its gradients are of its own mean loss. `sync(grads, n_local,
    n_global, world_size)` must leave in each tensor of `grads`, on every rank, the
    gradient of the mean loss over the whole global batch, which the check
    computes here in one process.
    """
    import torch

    n = cluster.world_size
    res = run_answer(cluster, _uneven_worker, sync, what="sync")
    if res is None:
        return NOT_YET
    sizes = _uneven_sizes(n)
    full = _local_grads(torch.cat([_rows_of(r, sizes[r]) for r in range(n)]))
    local = [_local_grads(_rows_of(r, sizes[r])) for r in range(n)]
    for rank, grads in enumerate(res):
        for name, want in full.items():
            got = grads[name]
            at = _where(got, want)
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
            elif _close(got, local[rank][name]):
                why = "that is this rank's own gradient: no all-reduce reached it"
            else:
                why = "weight by n_local / n_global, all-reduce (sum), in place"
            raise ExerciseError(f"{where}; {why}")
    print(f"correct: with shards of {sizes} examples every rank holds the "
          "full-batch gradient")
    return PASSED
