"""What the calculator returns for one layout: its costs broken down."""

from __future__ import annotations

from dataclasses import dataclass, field

from labkit.theory.layout.layout import Layout


@dataclass(frozen=True)
class Estimate:
    """One layout on one cluster: bytes per device, bytes sent per device per
    step, and seconds per step (compute, each exposed communication, bubble)."""

    layout: Layout
    memory: dict[str, float]  # by category: Parameter, Gradient, Optstate, Activation
    traffic: dict[str, float]  # tp, cp, pp, dp, ep
    time: dict[str, float]  # compute, tp, cp, pp, ep, dp, bubble (exposed)
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
