"""Diagrams of data moving: a collective's before and after, a ring step by step."""

from __future__ import annotations

from matplotlib.figure import Figure

from labkit.viz.style import _axes


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
