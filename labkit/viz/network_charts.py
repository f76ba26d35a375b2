"""Charts of networks: bandwidth by message size, published bandwidth by level of
the memory hierarchy (and a table of its sources), and the load on each cable of a
topology."""

from __future__ import annotations

import html

from matplotlib.figure import Figure

from labkit.viz.style import OP_COLORS, PAGE_WIDTH_IN, figure_and_axes


def bandwidth_chart(points, fits=None, *, ax=None, metric: str = "busbw",
              title: str = "Bus bandwidth by message size (a timing)") -> Figure:
    """busbw (or algbw) against message size, one line per op (labkit.bandwidth
    points); `fits` maps op -> labkit.theory.AlphaBeta, drawn dashed."""
    fig, ax = figure_and_axes(ax, (7, 4))
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
            factor = bus_factor(fit.op, fit.world_size) if metric == "busbw" else 1.0
            ys = [s / fit.time(s) * factor / 1e9 for s in xs]
            ax.plot(xs, ys, ":", color=color, lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size S (bytes)")
    ax.set_ylabel(f"{metric} (GB/s, 1 GB = 1e9 B)")
    ax.set_title(title)
    ax.legend(fontsize="small")
    return fig


def hierarchy(levels, *, ax=None, title: str = "Bandwidth by level (published figures)"
              ) -> Figure:
    """Horizontal bars of bandwidth (log scale) for labkit.theory.hardware
    Levels; levels with no published figure are listed, not drawn."""
    levels = list(levels)
    fig, ax = figure_and_axes(ax, (PAGE_WIDTH_IN, 0.45 * len(levels) + 1.2))
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


class FiguresTable:
    """Published figures with their sources, one row per level: HTML in a notebook
    (each source a link named by its site), a short text table elsewhere."""

    def __init__(self, levels):
        self.levels = list(levels)

    @staticmethod
    def _site(url: str) -> str:
        from urllib.parse import urlparse

        return urlparse(url).netloc.removeprefix("www.")

    @staticmethod
    def _bw(lv) -> str:
        return "—" if not lv.bandwidth else f"{lv.bandwidth / 1e9:,.0f}"

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td style='text-align:left'>{html.escape(lv.name)}</td>"
            f"<td>{self._bw(lv)}</td><td style='text-align:left'>"
            f"{html.escape(lv.note)}</td><td style='text-align:left'><a href="
            f"'{html.escape(lv.source)}'>{html.escape(self._site(lv.source))}</a>"
            "</td></tr>" for lv in self.levels)
        return ("<table><caption>published figures (GB/s, 1 GB = 1e9 B, per "
                "direction where that applies)</caption><tr><th style='text-align:"
                "left'>level</th><th>GB/s</th><th style='text-align:left'>what the "
                "source says</th><th style='text-align:left'>source</th></tr>"
                + rows + "</table>")

    def __repr__(self) -> str:
        return "\n".join(
            f"{lv.name:<36}{self._bw(lv) + ' GB/s' if lv.bandwidth else 'n/a':>11}  "
            f"({self._site(lv.source)})" for lv in self.levels)


def hierarchy_table(levels) -> FiguresTable:
    """labkit.theory.hardware Levels as a table: figure, note and a link to the
    source of each (the chart's footnotes)."""
    return FiguresTable(levels)


UNUSED_COLOR = "#B0B0B0"
SWITCH_COLOR = "#4D4D4D"


def _load_cmap():
    from matplotlib import colormaps
    from matplotlib.colors import ListedColormap

    base = colormaps["YlOrRd"]  # from 0.3 on: orange to dark red, no pale yellow
    return ListedColormap([base(0.3 + 0.7 * i / 255) for i in range(256)],
                          name="link load")


def _switch_label(name: str) -> str:
    if name.startswith("nvsw"):
        return f"NVSwitch, node {name[4:]}"
    return {"spine": "InfiniBand spine"}.get(name, name)


