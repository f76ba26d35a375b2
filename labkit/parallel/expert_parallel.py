"""Expert parallelism: a mixture-of-experts layer whose E experts are spread over
the ep ranks of an expert group, E/ep each; tokens travel to their experts and back
in two all-to-alls of uneven splits (Lepikhin et al. 2020, sec. 3.2-3.3).

    layer = MoELayer(hidden=16, ffn=32, experts=8, k=2)    # one process
    ep = ExpertParallelMoE.from_moe(layer, group)          # same weights, E/ep here
    y = ep(x)              # x: this rank's tokens (..., h); ep.stats: what moved

Imports labkit.parallel's models and expert_routing. Every expert runs on every
call, on an empty batch if no row came, so every replica's gradient has one shape.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from labkit.parallel.models import MLP
from labkit.parallel.expert_routing import (
    Router,
    Routing,
    capacity,
    check_capacity_factor,
    within_capacity,
)

# -- the all-to-all ----------------------------------------------------------------


def _exchange(x: torch.Tensor, send: list[int], receive: list[int], group):
    """send[q] rows of x (along dim 0) to rank q; receive[q] rows from it."""
    out = x.new_empty(sum(receive), *x.shape[1:])  # (sum(receive), ...)
    dist.all_to_all_single(out, x.contiguous(), receive, send, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """The rows' exchange; its backward is the same exchange with the splits
    swapped (torch's all_to_all_single_autograd does the same; the tests compare)."""

    @staticmethod
    def forward(ctx, x, send, receive, group):
        ctx.send, ctx.receive, ctx.group = send, receive, group
        return _exchange(x, send, receive, group)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.receive, ctx.send, ctx.group), None, None, None


def all_to_all_rows(x: torch.Tensor, send, receive, group=None) -> torch.Tensor:
    """Forward: send[q] rows of x to rank q of `group`, in rank order, and return
    the receive[q] rows from each rank q, in rank order. Backward: the same
    exchange of the gradient with send and receive swapped. Empty splits are
    fine (a rank may send or receive nothing).

    The sizes are checked first, across the ranks: every rank sends its plan
    (5 + 2N int64: its rows, a row's elements and bytes, how many sizes it gave,
    its send and receive sizes) to every rank, in one all-to-all that the
    traffic ledger records before the rows' (8(5 + 2N)(N-1) bus bytes a rank,
    as many as an all-gather of the plans, which is slower on gloo). Where
    receive[q] on rank r is not send[r] on rank q, or a rank's sizes do not fit
    its x, every rank raises the same ValueError naming the ranks and the sizes,
    before any row moves (gloo would fill a row expected but never sent with
    whatever memory held, or abort every rank for a row sent but not expected).
    Where dist.all_to_all_single is a wrapper that says it checks the sizes
    itself (its attribute `labkit_checks_sizes`: an exercise check's guard,
    which explains a mismatch in the exercise's words), that wrapper checks
    instead. ExpertParallelMoE skips the check: its receive sizes come from the
    counts it exchanged."""
    if getattr(dist.all_to_all_single, "labkit_checks_sizes", False):
        return _AllToAll.apply(x, [int(v) for v in send], [int(v) for v in receive],
                               group)  # the wrapper checks the sizes
    n = dist.get_world_size(group)
    plan = _plan(x, send, receive, n)
    mine = torch.tensor(plan * n, device=x.device)  # my plan, a copy for each rank
    every = torch.empty_like(mine)  # (N (5 + 2N),): every rank's plan
    dist.all_to_all_single(every, mine, group=group)  # gloo's all-gather is slower
    problem = _disagreement(every.view(n, -1).tolist(), n)
    if problem:
        raise ValueError(f"all_to_all_rows on {n} ranks: {problem}; raised on "
                         "every rank, before any row moved")
    return _AllToAll.apply(x, plan[5:5 + n], plan[5 + n:], group)


