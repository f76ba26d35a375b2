"""Tensor parallelism per transformer layer: its all-reduces and the bytes each rank
sends, and the parameters each rank holds (Megatron-LM's split)."""

from __future__ import annotations

from dataclasses import dataclass

from labkit.theory._validate import check_counts, check_world_size


@dataclass(frozen=True)
class LayerTraffic:
    """One transformer layer, one training step (forward + backward), per rank."""

    all_reduces_forward: int  # g after attention and after the MLP
    all_reduces_backward: int  # f before attention and before the MLP
    elements: int  # of each all-reduce: b·s·h
    bytes_each: float  # each rank sends per all-reduce (ring): 2(t-1)/t·bsh·bytes

    @property
    def all_reduces(self) -> int:
        return self.all_reduces_forward + self.all_reduces_backward

    @property
    def bytes_per_rank(self) -> float:
        """All four together: 8(t-1)/t·bsh elements of `elem_bytes` each."""
        return self.all_reduces * self.bytes_each


def layer_traffic(batch: int, seq: int, hidden: int, tp: int,
                  elem_bytes: int = 2) -> LayerTraffic:
    """What one transformer layer's tensor parallelism sends per step.

    Two all-reduces forward (g after the attention's and after the MLP's
    row-parallel layer) and two backward (f before each column-parallel layer),
    each of the activations b·s·h (Shoeybi et al. 2019, sec. 3 and fig. 4). A ring
    all-reduce sends 2(t-1)/t of its payload per rank (Patarasuk & Yuan 2009), so a
    layer sends 8·b·s·h·(t-1)/t elements per rank per microbatch (Narayanan et al.
    2021, sec. 3.3)."""
    check_counts(batch=batch, seq=seq, hidden=hidden, elem_bytes=elem_bytes)
    t = check_world_size(tp)
    n = batch * seq * hidden
    return LayerTraffic(2, 2, n, 2 * (t - 1) / t * n * elem_bytes)


@dataclass(frozen=True)
class LayerParams:
    """Parameters of one transformer layer on one rank of t."""

    sharded: int  # this rank's 1/t of QKV, projection, fc1, fc2 (and their biases)
    replicated: int  # on every rank whole: 2 LayerNorms, the row-parallel biases

    @property
    def total(self) -> int:
        return self.sharded + self.replicated


def layer_params(hidden: int, tp: int = 1, ffn: int | None = None) -> LayerParams:
    """A GPT layer (two LayerNorms, attention with biases, a 2-matrix GeLU MLP of
    width ffn, default 4h) split Megatron's way over t ranks. With t = 1 and ffn =
    4h it is 12h² + 13h, the per-layer term of Narayanan et al. 2021, eq. 2:
    P = 12lh²(1 + 13/(12h) + (V + s)/(12lh))."""
    h, t = hidden, check_world_size(tp)
    f = 4 * h if ffn is None else ffn
    check_counts(hidden=h, ffn=f)
    for name, v in (("hidden", h), ("ffn", f)):
        if v % t:
            raise ValueError(f"{name} = {v} is not divisible by tp = {t}")
    qkv, proj = 3 * h * h + 3 * h, h * h  # column-parallel: weights and biases
    fc1, fc2 = h * f + f, f * h  # row-parallel weights: biases are whole
    replicated = 2 * 2 * h + h + h  # two LayerNorms (weight, bias), proj and fc2 bias
    return LayerParams((qkv + proj + fc1 + fc2) // t, replicated)
