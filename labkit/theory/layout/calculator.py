"""The layout calculator's `estimate()`: a parallel layout's memory, traffic and step
time per device, in closed form, and why.

Imports the layout modules before it and labkit.theory.models.

The pieces are the course's own closed forms (theory.zero, theory.activations,
theory.tensor_parallel, theory.collective_cost, theory.pipeline); this package
adds how a layout's degrees feed them, and a step time: matrix products by a
roofline, each collective by the α-β model, α from NCCL's own cost model.
"""

from __future__ import annotations

import dataclasses

from labkit.theory.layout.breakdown import Estimate
from labkit.theory.layout.cluster import ClusterSpec
from labkit.theory.layout.layout import DIMS, Layout, groups_in_node, step_shape
from labkit.theory.layout.memory import memory
from labkit.theory.layout.reasons import reasons
from labkit.theory.layout.roofline import compute_slowdown, model_time
from labkit.theory.layout.time import time
from labkit.theory.layout.traffic import traffic
from labkit.theory.models import ModelConfig


def estimate(model: ModelConfig, layout: Layout, cluster: ClusterSpec,
             global_batch_tokens: int, seq: int, dtype_bytes: int = 2) -> Estimate:
    """Memory (memory), traffic (traffic) and step time (time) per device of
    `layout` training `model` on `cluster`, `global_batch_tokens` per step in
    sequences of `seq`; ValueError where the layout cannot run (check_layout).
    Compute is the model's FLOPs at the peak x the roofline's slowdown for this
    layout's per-device matrix shapes (compute_slowdown)."""
    shape = step_shape(model, layout, cluster, global_batch_tokens, seq)
    at_peak = model_time(model, layout, cluster, shape)
    slowdown = compute_slowdown(model, shape.microbatch_tokens, seq, layout.tp,
                                layout.ep, cluster, layout.etp)
    sent = traffic(model, layout, cluster, shape, dtype_bytes)
    in_node = groups_in_node(layout, cluster.gpus_per_node)
    est = Estimate(layout, memory(model, layout, shape, dtype_bytes), sent,
                   time(model, layout, cluster, shape, sent, at_peak * slowdown,
                        dtype_bytes),
                   cluster.gpu_memory,
                   {dim: in_node[dim] for dim in DIMS if getattr(layout, dim) > 1},
                   model_time=at_peak, gemm_slowdown=slowdown)
    return dataclasses.replace(est, reasons=reasons(est, cluster))
