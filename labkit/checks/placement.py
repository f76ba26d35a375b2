"""Chapter 08's checks: place a strategy (P, O, G, A and its collectives) and
predict its bytes, or design one that fits a budget; the check says which state,
which collective, which number or which limit is wrong.

`check_design` runs the student's placement itself, on the ranks, on the
chapter's model and on two shapes of it drawn fresh each run: the predicted
bytes must be a formula of the shape (a number read off the chapter's runs
fails the next shape), and labkit's calculator and any measuring while the
answer runs are refused.
"""

from __future__ import annotations

import random

from labkit.checks.common import (
    NOT_WRITTEN,
    NOT_YET,
    not_yet,
    PASSED,
    ExerciseError,
    call_answer,
    finite,
    is_number,
    labkit_cluster,
)
from labkit.checks.verify import fresh_seed, own_calls, refuse_own
from labkit.conventions import STATE_LETTERS
from labkit.theory import Placement

LABELS = {"sent": "bytes sent per step", "pcie": "bytes over PCIe per step"}
DESIGN_KEYS = ("P", "O", "G", "A", "sent", "pcie")


def _compare_placement(what: str, yours, want: Placement) -> None:
    if not isinstance(yours, Placement):
        raise ExerciseError(f"{what}: expected a labkit.theory.Placement, got "
                            f"{yours!r}")
    for s, name in STATE_LETTERS.items():
        if getattr(yours, s) != getattr(want, s):
            raise ExerciseError(
                f"{what}: {s} ({name}) is {getattr(want, s)} in this strategy, "
                f"not {getattr(yours, s)}")
    for sync, label in (("grad_sync", "gradients"), ("param_sync", "parameters")):
        got = getattr(yours, f"resolved_{sync}")()
        need = getattr(want, f"resolved_{sync}")()
        if got != need:
            raise ExerciseError(
                f"{what}: the {label} are synchronised by {need or 'nothing'} in "
                f"this strategy, not by {got or 'nothing'} (set {sync}=)")


def _compare_bytes(what: str, predicted: dict, measured: dict, rel: float,
                   exact) -> None:
    for key, got in measured.items():
        guess = predicted[key]
        if not is_number(guess):
            raise ExerciseError(f"{what}: {key} must be a number, got {guess!r}")
        finite(f"{what}: {key}", guess)
        tol = 0 if key in exact else rel * max(abs(got), 1)
        if abs(guess - got) > tol:
            label = (f"bytes of {STATE_LETTERS[key]}" if key in STATE_LETTERS
                     else LABELS.get(key, "bytes sent per step"))
            off = guess - got
            why = (f"{off:+,.0f} bytes: count every small tensor too (a step "
                   "counter is 4 bytes)" if abs(off) <= 64
                   else f"{guess / max(got, 1):.3g}×" if got
                   else f"{off:+,.0f} bytes")
            within = "to the byte" if key in exact else f"within {rel:.0%}"
            raise ExerciseError(
                f"{what}: you predicted {guess:,.0f} {label} ({key}); the ledgers "
                f"measured {got:,.0f} ({why}); it must match {within}")


def _answer_pair(what: str, fn):
    """Call the student's function: NOT_WRITTEN for a stub, else the pair
    (Placement, predicted bytes) it must return."""
    answer = call_answer(fn, what=f"{what} answer")
    if answer is not NOT_WRITTEN and not (isinstance(answer, tuple)
                                          and len(answer) == 2):
        raise ExerciseError(f"{what}: return a pair (Placement(...), dict of "
                            f"predicted bytes), not {answer!r}")
    return answer


def check_placement(what: str, yours, predicted, want: Placement, measured: dict,
                    rel: float = 0.01, exact=("P", "O", "G")) -> bool:
    """`yours`: the student's Placement; `predicted`: their bytes per rank, a dict
    with "P", "O", "G" (held) and "sent" (bytes per step), each number or None.
    `want` is the strategy's true Placement and `measured` the same keys as the
    ledgers measured them. Bytes held (the keys in `exact`) must agree to the
    byte, as the memory ledger counts them; bytes sent within `rel` (gloo's
    message headers).

    `yours` may also be the student's function returning (Placement, predicted):
    it is called here, and a stub still raising NotImplementedError is "not
    written yet"."""
    if callable(yours) and not isinstance(yours, Placement):
        answer = _answer_pair(what, yours)
        if answer is NOT_WRITTEN:
            return NOT_YET
        yours, predicted = answer
    if yours is None:
        not_yet(f"{what}: not answered yet (replace None with your Placement)")
        return NOT_YET
    _compare_placement(what, yours, want)
    if predicted is not None and not isinstance(predicted, dict):
        raise ExerciseError(f"{what}: the placement is right; predict the bytes as a "
                            f"dict with keys {', '.join(measured)}, not {predicted!r}")
    if predicted is None or any(predicted.get(k) is None for k in measured):
        print(f"{what}: the placement is right; now predict "
              f"{', '.join(k for k in measured)} in bytes")
        return NOT_YET
    _compare_bytes(what, predicted, measured, rel, exact)
    print(f"{what}: placement and bytes right "
          f"({', '.join(f'{k} {measured[k]:,.0f}' for k in measured)})")
    return PASSED


