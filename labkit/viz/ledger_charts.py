"""Charts of what the ledgers measured: memory by rank and category, traffic by rank
against the bus-bytes model, and a per-rank timeline (a timing)."""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from labkit.units import MiB
from labkit.viz.style import (
    CATEGORY_COLORS,
    COMPUTE_COLOR,
    OP_COLORS,
    PAGE_WIDTH_IN,
    by_rank,
    figure_and_axes,
    fits_beside,
    place_legend,
    records_of,
)


def memory_by_rank(per_rank, expected=None, *, ax=None, unit: float = MiB,
                   unit_name: str = "MiB", title: str = "Memory by rank",
                   colors: Mapping | None = None) -> Figure:
    """Stacked bars of bytes by category, one bar per rank.

    per_rank: rank -> {category: bytes} (a dict, or a list indexed by rank; a
    MemoryLedger's `current` or `at_peak` is such a dict); a key that is not an int
    labels its bar as it is (e.g. "fp32", "batch 8"). expected: bytes per bar (one
    number for all, or one per key), drawn as a line over each bar. colors:
    part -> colour, for parts that are not the ledger's categories (e.g. one
    category split in two); the categories keep theirs unless named here.
    """
    ranks = by_rank(per_rank)
    ranks = {r: getattr(v, "current", v) for r, v in ranks.items()}
    natural = 1.2 + 0.9 * len(ranks)  # the legend beside the bars
    beside = ax is not None or fits_beside(natural)
    fig, ax = figure_and_axes(ax, (min(natural, PAGE_WIDTH_IN), 3.6))
    cats = [c for c in CATEGORY_COLORS if any(v.get(c, 0) for v in ranks.values())]
    cats += sorted({c for v in ranks.values() for c in v} - set(CATEGORY_COLORS)
                   - {"Total"})
    xs = list(range(len(ranks)))
    bottom = [0.0] * len(xs)
    for cat in cats:
        heights = [ranks[r].get(cat, 0) / unit for r in ranks]
        ax.bar(xs, heights, bottom=bottom, label=cat, width=0.6,
               color=(colors or {}).get(cat, CATEGORY_COLORS.get(cat)))
        bottom = [b + h for b, h in zip(bottom, heights)]
    if expected is not None:
        exp = by_rank(expected) if isinstance(expected, (Mapping, Sequence)) else {
            r: expected for r in ranks}
        for x, r in zip(xs, ranks):
            if exp.get(r) is not None:
                ax.hlines(exp[r] / unit, x - 0.4, x + 0.4, colors="black",
                          linestyles="--", label="expected" if x == 0 else None)
    ax.set_xticks(xs, [_bar_label(r) for r in ranks])
    ax.set_ylabel(unit_name)
    ax.set_title(title, wrap=True)
    _legend(ax, beside)
    return fig


def _legend(ax, beside: bool, handles=None) -> None:
    """Beside the axes (top left of the space to their right), or below them."""
    place_legend(ax, handles, beside=beside)


def _bar_label(key) -> str:
    """'rank 2' for a rank; any other key as it is, wrapped to fit under a bar."""
    if isinstance(key, int):
        return f"rank {key}"
    return textwrap.fill(str(key), 8)  # 'FSDP, rank 0' -> 'FSDP,\nrank 0'


# --------------------------------------------------------------------- traffic


def traffic_by_rank(ledgers, *, ax=None, unit: float = MiB, unit_name: str = "MiB",
                    title: str = "Bytes sent by rank, per collective") -> Figure:
    """Per rank and op: bytes measured on the wire (solid) next to the bus-bytes
    model (hatched). ledgers: rank -> TrafficLedger or list of records."""
    ranks = {r: records_of(v) for r, v in by_rank(ledgers).items()}
    ops = sorted({rec.op for recs in ranks.values() for rec in recs},
                 key=lambda o: list(OP_COLORS).index(o) if o in OP_COLORS else 99)
    natural = 1.5 + 1.2 * len(ranks)  # the legend beside the bars
    beside = ax is not None or fits_beside(natural)
    fig, ax = figure_and_axes(ax, (min(natural, PAGE_WIDTH_IN), 3.6))
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
    ax.set_title(title, wrap=True)
    _legend(ax, beside)
    return fig


# --------------------------------------------------------------------- timeline


def timeline_by_rank(ledgers, *, ax=None,
                     title: str = "Timeline (a timing: varies run to run)"
                     ) -> Figure:
    """One lane per rank: compute (grey) and each collective (coloured) as spans,
    from the ledgers' own clocks (CLOCK_MONOTONIC, shared by the ranks)."""
    ranks = by_rank(ledgers)
    starts = [getattr(v, "start", None) for v in ranks.values()]
    recs_all = [rec for v in ranks.values() for rec in records_of(v)]
    origin = min([s for s in starts if s] + [rec.start for rec in recs_all] or [0.0])
    own = ax is None
    fig, ax = figure_and_axes(ax, (PAGE_WIDTH_IN, 0.8 + 0.6 * len(ranks)))
    seen = set()
    for lane, v in enumerate(ranks.values()):
        recs = sorted(records_of(v), key=lambda rec: rec.start)
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
    _legend(ax, not own, handles)  # its own figure: the lanes get the width
    return fig
