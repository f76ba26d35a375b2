"""Bytes one device of a layout sends per step, by parallel dimension, and
when its data-parallel bytes can go (ring collectives throughout)."""

from __future__ import annotations

from labkit.theory.collective_cost import ring_bytes_per_rank
from labkit.theory.layout.cluster import ClusterSpec
from labkit.theory.layout.counts import params_per_device
from labkit.theory.layout.layout import DIMS, Layout, StepShape, group_nodes
from labkit.theory.models import ModelConfig
from labkit.theory.tensor_parallel import layer_traffic
from labkit.theory.zero import zero_traffic

# When data-parallel bytes can go: see dp_phases_of.
DP_PHASES = ("end", "start", "backward", "stream")
# Node-limited routing: DeepSeek-AI 2024, sec. 2.1.2 and 3.2.2, sends each token
# to at most 4 nodes; it crosses InfiniBand once per node and is forwarded to
# that node's experts over NVLink. Where an EP group spans nodes, a token's
# copies on the network are min(top-k, this) instead of top-k.
NODE_LIMITED_ROUTING = {"DeepSeek-V3": 4}


def dp_phases_of(psi: float, n: int, stage: int, m: int,
                 dtype_bytes: int) -> dict[str, float]:
    """Bytes a device sends per step for data parallelism over n ranks, by when
    they can go (theory.zero_traffic's collectives, once per step or per
    micro-batch). DP and ZeRO-1 sum gradients over the m micro-batches locally and
    reduce once, at the "end", under the last micro-batch's backward only; ZeRO-1
    all-gathers the new weights at the "start" of the next step, under the first
    micro-batch's forward. ZeRO-2 keeps 1/n of the gradients, so it reduce-
    scatters every micro-batch under its "backward"; ZeRO-3 also all-gathers the
    weights for each micro-batch's forward and backward, prefetched: "stream".
    psi: the parameters this device holds before ZeRO shards them."""
    sent = zero_traffic(psi, n, stage, dtype_bytes)
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
    (DP x CP / EP; folded, TP x DP x CP / (expert TP x EP))."""
    dense, experts = params_per_device(model, layout)
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
