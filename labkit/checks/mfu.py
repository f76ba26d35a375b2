"""The MFU chapter's checks: an MFU under PaLM's convention, and the miscount
behind a reported MFU over 100 %.

Imports labkit.checks' common and verify and labkit.theory.utilisation (only to hold
this check's own reference to it). Every check draws its cases afresh each run
and computes its reference by its own arithmetic, refusing labkit's MFU
accountant in the answer; a miscount is told apart by the report's own FLOPs per
token and, where the inputs themselves are off, by the one correction that lands
in a typical MFU.
"""

from __future__ import annotations

import random

from labkit.checks.common import (
    NOT_WRITTEN,
    NOT_YET,
    PASSED,
    ExerciseError,
    as_number,
    close_to,
    not_yet,
    slips_named,
)
from labkit.checks.verify import call_refusing, fresh_seed
from labkit.theory.utilisation import likely_miscounts

# PaLM (Chowdhery et al. 2022, arXiv 2204.02311) app. B: 238.3K tokens/s on 6144
# TPU v4 chips of 275 TFLOP/s; N = 540e9, 118 layers, 48 heads of 256, T = 2048
# (table 1): 46.2 % MFU.
PALM_540B = (238.3e3 / 6144, 275e12, 540e9, 118, 48, 256, 2048)
_PEAKS = (312e12, 989.5e12, 275e12, 2.25e15)  # dense BF16: A100, H100, TPU v4, B200

_MFU_OWN = ("labkit.theory.utilisation", "labkit.theory.layout.costs:flops_per_token",
            "labkit.checks.mfu:_palm_flops", "labkit.checks.mfu:_diagnose")


def _answer(call: str, fn, args: tuple, what: str):
    """fn(*args) as call_refusing gives it, labkit's MFU accountant and this
    check's references refused; a stub that returns None is not written yet,
    as one that raises."""
    got = call_refusing(call, fn, args, what, _MFU_OWN,
                        "MFU accountant, or this check's")
    if got is None:
        not_yet(f"not written yet: {what} returns None; write it, then run this "
                "cell again")
        return NOT_WRITTEN
    return got


def _palm_flops(params: float, layers: int, heads: int, head_dim: int,
                seq: int) -> tuple[float, float]:
    """(6N, 12LHQT): PaLM app. B's training FLOPs per token, dense and attention."""
    return 6 * params, 12 * layers * heads * head_dim * seq


# ------------------------------------------------------ exercise 1: my_mfu


def _shape(rng: random.Random) -> tuple[float, int, int, int, int]:
    """A decoder's (params, layers, heads, head_dim, seq): N = 12Ld² + Vd."""
    head_dim = rng.choice((64, 128))
    heads = rng.choice((12, 16, 32, 40, 64, 96))
    layers = rng.randint(12, 96)
    d = heads * head_dim
    vocab = rng.choice((32_000, 50_257, 128_256))
    return (float(12 * layers * d * d + vocab * d), layers, heads, head_dim,
            rng.choice((1024, 2048, 4096, 8192, 32768)))


def _mfu_cases(seed: int) -> list[tuple]:
    """PaLM 540B, then five runs drawn this run at 25-60 % MFU."""
    rng = random.Random(seed)
    cases = [PALM_540B]
    while len(cases) < 6:
        n, layers, heads, head_dim, seq = _shape(rng)
        peak = rng.choice(_PEAKS)
        dense, attention = _palm_flops(n, layers, heads, head_dim, seq)
        rate = round(rng.uniform(0.25, 0.6) * peak / (dense + attention), 1)
        cases.append((rate, peak, n, layers, heads, head_dim, seq))
    return cases


def _mfu_slips(rate, peak, n, layers, heads, head_dim, seq) -> list:
    a = layers * heads * head_dim * seq

    def m(flops):
        return rate * flops / peak

    right = m(6 * n + 12 * a)
    return [
        (m(6 * n), "that leaves attention out: PaLM's convention counts its two "
                   "matmuls too, 12·L·H·Q·T FLOPs per token"),
        (m(6 * n + 6 * a), "that halves attention (a causal count); PaLM's "
                           "convention counts the full T x T square, 12·L·H·Q·T"),
        (m(2 * n + 4 * a), "that is the forward pass alone; training is forward + "
                           "backward, 3 times the forward: 6N + 12·L·H·Q·T"),
        (m(2 * n + 12 * a), "a parameter costs 6 FLOPs per token in training (2 "
                            "forward, 4 backward), not 2"),
        (m(4 * n + 12 * a), "a parameter costs 6 FLOPs per token in training (2 "
                            "forward, 4 backward), not 4"),
        (m(8 * n + 16 * a), "that counts a recomputed forward: hardware FLOPs "
                            "(HFU); MFU counts only the model's 6N + 12·L·H·Q·T"),
        (m(6 * n + 12 * a / seq), "the attention term grows with the sequence: "
                                  "12·L·H·Q·T, T the sequence length"),
        (100 * right, "return a fraction (0.462), not a percentage"),
        (seq * right, "6N + 12·L·H·Q·T is already per token: do not multiply "
                      "by the sequence length"),
        (1 / right, "MFU is achieved FLOP/s over peak FLOP/s, not the inverse"),
    ]


