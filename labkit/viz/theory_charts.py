"""Charts of the closed forms: ZeRO's memory per device, activations against
sequence length, a placement's cost, FLOPs per token by MFU convention."""

from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from labkit.conventions import MODEL_STATES, STATE_LETTERS
from labkit.viz.style import (
    CATEGORY_COLORS,
    PAGE_WIDTH_IN,
    figure_and_axes,
    fits_beside,
    place_legend,
)


def zero_bars(breakdowns, *, ax=None, unit: float = 1e9, unit_name: str = "GB",
              highlight: str | None = None, capacity: float | None = None,
              title: str = "Model states per device") -> Figure:
    """Stacked bars (Parameter, Gradient, Optstate) per label, as in the ZeRO
    paper's figure 1. breakdowns: label -> labkit.theory.ZeroMemory (or any object
    with parameter, gradient and optstate fields). capacity: a device's memory,
    drawn as a line where it is within reach of the bars; far above them the
    legend says so instead, so that the y-axis always scales to the bars."""
    labels = list(breakdowns)
    natural = 1.5 + 1.3 * len(labels)  # the legend beside the bars
    beside = ax is not None or fits_beside(natural)
    fig, ax = figure_and_axes(ax, (min(natural, PAGE_WIDTH_IN), 3.8))
    bottom = [0.0] * len(labels)
    for part in MODEL_STATES:
        heights = [getattr(breakdowns[k], part.lower()) / unit for k in labels]
        ax.bar(range(len(labels)), heights, bottom=bottom, label=part, width=0.6,
               color=CATEGORY_COLORS[part])
        bottom = [b + h for b, h in zip(bottom, heights)]
    for i, (label, total) in enumerate(zip(labels, bottom)):
        ax.text(i, total, f"{total:,.1f}" if total >= 1 else f"{total:.2g}",
                ha="center", va="bottom", fontsize=9,
                fontweight="bold" if label == highlight else "normal")
    top = max(bottom, default=0.0) or 1.0
    handles, names = ax.get_legend_handles_labels()
    if capacity:
        cap = capacity / unit
        if cap <= 1.5 * top:
            handles.append(ax.axhline(cap, color="black", ls="--", lw=1))
            names.append(f"device memory {cap:,.0f} {unit_name}")
            top = max(top, cap)
        else:  # a line at 80 GB would squash 2 GB bars into the floor
            handles.append(Patch(color="none"))
            names.append(f"device memory {cap:,.0f} {unit_name}:\nabove the chart,"
                         "\nevery bar fits")  # three short lines: a narrow legend
    ax.set_ylim(0, 1.15 * top)
    ax.set_xticks(range(len(labels)), labels)
    if highlight in labels:
        ax.get_xticklabels()[labels.index(highlight)].set_fontweight("bold")
    ax.set_ylabel(unit_name)
    ax.set_title(title, wrap=True)
    place_legend(ax, handles, names, beside=beside)
    return fig


def activation_chart(config, seqs, *, batch: int = 1, ax=None,
                     capacity: float | None = None, unit: float = 1e9,
                     unit_name: str = "GB") -> Figure:
    """Activation bytes of a whole model (all layers) against sequence length, from
    Korthikanti et al.'s per-layer count (labkit.theory.activation_memory): with
    the s x s attention scores stored, without them (FlashAttention, or selective
    recomputation), and with full recomputation (each layer's input only). Log-log,
    so a line's slope is its power of s: 2 for the scores, 1 for the rest."""
    from labkit import theory

    c = theory.MODELS[config] if isinstance(config, str) else config
    seqs = list(seqs)
    fig, ax = figure_and_axes(ax, (6.4, 3.8))
    curves = (("attention scores stored", {}, "#C44E52", "-"),
              ("no scores (FlashAttention)", {"attention_scores": False},
               "#4C72B0", "-"),
              ("full recomputation", {"recompute": "full"}, "#55A868", "--"))
    for label, kw, color, ls in curves:
        ys = [c.layers * theory.activation_memory(s, batch, c.hidden, c.heads, **kw)
              / unit for s in seqs]
        ax.plot(seqs, ys, ls, marker="o", ms=3, color=color, label=label)
    if capacity:
        ax.axhline(capacity / unit, color="black", ls=":", lw=1,
                   label=f"device memory {capacity / unit:,.0f} {unit_name}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length s (tokens)")
    ax.set_ylabel(f"{unit_name}, all {c.layers} layers, batch {batch}")
    ax.set_title(f"{c.name}: activations against sequence length (estimate)",
                 fontsize=10)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def placement_bars(cost, *, ax=None, unit: float = 1e9, unit_name: str = "GB",
                   title: str = "Per device: kept between steps vs at the peak"
                   ) -> Figure:
    """Persistent and peak bytes per training state (labkit.theory.PlacementCost);
    a state of no bytes in either bar is left out of the legend."""
    fig, ax = figure_and_axes(ax, (5.5, 3.6))
    totals = [0.0, 0.0]  # kept, at the peak
    for state in "POGA":  # a state with no bytes in either bar: no colour, no name
        h = [cost.persistent[state] / unit, cost.peak[state] / unit]
        if not any(h):
            continue
        ax.bar([0, 1], h, bottom=totals, color=CATEGORY_COLORS[STATE_LETTERS[state]],
               width=0.55, label=f"{state}: {STATE_LETTERS[state]}")
        totals = [b + v for b, v in zip(totals, h)]
    for x, total in enumerate(totals):
        ax.text(x, total, f"{total:,.2f}", ha="center", va="bottom", fontsize=9)
    # room above the taller bar for its total: autoscaling counts bars, not text
    ax.set_ylim(0, 1.15 * (max(totals) or 1.0))
    ax.set_xticks([0, 1], ["kept (persistent)", "at the peak"])
    ax.set_ylabel(unit_name)
    ax.set_title(title, fontsize=10)
    if ax.containers:
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def flops_by_length(seqs, counts: dict, *, baseline: str | None = None, ax=None,
                    title: str = "Training FLOPs per token, by whose count"
                    ) -> Figure:
    """A line per convention against sequence length (log scale): counts maps
    a convention's name to its FLOPs per token at each of `seqs`; drawn over
    `baseline`'s where given (the lines are then ratios). Each line's gid is
    "line:<name>"."""
    fig, ax = figure_and_axes(ax, (6.5, 3.4))
    base = counts[baseline] if baseline is not None else [1.0] * len(seqs)
    for name, flops in counts.items():
        ax.plot(seqs, [f / b for f, b in zip(flops, base)], marker="o", lw=1.6,
                label=name, gid=f"line:{name}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(seqs), [f"{s // 1024}K" if s >= 1024 else str(s)
                               for s in seqs])
    ax.minorticks_off()
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel(f"FLOPs per token / {baseline}'s" if baseline
                  else "FLOPs per token")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig
