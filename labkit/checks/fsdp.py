"""Chapter 07's checks: the ZeRO-3 forward hook pair (gather before, free after),
and the share of the weights a rank holds at its peak."""

from __future__ import annotations

import copy

from labkit.checks.common import (
    NOT_YET,
    PASSED,
    NOT_WRITTEN,
    ExerciseError,
    call_answer,
    run_answer,
    wrong_element,
)

IN, OUT = 10, 7  # a Linear whose weight (70) and bias (7) are not multiples of 4


def _layer_and_shards(rank: int, n: int):
    """The full Linear (the same in every process) and this rank's padded 1-D
    shards of its weight and bias: {name: s elements}, s = ceil(numel / n)."""
    import torch

    torch.manual_seed(0)
    full = torch.nn.Linear(IN, OUT)
    shards, shapes = {}, {}
    for name, p in full.named_parameters():
        s = -(-p.numel() // n)
        flat = torch.zeros(n * s)
        flat[:p.numel()] = p.detach().flatten()
        shards[name], shapes[name] = flat[rank * s:(rank + 1) * s].clone(), p.shape
    return full, shards, shapes


def _held(layer) -> dict[str, int]:
    """Elements of every tensor the layer keeps as an attribute or parameter."""
    import torch

    out = {k: v.numel() for k, v in layer._parameters.items() if v is not None}
    out.update({k: v.numel() for k, v in vars(layer).items()
                if isinstance(v, torch.Tensor) and v.untyped_storage().nbytes()})
    return out


def _hooks_worker(rank, world_size, fn):
    import torch

    from labkit.ledger import traffic

    full, shards, shapes = _layer_and_shards(rank, world_size)
    layer = torch.nn.Linear(IN, OUT)
    for name in shapes:
        delattr(layer, name)  # the layer starts with nothing of its own
    hooks = fn(layer, shards, shapes)
    if not (isinstance(hooks, tuple) and len(hooks) == 2
            and all(callable(h) for h in hooks)):
        return {"returned": hooks if hooks is None else repr(hooks)[:120]}
    pre, post = hooks
    seen = {}

    def look(module, args):  # runs after the student's pre-hook
        seen.update({n: getattr(module, n, None) for n in shapes})
        seen.update({n: None if t is None else t.detach().clone()
                     for n, t in seen.items()})

    layer.register_forward_pre_hook(pre)
    layer.register_forward_pre_hook(look)
    layer.register_forward_hook(post)
    x = torch.randn(3, IN, generator=torch.Generator().manual_seed(10 + rank))
    out = None
    with torch.no_grad(), traffic() as t:
        try:
            out = layer(x)
        except RuntimeError as err:  # e.g. a gathered weight of the wrong shape
            if not seen:
                raise
            out = err
    return {"seen": seen, "out": out, "want_out": full(x).detach(),
            "exact_out": copy.deepcopy(full).double()(x.double()).detach(),
            "want": {n: p.detach() for n, p in full.named_parameters()},
            "held": _held(layer), "ops": set(t.by_op())}


def check_zero3_hooks(cluster, fn) -> bool:
    """Check a student's ZeRO-3 forward hook pair on a Linear(10, 7).

    `fn(layer, shards, shapes)` returns (pre_forward, post_forward), hooks for
    register_forward_pre_hook and register_forward_hook. `layer` has no weight or
    bias; shards[name] is this rank's 1-D piece of that parameter (ceil(numel/N)
    elements, the last rank's zero-padded); shapes[name] its full shape. The pre
    hook must all-gather every parameter and set it on the layer (trimmed to its
    shape); the post hook must free it. A mistake is reported by rank, tensor and
    first wrong element, or by what the layer still holds after forward.
    """
    res = run_answer(cluster, _hooks_worker, fn, what="gather and free hooks")
    if res is None:
        return NOT_YET
    for rank, r in enumerate(res):
        if "returned" in r:
            raise ExerciseError(
                f"rank {rank}: your function returned {r['returned']}: return a pair "
                "(pre, post) of functions, pre(module, args) to gather before "
                "forward and post(module, args, output) to free after it")
        for name, want in r["want"].items():
            got = r["seen"].get(name)
            if got is None:
                raise ExerciseError(
                    f"rank {rank}: when forward ran, layer.{name} was not set: the "
                    "pre-forward hook must put the gathered parameter on the layer")
            if tuple(got.shape) != tuple(want.shape):
                raise ExerciseError(
                    f"rank {rank}, tensor {name}: forward saw shape "
                    f"{tuple(got.shape)}, expected {tuple(want.shape)}: gather all "
                    "N shards, drop the padding past numel, then view as the shape")
            if got.dtype != want.dtype:
                raise ExerciseError(
                    f"rank {rank}, tensor {name}: forward saw dtype {got.dtype}, "
                    f"expected {want.dtype}: keep the shards' dtype")
            bad = (got != want).nonzero()
            if len(bad):
                i = tuple(int(v) for v in bad[0])
                raise ExerciseError(
                    f"rank {rank}, tensor {name}, element {i}: forward saw "
                    f"{float(got[i]):.6g}, expected {float(want[i]):.6g} (the shards "
                    "go in rank order: rank r's piece is elements [r*s, (r+1)*s))")
        # the parameters were bit for bit full's: the output is one process's,
        # to its float32 rounding (a student's weight laid out otherwise may take
        # another kernel)
        out = r["out"]
        if getattr(out, "shape", None) != r["want_out"].shape or wrong_element(
                out, r["want_out"], r["exact_out"]) is not None:
            raise ExerciseError(f"rank {rank}: the parameters were right but the "
                                "output is not: do not change the input or output")
        big = {k: v for k, v in r["held"].items()
               if v > -(-r["want"][k].numel() // cluster.world_size)
               if k in r["want"]}
        if big:
            k, v = next(iter(big.items()))
            raise ExerciseError(
                f"rank {rank}: after forward the layer still holds {k} with {v} "
                f"elements (the whole parameter): the post-forward hook must free "
                f"it (e.g. `del module.{k}`), so that only the shards stay")
        if r["ops"] - {"all_gather"}:
            raise ExerciseError(
                f"rank {rank}: the values are right, but it used "
                f"{sorted(r['ops'] - {'all_gather'})}: one all-gather per "
                "parameter brings every rank's shard to every rank")
    print("correct: every rank gathered the weight and bias in rank order, trimmed "
          "the padding, computed the full layer's output, and freed both after")
    return PASSED


def check_peak_share(fn, measured: dict[tuple[int, int], float]) -> bool:
    """`fn(n_ranks, n_units)`: the fraction of a model's whole fp32 weights one rank
    holds at its peak under FSDP with prefetch, for `n_units` equal units on
    `n_ranks` ranks. `measured`: {(n_ranks, n_units): the fraction a memory
    ledger measured}; the answer must match those within 0.1% and the closed
    form (its shards, plus the unit computing and the one prefetched, whole)
    for other sizes."""
    cases = dict(measured)
    for n, u in ((2, 8), (4, 32), (8, 8), (64, 96)):
        cases.setdefault((n, u), 1 / n + 2 / u)
    for (n, u), want in cases.items():
        got = call_answer(fn, n, u, what="peak share")
        if got is NOT_WRITTEN:
            return NOT_YET
        if isinstance(got, bool) or not isinstance(got, (int, float)):
            raise ExerciseError(f"peak_share({n}, {u}) returned {got!r}: return a "
                                "number, the fraction of the whole fp32 weights")
        # 0.1%: the ledger's fractions are byte counts of whole tensors, the
        # closed form's an ideal; not a rounding
        if abs(got - want) > 1e-3 * want:
            source = ("the memory ledger measured" if (n, u) in measured
                      else "expected")
            raise ExerciseError(
                f"peak_share({n}, {u}) = {got:.4g}, but {source} {want:.4g}. Hint: "
                "between units a rank keeps 1/N of every unit; at the peak one unit "
                "is computing and, with prefetch, the next is already gathered, "
                "both whole")
    print("correct: the shards (1/N of every unit) plus two whole units, as the "
          "ledger measured" + (f" for {sorted(measured)}" if measured else ""))
    return PASSED


def _min_units_reference(psi: float, n: int, budget: float, eb: float):
    import math

    whole = eb * psi
    room = budget - whole / n
    return None if room <= 0 else max(1, math.ceil(2 * whole / room))


def check_min_units(fn, measured: dict | None = None) -> bool:
    """`fn(psi, n, budget, elem_bytes)`: the fewest equal FSDP units a model of psi
    parameters must be cut into so that one rank's weights at their peak (its
    shards, 1/n of the model, plus two whole units: the one computing and the one
    prefetched) fit in `budget` bytes; None when even the shards do not fit.
    `measured`: {(psi, n, budget, elem_bytes): units} where the budget is a peak
    the memory ledger measured with that many units; other cases are held to the
    closed form."""
    cases = dict(measured or {})
    for case in ((70e9, 64, 10e9, 2), (7.5e9, 8, 16e9, 2), (1_000, 4, 1_251, 4),
                 (1_000, 4, 1_000, 4), (8e9, 8, 2e9, 2), (4, 2, 100, 4)):
        cases.setdefault(case, _min_units_reference(*case))
    for (psi, n, budget, eb), want in cases.items():
        got = call_answer(fn, psi, n, budget, eb, what="min_units")
        if got is NOT_WRITTEN:
            return NOT_YET
        where = f"min_units(psi={psi:,.6g}, n={n}, budget={budget:,.6g}, " \
                f"elem_bytes={eb})"
        if want is None:
            if got is not None:
                raise ExerciseError(
                    f"{where} = {got!r}, expected None: the shards alone, "
                    f"elem_bytes·psi/n = {eb * psi / n:,.6g} bytes, already fill "
                    "the budget, so no number of units is enough")
            continue
        if isinstance(got, bool) or not isinstance(got, int):
            raise ExerciseError(f"{where} returned {got!r}: return a whole number "
                                "of units (or None)")
        if got != want:
            source = ("the memory ledger measured that peak with"
                      if (psi, n, budget, eb) in (measured or {}) else "expected")
            whole, shards = eb * psi, eb * psi / n
            why = ("at the peak a rank holds its shards, elem_bytes·psi/n, plus two "
                   "whole units, 2·elem_bytes·psi/U; solve shards + 2·whole/U <= "
                   "budget for the smallest whole U (round up)")
            if got > 0 and abs(shards + whole / got - budget) < abs(
                    shards + 2 * whole / got - budget) and got == -(
                    -whole // (budget - shards)):
                why = ("that counts one whole unit; with prefetch the next unit is "
                       "whole too: two units. " + why)
            raise ExerciseError(f"{where} = {got}, but {source} {want}. Hint: {why}")
    print("correct: the shards plus two whole units fit the budget, with the "
          "fewest units" + (" — as the ledger measured" if measured else ""))
    return PASSED