def _sizes(sizes, n: int) -> tuple[int, list[int]]:
    """(how many sizes were given, or -1 where they are not whole numbers; the
    first n of them, padded with 0)."""
    try:
        given = list(sizes)
        out = [int(a) for a in given]
        if any(float(a) != b for a, b in zip(given, out)):
            raise ValueError
    except (TypeError, ValueError, OverflowError, RuntimeError):
        return -1, [0] * n
    return len(out), (out + [0] * n)[:n]


def _plan(x: torch.Tensor, send, receive, n: int) -> list[int]:
    """This rank's all-to-all as 5 + 2n whole numbers the others can read: its
    rows (-1: x has no dimension to split), a row's elements and element bytes,
    how many send and receive sizes it gave (-1: not whole numbers), then the
    send and the receive sizes."""
    ns, send = _sizes(send, n)
    nr, receive = _sizes(receive, n)
    rows = int(x.shape[0]) if x.dim() else -1
    plan = [rows, math.prod(x.shape[1:]), x.element_size(), ns, nr, *send, *receive]
    return [min(max(v, -2 ** 63), 2 ** 63 - 1) for v in plan]  # fits int64


def _disagreement(plans: list[list[int]], n: int) -> str | None:
    """What is wrong with the ranks' plans (_plan's) of one all-to-all, the same
    words on every rank; None when every size pairs up."""
    def sizes(r, side):  # side 0: send, 1: receive
        return plans[r][5 + side * n:5 + (side + 1) * n]

    for r, (rows, width, size, *given) in enumerate(plans):
        for side, name in enumerate(("send", "receive")):
            if given[side] == -1:
                return f"rank {r}'s {name} sizes are not whole numbers"
            if given[side] != n:
                return (f"rank {r} gave {given[side]} {name} sizes for a group "
                        f"of {n} ranks: one per rank, in rank order")
            if min(sizes(r, side)) < 0:
                return f"rank {r}'s {name} sizes {sizes(r, side)} are not all >= 0"
        if rows < 0:
            return f"rank {r}'s x is a 0-d tensor: rows are its first dimension"
        if sum(sizes(r, 0)) != rows:
            return (f"rank {r}'s send sizes {sizes(r, 0)} add up to "
                    f"{sum(sizes(r, 0))} rows, but its x has {rows}")
        if (width, size) != tuple(plans[0][1:3]):
            return (f"rank {r}'s rows are {width} elements of {size} bytes, rank "
                    f"0's {plans[0][1]} of {plans[0][2]}: one row shape and dtype "
                    "on every rank")
    pairs = [f"rank {q} sends {sizes(q, 0)[r]} rows to rank {r}, which expects "
             f"{sizes(r, 1)[q]}" for q in range(n) for r in range(n)
             if sizes(q, 0)[r] != sizes(r, 1)[q]]
    if not pairs:
        return None
    more = f" (and {len(pairs) - 3} more pairs)" if len(pairs) > 3 else ""
    return ("the sizes do not pair up: " + "; ".join(pairs[:3]) + more
            + ". receive[q] on rank r must be send[r] on rank q: exchange the "
            "counts first (every rank's send sizes, in an all-to-all), as the MoE "
            "dispatch does")


# -- the layer ---------------------------------------------------------------------


