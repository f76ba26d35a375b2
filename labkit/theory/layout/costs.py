"""What a layout costs per device, in closed form, read top to bottom: parameters
and FLOPs (counts), matrix-product time against the roofline, memory by
category, traffic by dimension, step time (compute, exposed communication,
bubble), the Estimate they fill, its reasons in words, and `estimate()`, which
runs them in that order.

Imports labkit.theory's other modules, layout.cluster, layout.layout,
labkit.conventions and labkit.units.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import lru_cache

from labkit.conventions import ACTIVATION, GRADIENT, OPTSTATE, PARAMETER
from labkit.theory.activations import activation_terms
from labkit.theory.collective_cost import latency_steps, ring_bytes_per_rank
from labkit.theory.layout.cluster import ClusterSpec
from labkit.theory.layout.layout import (
    DIMS,
    Layout,
    StepShape,
    group_nodes,
    groups_in_node,
    step_shape,
)
from labkit.theory.models import ModelConfig, param_count
from labkit.theory.pipeline import pipeline_bubble
from labkit.theory.tensor_parallel import layer_traffic
from labkit.theory.zero import zero_breakdown, zero_traffic
from labkit.units import percent, si_bytes


# -- counts: parameters and FLOPs, as a layout divides them

@lru_cache(maxsize=64)
def _param_count(model: ModelConfig, active: bool = False) -> int:
    return param_count(model, active=active)  # the chooser asks thousands of times


def expert_params(model: ModelConfig) -> int:
    """Routed experts' parameters (those expert parallelism shards)."""
    if not model.experts:
        return 0
    matrices = 3 if model.gated_mlp else 2
    return ((model.layers - model.dense_layers) * model.experts * matrices
            * model.hidden * model.expert_ffn)


def params_per_device(model: ModelConfig, layout: Layout) -> tuple[float, float]:
    """(dense, routed-expert) parameters one device holds before ZeRO: the dense
    split over TP x PP, the experts over expert TP x PP x EP (expert TP = TP
    unless the layout is folded)."""
    total, experts = _param_count(model), expert_params(model)
    dense = (total - experts) / (layout.tp * layout.pp)
    return dense, experts / (layout.etp * layout.pp * layout.ep)


