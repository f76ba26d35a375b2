"""Charts of data parallelism: bytes each rank wrote under two or more schemes next
to their closed forms, and a per-rank timeline of backward and the collectives
(a timing), with the share of communication hidden under backward."""

from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from labkit.units import MiB
from labkit.viz.style import (
    COMPUTE_COLOR,
    OP_COLORS,
    PAGE_WIDTH_IN,
    LabFigure,
    by_rank,
    figure_and_axes,
    fits_beside,
    legend_outside,
    place_legend,
)

SCHEME_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860")


def dp_traffic(measured, expected=None, *, ax=None, unit: float = MiB,
               unit_name: str = "MiB",
               title: str = "Bytes each rank wrote in one step") -> Figure:
    """Grouped bars: for each rank, one bar per scheme (bytes measured on the wire),
    each with its closed form drawn as a dashed line across the bar.

    measured: scheme -> per-rank bytes (a list indexed by rank, or a dict).
    expected: scheme -> per-rank bytes, the closed form (same shape), optional.
    """
    schemes = {name: by_rank(v) for name, v in measured.items()}
    ranks = sorted({r for v in schemes.values() for r in v})
    natural = 2.0 + 1.0 * len(ranks)  # the legend beside the bars
    beside = ax is not None or fits_beside(natural)
    fig, ax = figure_and_axes(ax, (min(natural, PAGE_WIDTH_IN), 3.6))
    width = 0.8 / max(1, len(schemes))
    for i, (name, per_rank) in enumerate(schemes.items()):
        xs = [k - 0.4 + (i + 0.5) * width for k in range(len(ranks))]
        ax.bar(xs, [per_rank.get(r, 0) / unit for r in ranks], width * 0.9,
               color=SCHEME_COLORS[i % len(SCHEME_COLORS)], label=f"{name} (wire)")
        if expected is not None and name in expected:
            exp = by_rank(expected[name])
            for x, r in zip(xs, ranks):
                if exp.get(r) is not None:
                    ax.hlines(exp[r] / unit, x - width / 2, x + width / 2,
                              colors="black", linestyles="--", lw=1.2)
    handles, _ = ax.get_legend_handles_labels()
    if expected is not None:
        from matplotlib.lines import Line2D

        handles.append(Line2D([], [], color="black", ls="--", label="closed form"))
    ax.set_xticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.set_ylabel(f"{unit_name} written")
    ax.set_title(title, wrap=True)
    place_legend(ax, handles, beside=beside)
    return fig


# --------------------------------------------------------------------- timeline


def _op(span) -> str:
    return span.name.split()[0] if span.name else "comm"


def _rows(spans) -> list[int]:
    """Give each span (sorted by start) the first sub-row free at its start, so
    that no two spans in one sub-row overlap (greedy interval colouring)."""
    ends: list[float] = []
    rows = []
    for s in spans:
        for i, end in enumerate(ends):
            if end <= s.start:
                ends[i] = s.end
                rows.append(i)
                break
        else:
            ends.append(s.end)
            rows.append(len(ends) - 1)
    return rows


