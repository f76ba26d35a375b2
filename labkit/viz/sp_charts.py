"""Charts of chapter 11: a transformer layer's activation memory by strategy
(Korthikanti et al.'s terms stacked, the memory ledger's measurement beside them),
and the steps of ring attention (which key/value chunk each rank holds)."""

from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle

from labkit.theory import TERM_GROUP
from labkit.units import MiB
from labkit.viz.style import (
    PAGE_WIDTH_IN,
    figure_and_axes,
    fits_beside,
    legend_beside_or_below,
    place_legend,
)

# groups of table 2's terms: what splits them, and their colours
GROUPS = {
    "sp": ("LayerNorm, dropout, inputs: 10sbh (split by SP only)", "#64B5CD"),
    "tp": ("inside attention and MLP: 24sbh (split by TP)", "#4C72B0"),
    "scores": ("attention scores: 5as²b (split by TP)", "#C44E52"),
    "input": ("layer input (full recomputation)", "#8172B3"),
}
EXTRA_COLOR = "#CCB974"
KIND_COLORS = {"full": "#55A868", "diagonal": "#A5D6A7", "skipped": "#FFFFFF"}
KIND_NAMES = {"full": "attends to the whole chunk",
              "diagonal": "own chunk, causal mask inside",
              "skipped": "skipped (keys after all its queries)"}


def activation_bars(terms, measured=None, extras=None, *, ax=None,
                    unit: float = MiB, unit_name: str = "MiB",
                    title: str = "Activation memory per layer, per rank") -> Figure:
    """One stacked bar per strategy: the formula's bytes by group of terms
    (theory.activations.TERM_GROUP), then each extra the formula leaves out (in
    EXTRA_COLOR, hatched), and the measured bytes as a black diamond.

    terms: strategy -> {term: bytes} (theory.activations.activation_terms);
    measured: strategy -> bytes; extras: strategy -> {label: bytes}. Each bar
    segment has gid "strategy/group" (or "strategy/extra: label")."""
    terms = dict(terms)
    extras = extras or {}
    natural = 2.8 + 1.15 * len(terms)  # the legend beside the bars
    beside = ax is not None or fits_beside(natural)
    fig, ax = figure_and_axes(ax, (min(natural, PAGE_WIDTH_IN), 4.0))
    used = [g for g in GROUPS if any(TERM_GROUP.get(k, "sp") == g for t in
                                     terms.values() for k in t)]
    labels = sorted({lab for e in extras.values() for lab in e})
    xs = list(range(len(terms)))
    for x, (how, parts) in zip(xs, terms.items()):
        bottom = 0.0
        for g in used:
            h = sum(v for k, v in parts.items() if TERM_GROUP.get(k, "sp") == g)
            ax.bar(x, h / unit, bottom=bottom, width=0.6, color=GROUPS[g][1],
                   gid=f"{how}/{g}")
            bottom += h / unit
        for lab in labels:
            h = extras.get(how, {}).get(lab, 0) / unit
            ax.bar(x, h, bottom=bottom, width=0.6, color=EXTRA_COLOR, hatch="///",
                   edgecolor="#7F7F7F", lw=0.4, gid=f"{how}/extra: {lab}")
            bottom += h
        if measured is not None and measured.get(how) is not None:
            y = measured[how] / unit
            ax.plot([x], [y], marker="D", color="black", mfc="none", mew=1.2, ms=6,
                    ls="none", gid=f"{how}/measured")  # hollow: a thin bar shows
            ax.annotate(f"{y:.3g}", (x, max(y, bottom)), xytext=(0, 6), fontsize=8,
                        textcoords="offset points", ha="center", va="bottom")
    handles = [Patch(facecolor=GROUPS[g][1], label=GROUPS[g][0]) for g in used]
    handles += [Patch(facecolor=EXTRA_COLOR, hatch="///", edgecolor="#7F7F7F",
                      label=f"{lab} (not in the formula)") for lab in labels]
    if measured is not None:
        handles.append(Line2D([], [], marker="D", color="black", mfc="none", mew=1.2,
                              ls="none", label="measured (memory ledger)"))
    ax.set_xticks(xs, [_wrap(h) for h in terms], fontsize=8)
    ax.set_ylabel(unit_name)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.12)  # room for the numbers on top
    ax.set_title(title, wrap=True)
    place_legend(ax, handles, beside=beside)
    return fig


def _wrap(label: str, width: int = 14) -> str:
    words, lines = label.split(), [""]
    for w in words:
        if lines[-1] and len(lines[-1]) + 1 + len(w) > width:
            lines.append(w)
        else:
            lines[-1] = f"{lines[-1]} {w}".strip()
    return "\n".join(lines)


def ring_steps_chart(schedule, *, ax=None, title: str = "Ring attention, step by "
                     "step") -> Figure:
    """Who holds which key/value chunk at each step: a row per rank, a column per
    step, each cell labelled with the chunk and coloured by what the rank does
    with it (KIND_COLORS). schedule: ring_attention.ring_schedule(n, causal), or
    any Blocks with step, rank, chunk and kind. Each cell has gid "step/rank"."""
    blocks = list(schedule)
    steps = sorted({b.step for b in blocks})
    ranks = sorted({b.rank for b in blocks})
    own = ax is None
    fig, ax = figure_and_axes(ax, (2.6 + 1.0 * len(steps) + 2.6,
                                   0.9 + 0.6 * len(ranks)))
    for b in blocks:
        y = len(ranks) - 1 - ranks.index(b.rank)
        ax.add_patch(Rectangle((steps.index(b.step) + 0.05, y + 0.08), 0.9, 0.84,
                               facecolor=KIND_COLORS[b.kind], edgecolor="#7F7F7F",
                               lw=0.8, gid=f"{b.step}/{b.rank}"))
        ax.text(steps.index(b.step) + 0.5, y + 0.5, f"K,V {b.chunk}", ha="center",
                va="center", fontsize=8,
                color="#9E9E9E" if b.kind == "skipped" else "black")
    for i, r in enumerate(ranks):
        ax.text(-0.1, len(ranks) - 1 - i + 0.5, f"rank {r} (Q {r})", ha="right",
                va="center", fontsize=9)
    for j, s in enumerate(steps):
        ax.text(j + 0.5, len(ranks) + 0.05, f"step {s}", ha="center", va="bottom",
                fontsize=9)
    ax.set_xlim(-1.3, len(steps) + 0.05)
    ax.set_ylim(-0.05, len(ranks) + 0.45)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(title, fontsize=10)
    kinds = [k for k in KIND_COLORS if any(b.kind == k for b in blocks)]
    handles = [Patch(facecolor=KIND_COLORS[k], edgecolor="#7F7F7F",
                     label=KIND_NAMES[k]) for k in kinds]
    if own:  # below the grid if beside it the figure is too wide
        legend_beside_or_below(ax, handles, width_below=2.6 + 1.0 * len(steps))
    else:
        ax.legend(handles=handles, fontsize="small", loc="upper left",
                  bbox_to_anchor=(1.0, 1.0))
    return fig
