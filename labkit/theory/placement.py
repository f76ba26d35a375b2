"""Placement semantics: where parameters, optimizer state, gradients and activations
live (four states x five modes), what that costs, and whether it trains correctly."""

from __future__ import annotations

from dataclasses import dataclass

from labkit.theory._validate import check_params, check_world_size

#
# Mehta 2026, "Placement Semantics for Distributed Deep Learning" (arXiv 2601.02311):
# a strategy is where it places four training states - parameters P, optimizer
# state O, gradients G, activations A - each in one of five modes; two conditions,
# gradient integrity and state consistency, are necessary and sufficient for the
# result to match single-device training. We could read only the paper's abstract;
# the byte and traffic accounting below is the ZeRO paper's (sec. 5 and 7), written
# per mode, and reproduces the abstract's figures (ZeRO-3: 8x less memory than DP
# at 1.5x the communication, N = 8) and the 1120 GB of model state of a 70B model.

MODES = ("Replicated", "Sharded", "ShardedWithGather", "Materialized", "Offloaded")
_MODE_NOTES = {
    "Replicated": "every device holds all of it",
    "Sharded": "each device holds 1/N and never the whole",
    "ShardedWithGather": "each device holds 1/N; gathered whole just when used",
    "Materialized": "nothing kept: created when needed, freed after",
    "Offloaded": "kept in host memory, moved over PCIe when used",
}


@dataclass(frozen=True)
class PlacementCost:
    persistent: dict[str, float]  # state -> bytes kept on each device between steps
    peak: dict[str, float]  # state -> bytes at its largest during a step
    traffic: dict[str, float]  # collective -> bytes each device sends per step
    pcie: float  # bytes each device moves to or from host memory per step

    @property
    def persistent_total(self) -> float:
        return sum(self.persistent.values())

    @property
    def peak_total(self) -> float:
        return sum(self.peak.values())

    @property
    def traffic_total(self) -> float:
        return sum(self.traffic.values())


@dataclass(frozen=True)
class Verdict:
    ok: bool
    problems: tuple[str, ...]

    def __str__(self) -> str:
        return "correct" if self.ok else "incorrect: " + "; ".join(self.problems)


