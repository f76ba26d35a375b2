"""Plain sentences on why a layout costs what it costs (for the chooser)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from labkit.units import percent, si_bytes

if TYPE_CHECKING:
    from labkit.theory._layout_cost import Cluster, Estimate
    from labkit.theory.models import ModelConfig


def _gb(x: float) -> str:
    return si_bytes(x)  # kB, MB or GB: a small model's bytes never read 0.0 GB


def reasons(model: ModelConfig, est: Estimate, cluster: Cluster) -> list[str]:
    """Plain sentences on why this layout costs what it costs."""
    lay, out = est.layout, []
    where = {True: "inside a node", False: "across nodes"}
    link = {True: f"NVLink ({cluster.intra_bw / 1e9:,.0f} GB/s)",
            False: f"the network ({cluster.inter_bw / 1e9:,.0f} GB/s)"}
    if lay.tp > 1:
        i = est.in_node["tp"]
        stays = "stays inside a node" if i else "spans nodes"
        calls = 6 if lay.recompute == "full" else 4
        sp = "" if lay.sequence_parallel else " (no sequence parallelism)"
        out.append(f"TP {lay.tp}{sp} {stays}: its {calls} all-reduces per layer "
                   f"({_gb(est.traffic['tp'])} per step) run on {link[i]}")
    if lay.cp > 1:
        i = est.in_node["cp"]
        out.append(f"CP {lay.cp} splits each sequence {where[i]}; gathering K and V "
                   f"sends {_gb(est.traffic['cp'])} per step on {link[i]}")
    if lay.ep > 1:
        i = est.in_node["ep"]
        nodes = max(1, lay.ep * lay.tp * lay.cp // cluster.gpus_per_node)
        hid = (", hidden under compute by DualPipe" if lay.dualpipe
               and est.time["ep"] == 0 else "")
        out.append(f"EP {lay.ep} spans {nodes} node{'s' if nodes > 1 else ''}: its "
                   f"all-to-alls send {_gb(est.traffic['ep'])} per step on "
                   f"{link[i]}{hid}")
    if lay.pp > 1:
        i = est.in_node["pp"]
        bub = est.time["bubble"] / est.step_time
        out.append(f"PP {lay.pp} runs {where[i]}: only {_gb(est.traffic['pp'])} of "
                   f"activations per step go point to point, at the cost of a "
                   f"{percent(bub)} bubble ({lay.schedule}, {lay.microbatches} "
                   f"micro-batches)")
    if lay.dp > 1:
        i = est.in_node["dp"]
        hidden = est.time["dp"] < 0.005
        z = f"ZeRO-{lay.zero} " if lay.zero else ""
        out.append(f"{z}DP {lay.dp} is outermost ({where[i]}): its "
                   f"{_gb(est.traffic['dp'])} of data-parallel traffic per step "
                   + ("hides under the backward" if hidden else
                      f"leaves {est.time['dp']:.2f} s exposed"))
    out.append(f"its matrix products run at {1 / est.gemm_slowdown:.0%} of the "
               f"{cluster.flops / 1e12:,.0f} TFLOPS peak (roofline at this layout's "
               f"per-GPU shapes); the step reaches {percent(est.mfu)} MFU")
    mem = est.memory_total
    verdict = "fits in" if est.fits else "does not fit in"
    out.append(f"{_gb(mem)} per GPU {verdict} {_gb(est.gpu_memory)} (activations "
               f"{_gb(est.memory['activations'])}, recompute {lay.recompute})")
    return out
