"""Chapter 04's checks: SGD's bytes per parameter, predicted and then measured on
real ranks for cases drawn afresh each run; the smallest number of devices whose
ZeRO shards fit, on cases drawn afresh, against an exact reference (fractions)
of this module's own."""

from __future__ import annotations

import math
from fractions import Fraction

from labkit import ledger
from labkit.conventions import MODEL_STATES  # ZeRO's model states (sec. 3.1)
from labkit.checks.common import (
    NOT_WRITTEN,
    NOT_YET,
    PASSED,
    SHORT_TIMEOUT,
    ExerciseError,
    call_answer,
    is_finite,
    is_number,
    is_whole,
    run_answer,
)
from labkit.checks.verify import fresh_seed, own_calls, refuse_own

# ------------------------------------------------------------ SGD's bytes

# the dtypes a case may draw: their bytes per number
_DTYPES = {"float32": 4, "bfloat16": 2, "float64": 8}


def _sgd_cases(seed: int) -> list[tuple[float, str]]:
    """(momentum, dtype): the chapter's plain fp32 SGD, then three drawn afresh,
    with and without momentum, in other dtypes too."""
    import random

    rng = random.Random(seed)
    cases = [(0.0, "float32")]
    dtypes = list(_DTYPES)
    for k in range(3):
        momentum = round(rng.uniform(0.5, 0.99), 2) if k != 1 else 0.0
        cases.append((momentum, rng.choice(dtypes[1:] if k == 2 else dtypes)))
    return cases


def _optimizer_worker(rank, world_size, make, cases):
    import torch

    out = []
    for momentum, dtype in cases:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(),
                                    torch.nn.Linear(64, 32)).to(getattr(torch, dtype))
        opt = make(model.parameters(), momentum)
        if not isinstance(opt, torch.optim.Optimizer):
            return {"problem": f"make_optimizer(params, {momentum:g}) returned "
                               f"{type(opt).__name__}, not a torch.optim optimizer"}
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(rank))
        with ledger.memory(model, opt) as mem:
            model(x.to(model[0].weight.dtype)).float().square().mean().backward()
            opt.step()
        out.append({"psi": sum(p.numel() for p in model.parameters()),
                    "current": dict(mem.current), "type": type(opt).__name__,
                    "momentum": opt.defaults.get("momentum", 0)})
    return out


def _sgd_hint(cat: str, p, momentum: float, dtype: str) -> str:
    size = _DTYPES[dtype]
    if cat == "Optstate":
        if momentum and p == 0:
            return (f"with momentum {momentum:g} SGD keeps one buffer per parameter "
                    "(its momentum_buffer) from one step to the next")
        if not momentum and p:
            return ("plain SGD (momentum 0) keeps nothing from one step to the "
                    "next: it updates each parameter from its gradient alone")
        if p == 2 * size:
            return "that is Adam's two moments, m and v; SGD with momentum keeps one"
        if p == 12 or p == 4 + size:
            return ("no fp32 master copy here: SGD updates the parameters in their "
                    "own dtype (that was MasterWeights, section 2)")
    if p == 4 and size != 4:
        return (f"the parameters are {dtype}, {size} bytes a number; a gradient and "
                "a momentum buffer have their parameter's dtype")
    return f"a {dtype} number is {size} bytes"


