"""Chapter 07's check that runs ranks: a ZeRO-3 layer with autograd on (gather
before forward, free after it, gather again for backward, reduce-scatter the
gradients), on a layer and data drawn fresh each run, under the traffic ledger.
The arithmetic exercises (the share of the weights a rank holds at its peak, the
fewest units that fit) are in fsdp_arithmetic, and importable from here too."""

from __future__ import annotations

import copy

from labkit.checks.common import (
    NOT_YET,
    PASSED,
    SHORT_TIMEOUT,
    ExerciseError,
    run_answer,
    wrong_element,
)
from labkit.checks.fsdp_arithmetic import check_min_units, check_peak_share
from labkit.checks.verify import fresh_seed, own_calls, refuse_own

__all__ = ["check_min_units", "check_peak_share", "check_zero3_hooks"]

IN, OUT = 10, 7  # a Linear whose weight (70) and bias (7) are not multiples of 4
# labkit's own FSDP (its hooks, reduce-scatter) and rings: never the answer
_OWN = ("labkit.parallel.fsdp", "labkit.parallel.fsdp_units",
        "labkit.parallel.reduce_scatter", "labkit.comm.collectives")


def _layer_and_shards(rank: int, n: int, seed: int):
    """The full Linear, its weights drawn from `seed` (the same in every process),
    and this rank's padded 1-D shards of its weight and bias: {name: s
    elements}, s = ceil(numel / n)."""
    import torch

    full = torch.nn.Linear(IN, OUT)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in full.parameters():
            p.copy_(torch.rand(p.shape, generator=gen) * 2 - 1)
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


class _Unfilled(RuntimeError):
    """Backward read a saved tensor whose storage was not gathered again."""


def _saved_watch(kept: list):
    """saved_tensors_hooks that keep every tensor forward saves in `kept` and
    raise _Unfilled when backward reads one that has no bytes behind it."""
    def pack(t):
        kept.append(t)
        return t

    def unpack(t):
        if t.numel() and not t.untyped_storage().nbytes():
            raise _Unfilled(f"a saved tensor of shape {tuple(t.shape)}")
        return t
    return pack, unpack


def _hooks_worker(rank, world_size, fn, seed):
    with own_calls(*_OWN) as own:
        out = _hooks_run(rank, world_size, fn, seed)
    return {**out, "own": list(own)}


def _hooks_run(rank, world_size, fn, seed):
    import torch

    from labkit.ledger import traffic

    full, shards, shapes = _layer_and_shards(rank, world_size, seed)
    shards = {k: torch.nn.Parameter(v) for k, v in shards.items()}
    layer = torch.nn.Linear(IN, OUT)
    for name in shapes:
        delattr(layer, name)  # the layer starts with nothing of its own
    returned = fn(layer, shards, shapes)
    if returned is not None and not layer._forward_pre_hooks:  # the old API
        return {"returned": repr(returned)[:120]}
    seen = {}

    def look(module, args):  # runs after the student's pre-hook
        seen.update({n: getattr(module, n, None) for n in shapes})
        seen.update({n: None if t is None else t.detach().clone()
                     for n, t in seen.items()})

    layer.register_forward_pre_hook(look)
    gen = torch.Generator().manual_seed(seed + 1 + rank)
    # an input that needs its gradient, as a middle layer's does: forward saves
    # the weight for it, so that freeing must reach what autograd holds
    x = torch.randn(3, IN, generator=gen).requires_grad_()
    g = torch.randn(3, OUT, generator=gen)  # the output's gradient
    out, kept, backward = None, [], "not run"
    with torch.autograd.graph.saved_tensors_hooks(*_saved_watch(kept)):
        try:
            out = layer(x)
        except RuntimeError as err:  # e.g. a gathered weight of the wrong shape
            if not seen:
                raise
            out = err
    own = x.untyped_storage().data_ptr()
    saved = {s.data_ptr(): s.nbytes() for s in
             (k.untyped_storage() for k in kept) if s.data_ptr() != own}
    held, still = _held(layer), sum(saved.values())
    if isinstance(out, torch.Tensor):
        try:
            out.backward(g)
            backward = "ok"
        except _Unfilled as err:
            backward = f"unfilled: {err}"
        out = out.detach()
    grads = {n: None if s.grad is None else s.grad.detach().clone()
             for n, s in shards.items()}
    ops = []
    if backward == "ok":
        # two more steps: one as autograd runs it (saved-tensor hooks turn off
        # its check that nothing it saved was edited in place), one in the
        # traffic ledger, for what it sends
        for s in shards.values():
            s.grad = None
        try:
            layer(x).backward(g)
        except RuntimeError as err:
            if "inplace operation" not in str(err):
                raise
            backward = "inplace"
    if backward == "ok":
        with traffic() as t:
            layer(x).backward(g)
        ops = [(r.op, r.elements) for r in t.records]
    ref = {}
    for dtype in (torch.float32, torch.float64):  # this rank's whole gradients
        f = copy.deepcopy(full).to(dtype)
        (f(x.detach().to(dtype)) * g.to(dtype)).sum().backward()
        ref[dtype] = {n: p.grad.flatten() for n, p in f.named_parameters()}
    return {"seen": seen, "out": out, "want_out": full(x).detach(),
            "exact_out": copy.deepcopy(full).double()(x.double()).detach(),
            "want": {n: p.detach() for n, p in full.named_parameters()},
            "held": held, "saved": still, "backward": backward,
            "grads": grads,
            "ref": ref[torch.float32], "ref64": ref[torch.float64],
            "ops": ops}


