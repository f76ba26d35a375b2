"""Plain sentences on why a layout costs what it costs (for the chooser)."""

from __future__ import annotations

from labkit.conventions import ACTIVATION
from labkit.theory.layout.breakdown import Estimate
from labkit.theory.layout.cluster import ClusterSpec
from labkit.theory.layout.layout import group_nodes
from labkit.units import percent, si_bytes

# si_bytes writes kB, MB or GB: a small model's bytes never read 0.0 GB
_WHERE = {True: "inside a node", False: "across nodes"}


def reasons(est: Estimate, cluster: ClusterSpec) -> list[str]:
    """Plain sentences on why this layout costs what it costs."""
    layout, out = est.layout, []
    link = {True: f"NVLink ({cluster.intra_bw / 1e9:,.0f} GB/s)",
            False: f"the network ({cluster.inter_bw / 1e9:,.0f} GB/s)"}
    if layout.tp > 1:
        inside = est.in_node["tp"]
        stays = "stays inside a node" if inside else "spans nodes"
        calls = 6 if layout.recompute == "full" else 4
        no_sp = "" if layout.sequence_parallel else " (no sequence parallelism)"
        out.append(f"TP {layout.tp}{no_sp} {stays}: its {calls} all-reduces per "
                   f"layer ({si_bytes(est.traffic['tp'])} per step) run on "
                   f"{link[inside]}")
    if layout.cp > 1:
        inside = est.in_node["cp"]
        out.append(f"CP {layout.cp} splits each sequence {_WHERE[inside]}; gathering "
                   f"K and V sends {si_bytes(est.traffic['cp'])} per step on "
                   f"{link[inside]}")
    if layout.ep > 1:
        inside = est.in_node["ep"]
        nodes = group_nodes(layout, cluster.gpus_per_node)["ep"]
        hidden = (", hidden under compute by DualPipe" if layout.dualpipe
                  and est.time["ep"] == 0 else "")
        out.append(f"EP {layout.ep} spans {nodes} node{'s' if nodes > 1 else ''}: "
                   f"its all-to-alls send {si_bytes(est.traffic['ep'])} per step on "
                   f"{link[inside]}{hidden}")
    if layout.pp > 1:
        bubble = est.time["bubble"] / est.step_time
        out.append(f"PP {layout.pp} runs {_WHERE[est.in_node['pp']]}: only "
                   f"{si_bytes(est.traffic['pp'])} of activations per step go point "
                   f"to point, at the cost of a {percent(bubble)} bubble "
                   f"({layout.schedule}, {layout.microbatches} micro-batches)")
    if layout.dp > 1:
        hidden = est.time["dp"] < 0.005
        zero = f"ZeRO-{layout.zero} " if layout.zero else ""
        out.append(f"{zero}DP {layout.dp} is outermost ({_WHERE[est.in_node['dp']]}): "
                   f"its {si_bytes(est.traffic['dp'])} of data-parallel traffic per "
                   f"step " + ("hides under the backward" if hidden else
                               f"leaves {est.time['dp']:.2f} s exposed"))
    out.append(f"its matrix products run at {1 / est.gemm_slowdown:.0%} of the "
               f"{cluster.flops / 1e12:,.0f} TFLOPS peak (roofline at this layout's "
               f"per-GPU shapes); the step reaches {percent(est.mfu)} MFU")
    verdict = "fits in" if est.fits else "does not fit in"
    out.append(f"{si_bytes(est.memory_total)} per GPU {verdict} "
               f"{si_bytes(est.gpu_memory)} (activations "
               f"{si_bytes(est.memory[ACTIVATION])}, recompute {layout.recompute})")
    return out