@dataclass(frozen=True)
class MoEStats:
    """One forward of an MoE layer on one rank: its router's choices and the rows
    it moved. A row is one (token, expert) pair: `hidden` elements of
    `element_size` bytes."""

    tokens: int  # this rank's tokens
    routed: tuple[int, ...]  # (E,) pairs its router sent to each expert
    dropped: int  # pairs over capacity: their output is 0 (the residual only)
    capacity: int | None  # pairs per expert from this rank's tokens; None: any
    sent: tuple[int, ...]  # (ep,) rows dispatched to each rank of the group
    received: tuple[int, ...]  # (ep,) rows received from each rank
    expert_rows: tuple[int, ...]  # (E/ep,) rows each of this rank's experts ran
    ep_rank: int  # this rank's place in the expert group
    hidden: int
    element_size: int
    cross_node_rows: int = 0  # rows dispatched to ranks on other nodes
    cross_node_tokens: int = 0  # distinct (token, other node): one copy a node

    def _bytes(self, rows: int) -> int:
        return rows * self.hidden * self.element_size

    @property
    def dispatch_bytes(self) -> int:
        """Bytes the dispatch sends to other ranks (forward; the combine's
        backward sends as many)."""
        return self._bytes(sum(self.sent) - self.sent[self.ep_rank])

    @property
    def combine_bytes(self) -> int:
        """Bytes the combine sends back to other ranks (forward; the dispatch's
        backward sends as many)."""
        return self._bytes(sum(self.received) - self.received[self.ep_rank])

    @property
    def layer_bytes(self) -> int:
        """Rows this rank sends per layer, forward and backward, in bytes."""
        return 2 * (self.dispatch_bytes + self.combine_bytes)

    def __str__(self) -> str:
        """'rank 0: 16 tokens, 32 pairs kept (0 dropped); rows sent (8, 8, 8, 8),
        received (8, 8, 8, 8); its experts ran (16, 16)'"""
        kept = sum(self.routed) - self.dropped
        return (f"rank {self.ep_rank}: {self.tokens} tokens, {kept} pairs kept "
                f"({self.dropped} dropped); rows sent {self.sent}, received "
                f"{self.received}; its experts ran {self.expert_rows}")

    def cross_node_bytes(self, one_copy_per_node: bool = False) -> int:
        """Bytes of the dispatch that cross to other nodes: a row per pair, or
        one per (token, node) where the receiving node forwards it to its own
        experts (DeepSeek-AI 2024, sec. 3.2.2)."""
        return self._bytes(self.cross_node_tokens if one_copy_per_node
                           else self.cross_node_rows)


class MoELayer(nn.Module):
    """A mixture-of-experts layer in one process: a Router and E Experts.

    torch has no MoE layer; this is Mixtral's sparse MoE block (a top-k gate over
    E experts) with GShard's and Switch's capacity, its experts models.MLP (GeLU),
    not Mixtral's SwiGLU.

    Returns sum_j gate_j · expert_j(x) over each token's k choices (no residual:
    add it outside; a dropped pair adds 0). capacity_factor: None keeps every
    pair; else each expert takes ceil(cf·k·T/E) pairs of the T tokens of one
    call (a finite cf > 0; ValueError otherwise). After a forward, `routing`
    holds the Routing (for a balancing loss) and `stats` the MoEStats."""

    def __init__(self, hidden: int, ffn: int, experts: int, k: int, *,
                 capacity_factor: float | None = None, **router):
        super().__init__()
        self.router = Router(hidden, experts, k, **router)
        # each expert an MLP h -> ffn -> h
        self.experts = nn.ModuleList(MLP(hidden, ffn) for _ in range(experts))
        self.capacity_factor = check_capacity_factor(capacity_factor)
        self.routing: Routing | None = None
        self.stats: MoEStats | None = None

    @property
    def num_experts(self) -> int:
        return self.router.num_experts

    def forward(self, x: torch.Tensor, experts: torch.Tensor | None = None):
        """x (..., h) -> (..., h). experts: (T, k) to route as given."""
        return _moe_forward(self, x, experts, group=None, ep=1, rank=0)


