"""Spans of compute and communication a rank recorded, and how much they overlap.

A `Span` is plain data (times are this rank's time.perf_counter(), CLOCK_MONOTONIC
on Linux, so spans from ranks on one machine share a clock). `overlap_fraction`
is Holistic Trace Analysis's comm/compute overlap (github.com/facebookresearch/
HolisticTraceAnalysis, "Comm Comp Overlap"): the time in which communication and
computation both run, over the total time communication runs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Span:
    """One stretch of work on one rank: compute (backward) or a collective."""

    kind: str  # "compute" or "comm"
    name: str  # "backward", "all_reduce bucket 0", ...
    start: float  # time.perf_counter(): compute began, or the collective was issued
    end: float  # compute ended, or the collective completed
    nbytes: int = 0  # payload of a collective (0 for compute)

    @property
    def seconds(self) -> float:
        return self.end - self.start

    def as_dict(self) -> dict:
        return asdict(self)


def union(spans) -> list[tuple[float, float]]:
    """Merge spans (or (start, end) pairs) into sorted, disjoint intervals."""
    pairs = sorted((s.start, s.end) if isinstance(s, Span) else tuple(s) for s in spans)
    out: list[tuple[float, float]] = []
    for a, b in pairs:
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        elif b > a:
            out.append((a, b))
    return out


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _intersect(xs, ys) -> float:
    """Total length of the intersection of two sorted, disjoint interval lists."""
    i = j = 0
    both = 0.0
    while i < len(xs) and j < len(ys):
        lo, hi = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        both += max(0.0, hi - lo)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return both


def overlap_fraction(events) -> float:
    """Share of communication time during which compute also ran (0 ... 1).

    Overlapping collectives count once (the union of comm spans), as do
    overlapping compute spans. 0.0 when there is no communication at all.
    """
    comm = union(e for e in events if e.kind == "comm")
    compute = union(e for e in events if e.kind == "compute")
    total = _length(comm)
    return _intersect(comm, compute) / total if total > 0 else 0.0
