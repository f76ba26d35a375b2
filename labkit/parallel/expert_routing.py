"""Mixture-of-experts routing (expert_parallel.py's helper): which experts each
token goes to and with what weight, how many (token, expert) pairs an expert
takes, and two ways of keeping the experts evenly loaded (Switch, DeepSeek-V3).

    router = Router(hidden=16, experts=8, k=2)        # Mixtral's gate
    routing = router(x)           # x (T, h): .experts (T, k), .gates (T, k)
    keep = within_capacity(routing.experts, 8, capacity(1.25, 2, T, 8))

Imports torch and labkit.arguments. DeepSeek-V3's bias only picks experts: it is
added to the scores for the top-k choice, never to the gates.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labkit.arguments import whole


@dataclass(frozen=True)
class Routing:
    """One router call over T tokens."""

    experts: torch.Tensor  # (T, k) int64: the expert of each choice, best first
    gates: torch.Tensor  # (T, k): the weight of each choice's output (has grad)
    scores: torch.Tensor  # (T, E): every expert's score (softmax or sigmoid)

    def load(self) -> torch.Tensor:
        """(E,) int64: the (token, expert) pairs routed to each expert."""
        return torch.bincount(self.experts.reshape(-1),
                              minlength=self.scores.shape[-1])


class Router(nn.Module):
    """A top-k router: a linear gate (no bias), scores, the k best experts.

    nodes, max_nodes: node-limited routing; the E experts are `nodes` contiguous
    groups (the experts of one node each) and a token's k experts lie in at most
    `max_nodes` of them. `bias` (a buffer, not a parameter: no gradient) is
    DeepSeek-V3's balancing bias, added to the scores to choose only.
    normalize: rescale the k chosen gates to sum to 1 (default: when k > 1);
    refused for k = 1, where it makes every gate 1 and the router unlearnable.
    score="softmax" with normalize is Mixtral's and GShard's gate, k=1 without it
    Switch's; score="sigmoid" is DeepSeek-V3's (whose code also scales the gates
    by a constant, 2.5, not done here)."""

    SCORES = ("softmax", "sigmoid")

    def __init__(self, hidden: int, experts: int, k: int, *, score: str = "softmax",
                 normalize: bool | None = None, nodes: int = 1,
                 max_nodes: int | None = None):
        super().__init__()
        for name, v in (("hidden", hidden), ("experts", experts), ("k", k),
                        ("nodes", nodes)):
            whole(v, f"Router: {name}", 1)
        max_nodes = nodes if max_nodes is None else max_nodes
        if score not in self.SCORES:
            raise ValueError(f"score must be one of {self.SCORES}, not {score!r}")
        if not 1 <= k <= experts:
            raise ValueError(f"k = {k} experts per token out of {experts}")
        if experts % nodes or not 1 <= max_nodes <= nodes:
            raise ValueError(f"{experts} experts on {nodes} nodes, at most "
                             f"{max_nodes} per token: nodes must divide the "
                             "experts and 1 <= max_nodes <= nodes")
        if k % max_nodes or k // max_nodes > experts // nodes:
            raise ValueError(f"node-limited routing ranks nodes by their k/M = "
                             f"{k}/{max_nodes} best experts: M must divide k and "
                             f"k/M be at most the {experts // nodes} per node")
        if normalize is None:
            normalize = k > 1
        if normalize and k == 1:
            raise ValueError(
                "Router(k=1, normalize=True): one gate normalised is always 1, "
                "whatever the scores, so the router's gate gets no gradient and "
                "never learns which expert suits a token; Switch's top-1 keeps the "
                "probability as its gate (normalize=False, the default for k=1)")
        self.k, self.score, self.normalize = k, score, bool(normalize)
        self.nodes, self.max_nodes = nodes, max_nodes
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.register_buffer("bias", torch.zeros(experts))

    @property
    def num_experts(self) -> int:
        return self.gate.out_features

    def forward(self, x: torch.Tensor, experts: torch.Tensor | None = None
                ) -> Routing:
        """x (T, h). experts (T, k): use this choice instead of the router's own
        (the same routing for another run, e.g. in float64); gates still come
        from this router's scores. ValueError when experts is not one row of k
        expert ids in [0, E) per token of x."""
        if experts is not None:
            experts = self._forced(x, experts)
        logits = self.gate(x)  # (T, h) -> (T, E)
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        if experts is None:
            experts = self.choose(scores.detach())  # (T, k)
        gates = scores.gather(1, experts)  # (T, k)
        if self.normalize:
            gates = gates / gates.sum(-1, keepdim=True)
        return Routing(experts, gates, scores)

    def _forced(self, x: torch.Tensor, experts) -> torch.Tensor:
        """A forced routing, checked: (T, k) int64 expert ids in [0, E)."""
        t, k, e = x.shape[0] if x.dim() else 0, self.k, self.num_experts
        if not isinstance(experts, torch.Tensor) or experts.dtype in (
                torch.bool, torch.uint8) or experts.is_floating_point() \
                or experts.is_complex():
            what = (f"a {experts.dtype} tensor" if isinstance(experts, torch.Tensor)
                    else f"a {type(experts).__name__}")
            raise ValueError(f"forced routing: experts is {what}; give an integer "
                             f"tensor of expert ids, ({t}, {k})")
        if tuple(experts.shape) != (t, k):
            raise ValueError(
                f"forced routing: experts has shape {tuple(experts.shape)} for x "
                f"of shape {tuple(x.shape)}: one row of k = {k} experts per token, "
                f"({t}, {k}), expected")
        if experts.numel() and not (0 <= int(experts.min())
                                    and int(experts.max()) < e):
            raise ValueError(
                f"forced routing: expert ids from {int(experts.min())} to "
                f"{int(experts.max())}, but this router has {e} experts: ids in "
                f"[0, {e}) expected")
        return experts.long()

    def choose(self, scores: torch.Tensor) -> torch.Tensor:
        """(T, E) scores -> (T, k) experts: the top k of scores + bias, within
        the best `max_nodes` nodes."""
        biased = scores + self.bias  # the bias picks experts, never weighs them
        if self.max_nodes < self.nodes:
            biased = limit_nodes(biased, self.nodes, self.max_nodes, self.k)
        return biased.topk(self.k, dim=-1).indices


def limit_nodes(scores: torch.Tensor, nodes: int, max_nodes: int, k: int
                ) -> torch.Tensor:
    """(T, E) scores with every expert outside a token's `max_nodes` best nodes
    set to -inf; a node's score is the sum of its k/M highest (DeepSeek-AI 2024,
    sec. 2.1.2)."""
    t, e = scores.shape
    per_node = scores.view(t, nodes, e // nodes)  # (T, nodes, E/nodes)
    node_score = per_node.topk(k // max_nodes, dim=-1).values.sum(-1)  # (T, nodes)
    best = node_score.topk(max_nodes, dim=-1).indices  # (T, M)
    allowed = torch.zeros(t, nodes, dtype=torch.bool, device=scores.device
                          ).scatter_(1, best, True)  # (T, nodes)
    allowed = allowed.repeat_interleave(e // nodes, dim=1)  # (T, E)
    return scores.masked_fill(~allowed, float("-inf"))


def check_capacity_factor(factor) -> float | None:
    """factor if it is None (no capacity) or a finite number > 0, else
    ValueError saying so (NaN and inf included)."""
    if factor is None:
        return None
    if isinstance(factor, bool) or not isinstance(factor, numbers.Real) or not (
            math.isfinite(factor) and factor > 0):
        raise ValueError(f"the capacity factor must be a finite number > 0 (None: "
                         f"no capacity, every pair kept), got {factor!r}")
    return factor


def capacity(factor: float, k: int, tokens: int, experts: int) -> int:
    """Pairs one expert takes from `tokens` tokens: ceil(factor·k·T/E) (Fedus et
    al. 2021, sec. 2.2, eq. 3, with k choices per token as GShard's 2T/E).
    ValueError for a factor that is not finite and > 0, or k, E < 1, T < 0."""
    check_capacity_factor(factor)
    k, tokens = whole(k, "capacity: k", 1), whole(tokens, "capacity: tokens", 0)
    experts = whole(experts, "capacity: experts", 1)
    pairs = factor * k * tokens / experts
    if not math.isfinite(pairs):
        raise ValueError(
            f"capacity factor {factor} x k = {k} x {tokens} tokens / {experts} "
            f"experts is past float's range: give a smaller factor (c = E/k = "
            f"{experts / k:g} already lets every expert take all {tokens} tokens)")
    return math.ceil(pairs)


def within_capacity(experts: torch.Tensor, num_experts: int, cap: int | None
                    ) -> torch.Tensor:
    """(T, k) bool: which (token, expert) pairs their expert takes. Each expert
    takes its first `cap` pairs, first choices before second ones and in token
    order within a choice (GShard's priority: Lepikhin et al. 2020, Algorithm
    1). cap None: all; else a whole number >= 0."""
    if cap is None:
        return torch.ones_like(experts, dtype=torch.bool)
    cap = whole(cap, "within_capacity: cap, the pairs an expert takes,", 0)
    num_experts = whole(num_experts, "within_capacity: num_experts", 1)
    if experts.dim() != 2:
        raise ValueError(f"within_capacity: experts must be (T, k), one row of "
                         f"expert ids per token, got shape {tuple(experts.shape)}")
    if experts.numel() and not (0 <= int(experts.min())
                                and int(experts.max()) < num_experts):
        raise ValueError(f"within_capacity: expert ids from {int(experts.min())} "
                         f"to {int(experts.max())}, ids in [0, {num_experts}) "
                         "expected")
    t, k = experts.shape
    queue = F.one_hot(experts.t().reshape(-1), num_experts)  # (k T, E), choice-major
    place = (queue.cumsum(0) * queue).sum(1) - 1  # (k T,): place in its queue
    return (place < cap).view(k, t).t()


def _finite_at_least_0(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not (
            math.isfinite(v) and v >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")


def switch_balance_loss(routing: Routing, alpha: float = 1e-2) -> torch.Tensor:
    """α·E·Σ_i f_i·P_i (Fedus et al. 2021, eq. 4; α = 10^-2 there): f_i the
    fraction of the T·k pairs routed to expert i, P_i the mean over tokens of
    its probability (scores rescaled to sum to 1 per token: softmax unchanged).
    Equal to α when the routing is uniform; its gradient reaches the router
    through P. ValueError for an alpha that is not finite and >= 0."""
    _finite_at_least_0("switch_balance_loss: alpha", alpha)
    t, k = routing.experts.shape
    e = routing.scores.shape[-1]
    f = routing.load().to(routing.scores.dtype) / (t * k)  # (E,)
    p = routing.scores / routing.scores.sum(-1, keepdim=True)  # (T, E)
    return alpha * e * (f * p.mean(0)).sum()


@torch.no_grad()
def update_bias(router: Router, load: torch.Tensor, gamma: float = 1e-3, *,
                sum_over=None) -> torch.Tensor:
    """DeepSeek-V3's loss-free balancing, after a step: each expert's bias goes
    down by γ if its load is above the mean, up by γ if below (DeepSeek-AI 2024,
    sec. 2.1.2; γ = 0.001 for most of training, sec. 4.2). load: (E,) pairs
    routed to each expert in the step (Routing.load). sum_over: a process group
    (dist.group.WORLD for all) to sum the load over first, so that every rank
    sees the whole batch and makes the same update; None: this load alone.
    Returns the new bias. ValueError for a gamma that is not finite and >= 0."""
    _finite_at_least_0("update_bias: gamma", gamma)
    load = load.to(router.bias.dtype).clone()  # (E,)
    if sum_over is not None:
        dist.all_reduce(load, group=sum_over)
    router.bias += gamma * torch.sign(load.mean() - load)
    return router.bias
