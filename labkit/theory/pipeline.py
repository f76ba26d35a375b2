"""Pipeline bubbles and the activations a schedule keeps in flight."""

from __future__ import annotations

from dataclasses import dataclass

from labkit.theory._validate import check_counts


@dataclass(frozen=True)
class Bubble:
    of_total: float  # idle fraction of the whole step
    of_ideal: float  # idle time relative to the ideal (bubble-free) compute time


def pipeline_bubble(p: int, m: int, v: int = 1) -> Bubble:
    """Pipeline bubble for p stages, m micro-batches, v interleaved chunks per stage.

    Idle time is (p-1)/v micro-batch slots against m of work (GPipe, Huang et al.
    2019; 1F1B and the interleaved schedule, Narayanan et al. 2021, "Efficient
    Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", sec.
    2.2.1 and 2.2.2): of_ideal = (p-1)/(v m); of_total = (p-1)/(v m + p - 1),
    which for v = 1 is (p-1)/(m+p-1)."""
    check_counts(p=p, m=m, v=v)
    return Bubble(of_total=(p - 1) / (v * m + p - 1), of_ideal=(p - 1) / (v * m))


def zero_bubble_h1(p: int, m: int, f: float = 1.0, b: float = 1.0,
                   w: float = 1.0) -> Bubble:
    """ZB-H1's bubble (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", ICLR,
    sec. 2.1): the backward split into B (input gradient, time b) and W (weight
    gradient, time w); W passes held back fill the drain. With f = b = w (the
    paper's sec. 2 assumption) each stage idles (p-1)f against m(f+b+w) of work,
    a third of 1F1B's (p-1)(f+b+w): of_ideal = (p-1)/(3m), the paper's "bubble
    rate" (sail-sg/zero-bubble-pipeline-parallelism, README table).

    For other times this returns (p-1)·max(f+b-w, f, b) idle per stage: the
    schedule as labkit's simulator places it (pipeline_schedules.py), which for
    w <= min(f, b) is (p-1)(f+b-w); a W longer than F or B cannot fill the fill
    phase's gaps, which are F and B long. Needs m >= p."""
    check_counts(p=p, m=m)
    if m < p:
        raise ValueError(f"ZB-H1's bubble formula needs m >= p: m = {m} micro-"
                         f"batches cannot fill {p} stages")
    if min(f, b, w) <= 0:
        raise ValueError(f"pass times must be > 0, got f={f}, b={b}, w={w}")
    idle, work = (p - 1) * max(f + b - w, f, b), m * (f + b + w)
    return Bubble(of_total=idle / (work + idle), of_ideal=idle / work)


SCHEDULES_IN_FLIGHT = ("gpipe", "1f1b", "zb-h1")


def activations_in_flight(schedule: str, p: int, m: int) -> int:
    """Micro-batches whose activations the first stage holds at its peak: GPipe
    runs all m forwards first (m); 1F1B starts backwards after p (min(p, m)), and
    so does ZB-H1, whose first stage runs each W right after its B (Qi et al.
    2024, sec. 2.1: ZB-H1's peak memory is 1F1B's)."""
    if schedule not in SCHEDULES_IN_FLIGHT:
        raise ValueError(f"schedule must be one of {SCHEDULES_IN_FLIGHT}, not "
                         f"{schedule!r}")
    pipeline_bubble(p, m)  # validates p and m
    return m if schedule == "gpipe" else min(p, m)
