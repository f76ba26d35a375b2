"""Bytes one device of a layout holds, by category."""

from __future__ import annotations

from labkit.conventions import ACTIVATION, GRADIENT, OPTSTATE, PARAMETER
from labkit.theory.activations import activation_terms
from labkit.theory.layout.counts import params_per_device
from labkit.theory.layout.layout import Layout, StepShape
from labkit.theory.models import ModelConfig
from labkit.theory.zero import zero_breakdown


def activations_held(layout: Layout) -> float:
    """Micro-batches of one stage's activations the first stage holds at its
    peak. 1F1B: min(p, m) (chapter 10). Interleaved 1F1B with v chunks per
    stage: Megatron-LM's schedule (megatron/core/pipeline_parallel/schedules.py,
    forward_backward_pipelining_with_interleaving) runs 2(p-1) + (v-1)p chunk
    forwards before its first backward on the first stage, and one more before
    that backward, so v·p + p - 1 chunks of 1/v of the stage's layers are held:
    p + (p-1)/v micro-batches, p·(1 + (p-1)/(p v)) (Korthikanti et al. 2022,
    sec. 4.2.3, give this factor for the interleaved schedule); where m = p, or where
    that is more than all v·m chunks, every forward runs first and m are held.
    p = 16, v = 2: 23.5 where 1F1B holds 16; p = 4, v = 2: 5.5 (chapter 10
    measured it). DualPipe: p + 1 (DeepSeek-AI 2024, table 2)."""
    p, m, v = layout.pp, layout.microbatches, layout.interleave
    if p == 1:
        return 1
    if layout.dualpipe:
        return min(p + 1, m)
    if v == 1:
        return min(p, m)
    return m if m <= p else min(m, p + (p - 1) / v)


def memory(model: ModelConfig, layout: Layout, shape: StepShape,
           dtype_bytes: int = 2) -> dict[str, float]:
    """Bytes per device by memory category: Parameter, Gradient, Optstate, Activation.

    Mixed-precision Adam (2 + 2 + 12 bytes per parameter, theory.zero),
    parameters split over TP x PP (experts over expert TP x PP x EP), ZeRO over
    DP x CP (the experts' over their replicas, Layout.expert_replicas); DualPipe
    keeps two copies of the parameters.
    The busiest stage holds ceil(layers / PP) layers and activations_held(layout)
    micro-batches of activations (1F1B min(PP, m), interleaved PP + (PP-1)/v,
    DualPipe PP + 1; Korthikanti et al.'s GPT layer, with sequence parallelism
    when TP > 1 unless the layout turns it off, and FlashAttention, so no s x s
    scores; RMSNorm models (Llama 3, DeepSeek-V3) train without dropout, so no
    dropout masks; MLA and MoE change the constants, which this ignores)."""
    dense, experts = params_per_device(model, layout)
    replicas = layout.dp * layout.cp
    dense_states = zero_breakdown(dense, replicas, layout.zero,
                                  param_bytes=dtype_bytes, grad_bytes=dtype_bytes)
    expert_states = zero_breakdown(experts, layout.expert_replicas, layout.zero,
                                   param_bytes=dtype_bytes, grad_bytes=dtype_bytes)
    sequence_parallel = layout.tp > 1 and layout.sequence_parallel
    terms = activation_terms(shape.local_seq, shape.microbatch, model.hidden,
                             model.heads, layout.tp, sequence_parallel,
                             layout.recompute, attention_scores=False)
    per_layer = sum(size for term, size in terms.items()
                    if model.norm == "layernorm" or "dropout mask" not in term)
    copies = 2 if layout.dualpipe else 1
    return {PARAMETER: (dense_states.parameter + expert_states.parameter) * copies,
            GRADIENT: dense_states.gradient + expert_states.gradient,
            OPTSTATE: dense_states.optstate + expert_states.optstate,
            ACTIVATION: per_layer * shape.stage_layers * activations_held(layout)}
