"""A parallel layout's memory, traffic and step time per device, in closed form.

The pieces are the course's own closed forms: ZeRO's model states
(theory.zero), Korthikanti et al.'s activations (theory.activations), Megatron's
tensor-parallel all-reduces (theory.tensor_parallel), ring collectives
(theory.collective_cost) and pipeline bubbles (theory.pipeline). What this
module adds is how a layout's degrees feed them, and a step time: matrix
products by a roofline at the shapes each device gets (_layout_roofline), each
collective by the α-β model, α from NCCL's own cost model (_layout_cluster).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from labkit.theory._layout_cluster import Cluster
from labkit.theory._validate import check_counts
from labkit.theory.activations import activation_terms
from labkit.theory.collective_cost import ring_bytes_per_rank
from labkit.theory.models import ModelConfig, param_count
from labkit.theory.tensor_parallel import layer_traffic
from labkit.theory.zero import zero_breakdown

DIMS = ("tp", "cp", "pp", "dp", "ep")
# rank order, innermost first: TP, CP, the expert-parallel part of DP, PP, the rest
# of DP. Llama 3 orders its groups [TP, CP, PP, DP] (Llama Team 2024, sec. 3.3.2);
# DeepSeek-V3 packs each EP 64 group onto 8 consecutive nodes (DeepSeek-AI 2024,
# sec. 3.2), so EP comes before PP here; with EP 1 this is Llama's order.
ORDER = ("tp", "cp", "ep", "pp", "dp")
# Node-limited routing: DeepSeek-AI 2024, sec. 2.1.2 and 3.2.2, sends each token
# to at most 4 nodes; it crosses InfiniBand once per node and is forwarded to
# that node's experts over NVLink. Where an EP group spans nodes, a token's
# copies on the network are min(top-k, this) instead of top-k.
NODE_LIMITED_ROUTING = {"DeepSeek-V3": 4}


@dataclass(frozen=True)
class Layout:
    """Degrees of each kind of parallelism, and how the step is run.

    gpus = tp · pp · dp · cp. Expert parallelism does not add GPUs: the ep ranks
    that share one MoE layer's experts are data-parallel ranks for everything
    else (DeepSeek-V3: PP 16 x DP 128 = 2048 GPUs, its EP 64 groups spanning 8
    nodes each lie inside the 128 data-parallel ranks of a stage), so ep must
    divide dp · cp. zero: the ZeRO stage over the dp · cp ranks (0: plain DP).
    microbatches: per pipeline per step. recompute: "none", "selective", "full".
    interleave: v model chunks per pipeline stage (Narayanan et al. 2021's
    interleaved 1F1B: bubble / v, v times the pipeline sends). dualpipe:
    DeepSeek-V3's bidirectional schedule (DeepSeek-AI 2024, sec. 3.2.1): two
    copies of the parameters, PP + 1 micro-batches of activations, EP and PP
    traffic overlapped with compute, and a smaller bubble. sequence_parallel:
    with TP > 1, whether the norms' and dropouts' activations are split over
    the TP ranks too (Korthikanti et al. 2022, sec. 4.2.2; same bytes sent, the
    all-reduces become all-gathers and reduce-scatters); Megatron-LM's 2021 runs
    predate it."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    microbatches: int = 1
    recompute: str = "none"
    name: str = ""
    interleave: int = 1
    dualpipe: bool = False
    sequence_parallel: bool = True

    def __post_init__(self):
        check_counts(**{d: getattr(self, d) for d in (
            "tp", "pp", "dp", "cp", "ep", "microbatches", "interleave")})
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.recompute not in ("none", "selective", "full"):
            raise ValueError(f"recompute must be 'none', 'selective' or 'full', not "
                             f"{self.recompute!r}")
        if self.dualpipe and (self.pp % 2 or self.interleave > 1):
            raise ValueError(f"DualPipe needs an even PP (got {self.pp}) and no "
                             f"interleaving (got {self.interleave})")
        if (self.dp * self.cp) % self.ep:
            raise ValueError(f"EP {self.ep} must divide DP {self.dp} x CP {self.cp}: "
                             f"expert parallelism shards experts over data-parallel "
                             f"ranks")

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    def __str__(self) -> str:
        parts = [f"TP {self.tp}", f"PP {self.pp}"]
        if self.cp > 1:
            parts.append(f"CP {self.cp}")
        if self.ep > 1:
            parts.append(f"EP {self.ep}")
        parts.append(f"DP {self.dp}" + (f" (ZeRO-{self.zero})" if self.zero else ""))
        return " · ".join(parts)

    @property
    def schedule(self) -> str:
        if self.pp == 1:
            return "no pipeline"
        if self.dualpipe:
            return "DualPipe"
        return f"interleaved 1F1B (v = {self.interleave})" if self.interleave > 1 \
            else "1F1B"


