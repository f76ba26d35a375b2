"""Bytes per parameter, and ZeRO's model-state memory and traffic per device."""

from __future__ import annotations

from dataclasses import dataclass

from labkit.theory._validate import check_params, check_world_size

# ------------------------------------------------------------ bytes per parameter
#
# Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
# Parameter Models", sec. 3.1: mixed-precision Adam keeps fp16/bf16 parameters and
# gradients (2 + 2 bytes) and fp32 master weights, momentum and variance (K = 12):
# 16 bytes per parameter. Megatron-LM's distributed-optimizer table (README,
# "Distributed Optimizer"): fp16 params and grads with fp32 main grads: 20 bytes;
# bf16 params with fp32 grads: 18; fp32 params and grads: 16.

_OPT_STATE = {"adam": 8, "adamw": 8, "sgd-momentum": 4, "sgd": 0}  # fp32 bytes


@dataclass(frozen=True)
class BytesPerParam:
    """Bytes per parameter by memory category (labkit.conventions' names)."""

    parameter: int
    gradient: int
    optstate: int  # K: master weights + the optimizer's own state
    grad_accum: int = 0  # an fp32 copy of the gradients, where one is kept

    @property
    def total(self) -> int:
        return self.parameter + self.gradient + self.optstate + self.grad_accum


def bytes_per_param(optimizer: str = "adam", precision: str = "mixed",
                    fp32_grad_accum: bool = False) -> BytesPerParam:
    """Model-state bytes per parameter.

    precision "mixed": 16-bit params and grads, fp32 master weights (4) in the
    optimizer state; "fp32": everything fp32, no master copy. Adam/AdamW keep m and
    v (8 bytes), SGD with momentum 4, plain SGD nothing. fp32_grad_accum adds an
    fp32 gradient buffer (4), as Megatron's fp16 path does: 2 + 2 + 4 + 12 = 20.
    """
    if optimizer not in _OPT_STATE:
        raise ValueError(f"optimizer must be one of {sorted(_OPT_STATE)}, "
                         f"not {optimizer!r}")
    if precision == "mixed":
        return BytesPerParam(2, 2, 4 + _OPT_STATE[optimizer],
                             4 if fp32_grad_accum else 0)
    if precision == "fp32":
        if fp32_grad_accum:
            raise ValueError("fp32 training already accumulates gradients in fp32")
        return BytesPerParam(4, 4, _OPT_STATE[optimizer])
    raise ValueError(f"precision must be 'mixed' or 'fp32', not {precision!r}")


# ------------------------------------------------------------------------- ZeRO


@dataclass(frozen=True)
class ZeroMemory:
    """Bytes of model state per device, by memory category."""

    parameter: float
    gradient: float
    optstate: float

    @property
    def total(self) -> float:
        return self.parameter + self.gradient + self.optstate




def _check_stage(stage) -> int:
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0 (plain data parallel), 1, 2 or 3, "
                         f"got {stage!r}")
    return stage


def zero_breakdown(params: float, dp_size: int, stage: int, k: float = 12,
                   param_bytes: float = 2, grad_bytes: float = 2) -> ZeroMemory:
    """Per-device model states under ZeRO (Rajbhandari et al. 2020, sec. 5.1, fig. 1)
    over N = dp_size data-parallel ranks (the paper's N_d): stage 0 (DP)
    (2+2+K)Ψ; 1: 2Ψ+2Ψ+KΨ/N; 2: 2Ψ+(2+K)Ψ/N; 3: (2+2+K)Ψ/N."""
    psi, n = check_params(params), check_world_size(dp_size)
    stage = _check_stage(stage)
    if k < 0 or param_bytes < 0 or grad_bytes < 0:
        raise ValueError("bytes per parameter cannot be negative")
    p, g, o = param_bytes * psi, grad_bytes * psi, k * psi
    return ZeroMemory(p / n if stage >= 3 else p, g / n if stage >= 2 else g,
                      o / n if stage >= 1 else o)


def zero_memory(params: float, dp_size: int, stage: int, k: float = 12,
                **kw) -> float:
    """Bytes of model state per device for ZeRO `stage` (0 = plain DP) over
    N = dp_size data-parallel ranks. Ψ = 7.5e9, N = 64, K = 12 gives the
    paper's 120 / 31.4 / 16.6 / 1.9 GB."""
    return zero_breakdown(params, dp_size, stage, k, **kw).total


def zero_traffic(params: float, dp_size: int, stage: int,
                 elem_bytes: float = 2) -> dict[str, float]:
    """Bytes each rank sends per step, by collective, over N = dp_size
    data-parallel ranks (ring algorithms, exact (N-1)/N factors). DP: all-reduce
    of the gradients, 2Ψ; ZeRO-1/2: reduce-scatter of the gradients + all-gather
    of the updated parameters, also 2Ψ; ZeRO-3: an all-gather of the parameters
    in forward and again in backward + the reduce-scatter, 3Ψ (Rajbhandari et
    al. 2020, sec. 7.2-7.3)."""
    psi, n = check_params(params), check_world_size(dp_size)
    stage = _check_stage(stage)
    share = (n - 1) / n * psi * elem_bytes
    if stage == 0:
        return {"all_reduce (gradients)": 2 * share}
    if stage in (1, 2):
        return {"reduce_scatter (gradients)": share,
                "all_gather (parameters)": share}
    return {"all_gather (parameters, forward)": share,
            "all_gather (parameters, backward)": share,
            "reduce_scatter (gradients)": share}
