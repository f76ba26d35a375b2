"""Charts: data in, matplotlib Figure out. Each takes an optional `ax`, draws only
on it, and never touches global state (rcParams, pyplot's current figure).

    memory_by_rank(per_rank_bytes, expected=...)   stacked bars by category
    traffic_by_rank(ledgers)                       wire bytes vs the bus-bytes model
    timeline(ledgers)                              one lane per rank (a timing)
    measured_vs_expected(rows)                     an HTML table with relative errors
"""

from __future__ import annotations

import html
import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from labkit.units import MiB

CATEGORY_COLORS = {
    "Parameter": "#4C72B0",
    "Buffer": "#64B5CD",
    "Gradient": "#DD8452",
    "Optstate": "#55A868",
    "Activation": "#C44E52",
    "Temp": "#8172B3",
    "Other": "#937860",
}
OP_COLORS = {
    "all_reduce": "#4C72B0",
    "all_gather": "#55A868",
    "reduce_scatter": "#DD8452",
    "broadcast": "#8172B3",
    "reduce": "#937860",
    "all_to_all": "#C44E52",
    "scatter": "#DA8BC3",
    "gather": "#8C8C8C",
    "send": "#CCB974",
    "recv": "#64B5CD",
    "barrier": "#333333",
}
COMPUTE_COLOR = "#D9D9D9"


class LabFigure(Figure):
    """A Figure that shows itself in a notebook without pyplot (no global state)."""

    def _repr_png_(self) -> bytes:
        buf = io.BytesIO()
        self.savefig(buf, format="png", dpi=100, bbox_inches="tight")
        return buf.getvalue()


def _axes(ax, figsize):
    if ax is not None:
        return ax.figure, ax
    fig = LabFigure(figsize=figsize, layout="constrained")
    return fig, fig.add_subplot()


def _per_rank(data) -> dict[int, object]:
    if isinstance(data, Mapping):
        return dict(sorted(data.items()))
    return dict(enumerate(data))


def _records(ledger) -> list:
    return list(getattr(ledger, "records", ledger))


# --------------------------------------------------------------------- memory


def memory_by_rank(per_rank, expected=None, *, ax=None, unit: float = MiB,
                   unit_name: str = "MiB", title: str = "Memory by rank") -> Figure:
    """Stacked bars of bytes by category, one bar per rank.

    per_rank: rank -> {category: bytes} (a dict, or a list indexed by rank; a
    MemoryLedger's `current` or `at_peak` is such a dict). expected: bytes per rank
    (one number for all, or one per rank), drawn as a line over each bar.
    """
    ranks = _per_rank(per_rank)
    ranks = {r: getattr(v, "current", v) for r, v in ranks.items()}
    fig, ax = _axes(ax, (1.2 + 0.9 * len(ranks), 3.6))
    cats = [c for c in CATEGORY_COLORS if any(v.get(c, 0) for v in ranks.values())]
    cats += sorted({c for v in ranks.values() for c in v} - set(CATEGORY_COLORS)
                   - {"Total"})
    xs = list(range(len(ranks)))
    bottom = [0.0] * len(xs)
    for cat in cats:
        heights = [ranks[r].get(cat, 0) / unit for r in ranks]
        ax.bar(xs, heights, bottom=bottom, label=cat, width=0.6,
               color=CATEGORY_COLORS.get(cat))
        bottom = [b + h for b, h in zip(bottom, heights)]
    if expected is not None:
        exp = _per_rank(expected) if isinstance(expected, (Mapping, Sequence)) else {
            r: expected for r in ranks}
        for x, r in zip(xs, ranks):
            if exp.get(r) is not None:
                ax.hlines(exp[r] / unit, x - 0.4, x + 0.4, colors="black",
                          linestyles="--", label="expected" if x == 0 else None)
    ax.set_xticks(xs, [f"rank {r}" for r in ranks])
    ax.set_ylabel(unit_name)
    ax.set_title(title)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


# --------------------------------------------------------------------- traffic


