"""What a model holds and computes, as a layout divides it: parameters per
device (dense and routed experts) and training FLOPs per token."""

from __future__ import annotations

from functools import lru_cache

from labkit.theory.layout.layout import Layout
from labkit.theory.models import ModelConfig, param_count


@lru_cache(maxsize=64)
def _param_count(model: ModelConfig, active: bool = False) -> int:
    return param_count(model, active=active)  # the chooser asks thousands of times


def expert_params(model: ModelConfig) -> int:
    """Routed experts' parameters (those expert parallelism shards)."""
    if not model.experts:
        return 0
    matrices = 3 if model.gated_mlp else 2
    return ((model.layers - model.dense_layers) * model.experts * matrices
            * model.hidden * model.expert_ffn)


def params_per_device(model: ModelConfig, layout: Layout) -> tuple[float, float]:
    """(dense, routed-expert) parameters one device holds before ZeRO: the dense
    split over TP x PP, the experts over expert TP x PP x EP (expert TP = TP
    unless the layout is folded)."""
    total, experts = _param_count(model), expert_params(model)
    dense = (total - experts) / (layout.tp * layout.pp)
    return dense, experts / (layout.etp * layout.pp * layout.ep)


def flops_per_token(model: ModelConfig, seq: int) -> float:
    """Training FLOPs per token: 6 per active parameter (forward 2, backward 4)
    plus the attention scores, 12·layers·hidden·seq (Narayanan et al. 2021, eq. 3,
    without its logit term, which 6N already counts)."""
    return 6 * _param_count(model, True) + 12 * model.layers * model.hidden * seq