class ExpertParallelMoE(nn.Module):
    """An MoELayer with its experts spread over the ranks of `group`: the router
    whole on every rank, experts [r·E/ep, (r+1)·E/ep) on rank r. Build it with
    `from_moe`. ranks_per_node: how many consecutive ranks of the group share a
    node, for stats' cross-node counts (None: all of them).

    torch itself has no expert-parallel layer; this does what torchtitan's
    ExpertParallel (a DTensor ParallelStyle) does to an MoE module, as a module
    of its own with its own autograd all-to-all (all_to_all_rows).
    """

    def __init__(self, router: Router, experts: nn.ModuleList, num_experts: int,
                 group=None, *, capacity_factor: float | None = None,
                 ranks_per_node: int | None = None):
        super().__init__()
        self.group, self.ep_size = group, dist.get_world_size(group)
        self.ep_rank = dist.get_rank(group)
        if num_experts % self.ep_size:
            raise ValueError(f"{num_experts} experts do not split over the "
                             f"{self.ep_size} ranks of the expert group: each "
                             "rank must hold E/ep whole experts")
        if len(experts) != num_experts // self.ep_size:
            raise ValueError(f"{len(experts)} local experts given, E/ep = "
                             f"{num_experts // self.ep_size} expected")
        self.ranks_per_node = ranks_per_node or self.ep_size
        if self.ep_size % self.ranks_per_node:
            raise ValueError(f"{self.ranks_per_node} ranks per node do not divide "
                             f"the expert group's {self.ep_size}")
        self.router, self.experts = router, experts
        self._num_experts = num_experts
        self.capacity_factor = check_capacity_factor(capacity_factor)
        self.routing: Routing | None = None
        self.stats: MoEStats | None = None

    @classmethod
    def from_moe(cls, layer: MoELayer, group=None, *,
                 ranks_per_node: int | None = None) -> ExpertParallelMoE:
        """This rank's share of a one-process layer: a copy of its router and
        of its experts [r·E/ep, (r+1)·E/ep), the same weights."""
        ep, e = dist.get_world_size(group), layer.num_experts
        if e % ep:
            raise ValueError(f"{e} experts do not split over the {ep} ranks of the "
                             "expert group: each rank must hold E/ep whole experts")
        r, local = dist.get_rank(group), e // ep
        mine = nn.ModuleList(copy.deepcopy(layer.experts[i])
                             for i in range(r * local, (r + 1) * local))
        return cls(copy.deepcopy(layer.router), mine, e, group,
                   capacity_factor=layer.capacity_factor,
                   ranks_per_node=ranks_per_node)

    @property
    def num_experts(self) -> int:
        return self._num_experts

    def forward(self, x: torch.Tensor, experts: torch.Tensor | None = None):
        """x (..., h): this rank's tokens -> (..., h)."""
        return _moe_forward(self, x, experts, group=self.group, ep=self.ep_size,
                            rank=self.ep_rank)


# -- one forward, in one process (ep = 1) or over the expert group ------------------


def _moe_forward(layer, x, experts, *, group, ep: int, rank: int):
    """Route (the replicated router; pairs over capacity dropped), dispatch
    (counts first, then the rows, sorted by expert, hence by rank), run the
    local experts, combine (the reverse all-to-all), weight by gate and sum."""
    shape, h = x.shape, x.shape[-1]
    x = x.reshape(-1, h)  # (..., h) -> (T, h)
    t, e = x.shape[0], layer.num_experts
    routing = layer.router(x, experts)  # .experts, .gates: (T, k)
    k = routing.experts.shape[1]
    cap = (None if layer.capacity_factor is None
           else capacity(layer.capacity_factor, k, t, e))
    keep = within_capacity(routing.experts, e, cap).reshape(-1)  # (T k,)
    expert = routing.experts.reshape(-1)  # (T k,) pair -> expert
    token = torch.arange(t, device=x.device).repeat_interleave(k)  # (T k,) -> token
    kept = keep.nonzero().squeeze(1)
    order = kept[expert[kept].argsort(stable=True)]  # kept pairs, by expert
    counts = torch.bincount(expert[order], minlength=e)  # (E,)
    local = e // ep
    send = counts.view(ep, local).sum(1).tolist()  # (ep,) rows to each rank
    rows = x[token[order]]  # (N, h), grouped by expert, so by rank
    if ep > 1:  # counts first: how many rows of each of my experts every rank sends
        got = _exchange(counts.view(ep, local), [1] * ep, [1] * ep, group)
        receive = got.sum(1).tolist()  # (ep,)
        # receive came from the counts exchanged: the sizes pair up, unchecked
        rows = _AllToAll.apply(rows, send, receive, group)  # (M, h)
    else:
        got, receive = counts.view(1, e), send
    out_rows = _run_experts(layer.experts, rows, got)  # (M, h)
    if ep > 1:
        out_rows = _AllToAll.apply(out_rows, receive, send, group)  # (N, h)
    gates = routing.gates.reshape(-1)[order]  # (N,)
    y = x.new_zeros(t, h).index_add(0, token[order], out_rows * gates[:, None])
    layer.routing = routing
    layer.stats = _stats(layer, routing, token[order], expert[order], send, receive,
                         got, cap, int(t * k - kept.numel()), rank, ep, x)
    return y.view(shape)


