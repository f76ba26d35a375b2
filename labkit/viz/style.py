"""What every chart shares: colours by category and by collective, and a Figure
that shows itself in a notebook without pyplot."""

from __future__ import annotations

import io
from collections.abc import Mapping

from matplotlib.figure import Figure

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


def figure_and_axes(ax, figsize):
    """(figure, axes) for a chart: the caller's axes and their figure, or a new
    LabFigure of `figsize` inches with one axes. Every chart takes ax= this way."""
    if ax is not None:
        return ax.figure, ax
    fig = LabFigure(figsize=figsize, layout="constrained")
    return fig, fig.add_subplot()


def by_rank(data) -> dict:
    """rank -> value, ranks in order; named keys ("fp32", ...) keep the caller's."""
    if isinstance(data, Mapping):
        if all(isinstance(k, int) for k in data):
            return dict(sorted(data.items()))
        return dict(data)
    return dict(enumerate(data))


def records_of(ledger) -> list:
    """A ledger's records as a list (a ledger, or its records already)."""
    return list(getattr(ledger, "records", ledger))
