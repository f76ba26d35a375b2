"""When a layout's data-parallel bytes can go, what its collectives pay in
latency, and how long its pipeline idles."""

from __future__ import annotations

from typing import TYPE_CHECKING

from labkit.theory.collective_cost import latency_steps
from labkit.theory.pipeline import pipeline_bubble
from labkit.theory.zero import zero_traffic

if TYPE_CHECKING:
    from labkit.theory._layout_cluster import Cluster
    from labkit.theory._layout_cost import Layout
    from labkit.theory.models import ModelConfig


def dp_phases_of(psi: float, n: int, stage: int, m: int,
                 dtype_bytes: int) -> dict[str, float]:
    """Bytes a device sends per step for data parallelism over n ranks, by when
    they can go (theory.zero_traffic's collectives, once per step or per
    micro-batch). DP and ZeRO-1 sum gradients over the m micro-batches locally and
    reduce once, at the "end", under the last micro-batch's backward only; ZeRO-1
    all-gathers the new weights at the "start" of the next step, under the first
    micro-batch's forward. ZeRO-2 keeps 1/n of the gradients, so it reduce-
    scatters every micro-batch under its "backward"; ZeRO-3 also all-gathers the
    weights for each micro-batch's forward and backward, prefetched: "stream"."""
    t = zero_traffic(psi, n, stage, dtype_bytes)
    out = dict.fromkeys(("end", "start", "backward", "stream"), 0.0)
    if stage == 0:
        out["end"] = t["all_reduce (gradients)"]
    elif stage == 1:
        out["end"] = t["reduce_scatter (gradients)"]
        out["start"] = t["all_gather (parameters)"]
    elif stage == 2:
        out["backward"] = m * t["reduce_scatter (gradients)"]
        out["start"] = t["all_gather (parameters)"]
    else:
        out["stream"] = m * sum(t.values())
    return out


def bubble_fraction(lay: Layout) -> float:
    """Idle time over busy time per step. 1F1B (p-1)/m, interleaved (p-1)/(v m)
    (theory.pipeline_bubble). DualPipe's idle is (p/2 - 1)(F&B + B - 3W)
    (DeepSeek-AI 2024, table 2); we take F = B = W and the overlapped F&B chunk
    as F + B + one F of slack, which leaves (p/2 - 1) F against m (F + B + W):
    (p/2 - 1) / (3m), an assumption of ours."""
    if lay.pp == 1:
        return 0.0
    if lay.dualpipe:
        return (lay.pp / 2 - 1) / (3 * lay.microbatches)
    return pipeline_bubble(lay.pp, lay.microbatches, lay.interleave).of_ideal


def activations_held(lay: Layout) -> float:
    """Micro-batches of one stage's activations the first stage holds at its
    peak. 1F1B: min(p, m) (chapter 10). Interleaved 1F1B with v chunks per
    stage: Megatron-LM's schedule (megatron/core/pipeline_parallel/schedules.py,
    forward_backward_pipelining_with_interleaving) runs 2(p-1) + (v-1)p chunk
    forwards before its first backward on the first stage, and one more before
    that backward, so v·p + p - 1 chunks of 1/v of the stage's layers are held:
    p + (p-1)/v micro-batches, p·(1 + (p-1)/(p v)) (Korthikanti et al. 2022,
    sec. 4.2.3, give this factor for the interleaved schedule); where m = p, or where
    that is more than all v·m chunks, every forward runs first and m are held.
    p = 16, v = 2: 23.5 where 1F1B holds 16; p = 4, v = 2: 5.5 (chapter 10
    measured it). DualPipe: p + 1 (DeepSeek-AI 2024, table 2)."""
    p, m, v = lay.pp, lay.microbatches, lay.interleave
    if p == 1:
        return 1
    if lay.dualpipe:
        return min(p + 1, m)
    if v == 1:
        return min(p, m)
    return m if m <= p else min(m, p + (p - 1) / v)


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