# ------------------------------------------------------------ design for a budget

CHAPTER_SHAPE = (512, 8)  # chapter 08: four Linear(512, 512), 32 rows over 4 ranks
MiB = 2**20
# labkit's calculator, anything that measures, and this check's runner: never
# part of a prediction
_OWN_DESIGN = ("labkit.theory.placement:Placement.cost",
               "labkit.runtime.cluster:Cluster.run", "labkit.ledger.memory_ledger",
               "labkit.ledger.traffic_ledger", "labkit.checks.placement:_measure")
RUNS = ("P Replicated; O Replicated, Sharded or Offloaded; G Replicated or Sharded "
        "(Sharded reduce-scatters); A Replicated or Materialized")


def _runnable(pl: Placement) -> bool:
    """What _measure builds: the placements chapter 08's `make` builds."""
    return (pl.P == "Replicated" and pl.O in ("Replicated", "Sharded", "Offloaded")
            and pl.G in ("Replicated", "Sharded")
            and pl.A in ("Replicated", "Materialized")
            and not (pl.G == "Sharded" and pl.resolved_grad_sync() != "reduce_scatter"))


def _measure(rank, world_size, modes, grad_sync, width, rows):
    """One step of chapter 08's model (four Linear(width, width), GELU between,
    fp32 Adam, `rows` rows a rank) placed as `modes` says, inside the memory
    ledger, and one inside the traffic ledger: what one rank holds and moves."""
    from collections import OrderedDict
    from functools import partial

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from labkit.ledger import memory, traffic
    from labkit.parallel import (OffloadedOptimizer, ShardedOptimizer,
                                 activation_checkpoint)

    _, opt_mode, grad_mode, act_mode = modes  # O, G, A
    torch.manual_seed(0)
    parts = []
    for i in range(1, 5):
        parts += [(f"L{i}", torch.nn.Linear(width, width)), (f"gelu{i}",
                                                             torch.nn.GELU())]
    model = torch.nn.Sequential(OrderedDict(parts[:-1]))
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randn(rows, width, generator=g) for _ in range(2))
    adam = torch.optim.Adam
    if opt_mode == "Offloaded":  # Adam's slice, and its step, in host memory
        adam = partial(OffloadedOptimizer, optimizer_cls=adam)
    if opt_mode == "Replicated":
        opt = adam(model.parameters())
    elif grad_mode == "Sharded":  # ZeRO-2: one layer a bucket
        opt = ShardedOptimizer(model.parameters(), adam, stage=2, gather="all_gather",
                               bucket_mib=4 * (width * width + width) / MiB)
    else:  # ZeRO-1
        opt = ShardedOptimizer(model.parameters(), adam, stage=1, gather="all_gather",
                               reduce_scatter_gradients=grad_sync == "reduce_scatter")
    if act_mode == "Materialized":  # a checkpointed block per layer
        model = activation_checkpoint(model, every=2)
    forward = []

    def step(mem=None):
        opt.zero_grad()
        out = model(x)
        if mem is not None:
            forward.append(mem.peak["Activation"])
        F.mse_loss(out, y).backward()
        if grad_sync == "all_reduce":
            for p in model.parameters():
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        opt.step()

    with memory(model, opt) as mem:
        step(mem)
    with traffic() as sent:
        step()
    return dict(P=mem.current["Parameter"], O=mem.current["Optstate"],
                G=mem.peak["Gradient"], A=forward[0],
                sent=sum(r.bus_bytes for r in sent.records),
                pcie=opt.optim.bytes_moved[-1] if opt_mode == "Offloaded" else 0)


def _shapes(seed: int) -> list[tuple[int, int]]:
    """The chapter's shape, then two drawn from `seed`: widths that are
    multiples of 4 (every slice whole), a few rows a rank."""
    rng = random.Random(seed)
    out = [CHAPTER_SHAPE]
    while len(out) < 3:
        shape = (4 * rng.randint(16, 80), rng.randint(2, 12))
        if shape not in out:
            out.append(shape)
    return out


