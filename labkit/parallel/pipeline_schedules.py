"""Pipeline schedules: the order of passes on each stage (`stage_order`: GPipe,
1F1B, interleaved, ZB-H1), and a simulator that times any of them with fixed pass
durations, no ranks (`simulate_schedule`).

Imports labkit.arguments and labkit.theory. F is a forward, B a backward (in
zero-bubble schedules only the input's gradient), W the weights' gradient
(zero-bubble only), which ZB-H1 defers to fill the drain's bubbles.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

from labkit.arguments import whole
from labkit.theory import check_counts

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


class Action(NamedTuple):
    """One pass of one micro-batch through one of this rank's model chunks."""

    kind: str  # "F", "B" or "W"
    microbatch: int
    chunk: int = 0  # which of the rank's v chunks (interleaved); else 0


def _check(schedule: str, p: int, m: int, rank: int, v: int) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, not {schedule!r}")
    check_counts(p=p, m=m, v=v)
    whole(rank, "rank", 0, p - 1)
    if v != 1 and schedule != "interleaved":
        raise ValueError(f"v = {v} model chunks per rank needs schedule="
                         f"'interleaved', not {schedule!r}")
    if schedule == "interleaved" and m % p:
        raise ValueError(f"the interleaved schedule runs micro-batches in groups of "
                         f"p = {p}: m = {m} is not a multiple of {p}")


def stage_order(schedule: str, p: int, m: int, rank: int, v: int = 1) -> list[Action]:
    """The passes stage `rank` of p runs, in order, for m micro-batches: "gpipe"
    all forwards then all backwards; "1f1b" p-1-rank forwards, then one forward
    one backward; "interleaved" 1F1B over v chunks per rank; "zb-h1" 1F1B with
    stage `rank` deferring its first `rank` W passes."""
    _check(schedule, p, m, rank, v)
    F, B, W = (partial(Action, kind) for kind in "FBW")  # F(3): Action("F", 3)
    if schedule == "gpipe":
        return [F(i) for i in range(m)] + [B(i) for i in range(m)]
    if schedule == "interleaved":
        return _interleaved(p, m, rank, v)
    warmup = min(p - 1 - rank, m)
    order = [F(i) for i in range(warmup)]
    for k in range(m - warmup):  # steady state: one forward, one backward
        order += [F(warmup + k), B(k)]
        if schedule == "zb-h1" and k >= rank:
            order.append(W(k - rank))  # stage `rank` keeps `rank` W's back
    if schedule != "zb-h1":
        return order + [B(k) for k in range(m - warmup, m)]
    pending = [k for k in range(m) if W(k) not in order]
    for k in range(m - warmup, m):  # the drain: a deferred W after each B ...
        order.append(B(k))
        if pending:
            order.append(W(pending.pop(0)))
    order += [W(k) for k in pending]  # ... and the rest at the end
    return order


def _interleaved(p: int, m: int, rank: int, v: int) -> list[Action]:
    """Megatron-LM's interleaved order: the k-th forward runs chunk (k // p) % v on
    micro-batch (k // pv) p + k % p; backwards likewise, chunks in reverse."""
    total = m * v

    def pick(k: int, backward: bool) -> Action:
        group, within = divmod(k, p * v)
        chunk = within // p
        return Action("B" if backward else "F", group * p + within % p,
                      v - 1 - chunk if backward else chunk)

    warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
    order = [pick(k, False) for k in range(warmup)]
    for k in range(total - warmup):
        order += [pick(warmup + k, False), pick(k, True)]
    return order + [pick(k, True) for k in range(total - warmup, total)]


def peak_in_flight(order: list[Action]) -> int:
    """Most micro-batch chunks whose forward ran and whose backward (W, where the
    order splits it, else B) has not: the activations the stage holds at once."""
    split = any(a.kind == "W" for a in order)
    held, peak = set(), 0
    for a in order:
        if a.kind == "F":
            held.add((a.microbatch, a.chunk))
            peak = max(peak, len(held))
        elif a.kind == ("W" if split else "B"):
            held.discard((a.microbatch, a.chunk))
    return peak


