"""Charts of the closed forms: ZeRO's memory per device, a placement's cost."""

from __future__ import annotations

from matplotlib.figure import Figure

from labkit.viz.style import CATEGORY_COLORS, _axes

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
