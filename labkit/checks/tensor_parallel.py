"""Chapter 09's checks: a row-parallel layer's forward, f and g as autograd
Functions, and the tensor-parallel degree at which the activations that stay
whole outweigh the split ones (a t that splits the heads). The first two run the
answer on the ranks (common.run_answer: an exception is told by rank and line,
a deadlock in seconds) and compare it with one process's nn.Linear or MLP,
naming the rank, the tensor, the element and the likely mistake."""

from __future__ import annotations

import copy

from labkit.checks.common import (
    NOT_YET,
    not_yet,
    PASSED,
    SHORT_TIMEOUT,
    ExerciseError,
    is_number,
    rounding_tolerance,
    run_answer,
    wrong_element,
)

IN, OUT, FFN = 12, 7, 16  # Linear(12, 7); 12 and 16 divide by 2, 3, 4 ranks
SEQ, BATCH = 5, 3


# An answer passes within its float32 reference's own rounding (the reference
# against the same computed in float64: common.rounding_tolerance). The hints
# only name a mistake already found: `_like` recognises one within this much of
# the largest element, far above rounding (~1e-7) and far below what tells the
# mistakes apart (a bias, a factor t: ~1e-1).
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


# -- exercise 1: RowParallelLinear's forward ---------------------------------------


def _layer_and_input():
    import torch

    torch.manual_seed(0)  # the same layer and input in every process
    full = torch.nn.Linear(IN, OUT)
    x = torch.randn(SEQ, BATCH, IN, generator=torch.Generator().manual_seed(1))
    return full, x


def _row_worker(rank, world_size, fn):
    import torch

    from labkit.ledger import traffic

    full, x = _layer_and_input()
    k = IN // world_size
    cols = slice(rank * k, (rank + 1) * k)
    x_part = x[..., cols].clone()
    w_part = full.weight.detach()[:, cols].clone()
    bias = full.bias.detach().clone()
    with torch.no_grad(), traffic() as led:
        y = fn(x_part, w_part, bias, None)
    partial = x[..., cols] @ full.weight.detach()[:, cols].T
    return {"y": y if isinstance(y, torch.Tensor) else repr(y)[:80],
            "want": full(x).detach(),
            "exact": copy.deepcopy(full).double()(x.double()).detach(),
            "partial": partial, "bias": bias,
            "ops": [(r.op, r.elements) for r in led.records]}


def check_row_parallel_forward(cluster, fn, *, timeout: float = SHORT_TIMEOUT
                                ) -> bool:
    """Check a student's forward of a row-parallel Linear(12, 7).

    `fn(x_part, w_part, bias, group)` gets this rank's columns of the input,
    x_part (5, 3, 12/t), and of the weight, w_part (7, 12/t), the whole bias (7,)
    and the group (None: all ranks). It must return the whole output
    x @ W.T + b, (5, 3, 7), on every rank: the local product, one all-reduce,
    the bias once. A wrong answer is reported by rank and element, expected
    against got, with what the numbers look like (the bias t times, a partial sum);
    ranks still waiting in a collective after `timeout` seconds, by rank.
    """
    t = cluster.world_size
    if IN % t:
        raise ValueError(f"this check splits 12 input features: it needs 1, 2, 3, "
                         f"4 or 6 ranks, not {t}")
    res = run_answer(cluster, _row_worker, fn, what="row-parallel forward",
                     timeout=timeout)
    if res is None:
        return NOT_YET
    for rank, r in enumerate(res):
        y, want = r["y"], r["want"]
        if isinstance(y, str):
            raise ExerciseError(f"rank {rank}: your forward returned {y}, not a "
                                f"tensor of shape {_fmt(want.shape)}")
        if tuple(y.shape) != tuple(want.shape):
            raise ExerciseError(
                f"rank {rank}: the output has shape {_fmt(y.shape)}, expected "
                f"{_fmt(want.shape)}: x_part (5, 3, 12/t) @ w_part.T (12/t, 7) is "
                "(5, 3, 7), and every rank returns the whole output")
        wrong = _first_wrong(y, want, r["exact"])
        if wrong is not None:
            i, got, exp = wrong
            raise ExerciseError(
                f"rank {rank}, element {i}: got {got:.6g}, expected {exp:.6g}. "
                + _row_hint(y, want, r["partial"], r["bias"], t))
        ops = [op for op, _ in r["ops"]]
        if ops != ["all_reduce"] or r["ops"][0][1] != want.numel():
            raise ExerciseError(
                f"rank {rank}: the values are right, but the collectives were "
                f"{r['ops'] or 'none'} (op, elements): one all-reduce of the "
                f"{want.numel()} output elements is all a row-parallel layer sends")
    print(f"correct: on each of {t} ranks, (5, 3, {IN}/{t}) @ ({IN}/{t}, 7) gave a "
          f"partial sum; one all-reduce of {SEQ * BATCH * OUT} elements and the bias "
          "once gave the whole layer's output")
    return PASSED


