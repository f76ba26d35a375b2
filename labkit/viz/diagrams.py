"""Diagrams of data moving: a collective's before and after, a ring step by step,
and the bytes each rank wrote in each collective.

Every cell is a Rectangle with a gid ("before:r:i", "after:r:i", a sum's stripe
"after:r:i:from:q"), so a test can read back what a diagram says."""

from __future__ import annotations

from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from labkit.units import MiB
from labkit.viz.style import (
    MIN_FONT_PT,
    PAGE_WIDTH_IN,
    by_rank,
    figure_and_axes,
    fits_beside,
    place_legend,
    records_of,
)

RANK_COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860",
               "#DA8BC3", "#8C8C8C", "#CCB974", "#64B5CD"]
UNDEFINED = "#EEEEEE"  # a rank the collective leaves without a result
SUM_FACE = "#FFFFFF"  # a sum: white, with one stripe per rank it adds up
CELL_IN = 0.5  # inches per cell: every collective diagram has the same scale
FONT = 10


def rank_color(r: int) -> str:
    return RANK_COLORS[r % len(RANK_COLORS)]


def _cell(ax, x, y, text, color, *, edge="white", lw=1.0, alpha=1.0, gid=None,
          fontsize=FONT):
    # alpha on the face only: an outline stays as dark on a light cell
    ax.add_patch(Rectangle((x, y), 1, 1, facecolor=to_rgba(color, alpha),
                           edgecolor=edge, lw=lw, gid=gid))
    ax.text(x + 0.5, y + 0.5, text, ha="center", va="center", fontsize=fontsize)


def _fmt_value(v) -> str:
    return f"{v:g}" if isinstance(v, (int, float)) else str(v)