def check_optimizer_bytes(cluster, make_optimizer, predicted, *,
                          timeout: float = SHORT_TIMEOUT) -> bool:
    """Check a student's SGD and their prediction of its memory.

    `make_optimizer(params, momentum)` returns a torch.optim.SGD over params with
    that momentum; `predicted(momentum, dtype)` maps "Parameter", "Gradient" and
    "Optstate" to the bytes per parameter after one step of it on a model whose
    parameters are `dtype` (a torch.dtype). The cases (plain fp32 SGD, then three
    drawn afresh) are trained one step each on a rank under labkit.ledger.memory;
    every prediction must match what the rank measured. labkit's own table of
    bytes per parameter is refused.
    """
    import torch

    cases = _sgd_cases(fresh_seed())
    guesses = []
    for momentum, dtype in cases:
        call = f"predicted({momentum:g}, torch.{dtype})"
        with own_calls("labkit.theory.zero:bytes_per_param") as own:
            p = call_answer(predicted, momentum, getattr(torch, dtype),
                            what="prediction")
        refuse_own(call, own, "table of bytes per parameter")
        if p is NOT_WRITTEN:
            return NOT_YET
        if not isinstance(p, dict) or set(p) != set(MODEL_STATES):
            raise ExerciseError(f"{call} returned {p!r}; return a dict with the keys "
                                f"{', '.join(map(repr, MODEL_STATES))}, bytes per "
                                "parameter each")
        for cat in MODEL_STATES:
            if not is_number(p[cat]) or not is_finite(p[cat]):
                raise ExerciseError(f"{call}[{cat!r}] should be a number of bytes "
                                    f"per parameter, got {p[cat]!r}")
        guesses.append(p)
    res = run_answer(cluster, _optimizer_worker, make_optimizer, cases,
                     what="optimizer", timeout=timeout)
    if res is None:
        return NOT_YET
    for rank, runs in enumerate(res):
        if isinstance(runs, dict):
            raise ExerciseError(f"rank {rank}: {runs['problem']}")
        for (momentum, dtype), p, r in zip(cases, guesses, runs):
            if r["type"] != "SGD":
                raise ExerciseError(f"rank {rank}: make_optimizer returned "
                                    f"{r['type']}; the exercise asks for "
                                    "torch.optim.SGD")
            if r["momentum"] != momentum:
                raise ExerciseError(
                    f"rank {rank}: make_optimizer(params, {momentum:g}) returned "
                    f"SGD with momentum {r['momentum']:g}; pass the momentum on")
            for cat in MODEL_STATES:
                measured = r["current"].get(cat, 0) / r["psi"]
                if abs(p[cat] - measured) > 0.01:
                    raise ExerciseError(
                        f"SGD(momentum={momentum:g}) on {dtype} parameters, {cat}: "
                        f"you predicted {p[cat]:g} bytes per parameter; rank {rank} "
                        f"measured {measured:.2f}. Hint: "
                        + _sgd_hint(cat, p[cat], momentum, dtype))
    told = []
    for (momentum, dtype), r in zip(cases, res[0]):
        per = [r["current"].get(c, 0) / r["psi"] for c in MODEL_STATES]
        told.append(f"SGD(momentum={momentum:g}), {dtype}: {per[0]:g} + {per[1]:g} "
                    f"+ {per[2]:g} = {sum(per):g}")
    print(f"correct on {len(cases)} cases, the last three drawn this run; measured "
          f"bytes per parameter: {'; '.join(told)} (fp32 Adam: 4 + 4 + 8 = 16)")
    return PASSED


# ------------------------------------------------------------------ smallest N

_PER_PARAM = (2, 2, 12)  # mixed-precision Adam: bf16 params, grads; fp32 K = 12


def _held(psi, n: int, stage: int) -> Fraction:
    """Model-state bytes one device holds under ZeRO `stage` with n devices,
    exactly: the states a stage shards are divided by n, the others whole."""
    psi = Fraction(psi)
    return sum((Fraction(b) * psi / (n if stage > k else 1)
                for k, b in zip((2, 1, 0), _PER_PARAM)), Fraction(0))


def _kept(psi, stage: int) -> Fraction:
    """Bytes of the states ZeRO `stage` does not shard, which every device keeps
    whole."""
    return sum((Fraction(b) * Fraction(psi) for k, b in zip((2, 1, 0), _PER_PARAM)
                if stage <= k), Fraction(0))


def _smallest_n(psi, stage: int, capacity) -> int | None:
    """The smallest N whose ZeRO-`stage` states per device fit `capacity`
    bytes; None where no N does. Exact (fractions), so 16 * 70e9 / 14 = 80e9
    fits."""
    cap, kept = Fraction(capacity), _kept(psi, stage)
    if stage == 0:
        return 1 if kept <= cap else None
    if kept >= cap:
        return None
    sharded = _held(psi, 1, stage) - kept
    return max(1, math.ceil(sharded / (cap - kept)))


