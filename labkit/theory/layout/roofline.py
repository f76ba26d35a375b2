"""How fast a layout's matrix products run on one device: a roofline per GEMM.

Williams, Waterman & Patterson 2009 ("Roofline: an insightful visual performance
model for multicore architectures"): a kernel takes at least its FLOPs over the
peak and at least its bytes over the memory bandwidth. For one product of an
(m x k) by a (k x n) matrix in bf16: max(2mnk / (peak x efficiency),
2 (mk + kn + mn) / HBM), the efficiency being what a large product reaches
(ClusterSpec.gemm_efficiency). The backward runs two more products with the same
three operands (dX = dY W^T, dW = X^T dY): three times the forward's time.
"""

from __future__ import annotations

from labkit.theory.layout.cluster import ClusterSpec
from labkit.theory.layout.counts import flops_per_token
from labkit.theory.layout.layout import Layout, StepShape
from labkit.theory.models import ModelConfig


def gemm_time(m: float, n: float, k: float, cluster: ClusterSpec,
              dtype_bytes: int = 2) -> float:
    """Seconds for one (m x k) @ (k x n) product on one GPU, by the roofline."""
    flops = 2 * m * n * k / (cluster.flops * cluster.gemm_efficiency)
    moved = dtype_bytes * (m * k + k * n + m * n) / cluster.hbm_bw
    return max(flops, moved)


def layer_gemms(model: ModelConfig, tokens: float, tp: int, ep: int,
                moe: bool, etp: int | None = None
                ) -> list[tuple[float, float, float, float]]:
    """(count, m, n, k) of one layer's forward products on one device, for
    `tokens` tokens per micro-batch, the weights split over TP (Megatron's column
    and row split, chapter 09) and, in an MoE layer, the routed experts over EP:
    each device holds experts / ep of them and each receives tokens x top-k x ep
    / experts tokens (the EP group's tokens, spread evenly). etp: the ranks an
    expert is split over, when not TP (a folded layout): each device then
    dispatches its tokens x etp / tp (sequence parallelism's share, gathered over
    expert TP) and holds whole experts' widths / etp."""
    etp = tp if etp is None else etp
    hidden, heads = model.hidden, model.heads
    out = []
    if model.kv_lora_rank:  # multi-head latent attention: low-rank q and kv
        q_rank, kv_rank = model.q_lora_rank, model.kv_lora_rank
        qk = model.qk_nope_dim + model.qk_rope_dim
        out += [(1, tokens, q_rank, hidden), (1, tokens, heads * qk / tp, q_rank),
                (1, tokens, kv_rank + model.qk_rope_dim, hidden),
                (1, tokens, heads * (model.qk_nope_dim + model.v_head_dim) / tp,
                 kv_rank),
                (1, tokens, hidden, heads * model.v_head_dim / tp)]
    else:
        head = hidden // heads
        out += [(1, tokens, (hidden + 2 * model.kv_heads * head) / tp, hidden),
                (1, tokens, hidden, hidden / tp)]
    up = 2 if model.gated_mlp else 1  # SwiGLU: gate and up projections
    if moe:
        experts, expert_ffn = model.experts, model.expert_ffn
        per_expert = tokens * etp / tp * model.experts_per_token * ep / experts
        out += [(1, tokens, experts, hidden),  # the router
                (experts / ep, per_expert, up * expert_ffn / etp, hidden),
                (experts / ep, per_expert, hidden, expert_ffn / etp)]
        if model.shared_experts:
            shared_ffn = model.shared_experts * expert_ffn
            out += [(1, tokens, up * shared_ffn / tp, hidden),
                    (1, tokens, hidden, shared_ffn / tp)]
    else:
        ffn = model.ffn
        out += [(1, tokens, up * ffn / tp, hidden), (1, tokens, hidden, ffn / tp)]
    return out


def layer_seconds(model: ModelConfig, tokens: float, seq: int, tp: int, ep: int,
                  moe: bool, cluster: ClusterSpec, etp: int | None = None
                  ) -> tuple[float, float]:
    """(roofline seconds, seconds at the full peak) of one layer's forward and
    backward for one micro-batch on one device. Attention's scores (12·h·seq
    FLOPs per token, forward and backward) are priced as compute at the GEMM
    efficiency (FlashAttention keeps them out of HBM): an assumption."""
    roofline, at_peak = 0.0, 0.0
    for count, m, n, k in layer_gemms(model, tokens, tp, ep, moe, etp):
        roofline += 3 * count * gemm_time(m, n, k, cluster)
        at_peak += 3 * count * 2 * m * n * k / cluster.flops
    scores = 12 * model.hidden * seq * tokens / tp / cluster.flops
    return roofline + scores / cluster.gemm_efficiency, at_peak + scores


def compute_slowdown(model: ModelConfig, tokens: float, seq: int, tp: int, ep: int,
                     cluster: ClusterSpec, etp: int | None = None) -> float:
    """Roofline time over peak time for this layout's layers (dense and MoE
    weighted by their counts): 1 / gemm_efficiency where every product is large,
    more where thin per-device shapes leave it bound by HBM."""
    moe_layers = model.layers - model.dense_layers if model.experts else 0
    roofline, at_peak = 0.0, 0.0
    for moe, layers in ((False, model.layers - moe_layers), (True, moe_layers)):
        if layers:
            layer_roofline, layer_peak = layer_seconds(model, tokens, seq, tp, ep, moe,
                                                       cluster, etp)
            roofline = roofline + layers * layer_roofline
            at_peak = at_peak + layers * layer_peak
    return roofline / at_peak


def model_time(model: ModelConfig, layout: Layout, cluster: ClusterSpec,
               shape: StepShape) -> float:
    """Seconds one device's share of the model's FLOPs (no recomputation) takes
    at the full peak: its pipeline's tokens (the batch over DP x CP), its 1 / (TP
    x PP) of each token's flops_per_token."""
    tokens = shape.global_batch_tokens / (layout.dp * layout.cp)  # a pipeline, CP rank
    return (flops_per_token(model, shape.seq) * tokens / (layout.tp * layout.pp)
            / cluster.flops)
