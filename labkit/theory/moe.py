"""Mixture of experts in closed form: what expert parallelism sends per layer,
how many parameters a token uses of those a model holds, and the experts'
memory per rank."""

from __future__ import annotations

from dataclasses import dataclass

from labkit.theory._validate import check_counts, check_world_size
from labkit.theory.collective_cost import ring_bytes_per_rank
from labkit.theory.layout.costs import expert_params
from labkit.theory.models import MODELS, ModelConfig, param_count


@dataclass(frozen=True)
class ExpertTraffic:
    """Bytes one rank sends for one MoE layer and one micro-batch (to other
    ranks; what stays on the rank is not sent)."""

    dispatch: float  # rows to the experts, forward: T·k·leave·h·bytes
    combine: float  # rows back from this rank's experts, forward: T·k·arrive·h·b
    counts: float  # the counts exchanged before the dispatch: E(ep-1)/ep integers

    @property
    def forward(self) -> float:
        return self.counts + self.dispatch + self.combine

    @property
    def backward(self) -> float:
        """The combine's gradient goes the way the dispatch went, the dispatch's
        the way the combine did: the same bytes, no counts (the splits are
        known)."""
        return self.dispatch + self.combine

    @property
    def total(self) -> float:
        return self.forward + self.backward


def expert_traffic(tokens: int, k: int, hidden: int, ep: int, dtype_bytes: int = 2,
                   *, leave: float | None = None, arrive: float | None = None,
                   experts: int = 0, count_bytes: int = 8) -> ExpertTraffic:
    """The all-to-alls of expert parallelism over ep ranks, for a rank's T
    tokens each sent to k experts (Lepikhin et al. 2020, sec. 3.2-3.3: dispatch and
    combine). leave: the fraction of the T·k (token, expert) pairs whose expert
    is on another rank, (ep-1)/ep when routing spreads them evenly (the
    all-to-all's factor in ring_bytes_per_rank); arrive: the rows other ranks
    send to this rank's experts, as a fraction of T·k, = leave when every rank
    receives what it sends. Dropped pairs send nothing: count them out of
    leave. experts: E, to count the exchange of counts (E/ep integers of
    count_bytes to each other rank); 0 leaves it out.
    Per layer: 2·(dispatch + combine) + counts = 4·T·k·h·bytes·(ep-1)/ep when
    balanced, and twice that with full recomputation, which is not counted here."""
    check_counts(tokens=tokens, k=k, hidden=hidden, dtype_bytes=dtype_bytes)
    n = check_world_size(ep)
    pairs = tokens * k * hidden * dtype_bytes  # bytes of every row, kept or not
    dispatch = (ring_bytes_per_rank("all_to_all", pairs, n) if leave is None
                else pairs * _fraction(leave, "leave"))
    combine = dispatch if arrive is None else pairs * _fraction(arrive, "arrive")
    counts = ring_bytes_per_rank("all_to_all", experts * count_bytes, n)
    return ExpertTraffic(dispatch, combine, counts)


def _fraction(x: float, name: str) -> float:
    if not 0 <= x:
        raise ValueError(f"{name} must be a fraction of the T·k pairs >= 0, got {x}")
    return x


@dataclass(frozen=True)
class MoEParams:
    """Parameters a model holds and those one token uses (DeepSeek-V3: 671B and
    37B, DeepSeek-AI 2024, abstract)."""

    total: int
    active: int  # the dense parts, the shared and the k routed experts

    @property
    def total_per_active(self) -> float:
        """How many times more parameters the model holds than a token uses."""
        return self.total / self.active

    @property
    def forward_flops_per_token(self) -> float:
        """2 per active parameter: a multiply and an add (Kaplan et al. 2020,
        sec. 2.1), without attention's scores."""
        return 2 * self.active

    @property
    def params_per_flop(self) -> float:
        """Parameters held per forward FLOP a token costs: 1/2 for a dense model,
        total/active times that for an MoE."""
        return self.total / self.forward_flops_per_token


def moe_params(model: ModelConfig | str) -> MoEParams:
    """theory.param_count's total and active parameters of `model`."""
    m = MODELS[model] if isinstance(model, str) else model
    return MoEParams(param_count(m), param_count(m, active=True))


@dataclass(frozen=True)
class ExpertMemory:
    """The routed experts one rank of an expert group holds (before ZeRO)."""

    experts_per_layer: int  # E/ep of each MoE layer
    params: float  # over all MoE layers, divided further by PP if pipelined
    bytes: float  # params x dtype bytes


def expert_memory(model: ModelConfig | str, ep: int, dtype_bytes: int = 2,
                  pp: int = 1) -> ExpertMemory:
    """The routed experts' parameters over ep ranks (and pp stages): each rank
    holds E/ep whole experts of each MoE layer of its stage, the busiest stage's
    ceil(MoE layers / pp) layers, as the layout calculator counts them; the
    shared experts and the rest are dense, whole on every rank of the group."""
    m = MODELS[model] if isinstance(model, str) else model
    check_counts(ep=ep, pp=pp, dtype_bytes=dtype_bytes)
    if not m.experts or m.experts % ep:
        raise ValueError(f"EP {ep} must divide {m.name}'s {m.experts} routed experts")
    moe_layers = m.layers - m.dense_layers
    params = expert_params(m) / moe_layers * -(-moe_layers // pp) / ep
    return ExpertMemory(m.experts // ep, params, params * dtype_bytes)


def node_limited_reach(max_nodes: int, intra_bw: float, inter_bw: float) -> float:
    """Experts a token can reach for the network cost of max_nodes copies: each
    copy crosses the network once to a node, which forwards it over the faster
    links inside it to intra_bw/inter_bw experts at the same time (DeepSeek-AI
    2024, sec. 3.2.2: 4 nodes x 3.2 = 13 with NVLink 160 GB/s, IB 50 GB/s)."""
    check_counts(max_nodes=max_nodes)
    if intra_bw <= 0 or inter_bw <= 0:
        raise ValueError(f"bandwidths must be > 0, got {intra_bw}, {inter_bw}")
    return max_nodes * intra_bw / inter_bw
