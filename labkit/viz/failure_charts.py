"""Charts of chapter 13 (failures and slow links): the time a checkpoint interval
loses, loss curves side by side, and the bytes each step sends.

Data in, Figure out; every line has a gid ("line:<name>", "mark:<name>",
"bars:<name>") so a test can find what was drawn."""

from __future__ import annotations

from matplotlib.figure import Figure

from labkit.viz.style import figure_and_axes

_PALETTE = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860")


def waste_curve(intervals, waste, marks: dict | None = None, *, ax=None,
                title: str = "Time lost to checkpoints and failures") -> Figure:
    """The share of time lost (waste, fractions) against the checkpoint interval
    (seconds, drawn in minutes); `marks`: name -> an interval, a dashed vertical
    line each (Young's, Daly's)."""
    fig, ax = figure_and_axes(ax, (6.5, 3.4))
    ax.plot([t / 60 for t in intervals], [100 * w for w in waste],
            color=_PALETTE[0], lw=1.8, label="checkpoint cost + expected loss",
            gid="line:waste")
    for i, (name, t) in enumerate((marks or {}).items()):
        ax.axvline(t / 60, color=_PALETTE[1 + i], ls="--", lw=1.2,
                   label=f"{name}: {t / 60:.1f} min", gid=f"mark:{name}")
    ax.set_xlabel("checkpoint interval (minutes)")
    ax.set_ylabel("time lost (%)")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def loss_curves(runs: dict, *, ax=None, xlabel: str = "inner step",
                title: str = "Training loss at equal tokens") -> Figure:
    """runs: name -> losses, one per step (step 1 first), a line each."""
    fig, ax = figure_and_axes(ax, (6.5, 3.4))
    for i, (name, losses) in enumerate(runs.items()):
        ax.plot(range(1, len(losses) + 1), losses, color=_PALETTE[i % 6], lw=1.5,
                label=name, gid=f"line:{name}")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("loss")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def bytes_per_step(runs: dict, *, ax=None, unit: float = 1024.0,
                   unit_name: str = "KiB",
                   title: str = "Bytes a rank sends, step by step") -> Figure:
    """runs: name -> bytes one rank sent in each step, drawn as steps side by
    side (a group of bars per step, one colour per run)."""
    fig, ax = figure_and_axes(ax, (6.5, 3.4))
    n = max(1, len(runs))
    width = 0.8 / n
    for i, (name, sent) in enumerate(runs.items()):
        xs = [s + 1 - 0.4 + width * (i + 0.5) for s in range(len(sent))]
        ax.bar(xs, [b / unit for b in sent], width=width, color=_PALETTE[i % 6],
               label=name, gid=f"bars:{name}")
    ax.set_xlabel("inner step")
    ax.set_ylabel(f"sent ({unit_name})")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig
