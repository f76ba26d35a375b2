"""Activation memory per transformer layer (Korthikanti et al. 2022), in total and
tensor by tensor."""

from __future__ import annotations

from labkit.theory._validate import check_counts

RECOMPUTE = ("none", "selective", "full")


def _check(seq, batch, hidden, heads, tp, sp, recompute) -> None:
    check_counts(seq=seq, batch=batch, hidden=hidden, heads=heads, tp=tp)
    if hidden % heads:
        raise ValueError(f"hidden {hidden} is not divisible by heads {heads}")
    if heads % tp or hidden % tp:
        raise ValueError(f"tensor parallel {tp} must divide heads {heads} and "
                         f"hidden {hidden}")
    if sp and seq % tp:
        raise ValueError(f"sequence parallel needs seq {seq} divisible by tp {tp}")
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be 'none', 'selective' or 'full', "
                         f"not {recompute!r}")


def activation_memory(seq: int, batch: int, hidden: int, heads: int, tp: int = 1,
                      sp: bool = False, recompute: str = "none",
                      attention_scores: bool = True) -> float:
    """Activation bytes per transformer layer, 16-bit activations (Korthikanti et al.
    2022, "Reducing Activation Recomputation in Large Transformer Models", table 2):

        none, t = 1           sbh (34 + 5as/h)
        tensor parallel t     sbh (10 + 24/t + 5as/(ht))
        + sequence parallel   sbh/t (34 + 5as/h)
        selective recompute   drops the 5as/h attention term
        full recompute        2sbh, the layer's input only (/t with sequence parallel)

    attention_scores=False drops the 5as/h term too (FlashAttention never stores
    the s x s scores). `activation_terms` gives the same bytes tensor by tensor."""
    _check(seq, batch, hidden, heads, tp, sp, recompute)
    s, b, h, a, t = seq, batch, hidden, heads, tp
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sp else 1)
    attn = 5 * a * s / h if attention_scores and recompute == "none" else 0.0
    if sp or t == 1:
        return sbh / t * (34 + attn)
    return sbh * (10 + 24 / t + attn / t)


# Korthikanti et al. 2022, sec. 4.1: what one layer keeps for backward, in units
# of sbh bytes (16-bit values, 1-byte dropout masks), and whether tensor
# parallelism splits it ("tp": its heads or MLP features are split over t) or only
# sequence parallelism does ("sp": LayerNorm, dropout and the layer inputs).
_TERMS = (  # name, sbh units (or as/h units for the scores), split by
    ("LayerNorm 1 input", 2, "sp"),
    ("Q, K, V input (LayerNorm 1 output)", 2, "sp"),
    ("Q, K (for Q Kᵀ)", 4, "tp"),
    ("softmax output", 2, "scores"),
    ("softmax dropout mask", 1, "scores"),
    ("softmax dropout output (for ·V)", 2, "scores"),
    ("V", 2, "tp"),
    ("projection input", 2, "tp"),
    ("attention dropout mask", 1, "sp"),
    ("LayerNorm 2 input", 2, "sp"),
    ("fc1 input (LayerNorm 2 output)", 2, "sp"),
    ("GeLU input", 8, "tp"),
    ("fc2 input (GeLU output)", 8, "tp"),
    ("MLP dropout mask", 1, "sp"),
)
SCORE_TERMS = tuple(name for name, _, split in _TERMS if split == "scores")
# each term's group: "scores" (5as²b, split by t), "tp" (24sbh, split by t), "sp"
# (10sbh: split only with sequence parallelism), "input" (full recomputation's)
TERM_GROUP = {name: split for name, _, split in _TERMS} | {"layer input": "input"}


def activation_terms(seq: int, batch: int, hidden: int, heads: int, tp: int = 1,
                     sp: bool = False, recompute: str = "none",
                     attention_scores: bool = True) -> dict[str, float]:
    """`activation_memory`, tensor by tensor: {what is kept: bytes per layer}, in
    the order of the forward (Korthikanti et al. 2022, sec. 4.1). The attention
    block keeps 11sbh + 5as²b, the MLP 19sbh, the two LayerNorms 4sbh. Tensor
    parallelism splits what lies between its f and g (24sbh and the scores), and
    sequence parallelism the rest (10sbh). Selective recomputation drops the three
    terms of the s x s scores (SCORE_TERMS); full recomputation keeps only the
    layer's input, {"layer input": 2sbh} (/t with sequence parallelism)."""
    _check(seq, batch, hidden, heads, tp, sp, recompute)
    s, b, h, a, t = seq, batch, hidden, heads, tp
    sbh = s * b * h
    if recompute == "full":
        return {"layer input": 2 * sbh / (t if sp else 1)}
    keep_scores = attention_scores and recompute == "none"
    out = {}
    for name, units, split in _TERMS:
        if split == "scores":
            if keep_scores:
                out[name] = units * a * s * s * b / t
        elif split == "tp" or sp:
            out[name] = units * sbh / t
        else:
            out[name] = units * sbh
    return out