def _row_hint(y, want, partial, bias, t) -> str:
    if _like(y, want + (t - 1) * bias):
        return (f"The bias is added {t} times instead of once: every one of the "
                f"{t} ranks added it before the all-reduce, which summed it with "
                "the rest. Add it once, after the reduction.")
    if _like(y, want - bias):
        return "The output lacks the bias: add it once, after the all-reduce."
    if _like(y, partial + bias) or _like(y, partial):
        return ("This is only this rank's partial sum (its columns of W): all-reduce "
                "it over the group (dist.all_reduce sums in place).")
    if _like(y, want / t) or _like(y, (want - bias) / t + bias):
        return ("The output is 1/t of the answer: all-reduce sums the partial "
                "products, it must not average them (op=SUM, the default).")
    return ("Compute x_part @ w_part.T on this rank, all-reduce that over the group "
            "(op=SUM), then add the bias once.")


# -- exercise 2: f and g ------------------------------------------------------------


def _mlp():
    import torch

    from labkit.parallel import MLP

    torch.manual_seed(0)
    return MLP(IN, FFN)


def _reference(dtype: str = "float32"):
    """One process: the MLP's output, and the gradients of (y * dy).sum(), in
    float32 (what a rank computes) or float64 (the exact answer)."""
    import torch

    to = getattr(torch, dtype)
    mlp, (x, dy) = _mlp().to(to), _x_dy()
    x = x.to(to).requires_grad_()
    y = mlp(x)
    y.backward(dy.to(to))
    return y.detach(), x.grad, {k: p.grad for k, p in mlp.named_parameters()}


def _sliced(grads: dict, lo: int, hi: int) -> dict:
    """The gradients a rank holding hidden units lo:hi has."""
    return {"fc1.weight": grads["fc1.weight"][lo:hi],
            "fc1.bias": grads["fc1.bias"][lo:hi],
            "fc2.weight": grads["fc2.weight"][:, lo:hi],
            "fc2.bias": grads["fc2.bias"]}


def _x_dy():
    import torch

    g = torch.Generator().manual_seed(3)
    return torch.randn(SEQ, BATCH, IN, generator=g), torch.randn(SEQ, BATCH, IN,
                                                                 generator=g)


def _fg_worker(rank, world_size, f, g):
    import torch.nn.functional as F

    from labkit.ledger import traffic

    mlp, (x, dy) = _mlp(), _x_dy()
    k = FFN // world_size
    mine = slice(rank * k, (rank + 1) * k)
    w1 = mlp.fc1.weight.detach()[mine].clone().requires_grad_()
    b1 = mlp.fc1.bias.detach()[mine].clone().requires_grad_()
    w2 = mlp.fc2.weight.detach()[:, mine].clone().requires_grad_()
    b2 = mlp.fc2.bias.detach().clone().requires_grad_()
    x = x.clone().requires_grad_()
    with traffic() as led:
        with led.phase("forward"):
            h = F.gelu(F.linear(f(x, None), w1, b1))  # (s, b, ffn/t)
            y = g(F.linear(h, w2), None) + b2  # (s, b, h), whole
        with led.phase("backward"):
            if y.requires_grad:
                y.backward(dy)
    return {"y": y.detach(), "dx": x.grad, "grads": {
        "fc1.weight": w1.grad, "fc1.bias": b1.grad, "fc2.weight": w2.grad,
        "fc2.bias": b2.grad}, "mine": (mine.start, mine.stop),
        "ops": [(r.phase, r.op) for r in led.records]}


