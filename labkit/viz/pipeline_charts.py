"""Charts of pipeline parallelism: one lane per stage with its forward and
backward passes (micro-batch numbers on them), idle time (the bubble) shaded,
from spans real ranks recorded or from the schedule simulator; and the bubble
against the number of micro-batches.

Every bar set is one broken_barh with gid "rank:kind" (kind: forward, backward,
weights, send, recv, idle; with v chunks "forward/1" ...), so a test can count
what was drawn."""

from __future__ import annotations

from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from labkit.viz.style import (
    MIN_FONT_PT,
    OP_COLORS,
    PAGE_WIDTH_IN,
    LabFigure,
    by_rank,
    figure_and_axes,
    legend_outside,
)

PIPE_COLORS = {"forward": "#4C72B0", "backward": "#55A868", "weights": "#DD8452",
               "send": OP_COLORS["send"], "recv": OP_COLORS["recv"],
               "idle": "#F4F4F4"}
PIPE_LABELS = {"forward": "forward (F)", "backward": "backward (B)",
               "weights": "weight gradient (W)", "send": "send: posted to done",
               "recv": "receive: posted to arrived", "idle": "idle (bubble)"}
_KINDS = {"F": "forward", "B": "backward", "W": "weights"}
_IDLE_EDGE = "#C8C8C8"


def _shade(color: str, chunk: int, v: int) -> tuple:
    """Chunk 0 in the colour itself, later chunks mixed towards white."""
    t = 0.55 * chunk / max(1, v - 1) if v > 1 else 0.0
    return tuple(c + (1 - c) * t for c in to_rgb(color))


def _ink(rgb) -> str:
    r, g, b = rgb
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.55 else "white"


def _gaps(bars, lo: float, hi: float) -> list[tuple[float, float]]:
    """(start, width) of the stretches of [lo, hi] that no bar covers."""
    out, t = [], lo
    for a, b in sorted((a, a + w) for a, w in bars):
        if a > t:
            out.append((t, a - t))
        t = max(t, b)
    if hi > t:
        out.append((t, hi - t))
    return out


def _draw(ax, lanes: dict, comm: dict, window: tuple[float, float], v: int = 1,
          legend: bool | str = True, names: dict | None = None,
          label_size: float = MIN_FONT_PT) -> list:
    """lanes: rank -> [(start, end, kind, microbatch, chunk)] compute passes;
    comm: rank -> [(start, end, kind)]; idle = `window` minus the passes.
    Returns the legend's handles (none if not `legend`), for `_place`: the
    caller places it once the axes' title and labels are set."""
    names = {**PIPE_LABELS, **(names or {})}
    span = max(window[1] - window[0], 1e-12)
    drawn: list[tuple[str, int]] = []
    for lane, (rank, passes) in enumerate(lanes.items()):
        has_comm = bool(comm.get(rank))
        top, height = (lane - 0.4, 0.52) if has_comm else (lane - 0.4, 0.8)
        bars = [(a, b - a) for a, b, *_ in passes]
        ax.broken_barh(_gaps(bars, *window), (top, height),
                       facecolors=PIPE_COLORS["idle"], edgecolors=_IDLE_EDGE,
                       hatch="///", linewidth=0.4, gid=f"{rank}:idle")
        if ("idle", 0) not in drawn:
            drawn.append(("idle", 0))
        groups: dict[tuple[str, int], list] = {}
        for a, b, kind, mb, chunk in passes:
            groups.setdefault((kind, chunk), []).append((a, b, mb))
        for (kind, chunk), items in groups.items():
            rgb = _shade(PIPE_COLORS[kind], chunk, v)
            gid = f"{rank}:{kind}" + (f"/{chunk}" if v > 1 else "")
            ax.broken_barh([(a, b - a) for a, b, _ in items], (top, height),
                           facecolors=[rgb], edgecolors="white", linewidth=0.6,
                           gid=gid)
            if (kind, chunk) not in drawn:
                drawn.append((kind, chunk))
            for a, b, mb in items:  # the micro-batch number, where it fits
                if (b - a) / span >= 0.012:
                    ax.text((a + b) / 2, top + height / 2, str(mb), ha="center",
                            va="center", fontsize=label_size, color=_ink(rgb),
                            clip_on=True)
        by_kind: dict[str, list] = {}
        for a, b, kind in comm.get(rank, []):
            by_kind.setdefault(kind, []).append((a, max(b - a, span * 0.002)))
        for i, kind in enumerate(k for k in ("recv", "send") if k in by_kind):
            ax.broken_barh(by_kind[kind], (lane + 0.15 + 0.13 * i, 0.11),
                           facecolors=PIPE_COLORS[kind], gid=f"{rank}:{kind}")
            if (kind, 0) not in drawn:
                drawn.append((kind, 0))
    ax.set_yticks(range(len(lanes)), [f"stage {r}" for r in lanes])
    ax.set_ylim(len(lanes) - 0.5, -0.5)  # stage 0 on top
    pad = 0.01 * span
    starts = [a for p in lanes.values() for a, *_ in p] + [
        a for c in comm.values() for a, *_ in c]
    ends = [b for p in lanes.values() for _, b, *_ in p] + [
        b for c in comm.values() for _, b, *_ in c]
    ax.set_xlim(min([window[0], *starts]) - pad, max([window[1], *ends]) + pad)
    if legend:
        order = ("forward", "backward", "weights", "recv", "send", "idle")
        handles = []
        for kind in order:
            for k, chunk in sorted(drawn, key=lambda kc: kc[1]):
                if k != kind:
                    continue
                label = names[kind] + (f", chunk {chunk}" if v > 1 and kind in
                                       ("forward", "backward", "weights") else "")
                hatch = "///" if kind == "idle" else None
                handles.append(Patch(facecolor=_shade(PIPE_COLORS[kind], chunk, v),
                                     edgecolor=_IDLE_EDGE if hatch else "none",
                                     hatch=hatch, label=label))
        return handles
    return []