def dp_timeline(events, *, ax=None, title: str = "", origin: float | None = None,
                legend: bool | str = True, compute: str = "backward",
                labels: dict | None = None, min_width: float = 0.0,
                share_label: str = "") -> Figure:
    """One lane per rank from recorded `Span`s (a timing: varies run to run).

    events: rank -> list of Span (DataParallel.events, or spans recorded the same
    way). In each lane, compute is the grey bar on top (`compute` names it:
    "backward" for data parallelism, "compute" where forward runs too); each
    collective, from the moment it was issued to the moment it completed, is a
    coloured bar below, in its own sub-row wherever it overlaps another, so no bar
    hides another. The title gives the share of communication time during which
    compute ran (`overlap_fraction`), averaged over the ranks; `share_label` says
    of what (e.g. "in this step"). labels: op -> its legend label (default: the
    op's name). min_width: draw no compute span narrower than this fraction of
    the time axis (0: true widths), so that spans of single operators stay
    visible; the overlap share is computed from the true spans. legend: True
    (below the axes on a figure of its own, beside them on the caller's axes),
    "below", "above" (over the title) or False.
    """
    # here, not at the top: labkit.parallel imports torch, which viz otherwise need not
    from labkit.ledger import overlap_fraction

    ranks = by_rank(events)
    spans = [s for v in ranks.values() for s in v]
    if origin is None:
        origin = min((s.start for s in spans), default=0.0)
    own = ax is None
    fig, ax = figure_and_axes(ax, (PAGE_WIDTH_IN, 0.9 + 0.8 * len(ranks)))
    seen: list[str] = []
    extent = 1e3 * (max((s.end for s in spans), default=origin) - origin)
    for lane, evs in enumerate(ranks.values()):
        busy = [(1e3 * (s.start - origin), max(1e3 * s.seconds, min_width * extent))
                for s in evs if s.kind == "compute"]
        ax.broken_barh(busy, (lane - 0.42, 0.36), facecolors=COMPUTE_COLOR,
                       edgecolors="#7F7F7F", linewidth=0.5)
        comm = sorted((s for s in evs if s.kind == "comm"), key=lambda s: s.start)
        rows = _rows(comm)
        height = 0.44 / max(1, max(rows, default=0) + 1)
        for s, row in zip(comm, rows):
            op = _op(s)
            if op not in seen:
                seen.append(op)
            ax.broken_barh([(1e3 * (s.start - origin), 1e3 * s.seconds)],
                           (lane - 0.02 + row * height, height * 0.85),
                           facecolors=OP_COLORS.get(op, "black"))
    shares = [overlap_fraction(v) for v in ranks.values()]
    share = sum(shares) / len(shares) if shares else 0.0
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.set_ylim(len(ranks) - 0.5, -0.5)  # rank 0 on top
    ax.set_xlabel("ms since the first span began")
    of = f" {share_label}" if share_label else ""
    tail = f"{share:.0%} of communication time under {compute}{of} (a timing)"
    # a title longer than a line of the page (about 75 characters): the share
    # on a line of its own
    head = "" if not title else f"{title}:" + (
        "\n" if len(title) + len(tail) > 72 else " ")
    ax.set_title(head + tail, wrap=True)
    if legend:
        handles = _handles(compute, seen, labels)
        if legend is True and not own:
            ax.legend(handles=handles, fontsize="small", loc="upper left",
                      bbox_to_anchor=(1.0, 1.0))
        else:
            legend_outside(ax, handles, side="above" if legend == "above"
                           else "below", grow=own)
    return fig


def dp_timelines(schemes, *, title: str = "One training step, rank by rank",
                 compute: str = "backward", labels: dict | None = None,
                 min_width: float = 0.0, share_label: str = "",
                 tick_labels: bool = False) -> Figure:
    """dp_timeline for each scheme (name -> rank -> spans), stacked, one time axis
    (each panel starts at its own first span); the legend over the top panel.
    labels, min_width, share_label: as dp_timeline's. tick_labels: number the time
    axis under every panel, not only the lowest."""
    n_ranks = max((len(by_rank(v)) for v in schemes.values()), default=1)
    fig = LabFigure(figsize=(PAGE_WIDTH_IN, (0.8 + 0.6 * n_ranks) * len(schemes)),
                    layout="constrained")
    axes = fig.subplots(len(schemes), 1, sharex=True, squeeze=False)[:, 0]
    for i, (ax, (name, events)) in enumerate(zip(axes, schemes.items())):
        dp_timeline(events, ax=ax, title=name, legend=False, compute=compute,
                    labels=labels, min_width=min_width, share_label=share_label)
        if i < len(axes) - 1:
            ax.set_xlabel("")
            if tick_labels:
                ax.tick_params(labelbottom=True)
    fig.suptitle(title)
    # the legend over the top panel: its entries, from every panel's ops
    seen = list(dict.fromkeys(  # in the order each panel meets them
        _op(s) for events in schemes.values() for v in by_rank(events).values()
        for s in sorted((s for s in v if s.kind == "comm"), key=lambda s: s.start)))
    legend_outside(axes[0], _handles(compute, seen, labels), side="above")
    return fig


def _handles(compute: str, ops, labels) -> list:
    handles = [Patch(facecolor=COMPUTE_COLOR, edgecolor="#7F7F7F",
                     label=f"{compute} (compute)" if compute != "compute"
                     else "compute")]
    return handles + [Patch(color=OP_COLORS.get(op, "black"),
                            label=f"{(labels or {}).get(op, op)}: issued to done")
                      for op in ops]