def _smallest_cases(seed: int) -> list[tuple[str, int | float, int | float]]:
    """(name, Ψ, capacity): the chapter's (70e9 and Llama 3 70B on 80 GB), then
    models and devices drawn afresh: one that fits from stage 1, one from stage
    2, one under ZeRO-3 alone, one on a single device, and one whose ZeRO-3
    states land exactly on the capacity."""
    import random

    from labkit import theory

    rng = random.Random(seed)
    cases = [("Ψ = 70e9", 70e9, 80e9),
             ("Llama 3 70B", theory.param_count("llama3-70b"), 80e9)]
    drawn = []
    # 16Ψ / capacity: stages 1 to 3 fit; 2 and 3; 3 alone; (and below) stage 0 too
    for low, high in ((1.5, 3.9), (4.2, 7.8), (8.5, 400), (0.2, 0.95)):
        while True:
            cap = rng.randint(16, 192) * 10**9
            psi = int(cap * rng.uniform(low, high) / 16)
            if all(_smallest_n(psi, s, cap) in (None, *range(1, 5001))
                   for s in range(4)):  # a search from N = 1 ends quickly
                break
        drawn.append((psi, cap))
    n, q = rng.randint(3, 500), rng.randint(1, 12 * 10**9)
    drawn.append((n * q, 16 * q))  # ZeRO-3 keeps exactly the capacity at N = n
    return cases + [("a model drawn this run", psi, cap) for psi, cap in drawn]


def _gb(stage: int, psi, n: int) -> str:
    return f"{float(_held(psi, n, stage)) / 1e9:,.2f} GB"


def check_smallest_n(fn, capacity: float | None = None) -> bool:
    """Check a student's `fn(psi, stage, capacity)`: the smallest number of devices
    N at which ZeRO `stage` (0 = plain data parallelism) keeps at most `capacity`
    bytes of mixed-precision Adam model state per device, or None if no N does.
    Tried at every stage on 70e9 parameters and Llama 3 70B with 80 GB, and on
    models and capacities drawn afresh each run (`capacity` fixes theirs)."""
    cases = _smallest_cases(fresh_seed())
    if capacity is not None:
        cases = [(name, psi, capacity) for name, psi, _ in cases]
    for name, psi, cap in cases:
        for stage in (3, 2, 1, 0):
            want = _smallest_n(psi, stage, cap)
            call = (f"{getattr(fn, '__name__', 'your function')}("
                    f"{psi if isinstance(psi, int) else f'{psi:.6g}'}, stage={stage}, "
                    f"capacity={cap:.6g}) for {name}")
            try:
                with own_calls("labkit.checks.memory:_smallest_n") as own:
                    got = call_answer(fn, psi, stage, cap, what="function")
            except ExerciseError as err:
                raise ExerciseError(f"{call}: {err}") from None
            refuse_own(call, own, "smallest N (this check's reference)")
            if got is NOT_WRITTEN:
                return NOT_YET
            if got is not None and not is_whole(got):
                raise ExerciseError(f"{call} returned {got!r}: return a whole number "
                                    "of devices, or None when no N fits")
            if got == want:
                continue
            _smallest_error(call, got, want, psi, stage, cap)
    n70 = _smallest_n(70e9, 3, 80e9)
    llama = _smallest_n(cases[1][1], 3, 80e9)
    print(f"correct on {len(cases) * 4} cases, {len(cases) * 4 - 8} of them drawn this "
          f"run: e.g. Ψ = 70e9 fits in 80 GB from N = {n70} under ZeRO-3, Llama 3 "
          f"70B from N = {llama}, and under stages 0 to 2 at no N")
    return PASSED


def _smallest_error(call, got, want, psi, stage, cap) -> None:
    gbs = f"{cap / 1e9:g} GB"
    if want is None:
        kept = {0: "all 16Ψ", 1: "the 2Ψ + 2Ψ of parameters and gradients",
                2: "the 2Ψ of parameters"}[stage]
        raise ExerciseError(
            f"{call} returned {got}, but no N fits: stage {stage} keeps {kept} on "
            f"every device, {_gb(stage, psi, 10**9)} even at N = 1e9, more than "
            f"{gbs}. Return None")
    if got is None:
        raise ExerciseError(
            f"{call} returned None, but N = {want} fits: {_gb(stage, psi, want)} per "
            "device")
    got = int(got)
    if got < want:
        raise ExerciseError(
            f"{call} returned {got}, expected {want}: at N = {got} each device keeps "
            f"{_gb(stage, psi, got)}, more than {gbs}")
    if got == want + 1 and _held(psi, want, stage) == Fraction(cap):
        raise ExerciseError(
            f"{call} returned {got}, expected {want}: at N = {want} each device "
            f"keeps exactly {gbs}, which fits: 'at most capacity' includes equal "
            "(<=, not <)")
    hint = " (N need not be a power of two)" if got & (got - 1) == 0 else ""
    raise ExerciseError(
        f"{call} returned {got}, expected {want}: N = {want} already fits "
        f"({_gb(stage, psi, want)} per device; N = {want - 1} keeps "
        f"{_gb(stage, psi, max(1, want - 1))}){hint}")
