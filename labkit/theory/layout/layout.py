"""A parallel layout: its degrees, whether a model and cluster can run it, the
shape of one device's work per step, and where each group's ranks sit."""

from __future__ import annotations

from dataclasses import dataclass

from labkit.theory._validate import check_counts
from labkit.theory.layout.cluster import ClusterSpec
from labkit.theory.models import ModelConfig

DIMS = ("tp", "cp", "pp", "dp", "ep")
# rank order, innermost first: TP, CP, the expert-parallel part of DP, PP, the rest
# of DP. Llama 3 orders its groups [TP, CP, PP, DP] (Llama Team 2024, sec. 3.3.2);
# DeepSeek-V3 packs each EP 64 group onto 8 consecutive nodes (DeepSeek-AI 2024,
# sec. 3.2), so EP comes before PP here; with EP 1 this is Llama's order.
ORDER = ("tp", "cp", "ep", "pp", "dp")


@dataclass(frozen=True)
class Layout:
    """Degrees of each kind of parallelism, and how the step is run.

    gpus = tp · pp · dp · cp. Expert parallelism does not add GPUs: the ep ranks
    that share one MoE layer's experts are data-parallel ranks for everything
    else (DeepSeek-V3: PP 16 x DP 128 = 2048 GPUs, its EP 64 groups spanning 8
    nodes each lie inside the 128 data-parallel ranks of a stage), so ep must
    divide dp · cp, and the routed experts are split over TP like the rest.
    expert_tp: set below tp for Megatron Core's MoE parallel folding (Liu et al.
    2025): the experts split over expert_tp ranks only and the EP group drawn
    from the TP x CP x DP ranks of a stage, attention keeping its TP (DeepSeek-V3
    serves that way: attention TP 4, experts EP 32 without TP, sec. 3.4.1); ranks
    then run TP, CP, DP, PP innermost first (Megatron's default order), so an EP
    group is etp x ep consecutive ranks. zero: the ZeRO stage over the dp · cp
    ranks (0: plain DP).
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
    expert_tp: int | None = None  # None: the experts split over TP, as the rest

    def __post_init__(self):
        check_counts(**{field: getattr(self, field) for field in (
            "tp", "pp", "dp", "cp", "ep", "microbatches", "interleave")})
        if self.expert_tp is not None:
            check_counts(expert_tp=self.expert_tp)
            if self.tp % self.expert_tp:
                raise ValueError(f"expert TP {self.expert_tp} must divide TP "
                                 f"{self.tp}")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.recompute not in ("none", "selective", "full"):
            raise ValueError(f"recompute must be 'none', 'selective' or 'full', not "
                             f"{self.recompute!r}")
        if self.dualpipe and (self.pp % 2 or self.interleave > 1):
            raise ValueError(f"DualPipe needs an even PP (got {self.pp}) and no "
                             f"interleaving (got {self.interleave})")
        if self.folded:
            if (self.tp * self.dp * self.cp) % (self.etp * self.ep):
                raise ValueError(
                    f"expert TP {self.etp} x EP {self.ep} must divide TP {self.tp} "
                    f"x DP {self.dp} x CP {self.cp}: folded, the experts' groups "
                    "are drawn from a stage's ranks")
        elif (self.dp * self.cp) % self.ep:
            raise ValueError(f"EP {self.ep} must divide DP {self.dp} x CP {self.cp}: "
                             f"expert parallelism shards experts over data-parallel "
                             f"ranks")

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def etp(self) -> int:
        """The ranks each routed expert is split over (TP unless folded)."""
        return self.tp if self.expert_tp is None else self.expert_tp

    @property
    def folded(self) -> bool:
        """Whether the experts use their own split (expert_tp below TP)."""
        return self.etp < self.tp

    @property
    def expert_replicas(self) -> int:
        """Ranks holding the same expert shard, over which its gradients are
        reduced (and ZeRO shards its states): TP·DP·CP / (expert TP·EP)."""
        return max(1, self.tp * self.dp * self.cp // (self.etp * self.ep))

    def __str__(self) -> str:
        parts = [f"TP {self.tp}", f"PP {self.pp}"]
        if self.cp > 1:
            parts.append(f"CP {self.cp}")
        if self.ep > 1:
            parts.append(f"EP {self.ep}" + (f" (expert TP {self.etp})" if self.folded
                                            else ""))
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
class StepShape:
    """What one device of a layout works on per step: `microbatches` (m)
    micro-batches of `microbatch` (b) sequences, `local_seq` (seq / CP) tokens of
    each, through the `stage_layers` layers (ceil(layers / PP)) of the busiest
    pipeline stage, `stage_moe_layers` of them MoE layers (0 without experts)."""

    global_batch_tokens: int
    seq: int
    microbatches: int
    microbatch: int
    local_seq: int
    stage_layers: int
    stage_moe_layers: int

    @property
    def microbatch_tokens(self) -> int:
        """Tokens one device holds per micro-batch: b x seq / CP."""
        return self.microbatch * self.local_seq


def check_layout(model: ModelConfig, layout: Layout, cluster: ClusterSpec,
                 global_batch_tokens: int, seq: int) -> int:
    """Raise ValueError where the layout cannot run; return sequences per
    data-parallel replica."""
    if layout.gpus > cluster.gpus:
        raise ValueError(f"{layout} needs {layout.gpus} GPUs; the cluster has "
                         f"{cluster.gpus} ({cluster.nodes} nodes x "
                         f"{cluster.gpus_per_node})")
    if model.heads % layout.tp:
        raise ValueError(f"TP {layout.tp} does not divide the {model.heads} attention "
                         f"heads of {model.name}")
    if layout.pp > model.layers:
        raise ValueError(f"PP {layout.pp} is more stages than {model.name}'s "
                         f"{model.layers} layers")
    if model.experts and model.experts % layout.ep:
        raise ValueError(f"EP {layout.ep} does not divide {model.name}'s "
                         f"{model.experts} experts")
    if not model.experts and layout.ep > 1:
        raise ValueError(f"{model.name} has no experts to shard over EP {layout.ep}")
    sequence_split = layout.tp if layout.tp > 1 and layout.sequence_parallel else 1
    if seq % (layout.cp * sequence_split):
        raise ValueError(f"seq {seq} is not divisible by CP {layout.cp} x TP "
                         f"{layout.tp} (sequence parallelism splits it over both)")
    if global_batch_tokens % seq:
        raise ValueError(f"global batch {global_batch_tokens} tokens is not a whole "
                         f"number of {seq}-token sequences")
    sequences = global_batch_tokens // seq
    if sequences % layout.dp:
        raise ValueError(f"{sequences} sequences per step do not split over DP "
                         f"{layout.dp}")
    per_replica = sequences // layout.dp
    if layout.dualpipe and layout.microbatches < 2 * layout.pp:
        raise ValueError(f"DualPipe needs at least 2 x PP = {2 * layout.pp} micro-"
                         f"batches to fill both directions, got {layout.microbatches}")
    layers_per_stage = -(-model.layers // layout.pp)
    if layout.interleave > 1 and layers_per_stage < layout.interleave:
        raise ValueError(f"interleave {layout.interleave} needs at least that many "
                         f"layers per stage; PP {layout.pp} leaves {layers_per_stage}")
    if per_replica % layout.microbatches:
        raise ValueError(f"{per_replica} sequences per replica do not split into "
                         f"{layout.microbatches} micro-batches")
    return per_replica


def step_shape(model: ModelConfig, layout: Layout, cluster: ClusterSpec,
               global_batch_tokens: int, seq: int) -> StepShape:
    """One device's work per step (check_layout first: ValueError where the
    layout cannot run)."""
    per_replica = check_layout(model, layout, cluster, global_batch_tokens, seq)
    moe_layers = model.layers - model.dense_layers if model.experts else 0
    return StepShape(global_batch_tokens, seq, layout.microbatches,
                     microbatch=per_replica // layout.microbatches,
                     local_seq=seq // layout.cp,
                     stage_layers=-(-model.layers // layout.pp),
                     stage_moe_layers=-(-moe_layers // layout.pp))


def _folded_spans(layout: Layout) -> dict[str, tuple[int, int]]:
    """(stride, size) of each group of a folded layout, ranks numbered TP, CP,
    DP, PP fastest first: an EP group is every etp-th of etp·ep consecutive
    ranks, the experts' data-parallel group the stride etp·ep beyond it."""
    tp, cp, dp = layout.tp, layout.cp, layout.dp
    return {"tp": (1, tp), "cp": (tp, cp), "dp": (tp, cp * dp),
            "pp": (tp * cp * dp, layout.pp), "ep": (layout.etp, layout.ep),
            "dp_expert": (layout.etp * layout.ep, layout.expert_replicas)}