def check_mfu(fn) -> bool:
    """`fn(tokens_per_second, peak_flops, params, layers, heads, head_dim,
    seq_len)`: one GPU's MFU, a fraction, under PaLM's convention (6N +
    12·L·H·Q·T FLOPs per token). PaLM 540B's published run and five drawn this
    run; labkit's MFU accountant is refused; the usual slips are named."""
    cases = _mfu_cases(fresh_seed())
    for case in cases:
        call = "my_mfu({:.6g}, {:.4g}, {:.6g}, {}, {}, {}, {})".format(*case)
        got = _answer(call, fn, case, "my_mfu")
        if got is NOT_WRITTEN:
            return NOT_YET
        got = as_number(call, got)
        rate, peak, *shape = case
        want = rate * sum(_palm_flops(*shape)) / peak
        if close_to(got, want):
            continue
        hint = slips_named(got, want, _mfu_slips(*case), (
            "MFU = tokens/s x (6N + 12·L·H·Q·T) / peak FLOP/s, one GPU's"))
        raise ExerciseError(f"{call} = {got:.6g}, expected {want:.6g}. Hint: {hint}")
    rate, peak, *shape = PALM_540B
    palm = 100 * rate * sum(_palm_flops(*shape)) / peak
    print(f"correct: PaLM 540B's MFU is {palm:.1f} % (published: 46.2 %), and "
          f"{len(cases) - 1} runs drawn this run agree")
    return PASSED


# ------------------------------------------------- exercise 2: find_miscount

# The miscounts find_miscount names, one of them in every report the check
# draws (labkit.theory.utilisation.MISCOUNTS says each in words)
MISCOUNT_NAMES = ("job_tokens", "low_peak", "attention_twice", "per_sequence",
                  "percent")
TYPICAL = (0.20, 0.70)  # a typical MFU: where one correction lands, and only one


def _report(rng: random.Random, name: str):
    """(report, true MFU): a run under PaLM's convention with `name` seeded into
    what it reports, drawn until it reports over 100 % and, where the inputs
    themselves are off (job_tokens, low_peak), only the right correction lands
    in TYPICAL; None when this draw does not."""
    n, layers, heads, head_dim, seq = _shape(rng)
    if name == "attention_twice":  # a long sequence: attention rivals 6N
        layers, seq = rng.randint(24, 48), rng.choice((65536, 131072))
        heads, head_dim = rng.choice((16, 32)), 128
        d = heads * head_dim
        n = float(12 * layers * d * d + 32_000 * d)
    peak, gpus = rng.choice(_PEAKS), rng.choice((8, 16, 64, 256, 1024, 6144))
    dense, attention = _palm_flops(n, layers, heads, head_dim, seq)
    true = rng.uniform(0.3, 0.65)
    rate = true * peak / (dense + attention)
    report = dict(tokens_per_second=rate, gpus=gpus, peak_flops=peak, params=n,
                  layers=layers, heads=heads, head_dim=head_dim, seq_len=seq,
                  flops_per_token=dense + attention, convention="palm")
    if name == "job_tokens":
        report["tokens_per_second"] = rate * gpus
    elif name == "low_peak":
        report["peak_flops"] = peak / 2
    elif name == "attention_twice":
        report["flops_per_token"] = dense + 2 * attention
    elif name == "per_sequence":
        report["flops_per_token"] = (dense + attention) * seq
    shown = (report["tokens_per_second"] * report["flops_per_token"]
             / report["peak_flops"])
    report["reported_mfu"] = 100 * shown if name == "percent" else shown
    if report["reported_mfu"] <= 1:
        return None
    if name in ("job_tokens", "low_peak"):
        low, high = TYPICAL
        if sum(low <= shown / k <= high for k in (gpus, 2)) != 1:
            return None
    return report, true