# ------------------------------------------------------------------- simulator


@dataclass(frozen=True)
class Op:
    """One pass as the simulator placed it (time in units of the durations)."""

    start: float
    end: float
    kind: str  # "F", "B" or "W"
    microbatch: int
    chunk: int = 0


@dataclass(frozen=True)
class Simulation:
    """Every stage's passes in order, placed in time: `ops[rank]`."""

    schedule: str
    p: int
    m: int
    v: int
    ops: dict[int, list[Op]]

    @property
    def makespan(self) -> float:
        return max(o.end for ops in self.ops.values() for o in ops)

    def busy(self, rank: int) -> float:
        return sum(o.end - o.start for o in self.ops[rank])

    def bubble(self, rank: int) -> float:
        """Idle share of the whole step on this rank (0 ... 1)."""
        return 1 - self.busy(rank) / self.makespan

    @property
    def bubble_of_total(self) -> float:
        """Idle time over the whole step, averaged over the ranks
        (theory.pipeline_bubble's of_total: (p-1)/(m+p-1) for GPipe and 1F1B)."""
        return sum(self.bubble(r) for r in self.ops) / self.p

    @property
    def bubble_of_ideal(self) -> float:
        """Idle time over the busy time, averaged over the ranks (Megatron's and
        the zero-bubble paper's "bubble rate")."""
        return sum(self.makespan / self.busy(r) - 1 for r in self.ops) / self.p


def simulate_schedule(schedule: str, p: int, m: int, v: int = 1, *, f: float = 1.0,
                      b: float = 1.0, w: float = 1.0, comm: float = 0.0
                      ) -> Simulation:
    """Place every stage's passes in time: each starts when its stage is free and
    its inputs are ready (`comm` later when they come from another rank).

    f, b, w: a whole stage's forward, input-gradient and weight-gradient times; a
    schedule that does not split the backward runs B for b + w. With v chunks per
    rank each chunk takes 1/v of them."""
    orders = {r: stage_order(schedule, p, m, r, v) for r in range(p)}
    split = schedule == "zb-h1"
    cost = {"F": f / v, "B": (b if split else b + w) / v, "W": w / v}
    stages = v * p

    def needs(a: Action, rank: int):
        # F on virtual stage k needs F on k-1; B on k needs B on k+1 (the last
        # stage: its own F); W needs B
        k = a.chunk * p + rank  # virtual stage
        if a.kind == "F":
            return [] if k == 0 else [("F", a.microbatch, k - 1)]
        if a.kind == "B":
            return [("F" if k == stages - 1 else "B", a.microbatch,
                     k if k == stages - 1 else k + 1)]
        return [("B", a.microbatch, k)]

    done: dict[tuple, float] = {}
    ops: dict[int, list[Op]] = {r: [] for r in range(p)}
    free = dict.fromkeys(range(p), 0.0)
    pos = dict.fromkeys(range(p), 0)
    while any(pos[r] < len(orders[r]) for r in range(p)):
        moved = False
        for r in range(p):
            while pos[r] < len(orders[r]):
                a = orders[r][pos[r]]
                deps = needs(a, r)
                if any(d not in done for d in deps):
                    break
                ready = max([done[d] + (comm if d[2] % p != r else 0.0)
                             for d in deps], default=0.0)
                start = max(free[r], ready)
                free[r] = start + cost[a.kind]
                done[(a.kind, a.microbatch, a.chunk * p + r)] = free[r]
                ops[r].append(Op(start, free[r], a.kind, a.microbatch, a.chunk))
                pos[r] += 1
                moved = True
        if not moved:
            stuck = {r: orders[r][pos[r]] for r in range(p) if pos[r] < len(orders[r])}
            raise ValueError(f"schedule {schedule!r} deadlocks: every stage waits "
                             f"(next passes {stuck})")
    return Simulation(schedule, p, m, v, ops)