def stage_layer_counts(model: ModelConfig, layout: Layout) -> list[int]:
    """Layers on each pipeline stage: ceil(layers / PP) each (the last stage
    what is left), except where the embedding and the head can each take a
    layer's place (layers + 2 divisible by PP): then the first and last stage
    hold one fewer, Llama 3's split (Llama Team 2024, sec. 3.3.2: 126 layers
    over 16 stages, 7 + 8 x 14 + 7)."""
    p, n = layout.pp, model.layers
    if p > 1 and (n + 2) % p == 0:
        inner = (n + 2) // p
        return [inner - 1] + [inner] * (p - 2) + [inner - 1]
    each = -(-n // p)
    counts = [min(each, n - k * each) for k in range(p)]
    if min(counts) < 1:
        raise ValueError(f"{n} layers leave a stage of PP {p} empty")
    return counts


def stage_params(model: ModelConfig, layout: Layout, stage: int) -> float:
    """Dense parameters one device of pipeline stage `stage` holds before ZeRO:
    its layers' share (the dense part of the average layer) over TP, the
    embedding (and a learned position table) on the first stage, the head and
    the final norm on the last (a tied model's last stage keeps its own copy of
    the embedding, as Megatron-LM does). Norms and biases split over TP here,
    where TP keeps row-parallel biases and norms whole: labkit.parallel.scale_twin
    builds the stages and holds this to the element but for those."""
    total, experts = _param_count(model), expert_params(model)
    if layout.pp == 1:
        return (total - experts) / layout.tp
    h = model.hidden
    embed = model.vocab * h + model.learned_positions * h
    head = model.vocab * h
    final_norm = h * (2 if model.norm == "layernorm" else 1)
    outside = embed + final_norm + (0 if model.tied_embeddings else head)
    layer = (total - experts - outside) / model.layers
    held = stage_layer_counts(model, layout)[stage] * layer
    held += embed if stage == 0 else 0
    held += head + final_norm if stage == layout.pp - 1 else 0
    return held / layout.tp


@lru_cache(maxsize=4096)  # memory() and dp_traffic() of every layout the chooser tries
def busiest_stage_params(model: ModelConfig, layout: Layout) -> float:
    """stage_params of the stage that holds the most: what memory() and
    dp_traffic() charge a device (P / (TP x PP), params_per_device, is the
    average, which the end stages' embedding and head exceed). DualPipe: the
    average, which memory() doubles: each device holds two mirrored stages, the
    first's and the last's together (DeepSeek-AI 2024, sec. 3.4: the embedding
    and the head on one PP rank), a split the report does not give."""
    if layout.dualpipe:
        return params_per_device(model, layout)[0]
    ends = {0, layout.pp - 1, min(1, layout.pp - 1)}
    return max(stage_params(model, layout, k) for k in ends)


def flops_per_token(model: ModelConfig, seq: int) -> float:
    """Training FLOPs per token: 6 per active parameter (forward 2, backward 4)
    plus the attention scores, 12·layers·hidden·seq (Narayanan et al. 2021, eq. 3,
    without its logit term, which 6N already counts)."""
    return 6 * _param_count(model, True) + 12 * model.layers * model.hidden * seq



# -- roofline: how fast a layout's matrix products run on one device

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



# -- memory: bytes one device holds, by category

def activations_held(layout: Layout) -> float:
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
    p, m, v = layout.pp, layout.microbatches, layout.interleave
    if p == 1:
        return 1
    if layout.dualpipe:
        return min(p + 1, m)
    if v == 1:
        return min(p, m)
    return m if m <= p else min(m, p + (p - 1) / v)


def memory(model: ModelConfig, layout: Layout, shape: StepShape,
           dtype_bytes: int = 2) -> dict[str, float]:
    """Bytes per device by memory category: Parameter, Gradient, Optstate, Activation.

    Mixed-precision Adam (2 + 2 + 12 bytes per parameter, theory.zero),
    parameters split over TP x PP (experts over expert TP x PP x EP), ZeRO over
    DP x CP (the experts' over their replicas, Layout.expert_replicas); DualPipe
    keeps two copies of the parameters.
    The busiest stage holds ceil(layers / PP) layers and activations_held(layout)
    micro-batches of activations (1F1B min(PP, m), interleaved PP + (PP-1)/v,
    DualPipe PP + 1; Korthikanti et al.'s GPT layer, with sequence parallelism
    when TP > 1 unless the layout turns it off, and FlashAttention, so no s x s
    scores; RMSNorm models (Llama 3, DeepSeek-V3) train without dropout, so no
    dropout masks; MLA and MoE change the constants, which this ignores)."""
    dense = busiest_stage_params(model, layout)
    experts = params_per_device(model, layout)[1]
    replicas = layout.dp * layout.cp
    dense_states = zero_breakdown(dense, replicas, layout.zero,
                                  param_bytes=dtype_bytes, grad_bytes=dtype_bytes)
    expert_states = zero_breakdown(experts, layout.expert_replicas, layout.zero,
                                   param_bytes=dtype_bytes, grad_bytes=dtype_bytes)
    sequence_parallel = layout.tp > 1 and layout.sequence_parallel
    terms = activation_terms(shape.local_seq, shape.microbatch, model.hidden,
                             model.heads, layout.tp, sequence_parallel,
                             layout.recompute, attention_scores=False)
    per_layer = sum(size for term, size in terms.items()
                    if model.norm == "layernorm" or "dropout mask" not in term)
    copies = 2 if layout.dualpipe else 1
    return {PARAMETER: (dense_states.parameter + expert_states.parameter) * copies,
            GRADIENT: dense_states.gradient + expert_states.gradient,
            OPTSTATE: dense_states.optstate + expert_states.optstate,
            ACTIVATION: per_layer * shape.stage_layers * activations_held(layout)}



# -- traffic: bytes one device sends per step, by parallel dimension

# When data-parallel bytes can go: see dp_phases_of.
DP_PHASES = ("end", "start", "backward", "stream")
# Node-limited routing: DeepSeek-AI 2024, sec. 2.1.2 and 3.2.2, sends each token
# to at most 4 nodes; it crosses InfiniBand once per node and is forwarded to
# that node's experts over NVLink. Where an EP group spans nodes, a token's
# copies on the network are min(top-k, this) instead of top-k.
NODE_LIMITED_ROUTING = {"DeepSeek-V3": 4}


def dp_phases_of(psi: float, dp_size: int, stage: int, m: int,
                 dtype_bytes: int) -> dict[str, float]:
    """Bytes a device sends per step for data parallelism over n = dp_size
    ranks, by when they can go (theory.zero_traffic's collectives, once per step
    or per micro-batch). DP and ZeRO-1 sum gradients over the m micro-batches
    locally and reduce once, at the "end", under the last micro-batch's backward
    only; ZeRO-1 all-gathers the new weights at the "start" of the next step,
    under the first micro-batch's forward. ZeRO-2 keeps 1/n of the gradients, so
    it reduce-scatters every micro-batch under its "backward"; ZeRO-3 also
    all-gathers the weights for each micro-batch's forward and backward,
    prefetched: "stream". psi: the parameters this device holds before ZeRO
    shards them."""
    sent = zero_traffic(psi, dp_size, stage, dtype_bytes)
    out = dict.fromkeys(DP_PHASES, 0.0)
    if stage == 0:
        out["end"] = sent["all_reduce (gradients)"]
    elif stage == 1:
        out["end"] = sent["reduce_scatter (gradients)"]
        out["start"] = sent["all_gather (parameters)"]
    elif stage == 2:
        out["backward"] = m * sent["reduce_scatter (gradients)"]
        out["start"] = sent["all_gather (parameters)"]
    else:
        out["stream"] = m * sum(sent.values())
    return out


def dp_traffic(model: ModelConfig, layout: Layout, shape: StepShape,
               dtype_bytes: int = 2) -> dict[str, float]:
    """Data-parallel bytes per step by phase (dp_phases_of): the dense
    parameters' over DP x CP ranks plus the routed experts' over their replicas
    (DP x CP / EP; folded, TP x DP x CP / (expert TP x EP)); the dense ones
    of the busiest stage (busiest_stage_params)."""
    dense = busiest_stage_params(model, layout)
    experts = params_per_device(model, layout)[1]
    replicas = layout.dp * layout.cp
    phases = dict.fromkeys(DP_PHASES, 0.0)
    for psi, ranks in ((dense, replicas), (experts, layout.expert_replicas)):
        if psi and ranks > 1:
            by_phase = dp_phases_of(psi, ranks, layout.zero, shape.microbatches,
                                    dtype_bytes)
            for phase, size in by_phase.items():
                phases[phase] += size
    return phases


def _cp_layer_bytes(model: ModelConfig, layout: Layout, shape: StepShape,
                    dtype_bytes: int) -> float:
    """CP all-gathers K and V of the whole sequence forward (again in the
    recomputed forward) and reduce-scatters their gradients backward."""
    if model.kv_lora_rank:  # MLA caches one latent and the rope key per token
        kv_dim = model.kv_lora_rank + model.qk_rope_dim
    else:
        kv_dim = 2 * model.kv_heads * (model.hidden // model.heads)
    kv = shape.microbatch * shape.seq * kv_dim * dtype_bytes / layout.tp
    gathers = 2 if layout.recompute == "full" else 1
    return (ring_bytes_per_rank("all_gather", kv, layout.cp) * gathers
            + ring_bytes_per_rank("reduce_scatter", kv, layout.cp))


def _ep_layer_bytes(model: ModelConfig, layout: Layout, cluster: ClusterSpec,
                    shape: StepShape, dtype_bytes: int) -> float:
    """EP's dispatch and combine all-to-alls of the routed tokens, forward and
    backward. Inside a node: a row per (token, expert) pair, (ep-1)/ep of them to
    another GPU. Where the EP group spans nodes, the bytes on the network: a
    token's copies (capped by node-limited routing, one per node, forwarded
    inside it), of which (nodes-1)/nodes go to another node when routing spreads
    them evenly, the token's own node as likely as any."""
    row = shape.microbatch * shape.local_seq * model.hidden * dtype_bytes / layout.tp
    copies = model.experts_per_token
    nodes = group_nodes(layout, cluster.gpus_per_node)["ep"]
    if nodes == 1:
        return 2 * 2 * ring_bytes_per_rank("all_to_all", row * copies, layout.ep)
    copies = min(copies, NODE_LIMITED_ROUTING.get(model.name, copies))
    return 2 * 2 * row * copies * (nodes - 1) / nodes


def traffic(model: ModelConfig, layout: Layout, cluster: ClusterSpec, shape: StepShape,
            dtype_bytes: int = 2) -> dict[str, float]:
    """Bytes each device sends per step (ring collectives), by dimension: TP 4
    all-reduces per layer per micro-batch (6 with full recomputation); CP
    all-gathers K and V forward and reduce-scatters their gradients backward;
    PP sends each micro-batch's activation forward and its gradient back (/TP:
    scatter-gather; v times with interleaving); DP/ZeRO theory.zero_traffic of
    this device's parameters (dp_traffic); EP dispatch and combine all-to-alls
    of the routed tokens, forward and backward. m micro-batches of b sequences
    per step (shape)."""
    full = layout.recompute == "full"
    m, b = shape.microbatches, shape.microbatch
    sent = dict.fromkeys(DIMS, 0.0)
    if layout.tp > 1:
        tp_layer = layer_traffic(b, shape.local_seq, model.hidden, layout.tp,
                                 dtype_bytes).bytes_per_rank * (1.5 if full else 1)
        sent["tp"] = tp_layer * shape.stage_layers * m
    if layout.cp > 1:
        cp_layer = _cp_layer_bytes(model, layout, shape, dtype_bytes)
        sent["cp"] = cp_layer * shape.stage_layers * m
    if layout.pp > 1:
        sent["pp"] = (2 * m * b * shape.local_seq * model.hidden * dtype_bytes
                      / layout.tp * layout.interleave)
    sent["dp"] = sum(dp_traffic(model, layout, shape, dtype_bytes).values())
    if layout.ep > 1:
        ep_layer = _ep_layer_bytes(model, layout, cluster, shape, dtype_bytes)
        sent["ep"] = ep_layer * shape.stage_moe_layers * m
    return sent



# -- time: seconds one device spends per step (compute, exposed communication, bubble)

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


def ring_latency(op: str, world_size: int, nodes: int, alpha_intra: float,
                 alpha_inter: float) -> float:
    """The α part of one ring collective over n = world_size ranks on `nodes`
    nodes: its latency_steps(op, n) steps (2(n-1) for all-reduce, n-1
    otherwise), of which latency_steps(op, nodes) cross between nodes and pay
    alpha_inter, the rest alpha_intra (NCCL's ring model, src/graph/tuning.cc)."""
    if world_size <= 1:
        return 0.0
    inter = latency_steps(op, nodes) if nodes > 1 else 0
    return (latency_steps(op, world_size) - inter) * alpha_intra + inter * alpha_inter


def dp_latency_of(stage: int, dp_size: int, nodes: int, layers: int, m: int,
                  alpha_intra: float, alpha_inter: float) -> dict[str, float]:
    """Seconds of α a device pays per step for data parallelism over dp_size
    ranks, by phase as in dp_phases_of, taking one collective per layer each
    time the layer's gradients or weights move (FSDP's unit is a layer; DDP's
    buckets are of the same order): DP all-reduces once per layer, ZeRO-1
    reduce-scatters and all-gathers once per layer, ZeRO-2 reduce-scatters per
    layer and micro-batch, ZeRO-3 gathers forward and backward and
    reduce-scatters per layer and micro-batch. m: micro-batches per step."""
    out = dict.fromkeys(DP_PHASES, 0.0)
    if dp_size <= 1:
        return out

    def alpha(op):
        return ring_latency(op, dp_size, nodes, alpha_intra, alpha_inter)

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


def step_time(model: ModelConfig, layout: Layout, cluster: ClusterSpec,
              shape: StepShape, sent: dict[str, float], roofline_compute: float,
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



# -- what the calculator returns for one layout: its costs broken down

@dataclass(frozen=True)
class Estimate:
    """One layout on one cluster: bytes per device, bytes sent per device per
    step, and seconds per step (compute, each exposed communication, bubble)."""

    layout: Layout
    memory: dict[str, float]  # by category: Parameter, Gradient, Optstate, Activation
    traffic: dict[str, float]  # tp, cp, pp, dp, ep
    time: dict[str, float]  # compute, tp, cp, pp, ep, dp, bubble (exposed)
    gpu_memory: float
    in_node: dict[str, bool]  # each dimension > 1: does its group fit in a node
    reasons: list[str] = field(default_factory=list)
    model_time: float = 0.0  # the model's FLOPs at the full peak, seconds
    gemm_slowdown: float = 1.0  # roofline time over peak time of the layers

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: the model's FLOPs (no recomputation) over
        what the GPU's peak could do in the step."""
        return self.model_time / self.step_time

    @property
    def memory_total(self) -> float:
        return sum(self.memory.values())

    @property
    def traffic_total(self) -> float:
        return sum(self.traffic.values())

    @property
    def step_time(self) -> float:
        return sum(self.time.values())

    @property
    def fits(self) -> bool:
        return self.memory_total <= self.gpu_memory



# -- reasons: plain sentences on why a layout costs what it costs

# si_bytes writes kB, MB or GB: a small model's bytes never read 0.0 GB
_WHERE = {True: "inside a node", False: "across nodes"}


def reasons(est: Estimate, cluster: ClusterSpec) -> list[str]:
    """Plain sentences on why this layout costs what it costs."""
    layout, out = est.layout, []
    link = {True: f"NVLink ({cluster.intra_bw / 1e9:,.0f} GB/s)",
            False: f"the network ({cluster.inter_bw / 1e9:,.0f} GB/s)"}
    if layout.tp > 1:
        inside = est.in_node["tp"]
        stays = "stays inside a node" if inside else "spans nodes"
        calls = 6 if layout.recompute == "full" else 4
        no_sp = "" if layout.sequence_parallel else " (no sequence parallelism)"
        out.append(f"TP {layout.tp}{no_sp} {stays}: its {calls} all-reduces per "
                   f"layer ({si_bytes(est.traffic['tp'])} per step) run on "
                   f"{link[inside]}")
    if layout.cp > 1:
        inside = est.in_node["cp"]
        out.append(f"CP {layout.cp} splits each sequence {_WHERE[inside]}; gathering "
                   f"K and V sends {si_bytes(est.traffic['cp'])} per step on "
                   f"{link[inside]}")
    if layout.ep > 1:
        inside = est.in_node["ep"]
        nodes = group_nodes(layout, cluster.gpus_per_node)["ep"]
        hidden = (", hidden under compute by DualPipe" if layout.dualpipe
                  and est.time["ep"] == 0 else "")
        out.append(f"EP {layout.ep} spans {nodes} node{'s' if nodes > 1 else ''}: "
                   f"its all-to-alls send {si_bytes(est.traffic['ep'])} per step on "
                   f"{link[inside]}{hidden}")
    if layout.pp > 1:
        bubble = est.time["bubble"] / est.step_time
        out.append(f"PP {layout.pp} runs {_WHERE[est.in_node['pp']]}: only "
                   f"{si_bytes(est.traffic['pp'])} of activations per step go point "
                   f"to point, at the cost of a {percent(bubble)} bubble "
                   f"({layout.schedule}, {layout.microbatches} micro-batches)")
    if layout.dp > 1:
        hidden = est.time["dp"] < 0.005
        zero = f"ZeRO-{layout.zero} " if layout.zero else ""
        out.append(f"{zero}DP {layout.dp} is outermost ({_WHERE[est.in_node['dp']]}): "
                   f"its {si_bytes(est.traffic['dp'])} of data-parallel traffic per "
                   f"step " + ("hides under the backward" if hidden else
                               f"leaves {est.time['dp']:.2f} s exposed"))
    out.append(f"its matrix products run at {1 / est.gemm_slowdown:.0%} of the "
               f"{cluster.flops / 1e12:,.0f} TFLOPS peak (roofline at this layout's "
               f"per-GPU shapes); the step reaches {percent(est.mfu)} MFU")
    verdict = "fits in" if est.fits else "does not fit in"
    out.append(f"{si_bytes(est.memory_total)} per GPU {verdict} "
               f"{si_bytes(est.gpu_memory)} (activations "
               f"{si_bytes(est.memory[ACTIVATION])}, recompute {layout.recompute})")
    return out



# -- estimate(): memory, traffic and step time, combined into an Estimate

def estimate(model: ModelConfig, layout: Layout, cluster: ClusterSpec,
             global_batch_tokens: int, seq: int, dtype_bytes: int = 2) -> Estimate:
    """Memory (memory), traffic (traffic) and step time (time) per device of
    `layout` training `model` on `cluster`, `global_batch_tokens` per step in
    sequences of `seq`; ValueError where the layout cannot run (check_layout).
    Compute is the model's FLOPs at the peak x the roofline's slowdown for this
    layout's per-device matrix shapes (compute_slowdown)."""
    shape = step_shape(model, layout, cluster, global_batch_tokens, seq)
    at_peak = model_time(model, layout, cluster, shape)
    slowdown = compute_slowdown(model, shape.microbatch_tokens, seq, layout.tp,
                                layout.ep, cluster, layout.etp)
    sent = traffic(model, layout, cluster, shape, dtype_bytes)
    in_node = groups_in_node(layout, cluster.gpus_per_node)
    est = Estimate(layout, memory(model, layout, shape, dtype_bytes), sent,
                   step_time(model, layout, cluster, shape, sent, at_peak * slowdown,
                        dtype_bytes),
                   cluster.gpu_memory,
                   {dim: in_node[dim] for dim in DIMS if getattr(layout, dim) > 1},
                   model_time=at_peak, gemm_slowdown=slowdown)
    return dataclasses.replace(est, reasons=reasons(est, cluster))