def link_load(routed, topo, *, ax=None, title: str | None = None,
              metric: str = "bytes") -> Figure:
    """Every cable of a topology, coloured by the load `route` put on it (the busier
    of its two directions); a colourbar says what each shade means.

    metric "bytes": GB on the cable; "seconds": ms to carry them at the cable's
    speed, which shows the bottleneck where links differ (NVLink vs InfiniBand).
    Unused cables are grey and dashed; a torus's wraparound cable is drawn as two
    stubs pointing out of the grid at its two ends. Switches are bars; a device's
    cable to a switch runs straight to the bar. Each cable's artists carry the gid
    "link a|b" (a, b sorted), so a test can find every one."""
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch, Rectangle

    if metric not in ("bytes", "seconds"):
        raise ValueError(f"metric must be 'bytes' or 'seconds', not {metric!r}")
    scale, unit = (1e9, "GB") if metric == "bytes" else (1e-3, "ms")

    def value(link):
        b = routed.link_bytes.get(link, 0.0)
        return b if metric == "bytes" else b / routed.link_bw[link]

    loads = {c: max(value(c), value(c[::-1])) / scale for c in topo.cables}
    peak = max(loads.values(), default=0.0) or 1.0
    cmap, norm = _load_cmap(), Normalize(0.0, peak)
    switches = set(topo.switches)
    xs = [x for x, _ in topo.pos.values()]
    ys = [y for _, y in topo.pos.values()]
    span_x, span_y = max(xs) - min(xs) + 1.4, max(ys) - min(ys) + 1.4
    inch = min(1.0, (PAGE_WIDTH_IN - 2.2) / span_x)  # 2.2 in: colourbar, margins
    fig, ax = figure_and_axes(ax, (span_x * inch + 2.2, max(3.4, span_y * inch + 1.8)))
    bar_h = 0.22
    for (a, b) in topo.cables:
        load = loads[(a, b)]
        style = dict(color=cmap(norm(load)) if load else UNUSED_COLOR,
                     lw=1.5 + 3 * load / peak if load else 1.2,
                     ls="-" if load else "--", gid=f"link {a}|{b}", zorder=1,
                     solid_capstyle="butt")
        (xa, ya), (xb, yb) = topo.pos[a], topo.pos[b]
        if a in switches or b in switches:
            (xd, yd), ysw = ((xa, ya), yb) if b in switches else ((xb, yb), ya)
            end = ysw - bar_h / 2 if ysw > yd else ysw + bar_h / 2
            ax.plot([xd, xd], [yd, end], **style)
        elif (a, b) in topo.wraparound:  # a stub out of each end, away from the other
            dx, dy = xb - xa, yb - ya
            ln = (dx * dx + dy * dy) ** 0.5
            ux, uy = 0.45 * dx / ln, 0.45 * dy / ln
            for (x0, y0), (sx, sy) in (((xa, ya), (-ux, -uy)), ((xb, yb), (ux, uy))):
                ax.plot([x0, x0 + sx], [y0, y0 + sy], **style)
        else:
            ax.plot([xa, xb], [ya, yb], **style)
    for s in switches:
        near = [topo.pos[d][0] for c in topo.cables if s in c for d in c if d != s]
        x0, x1 = min(near) - 0.35, max(near) + 0.35
        y = topo.pos[s][1]
        ax.add_patch(Rectangle((x0, y - bar_h / 2), x1 - x0, bar_h,
                               color=SWITCH_COLOR, zorder=2))
        ax.text((x0 + x1) / 2, y, _switch_label(s), color="white", ha="center",
                va="center", fontsize=8, zorder=3)
    dev = [topo.pos[d] for d in topo.devices]
    ax.scatter([x for x, _ in dev], [y for _, y in dev], s=55, color="white",
               edgecolors="black", linewidths=1.2, zorder=3)
    what = "GB on the cable" if metric == "bytes" else "ms to carry its bytes"
    fig.colorbar(ScalarMappable(norm, cmap), ax=ax, shrink=0.8,
                 label=f"{what} (busier direction)")
    handles = [Line2D([], [], ls="none", marker="o", mfc="white", mec="black",
                      label="device"),
               Line2D([], [], color=UNUSED_COLOR, ls="--", label="cable not used")]
    if switches:
        handles.insert(1, Patch(color=SWITCH_COLOR, label="switch"))
    if topo.wraparound:
        handles.append(Line2D([], [], color=cmap(0.6), label="wraparound cable: a "
                              "stub at each end"))
    ax.legend(handles=handles, fontsize="small", loc="upper center", ncol=2,
              bbox_to_anchor=(0.5, 0.0), frameon=False)
    busiest = max(loads.values(), default=0.0)
    ax.set_title(title or f"{topo.name}: busiest cable {busiest:,.3g} {unit}",
                 fontsize=10)
    ax.set_xlim(min(xs) - 0.7, max(xs) + 0.7)
    ax.set_ylim(min(ys) - 0.7, max(ys) + 0.7)
    if not switches:
        ax.set_aspect("equal")
    ax.axis("off")
    return fig