@dataclass(frozen=True)
class Estimate:
    """One layout on one cluster: bytes per device, bytes sent per device per
    step, and seconds per step (compute, each exposed communication, bubble)."""

    layout: Layout
    memory: dict[str, float]  # params, grads, optimizer, activations
    traffic: dict[str, float]  # tp, cp, pp, dp, ep
    time: dict[str, float]  # compute, tp, cp, pp, dp, ep, bubble (exposed)
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


@lru_cache(maxsize=64)
def _count(c: ModelConfig, active: bool = False) -> int:
    return param_count(c, active=active)


def _expert_params(c: ModelConfig) -> int:
    """Routed experts' parameters (those expert parallelism shards)."""
    if not c.experts:
        return 0
    mats = 3 if c.gated_mlp else 2
    return (c.layers - c.dense_layers) * c.experts * mats * c.hidden * c.expert_ffn


def flops_per_token(c: ModelConfig, seq: int) -> float:
    """Training FLOPs per token: 6 per active parameter (forward 2, backward 4)
    plus the attention scores, 12·layers·hidden·seq (Narayanan et al. 2021, eq. 3,
    without its logit term, which 6N already counts)."""
    return 6 * _count(c, True) + 12 * c.layers * c.hidden * seq


def check_layout(model: ModelConfig, layout: Layout, cluster: Cluster,
                 global_batch_tokens: int, seq: int) -> int:
    """Raise ValueError where the layout cannot run; return sequences per
    data-parallel replica."""
    lay, c = layout, model
    if lay.gpus > cluster.gpus:
        raise ValueError(f"{lay} needs {lay.gpus} GPUs; the cluster has "
                         f"{cluster.gpus} ({cluster.nodes} nodes x "
                         f"{cluster.gpus_per_node})")
    if c.heads % lay.tp:
        raise ValueError(f"TP {lay.tp} does not divide the {c.heads} attention heads "
                         f"of {c.name}")
    if lay.pp > c.layers:
        raise ValueError(f"PP {lay.pp} is more stages than {c.name}'s {c.layers} "
                         f"layers")
    if c.experts and c.experts % lay.ep:
        raise ValueError(f"EP {lay.ep} does not divide {c.name}'s {c.experts} experts")
    if not c.experts and lay.ep > 1:
        raise ValueError(f"{c.name} has no experts to shard over EP {lay.ep}")
    if seq % (lay.cp * (lay.tp if lay.tp > 1 and lay.sequence_parallel else 1)):
        raise ValueError(f"seq {seq} is not divisible by CP {lay.cp} x TP {lay.tp} "
                         f"(sequence parallelism splits it over both)")
    if global_batch_tokens % seq:
        raise ValueError(f"global batch {global_batch_tokens} tokens is not a whole "
                         f"number of {seq}-token sequences")
    seqs = global_batch_tokens // seq
    if seqs % lay.dp:
        raise ValueError(f"{seqs} sequences per step do not split over DP {lay.dp}")
    per_replica = seqs // lay.dp
    if lay.dualpipe and lay.microbatches < 2 * lay.pp:
        raise ValueError(f"DualPipe needs at least 2 x PP = {2 * lay.pp} micro-"
                         f"batches to fill both directions, got {lay.microbatches}")
    if lay.interleave > 1 and -(-c.layers // lay.pp) < lay.interleave:
        raise ValueError(f"interleave {lay.interleave} needs at least that many "
                         f"layers per stage; PP {lay.pp} leaves "
                         f"{-(-c.layers // lay.pp)}")
    if per_replica % lay.microbatches:
        raise ValueError(f"{per_replica} sequences per replica do not split into "
                         f"{lay.microbatches} micro-batches")
    return per_replica


def _in_node(lay: Layout, gpn: int) -> dict[str, bool]:
    """Whether each dimension's group lies inside one node, ranks numbered with
    ORDER's first dimension fastest."""
    deg = {"tp": lay.tp, "cp": lay.cp, "ep": lay.ep, "pp": lay.pp,
           "dp": max(1, lay.dp * lay.cp // lay.ep // lay.cp)}
    out, span = {}, 1
    for d in ORDER:
        span *= deg[d]
        out[d] = span <= gpn
    out["dp"] = out["dp"] and out["ep"]  # DP's group includes the EP ranks
    return {d: out[d] for d in DIMS}


def estimate(model: ModelConfig, layout: Layout, cluster: Cluster,
             global_batch_tokens: int, seq: int, dtype_bytes: int = 2) -> Estimate:
    """Memory, traffic and step time per device of `layout` training `model`.

    Memory: mixed-precision Adam (2 + 2 + 12 bytes per parameter, theory.zero),
    parameters split over TP x PP (experts also over EP), ZeRO over DP x CP (the
    experts' over DP x CP / EP); the busiest stage holds ceil(layers / PP) layers
    and activations_held(layout) micro-batches of activations (1F1B min(PP, m),
    interleaved PP + (PP-1)/v, DualPipe PP + 1; Korthikanti et al.'s GPT layer,
    with sequence parallelism when TP > 1 unless the layout turns it off, and
    FlashAttention, so no
    s x s scores; RMSNorm models (Llama 3, DeepSeek-V3) train without dropout,
    so no dropout masks; MLA and MoE change the constants, which this ignores).
    Traffic, bytes each device sends per step (ring collectives): TP 4 all-
    reduces per layer per micro-batch (6 with full recomputation); CP all-gathers
    K and V forward and reduce-scatters their gradients backward; PP sends each
    micro-batch's activation forward and its gradient back (/TP: scatter-gather);
    DP/ZeRO theory.zero_traffic of this device's parameters; EP dispatch and
    combine all-to-alls of the routed tokens, forward and backward.
    Time: compute = FLOPs at the peak x the roofline's slowdown for this
    layout's per-device matrix shapes (compute_slowdown; x 4/3 with full
    recomputation); each collective by the α-β model, its bytes over NVLink if
    its group lies in a node, else over the NIC, plus α per ring step (NCCL's
    intra- and inter-node α, ring_latency; one α per pipeline send); DP's time
    hides under the compute that runs while it can go (dp_phases_of); the bubble
    is bubble_fraction of the rest."""
    from labkit.theory._layout_roofline import compute_slowdown
    from labkit.theory._layout_time import (
        activations_held,
        bubble_fraction,
        dp_phases_of,
        latency_of,
    )
    c, lay = model, layout
    per_replica = check_layout(c, lay, cluster, global_batch_tokens, seq)
    m = lay.microbatches
    b = per_replica // m  # micro-batch size, sequences
    s_local = seq // lay.cp
    stage_layers = -(-c.layers // lay.pp)
    total, experts = _count(c), _expert_params(c)
    dense_dev = (total - experts) / (lay.tp * lay.pp)
    expert_dev = experts / (lay.tp * lay.pp * lay.ep)
    k = 12
    zd = zero_breakdown(dense_dev, lay.dp * lay.cp, lay.zero, k, dtype_bytes,
                        dtype_bytes)
    ze = zero_breakdown(expert_dev, max(lay.dp * lay.cp // lay.ep, 1), lay.zero, k,
                        dtype_bytes, dtype_bytes)
    sp = lay.tp > 1 and lay.sequence_parallel
    terms = activation_terms(s_local, b, c.hidden, c.heads, lay.tp, sp,
                             lay.recompute, attention_scores=False)
    act_layer = sum(v for k, v in terms.items()
                    if c.norm == "layernorm" or "dropout mask" not in k)
    # micro-batches held at the first stage's peak: 1F1B min(p, m), interleaved
    # p + (p-1)/v, DualPipe p + 1 (activations_held)
    in_flight = activations_held(lay)
    copies = 2 if lay.dualpipe else 1
    memory = {"params": (zd.params + ze.params) * copies,
              "grads": zd.grads + ze.grads,
              "optimizer": zd.optimizer + ze.optimizer,
              "activations": act_layer * stage_layers * in_flight}

    full = lay.recompute == "full"
    traffic = dict.fromkeys(DIMS, 0.0)
    if lay.tp > 1:
        lt = layer_traffic(b, s_local, c.hidden, lay.tp, dtype_bytes)
        per_layer = lt.bytes_per_rank * (1.5 if full else 1)
        traffic["tp"] = per_layer * stage_layers * m
    if lay.cp > 1:
        head = c.hidden // c.heads
        kv_dim = (c.kv_lora_rank + c.qk_rope_dim if c.kv_lora_rank
                  else 2 * c.kv_heads * head)
        kv = b * seq * kv_dim * dtype_bytes / lay.tp  # K and V of the whole sequence
        per_layer = (ring_bytes_per_rank("all_gather", kv, lay.cp) * (2 if full else 1)
                     + ring_bytes_per_rank("reduce_scatter", kv, lay.cp))
        traffic["cp"] = per_layer * stage_layers * m
    if lay.pp > 1:
        traffic["pp"] = (2 * m * b * s_local * c.hidden * dtype_bytes / lay.tp
                         * lay.interleave)
    dp_n = lay.dp * lay.cp
    dp_phases = dict.fromkeys(("end", "start", "backward", "stream"), 0.0)
    for psi, n in ((dense_dev, dp_n), (expert_dev, dp_n // lay.ep)):
        if psi and n > 1:
            for k, v in dp_phases_of(psi, n, lay.zero, m, dtype_bytes).items():
                dp_phases[k] += v
    traffic["dp"] = sum(dp_phases.values())
    if lay.ep > 1:
        moe_layers = -(-(c.layers - c.dense_layers) // lay.pp)
        copies = c.experts_per_token
        if lay.ep * lay.tp * lay.cp > cluster.gpus_per_node:  # the EP group spans nodes
            copies = min(copies, NODE_LIMITED_ROUTING.get(c.name, copies))
        routed = b * s_local * copies * c.hidden * dtype_bytes / lay.tp
        per_layer = 2 * 2 * ring_bytes_per_rank("all_to_all", routed, lay.ep)
        traffic["ep"] = per_layer * moe_layers * m

    in_node = _in_node(lay, cluster.gpus_per_node)
    bw = {d: cluster.intra_bw if in_node[d] else cluster.inter_bw for d in DIMS}
    lat = latency_of(c, lay, cluster, stage_layers, m, full)
    tokens_dev = global_batch_tokens / (lay.dp * lay.cp)  # per pipeline, per CP rank
    model_time = (flops_per_token(c, seq) * tokens_dev / (lay.tp * lay.pp)
                  / cluster.flops)
    slow = compute_slowdown(c, b * s_local, seq, lay.tp, lay.ep, cluster)
    compute = model_time * slow * (4 / 3 if full else 1)
    time = {"compute": compute}
    for d in ("tp", "cp", "pp", "ep"):
        time[d] = traffic[d] / bw[d] + lat[d]
    if lay.dualpipe:  # forward and backward chunks of two micro-batches overlap
        both = time["ep"] + time["pp"]  # what compute cannot hide stays each's
        left = max(0.0, both - compute) / both if both else 0.0
        time["ep"], time["pp"] = time["ep"] * left, time["pp"] * left
    window = {"end": 2 / 3 * compute / m, "start": compute / 3 / m,
              "backward": 2 / 3 * compute, "stream": compute}
    time["dp"] = sum(max(0.0, v / bw["dp"] + lat["dp"][k] - window[k])
                     for k, v in dp_phases.items())
    busy = compute + sum(time[d] for d in ("tp", "cp", "pp", "ep"))
    time["bubble"] = bubble_fraction(lay) * busy
    est = Estimate(lay, memory, traffic, time, cluster.gpu_memory,
                   {d: in_node[d] for d in DIMS if getattr(lay, d) > 1},
                   model_time=model_time, gemm_slowdown=slow)
    from labkit.theory._layout_reasons import reasons  # it reads an Estimate
    est.reasons.extend(reasons(model, est, cluster))
    return est

