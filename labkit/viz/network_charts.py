"""Charts of networks: bandwidth by message size, published bandwidth by level of
the memory hierarchy, and the load on each link of a topology."""

from __future__ import annotations

from matplotlib.figure import Figure

from labkit.viz.style import OP_COLORS, _axes


def bandwidth_chart(points, fits=None, *, ax=None, metric: str = "busbw",
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