def traffic_by_rank(ledgers, *, ax=None, unit: float = MiB, unit_name: str = "MiB",
                    title: str = "Bytes sent by rank, per collective") -> Figure:
    """Per rank and op: bytes measured on the wire (solid) next to the bus-bytes
    model (hatched). ledgers: rank -> TrafficLedger or list of records."""
    ranks = {r: _records(v) for r, v in _per_rank(ledgers).items()}
    ops = sorted({rec.op for recs in ranks.values() for rec in recs},
                 key=lambda o: list(OP_COLORS).index(o) if o in OP_COLORS else 99)
    fig, ax = _axes(ax, (1.5 + 1.2 * len(ranks), 3.6))
    width = 0.8 / max(1, 2 * len(ops))
    for i, op in enumerate(ops):
        wire, model = [], []
        for recs in ranks.values():
            sel = [rec for rec in recs if rec.op == op]
            known = all(rec.wire_bytes is not None for rec in sel)
            # unknown wire bytes (NCCL, point-to-point, no /proc) are not drawn as 0
            wire.append(sum(rec.wire_bytes for rec in sel) / unit if known
                        else float("nan"))
            model.append(sum(rec.bus_bytes for rec in sel) / unit)
        xs = [k - 0.4 + (2 * i + 0.5) * width for k in range(len(ranks))]
        color = OP_COLORS.get(op)
        unknown = any(w != w for w in wire)  # some rank could not measure it
        ax.bar(xs, wire, width, color=color,
               label=f"{op} (wire: not measured)" if unknown else f"{op} (wire)")
        ax.bar([x + width for x in xs], model, width, color=color, alpha=0.35,
               hatch="//", edgecolor=color, label=f"{op} (bus model)")
    ax.set_xticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.set_ylabel(unit_name)
    ax.set_title(title)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


# --------------------------------------------------------------------- timeline


def timeline(ledgers, *, ax=None, title: str = "Timeline (a timing: varies run to run)"
             ) -> Figure:
    """One lane per rank: compute (grey) and each collective (coloured) as spans,
    from the ledgers' own clocks (CLOCK_MONOTONIC, shared by the ranks)."""
    ranks = _per_rank(ledgers)
    starts = [getattr(v, "start", None) for v in ranks.values()]
    recs_all = [rec for v in ranks.values() for rec in _records(v)]
    origin = min([s for s in starts if s] + [rec.start for rec in recs_all] or [0.0])
    fig, ax = _axes(ax, (8, 0.8 + 0.6 * len(ranks)))
    seen = set()
    for lane, v in enumerate(ranks.values()):
        recs = sorted(_records(v), key=lambda rec: rec.start)
        t0 = getattr(v, "start", None) or (recs[0].start if recs else origin)
        t1 = getattr(v, "stop", None) or (recs[-1].start + recs[-1].seconds if recs
                                          else t0)
        # compute: the ledger's window minus the collectives
        cursor, gaps = t0, []
        for rec in recs:
            if rec.start > cursor:
                gaps.append((cursor - origin, rec.start - cursor))
            cursor = max(cursor, rec.start + rec.seconds)
        if t1 > cursor:
            gaps.append((cursor - origin, t1 - cursor))
        ax.broken_barh(gaps, (lane - 0.35, 0.7), facecolors=COMPUTE_COLOR)
        for rec in recs:
            ax.broken_barh([(rec.start - origin, rec.seconds)], (lane - 0.35, 0.7),
                           facecolors=OP_COLORS.get(rec.op, "black"))
            seen.add(rec.op)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first rank started recording")
    ax.set_title(title)
    handles = [Patch(color=COMPUTE_COLOR, label="compute")]
    handles += [Patch(color=OP_COLORS.get(op, "black"), label=op)
                for op in OP_COLORS if op in seen]
    ax.legend(handles=handles, fontsize="small", loc="upper left",
              bbox_to_anchor=(1.0, 1.0))
    return fig


# --------------------------------------------------------------------- table


@dataclass(frozen=True)
class Row:
    name: str
    measured: float
    expected: float

    @property
    def rel_error(self) -> float:
        if self.expected == 0:
            return 0.0 if self.measured == 0 else float("inf")
        return (self.measured - self.expected) / abs(self.expected)


