"""Chapter 04's checks: an optimizer's bytes per parameter, predicted and then
measured on real ranks; the smallest number of devices whose ZeRO shards fit."""

from __future__ import annotations

import math
from fractions import Fraction

from labkit import ledger
from labkit.conventions import MODEL_STATES  # ZeRO's model states (sec. 3.1)
from labkit.checks.common import (
    NOT_WRITTEN,
    NOT_YET,
    not_yet,
    PASSED,
    ExerciseError,
    call_answer,
    run_answer,
)

_HINTS = {
    "Parameter": "fp32 parameters take 4 bytes each, whatever the optimizer",
    "Gradient": "backward leaves one fp32 gradient per parameter: 4 bytes",
    "Optstate": "plain SGD keeps no state at all; SGD with momentum keeps one fp32 "
                "buffer per parameter (4 bytes); Adam keeps two (m and v, 8 bytes)",
}


def _optimizer_worker(rank, world_size, make):
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 32))
    opt = make(model.parameters())
    if not isinstance(opt, torch.optim.Optimizer):
        return {"problem": f"make_optimizer returned {type(opt).__name__}, not a "
                           "torch.optim optimizer"}
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(rank))
    with ledger.memory(model, opt) as mem:
        model(x).square().mean().backward()
        opt.step()
    return {"psi": sum(p.numel() for p in model.parameters()),
            "current": dict(mem.current), "type": type(opt).__name__,
            "momentum": opt.defaults.get("momentum", 0)}


def check_optimizer_bytes(cluster, make_optimizer, predicted) -> bool:
    """Check a student's optimizer swap and their prediction of its memory.

    `make_optimizer(params)` returns a torch.optim.SGD over params; `predicted` maps
    "Parameter", "Gradient" and "Optstate" to bytes per parameter after one fp32
    training step. Every rank trains a small MLP one step with that optimizer under
    labkit.ledger.memory; the prediction must match what each rank measured.
    """
    res = run_answer(cluster, _optimizer_worker, make_optimizer,
                     what="optimizer")
    if res is None:
        return NOT_YET
    if not isinstance(predicted, dict):
        raise ExerciseError(f"predicted should be a dict like {{'Parameter': 4, ...}}"
                            f", got {type(predicted).__name__}")
    empty = [c for c in MODEL_STATES if predicted.get(c) is None]
    if empty:
        not_yet(f"predicted: {', '.join(empty)} not filled in yet (replace None "
                "with bytes per parameter), then run this cell again")
        return NOT_YET
    for rank, r in enumerate(res):
        if "problem" in r:
            raise ExerciseError(f"rank {rank}: {r['problem']}")
        if r["type"] != "SGD":
            raise ExerciseError(f"rank {rank}: make_optimizer returned {r['type']}; "
                                "the exercise swaps Adam for torch.optim.SGD")
        desc = f"SGD(momentum={r['momentum']:g})"
        for cat in MODEL_STATES:
            p = predicted[cat]
            if isinstance(p, bool) or not isinstance(p, (int, float)):
                raise ExerciseError(f"predicted[{cat!r}] should be a number of bytes "
                                    f"per parameter, got {p!r}")
            measured = r["current"].get(cat, 0) / r["psi"]
            if abs(p - measured) > 0.01:
                raise ExerciseError(
                    f"rank {rank}, {cat}: you predicted {p:g} bytes per parameter; "
                    f"the rank measured {measured:.2f} with your {desc}. "
                    f"Hint: {_HINTS[cat]}")
    r = res[0]
    per = [round(r["current"].get(c, 0) / r["psi"], 2) for c in MODEL_STATES]
    print(f"correct: {desc} holds {per[0]:g} + {per[1]:g} + {per[2]:g} = "
          f"{sum(per):g} bytes per parameter on every rank (fp32 Adam: 4 + 4 + 8 = 16)")
    return PASSED


# ------------------------------------------------------------------ smallest N

K_MIXED = 12  # mixed-precision Adam: fp32 master + m + v


