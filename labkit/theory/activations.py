"""Activation memory per transformer layer (Korthikanti et al. 2022)."""

from __future__ import annotations


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
    the s x s scores)."""
    for name, v in (("seq", seq), ("batch", batch), ("hidden", hidden),
                    ("heads", heads), ("tp", tp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    if hidden % heads:
        raise ValueError(f"hidden {hidden} is not divisible by heads {heads}")
    if heads % tp or hidden % tp:
        raise ValueError(f"tensor parallel {tp} must divide heads {heads} and "
                         f"hidden {hidden}")
    if sp and seq % tp:
        raise ValueError(f"sequence parallel needs seq {seq} divisible by tp {tp}")
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be 'none', 'selective' or 'full', "
                         f"not {recompute!r}")
    s, b, h, a, t = seq, batch, hidden, heads, tp
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sp else 1)
    attn = 5 * a * s / h if attention_scores and recompute == "none" else 0.0
    if sp or t == 1:
        return sbh / t * (34 + attn)
    return sbh * (10 + 24 / t + attn / t)
