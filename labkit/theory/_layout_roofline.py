"""How fast a layout's matrix products run on one device: a roofline per GEMM.

Williams, Waterman & Patterson 2009 ("Roofline: an insightful visual performance
model for multicore architectures"): a kernel takes at least its FLOPs over the
peak and at least its bytes over the memory bandwidth. For one product of an
(m x k) by a (k x n) matrix in bf16: max(2mnk / (peak x efficiency),
2 (mk + kn + mn) / HBM), the efficiency being what a large product reaches
(Cluster.gemm_efficiency). The backward runs two more products with the same
three operands (dX = dY W^T, dW = X^T dY): three times the forward's time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from labkit.theory._layout_cluster import Cluster
    from labkit.theory.models import ModelConfig


def gemm_time(m: float, n: float, k: float, cluster: Cluster,
              dtype_bytes: int = 2) -> float:
    """Seconds for one (m x k) @ (k x n) product on one GPU, by the roofline."""
    flops = 2 * m * n * k / (cluster.flops * cluster.gemm_efficiency)
    moved = dtype_bytes * (m * k + k * n + m * n) / cluster.hbm_bw
    return max(flops, moved)


def layer_gemms(c: ModelConfig, tokens: float, tp: int, ep: int,
                moe: bool) -> list[tuple[float, float, float, float]]:
    """(count, m, n, k) of one layer's forward products on one device, for
    `tokens` tokens per micro-batch, the weights split over TP (Megatron's column
    and row split, chapter 09) and, in an MoE layer, the routed experts over EP:
    each device holds experts / ep of them and each receives tokens x top-k x ep
    / experts tokens (the EP group's tokens, spread evenly)."""
    h, t, T = c.hidden, tp, tokens
    out = []
    if c.kv_lora_rank:  # multi-head latent attention: low-rank q and kv
        qk = c.qk_nope_dim + c.qk_rope_dim
        out += [(1, T, c.q_lora_rank, h), (1, T, c.heads * qk / t, c.q_lora_rank),
                (1, T, c.kv_lora_rank + c.qk_rope_dim, h),
                (1, T, c.heads * (c.qk_nope_dim + c.v_head_dim) / t, c.kv_lora_rank),
                (1, T, h, c.heads * c.v_head_dim / t)]
    else:
        head = h // c.heads
        out += [(1, T, (h + 2 * c.kv_heads * head) / t, h), (1, T, h, h / t)]
    up = 2 if c.gated_mlp else 1  # SwiGLU: gate and up projections
    if moe:
        per_expert = T * c.experts_per_token * ep / c.experts
        out += [(1, T, c.experts, h),  # the router
                (c.experts / ep, per_expert, up * c.expert_ffn / t, h),
                (c.experts / ep, per_expert, h, c.expert_ffn / t)]
        if c.shared_experts:
            ffn = c.shared_experts * c.expert_ffn
            out += [(1, T, up * ffn / t, h), (1, T, h, ffn / t)]
    else:
        out += [(1, T, up * c.ffn / t, h), (1, T, h, c.ffn / t)]
    return out


def layer_seconds(c: ModelConfig, tokens: float, seq: int, tp: int, ep: int,
                  moe: bool, cluster: Cluster) -> tuple[float, float]:
    """(roofline seconds, seconds at the full peak) of one layer's forward and
    backward for one micro-batch on one device. Attention's scores (12·h·seq
    FLOPs per token, forward and backward) are priced as compute at the GEMM
    efficiency (FlashAttention keeps them out of HBM): an assumption."""
    rt, ideal = 0.0, 0.0
    for count, m, n, k in layer_gemms(c, tokens, tp, ep, moe):
        rt += 3 * count * gemm_time(m, n, k, cluster)
        ideal += 3 * count * 2 * m * n * k / cluster.flops
    scores = 12 * c.hidden * seq * tokens / tp / cluster.flops
    return rt + scores / cluster.gemm_efficiency, ideal + scores


def compute_slowdown(c: ModelConfig, tokens: float, seq: int, tp: int, ep: int,
                     cluster: Cluster) -> float:
    """Roofline time over peak time for this layout's layers (dense and MoE
    weighted by their counts): 1 / gemm_efficiency where every product is large,
    more where thin per-device shapes leave it bound by HBM."""
    moe_layers = c.layers - c.dense_layers if c.experts else 0
    rt, ideal = 0.0, 0.0
    for moe, n in ((False, c.layers - moe_layers), (True, moe_layers)):
        if n:
            r, i = layer_seconds(c, tokens, seq, tp, ep, moe, cluster)
            rt, ideal = rt + n * r, ideal + n * i
    return rt / ideal