def check_conjugate_operators(cluster, f, g, *, timeout: float = SHORT_TIMEOUT
                              ) -> bool:
    """Check a student's f and g on a tensor-parallel MLP, Linear(12, 16), GeLU,
    Linear(16, 12), on every rank of the cluster.

    `f(x, group)` and `g(x, group)` return tensors autograd can differentiate
    through (an autograd.Function's .apply). The MLP's first layer is
    column-parallel with f before it, the second row-parallel with g after it.
    Output, input gradient and every weight gradient are compared with one
    process's MLP; a wrong one is reported by rank, tensor and element, with which
    of f and g (forward or backward) can produce that mistake."""
    res = run_answer(cluster, _fg_worker, f, g, what="f and g", timeout=timeout)
    if res is None:
        return NOT_YET
    t = cluster.world_size
    y, dx, grads = _reference()
    y64, dx64, grads64 = _reference("float64")
    for rank, r in enumerate(res):
        want, exact = (_sliced(g, *r["mine"]) for g in (grads, grads64))
        if not _close(r["y"], y, y64):
            raise ExerciseError(_fg_message(rank, "the output", r["y"], y, y64, t, (
                "The forward is wrong: f must return x unchanged (every rank "
                "already holds the whole x) and g must sum the t partial outputs "
                "(all-reduce, op=SUM).")))
        if r["dx"] is None:
            raise ExerciseError(
                f"rank {rank}: x got no gradient: f must be differentiable. Write "
                "it as a torch.autograd.Function (forward and backward) and return "
                "MyF.apply(x, group), not a tensor made under no_grad or detached")
        for name, w in want.items():
            got = r["grads"][name]
            if got is None or not _close(got, w, exact[name]):
                raise ExerciseError(_fg_message(rank, f"the gradient of {name}", got,
                                                w, exact[name], t, (
                    "g's backward must be the identity: the loss's gradient reaches "
                    "every rank's partial output whole, and an all-reduce there "
                    "multiplies it by t.")))
        if not _close(r["dx"], dx, dx64):
            raise ExerciseError(_fg_message(rank, "x's gradient", r["dx"], dx, dx64,
                                            t, (
                "f's backward must all-reduce (sum) the gradient: each rank's x.grad "
                "holds only the part that flowed through its own columns of the "
                "first layer.")))
        ops = r["ops"]
        if ops != [("forward", "all_reduce"), ("backward", "all_reduce")]:
            raise ExerciseError(
                f"rank {rank}: the values are right, but the collectives were {ops} "
                "(phase, op): f and g together need one all-reduce forward (g) and "
                "one backward (f)")
    allowed = max(rounding_tolerance(a, b) for a, b in (
        (y, y64), (dx, dx64), *((grads[k], grads64[k]) for k in grads)))
    print(f"correct: output, x's gradient and every weight's gradient match one "
          f"process on all {t} ranks (within {allowed:.1g}, the rounding of one "
          "process's float32), with one all-reduce forward (g) and one backward (f)")
    return PASSED


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


def check_whole_over_half(what: str, t, *, heads: int, ffn: int, whole: float,
                          activation_bytes) -> bool:
    """The smallest tensor-parallel degree t at which the activations every rank
    holds whole (`whole` bytes) are more than half of a rank's activations,
    `activation_bytes(t)`, among the t that split the model: t must divide the
    attention heads (each rank computes whole heads) and the MLP's `ffn`
    features. None: not answered yet."""
    if t is None:
        not_yet(f"{what}: not answered yet (replace None with your t)")
        return NOT_YET
    if not is_number(t) or t < 1 or \
            not float(t).is_integer():      # 4, 4.0 and numpy's 4 are all 4
        raise ExerciseError(f"{what}: t is a whole number of ranks >= 1, not {t!r}")
    t = int(t)
    if heads % t or ffn % t:
        raise ExerciseError(
            f"{what}: t = {t} cannot split the model: {heads} attention heads "
            f"and {ffn} MLP features over {t} ranks leave "
            f"{heads / t:g} heads and {ffn / t:g} features a rank; each rank "
            f"computes whole heads, so t must divide {heads} (and {ffn})")
    fits = [d for d in range(1, heads + 1) if heads % d == 0 and ffn % d == 0]
    want = next((d for d in fits if 2 * whole > activation_bytes(d)), None)
    if want is None:
        raise ExerciseError(f"{what}: no t that splits {heads} heads qualifies; "
                            "the exercise expects one")
    if t != want:
        share = whole / activation_bytes(t)
        why = ("not more than half yet" if t < want else
               f"but already at t = {want}, a smaller divisor of {heads}")
        raise ExerciseError(
            f"{what}: at t = {t} the whole activations are {share:.0%} of a "
            f"rank's, {why}; among the t that divide {heads} heads the answer is "
            f"{'larger' if t < want else 'smaller'}")
    skipped = [d for d in range(1, want) if 2 * whole > activation_bytes(d)]
    note = (f"; t = {', '.join(map(str, skipped))} would satisfy the inequality "
            f"but cannot split {heads} heads" if skipped else "")
    print(f"{what}: right, t = {t}: {whole / activation_bytes(t):.0%} of a rank's "
          f"activations stay whole{note}")
    return PASSED