def smallest_n_reference(psi: float, stage: int, capacity: float) -> int | None:
    """The smallest N at which ZeRO `stage`'s model states per device, mixed-
    precision Adam (2 + 2 + 12 bytes per parameter), fit in `capacity` bytes; None
    where no N does. Exact (fractions), so 16 * 70e9 / 14 = 80e9 fits."""
    psi, cap = Fraction(psi), Fraction(capacity)
    whole = (2 + 2 + K_MIXED) * psi
    kept = {0: whole, 1: 4 * psi, 2: 2 * psi, 3: Fraction(0)}[stage]  # not sharded
    if stage == 0:
        return 1 if whole <= cap else None
    if kept >= cap:
        return None
    return max(1, math.ceil((whole - kept) / (cap - kept)))


def _gb(stage: int, psi: float, n: int) -> str:
    from labkit import theory

    return f"{theory.zero_memory(psi, n, stage) / 1e9:,.2f} GB"


def check_smallest_n(fn, capacity: float = 80e9) -> bool:
    """Check a student's `fn(psi, stage, capacity)`: the smallest number of devices
    N at which ZeRO `stage` (0 = plain data parallelism) keeps at most `capacity`
    bytes of mixed-precision Adam model state per device, or None if no N does.
    Tried on 70e9 parameters, Llama 3 70B and smaller models, stages 0 to 3."""
    from labkit import theory

    psis = {"Ψ = 70e9": 70e9, "Llama 3 70B": float(theory.param_count("llama3-70b")),
            "Ψ = 7.5e9": 7.5e9, "GPT-2 small": float(theory.param_count("gpt2-small"))}
    for name, psi in psis.items():
        for stage in (3, 2, 1, 0):
            want = smallest_n_reference(psi, stage, capacity)
            call = (f"{getattr(fn, '__name__', 'your function')}({psi:.6g}, "
                    f"stage={stage}) for {name}")
            try:
                got = call_answer(fn, psi, stage, capacity, what="function")
            except ExerciseError as err:
                raise ExerciseError(f"{call}: {err}") from None
            if got is NOT_WRITTEN:
                return NOT_YET
            if got is not None and (isinstance(got, bool) or not isinstance(
                    got, (int, float)) or not math.isfinite(got) or got != int(got)):
                raise ExerciseError(f"{call} returned {got!r}: return a whole number "
                                    "of devices, or None when no N fits")
            if got == want:
                continue
            cap = f"{capacity / 1e9:g} GB"
            if want is None:
                kept = {0: "all 16Ψ", 1: "the 2Ψ + 2Ψ of parameters and gradients",
                        2: "the 2Ψ of parameters"}[stage]
                raise ExerciseError(
                    f"{call} returned {got}, but no N fits: stage {stage} keeps "
                    f"{kept} on every device, {_gb(stage, psi, 10**9)} even at N = "
                    f"1e9, more than {cap}. Return None")
            if got is None:
                raise ExerciseError(
                    f"{call} returned None, but N = {want} fits: "
                    f"{_gb(stage, psi, want)} per device")
            got = int(got)
            if got < want:
                raise ExerciseError(
                    f"{call} returned {got}, expected {want}: at N = {got} each "
                    f"device keeps {_gb(stage, psi, got)}, more than {cap}")
            hint = (" (N need not be a power of two)" if got & (got - 1) == 0
                    else "")
            raise ExerciseError(
                f"{call} returned {got}, expected {want}: N = {want} already fits "
                f"({_gb(stage, psi, want)} per device; N = {want - 1} keeps "
                f"{_gb(stage, psi, max(1, want - 1))}){hint}")
    n70 = smallest_n_reference(70e9, 3, capacity)
    llama = smallest_n_reference(psis["Llama 3 70B"], 3, capacity)
    print(f"correct on {len(psis) * 4} cases: e.g. Ψ = 70e9 fits in {capacity / 1e9:g}"
          f" GB from N = {n70} under ZeRO-3, Llama 3 70B from N = {llama}, and under "
          "stages 0 to 2 at no N")
    return PASSED
