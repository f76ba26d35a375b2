"""Charts of ZeRO: who holds what (the steward grid: ranks x layers, one strip per
training state), and bytes per rank grouped by stage (memory or traffic)."""

from __future__ import annotations

import textwrap

from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle

from labkit.units import MiB
from labkit.viz.style import (
    CATEGORY_COLORS,
    MIN_FONT_PT,
    OP_COLORS,
    PAGE_WIDTH_IN,
    LabFigure,
    by_rank,
    figure_and_axes,
    fits_beside,
    legend_beside_or_below,
    place_legend,
)

# The notes' five states of mixed-precision Adam (ZeRO paper, sec. 3.1): A and E
# are what the model computes with, B, C, D what the optimizer keeps (K = 12).
STATE_COLORS = {"A": CATEGORY_COLORS["Parameter"], "B": "#1B5E20", "C": "#55A868",
                "D": "#A5D6A7", "E": CATEGORY_COLORS["Gradient"]}
STATE_NAMES = {"A": "A: bf16 weights (Parameter)",
               "B": "B: fp32 master weights (Optstate)",
               "C": "C: Adam's m (Optstate)", "D": "D: Adam's v (Optstate)",
               "E": "E: bf16 gradients (Gradient)"}
_EMPTY = "#FFFFFF"
_EDGE = "#BBBBBB"


def _ink(color: str) -> str:
    """Black or white text, whichever reads on `color` (#RRGGBB)."""
    r, g, b = (int(color[i:i + 2], 16) for i in (1, 3, 5))
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 140 else "white"


def steward_grid(holds, *, states=None, names=None, ax=None, title: str = "",
                 rank_label: str = "rank {}", legend: bool = True) -> Figure:
    """Who holds what: one row per rank, one column per layer, and in each cell one
    strip per state, filled to the fraction of that layer's state the rank holds
    (empty: none of it).

    holds: rank -> {layer: {state: fraction 0..1}} (a dict, or a list by rank).
    states: the strips, in order (default: every state met, A-E first).
    names: state -> legend label (default STATE_NAMES). Each strip rectangle has
    gid "rank/layer/state", so a test can find it."""
    ranks = by_rank(holds)
    layers = list(dict.fromkeys(lay for r in ranks.values() for lay in r))
    met = {s for r in ranks.values() for cell in r.values() for s in cell}
    states = list(states or [s for s in STATE_COLORS if s in met]
                  + sorted(met - set(STATE_COLORS)))
    names = {**STATE_NAMES, **(names or {})}
    own = ax is None
    grid = 1.6 + 1.25 * len(layers)
    fig, ax = figure_and_axes(ax, (grid + (2.6 if legend else 0),
                                   0.9 + 0.85 * len(ranks)))
    k, w = len(states), 0.9 / max(1, len(states))
    for row, (rank, cells) in enumerate(ranks.items()):
        y = len(ranks) - 1 - row
        for col, layer in enumerate(layers):
            held = cells.get(layer, {})
            for i, s in enumerate(states):
                x = col + 0.05 + i * w
                f = min(1.0, max(0.0, float(held.get(s, 0.0))))
                color = STATE_COLORS.get(s, "#8C8C8C")
                ax.add_patch(Rectangle((x, y + 0.05), w, 0.8, facecolor=_EMPTY,
                                       edgecolor=_EDGE, lw=0.6))
                bar = Rectangle((x, y + 0.05), w, 0.8 * f, facecolor=color,
                                edgecolor="none", gid=f"{rank}/{layer}/{s}")
                ax.add_patch(bar)
                ink = _ink(color) if f >= 0.5 else ("black" if f else _EDGE)
                ax.text(x + w / 2, y + 0.45, s, ha="center", va="center",
                        fontsize=8 if k <= 5 else MIN_FONT_PT, color=ink)
        ax.text(-0.1, y + 0.45, rank_label.format(rank), ha="right", va="center",
                fontsize=9)
    for col, layer in enumerate(layers):
        ax.text(col + 0.5, len(ranks) + 0.05, str(layer), ha="center", va="bottom",
                fontsize=9)
    ax.set_xlim(-1.0, len(layers) + 0.05)
    ax.set_ylim(-0.05, len(ranks) + 0.45)
    ax.set_aspect("equal")
    ax.axis("off")
    if title:
        ax.set_title(title, fontsize=10)
    if legend and own:  # below the grid if beside it the figure is too wide
        legend_beside_or_below(ax, _state_handles(states, names), width_below=grid,
                               title="strip filled = share held")
    elif legend:
        ax.legend(handles=_state_handles(states, names), fontsize="small",
                  loc="upper left", bbox_to_anchor=(1.0, 1.0),
                  title="strip filled = share held")
    return fig