def _miscount_cases(seed: int) -> list[tuple[dict, str, float]]:
    """Each miscount once, in a drawn order, then one more: six reports."""
    rng = random.Random(seed)
    names = list(MISCOUNT_NAMES)
    rng.shuffle(names)
    names.append(rng.choice(MISCOUNT_NAMES))
    cases = []
    for name in names:
        got = None
        while got is None:
            got = _report(rng, name)
        cases.append((got[0], name, got[1]))
    return cases


def _diagnose(report: dict) -> tuple[str, float]:
    """The check's own reading of a report: its FLOPs per token against PaLM's
    count, then the reported MFU against the one its inputs give, then the
    correction (÷ GPUs, or a doubled peak) that lands in TYPICAL."""
    r = report
    flops = sum(_palm_flops(r["params"], r["layers"], r["heads"], r["head_dim"],
                            r["seq_len"]))
    ratio = r["flops_per_token"] / flops
    right = r["tokens_per_second"] * flops / r["peak_flops"]
    if close_to(ratio, r["seq_len"]):
        return "per_sequence", right
    if not close_to(ratio, 1.0):
        return "attention_twice", right
    if close_to(r["reported_mfu"], 100 * right):
        return "percent", right
    low, high = TYPICAL
    if low <= right / r["gpus"] <= high:
        return "job_tokens", right / r["gpus"]
    return "low_peak", right / 2


def _as_pair(call: str, got) -> tuple[str, float]:
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        raise ExerciseError(f"{call} returned {got!r}; return (name, corrected "
                            f"MFU), the name one of {MISCOUNT_NAMES}")
    name, value = got
    if name not in MISCOUNT_NAMES:
        raise ExerciseError(f"{call} named {name!r}; the name is one of "
                            f"{MISCOUNT_NAMES}")
    return name, as_number(f"{call}'s corrected MFU", value)


def _miscount_hint(report: dict, name: str, got: tuple[str, float],
                   want: float) -> str:
    if got[0] != name:
        if name in ("job_tokens", "low_peak") and got[0] in ("job_tokens",
                                                             "low_peak"):
            return ("both dividing by the GPUs and doubling the peak bring it "
                    "under 100 %: only one lands in a typical MFU (20-70 %)")
        return ("compare the report's flops_per_token with PaLM's 6N + 12·L·H·Q·T "
                "from its shape first, then its reported MFU with the one its "
                "inputs give")
    said = []  # a percent report's own value is 100 x the right one: both
    if close_to(got[1], 100 * want):
        said.append("return the corrected MFU as a fraction, not a percentage")
    if close_to(got[1], report["reported_mfu"]):
        said.append("that is the reported MFU; return it corrected")
    if said:
        return "; ".join(said)
    return "undo the miscount: the MFU the run really had, one GPU's, as a fraction"


def check_miscount(fn) -> bool:
    """`fn(report)`: (name, corrected MFU) of the miscount behind a reported MFU
    over 100 %, the name one of MISCOUNT_NAMES. Six reports drawn this run, each
    with one seeded miscount; labkit's likely_miscounts is refused."""
    cases = _miscount_cases(fresh_seed())
    for report, name, true in cases:
        found = {m.name: m.corrected for m in likely_miscounts(
            report["reported_mfu"], params=report["params"],
            layers=report["layers"], heads=report["heads"],
            head_dim=report["head_dim"], seq_len=report["seq_len"],
            gpus=report["gpus"])}
        mine = _diagnose(report)
        if mine[0] != name or not close_to(mine[1], true) or not close_to(
                found.get(name) or 0.0, true):
            raise RuntimeError(  # this check's reading against labkit's theory
                f"the check's report {report} seeds {name} ({true!r}); its own "
                f"reading says {mine}, likely_miscounts {found}")
        call = f"find_miscount(report of {100 * report['reported_mfu']:,.1f} % MFU)"
        got = _answer(call, fn, (dict(report),), "find_miscount")
        if got is NOT_WRITTEN:
            return NOT_YET
        got = _as_pair(call, got)
        if got[0] == name and close_to(got[1], true):
            continue
        hint = _miscount_hint(report, name, got, true)
        raise ExerciseError(f"{call}: you said ({got[0]!r}, {got[1]:.6g}), "
                            f"expected ({name!r}, {true:.6g}). Hint: {hint}")
    print(f"correct: you named the miscount and the MFU the run really had in "
          f"{len(cases)} reports drawn this run (each of "
          f"{', '.join(MISCOUNT_NAMES)})")
    return PASSED
