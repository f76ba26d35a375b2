"""Chapter 09's checks: a row-parallel layer's forward, f and g, the bytes a GPU
sends per layer, and the smallest t at which whole activations outweigh split ones.

Imports the other check modules; torch and labkit.ledger inside the checks.

The first two run on the ranks under the traffic ledger: labkit's own tensor
parallelism and any collective but all-reduce are refused before the values are
looked at, then each rank is held to the all-reduces the exercise asks for.
"""

from __future__ import annotations

import random
from fractions import Fraction

from labkit.checks.common import (
    NOT_WRITTEN,
    NOT_YET,
    PASSED,
    SHORT_TIMEOUT,
    ExerciseError,
    call_answer,
    finite,
    is_number,
    is_whole,
    rounding_tolerance,
    run_answer,
    wrong_element,
)
from labkit.checks.verify import fresh_seed, own_calls, refuse_own

IN, OUT, FFN = 12, 7, 24  # Linear(12, 7); the MLP 12 -> 24 -> 12: t = 2, 3, 4, 6
SEQ, BATCH = 5, 3
# labkit's own tensor parallelism: never an answer to exercises 1 and 2
_OWN_LAYERS = ("labkit.parallel.tensor_parallel",
               "labkit.parallel.tensor_parallel_mappings")

# An f/g answer passes within its float32 reference's own rounding (the
# reference against the same computed in float64: common.rounding_tolerance).
# The hints only name a mistake already found: `_like` recognises one within
# this much of the largest element, far above rounding (~1e-7) and far below
# what tells the mistakes apart (a bias, a factor t: ~1e-1).
DIAGNOSIS_REL = 1e-4


def _first_wrong(got, want, exact):
    """(index, got, expected) of the first element of `got` farther from `exact`
    (float64) than the float32 reference `want` rounds, or None."""
    bad = wrong_element(got, want, exact)
    return None if bad is None else bad[:3]


def _close(got, want, exact) -> bool:
    """The pass criterion: `got` is `exact` to the float32 reference's rounding."""
    return got.shape == want.shape and _first_wrong(got, want, exact) is None


def _like(got, guess) -> bool:
    """A diagnosis, not a pass criterion: `got` is `guess` up to DIAGNOSIS_REL of
    its largest element."""
    tol = DIAGNOSIS_REL * max(guess.abs().max().item(), 1e-12)
    return got.shape == guess.shape and bool(
        ((got.double() - guess.double()).abs() <= tol).all())


def _fmt(shape) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"


def _plural(k: int, word: str) -> str:
    return f"{k} {word}" + ("" if k == 1 else "s")


# ------------------------------------------------------- groups and collectives


def _tp_size(world_size: int) -> int:
    """t: two replicas of t ranks where the world splits evenly (so that an
    all-reduce over every rank instead of the group sums another replica's
    batch in, and shows), else one group of all of them."""
    return world_size // 2 if world_size >= 4 and world_size % 2 == 0 else world_size


_GROUPS: dict = {}  # on a rank: its groups, made once per world and t