def _place(ax, handles, legend: bool | str, grow: bool) -> None:
    """legend: True (beside the axes), "below" (under them, in columns), "above"
    (over the title, in columns) or False. grow: a legend below or above makes
    the figure taller by its height."""
    if not legend or not handles:
        return
    if legend in ("below", "above"):
        legend_outside(ax, handles, side=legend, grow=grow, frameon=False)
    else:
        ax.legend(handles=handles, fontsize="small", loc="upper left",
                  bbox_to_anchor=(1.0, 1.0))


def _span_kind(span) -> tuple[str, int]:
    words = span.name.split()
    return words[0], int(words[-1]) if words[-1].isdigit() else -1


def pipeline_timeline(events, *, ax=None, title: str = "",
                      legend: bool | str = True) -> Figure:
    """One lane per stage from the spans real ranks recorded (a timing).

    events: rank -> list of Span (PipelineParallel.events): compute "forward i" /
    "backward i", comm "send ... i" / "recv ... i". Forward and backward bars carry
    their micro-batch number; idle time between the first pass that started and
    the last that ended (any rank) is hatched; receives (posted to arrived) and
    sends (posted to done) are thin bars below. Time counts from the first pass: a
    receive posted earlier (during the previous step) is drawn from there. The
    title gives each stage's bubble. legend: as schedule_timeline's."""
    from labkit.parallel import bubble_of_total_by_rank

    ranks = by_rank(events)
    compute = [s for evs in ranks.values() for s in evs if s.kind == "compute"]
    if not compute:
        raise ValueError("no compute spans: nothing ran")
    origin = min(s.start for s in compute)  # the step's first pass
    ms = lambda t: 1e3 * (max(t, origin) - origin)
    lanes, comm = {}, {}
    for rank, evs in ranks.items():
        lanes[rank] = [(ms(s.start), ms(s.end), *_span_kind(s), 0)
                       for s in evs if s.kind == "compute"]
        comm[rank] = [(ms(s.start), ms(s.end), _span_kind(s)[0])
                      for s in evs if s.kind == "comm" and s.end > origin]
    window = (ms(min(s.start for s in compute)), ms(max(s.end for s in compute)))
    own = ax is None
    fig, ax = figure_and_axes(ax, (PAGE_WIDTH_IN, 0.9 + 0.75 * len(ranks)))
    handles = _draw(ax, lanes, comm, window, legend=legend)
    bubbles = bubble_of_total_by_rank(list(ranks.values()))
    head = f"{title}: " if title else ""
    ax.set_title(f"{head}idle " + ", ".join(f"{b:.0%} on stage {r}" for r, b in
                                           zip(ranks, bubbles))
                 + " (a timing)", fontsize=10, wrap=True)
    ax.set_xlabel("ms since the first pass began")
    _place(ax, handles, legend, grow=own)
    return fig