def sources(op: str, before, after, root: int = 0) -> list:
    """For each rank, for each cell of its result, the set of ranks the value came
    from (several: a sum); None for a rank left without a result."""
    n = len(before)
    everyone = frozenset(range(n))
    out = []
    for r in range(n):
        res = after[r]
        if res is None:
            out.append(None)
            continue
        k = len(res)
        if op in ("reduce", "all_reduce", "reduce_scatter"):
            cells = [everyone] * k
        elif op in ("broadcast", "scatter"):
            cells = [frozenset([root])] * k
        elif op in ("all_gather", "gather"):  # rank order: cell i from rank i // k
            cells = [frozenset([i // len(before[0])]) for i in range(k)]
        elif op == "all_to_all":  # chunk i of the result came from rank i
            cells = [frozenset([i * n // k]) for i in range(k)]
        else:
            raise ValueError(f"unknown collective {op!r}")
        out.append(cells)
    return out


def _after_cell(ax, x, y, v, srcs, gid):
    if len(srcs) == 1:
        (q,) = srcs
        _cell(ax, x, y, _fmt_value(v), rank_color(q), alpha=0.45, gid=gid)
        return
    _cell(ax, x, y, _fmt_value(v), SUM_FACE, edge="#BBBBBB", gid=gid)
    w = 1.0 / len(srcs)
    for j, q in enumerate(sorted(srcs)):  # one stripe per rank in the sum
        ax.add_patch(Rectangle((x + j * w, y + 0.04), w, 0.2, facecolor=rank_color(q),
                               edgecolor="none", gid=f"{gid}:from:{q}"))


def collective_diagram(op: str, before, after, *, root: int = 0, ax=None) -> Figure:
    """Each rank's array before and after `op` (None: no result on that rank).

    Every cell is coloured by the rank its value came from, before and after; a
    sum is white with one stripe per rank it adds up. Drawn on its own figure, a
    cell is CELL_IN inches for every op (the legend below gets what room it needs,
    never at the cells' expense)."""
    n = len(before)
    width_b = max(len(b) for b in before)
    width_a = max((len(a) for a in after if a is not None), default=1)
    gap, left, right, top = 2, 2.2, 0.3, 1.7  # in cells
    width_u = left + width_b + gap + width_a + right
    own = ax is None
    if own:
        from labkit.viz.style import LabFigure

        fig = LabFigure(figsize=(CELL_IN * width_u, CELL_IN * (n + top + 2)))
        ax = fig.add_axes((0, 0, 1, 1))
    fig = ax.figure
    srcs = sources(op, before, after, root)
    for r in range(n):
        y = n - 1 - r
        for i, v in enumerate(before[r]):
            _cell(ax, i, y, _fmt_value(v), rank_color(r), alpha=0.45,
                  gid=f"before:{r}:{i}")
        ax.text(-0.3, y + 0.5, f"rank {r}", ha="right", va="center", fontsize=FONT)
        x0 = width_b + gap
        if after[r] is None:
            _cell(ax, x0, y, "–", UNDEFINED, gid=f"after:{r}:none")
            continue
        for i, v in enumerate(after[r]):
            _after_cell(ax, x0 + i, y, v, srcs[r][i], f"after:{r}:{i}")
    ax.annotate("", xy=(width_b + gap - 0.2, n / 2), xytext=(width_b + 0.2, n / 2),
                arrowprops={"arrowstyle": "->", "lw": 1.5})
    ax.text(width_b / 2, n + 0.2, "before", ha="center", fontsize=FONT + 1)
    ax.text(width_b + gap + width_a / 2, n + 0.2, "after", ha="center",
            fontsize=FONT + 1)
    title = ax.text(width_u / 2 - left, n + 0.9, op.replace("_", "-"), ha="center",
                    fontsize=FONT + 3)
    title.set_gid("title")
    ax.set_aspect("equal")
    ax.axis("off")
    handles = [Patch(facecolor=rank_color(q), alpha=0.45, label=f"from rank {q}")
               for q in range(n)]
    if any(len(c) > 1 for cells in srcs if cells for c in cells):
        handles.append(Patch(facecolor=SUM_FACE, edgecolor="#BBBBBB",
                             label="a sum (stripes: its ranks)"))
    if any(cells is None for cells in srcs):
        handles.append(Patch(facecolor=UNDEFINED, label="– no result"))
    if not own:
        ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0),
                  ncol=(len(handles) + 1) // 2, fontsize=FONT - 1, frameon=False)
        return fig
    _legend_below(fig, ax, handles, width_u, left, right, n + top)
    return fig


def _legend_below(fig, ax, handles, width_u, left, right, above):
    """Put the legend under the cells in as many columns as fit the figure's width,
    then size the figure to hold it: one cell stays CELL_IN inches."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(fig).get_renderer()
    for ncol in range(len(handles), 0, -1):
        leg = ax.legend(handles=handles, loc="upper center", ncol=ncol,
                        bbox_to_anchor=(width_u / 2 - left, -0.25),
                        bbox_transform=ax.transData, fontsize=FONT - 1, frameon=False)
        box = leg.get_window_extent(renderer)
        if box.width <= fig.dpi * CELL_IN * (width_u - 0.2) or ncol == 1:
            break
    below = box.height / (fig.dpi * CELL_IN) + 0.5  # in cells
    fig.set_size_inches(CELL_IN * width_u, CELL_IN * (above + below))
    ax.set_xlim(-left, width_u - left)
    ax.set_ylim(-below, above - 0.2)


# ------------------------------------------------------------ ring all-reduce

RING_COLOR = "#4C72B0"


def _shade(k: int, n: int) -> float:
    return 0.15 + 0.85 * k / n


def ring_legend(world_size: int) -> list[Patch]:
    """What the shades and outlines of a ring grid of world_size ranks mean: one
    shade per number of ranks summed (up to 5 ranks; beyond, a few of them)."""
    n = world_size
    counts = range(1, n + 1) if n <= 5 else sorted({1, 2, n // 2, n - 1, n})
    handles = []
    for k in counts:
        label = ("one rank's value" if k == 1 else f"Σ: all {n} ranks" if k == n
                 else f"a sum of {k} ranks")
        handles.append(Patch(facecolor=RING_COLOR, alpha=_shade(k, n), label=label))
    handles.append(Patch(facecolor="white", edgecolor="black", lw=2.0,
                         label="sent in this step"))
    return handles


def _ring_cells(ax, step, x0: float, y0: float, gid: str, fontsize: int) -> None:
    """One state's n x n chunk grid with its lower-left corner at (x0, y0)."""
    n = len(step.holds)
    sent = {(src, c) for src, _, c in step.sends}
    for r in range(n):
        for c in range(n):
            members = sorted(step.holds[r][c])
            label = "Σ" if len(members) == n else "+".join(map(str, members))
            if n > 6 and len(members) not in (1, n):
                label = str(len(members))
            sending = (r, c) in sent
            _cell(ax, x0 + c, y0 + n - 1 - r, label, RING_COLOR,
                  alpha=_shade(len(members), n), gid=f"{gid}{r}:{c}",
                  edge="black" if sending else "white", lw=2.0 if sending else 1.0,
                  fontsize=fontsize if len(label) <= 3 else fontsize - 1)


def ring_grid(step, *, ax=None, legend: bool = True) -> Figure:
    """One state of ring all-reduce (a labkit.collectives.RingStep): rank rows x
    chunk columns; a cell lists the ranks whose values it sums (for n > 6, how
    many), darker = more. Outlined cells are the ones sent during this step."""
    n = len(step.holds)
    scale = min(1.0, (PAGE_WIDTH_IN - 1.6) / (0.75 * n))  # < 1 from 9 ranks on
    fig, ax = figure_and_axes(ax, (0.75 * n * scale + 1.6, 0.6 * n * scale + 2.0))
    size = FONT if n <= 6 else MIN_FONT_PT + 1  # chunk numbers: a point less
    _ring_cells(ax, step, 0, 0, "ring:", size)
    for r in range(n):
        ax.text(-0.15, n - 0.5 - r, f"rank {r}", ha="right", va="center",
                fontsize=size)
    for c in range(n):
        ax.text(c + 0.5, n + 0.12, f"chunk {c}" if n <= 6 else str(c), ha="center",
                fontsize=size - 1)
    ax.set_xlim(-1.5, n + 0.1)
    ax.set_ylim(-0.1, n + 0.6)
    ax.set_aspect("equal")
    ax.axis("off")
    title = "start: each rank holds only its own data" if step.phase == "start" else \
        f"{step.phase} step {step.step} of {n - 1}"
    ax.set_title(title, fontsize=FONT + 1)
    if legend:
        ax.legend(handles=ring_legend(n), loc="upper center", ncol=2,
                  bbox_to_anchor=(0.5, 0.0), fontsize=FONT - 1, frameon=False,
                  title=None if n <= 6 else "a number: how many ranks a cell sums",
                  title_fontsize=FONT - 1)
    return fig


def _short_title(step, n: int) -> str:
    if step.phase == "start":
        return "start"
    return f"{step.phase} {step.step}/{n - 1}"


def ring_panels(steps, *, ncols: int = 4, width_in: float = 10.0) -> Figure:
    """Several states of ring all-reduce side by side, on one scale (one axes):
    rank labels on the left of each row, chunk numbers above each grid, and the
    key in the next free slot."""
    from labkit.viz.style import LabFigure

    n = len(steps[0].holds)
    gap, left, head = 0.8, 1.7, 1.3  # in cells
    rows = -(-(len(steps) + 1) // ncols)
    width_u = left + ncols * n + (ncols - 1) * gap
    unit = width_in / width_u
    fig = LabFigure(figsize=(width_in, unit * rows * (n + head) + 0.5),
                    layout="constrained")
    ax = fig.add_subplot()
    for k, st in enumerate(steps):
        row, col = divmod(k, ncols)
        x0, y0 = left + col * (n + gap), -row * (n + head)
        _ring_cells(ax, st, x0, y0, f"ring:{k}:", FONT)
        for c in range(n):
            ax.text(x0 + c + 0.5, y0 + n + 0.1, str(c), ha="center", va="bottom",
                    fontsize=FONT - 1)
        if col == 0:
            for r in range(n):
                ax.text(x0 - 0.15, y0 + n - 0.5 - r, f"rank {r}", ha="right",
                        va="center", fontsize=FONT)
            ax.text(x0 - 0.15, y0 + n + 0.1, "chunk", ha="right", va="bottom",
                    fontsize=FONT - 1)
        ax.text(x0 + n / 2, y0 + n + 0.55, _short_title(st, n), ha="center",
                va="bottom", fontsize=FONT + 1)
    row, col = divmod(len(steps), ncols)
    x0, y0 = left + col * (n + gap), -row * (n + head)
    ax.legend(handles=ring_legend(n), loc="center",
              bbox_to_anchor=(x0 + n / 2, y0 + n / 2), bbox_transform=ax.transData,
              fontsize=FONT - 1, frameon=False, title="a cell lists the ranks\n"
              "whose values it sums", title_fontsize=FONT - 1)
    ax.set_xlim(0, width_u)
    ax.set_ylim(-(rows - 1) * (n + head) - 0.1, n + head - 0.1)
    ax.set_aspect("equal")
    ax.axis("off")
    return fig


# ------------------------------------------------------------ bytes per collective


def traffic_by_collective(ledgers, *, ax=None, unit: float = MiB,
                          unit_name: str = "MiB",
                          title: str = "Bytes each rank wrote, per collective"
                          ) -> Figure:
    """One group of bars per collective, one bar per rank (coloured by rank): the
    bytes it wrote to its sockets. A black line across each group marks nccl-tests'
    bus bytes for that call, S × factor. ledgers: rank -> TrafficLedger."""
    ranks = {r: records_of(v) for r, v in by_rank(ledgers).items()}
    ops: list[str] = []
    for recs in ranks.values():
        ops += [rec.op for rec in recs if rec.op not in ops]
    natural = 1.8 + 1.0 * len(ops)  # the legend beside the bars
    beside = ax is not None or fits_beside(natural)
    fig, ax = figure_and_axes(ax, (min(natural, PAGE_WIDTH_IN), 3.8))
    n = len(ranks)
    width = 0.8 / max(1, n)
    for k, (r, recs) in enumerate(ranks.items()):
        heights = []
        for op in ops:
            wire = [rec.wire_bytes for rec in recs if rec.op == op]
            known = wire and all(w is not None for w in wire)
            heights.append(sum(wire) / unit if known else float("nan"))
        xs = [i - 0.4 + (k + 0.5) * width for i in range(len(ops))]
        ax.bar(xs, heights, width, color=rank_color(r), label=f"rank {r}")
    first = next(iter(ranks.values()), [])
    for i, op in enumerate(ops):
        bus = sum(rec.bus_bytes for rec in first if rec.op == op) / unit
        ax.hlines(bus, i - 0.45, i + 0.45, colors="black", lw=1.5,
                  label="bus bytes, S × factor" if i == 0 else None)
    ax.set_xticks(range(len(ops)), [op.replace("_", "-") for op in ops],
                  rotation=30, ha="right")
    ax.set_ylabel(f"{unit_name} written")
    ax.set_title(title, wrap=True)
    place_legend(ax, beside=beside)
    return fig