def _groups(rank: int, world_size: int, t: int):
    """(this rank's tensor-parallel group, its global ranks): ranks [d·t, (d+1)·t)
    form replica d's group. Every rank creates every group, in the same order,
    the first time a check asks for them in this world."""
    import torch.distributed as dist

    key = (id(dist.group.WORLD), world_size, t)
    if key not in _GROUPS:
        for d in range(world_size // t):
            ranks = tuple(range(d * t, (d + 1) * t))
            group = dist.new_group(list(ranks))
            if rank in ranks:
                _GROUPS[key] = (group, ranks)
    return _GROUPS[key]


def _only_all_reduce(rank: int, records, what: str) -> None:
    """Before the values: the answer called no collective but all-reduce."""
    other = sorted({r.op for r in records if r.op != "all_reduce"})
    if not other:
        return
    if "all_gather" in other:
        why = ("a tensor-parallel rank never gathers the whole weight (nor the "
               "whole input): it keeps its columns of W, and one all-reduce sums "
               "the partial outputs")
    else:
        why = f"{what} sends all-reduces (dist.all_reduce) and nothing else"
    raise ExerciseError(f"rank {rank}: your answer called {other}; {why}")


def _require_all_reduce(where: str, records, elements: int, members, what: str
                        ) -> None:
    """After the values: the records hold exactly one all-reduce, of `elements`
    float32 elements, in the group `members`."""
    got = [r for r in records if r.op == "all_reduce"]
    if len(got) != 1:
        raise ExerciseError(
            f"{where}: it called all-reduce {len(got)} times; {what} is one "
            f"all-reduce of the {elements} elements it sums")
    r = got[0]
    if r.elements != elements:
        raise ExerciseError(
            f"{where}: its all-reduce carried {r.elements} elements; {what} sums "
            f"{elements} ({_fmt((SEQ, BATCH, elements // (SEQ * BATCH)))}), no more")
    if r.payload_bytes != 4 * elements:
        raise ExerciseError(
            f"{where}: its all-reduce carried {r.payload_bytes} bytes; "
            f"{elements} float32 elements are {4 * elements} (a {r.dtype} copy "
            "sends more than the layer's own dtype)")
    if tuple(r.group_ranks) != tuple(members):
        raise ExerciseError(
            f"{where}: it all-reduced over ranks {list(r.group_ranks)}; its "
            f"tensor-parallel group is ranks {list(members)}: pass `group`")


# -- exercise 1: RowParallelLinear's forward ---------------------------------------


def _row_worker(rank, world_size, fn, t, xs, weight, bias):
    """The whole input of this rank's replica and this rank's columns of the
    weight; the student's forward run under the traffic ledger."""
    import torch

    from labkit.ledger import traffic

    group, members = _groups(rank, world_size, t)
    d, i = divmod(rank, t)
    k = IN // t
    w_part = weight[:, i * k:(i + 1) * k].clone()
    with torch.no_grad(), traffic() as led, own_calls(*_OWN_LAYERS) as own:
        y = fn(xs[d].clone(), w_part, bias.clone(), group)
    return {"y": y.detach().clone() if isinstance(y, torch.Tensor) else
            repr(y)[:80], "records": list(led.records), "own": list(own),
            "members": members}


_SLICE = ("x is the whole input, on every rank of the group: this rank multiplies "
          "only its columns of it, the k = w_part.shape[1] columns at its place in "
          "the group, i = dist.get_rank(group) (not its global rank: the second "
          "group's ranks are 2 and 3, its places 0 and 1)")


def check_row_parallel_forward(cluster, fn, *, timeout: float = SHORT_TIMEOUT
                               ) -> bool:
    """Check a student's forward of a row-parallel Linear(12, 7).

    `fn(x, w_part, bias, group)` gets the whole input x (5, 3, 12), which every
    rank of its group holds, this rank's columns of the weight, w_part
    (7, 12/t) (rank i of the group: columns [i·12/t, (i+1)·12/t)), the whole
    bias (7,) and its tensor-parallel group. It must return the whole output
    x @ W.T + b, (5, 3, 7), on every rank: its columns of x times w_part, one
    all-reduce in the group, the bias once. The inputs are whole numbers drawn
    fresh each run (exact in float32 in any order of summing), and each replica
    of t ranks has its own batch. Refused before the values: labkit's own
    layers, any collective but all-reduce. After them: one all-reduce of 105
    float32 elements in the group, on every rank.
    """
    import torch

    n = cluster.world_size
    t = _tp_size(n)
    if IN % t:
        raise ValueError(f"this check splits 12 input features in groups of t = {t}: "
                         "it needs 1, 2, 3, 4, 6, 8 or 12 ranks")
    gen = torch.Generator().manual_seed(fresh_seed())
    xs = torch.randint(-4, 5, (n // t, SEQ, BATCH, IN), generator=gen).float()
    weight = torch.randint(-4, 5, (OUT, IN), generator=gen).float()
    bias = torch.randint(-9, 10, (OUT,), generator=gen).float()
    try:
        res = run_answer(cluster, _row_worker, fn, t, xs, weight, bias,
                         what="row-parallel forward", timeout=timeout)
    except ExerciseError as err:  # a shape that does not fit: x is whole
        text = str(err)
        if "shape" not in text and "size" not in text:
            raise
        raise ExerciseError(f"{text.split('. Hint: ')[0]}. Hint: {_SLICE}") from None
    if res is None:
        return NOT_YET
    for rank, r in enumerate(res):
        refuse_own(f"rank {rank}", r["own"], "tensor-parallel layer")
        _only_all_reduce(rank, r["records"], "a row-parallel layer")
    k = IN // t
    for rank, r in enumerate(res):
        x, i = xs[rank // t], rank % t
        y, want = r["y"], x @ weight.T + bias  # whole numbers: exact
        if isinstance(y, str):
            raise ExerciseError(f"rank {rank}: your forward returned {y}, not a "
                                f"tensor of shape {_fmt(want.shape)}")
        if tuple(y.shape) != tuple(want.shape):
            raise ExerciseError(
                f"rank {rank}: the output has shape {_fmt(y.shape)}, expected "
                f"{_fmt(want.shape)}: x's columns (5, 3, 12/t) @ w_part.T (12/t, 7) "
                "is (5, 3, 7), and every rank returns the whole output")
        if y.dtype != want.dtype:
            raise ExerciseError(f"rank {rank}: the output is {y.dtype}; the layer "
                                f"computes in {want.dtype}, as its inputs")
        if not torch.equal(y, want):
            where = tuple(int(v) for v in (y != want).nonzero()[0])
            # [j][c]: x's columns j times the weight's columns c
            parts = [[x[..., j * k:(j + 1) * k] @ weight[:, c * k:(c + 1) * k].T
                      for c in range(t)] for j in range(t)]
            world = sum(xs[d] for d in range(n // t)) @ weight.T + bias
            raise ExerciseError(
                f"rank {rank}, element {where}: got {float(y[where]):g}, expected "
                f"{float(want[where]):g}. " + _row_hint(y, want, parts, i, bias, t,
                                                        world, n))
    for rank, r in enumerate(res):
        _require_all_reduce(f"rank {rank}: the values are right, but", r["records"],
                            SEQ * BATCH * OUT, r["members"],
                            "a row-parallel layer's forward")
    groups = f"{n // t} groups of {t}" if n > t else f"one group of {t}"
    print(f"correct: on inputs drawn this run, every rank of {groups} returned its "
          f"replica's whole output; measured on every rank: one all-reduce of "
          f"{SEQ * BATCH * OUT} float32 elements ({4 * SEQ * BATCH * OUT} bytes) in "
          "its group, no other collective")
    return PASSED


def _row_hint(y, want, parts, i, bias, t, world, n) -> str:
    if n > t and _like(y, world):
        return (f"This is the sum over all {n} ranks: the all-reduce ran in the "
                "default group, and added the other replica's partial sums (of "
                "another batch). Pass group=group.")
    for j, row in enumerate(parts):
        if _like(y, sum(row) + bias) or _like(y, sum(row)):
            return (f"Every rank of the group multiplied the same columns of x, "
                    f"[{j * IN // t}, {(j + 1) * IN // t}), by its own columns of "
                    "W. " + _SLICE + ".")
    if _like(y, want + (t - 1) * bias):
        return (f"The bias is added {t} times instead of once: every one of the "
                f"{t} ranks added it before the all-reduce, which summed it with "
                "the rest. Add it once, after the reduction.")
    if _like(y, want - bias):
        return "The output lacks the bias: add it once, after the all-reduce."
    if _like(y, parts[i][i] + bias) or _like(y, parts[i][i]):
        return ("This is only this rank's partial sum (its columns of W): all-reduce "
                "it over the group (dist.all_reduce sums in place).")
    if _like(y, want / t) or _like(y, (want - bias) / t + bias):
        return ("The output is 1/t of the answer: all-reduce sums the partial "
                "products, it must not average them (op=SUM, the default).")
    return ("Multiply this rank's columns of x by w_part.T, all-reduce that over "
            "the group (op=SUM), then add the bias once.")


# -- exercise 2: f and g ------------------------------------------------------------

_NAMES = {"w1": "fc1.weight", "b1": "fc1.bias", "w2": "fc2.weight", "b2": "fc2.bias"}


def _draw_mlp(seed: int, replicas: int):
    """An MLP 12 -> 24 -> 12's weights, and an input and an output gradient per
    replica, all drawn from `seed`."""
    import torch

    g = torch.Generator().manual_seed(seed)
    params = {"w1": torch.randn(FFN, IN, generator=g) / IN ** 0.5,
              "b1": torch.randn(FFN, generator=g) / 4,
              "w2": torch.randn(IN, FFN, generator=g) / FFN ** 0.5,
              "b2": torch.randn(IN, generator=g) / 4}
    xs = torch.randn(replicas, SEQ, BATCH, IN, generator=g)
    dys = torch.randn(replicas, SEQ, BATCH, IN, generator=g)
    return params, xs, dys


def _mlp_step(params, x, dy, dtype: str = "float32"):
    """One process: the MLP's output, x's gradient and the weights' gradients of
    (y * dy).sum(), in float32 (what a rank computes) or float64 (exact)."""
    import torch
    import torch.nn.functional as F

    to = getattr(torch, dtype)
    p = {k: v.to(to).clone().requires_grad_() for k, v in params.items()}
    x = x.to(to).clone().requires_grad_()
    y = F.linear(F.gelu(F.linear(x, p["w1"], p["b1"])), p["w2"], p["b2"])
    y.backward(dy.to(to))
    return y.detach(), x.grad, {_NAMES[k]: v.grad for k, v in p.items()}


def _sliced(grads: dict, lo: int, hi: int) -> dict:
    """The gradients a rank holding hidden units lo:hi has."""
    return {"fc1.weight": grads["fc1.weight"][lo:hi],
            "fc1.bias": grads["fc1.bias"][lo:hi],
            "fc2.weight": grads["fc2.weight"][:, lo:hi],
            "fc2.bias": grads["fc2.bias"]}


def _fg_worker(rank, world_size, f, g, t, params, xs, dys):
    import torch.nn.functional as F

    from labkit.ledger import traffic

    group, members = _groups(rank, world_size, t)
    d, i = divmod(rank, t)
    k = FFN // t
    mine = slice(i * k, (i + 1) * k)
    w1 = params["w1"][mine].clone().requires_grad_()
    b1 = params["b1"][mine].clone().requires_grad_()
    w2 = params["w2"][:, mine].clone().requires_grad_()
    b2 = params["b2"].clone().requires_grad_()
    x = xs[d].clone().requires_grad_()
    with traffic() as led, own_calls(*_OWN_LAYERS) as own:
        with led.phase("forward"):
            h = F.gelu(F.linear(f(x, group), w1, b1))  # (s, b, ffn/t)
            y = g(F.linear(h, w2), group) + b2  # (s, b, h), whole
        with led.phase("backward"):
            if y.requires_grad:
                y.backward(dys[d])
    return {"y": y.detach(), "dx": x.grad, "grads": {
        "fc1.weight": w1.grad, "fc1.bias": b1.grad, "fc2.weight": w2.grad,
        "fc2.bias": b2.grad}, "mine": (mine.start, mine.stop),
        "records": list(led.records), "own": list(own), "members": members}


def check_conjugate_operators(cluster, f, g, *, timeout: float = SHORT_TIMEOUT
                              ) -> bool:
    """Check a student's f and g on a tensor-parallel MLP, Linear(12, 24), GeLU,
    Linear(24, 12), on every rank of the cluster, in groups of t (two replicas,
    each with its own batch, where the ranks split evenly).

    `f(x, group)` and `g(x, group)` return tensors autograd can differentiate
    through (an autograd.Function's .apply). The MLP's first layer is
    column-parallel with f before it, the second row-parallel with g after it;
    weights, inputs and output gradients are drawn fresh each run. Refused
    before the values: labkit's own operators, any collective but all-reduce.
    Output, input gradient and every weight gradient are compared with one
    process's MLP; a wrong one is reported by rank, tensor and element, with
    which of f and g (forward or backward) can produce that mistake. After the
    values: one all-reduce of the activations forward (g) and one backward (f),
    in the group, on every rank."""
    n = cluster.world_size
    t = _tp_size(n)
    if FFN % t:
        raise ValueError(f"this check splits 24 hidden features in groups of t = "
                         f"{t}: it needs 1, 2, 3, 4, 6, 8 or 12 ranks")
    params, xs, dys = _draw_mlp(fresh_seed(), n // t)
    res = run_answer(cluster, _fg_worker, f, g, t, params, xs, dys, what="f and g",
                     timeout=timeout)
    if res is None:
        return NOT_YET
    for rank, r in enumerate(res):
        refuse_own(f"rank {rank}", r["own"], "f and g (tensor_parallel_mappings)")
        _only_all_reduce(rank, r["records"], "f and g")
    refs = [(_mlp_step(params, xs[d], dys[d]),
             _mlp_step(params, xs[d], dys[d], "float64")) for d in range(n // t)]
    world = _world_sums(refs, params)
    allowed = 0.0
    for rank, r in enumerate(res):
        (y, dx, grads), (y64, dx64, grads64) = refs[rank // t]
        if not _close(r["y"], y, y64):
            hint = ("The forward is wrong: f must return x unchanged (every rank "
                    "already holds the whole x) and g must sum the t partial "
                    "outputs (all-reduce, op=SUM) in the group.")
            if n > t and _like(r["y"], world["y"]):
                hint = (f"This is the sum over all {n} ranks: g all-reduced in the "
                        "default group and added the other replica's partial "
                        "outputs (of another batch). Pass the group to "
                        "dist.all_reduce.")
            raise ExerciseError(_fg_message(rank, "the output", r["y"], y, y64, t,
                                            hint))
        if r["dx"] is None:
            raise ExerciseError(
                f"rank {rank}: x got no gradient: f must be differentiable. Write "
                "it as a torch.autograd.Function (forward and backward) and return "
                "MyF.apply(x, group), not a tensor made under no_grad or detached")
        want, exact = (_sliced(gr, *r["mine"]) for gr in (grads, grads64))
        for name, w in want.items():
            got = r["grads"][name]
            if got is None or not _close(got, w, exact[name]):
                raise ExerciseError(_fg_message(rank, f"the gradient of {name}", got,
                                                w, exact[name], t, (
                    "g's backward must be the identity: the loss's gradient reaches "
                    "every rank's partial output whole, and an all-reduce there "
                    "multiplies it by t.")))
        if not _close(r["dx"], dx, dx64):
            hint = ("f's backward must all-reduce (sum) the gradient: each rank's "
                    "x.grad holds only the part that flowed through its own columns "
                    "of the first layer.")
            if n > t and _like(r["dx"], world["dx"]):
                hint = (f"This is the sum over all {n} ranks: f's backward "
                        "all-reduced in the default group and added the other "
                        "replica's gradient (of another batch). Keep the group in "
                        "ctx and pass it to dist.all_reduce.")
            raise ExerciseError(_fg_message(rank, "x's gradient", r["dx"], dx, dx64,
                                            t, hint))
        allowed = max(allowed, *(rounding_tolerance(a, b) for a, b in (
            (y, y64), (dx, dx64), *((grads[k], grads64[k]) for k in grads))))
    for rank, r in enumerate(res):
        where = f"rank {rank}: the values are right, but"
        for phase, who in (("forward", "g"), ("backward", "f")):
            _require_all_reduce(f"{where} in {phase}", [
                x for x in r["records"] if x.phase == phase], SEQ * BATCH * IN,
                r["members"], f"{who} in {phase}")
    groups = f"{n // t} groups of {t}" if n > t else f"one group of {t}"
    print(f"correct: on weights and batches drawn this run, output, x's gradient "
          f"and every weight's gradient match one process on all {n} ranks "
          f"({groups}; within {allowed:.1g}, the rounding of one process's "
          "float32); measured on every rank: one all-reduce of "
          f"{SEQ * BATCH * IN} float32 elements forward (g) and one backward (f), "
          "in its group, no other collective")
    return PASSED


def _world_sums(refs, params) -> dict:
    """What every rank gets when g's forward, or f's backward, all-reduce over
    all ranks instead of the group: the replicas' sums."""
    ys = [y - params["b2"] for (y, _, _), _ in refs]
    return {"y": sum(ys) + params["b2"], "dx": sum(dx for (_, dx, _), _ in refs)}


def _fg_message(rank, what, got, want, exact, t, hint) -> str:
    if got is None:
        return f"rank {rank}: {what} is missing (None). {hint}"
    if got.shape != want.shape:
        return (f"rank {rank}: {what} has shape {_fmt(got.shape)}, expected "
                f"{_fmt(want.shape)}. {hint}")
    i, a, b = _first_wrong(got, want, exact)
    scale = ""
    if _like(got, t * want):
        scale = f" (it is {t}x the right value everywhere)"
    return (f"rank {rank}, {what}, element {i}: got {a:.6g}, expected {b:.6g}"
            f"{scale}. {hint}")


# -- exercise 3: bytes per GPU per layer ---------------------------------------------

# the closed forms the chapter teaches, and the α-β model: never an answer
_OWN_FORMULAS = ("labkit.theory.tensor_parallel", "labkit.theory.collective_cost",
                 "labkit.theory.activations",
                 "labkit.checks.tensor_parallel:_layer_bytes",
                 "labkit.checks.tensor_parallel:_smallest_t")
GPT3 = (1, 2048, 12288, 8, 2)  # b, s, h, t, bytes an element: the chapter's GPT-3


def _layer_bytes(b: int, s: int, h: int, t: int, elem_bytes: int,
                 recompute: bool) -> Fraction:
    """Bytes one rank sends per layer per step, exactly: g's two all-reduces
    forward (twice with the forward run again), f's two backward, each a ring
    of b·s·h elements sending 2(t-1)/t of them."""
    all_reduces = 6 if recompute else 4
    return all_reduces * 2 * Fraction(t - 1, t) * b * s * h * elem_bytes


def _bytes_cases(seed: int) -> list[tuple]:
    rng = random.Random(seed)
    cases = [(*GPT3, False), (*GPT3, True)]
    for recompute in (False, True, rng.random() < 0.5, rng.random() < 0.5):
        cases.append((rng.randint(1, 16), rng.choice((256, 512, 1024, 2048, 4096)),
                      64 * rng.randint(4, 200), rng.choice((2, 3, 4, 6, 8, 16)),
                      rng.choice((2, 4)), recompute))
    cases.append((rng.randint(1, 8), 1024, 64 * rng.randint(4, 64), 1, 2,
                  rng.random() < 0.5))  # t = 1: no ring, nothing sent
    return cases


def _bytes_hint(case, got: float) -> str:
    b, s, h, t, e, recompute = case
    n, ring = b * s * h, 2 * Fraction(t - 1, t)
    k = 6 if recompute else 4
    near = {
        "the ring's factor is 2(t-1)/t: an all-reduce is a reduce-scatter and an "
        "all-gather, (t-1)/t of the payload each": k * Fraction(t - 1, t) * n * e,
        "that is the payload of the all-reduces; a ring sends 2(t-1)/t of it per "
        "rank": k * n * e,
        "2(t-1), not 2(t-1)/t: each ring step sends 1/t of the payload": k * 2 * (
            t - 1) * n * e,
        "that counts elements; each is elem_bytes bytes": k * ring * n,
        "forward only: backward sends f's two all-reduces": 2 * ring * n * e,
        "the forward's two all-reduces and backward's two: the forward run again "
        "in backward sends g's two once more": 4 * ring * n * e if recompute
        else None,
        "the forward run again sends g's two all-reduces once more, not four: f is "
        "the identity in forward": 8 * ring * n * e if recompute else None,
        "with recompute=False the forward runs once: four all-reduces": 6 * ring * n
        * e if not recompute else None,
        "that is the layer's weights (12h²): tensor parallelism sends activations, "
        "b·s·h": k * ring * 12 * h * h * e,
    }
    # some mistakes give the same number (2-byte elements counted as elements is
    # the ring's factor without its 2): name every one that fits
    whys = [why for why, v in near.items()
            if v is not None and abs(got - float(v)) <= 1e-9 * abs(float(v))]
    return "".join(f"; {'or ' * (k > 0)}{why}" for k, why in enumerate(whys))


def check_tp_layer_bytes(fn) -> bool:
    """Check a student's `fn(b, s, h, t, elem_bytes, recompute)`: the bytes one GPU
    sends per transformer layer per training step under Megatron's tensor
    parallelism over t GPUs (ring all-reduces of b·s·h elements of elem_bytes
    each); with recompute, the layer is checkpointed whole, and backward runs
    its forward again, collectives included. Called on GPT-3's layer and on
    cases drawn fresh each run; labkit's own closed forms are refused."""
    cases = _bytes_cases(fresh_seed())
    for case in cases:
        b, s, h, t, e, recompute = case
        where = (f"tp_layer_bytes(b={b}, s={s}, h={h}, t={t}, elem_bytes={e}, "
                 f"recompute={recompute})")
        with own_calls(*_OWN_FORMULAS) as own:
            got = call_answer(fn, *case, what="bytes per layer")
        refuse_own(where, own, "tensor-parallel traffic (or this check's "
                   "reference)")
        if got is NOT_WRITTEN:
            return NOT_YET
        if not is_number(got):
            raise ExerciseError(f"{where}: expected a number of bytes, got "
                                f"{type(got).__name__} {got!r}")
        finite(where, got)
        want = _layer_bytes(*case)
        # the float64 formula against the exact one: another order of the same
        # operations differs in the 16th digit; 1e-9 relative absorbs that only
        if not abs(float(got) - float(want)) <= 1e-9 * float(want):
            raise ExerciseError(f"{where}: got {float(got):,.6g} bytes, expected "
                                f"{float(want):,.0f}" + _bytes_hint(case, got))
    plain, again = (float(_layer_bytes(*GPT3, r)) for r in (False, True))
    print(f"correct on {len(cases)} cases, {len(cases) - 2} of them drawn this run: "
          f"a GPT-3 layer at t = 8 sends {plain / 2**20:,.0f} MiB per GPU per step, "
          f"{again / 2**20:,.0f} MiB with the layer recomputed in backward")
    return PASSED


# -- exercise 4: the t at which the whole activations outweigh the split ones -------

CHAPTER_BLOCK = (64, 4, 64, 8, 256)  # s, b, h, heads, ffn: section 5's block


def _activations(s: int, b: int, h: int, heads: int, ffn: int) -> tuple[int, int]:
    """(whole, split) elements of one block's activations, as chapter 09 counts
    them: whole on every rank, the block input, LN1's output, the residual sum,
    LN2's output and the block's output (5 sbh) and the two LayerNorms' means
    and reciprocal deviations (4 sb); split by t, q, k, v and the attention
    output (4 sbh), fc1's and GeLU's outputs (2 sb·ffn) and the softmax's
    scores (heads·s²·b)."""
    whole = 5 * s * b * h + 4 * s * b
    return whole, 4 * s * b * h + 2 * s * b * ffn + heads * s * s * b


def _smallest_t(s, b, h, heads, ffn, *, whole=None, split=None, factor=1,
                strict=True):
    """The smallest t dividing heads and ffn with whole·t > split (a rank's
    whole activations more than half of whole + split/t), or None; the keywords
    make the usual wrong answers."""
    w, sp = _activations(s, b, h, heads, ffn)
    w, sp = (whole if whole is not None else w), (split if split is not None else sp)
    for t in range(1, heads + 1):
        if heads % t == 0 and ffn % t == 0 and (
                factor * w * t > sp if strict else factor * w * t >= sp):
            return t
    return None


def _block_cases(seed: int) -> list[tuple]:
    """The chapter's block, then six drawn from `seed`, each with an answer, and
    at least three different answers among the seven (a t written down fails)."""
    rng = random.Random(seed)
    cases = [CHAPTER_BLOCK]
    while len(cases) < 7 or len({_smallest_t(*c) for c in cases}) < 3:
        if len(cases) == 7:
            cases.pop(rng.randrange(1, 7))
        heads = rng.choice((4, 6, 8, 12, 16, 24))
        h = heads * rng.choice((8, 16, 32, 64))
        # 8h/3 rounded up to a multiple of 64 (a SwiGLU MLP's width), which
        # some t that divide the heads do not divide
        ffn = rng.choice((2 * h, 4 * h, 64 * -(-h // 24)))
        s, b = rng.choice((16, 32, 64, 128, 256)), rng.randint(1, 8)
        if _smallest_t(s, b, h, heads, ffn) is not None:
            cases.append((s, b, h, heads, ffn))
    return cases


def _block_hint(case, got: int) -> str:
    s, b, h, heads, ffn = case
    sbh, sb = s * b * h, s * b
    near = {
        "the LayerNorms' statistics (a mean and a reciprocal deviation per token "
        "and LayerNorm, 4 sb) stay whole too": _smallest_t(*case, whole=5 * sbh),
        "the MLP's hidden activations are 2·sb·ffn; 8 sbh only when ffn = 4h":
            _smallest_t(*case, split=12 * sbh + heads * s * s * b),
        "the attention scores (heads·s²·b, the softmax's output) split by t too":
            _smallest_t(*case, split=4 * sbh + 2 * sb * ffn),
        "the whole ones must be more than half of a rank's activations, whole + "
        "split/t: whole > split/t, not whole > split/(2t)": _smallest_t(*case,
                                                                        factor=2),
        "more than half: at equality it is not more": _smallest_t(*case,
                                                                  strict=False),
    }
    for why, v in near.items():
        if v is not None and v == got and v != _smallest_t(*case):
            return f"; {why}"
    return ""


def check_whole_over_half(fn) -> bool:
    """Check a student's `fn(s, b, h, heads, ffn)`: the smallest tensor-parallel
    degree t at which the activations a rank of chapter 09's block holds whole
    are more than half of its activations (`_activations` says which are
    which), among the t that split the block: t divides the heads (each rank
    computes whole heads) and the MLP's ffn features; None if none does. Called
    on the chapter's block and on blocks drawn fresh each run (each has an
    answer); labkit's own activation formulas are refused."""
    cases = _block_cases(fresh_seed())
    for case in cases:
        s, b, h, heads, ffn = case
        where = f"smallest_t(s={s}, b={b}, h={h}, heads={heads}, ffn={ffn})"
        with own_calls(*_OWN_FORMULAS) as own:
            got = call_answer(fn, *case, what="smallest t")
        refuse_own(where, own, "activation formulas (or this check's reference)")
        if got is NOT_WRITTEN:
            return NOT_YET
        want = _smallest_t(*case)
        if got is None:
            raise ExerciseError(f"{where}: got None; t = {want} splits the block "
                                "and qualifies")
        if not is_number(got):
            raise ExerciseError(f"{where}: expected a whole number of ranks, got "
                                f"{type(got).__name__} {got!r}")
        finite(where, got)
        if got < 1 or not is_whole(got):  # 4, 4.0 and numpy's 4 are 4
            raise ExerciseError(f"{where}: t is a whole number of ranks >= 1, not "
                                f"{got!r}")
        got = int(got)
        if heads % got or ffn % got:
            raise ExerciseError(
                f"{where}: t = {got} cannot split the block: {heads} attention "
                f"heads and {ffn} MLP features over {got} ranks leave "
                f"{heads / got:g} heads and {ffn / got:g} features a rank; each "
                f"rank computes whole heads, so t must divide {heads} and {ffn}")
        if got != want:
            whole, split = _activations(*case)
            share = Fraction(whole * got, whole * got + split)
            why = ("not more than half yet" if got < want else
                   f"but already at t = {want}, a smaller t that splits the block")
            raise ExerciseError(
                f"{where}: at t = {got} the whole activations are "
                f"{float(share):.1%} of a rank's, {why}" + _block_hint(case, got))
    whole, split = _activations(*CHAPTER_BLOCK)
    t = _smallest_t(*CHAPTER_BLOCK)
    print(f"correct on {len(cases)} blocks, {len(cases) - 1} of them drawn this run; "
          f"in the chapter's block t = {t}: "
          f"{whole * t / (whole * t + split):.1%} of a rank's activations stay "
          "whole")
    return PASSED