def pipeline_timelines(runs: dict, *, title: str = "") -> Figure:
    """pipeline_timeline for each run (name -> rank -> spans), stacked, on one
    time axis (each panel from its own first pass); the legend over the top one
    (the legend of every kind the runs drew)."""
    n = sum(len(by_rank(v)) for v in runs.values())
    fig = LabFigure(figsize=(PAGE_WIDTH_IN, 0.9 * len(runs) + 0.5 * n),
                    layout="constrained")
    axes = fig.subplots(len(runs), 1, sharex=True, squeeze=False)[:, 0]
    lims = []
    for ax, (name, events) in zip(axes, runs.items()):
        pipeline_timeline(events, ax=ax, title=name, legend=False)
        lims.append(ax.get_xlim())
        ax.set_xlabel("")
    axes[0].set_xlim(min(a for a, _ in lims), max(b for _, b in lims))  # fit all
    axes[-1].set_xlabel("ms since each run's first pass began")
    if title:
        fig.suptitle(title)
    _legend_over(axes[0], axes)
    return fig


def _legend_over(top, axes) -> None:
    """One legend over the top panel, of every kind drawn in any panel."""
    order = ("forward", "backward", "weights", "recv", "send", "idle")
    drawn = {c.get_gid().split(":")[1].split("/")[0] for ax in axes
             for c in ax.collections if c.get_gid() and ":" in c.get_gid()}
    handles = [Patch(facecolor=PIPE_COLORS[k],
                     edgecolor=_IDLE_EDGE if k == "idle" else "none",
                     hatch="///" if k == "idle" else None, label=PIPE_LABELS[k])
               for k in order if k in drawn]
    legend_outside(top, handles, side="above", frameon=False)


def schedule_timeline(sim, *, ax=None, title: str = "", legend: bool | str = True,
                      unit: str = "one stage's forward",
                      label_size: float = MIN_FONT_PT) -> Figure:
    """One lane per stage from the schedule simulator (`simulate_schedule`): F, B
    and (zero-bubble) W passes placed in time, micro-batch numbers on them, idle
    hatched; with v chunks per stage each chunk a lighter shade. legend: beside
    the axes (True), "below" them (the lanes get the page's width), "above"
    them or False."""
    own = ax is None
    fig, ax = figure_and_axes(ax, (PAGE_WIDTH_IN, 0.9 + 0.6 * len(sim.ops)))
    _schedule(sim, ax, title, legend, label_size, f"time (1 = {unit})", own)
    return fig


def _schedule(sim, ax, title, legend, label_size, xlabel: str, grow: bool) -> None:
    lanes = {r: [(o.start, o.end, _KINDS[o.kind], o.microbatch, o.chunk)
                 for o in ops] for r, ops in sorted(sim.ops.items())}
    names = ({"backward": "input gradient (B)"} if any(
        o.kind == "W" for ops in sim.ops.values() for o in ops) else None)
    handles = _draw(ax, lanes, {}, (0.0, sim.makespan), v=sim.v, legend=legend,
                    names=names, label_size=label_size)
    v = f", v={sim.v}" if sim.v > 1 else ""
    head = title or f"{sim.schedule}, p={sim.p}, m={sim.m}{v}"
    ax.set_title(f"{head}: idle {sim.bubble_of_total:.1%} of the step "
                 "(simulated)", fontsize=10, wrap=True)
    ax.set_xlabel(xlabel)
    _place(ax, handles, legend, grow)


