"""Model FLOPs utilisation under named conventions: every MFU says whose count it is.

Pure closed forms; imports only labkit.arguments. The non-obvious fact: the same
run's MFU differs by several points between conventions (attention counted on
the full T x T square or on the causal half, embeddings in or out, recomputed
FLOPs in or out), so a number without its convention cannot be compared; and an
MFU over 100 % is always a miscount, which `likely_miscounts` names.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.arguments import real, whole

# A typical training run's MFU: the band a corrected miscount should land in.
PLAUSIBLE = (0.20, 0.70)

# name -> (formula, source). The formulas are per token, N the `params` given,
# E `embedding_params` (lookup-only tables), L H Q T layers, heads, head dim and
# sequence; K the keys a query attends on average.
CONVENTIONS = {
    "palm": (
        "6N + 12LHQT",
        "Chowdhery et al. 2022 (PaLM, arXiv 2204.02311), sec. 4.1 and app. B: "
        "N all parameters (540B for PaLM 540B, its shared embedding included), "
        "attention's two matmuls on the full T x T square (not causal)"),
    "kaplan": (
        "6(N - E)",
        "Kaplan et al. 2020 (arXiv 2001.08361), sec. 2.1: C = 6N, N without "
        "embeddings, attention left out; PaLM app. B's 'without self-attention' "
        "figures are this with E = 0"),
    "torchtitan": (
        "6(N - E) + 12LHQT",
        "pytorch/torchtitan, torchtitan/models/utils.py "
        "get_dense_model_nparams_and_flops (nn.Embedding tables left out unless "
        "tied; 'we do not account for sparsity in causal attention')"),
    "nanogpt": (
        "6(N - E) + 12LHQT",
        "karpathy/nanoGPT, model.py estimate_mfu (PaLM app. B; "
        "get_num_params(non_embedding=True) leaves out the position table wpe, "
        "keeps wte, tied to lm_head)"),
    "llm-foundry": (
        "6N + 12·L·d·T",
        "mosaicml/llm-foundry, scripts/train/benchmarking/collect_results.py and "
        "README.md: N all parameters, d = d_model (hidden), full square; HFU "
        "under activation checkpointing 4/3 of it"),
    "megatron": (
        "6(N - E) + 12LHQ·K, K = T/2 causal",
        "NVIDIA/Megatron-LM, megatron/training/training.py "
        "num_floating_point_operations: every GEMM (logits too, the input lookup "
        "not), core attention halved for the causal mask, GQA changing only the "
        "projections; sliding windows (K below) are labkit's extension"),
    "megatron-sc21": (
        "72lh² + 12lhs + 6hV (96lh² + 16lhs + 6hV with full recompute)",
        "Narayanan et al. 2021 (SC21, arXiv 2104.04473), eq. 3: 96Bslh²(1 + "
        "s/6h + V/16lhs) per iteration counts full recomputation (an HFU); "
        "its MFU is the same count without the recomputed forward"),
}
_RECOMPUTE = ("none", "selective", "full")


def _short(name: str) -> str:
    """'Chowdhery et al. 2022 app. B'-like: the source up to its first comma."""
    return CONVENTIONS[name][1].split(",")[0].split(" (")[0]


@dataclass(frozen=True)
class MFU:
    """A utilisation that says its convention: `value` a fraction of peak."""

    value: float
    convention: str
    flops_per_token: float
    hardware: bool = False

    @property
    def percent(self) -> float:
        return 100 * self.value

    def __str__(self) -> str:
        kind = "HFU" if self.hardware else "MFU"
        formula, _ = CONVENTIONS[self.convention]
        return (f"{self.percent:.1f} % {kind} ({self.convention}: {formula}, "
                f"{_short(self.convention)})")


@dataclass(frozen=True)
class Miscount:
    """One usual miscount: `factor` the reported value over the right one,
    `corrected` the value once undone (None where it cannot be computed),
    `plausible` when that lands in PLAUSIBLE."""

    name: str
    factor: float | None
    corrected: float | None
    plausible: bool
    why: str


class ImpossibleMFU(ValueError):
    """An MFU over 100 %: a miscount; `candidates` the likely ones."""

    def __init__(self, message: str, value: float, candidates: tuple):
        super().__init__(message)
        self.value, self.candidates = value, candidates


# ------------------------------------------------------------------ arguments



def _shape(params, layers, heads, head_dim, seq_len, convention, more) -> dict:
    """The checked arguments of a count; errors name the argument."""
    if convention not in CONVENTIONS:
        raise ValueError(f"convention must be one of {', '.join(CONVENTIONS)}; "
                         f"got {convention!r}")
    known = {"causal", "window", "kv_heads", "embedding_params", "recompute",
             "vocab", "hidden", "hardware"}
    unknown = set(more) - known
    if unknown:
        raise TypeError(f"unknown argument(s) {sorted(unknown)}; a count takes "
                        f"{sorted(known)}")
    s = dict(n=real(params, "params"), layers=whole(layers, "layers"),
             heads=whole(heads, "heads"), head_dim=whole(head_dim, "head_dim"),
             seq=whole(seq_len, "seq_len"), convention=convention)
    causal = more.get("causal", True)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    window = more.get("window")
    s["window"] = None if window is None else whole(window, "window")
    kv = more.get("kv_heads")
    if kv is not None and s["heads"] % whole(kv, "kv_heads"):
        raise ValueError(f"kv_heads must divide heads ({s['heads']}), got {kv}")
    e = real(more.get("embedding_params", 0), "embedding_params", zero=True)
    if e >= s["n"]:
        raise ValueError(f"embedding_params ({e:g}) must be fewer than params "
                         f"({s['n']:g})")
    recompute = more.get("recompute", "none")
    if recompute not in _RECOMPUTE:
        raise ValueError(f"recompute must be one of {_RECOMPUTE}, got {recompute!r}")
    hardware = more.get("hardware", False)
    if not isinstance(hardware, bool):
        raise TypeError(f"hardware must be True or False, got {hardware!r}")
    hidden = more.get("hidden")
    s["hidden"] = (s["heads"] * s["head_dim"] if hidden is None
                   else whole(hidden, "hidden"))
    vocab = more.get("vocab")
    if vocab is None and convention == "megatron-sc21":
        raise ValueError("convention 'megatron-sc21' counts the logits from the "
                         "shape: give vocab=")
    s.update(causal=causal, e=e, recompute=recompute, hardware=hardware,
             vocab=None if vocab is None else whole(vocab, "vocab"))
    return s


# ------------------------------------------------------------------- counting


def _keys(s: dict) -> float:
    """Keys a query attends on average, as the convention counts them: T
    (the full square) for all but megatron; there, causal T/2 (Megatron's
    s²/2), and with a window w < T the band's area over T, w - w²/2T (the same
    continuous count, so w >= T gives T/2)."""
    t = s["seq"]
    if s["convention"] != "megatron" or not s["causal"]:
        return float(t)
    w = s["window"]
    return t / 2 if w is None or w >= t else w - w * w / (2 * t)


def _parts(s: dict) -> tuple[float, float]:
    """(dense, attention) training FLOPs per token, model FLOPs only."""
    n, e, layers, t = s["n"], s["e"], s["layers"], s["seq"]
    hq = s["heads"] * s["head_dim"]
    name = s["convention"]
    if name == "palm":
        return 6 * n, 12 * layers * hq * t
    if name == "kaplan":
        return 6 * (n - e), 0.0
    if name in ("torchtitan", "nanogpt"):
        return 6 * (n - e), 12 * layers * hq * t
    if name == "llm-foundry":
        return 6 * n, 12 * layers * s["hidden"] * t
    if name == "megatron":
        return 6 * (n - e), 12 * layers * hq * _keys(s)
    h = s["hidden"]  # megatron-sc21: from the shape, not from params
    return 72 * layers * h * h + 6 * h * s["vocab"], 12 * layers * h * t


def _recomputed(s: dict, dense: float, attention: float) -> float:
    """FLOPs per token that recomputation adds (HFU only): a forward is a
    third of training; selective recomputes attention's core (Korthikanti et al.
    2022, arXiv 2205.05198), full the whole forward (Megatron's eq. 3: the
    layers, not the logits)."""
    if s["recompute"] == "none":
        return 0.0
    if s["recompute"] == "selective":
        return attention / 3
    if s["convention"] == "megatron-sc21":
        h = s["hidden"]
        return 24 * s["layers"] * h * h + attention / 3
    return (dense + attention) / 3


def flops_per_token(*, params, layers, heads, head_dim, seq_len,
                    convention: str = "palm", **more) -> float:
    """Training FLOPs per token under `convention` (a key of CONVENTIONS);
    hardware=True adds what `recompute` ("none", "selective", "full") does
    again. Keywords: causal, window, kv_heads (checked; GQA changes parameter
    counts, never the attention scores' FLOPs), embedding_params, vocab, hidden."""
    s = _shape(params, layers, heads, head_dim, seq_len, convention, more)
    dense, attention = _parts(s)
    extra = _recomputed(s, dense, attention) if s["hardware"] else 0.0
    return dense + attention + extra


def mfu(tokens_per_second, peak_flops, *, params, layers, heads, head_dim,
        seq_len, convention: str = "palm", gpus=None, **more) -> MFU:
    """One GPU's tokens/s and peak FLOP/s -> its model FLOPs utilisation
    (hardware=True: HFU) under `convention`, an MFU that prints its
    convention. Over 100 % raises ImpossibleMFU naming the likely miscounts
    (gpus=, when known, lets it test tokens/s given for the whole job). Other
    keywords as flops_per_token."""
    rate = real(tokens_per_second, "tokens_per_second")
    peak = real(peak_flops, "peak_flops")
    if gpus is not None:
        whole(gpus, "gpus")
    shape = dict(params=params, layers=layers, heads=heads, head_dim=head_dim,
                 seq_len=seq_len, convention=convention)
    f = flops_per_token(**shape, **more)
    value = rate * f / peak
    if value > 1:
        found = likely_miscounts(value, **shape, gpus=gpus, **more)
        named = "; ".join(_said(m) for m in found) or "none of the usual ones"
        kind = "HFU" if more.get("hardware") else "MFU"
        raise ImpossibleMFU(
            f"{100 * value:.1f} % {kind} ({convention}) is impossible: a GPU "
            f"cannot beat its peak. Likely miscounts: {named}", value, found)
    return MFU(value, convention, f, bool(more.get("hardware", False)))


def _said(m: Miscount) -> str:
    if m.corrected is None:
        return m.why
    tag = ", a typical MFU" if m.plausible else ""
    return f"{m.why} (-> {100 * m.corrected:.1f} %{tag})"


# ------------------------------------------------------------- miscounts

MISCOUNTS = {
    "job_tokens": "tokens/s for the whole job given as one GPU's",
    "low_peak": "a peak half the one the run computes at (FP8 work over the "
                "BF16 peak, or a dense peak halved again as if it were sparse)",
    "hfu": "hardware FLOPs (the forward recomputed under full recomputation) "
           "counted as model FLOPs",
    "attention_twice": "attention's FLOPs counted twice",
    "per_sequence": "FLOPs per sequence used as FLOPs per token (x seq_len)",
    "percent": "a percentage taken for a fraction (x 100)",
}


def likely_miscounts(value, *, params, layers, heads, head_dim, seq_len,
                     convention: str = "palm", gpus=None, **more
                     ) -> tuple[Miscount, ...]:
    """The usual miscounts that bring a reported utilisation `value` (a
    fraction, over 1 or not) to at most 100 %, each with the corrected value,
    those landing in PLAUSIBLE first, then by closeness to its middle. The
    whole-job tokens/s needs gpus=; without it the candidate says so and has no
    corrected value. `value` as computed under `convention` with the same
    keywords (hardware, recompute ...)."""
    value = real(value, "value")
    s = _shape(params, layers, heads, head_dim, seq_len, convention, more)
    dense, attention = _parts(s)
    total = dense + attention + (_recomputed(s, dense, attention)
                                 if s["hardware"] else 0.0)
    factors = {"low_peak": 2.0, "per_sequence": float(s["seq"]), "percent": 100.0}
    if attention:
        factors["attention_twice"] = (total + attention) / total
    if not s["hardware"]:
        full = dict(s, recompute="full")
        factors["hfu"] = (total + _recomputed(full, dense, attention)) / total
    out = []
    if gpus is None:
        out.append(Miscount("job_tokens", None, None, False,
                            "tokens/s for the whole job? pass gpus= or divide "
                            "by the number of GPUs"))
    else:
        factors["job_tokens"] = float(whole(gpus, "gpus"))
    for name, k in factors.items():
        got = value / k
        if k > 1 and got <= 1:
            low, high = PLAUSIBLE
            out.append(Miscount(name, k, got, low <= got <= high,
                                f"{MISCOUNTS[name]}: / {k:.4g}"))
    middle = sum(PLAUSIBLE) / 2

    def rank(m):
        if m.corrected is None:
            return (1, 0.0)
        return (0 if m.plausible else 2, abs(m.corrected - middle))

    return tuple(sorted(out, key=rank))