class Comparison:
    """Measured vs expected, one row each, with the relative error. Renders as HTML."""

    def __init__(self, rows, *, unit: float = 1.0, unit_name: str = "bytes",
                 tolerance: float | None = None):
        self.rows = [r if isinstance(r, Row) else Row(*r) for r in rows]
        self.unit, self.unit_name, self.tolerance = unit, unit_name, tolerance

    @property
    def max_rel_error(self) -> float:
        return max((abs(r.rel_error) for r in self.rows), default=0.0)

    def _fmt(self, v: float) -> str:
        v = v / self.unit
        return f"{v:,.0f}" if float(v).is_integer() else f"{v:,.4g}"

    def _repr_html_(self) -> str:
        body = []
        for r in self.rows:
            ok = ""
            if self.tolerance is not None:
                ok = "✓" if abs(r.rel_error) <= self.tolerance else "✗"
            body.append(
                f"<tr><td style='text-align:left'>{html.escape(r.name)}</td>"
                f"<td>{self._fmt(r.measured)}</td><td>{self._fmt(r.expected)}</td>"
                f"<td>{r.rel_error:+.3%}</td><td>{ok}</td></tr>")
        tol = "" if self.tolerance is None else f" (tolerance {self.tolerance:.1%})"
        return (f"<table><caption>measured vs expected, in {self.unit_name}{tol}"
                "</caption><tr><th style='text-align:left'>what</th><th>measured</th>"
                "<th>expected</th><th>rel. error</th><th></th></tr>"
                + "".join(body) + "</table>")

    def __repr__(self) -> str:
        lines = [f"{'what':<40}{'measured':>16}{'expected':>16}{'rel.err':>10}"]
        for r in self.rows:
            lines.append(f"{r.name:<40}{self._fmt(r.measured):>16}"
                         f"{self._fmt(r.expected):>16}{r.rel_error:>+10.3%}")
        return "\n".join(lines)


def measured_vs_expected(rows, *, unit: float = 1.0, unit_name: str = "bytes",
                         tolerance: float | None = None) -> Comparison:
    """rows: (name, measured, expected) triples -> a table with relative errors."""
    return Comparison(rows, unit=unit, unit_name=unit_name, tolerance=tolerance)


# --------------------------------------------------------------------- diagrams


def _cell(ax, x, y, text, color, *, edge="white", lw=1.0, alpha=1.0):
    from matplotlib.patches import Rectangle

    ax.add_patch(Rectangle((x, y), 1, 1, facecolor=color, edgecolor=edge, lw=lw,
                           alpha=alpha))
    ax.text(x + 0.5, y + 0.5, text, ha="center", va="center", fontsize=9)


def _fmt_value(v) -> str:
    return f"{v:g}" if isinstance(v, (int, float)) else str(v)


RANK_COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860",
               "#DA8BC3", "#8C8C8C", "#CCB974", "#64B5CD"]


def collective_diagram(op: str, before, after, *, ax=None) -> Figure:
    """Each rank's array before and after `op` (None: undefined after it).

    Cells before are coloured by the rank that holds them; cells after are grey
    when they mix contributions, else coloured by where they came from."""
    n = len(before)
    width_b = max(len(b) for b in before)
    width_a = max((len(a) for a in after if a is not None), default=1)
    fig, ax = _axes(ax, (0.5 * (width_b + width_a) + 2.5, 0.5 * n + 1.0))
    gap = 2
    for r in range(n):
        y = n - 1 - r
        for i, v in enumerate(before[r]):
            color = RANK_COLORS[r % len(RANK_COLORS)]
            _cell(ax, i, y, _fmt_value(v), color, alpha=0.45)
        ax.text(-0.3, y + 0.5, f"rank {r}", ha="right", va="center", fontsize=9)
        out = after[r]
        x0 = width_b + gap
        if out is None:
            _cell(ax, x0, y, "–", "#EEEEEE")
            continue
        for i, v in enumerate(out):
            _cell(ax, x0 + i, y, _fmt_value(v), "#BBBBBB", alpha=0.6)
    ax.annotate("", xy=(width_b + gap - 0.2, n / 2), xytext=(width_b + 0.2, n / 2),
                arrowprops={"arrowstyle": "->", "lw": 1.5})
    ax.text(width_b / 2, n + 0.2, "before", ha="center", fontsize=10)
    ax.text(width_b + gap + width_a / 2, n + 0.2, "after", ha="center", fontsize=10)
    ax.set_xlim(-2.2, width_b + gap + width_a + 0.3)
    ax.set_ylim(-0.2, n + 0.8)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(op.replace("_", "-"), fontsize=12)
    return fig