def schedule_timelines(sims: dict, *, title: str = "", lane: float = 0.42,
                       legend: bool | str = "below",
                       label_size: float = MIN_FONT_PT) -> Figure:
    """schedule_timeline for each simulation (name -> Simulation), stacked on one
    time axis; the legend of each panel below it (which leaves the lanes the
    page's width; True: beside it). lane: inches of height per stage."""
    n = sum(len(s.ops) for s in sims.values())
    below = 0.4 if legend in ("below", "above") else 0.0
    fig = LabFigure(figsize=(PAGE_WIDTH_IN, (0.8 + below) * len(sims) + lane * n),
                    layout="constrained")
    axes = fig.subplots(len(sims), 1, sharex=True, squeeze=False)[:, 0]
    for i, (ax, (name, sim)) in enumerate(zip(axes, sims.items())):
        last = i == len(axes) - 1
        _schedule(sim, ax, name, legend, label_size,
                  "time (1 = one stage's forward)" if last else "", grow=False)
    longest = max(s.makespan for s in sims.values())  # shared x: fit the longest
    axes[0].set_xlim(-0.01 * longest, 1.01 * longest)
    if title:
        fig.suptitle(title)
    return fig


def bubble_vs_m(curves: dict, points: dict | None = None, *, ax=None,
                title: str = "Pipeline bubble against micro-batches",
                ylabel: str = "idle share of the step", dodge: bool = False
                ) -> Figure:
    """Lines: name -> (ms, values), closed forms; markers: name -> (ms, values),
    simulated or measured, in the colour of the line of the same name (if any),
    each series its own marker shape (hollow, so coinciding points both show).
    dodge: where several marker series share an m, draw them side by side (a
    small step along m) and each a size smaller, so that two values that
    coincide both show; off, every marker sits exactly at its m (on its line)."""
    palette = ("#4C72B0", "#55A868", "#C44E52", "#8172B3", "#DD8452", "#937860")
    fig, ax = figure_and_axes(ax, (6.5, 3.6))
    colors: dict[str, str] = {}
    handles = []
    for i, (name, (ms, ys)) in enumerate(curves.items()):
        colors[name] = palette[i % len(palette)]
        ax.plot(ms, ys, color=colors[name], lw=1.5, gid=f"line:{name}")
        handles.append(Line2D([], [], color=colors[name], lw=1.5, label=name))
    shapes = ("o", "s", "^", "D", "v")  # two series on one point stay visible
    sharing: dict = {}  # m -> the series with a marker there, in order
    for name, (ms, _) in (points or {}).items():
        for m in ms:
            sharing.setdefault(m, []).append(name)
    for i, (name, (ms, ys)) in enumerate((points or {}).items()):
        c = colors.get(name, palette[(len(curves) + i) % len(palette)])
        mark, size = shapes[i % len(shapes)], 7.0
        if dodge:  # side by side where m is shared: 2^(+-0.06), a step on log2 m
            ms = [m * 2 ** (0.12 * (sharing[m].index(name)
                                    - (len(sharing[m]) - 1) / 2)) for m in ms]
            size = max(4.0, 8.0 - 1.5 * i)
        ax.plot(ms, ys, ls="none", marker=mark, mfc="none", mec=c, ms=size,
                gid=f"points:{name}")
        handles.append(Line2D([], [], ls="none", marker=mark, mfc="none", mec=c,
                              ms=size, label=f"{name} (simulated)" if name in
                              curves else name))
    ax.set_xscale("log", base=2)
    ticks = sorted({m for _, (ms, _) in [*curves.items(), *(points or {}).items()]
                    for m in ms})  # the m given, not the dodged positions
    ax.set_xticks(ticks, [str(m) for m in ticks])
    ax.minorticks_off()
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    ax.legend(handles=handles, fontsize="small", loc="upper left",
              bbox_to_anchor=(1.0, 1.0))
    return fig