def check_zero3_hooks(cluster, fn, *, timeout: float = SHORT_TIMEOUT) -> bool:
    """Check a student's ZeRO-3 layer, forward and backward, on a Linear(10, 7)
    whose input needs its gradient (as a middle layer's does), autograd on.

    `fn(layer, shards, shapes)` registers hooks on `layer` (its return value is
    not used). `layer` has no weight or bias; shards[name] is this rank's 1-D
    piece of that parameter (an nn.Parameter of ceil(numel/N) elements, the last
    rank's zero-padded); shapes[name] its full shape. Before forward the layer
    must all-gather every parameter and set it on the layer (trimmed, shaped);
    after forward free it — its storage, which autograd's saved tensors share;
    before the layer's backward gather it again; and put the mean over the ranks
    of piece r of each whole gradient in rank r's shards[name].grad. A mistake is
    reported by rank, tensor and first wrong element, or by what was still held
    after forward, or by what backward found freed. The layer and the data are
    drawn fresh each run; then each rank is held to the collectives of a step
    (the traffic ledger's): an all-gather of every parameter for forward and
    again for backward (the bias may be left out of the second: backward does
    not read it), a reduce-scatter of every whole gradient (on gloo an
    all-to-all and a local sum), nothing else; labkit's own FSDP is refused.
    """
    seed = fresh_seed()
    res = run_answer(cluster, _hooks_worker, fn, seed, what="ZeRO-3 hooks",
                     timeout=timeout)
    if res is None:
        return NOT_YET
    n = cluster.world_size
    for rank, r in enumerate(res):
        refuse_own(f"rank {rank}", r["own"], "FSDP (or ring)")
    for rank, r in enumerate(res):
        if "seen" not in r:
            raise ExerciseError(
                f"rank {rank}: your function returned {r['returned']} and put no "
                "hook on the layer: register the hooks on the layer "
                "yourself (layer.register_forward_pre_hook(...), ...)")
        _check_forward(rank, r, n)
        if r["saved"]:
            raise ExerciseError(
                f"rank {rank}: after forward autograd's graph still holds "
                f"{r['saved']} bytes of the gathered weight, which forward saved "
                "for backward: dropping the layer's name (delattr) leaves the "
                "tensor to the graph. Free its storage, "
                "`t.untyped_storage().resize_(0)`, and gather into that same "
                "tensor again before backward (into `t.data`, so that autograd "
                "does not take the refill for an in-place edit)")
        if r["backward"].startswith("unfilled"):
            raise ExerciseError(
                f"rank {rank}: the layer's backward read the weight it saved in "
                f"forward ({r['backward'].removeprefix('unfilled: ')}) and found "
                "it freed: gather it again before the layer's backward, e.g. in a "
                "hook on the forward output's gradient (out.register_hook), which "
                "runs just before")
        if r["backward"] == "inplace":
            raise ExerciseError(
                f"rank {rank}: backward says a tensor it saved was modified in "
                "place: your gather for backward wrote into it. Gather or copy "
                "into `full.data` (the same storage, which autograd does not count "
                "as an edit of what it saved)")
    _check_gradients(res, n)
    padded = {k: n * -(-v.numel() // n) for k, v in res[0]["want"].items()}
    for rank, r in enumerate(res):
        _zero3_calls(rank, r["ops"], padded)
    gathered = sum(k for op, k in res[0]["ops"] if op == "all_gather")
    print("correct: on a layer and data drawn this run, every rank gathered the "
          "weight and bias in rank order, freed their storage after forward "
          "(autograd held nothing whole), gathered again for backward, and kept "
          "its piece of the averaged gradients; measured on every rank, a step: "
          f"all-gathers of {gathered} elements, a reduce-scatter of "
          f"{_sum_text(padded, 1)}, nothing else")
    return PASSED


def _sum_text(padded: dict, times: int) -> str:
    terms = " + ".join(str(v) for v in padded.values())
    return terms if times == 1 else f"{times} × ({terms})"


def _zero3_calls(rank: int, calls, padded: dict) -> None:
    """A step's collectives, after the values: all-gathers of every (padded)
    parameter in forward and of at least the weight again in backward, a
    reduce-scatter of every whole gradient."""
    where = f"rank {rank}, the values are right, but"
    ops = [op for op, _ in calls if op != "barrier"]
    other = sorted(set(ops) - {"all_gather", "all_to_all", "reduce_scatter"})
    if other:
        raise ExerciseError(
            f"{where} it used {other}: an all-gather brings every shard to every "
            "rank, and a reduce-scatter (on gloo: an all-to-all and a local sum) "
            "brings each rank its piece of the summed gradients only"
            + (", where an all-reduce sends every rank all of them"
               if "all_reduce" in other else ""))
    total = sum(padded.values())
    gathered = sum(k for op, k in calls if op == "all_gather")
    scattered = sum(k for op, k in calls if op in ("all_to_all", "reduce_scatter"))
    if not total + padded["weight"] <= gathered <= 2 * total:
        raise ExerciseError(
            f"{where} its all-gathers carried {gathered} elements in a step; a "
            f"ZeRO-3 layer gathers each parameter ({_sum_text(padded, 1)} padded "
            "elements) for forward and again, after freeing it, for backward "
            f"(the weight at least): {total + padded['weight']} to {2 * total}")
    if scattered != total:
        raise ExerciseError(
            f"{where} its reduce-scatters carried {scattered} elements in a step; "
            f"each whole gradient goes once, {_sum_text(padded, 1)} = {total} "
            "padded elements")


def _check_forward(rank: int, r: dict, n: int) -> None:
    """What forward saw, what it computed and what the layer held after it."""
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
    # the parameters were bit for bit full's: the output is one process's, to its
    # float32 rounding (a student's weight laid out otherwise may take another
    # kernel)
    out = r["out"]
    if getattr(out, "shape", None) != r["want_out"].shape or wrong_element(
            out, r["want_out"], r["exact_out"]) is not None:
        raise ExerciseError(f"rank {rank}: the parameters were right but the "
                            "output is not: do not change the input or output")
    big = {k: v for k, v in r["held"].items()
           if k in r["want"] and v > -(-r["want"][k].numel() // n)}
    if big:
        k, v = next(iter(big.items()))
        raise ExerciseError(
            f"rank {rank}: after forward the layer still holds {k} with {v} "
            "elements (the whole parameter): the post-forward hook must free it "
            "(its storage: `t.untyped_storage().resize_(0)`), so that only the "
            "shards stay")


def _check_gradients(res: list, n: int) -> None:
    """Rank r's shards[name].grad: piece r of the mean over the ranks of the whole
    gradients, to the float32 reference's own rounding against float64."""
    import torch

    for name in res[0]["ref"]:
        s = res[0]["grads"][name].numel() if res[0]["grads"][name] is not None \
            else -(-res[0]["ref"][name].numel() // n)
        pieces = {}
        for key in ("ref", "ref64"):
            mean = torch.stack([r[key][name] for r in res]).mean(0)
            pieces[key] = torch.zeros(n * s, dtype=mean.dtype)
            pieces[key][:mean.numel()] = mean
        for rank, r in enumerate(res):
            got = r["grads"][name]
            want, exact = (pieces[k][rank * s:(rank + 1) * s] for k in
                           ("ref", "ref64"))
            if got is None:
                raise ExerciseError(
                    f"rank {rank}: after backward shards['{name}'].grad is None: "
                    "reduce-scatter the whole gradient once it is complete (e.g. "
                    "in a post-accumulate-grad hook) and set the shard's .grad to "
                    "this rank's piece of the mean")
            if tuple(got.shape) != tuple(want.shape):
                raise ExerciseError(
                    f"rank {rank}: shards['{name}'].grad has shape "
                    f"{tuple(got.shape)}, expected {tuple(want.shape)}: this "
                    "rank's piece only, padding included")
            # the mean cancels: a right answer rounds by units of the ranks'
            # own gradients (the terms), not of the small mean
            terms = max(r["ref64"][name].abs().max().item() for r in res)
            bad = wrong_element(got, want, exact, scale=terms)
            if bad is not None:
                i, g, e, tol = bad
                hint = ("that is N times the mean: divide the sum by N" if
                        abs(g - n * e) <= n * tol else "rank r keeps piece r of the "
                        "mean over the ranks of the whole (padded) gradient")
                raise ExerciseError(
                    f"rank {rank}, shards['{name}'].grad, element {i}: got "
                    f"{g:.6g}, expected {e:.6g} (± {tol:.1e}): {hint}")
