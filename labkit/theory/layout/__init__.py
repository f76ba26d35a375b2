"""The layout calculator: what a parallel layout (TP, CP, PP, DP/ZeRO, EP) costs
per device on a cluster, in closed form, and a chooser that ranks layouts.

Part of labkit.theory: imports labkit.theory's other modules, labkit.conventions
and labkit.units only. Each module here imports only those before it in this
order (no cycles): cluster, layout, costs (estimate() and what it adds up),
published, ranking, runs, scaling.
"""

from labkit.theory.layout.costs import (
    activations_held,
    bubble_of_ideal,
    busiest_stage_params,
    compute_slowdown,
    estimate,
    Estimate,
    flops_per_token,
    gemm_time,
    layer_gemms,
    params_per_device,
    ring_latency,
    stage_layer_counts,
    stage_params,
)
from labkit.theory.layout.cluster import (
    A100_SELENE,
    DEEPSEEK_V3_CLUSTER,
    H100_NODE,
    LLAMA3_CLUSTER,
    ClusterSpec,
)
from labkit.theory.layout.layout import DIMS, Layout, check_layout, group_nodes
from labkit.theory.layout.published import LLAMA3_LONG_CONTEXT, PUBLISHED_LAYOUTS
from labkit.theory.layout.ranking import Ranked, choose, explain, find
from labkit.theory.layout.runs import PUBLISHED_RUNS, PublishedRun
from labkit.theory.layout.scaling import WASTEFUL_MFU, Scale, scale

__all__ = [
    "A100_SELENE", "DEEPSEEK_V3_CLUSTER", "DIMS", "H100_NODE", "LLAMA3_CLUSTER",
    "LLAMA3_LONG_CONTEXT", "PUBLISHED_LAYOUTS", "PUBLISHED_RUNS", "WASTEFUL_MFU",
    "ClusterSpec", "Estimate", "Layout", "PublishedRun", "Ranked", "Scale",
    "activations_held", "bubble_of_ideal", "check_layout", "choose",
    "compute_slowdown", "estimate", "explain", "find", "flops_per_token",
    "gemm_time", "group_nodes", "layer_gemms", "params_per_device", "ring_latency",
    "scale", "busiest_stage_params", "stage_layer_counts", "stage_params",
]