def group_nodes(lay: Layout, gpn: int) -> dict[str, int]:
    """Nodes each group spans, ranks numbered with ORDER's first dimension
    fastest (TP, CP, EP, PP, DP). "dp" is the dense data-parallel group (CP x EP
    x the rest of DP, where ZeRO shards), "dp_expert" the experts' (CP x the
    rest). A dimension of stride s puts min(n, gpn / s) of its n ranks in a node."""
    rest = max(1, lay.dp // lay.ep)
    deg = {"tp": lay.tp, "cp": lay.cp, "ep": lay.ep, "pp": lay.pp, "dp": rest}
    stride, s = {}, 1
    for d in ("tp", "cp", "ep", "pp", "dp"):
        stride[d], s = s, s * deg[d]

    def nodes(dims):
        size = per_node = 1
        for d in dims:
            size *= deg[d]
            per_node *= min(deg[d], max(1, gpn // stride[d]))
        return max(1, -(-size // per_node))

    out = {d: nodes((d,)) for d in ("tp", "cp", "ep", "pp")}
    # where EP borrows CP ranks (ep > dp) the product overcounts: cap by group size
    out["dp"] = min(nodes(("cp", "ep", "dp")), lay.dp * lay.cp)
    out["dp_expert"] = min(nodes(("cp", "dp")), max(1, lay.dp * lay.cp // lay.ep))
    return out


def dp_latency_of(stage: int, n: int, nodes: int, layers: int, m: int,
                  alpha_intra: float, alpha_inter: float) -> dict[str, float]:
    """Seconds of α a device pays per step for data parallelism over n ranks,
    by phase as in dp_phases_of, taking one collective per layer each time the
    layer's gradients or weights move (FSDP's unit is a layer; DDP's buckets are
    of the same order): DP all-reduces once per layer, ZeRO-1 reduce-scatters
    and all-gathers once per layer, ZeRO-2 reduce-scatters per layer and
    micro-batch, ZeRO-3 gathers forward and backward and reduce-scatters per
    layer and micro-batch."""
    out = dict.fromkeys(("end", "start", "backward", "stream"), 0.0)
    if n <= 1:
        return out

    def lat(op):
        return ring_latency(op, n, nodes, alpha_intra, alpha_inter)

    if stage == 0:
        out["end"] = layers * lat("all_reduce")
    elif stage == 1:
        out["end"], out["start"] = layers * lat("reduce_scatter"), layers * lat(
            "all_gather")
    elif stage == 2:
        out["backward"] = m * layers * lat("reduce_scatter")
        out["start"] = layers * lat("all_gather")
    else:
        out["stream"] = m * layers * (2 * lat("all_gather") + lat("reduce_scatter"))
    return out


def latency_of(c: ModelConfig, lay: Layout, cluster: Cluster, stage_layers: int,
             m: int, full: bool) -> dict:
    """Seconds of α per step, by dimension (collectives per step x ring_latency);
    "dp" is a dict by phase (dp_latency_of), dense and expert groups added."""
    a_in, a_out = cluster.alpha_intra, cluster.alpha_inter
    nodes = group_nodes(lay, cluster.gpus_per_node)

    def ring(op, d):
        return ring_latency(op, getattr(lay, d), nodes[d], a_in, a_out)

    moe_layers = -(-(c.layers - c.dense_layers) // lay.pp) if c.experts else 0
    out = {"tp": (6 if full else 4) * stage_layers * m * ring("all_reduce", "tp"),
           "cp": (3 if full else 2) * stage_layers * m * ring("all_gather", "cp"),
           "ep": 4 * moe_layers * m * ring("all_to_all", "ep"),
           "pp": 0.0}
    if lay.pp > 1:  # one α per send: activation forward, gradient back, per chunk
        out["pp"] = 2 * m * lay.interleave * (a_in if nodes["pp"] == 1 else a_out)
    n = lay.dp * lay.cp
    out["dp"] = dp_latency_of(lay.zero, n, nodes["dp"], stage_layers, m, a_in, a_out)
    if c.experts and n // lay.ep > 1:
        ex = dp_latency_of(lay.zero, n // lay.ep, nodes["dp_expert"], moe_layers, m,
                           a_in, a_out)
        out["dp"] = {k: v + ex[k] for k, v in out["dp"].items()}
    return out
