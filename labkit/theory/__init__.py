"""Layer 2, closed forms only: what the course's numbers should be.

No torch.distributed and no measurement here; imports only labkit.conventions,
labkit.units and labkit.arguments. Sizes are bytes, times seconds, bandwidths
bytes/second (labkit.units has GB = 1e9 and GiB = 2**30). Every formula names its
source, and tests/test_theory_*.py hold each to a published number.
"""

from labkit.theory import hardware
from labkit.theory._validate import check_counts
from labkit.theory.activations import (
    RECOMPUTE,
    SCORE_TERMS,
    TERM_GROUP,
    activation_memory,
    activation_terms,
)
from labkit.theory.collective_cost import (
    COLLECTIVES,
    AlphaBeta,
    alpha_beta_time,
    bus_factor,
    fit_alpha_beta,
    latency_steps,
    ring_bytes_per_rank,
)
from labkit.theory.layout import (
    A100_SELENE,
    H100_NODE,
    LLAMA3_CLUSTER,
    PUBLISHED_RUNS,
    WASTEFUL_MFU,
    ClusterSpec,
    Estimate,
    Layout,
    choose,
    estimate,
    explain,
    find,
    flops_per_token,
    gemm_time,
    group_nodes,
    layer_gemms,
    params_per_device,
    ring_latency,
    scale,
    busiest_stage_params,
    stage_layer_counts,
    stage_params,
)
from labkit.theory.models import MODELS, PUBLISHED_PARAMS, ModelConfig, param_count
from labkit.theory.pipeline import (
    Bubble,
    activations_in_flight,
    pipeline_bubble,
    zero_bubble_h1,
)
from labkit.theory.placement import (
    MODES,
    PLACEMENTS,
    Placement,
    PlacementCost,
    Verdict,
)
from labkit.theory.tensor_parallel import (
    LayerParams,
    LayerTraffic,
    layer_params,
    layer_traffic,
)
from labkit.theory.zero import (
    BytesPerParam,
    ZeroMemory,
    bytes_per_param,
    zero_breakdown,
    zero_memory,
    zero_traffic,
)

from labkit.theory.context_parallel import (
    CP_METHODS,
    ContextTraffic,
    allgather_traffic,
    context_parallel_traffic,
    ring_traffic,
    ulysses_traffic,
)
from labkit.theory import utilisation
from labkit.theory.utilisation import (
    CONVENTIONS as MFU_CONVENTIONS,
    MFU,
    MISCOUNTS,
    ImpossibleMFU,
    Miscount,
    likely_miscounts,
    mfu,
)
from labkit.theory.failures import (
    DAY,
    HOUR,
    LLAMA3_FAILURES,
    FailureSnapshot,
    SyncTraffic,
    bytes_across_hosts,
    crossover_bandwidth,
    daly_interval,
    ddp_traffic,
    diloco_traffic,
    expected_interruptions,
    failure_cost,
    failure_snapshot,
    job_mtbf,
    quantized_payload,
    sync_step_time,
    wasted_fraction,
    young_interval,
)
from labkit.theory.moe import (
    ExpertMemory,
    ExpertTraffic,
    MoEParams,
    expert_memory,
    expert_traffic,
    moe_params,
    node_limited_reach,
)

__all__ = [
    "COLLECTIVES", "MODELS", "MODES", "PLACEMENTS", "PUBLISHED_PARAMS", "AlphaBeta",
    "Bubble", "BytesPerParam", "ModelConfig", "Placement", "PlacementCost", "Verdict",
    "ZeroMemory", "activation_memory", "activations_in_flight", "alpha_beta_time",
    "bus_factor", "bytes_per_param", "fit_alpha_beta", "latency_steps",
    "param_count", "pipeline_bubble", "ring_bytes_per_rank", "zero_breakdown",
    "zero_memory", "zero_traffic",
]
__all__ += ["LayerParams", "LayerTraffic", "activation_terms", "layer_params",
            "layer_traffic", "zero_bubble_h1"]
# the layout calculator (labkit.theory.layout): what chapters and other layers use
__all__ += ["A100_SELENE", "H100_NODE", "LLAMA3_CLUSTER", "PUBLISHED_RUNS",
            "WASTEFUL_MFU", "ClusterSpec", "Layout", "choose", "estimate", "explain",
            "find", "flops_per_token", "gemm_time", "group_nodes", "layer_gemms",
            "params_per_device", "ring_latency", "scale", "Estimate",
            "busiest_stage_params", "stage_layer_counts", "stage_params"]
# for chapters and the layers above (tests/test_public_faces.py)
__all__ += ["RECOMPUTE", "SCORE_TERMS", "TERM_GROUP", "check_counts", "hardware"]
__all__ += ["CP_METHODS", "ContextTraffic", "allgather_traffic",
            "context_parallel_traffic", "ring_traffic", "ulysses_traffic"]
__all__ += ["ExpertMemory", "ExpertTraffic", "MoEParams", "expert_memory",
            "expert_traffic", "moe_params", "node_limited_reach"]
__all__ += ["DAY", "HOUR", "LLAMA3_FAILURES", "FailureSnapshot", "SyncTraffic",
            "bytes_across_hosts", "crossover_bandwidth", "daly_interval",
            "ddp_traffic", "diloco_traffic", "expected_interruptions", "failure_cost",
            "failure_snapshot", "job_mtbf", "quantized_payload", "sync_step_time",
            "wasted_fraction", "young_interval"]
# MFU under named conventions (theory.utilisation; its flops_per_token is
# utilisation.flops_per_token, the calculator's is theory.flops_per_token)
__all__ += ["MFU", "MFU_CONVENTIONS", "MISCOUNTS", "ImpossibleMFU", "Miscount",
            "likely_miscounts", "mfu", "utilisation"]
