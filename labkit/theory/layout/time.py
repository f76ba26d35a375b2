"""Seconds one device of a layout spends per step: compute, each dimension's
exposed communication (α-β: bytes over the link its group uses, plus α per ring
step), and the pipeline bubble."""

from __future__ import annotations

from labkit.theory.collective_cost import latency_steps
from labkit.theory.layout.cluster import ClusterSpec
from labkit.theory.layout.layout import (
    DIMS,
    Layout,
    StepShape,
    group_nodes,
    groups_in_node,
)
from labkit.theory.layout.traffic import DP_PHASES, dp_traffic
from labkit.theory.models import ModelConfig
from labkit.theory.pipeline import pipeline_bubble


def bubble_of_ideal(layout: Layout) -> float:
    """Idle time over busy time per step. 1F1B (p-1)/m, interleaved (p-1)/(v m)
    (theory.pipeline_bubble). DualPipe's idle is (p/2 - 1)(F&B + B - 3W)
    (DeepSeek-AI 2024, table 2); we take F = B = W and the overlapped F&B chunk
    as F + B + one F of slack, which leaves (p/2 - 1) F against m (F + B + W):
    (p/2 - 1) / (3m), an assumption of ours."""
    if layout.pp == 1:
        return 0.0
    if layout.dualpipe:
        return (layout.pp / 2 - 1) / (3 * layout.microbatches)
    return pipeline_bubble(layout.pp, layout.microbatches, layout.interleave).of_ideal


def ring_latency(op: str, n: int, nodes: int, alpha_intra: float,
                 alpha_inter: float) -> float:
    """The α part of one ring collective over n ranks on `nodes` nodes: its
    latency_steps(op, n) steps (2(n-1) for all-reduce, n-1 otherwise), of which
    latency_steps(op, nodes) cross between nodes and pay alpha_inter, the rest
    alpha_intra (NCCL's ring model, src/graph/tuning.cc)."""
    if n <= 1:
        return 0.0
    inter = latency_steps(op, nodes) if nodes > 1 else 0
    return (latency_steps(op, n) - inter) * alpha_intra + inter * alpha_inter


def dp_latency_of(stage: int, n: int, nodes: int, layers: int, m: int,
                  alpha_intra: float, alpha_inter: float) -> dict[str, float]:
    """Seconds of α a device pays per step for data parallelism over n ranks,
    by phase as in dp_phases_of, taking one collective per layer each time the
    layer's gradients or weights move (FSDP's unit is a layer; DDP's buckets are
    of the same order): DP all-reduces once per layer, ZeRO-1 reduce-scatters
    and all-gathers once per layer, ZeRO-2 reduce-scatters per layer and
    micro-batch, ZeRO-3 gathers forward and backward and reduce-scatters per
    layer and micro-batch. m: micro-batches per step."""
    out = dict.fromkeys(DP_PHASES, 0.0)
    if n <= 1:
        return out

    def alpha(op):
        return ring_latency(op, n, nodes, alpha_intra, alpha_inter)

    if stage == 0:
        out["end"] = layers * alpha("all_reduce")
    elif stage == 1:
        out["end"] = layers * alpha("reduce_scatter")
        out["start"] = layers * alpha("all_gather")
    elif stage == 2:
        out["backward"] = m * layers * alpha("reduce_scatter")
        out["start"] = layers * alpha("all_gather")
    else:
        out["stream"] = m * layers * (2 * alpha("all_gather") + alpha("reduce_scatter"))
    return out


def latency(layout: Layout, cluster: ClusterSpec, shape: StepShape) -> dict[str, float]:
    """Seconds of α per step for TP, CP, PP and EP (collectives per step x
    ring_latency; one α per pipeline send)."""
    alpha_in, alpha_out = cluster.alpha_intra, cluster.alpha_inter
    nodes = group_nodes(layout, cluster.gpus_per_node)

    def ring(op, dim):
        return ring_latency(op, getattr(layout, dim), nodes[dim], alpha_in, alpha_out)

    full, m = layout.recompute == "full", shape.microbatches
    out = {"tp": (6 if full else 4) * shape.stage_layers * m * ring("all_reduce", "tp"),
           "cp": (3 if full else 2) * shape.stage_layers * m * ring("all_gather", "cp"),
           "ep": 4 * shape.stage_moe_layers * m * ring("all_to_all", "ep"),
           "pp": 0.0}
    if layout.pp > 1:  # one α per send: activation forward, gradient back, per chunk
        out["pp"] = 2 * m * layout.interleave * (alpha_in if nodes["pp"] == 1
                                                  else alpha_out)
    return out