def _run_experts(experts: nn.ModuleList, rows: torch.Tensor, got: torch.Tensor):
    """rows (M, h) in blocks by source rank, then local expert (got (ep, E/ep)
    rows per block) -> each row through its expert, in the same order."""
    ep, local = got.shape
    which = torch.arange(local, device=rows.device).repeat(ep).repeat_interleave(
        got.reshape(-1))  # (M,)
    perm = which.argsort(stable=True)  # by local expert, sources in rank order
    chunks = rows[perm].split(got.sum(0).tolist())
    # every expert runs, on an empty chunk if no row came: a zero gradient of
    # its own shape, as in one process
    out = torch.cat([f(c) for f, c in zip(experts, chunks)])  # (M, h)
    return out[perm.argsort()]  # back to the order the rows came in


def _stats(layer, routing, token, expert, send, receive, got, cap, dropped, rank,
           ep, x) -> MoEStats:
    per_node = getattr(layer, "ranks_per_node", ep)
    local = layer.num_experts // ep
    node = expert // (local * per_node)  # (N,) node of each kept pair's expert
    away = node != rank // per_node
    nodes = ep // per_node
    return MoEStats(
        tokens=x.shape[0], routed=tuple(routing.load().tolist()), dropped=dropped,
        capacity=cap, sent=tuple(send), received=tuple(receive),
        expert_rows=tuple(got.sum(0).tolist()), ep_rank=rank, hidden=x.shape[1],
        element_size=x.element_size(), cross_node_rows=int(away.sum()),
        cross_node_tokens=int(torch.unique(token[away] * nodes + node[away]).numel()))


# -- expert data parallelism -------------------------------------------------------


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of every ExpertParallelMoE's local experts in `model`."""
    return [p for m in model.modules() if isinstance(m, ExpertParallelMoE)
            for p in m.experts.parameters()]


def sync_expert_data_parallel_grads(model: nn.Module, groups) -> None:
    """Average the gradients of data parallelism with experts (groups: a
    ParallelGroups with ep). Dense parameters (router, everything but the
    experts) are summed over the DP group; an expert's over the expert-DP group,
    the ranks holding its replicas, whose gradients already hold the tokens of
    their EP groups (the combine's backward brought them); both are divided by
    the DP size, the number of batches. One all-reduce of a flat buffer each."""
    experts = expert_parameters(model)
    ids = {id(p) for p in experts}
    dense = [p for p in model.parameters() if id(p) not in ids]
    for params, group, size in ((dense, groups.dp_group, groups.dp_size),
                                (experts, groups.edp_group, groups.edp_size)):
        params = [p for p in params if p.requires_grad]
        if not params:
            continue
        # a parameter without a gradient here may have one on a replica: add 0
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p))
                          .reshape(-1) for p in params])  # (n,)
        if size > 1:
            dist.all_reduce(flat, group=group)
        flat /= groups.dp_size
        for p, g in zip(params, flat.split([p.numel() for p in params])):
            p.grad = g.view_as(p).clone()