def ring_grid(step, *, ax=None) -> Figure:
    """One state of ring all-reduce (a labkit.collectives.RingStep): rank rows x
    chunk columns; a cell lists the ranks whose values it sums, darker = more.
    Outlined cells are the ones sent during this step."""
    holds = step.holds
    n = len(holds)
    fig, ax = _axes(ax, (0.75 * n + 1.6, 0.6 * n + 1.2))
    sent = {(src, c) for src, _, c in step.sends}
    for r in range(n):
        y = n - 1 - r
        for c in range(n):
            members = sorted(holds[r][c])
            label = "Σ" if len(members) == n else "+".join(map(str, members))
            if n > 6 and len(members) not in (1, n):
                label = str(len(members))
            shade = 0.15 + 0.85 * len(members) / n
            sending = (r, c) in sent
            _cell(ax, c, y, label, "#4C72B0", alpha=shade, edge="black" if sending
                  else "white", lw=2.0 if sending else 1.0)
        ax.text(-0.3, y + 0.5, f"rank {r}", ha="right", va="center", fontsize=8)
    for c in range(n):
        ax.text(c + 0.5, n + 0.15, f"chunk {c}", ha="center", fontsize=7)
    ax.set_xlim(-1.6, n + 0.1)
    ax.set_ylim(-0.1, n + 0.6)
    ax.set_aspect("equal")
    ax.axis("off")
    total = n - 1
    title = "start: each rank holds only its own data" if step.phase == "start" else \
        f"{step.phase} step {step.step} of {total}"
    ax.set_title(title, fontsize=10)
    return fig