def _state_handles(states, names) -> list:
    handles = [Patch(facecolor=STATE_COLORS.get(s, "#8C8C8C"), edgecolor=_EDGE,
                     label=names.get(s, s)) for s in states]
    return handles + [Patch(facecolor=_EMPTY, edgecolor=_EDGE, label="not held")]


def steward_grids(panels, *, states=None, names=None, rank_label: str = "rank {}",
                  ncols: int = 2, title: str = "") -> Figure:
    """Several steward grids, `ncols` to a row (e.g. one per ZeRO stage), one
    legend. panels: panel title -> holds, as for `steward_grid`."""
    panels = dict(panels)
    met = {s for h in panels.values() for r in by_rank(h).values()
           for cell in r.values() for s in cell}
    states = list(states or [s for s in STATE_COLORS if s in met]
                  + sorted(met - set(STATE_COLORS)))
    names = {**STATE_NAMES, **(names or {})}
    n_layers = max(len({lay for r in by_rank(h).values() for lay in r})
                   for h in panels.values())
    n_ranks = max(len(by_rank(h)) for h in panels.values())
    cols = max(1, min(ncols, len(panels)))
    rows = -(-len(panels) // cols)
    width = cols * (0.9 + 1.0 * n_layers) + 0.3
    scale = min(1.0, PAGE_WIDTH_IN / width)  # the grids keep their proportions
    fig = LabFigure(figsize=(width * scale,
                             rows * (0.7 + 0.8 * n_ranks) * scale + 1.0),
                    layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).reshape(-1)
    for ax, (label, holds) in zip(axes, panels.items()):
        steward_grid(holds, states=states, names=names, ax=ax, title=label,
                     rank_label=rank_label, legend=False)
    for ax in axes[len(panels):]:
        ax.axis("off")
    fig.legend(handles=_state_handles(states, names), loc="outside lower center",
               ncol=min(3, len(states) + 1), fontsize="small",
               title="in each cell, a strip per state, filled to the share held")
    if title:
        fig.suptitle(title)
    return fig


# ------------------------------------------------------------- bytes by stage


def stage_bars(per_stage, expected=None, *, colors=None, labels=None, ax=None,
               unit: float = MiB, unit_name: str = "MiB",
               expected_label: str = "expected", ylabel: str | None = None,
               totals: bool = False, title: str = "Per rank, by stage") -> Figure:
    """Stacked bars per rank, grouped by stage: what each rank holds (or sends).

    per_stage: stage label -> per rank {part: bytes} (a dict or a list by rank);
    parts are stacked in the order first met. expected: stage label -> bytes per
    rank (one number), drawn as a dashed line over that stage's bars. colors and
    labels: part -> colour / legend label (default: the ledgers' category and
    collective colours, the part's own name). totals: write each bar's total
    above it (so that a bar too small to see still says what it is)."""
    stages = {k: by_rank(v) for k, v in dict(per_stage).items()}
    palette = {**CATEGORY_COLORS, **OP_COLORS, **(colors or {})}
    labels = labels or {}
    parts = list(dict.fromkeys(p for ranks in stages.values()
                               for d in ranks.values() for p, b in d.items() if b))
    n_bars = sum(len(r) for r in stages.values())
    natural = 2.6 + 0.42 * n_bars + 0.4 * len(stages)  # the legend beside
    beside = ax is not None or fits_beside(natural)
    fig, ax = figure_and_axes(ax, (min(natural, PAGE_WIDTH_IN), 3.8))
    x, ticks, tick_labels, centres, tops = 0.0, [], [], [], []
    for label, ranks in stages.items():
        xs = [x + i for i in range(len(ranks))]
        bottom = [0.0] * len(xs)
        for part in parts:
            h = [ranks[r].get(part, 0) / unit for r in ranks]
            ax.bar(xs, h, bottom=bottom, width=0.75, color=palette.get(part),
                   label=labels.get(part, part) if label == next(iter(stages))
                   else None, gid=f"{label}/{part}")
            bottom = [b + v for b, v in zip(bottom, h)]
        for xi, top in zip(xs, bottom) if totals else ():
            ax.annotate(f"{top:.3g}", (xi, top), xytext=(0, 2.5),
                        fontsize=MIN_FONT_PT,
                        textcoords="offset points", ha="center", va="bottom")
        if expected is not None and expected.get(label) is not None:
            ax.hlines(expected[label] / unit, xs[0] - 0.45, xs[-1] + 0.45,
                      colors="black", linestyles="--", lw=1.2, gid=f"{label}/expected")
        tops += bottom
        ticks += xs
        tick_labels += [str(r) for r in ranks]
        centres.append((sum(xs) / len(xs), label))
        x = xs[-1] + 1.8
    handles, names = ax.get_legend_handles_labels()
    if expected is not None:
        handles.append(Line2D([], [], color="black", ls="--", lw=1.2))
        names.append(expected_label)
    # headroom over the tallest bar or line: autoscaling would stop on the top of
    # the tallest stack, where a part of zero height leaves a sticky edge
    lines = [expected[k] / unit for k in stages
             if expected is not None and expected.get(k) is not None]
    top = max(tops + lines, default=0.0) or 1.0
    ax.set_ylim(0, top * (1.15 if totals else 1.08))
    ax.set_xticks(ticks, tick_labels, fontsize=8)
    ax.set_xlabel("rank", fontsize=8, labelpad=1)
    # the stages' names go under the ranks and the "rank" label: an axis on the
    # bottom spine whose labels sit that many points lower, whatever the height
    tick = ax.xaxis.get_major_ticks()[0] if ticks else None
    below = (tick.get_tick_padding() + tick.get_pad() if tick else 7.0) \
        + 2 * 1.05 * 8 + 1 + 5  # two 8-pt lines (ranks, "rank"), labelpad, gap
    sec = ax.secondary_xaxis("bottom")
    # a stage's name wraps to about its group's width (a 10-pt character is
    # about 6 pt wide; 0.9 in of the figure go to the y axis)
    per_bar = (fig.get_figwidth() - 0.9 - (1.9 if beside else 0)) / max(x - 0.8, 1)
    sec.set_xticks([c for c, _ in centres],
                   [_wrap_label(lab, (len(stages[lab]) + 0.8) * per_bar * 72 / 6)
                    for c, lab in centres])
    sec.tick_params(length=0, pad=below)
    sec.spines["bottom"].set_visible(False)
    ax.set_ylabel(ylabel or unit_name)
    ax.set_title(title, wrap=True)
    place_legend(ax, handles, names, beside=beside)
    return fig


def _wrap_label(label: str, chars: float) -> str:
    """Each line of `label` wrapped at words to about `chars` characters."""
    width = max(8, int(chars))
    return "\n".join(textwrap.fill(line, width, break_long_words=False)
                     for line in str(label).split("\n"))