@dataclass(frozen=True)
class Placement:
    """Where P, O, G and A live. grad_sync ("all_reduce", "reduce_scatter" or
    None) and param_sync ("all_gather" or None) default to what the modes need."""

    P: str = "Replicated"
    O: str = "Replicated"  # noqa: E741
    G: str = "Replicated"
    A: str = "Replicated"
    grad_sync: str | None = "auto"
    param_sync: str | None = "auto"
    name: str = ""

    def __post_init__(self):
        for state in "POGA":
            if getattr(self, state) not in MODES:
                raise ValueError(f"{state} must be one of {MODES}, "
                                 f"not {getattr(self, state)!r}")
        if self.grad_sync not in ("auto", "all_reduce", "reduce_scatter", None):
            raise ValueError(f"grad_sync must be 'all_reduce', 'reduce_scatter' or "
                             f"None, not {self.grad_sync!r}")
        if self.param_sync not in ("auto", "all_gather", None):
            raise ValueError(f"param_sync must be 'all_gather' or None, "
                             f"not {self.param_sync!r}")

    # what the modes imply ----------------------------------------------------

    def _owned_optimizer(self) -> bool:  # each device updates only its shard
        return self.O in ("Sharded", "ShardedWithGather", "Offloaded")

    def resolved_grad_sync(self) -> str | None:
        if self.grad_sync != "auto":
            return self.grad_sync
        sharded = self._owned_optimizer() or self.G in ("Sharded", "ShardedWithGather")
        return "reduce_scatter" if sharded else "all_reduce"

    def gathers_parameters(self) -> bool:
        """Whole parameters are rebuilt from 1/N shards each time a layer runs
        (forward, and again in backward): ShardedWithGather; Materialized from an
        optimizer state - the master copy - that each device holds a shard of; or
        Offloaded beside such an optimizer, each host keeping the 1/N its device
        updates. From a replicated optimizer every device has the whole: a local
        cast (Materialized) or a whole copy on its host (Offloaded), no traffic."""
        return self.P == "ShardedWithGather" or (
            self.P in ("Materialized", "Offloaded") and self._owned_optimizer())

    def resolved_param_sync(self) -> str | None:
        if self.param_sync != "auto":
            return self.param_sync
        # replicated parameters updated shard by shard must be gathered again
        return "all_gather" if self.P == "Replicated" and self._owned_optimizer() \
            else None

    # the two correctness conditions ---------------------------------------------

    def check(self, *, k: float = 12) -> Verdict:
        """Gradient integrity: every gradient the optimizer applies is reduced over
        the whole global batch. State consistency: after the step every device's
        view of the parameters is the same, and the one a single device's update
        gives. Plus: a data-parallel forward needs the whole of each layer's
        parameters at some point. `k`: the optimizer's bytes of state per
        parameter, as in cost(); only k = 0 (no state) may be Materialized."""
        if k < 0:
            raise ValueError(f"k cannot be negative, got {k}")
        problems = []
        if self.resolved_grad_sync() is None:
            what = "sharded gradients" if self.G in ("Sharded", "ShardedWithGather") \
                else "gradients"
            problems.append(
                f"gradient integrity: {what} are never reduced across devices, so "
                "each device applies the gradient of its own micro-batch only")
        if self.P == "Replicated" and self._owned_optimizer() and \
                self.resolved_param_sync() is None:
            problems.append(
                "state consistency: each device updates only its shard of the "
                "replicated parameters and nothing gathers the rest, so the "
                "replicas drift apart")
        if self.resolved_grad_sync() == "reduce_scatter" and self.O == "Replicated":
            problems.append(
                "state consistency: the optimizer is replicated but each device "
                "holds the reduced gradient of its shard only; the replicas update "
                "with different gradients")
        if self.O == "Materialized" and k > 0:
            # Adam's m and v are averages over every step so far, the master copy
            # the sum of every update: no input rebuilds them, unlike activations
            problems.append(
                "state consistency: the optimizer state is Materialized, so it is "
                "rebuilt from nothing every step, but Adam's m and v (and the fp32 "
                "master copy) carry every earlier step: each update is not the one "
                "a single device makes (only a stateless optimizer, k = 0, can be "
                "Materialized)")
        if self.P == "Materialized" and self.O == "Materialized":
            problems.append(
                "state consistency: parameters and optimizer state are both "
                "Materialized, so no device keeps the weights (nor their master "
                "copy) from one step to the next: there is nothing to rebuild "
                "them from")
        if self.P == "Sharded":
            problems.append(
                "parameters are sharded and never gathered: no device can run a "
                "layer's forward on its own batch (that needs tensor parallelism, "
                "chapter 09, or ShardedWithGather)")
        return Verdict(not problems, tuple(problems))

    # memory and traffic -----------------------------------------------------------

    def cost(self, params: float, dp_size: int, *, k: float = 12,
             param_bytes: float = 2, grad_bytes: float = 2, activations: float = 0.0,
             gather_fraction: float = 1.0) -> PlacementCost:
        """Bytes per device (persistent and peak) and traffic per step for Ψ =
        `params` on N = dp_size data-parallel devices. `activations`: one
        device's activation bytes when Replicated (its own micro-batch).
        `gather_fraction`: the largest share of a gathered, Materialized or
        Offloaded state held whole on the device at once (1/L when it is one of L
        layers at a time)."""
        psi, n = check_params(params), check_world_size(dp_size)
        if not 0 < gather_fraction <= 1:
            raise ValueError(
                f"gather_fraction must be in (0, 1], got {gather_fraction}")
        if activations < 0:
            raise ValueError("activations cannot be negative")
        full = {"P": param_bytes * psi, "O": k * psi, "G": grad_bytes * psi,
                "A": float(activations)}
        persistent, peak = {}, {}
        for state, size in full.items():
            mode = getattr(self, state)
            keep = {"Replicated": size, "Sharded": size / n,
                    "ShardedWithGather": size / n, "Materialized": 0.0,
                    "Offloaded": 0.0}[mode]
            # Offloaded P, G and A are whole on the device while their layer runs:
            # its weights, the gradient backward makes before it is reduced and
            # moved off, its activations between the copy and the free
            transient = {"ShardedWithGather": gather_fraction * size * (1 - 1 / n),
                         "Materialized": gather_fraction * size,
                         "Offloaded": gather_fraction * size}.get(mode, 0.0)
            if state == "O" and mode == "Offloaded":
                transient = 0.0  # ZeRO-Offload steps on the CPU: O never comes back
            if state == "A":  # activations live only inside a step
                keep, transient = 0.0, keep + transient
            persistent[state], peak[state] = keep, keep + transient
        share = (n - 1) / n * psi
        traffic = {}
        sync = self.resolved_grad_sync()
        if sync == "all_reduce":
            traffic["all_reduce (gradients)"] = 2 * share * grad_bytes
        elif sync == "reduce_scatter":
            traffic["reduce_scatter (gradients)"] = share * grad_bytes
        if self.gathers_parameters():
            traffic["all_gather (parameters, forward)"] = share * param_bytes
            traffic["all_gather (parameters, backward)"] = share * param_bytes
        if self.resolved_param_sync() == "all_gather":
            traffic["all_gather (parameters, after the step)"] = share * param_bytes
        pcie = 0.0
        # P whose only copy is in host memory - Offloaded, or Materialized from an
        # offloaded master - crosses PCIe each time a layer runs, forward and
        # backward (ZeRO-Infinity, Rajbhandari et al. 2021, sec. 4.1): a device's
        # 1/N beside an owned optimizer (the rest is all-gathered), else the whole
        from_host = self.P == "Offloaded" or (
            self.P == "Materialized" and self.O == "Offloaded")
        host_p = param_bytes * psi / (n if self._owned_optimizer() else 1)
        if from_host:
            pcie += 2 * host_p
        if self.O == "Offloaded":  # gradients down to the CPU's step; its updated
            pcie += grad_bytes * psi / n  # parameters up, unless they wait on the
            if not from_host:  # host for the next forward
                pcie += param_bytes * psi / n
        elif self.P == "Offloaded":  # a step on the device writes P back to the host
            pcie += host_p
        if self.G == "Offloaded" and self.O != "Offloaded":
            # backward makes a layer's gradient on the device; once reduced, the
            # device's part (its 1/N after a reduce-scatter or beside an owned
            # optimizer, else the whole) goes down, and a step on the device needs
            # it back up. Beside O Offloaded the CPU steps where it landed: that
            # one trip down is counted above
            owned = self._owned_optimizer() or sync == "reduce_scatter"
            pcie += 2 * grad_bytes * psi / (n if owned else 1)
        if self.A == "Offloaded":  # each layer's activations down after forward
            pcie += 2 * full["A"]  # made them, up again for its backward
        return PlacementCost(persistent, peak, traffic, pcie)

    def describe(self) -> str:
        return "\n".join(f"{s}: {getattr(self, s):<18} {_MODE_NOTES[getattr(self, s)]}"
                         for s in "POGA")


PLACEMENTS = {
    "DP": Placement("Replicated", "Replicated", "Replicated", "Replicated", name="DP"),
    "ZeRO-1": Placement("Replicated", "Sharded", "Replicated", "Replicated",
                        name="ZeRO-1"),
    "ZeRO-2": Placement("Replicated", "Sharded", "Sharded", "Replicated",
                        name="ZeRO-2"),
    "ZeRO-3": Placement("ShardedWithGather", "Sharded", "Sharded", "Replicated",
                        name="ZeRO-3"),
    "FSDP": Placement("ShardedWithGather", "Sharded", "Sharded", "Replicated",
                      name="FSDP"),
    "ZeRO-Offload": Placement("Replicated", "Offloaded", "Sharded", "Replicated",
                              name="ZeRO-Offload"),
}