def bandwidth(points, fits=None, *, ax=None, metric: str = "busbw",
              title: str = "Bus bandwidth by message size (a timing)") -> Figure:
    """busbw (or algbw) against message size, one line per op (labkit.bandwidth
    points); `fits` maps op -> labkit.theory.AlphaBeta, drawn dashed."""
    fig, ax = _axes(ax, (7, 4))
    ops = list(dict.fromkeys(p.op for p in points))
    for op in ops:
        pts = sorted((p for p in points if p.op == op), key=lambda p: p.size)
        color = OP_COLORS.get(op, OP_COLORS["all_reduce"] if "ring" in op else None)
        style = "--o" if op == "ring_all_reduce" else "-o"
        ax.plot([p.size for p in pts], [getattr(p, metric) / 1e9 for p in pts], style,
                color=color, label=op.replace("_", "-"), ms=3,
                mfc="white" if op == "ring_all_reduce" else color)
        if fits and op in fits:
            from labkit.theory import bus_factor

            fit = fits[op]
            xs = [p.size for p in pts]
            ys = [s / fit.time(s) * (bus_factor(fit.op, fit.n) if metric == "busbw"
                                     else 1.0) / 1e9 for s in xs]
            ax.plot(xs, ys, ":", color=color, lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size S (bytes)")
    ax.set_ylabel(f"{metric} (GB/s, 1 GB = 1e9 B)")
    ax.set_title(title)
    ax.legend(fontsize="small")
    return fig


def hierarchy(levels, *, ax=None, title: str = "Bandwidth by level (published figures)"
              ) -> Figure:
    """Horizontal bars of bandwidth (log scale) for labkit.hardware Levels; levels
    with no published figure are listed, not drawn."""
    levels = list(levels)
    fig, ax = _axes(ax, (8, 0.45 * len(levels) + 1.2))
    ys = list(range(len(levels)))[::-1]
    for y, lv in zip(ys, levels):
        if lv.bandwidth:
            ax.barh(y, lv.bandwidth / 1e9, color="#4C72B0")
            ax.text(lv.bandwidth / 1e9 * 1.1, y, f"{lv.bandwidth / 1e9:,.0f} GB/s",
                    va="center", fontsize=8)
        else:
            ax.text(1.1, y, "no published bandwidth", va="center", fontsize=8,
                    style="italic", color="#666666")
    ax.set_yticks(ys, [lv.name for lv in levels], fontsize=8)
    ax.set_xscale("log")
    ax.set_xlim(1, 5e4)
    ax.set_xlabel("GB/s (1 GB = 1e9 B), per direction where it applies")
    ax.set_title(title)
    return fig


def link_load(routed, topo, *, ax=None, title: str | None = None) -> Figure:
    """A topology drawn with each cable coloured by the bytes it carries (the
    larger direction), from labkit.topology.route."""
    from matplotlib import colormaps

    fig, ax = _axes(ax, (5, 4))
    cmap = colormaps["viridis"]
    peak = max(routed.link_bytes.values(), default=1.0) or 1.0
    drawn = set()
    for (a, b) in topo.links:
        key = tuple(sorted((a, b)))
        if key in drawn:
            continue
        drawn.add(key)
        load = max(routed.link_bytes.get((a, b), 0.0),
                   routed.link_bytes.get((b, a), 0.0))
        (xa, ya), (xb, yb) = topo.pos[a], topo.pos[b]
        color = cmap(load / peak) if load else "#DDDDDD"
        lw = 1 + 3 * load / peak
        if abs(xa - xb) > 1.01 or abs(ya - yb) > 1.01:  # wraparound: two stubs
            dx, dy = (xb - xa), (yb - ya)
            ux, uy = (-0.35 * (dx > 0) + 0.35 * (dx < 0), -0.35 * (dy > 0)
                      + 0.35 * (dy < 0))
            ax.plot([xa, xa + ux], [ya, ya + uy], color=color, lw=lw, ls=":")
            ax.plot([xb, xb - ux], [yb, yb - uy], color=color, lw=lw, ls=":")
        else:
            ax.plot([xa, xb], [ya, yb], color=color, lw=lw, zorder=1)
    for d in topo.devices:
        ax.scatter(*topo.pos[d], s=60, color="black", zorder=2)
    for s in set(topo.pos) - set(topo.devices):
        ax.scatter(*topo.pos[s], s=160, marker="s", color="#8172B3", zorder=2)
    ax.set_title(title or f"{topo.name}: busiest link {peak / 1e9:.2f} GB "
                 f"(dotted: wraparound)", fontsize=9)
    ax.axis("off")
    ax.set_aspect("equal", adjustable="datalim")
    return fig


# --------------------------------------------------------------------- ZeRO


ZERO_COLORS = {"params": CATEGORY_COLORS["Parameter"],
               "grads": CATEGORY_COLORS["Gradient"],
               "optimizer": CATEGORY_COLORS["Optstate"]}


def zero_bars(breakdowns, *, ax=None, unit: float = 1e9, unit_name: str = "GB",
              highlight: str | None = None, capacity: float | None = None,
              title: str = "Model states per device") -> Figure:
    """Stacked bars (parameters, gradients, optimizer state) per label, as in the
    ZeRO paper's figure 1. breakdowns: label -> labkit.theory.ZeroMemory (or any
    object with params, grads, optimizer). capacity: a device's memory, drawn."""
    labels = list(breakdowns)
    fig, ax = _axes(ax, (1.5 + 1.3 * len(labels), 3.8))
    bottom = [0.0] * len(labels)
    for part, color in ZERO_COLORS.items():
        heights = [getattr(breakdowns[k], part) / unit for k in labels]
        ax.bar(range(len(labels)), heights, bottom=bottom, color=color, label=part,
               width=0.6)
        bottom = [b + h for b, h in zip(bottom, heights)]
    for i, (label, total) in enumerate(zip(labels, bottom)):
        ax.text(i, total, f"{total:,.1f}", ha="center", va="bottom", fontsize=9,
                fontweight="bold" if label == highlight else "normal")
    if capacity:
        ax.axhline(capacity / unit, color="black", ls="--", lw=1,
                   label=f"device memory {capacity / unit:,.0f} {unit_name}")
    ax.set_xticks(range(len(labels)), labels)
    if highlight in labels:
        ax.get_xticklabels()[labels.index(highlight)].set_fontweight("bold")
    ax.set_ylabel(unit_name)
    ax.set_title(title)
    ax.legend(fontsize="small", loc="upper right")
    return fig


def placement_bars(cost, *, ax=None, unit: float = 1e9, unit_name: str = "GB",
                   title: str = "Per device: kept between steps vs at the peak"
                   ) -> Figure:
    """Persistent and peak bytes per training state (labkit.theory.PlacementCost)."""
    fig, ax = _axes(ax, (5.5, 3.6))
    colors = {"P": CATEGORY_COLORS["Parameter"], "O": CATEGORY_COLORS["Optstate"],
              "G": CATEGORY_COLORS["Gradient"], "A": CATEGORY_COLORS["Activation"]}
    names = {"P": "parameters", "O": "optimizer", "G": "gradients",
             "A": "activations"}
    for x, what in enumerate(("persistent", "peak")):
        parts = getattr(cost, what)
        bottom = 0.0
        for state in "POGA":
            h = parts[state] / unit
            ax.bar(x, h, bottom=bottom, color=colors[state], width=0.55,
                   label=names[state] if x == 0 else None)
            bottom += h
        ax.text(x, bottom, f"{bottom:,.2f}", ha="center", va="bottom", fontsize=9)
    ax.set_xticks([0, 1], ["kept (persistent)", "at the peak"])
    ax.set_ylabel(unit_name)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig
