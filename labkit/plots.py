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
            wire.append(sum(rec.wire_bytes or 0 for rec in sel) / unit)
            model.append(sum(rec.bus_bytes for rec in sel) / unit)
        xs = [k - 0.4 + (2 * i + 0.5) * width for k in range(len(ranks))]
        color = OP_COLORS.get(op)
        ax.bar(xs, wire, width, color=color, label=f"{op} (wire)")
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
    for lane, (r, v) in enumerate(ranks.items()):
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