def dp_latency(model: ModelConfig, layout: Layout, cluster: ClusterSpec,
               shape: StepShape) -> dict[str, float]:
    """Seconds of α per step for data parallelism, by phase (dp_latency_of), the
    dense group's and the routed experts' added."""
    alpha_in, alpha_out = cluster.alpha_intra, cluster.alpha_inter
    nodes = group_nodes(layout, cluster.gpus_per_node)
    replicas, m = layout.dp * layout.cp, shape.microbatches
    out = dp_latency_of(layout.zero, replicas, nodes["dp"], shape.stage_layers, m,
                        alpha_in, alpha_out)
    if model.experts and layout.expert_replicas > 1:
        experts = dp_latency_of(layout.zero, layout.expert_replicas, nodes["dp_expert"],
                                shape.stage_moe_layers, m, alpha_in, alpha_out)
        out = {phase: seconds + experts[phase] for phase, seconds in out.items()}
    return out


def _dp_exposed(model: ModelConfig, layout: Layout, cluster: ClusterSpec,
                shape: StepShape, bandwidth: float, compute: float,
                dtype_bytes: int) -> float:
    """DP's seconds that the compute running while they can go does not hide:
    the "end" under the last micro-batch's backward, the "start" under the first
    one's forward, ZeRO-2's reduce-scatters under all backwards, ZeRO-3's
    stream under the whole step."""
    m = shape.microbatches
    window = {"end": 2 / 3 * compute / m, "start": compute / 3 / m,
              "backward": 2 / 3 * compute, "stream": compute}
    alpha = dp_latency(model, layout, cluster, shape)
    return sum(max(0.0, size / bandwidth + alpha[phase] - window[phase])
               for phase, size in dp_traffic(model, layout, shape,
                                             dtype_bytes).items())


def time(model: ModelConfig, layout: Layout, cluster: ClusterSpec, shape: StepShape,
         sent: dict[str, float], roofline_compute: float,
         dtype_bytes: int = 2) -> dict[str, float]:
    """Seconds per step: compute, then each dimension's exposed communication,
    then the bubble. compute: roofline_compute (the model's FLOPs priced by the
    roofline at this layout's shapes), x 4/3 with full recomputation. Each
    collective by the α-β model: `sent` (traffic()) over NVLink if its group
    lies in a node, else over the NIC, plus α per ring step (NCCL's intra- and
    inter-node α, ring_latency). DualPipe hides EP and PP under compute; DP hides
    under the compute that runs while it can go (_dp_exposed); the bubble is
    bubble_of_ideal of the rest."""
    in_node = groups_in_node(layout, cluster.gpus_per_node)
    bandwidth = {dim: cluster.intra_bw if in_node[dim] else cluster.inter_bw
                 for dim in DIMS}
    alpha = latency(layout, cluster, shape)
    compute = roofline_compute * (4 / 3 if layout.recompute == "full" else 1)
    seconds = {"compute": compute}
    for dim in ("tp", "cp", "pp", "ep"):
        seconds[dim] = sent[dim] / bandwidth[dim] + alpha[dim]
    if layout.dualpipe:  # forward and backward chunks of two micro-batches overlap
        both = seconds["ep"] + seconds["pp"]  # what compute cannot hide stays each's
        left = max(0.0, both - compute) / both if both else 0.0
        seconds["ep"], seconds["pp"] = seconds["ep"] * left, seconds["pp"] * left
    seconds["dp"] = _dp_exposed(model, layout, cluster, shape, bandwidth["dp"],
                                compute, dtype_bytes)
    busy = compute + sum(seconds[dim] for dim in ("tp", "cp", "pp", "ep"))
    seconds["bubble"] = bubble_of_ideal(layout) * busy
    return seconds