def _nodes(stride: int, size: int, gpus_per_node: int) -> int:
    """Nodes a group of `size` ranks `stride` apart spans."""
    return max(1, -(-size // min(size, max(1, gpus_per_node // stride))))


def groups_in_node(layout: Layout, gpus_per_node: int) -> dict[str, bool]:
    """Whether each dimension's group lies inside one node, ranks numbered with
    ORDER's first dimension fastest (folded: TP, CP, DP, PP)."""
    if layout.folded:
        return {dim: _nodes(*span, gpus_per_node) == 1
                for dim, span in _folded_spans(layout).items()
                if dim in DIMS}
    degree = {"tp": layout.tp, "cp": layout.cp, "ep": layout.ep, "pp": layout.pp,
              "dp": max(1, layout.dp * layout.cp // layout.ep // layout.cp)}
    inside, span = {}, 1
    for dim in ORDER:
        span *= degree[dim]
        inside[dim] = span <= gpus_per_node
    inside["dp"] = inside["dp"] and inside["ep"]  # DP's group includes the EP ranks
    return {dim: inside[dim] for dim in DIMS}


def group_nodes(layout: Layout, gpus_per_node: int) -> dict[str, int]:
    """Nodes each group spans, ranks numbered with ORDER's first dimension
    fastest (TP, CP, EP, PP, DP). "dp" is the dense data-parallel group (CP x EP
    x the rest of DP, where ZeRO shards), "dp_expert" the experts' (CP x the
    rest). A dimension of stride s puts min(n, gpus_per_node / s) of its n ranks
    in a node. Folded layouts: _folded_spans."""
    if layout.folded:
        return {dim: _nodes(*span, gpus_per_node)
                for dim, span in _folded_spans(layout).items()}
    rest = max(1, layout.dp // layout.ep)
    degree = {"tp": layout.tp, "cp": layout.cp, "ep": layout.ep, "pp": layout.pp,
              "dp": rest}
    stride, ranks_inside = {}, 1
    for dim in ORDER:
        stride[dim], ranks_inside = ranks_inside, ranks_inside * degree[dim]

    def nodes(dims):
        size = per_node = 1
        for dim in dims:
            size *= degree[dim]
            per_node *= min(degree[dim], max(1, gpus_per_node // stride[dim]))
        return max(1, -(-size // per_node))

    spans = {dim: nodes((dim,)) for dim in ("tp", "cp", "ep", "pp")}
    # where EP borrows CP ranks (ep > dp) the product overcounts: cap by group size
    spans["dp"] = min(nodes(("cp", "ep", "dp")), layout.dp * layout.cp)
    spans["dp_expert"] = min(nodes(("cp", "dp")),
                             max(1, layout.dp * layout.cp // layout.ep))
    return spans