def _design_answer(what: str, fn, width: int, rows: int, n: int):
    """The student's (Placement, predicted) for one shape; NOT_WRITTEN for a stub."""
    where = f"{what}, width {width}, {rows} rows a rank"
    with own_calls(*_OWN_DESIGN) as own:
        answer = call_answer(fn, width, rows, n, what=f"{what} answer")
    if own:
        measured = own[0].split(".")[-1] != "cost"
        refuse_own(where, own, "calculator (derive the bytes from the modes)"
                   if not measured else "runner or ledgers (a prediction is "
                   "computed before anything runs, not measured)")
    if answer is NOT_WRITTEN:
        return answer
    if not (isinstance(answer, tuple) and len(answer) == 2):
        raise ExerciseError(f"{where}: return a pair (Placement(...), dict of "
                            f"predicted bytes), not {answer!r}")
    pl, predicted = answer
    if not isinstance(pl, Placement):
        raise ExerciseError(f"{where}: expected a labkit.theory.Placement, got "
                            f"{pl!r}")
    if not isinstance(predicted, dict) or set(predicted) != set(DESIGN_KEYS):
        raise ExerciseError(f"{where}: predict the bytes as a dict with keys "
                            f"{', '.join(DESIGN_KEYS)}, not {predicted!r}")
    for key in DESIGN_KEYS:
        if not is_number(predicted[key]):
            raise ExerciseError(f"{where}: {key} must be a number of bytes, got "
                                f"{predicted[key]!r}")
        finite(f"{where}: {key}", predicted[key])
    return pl, predicted


def _design_hint(key: str, guess: float, got: float, width: int, rows: int,
                 n: int, first: dict | None) -> str:
    """Why a prediction is off, where it is a usual mistake."""
    layer = width * width + width
    psi, unit = 4 * layer, rows * width * 4
    if first is not None and guess == first[key] and guess != got:
        return (f"; that is the {key} measured at width {CHAPTER_SHAPE[0]}: the "
                "prediction must follow width, rows and n, not a number read off "
                "the chapter's runs")
    near = {
        "P": {2 * psi: "this model trains in fp32: 4 bytes a parameter, Ψ = "
              "4(width² + width) parameters"},
        "O": {12 * psi // n: "fp32 Adam keeps m and v, 8 bytes a parameter "
              "(mixed precision's 12 adds a master copy this model does not "
              "have)", 12 * psi: "fp32 Adam keeps m and v, 8 bytes a parameter"},
        "G": {got - 4 * layer: "the gradient bucket in flight: backward fills one "
              "layer's whole gradients, 4(width² + width) bytes, before they are "
              "reduce-scattered"},
        "A": {7 * unit: "checkpointing per layer keeps the 4 layer outputs, 4 of "
              "the 7 activations forward saves", 4 * unit: "A Replicated keeps all "
              "7 activations forward saves, 4·rows·width bytes each"},
        "sent": {(n - 1) / n * 4 * psi: "a reduce-scatter and an all-gather (or "
                 "an all-reduce, which is both) send (N-1)/N of the model each",
                 2 * 4 * psi: "a ring sends (N-1)/N of the payload per pass, not "
                 "all of it"},
        "pcie": {4 * psi // n: "the gradient slice goes down to the host and the "
                 "updated parameter slice comes back up: (4 + 4)Ψ/N"},
    }
    for value, why in near.get(key, {}).items():
        if value != got and abs(guess - value) <= 1e-9 * max(abs(value), 1):
            return f"; {why}"
    off = guess - got
    if 0 < abs(off) <= 64:
        return "; count every small tensor too (a step counter is 4 bytes)"
    if got == 0:
        return f"; the ledgers measured none ({off:+,.0f} bytes)"
    return f" ({guess / got:.3g}×)"


