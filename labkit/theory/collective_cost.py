"""Collective costs: bytes each rank sends, bus factors, latency steps, the α-β
model and its fit. Sizes in bytes, times in seconds, bandwidths in bytes/second."""

from __future__ import annotations

from dataclasses import dataclass

from labkit.conventions import BUS_FACTOR
from labkit.theory._validate import check_size, check_world_size

#
# Bus factors: nccl-tests, doc/PERFORMANCE.md ("busBw = algBw * factor"):
#   all-reduce 2(n-1)/n; all-gather, reduce-scatter, all-to-all (n-1)/n;
#   broadcast, reduce 1. For the ring algorithms the factor times the array size S
#   is also the number of bytes each rank sends (Patarasuk & Yuan 2009, "Bandwidth
#   optimal all-reduce algorithms for clusters of workstations": 2(n-1)/n * S is
#   the lower bound for all-reduce, reached by the ring). The table lives in
#   labkit.conventions, shared with the traffic ledger.

_FACTORS = {op: f for op, f in BUS_FACTOR.items()
            if op not in ("send", "recv", "barrier")}

# Steps (message latencies) of the ring algorithms (Thakur, Rabenseifner & Gropp
# 2005, "Optimization of Collective Communication Operations in MPICH", sec. 4):
# ring all-gather takes n-1 steps; ring all-reduce is a reduce-scatter then an
# all-gather, 2(n-1) steps; a pipelined chain broadcast n-1 steps. An all-to-all
# is no ring: its n-1 sends go out at once (NCCL groups them, DeepEP's kernels
# likewise), so it waits one message latency, not n-1 in turn (MPICH's pairwise
# exchange, Thakur et al. sec. 4.5, is the sequential alternative). Held to
# DeepEP's published dispatch and combine latencies in the tests.
_STEPS = {
    "all_reduce": lambda n: 2 * (n - 1),
    "all_gather": lambda n: n - 1,
    "reduce_scatter": lambda n: n - 1,
    "all_to_all": lambda n: min(1, n - 1),
    "scatter": lambda n: n - 1,
    "gather": lambda n: n - 1,
    "broadcast": lambda n: n - 1,
    "reduce": lambda n: n - 1,
}
COLLECTIVES = tuple(_FACTORS)



def _check_op(op: str) -> str:
    if op not in _FACTORS:
        raise ValueError(f"unknown collective {op!r}; one of {COLLECTIVES}")
    return op




def bus_factor(op: str, world_size: int) -> float:
    """nccl-tests' busbw / algbw for `op` on n = world_size ranks (2(n-1)/n for
    all-reduce)."""
    return _FACTORS[_check_op(op)](check_world_size(world_size))


def ring_bytes_per_rank(op: str, size: float, world_size: int) -> float:
    """Bytes each rank sends in the ring algorithm for an S-byte array on
    n = world_size ranks: all-reduce 2(n-1)/n * S, all-gather / reduce-scatter
    (n-1)/n * S."""
    return bus_factor(op, world_size) * check_size(size)


def latency_steps(op: str, world_size: int) -> int:
    """Message latencies one after another on n = world_size ranks: a ring's
    steps (2(n-1) for all-reduce, n-1 for all-gather); 1 for an all-to-all, whose
    sends go at once."""
    return _STEPS[_check_op(op)](check_world_size(world_size))


def alpha_beta_time(op: str, size: float, world_size: int, alpha: float,
                    beta: float) -> float:
    """The α-β (latency-bandwidth) model of a collective (a ring, or an
    all-to-all's concurrent sends): t = latency_steps * α + bytes_per_rank / β
    (Thakur et al. 2005, sec. 2; β in bytes/s)."""
    if alpha < 0 or beta <= 0:
        raise ValueError(f"need alpha >= 0 s and beta > 0 bytes/s, got {alpha}, {beta}")
    return (latency_steps(op, world_size) * alpha
            + ring_bytes_per_rank(op, size, world_size) / beta)


@dataclass(frozen=True)
class AlphaBeta:
    """A fitted α-β model of one collective on world_size ranks."""

    op: str
    world_size: int
    alpha: float  # seconds per step (latency)
    beta: float  # bytes per second (bandwidth)

    def time(self, size: float) -> float:
        return alpha_beta_time(self.op, size, self.world_size, self.alpha, self.beta)


def fit_alpha_beta(op: str, world_size: int, sizes, seconds) -> AlphaBeta:
    """Least-squares fit of t = steps*α + bytes_per_rank/β to measured (size, t).

    Both terms are linear in (α, 1/β); negative estimates are clamped to the
    smallest physical value (α = 0; β from the largest size alone)."""
    sizes, seconds = list(sizes), list(seconds)
    if len(sizes) != len(seconds) or len(sizes) < 2:
        raise ValueError("need at least two (size, seconds) points of equal length")
    k = latency_steps(op, world_size)
    xs = [ring_bytes_per_rank(op, s, world_size) for s in sizes]
    # ordinary least squares for t = c + b*x, then α = c / steps, β = 1 / b
    m, sx, st = len(xs), sum(xs), sum(seconds)
    sxx = sum(x * x for x in xs)
    sxt = sum(x * t for x, t in zip(xs, seconds))
    den = m * sxx - sx * sx
    if den == 0:
        raise ValueError("sizes must not all be equal")
    b = (m * sxt - sx * st) / den
    c = (st - b * sx) / m
    if c < 0:  # no negative latency: refit through the origin
        c, b = 0.0, sxt / sxx
    if b <= 0:  # no infinite bandwidth: take the largest message alone
        big = max(range(m), key=lambda i: xs[i])
        b = max(seconds[big] - c, 1e-12) / xs[big]
    return AlphaBeta(op, world_size, alpha=c / k if k else 0.0, beta=1.0 / b)
