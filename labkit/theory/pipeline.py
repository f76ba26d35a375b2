"""Pipeline bubbles and the activations a schedule keeps in flight."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Bubble:
    of_total: float  # idle fraction of the whole step
    of_ideal: float  # idle time relative to the ideal (bubble-free) compute time


def pipeline_bubble(p: int, m: int, v: int = 1) -> Bubble:
    """Pipeline bubble for p stages, m micro-batches, v interleaved chunks per stage.

    Idle time is (p-1)/v micro-batch slots against m of work (GPipe, Huang et al.
    2019; 1F1B and the interleaved schedule, Narayanan et al. 2021, "Efficient
    Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", sec.
    2.2): of_ideal = (p-1)/(v m); of_total = (p-1)/(v m + p - 1), which for v = 1
    is (p-1)/(m+p-1)."""
    for name, x in (("p", p), ("m", m), ("v", v)):
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {x!r}")
    return Bubble(of_total=(p - 1) / (v * m + p - 1), of_ideal=(p - 1) / (v * m))


def activations_in_flight(schedule: str, p: int, m: int) -> int:
    """Micro-batches whose activations the first stage holds at its peak: GPipe
    runs all m forwards first (m); 1F1B starts backwards after p (min(p, m))."""
    if schedule not in ("gpipe", "1f1b"):
        raise ValueError(f"schedule must be 'gpipe' or '1f1b', not {schedule!r}")
    pipeline_bubble(p, m)  # validates p and m
    return m if schedule == "gpipe" else min(p, m)