def check_design(what: str, cluster, fn, *, device_mib: float,
                 pcie: float | None = None, fixed: dict | None = None) -> bool:
    """A placement designed to fit a budget, and its bytes predicted.

    `fn(width, rows, n)` returns (Placement, predicted) for chapter 08's model,
    four Linear(width, width) with GELU between, fp32 Adam, `rows` rows on each
    of n ranks: predicted a dict with DESIGN_KEYS, "P", "O", "G", "A" the bytes
    one rank holds on the device (P and O after the step, G at its peak, A when
    forward ends), "sent" the bytes it sends per step as a ring counts them
    (the ledger's bus bytes, without gloo's headers) and "pcie" the bytes it
    moves to or from host memory per step. The check runs the placement on the
    ranks at the chapter's shape (width 512, 8 rows), where it must fit the
    budget: at most `device_mib` MiB on the device (P + O + G + A), DP's
    traffic, at most `pcie` bytes over PCIe (None: no limit); `fixed`: states
    whose mode is prescribed, e.g. {"A": "Replicated"}. Then at two shapes drawn
    fresh each run, the same placement. Every prediction must match the ledgers
    (to a float's rounding). While `fn` runs, labkit's calculator
    (Placement.cost) and anything that measures are refused."""
    n = cluster.world_size
    shapes = _shapes(fresh_seed())
    answers = []
    for width, rows in shapes:
        answer = _design_answer(what, fn, width, rows, n)
        if answer is NOT_WRITTEN:
            return NOT_YET
        answers.append(answer)
    pl = answers[0][0]
    for s, mode in (fixed or {}).items():
        if getattr(pl, s) != mode:
            raise ExerciseError(f"{what}: {s} ({STATE_LETTERS[s]}) must be {mode} "
                                f"here, not {getattr(pl, s)}")
    verdict = pl.check(k=8)
    if not verdict.ok:
        raise ExerciseError(f"{what}: this placement does not train what one "
                            f"process trains: {'; '.join(verdict.problems)}")
    if not _runnable(pl):
        raise ExerciseError(f"{what}: this chapter cannot run P {pl.P}, O {pl.O}, "
                            f"G {pl.G}, A {pl.A} (gradients by "
                            f"{pl.resolved_grad_sync()}); it runs {RUNS}")
    for (width, rows), (other, _) in zip(shapes[1:], answers[1:]):
        if other != pl:
            raise ExerciseError(
                f"{what}: at width {width}, {rows} rows your design is {other}, at "
                f"the chapter's shape {pl}; the budget picks one design, and its "
                "bytes follow the shape")
    first = None
    for (width, rows), (_, predicted) in zip(shapes, answers):
        measured = labkit_cluster(cluster).run(
            _measure, tuple(getattr(pl, s) for s in "POGA"),
            pl.resolved_grad_sync(), width, rows)[0]
        if first is None:
            _fits(what, measured, n, device_mib, pcie)
        for key in DESIGN_KEYS:
            guess, got = float(predicted[key]), measured[key]
            if not abs(guess - got) <= 1e-9 * max(abs(got), 1):
                label = (f"bytes of {STATE_LETTERS[key]}" if key in STATE_LETTERS
                         else LABELS[key])
                raise ExerciseError(
                    f"{what}, width {width}, {rows} rows a rank: you predicted "
                    f"{guess:,.0f} {label} ({key}); the ledgers measured {got:,.0f}"
                    + _design_hint(key, guess, got, width, rows, n, first))
        if first is None:
            first = measured
    device = sum(first[s] for s in "POGA")
    held = ", ".join(f"{k} {first[k]:,.0f}" for k in DESIGN_KEYS)
    print(f"{what}: fits ({device:,.0f} of {device_mib * MiB:,.0f} bytes on the "
          f"device at width {CHAPTER_SHAPE[0]}), and every byte you predicted is "
          f"what the ledgers measured, there and at widths {shapes[1][0]} and "
          f"{shapes[2][0]} (drawn this run); at width {CHAPTER_SHAPE[0]}: {held}")
    return PASSED


def _fits(what: str, measured: dict, n: int, device_mib: float,
          pcie: float | None) -> None:
    """The budget at the chapter's shape: device bytes, DP's traffic, PCIe."""
    width = CHAPTER_SHAPE[0]
    psi = 4 * (width * width + width)
    dp = 2 * (n - 1) * 4 * psi / n  # DP's ring all-reduce of 4Ψ bytes
    device = sum(measured[s] for s in "POGA")
    held = ", ".join(f"{s} {measured[s]:,.0f}" for s in "POGA")
    for key, got, limit in (("device", device, device_mib * MiB),
                            ("sent", measured["sent"], dp),
                            ("pcie", measured["pcie"], pcie)):
        if limit is not None and got > limit * (1 + 1e-12):
            amount = (f"holds {got:,.0f} bytes on the device ({held})" if key ==
                      "device" else f"moves {got:,.0f} {LABELS[key]}")
            allows = (f"{limit:,.0f} ({device_mib} MiB)" if key == "device" else
                      f"{limit:,.0f} (DP's)" if key == "sent" else f"{limit:,.0f}")
            raise ExerciseError(
                f"{what}: measured on the ranks, your placement {amount}; the "
                f"budget allows {allows}: which state could live elsewhere?")
