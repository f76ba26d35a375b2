"""Chapter 05's checks that run ranks: the bucket flush of overlapped all-reduce,
and the full-batch gradient from shards of different sizes when no rank is told
the batch's size. Both run on a model, data and shard sizes drawn fresh each
run, under the traffic ledger, and are held to the collectives the exercise
asks for. The arithmetic exercises are in data_parallel_arithmetic (importable
from here too)."""

from __future__ import annotations

import random

from labkit.checks.common import (
    NOT_YET,
    PASSED,
    SHORT_TIMEOUT,
    ExerciseError,
    first_wrong,
    rounding_tolerance,
    run_answer,
)
from labkit.checks.data_parallel_arithmetic import (
    check_bucket_count,
    check_bytes_per_step,
)
from labkit.checks.verify import fresh_seed, own_calls, refuse_own

__all__ = ["check_bucket_count", "check_bucket_flush", "check_bytes_per_step",
           "check_uneven_shards"]

# labkit's own data parallelism (buckets, packing) and rings: never the answer
_OWN = ("labkit.parallel.data_parallel", "labkit.parallel.buckets",
        "labkit.comm.collectives")
_FLUSH_BUCKETS = (("2.bias", "2.weight"), ("0.bias", "0.weight"))  # backward order


def _small_mlp(seed: int):
    """Linear(6, 5), Tanh, Linear(5, 3) with weights drawn from `seed` (uniform
    in [-1, 1)): the same model on every rank and in the kernel."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(),
                                torch.nn.Linear(5, 3))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.rand(p.shape, generator=g) * 2 - 1)
    return model


def _rows_of(seed: int, rank: int, n: int):
    import torch

    g = torch.Generator().manual_seed(seed + 1 + rank)
    return torch.randn(n, 6, generator=g)


def _local_grads(seed: int, x, dtype: str = "float32") -> dict:
    """The small MLP's gradients of a mean loss over the rows x, by parameter
    name, in float32 (what a rank computes) or float64 (the exact answer)."""
    import torch

    to = getattr(torch, dtype)
    model = _small_mlp(seed).to(to)
    model(x.to(to)).square().mean().backward()
    return {name: p.grad for name, p in model.named_parameters()}


def _where(got, want, exact, terms):
    """Index (a tuple) of the first element of `got` farther from `exact` (the
    float64 answer) than the float32 reference `want` rounds, or None (NaN is
    wrong): the ranks add in another order than one process, and round as much.
    `terms`: the tensors summed into it (each rank's gradient), whose rounding
    a right answer carries where they cancel."""
    scale = max(t.detach().double().abs().max().item() for t in terms)
    return first_wrong(got, exact, atol=rounding_tolerance(want, exact, scale))


# The hints only name a mistake already found: `_close` recognises one within
# this much of the largest element, far above rounding (~1e-7) and far below
# what tells the mistakes apart (a factor n, one rank's gradient: ~1e-1).
DIAGNOSIS_REL = 1e-4


def _close(a, b) -> bool:
    """A diagnosis, not a pass criterion: `a` is `b` up to DIAGNOSIS_REL of b's
    largest element."""
    tol = DIAGNOSIS_REL * max(b.abs().max().item(), 1e-12)
    return a.shape == b.shape and bool(((a - b).abs() <= tol).all())


def _plural(k: int, word: str) -> str:
    return f"{k} {word}" + ("" if k == 1 else "s")


# ---------------------------------------------------------------- bucket flush

# A flush that does not wait returns in microseconds; the other ranks give it
# this long before they conclude it is blocked in its all-reduce (which cannot
# complete: they have not started theirs), and then start theirs so it can go on.
_FLUSH_RETURNS_WITHIN = 2.0  # seconds
# How long the other ranks hold back their all-reduce while the leader runs
# finish(): a finish that returns in that time did not wait for the result.
_FINISH_HELD = 0.5  # seconds


def _bucket_flush_worker(rank, world_size, flush, seed, timeout):
    """Two passes. The first, in backward as DataParallel runs it, under the
    traffic ledger (which completes each collective before the next: bytes, not
    overlap). The second on plain whole-number tensors, without the ledger, where
    rank 0 flushes and finishes while the others hold back their all-reduce."""
    from functools import partial

    from labkit.ledger import traffic

    model = _small_mlp(seed)
    named = dict(model.named_parameters())
    ready = [0] * len(_FLUSH_BUCKETS)
    finishes: list = [None] * len(_FLUSH_BUCKETS)

    def on_grad(b, t, param):  # a post-accumulate-grad hook, as DataParallel's
        ready[b] += 1
        if ready[b] == len(_FLUSH_BUCKETS[b]):  # the bucket is full: flush it
            with t.phase(f"bucket {b}"):
                finishes[b] = flush([named[n].grad for n in _FLUSH_BUCKETS[b]],
                                    world_size)

    with own_calls(*_OWN) as own:
        with traffic() as t:
            for b, names in enumerate(_FLUSH_BUCKETS):
                for n in names:
                    named[n].register_post_accumulate_grad_hook(partial(on_grad, b, t))
            model(_rows_of(seed, rank, 4)).square().mean().backward()
            returned = [True if callable(f) else type(f).__name__ for f in finishes]
            if all(r is True for r in returned):
                for finish in finishes:  # backward is over: wait for every bucket
                    with t.phase("finish"):
                        finish()
        probe = (_async_probe(rank, world_size, flush, seed, timeout)
                 if all(r is True for r in returned) and not own else None)
    calls = [(r.phase, r.op, r.elements, r.payload_bytes) for r in t.records]
    return ({n: p.grad.clone() for n, p in named.items()}, returned, calls, probe,
            list(own))


def _probe_grads(seed: int, rank: int):
    """Two tensors of whole numbers in [1, 1000): their sum over the ranks is
    exact in float32 in any order, and so is its quotient by 4 ranks."""
    import torch

    g = torch.Generator().manual_seed(seed + 101 + rank)
    return [torch.randint(1, 1000, shape, generator=g).float()
            for shape in ((5,), (3, 4))]


def _appears(store, key: str, seconds: float) -> bool:
    """Whether `key` is set in the store within `seconds` (polled: a store's own
    timed wait prints a warning on every timeout)."""
    import time

    end = time.monotonic() + seconds
    while not store.check([key]):
        if time.monotonic() > end:
            return False
        time.sleep(0.002)
    return True


def _async_probe(rank, world_size, flush, seed, timeout):
    """Rank 0 calls flush and finish while the other ranks have not yet started
    their all-reduce, which therefore cannot complete: a flush that returns did
    not wait for it, a finish that returns did not wait either. Told through the
    ranks' store, with timeouts, so that neither mistake is a deadlock."""
    import torch.distributed as dist

    store = dist.PrefixStore(f"labkit/checks/flush/{seed}",
                             dist.distributed_c10d._get_default_store())
    grads = _probe_grads(seed, rank)
    waited_in_flush = finish_early = False
    if rank == 0:
        store.set("flush", "1")
        finish = flush(grads, world_size)
        store.set("flushed", "1")
        if callable(finish):
            finish()
        store.set("finished", "1")
    else:
        if not _appears(store, "flush", timeout - 1):
            return None  # rank 0 is stuck before it (pass 1): let the timeout say so
        # rank 0 blocked in flush: its all-reduce waits for ours
        waited_in_flush = not _appears(store, "flushed", _FLUSH_RETURNS_WITHIN)
        # finish returned before our all-reduce began: it did not wait
        finish_early = (not waited_in_flush
                        and _appears(store, "finished", _FINISH_HELD))
        finish = flush(grads, world_size)
        if callable(finish):
            finish()
    return [t.clone() for t in grads], waited_in_flush, finish_early


def check_bucket_flush(cluster, flush, *, timeout: float = SHORT_TIMEOUT) -> bool:
    """Check a student's bucket flush, the heart of bucketed all-reduce.

    `flush(grads, world_size)` is called during backward as soon as every gradient
    of a bucket is ready. It must start ONE asynchronous all-reduce of the
    bucket's gradients flattened into one tensor, not wait for it, and return a
    function `finish()` that, called after backward, waits for it and leaves in
    each tensor of `grads` its mean over the ranks. The check runs it on the
    ranks (a small MLP drawn fresh, two buckets, different data on every rank)
    under the traffic ledger: one all-reduce per bucket, of the bucket's bytes,
    started in flush; then once more with rank 0 flushing and finishing before
    the others have started their all-reduce, so that a flush that waits, or a
    finish that does not, shows; and compares every gradient with the mean of
    the ranks' gradients computed here, in one process.
    """
    n = cluster.world_size
    seed = fresh_seed()
    res = run_answer(cluster, _bucket_flush_worker, flush, seed, timeout, what="flush",
                     timeout=timeout + _FLUSH_RETURNS_WITHIN + _FINISH_HELD)
    if res is None:
        return NOT_YET
    sizes = {k: p.numel() for k, p in _small_mlp(seed).named_parameters()}
    for rank, (_, returned, calls, _, own) in enumerate(res):
        refuse_own(f"rank {rank}", own, "data parallelism (or ring)")
        for b, ok in enumerate(returned):
            if ok is not True:
                raise ExerciseError(
                    f"rank {rank}, bucket {b}: flush returned {ok}, not a function; "
                    "it must return a function finish() that waits for the "
                    "all-reduce and writes the mean back into the gradients")
        _flush_calls(rank, calls, sizes)
    _flush_waits(res)
    _flush_values(res, seed, n)
    numels = [sum(sizes[k] for k in names) for names in _FLUSH_BUCKETS]
    print(f"correct: measured on every rank, each bucket went as one all-reduce of "
          f"its gradients ({' and '.join(f'{4 * k} bytes' for k in numels)}), "
          "started in flush, which returned before the other ranks had started "
          "theirs (so it did not wait), and finish waited for it; all "
          f"{n} ranks hold the mean gradient in every tensor")
    return PASSED


def _flush_calls(rank: int, calls, sizes: dict) -> None:
    """Each bucket: exactly one all-reduce, made in flush, of the bucket's
    elements in float32; nothing in finish."""
    for b, names in enumerate(_FLUSH_BUCKETS):
        mine = [(op, k, nbytes) for phase, op, k, nbytes in calls
                if phase == f"bucket {b}"]
        ops = [op for op, _, _ in mine]
        numel = sum(sizes[name] for name in names)
        where = f"rank {rank}, bucket {b} ({', '.join(names)})"
        if not ops:
            late = sorted({op for phase, op, _, _ in calls if phase == "finish"})
            raise ExerciseError(
                f"{where}: flush made no collective" + (
                    f" (finish made {late})" if late else "") + "; flush must "
                "START the bucket's all-reduce (async_op=True) during backward, "
                "so that it travels while backward computes the layers before; "
                "finish only waits for it")
        if ops.count("all_reduce") > 1 and set(ops) == {"all_reduce"}:
            raise ExerciseError(
                f"{where}: flush made {_plural(len(ops), 'all-reduce')}, one per "
                "tensor; a bucket goes as ONE all_reduce of its gradients "
                "flattened into one tensor (torch.cat of g.reshape(-1)): one "
                "message's latency instead of one per tensor")
        if ops != ["all_reduce"]:
            raise ExerciseError(
                f"{where}: flush made {ops}; a bucket goes as ONE all_reduce (a "
                "sum over the ranks) of its gradients flattened into one tensor")
        _, k, nbytes = mine[0]
        if k != numel:
            raise ExerciseError(
                f"{where}: the all-reduce carried {k} elements, but the bucket's "
                f"gradients hold {numel} ({' + '.join(str(sizes[x]) for x in names)}"
                "): flatten every gradient of the bucket, each once")
        if nbytes != 4 * numel:
            raise ExerciseError(
                f"{where}: the all-reduce carried {nbytes} bytes for {numel} "
                f"elements, {nbytes // numel} bytes each; the gradients are "
                f"float32, 4 bytes each, {4 * numel} bytes: keep their dtype")
    after = sorted({op for phase, op, _, _ in calls if phase == "finish"})
    if after:
        raise ExerciseError(
            f"rank {rank}: finish made {after}; the all-reduce was started in "
            "flush, so finish only waits for it (work.wait()) and copies the "
            "mean back")


def _flush_waits(res) -> None:
    """The second pass: what rank 0's flush and finish did while the others had
    not started their all-reduce."""
    probes = [r[3] for i, r in enumerate(res) if i and r[3] is not None]
    if not probes:
        return
    _, waited_in_flush, finish_early = probes[0]
    if waited_in_flush:
        raise ExerciseError(
            f"rank 0: flush did not return within {_FLUSH_RETURNS_WITHIN:g} s while "
            "the other ranks had not yet started their all-reduce: it waits for "
            "it (dist.all_reduce without async_op=True, or work.wait() inside "
            "flush), so backward stops until the bytes arrive and nothing is "
            "overlapped. Start it with work = dist.all_reduce(flat, "
            "async_op=True), keep `work`, and call work.wait() in finish()")
    if finish_early:
        raise ExerciseError(
            "rank 0: finish() returned while the other ranks had not yet started "
            "their all-reduce, so the result could not have arrived: finish must "
            "wait for the all-reduce (work.wait()) before it reads the sum")


def _flush_values(res, seed: int, n: int) -> None:
    local = [_local_grads(seed, _rows_of(seed, r, 4)) for r in range(n)]
    local64 = [_local_grads(seed, _rows_of(seed, r, 4), "float64") for r in range(n)]
    for rank, (grads, *_) in enumerate(res):
        for b, names in enumerate(_FLUSH_BUCKETS):
            for name in names:
                want = sum(local[r][name] for r in range(n)) / n
                exact = sum(local64[r][name] for r in range(n)) / n
                got = grads[name]
                at = _where(got, want, exact, [g[name] for g in local64])
                if at is None:
                    continue
                raise ExerciseError(
                    f"rank {rank}, bucket {b}, tensor {name!r}, element {list(at)}: "
                    f"got {got[at].item():.6g}, expected the mean over ranks "
                    f"{want[at].item():.6g}; "
                    + _flush_why(got, want, local[rank][name], n))
    probe = [_probe_grads(seed, r) for r in range(n)]
    for rank, r in enumerate(res):
        for i, got in enumerate(r[3][0] if r[3] is not None else ()):
            want = sum(p[i] for p in probe) / n  # whole numbers: exact
            if not bool((got == want).all()):
                raise ExerciseError(
                    f"rank {rank}, called outside backward on tensors of shapes "
                    f"(5,) and (3, 4), tensor {i}: got {got.tolist()}, expected "
                    f"their mean over ranks {want.tolist()}; "
                    + _flush_why(got, want, probe[rank][i], n))


def _flush_why(got, want, own, n: int) -> str:
    if _close(got, n * want):
        return f"that is {n}x the mean: divide the sum by world_size"
    if _close(got, own):
        return ("that is this rank's own gradient: the mean never reached it. In "
                "finish, wait, then copy each slice of the flat result back into "
                "its tensor in place (g.copy_(...)), in the order you flattened them")
    return ("check that you split the flat tensor back in the order you flattened "
            "it, with each tensor's numel and shape")


# ---------------------------------------------------------------- uneven shards


def _uneven_counts(seed: int, n: int) -> list[int]:
    """Each rank's number of examples, 1 to 9, drawn from `seed`; never all equal
    (equal shards are the case where the plain mean is right)."""
    rng = random.Random(seed)
    while True:
        counts = [rng.randint(1, 9) for _ in range(n)]
        if len(set(counts)) > 1:
            return counts


def _uneven_worker(rank, world_size, sync, seed, counts):
    from labkit.ledger import traffic

    model = _small_mlp(seed)
    model(_rows_of(seed, rank, counts[rank])).square().mean().backward()
    grads = [p.grad for p in model.parameters()]
    with own_calls(*_OWN) as own, traffic() as t:
        sync(grads, counts[rank], world_size)  # each rank knows its own count only
    calls = [(r.op, r.elements, r.payload_bytes) for r in t.records]
    return {n: p.grad.clone() for n, p in model.named_parameters()}, calls, list(own)


def check_uneven_shards(cluster, sync, *, timeout: float = SHORT_TIMEOUT) -> bool:
    """Check a student's gradient sync for shards of different sizes, when no rank
    is told the batch's size.

    Rank r holds b_r examples (1 to 9, drawn fresh each run, not all equal) and
    the gradients of its own mean loss. `sync(grads, n_local, world_size)` must
    leave in each tensor of `grads`, on every rank, the gradient of the mean loss
    over the whole batch of B = sum of b_r examples, which the check computes
    here in one process. It runs twice, on two draws whose B differ, so that a B
    written down from an earlier run cannot be right both times (one draw of
    four ranks has a given B about 1 time in 30). Its communication is held to
    all-reduces: the counts (a few elements) and the weighted gradients, every
    element once.
    """
    n = cluster.world_size
    seed = fresh_seed()
    first = _uneven_counts(seed, n)
    second_seed = seed + 1
    while sum(_uneven_counts(second_seed, n)) == sum(first):
        second_seed += 1
    draws = [(seed, first), (second_seed, _uneven_counts(second_seed, n))]
    psi = sum(p.numel() for p in _small_mlp(seed).parameters())
    for draw_seed, counts in draws:
        res = run_answer(cluster, _uneven_worker, sync, draw_seed, counts,
                         what="sync", timeout=timeout)
        if res is None:
            return NOT_YET
        _uneven_values(res, draw_seed, counts)
        for rank, (_, calls, _) in enumerate(res):
            _uneven_calls(rank, calls, psi, n)
    print(f"correct: with shards of {draws[0][1]} and of {draws[1][1]} examples, "
          f"drawn this run, every rank holds the full-batch gradient; measured "
          f"on every rank: all-reduces only, the {psi} gradient elements once "
          f"({4 * psi} bytes) and the counts")
    return PASSED


def _uneven_values(res, seed: int, counts: list[int]) -> None:
    """Every rank's gradients against the full batch's, computed here."""
    import torch

    n = len(counts)
    for rank, (_, _, own) in enumerate(res):
        refuse_own(f"rank {rank}", own, "data parallelism (or ring)")
    total = sum(counts)
    everything = torch.cat([_rows_of(seed, r, counts[r]) for r in range(n)])
    full = _local_grads(seed, everything)
    full64 = _local_grads(seed, everything, "float64")
    local = [_local_grads(seed, _rows_of(seed, r, counts[r])) for r in range(n)]
    for rank, (grads, calls, _) in enumerate(res):
        reduced = any(op == "all_reduce" for op, _, _ in calls)
        for name, want in full.items():
            got = grads[name]
            weighted = [c / total * g[name] for c, g in zip(counts, local)]
            at = _where(got, want, full64[name], [full64[name], *weighted])
            if at is None:
                continue
            raise ExerciseError(
                f"rank {rank} (holding {counts[rank]} of {total} examples; counts "
                f"this run {counts}), tensor {name!r}, element {list(at)}: got "
                f"{got[at].item():.6g}, expected the full-batch gradient "
                f"{want[at].item():.6g}; "
                + _uneven_why(got, want, [g[name] for g in local], counts, rank,
                              reduced))


def _uneven_why(got, want, local: list, counts: list, rank: int,
                reduced: bool) -> str:
    """What a wrong gradient is, told by what it equals."""
    n, total = len(counts), sum(counts)
    plain = sum(local) / n
    weighted_sum = sum(b * g for b, g in zip(counts, local))
    known = [
        (plain, "that is the plain mean of the ranks' gradients (what weighting "
                "by n_local / (world_size × n_local) gives), right only for equal "
                "shards: weight each rank's gradient by its share of the batch, "
                "n_local / B, with B the sum of every rank's count, which no rank "
                "can compute from its own: all-reduce the counts to find it"),
        (n * plain, "that is the plain sum of the ranks' gradients: weight each "
                    "rank's gradient by n_local / B before the sum"),
        (want / n, f"that is 1/{n} of it: the weighted sum is already the mean, "
                   "so do not divide by world_size as well"),
        (weighted_sum, "that is the sum of n_local × gradient over the ranks: "
                       "divide it by B, the batch's size (the sum of the counts)"),
        (n * plain / total, "that is the ranks' gradients summed and divided by "
                            "B, unweighted: each rank's gradient is a mean over "
                            "its own n_local examples, so weight it by n_local"),
    ]
    for value, why in known:
        if _close(got, value):
            return why
    if _close(got, local[rank]):
        if reduced:
            return ("that is this rank's own gradient: your all-reduce ran, but not "
                    "on these tensors. Change each gradient in place (g.mul_(...), "
                    "dist.all_reduce(g)); g = g * w makes a new tensor the model "
                    "never sees")
        return "that is this rank's own gradient: no all-reduce reached it"
    return ("find B = the sum of every rank's n_local (an all-reduce of a one-element "
            "tensor), weight by n_local / B, all-reduce the gradients (sum), in place")


def _uneven_calls(rank: int, calls, psi: int, n: int) -> None:
    """After the values: all-reduces only (an all-gather of the counts allowed),
    the gradients' elements once, in float32."""
    where = f"rank {rank}, the values are right, but"
    other = sorted({op for op, _, _ in calls if op not in ("all_reduce", "all_gather")})
    gathered = sum(k for op, k, _ in calls if op == "all_gather")
    if gathered > n:  # more than one count from each rank
        raise ExerciseError(
            f"{where} it all-gathered {gathered:,} elements: every rank's "
            f"gradients, {n - 1} times the bytes it needs to send. An all-reduce "
            "of the weighted gradients leaves every rank their sum, which is "
            "the full-batch gradient, for 2(N-1)/N of the gradient bytes")
    if other:
        raise ExerciseError(
            f"{where} it called {other}: the exercise is all-reduces, one of the "
            "counts and one (or one per tensor) of the weighted gradients")
    elements = sum(k for op, k, _ in calls if op == "all_reduce")
    if not psi <= elements <= psi + n:
        raise ExerciseError(
            f"{where} its all-reduces carried {elements:,} elements; the model's "
            f"gradients are {psi:,}, and the counts one a rank: all-reduce each "
            "gradient once (weight it first, then one sum does it)")
    nbytes = sum(b for op, _, b in calls if op == "all_reduce")
    if nbytes > 4 * psi + 8 * n:
        raise ExerciseError(
            f"{where} its all-reduces carried {nbytes:,} bytes for {elements:,} "
            f"elements; the gradients are float32, {4 * psi:,} bytes: keep their "
            "dtype")
