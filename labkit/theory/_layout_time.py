"""When a layout's data-parallel bytes can go, and how long its pipeline idles."""

from __future__ import annotations

from typing import TYPE_CHECKING

from labkit.theory.pipeline import pipeline_bubble
from labkit.theory.zero import zero_traffic

if TYPE_CHECKING:
    from labkit.theory._layout_cost import Layout


def dp_phases_of(psi: float, n: int, stage: int, m: int,
                 dtype_bytes: int) -> dict[str, float]:
    """Bytes a device sends per step for data parallelism over n ranks, by when
    they can go (theory.zero_traffic's collectives, once per step or per
    micro-batch). DP and ZeRO-1 sum gradients over the m micro-batches locally and
    reduce once, at the "end", under the last micro-batch's backward only; ZeRO-1
    all-gathers the new weights at the "start" of the next step, under the first
    micro-batch's forward. ZeRO-2 keeps 1/n of the gradients, so it reduce-
    scatters every micro-batch under its "backward"; ZeRO-3 also all-gathers the
    weights for each micro-batch's forward and backward, prefetched: "stream"."""
    t = zero_traffic(psi, n, stage, dtype_bytes)
    out = dict.fromkeys(("end", "start", "backward", "stream"), 0.0)
    if stage == 0:
        out["end"] = t["all_reduce (gradients)"]
    elif stage == 1:
        out["end"] = t["reduce_scatter (gradients)"]
        out["start"] = t["all_gather (parameters)"]
    elif stage == 2:
        out["backward"] = m * t["reduce_scatter (gradients)"]
        out["start"] = t["all_gather (parameters)"]
    else:
        out["stream"] = m * sum(t.values())
    return out


def bubble_fraction(lay: Layout) -> float:
    """Idle time over busy time per step. 1F1B (p-1)/m, interleaved (p-1)/(v m)
    (theory.pipeline_bubble). DualPipe's idle is (p/2 - 1)(F&B + B - 3W)
    (DeepSeek-AI 2024, table 2); we take F = B = W and the overlapped F&B chunk
    as F + B + one F of slack, which leaves (p/2 - 1) F against m (F + B + W):
    (p/2 - 1) / (3m), an assumption of ours."""
    if lay.pp == 1:
        return 0.0
    if lay.dualpipe:
        return (lay.pp / 2 - 1) / (3 * lay.microbatches)
    return pipeline_bubble(lay.pp, lay.microbatches, lay.interleave).of_ideal
