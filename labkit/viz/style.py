"""What every chart shares: colours by category and by collective, and a Figure
that shows itself in a notebook without pyplot."""

from __future__ import annotations

import io
from collections.abc import Mapping

from matplotlib.figure import Figure
from matplotlib.legend import Legend

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

# The course site's article column is 752 px wide in a 1280 px window
# (labkit.cli.page_assets.SITE_CSS makes it so) and a figure is saved at 100
# dpi. A chart is at most PAGE_WIDTH_IN wide (771 px saved, with the padding),
# so the page shows it at 97.5 % of its size or more and its smallest text,
# MIN_FONT_PT (10.4 px), stays over 10 px; a browser test checks every page.
# What does not fit beside a chart's axes goes below them.
PAGE_WIDTH_IN = 7.6
MIN_FONT_PT = 7.5


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


def fits_beside(natural: float) -> bool:
    """Whether a chart of `natural` inches (its legend beside it included) fits the
    page; if not, it is drawn PAGE_WIDTH_IN wide with its legend below."""
    return natural <= PAGE_WIDTH_IN


def _renderer(fig):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    if not isinstance(fig.canvas, FigureCanvasAgg):
        FigureCanvasAgg(fig)
    return fig.canvas.get_renderer()


def place_legend(ax, handles=None, labels=None, *, beside: bool) -> Legend:
    """The axes' legend to their right (`beside`: the chart fits the page with
    it there, see fits_beside), or centred below them (legend_outside)."""
    if not beside:
        return legend_outside(ax, handles, labels)
    given = {"handles": handles, "labels": labels}
    return ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0),
                     **{k: v for k, v in given.items() if v is not None})


def legend_beside_or_below(ax, handles=None, *, width_below: float, **kw
                           ) -> Legend:
    """The legend beside the axes if the figure, as it is saved (tight), then fits
    the page; otherwise below them, the figure `width_below` inches wide. For a
    chart whose drawing keeps its aspect (a grid of cells), whose saved width
    its figure's width does not tell."""
    fig = ax.figure
    opts = {} if handles is None else {"handles": handles}
    leg = ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0),
                    **opts, **kw)
    renderer = _renderer(fig)
    fig.draw_without_rendering()
    if fig.get_tightbbox(renderer).width <= PAGE_WIDTH_IN:  # in inches
        return leg
    leg.remove()
    fig.set_size_inches(min(width_below, PAGE_WIDTH_IN), fig.get_figheight())
    return legend_outside(ax, handles, **kw)


def legend_outside(ax, handles=None, labels=None, *, side: str = "below",
                   ncol: int | None = None, grow: bool = True, gap: float = 4.0,
                   **kw) -> Legend:
    """The axes' legend centred under it (side "below": under its tick labels and
    x label, whatever their height) or over it ("above": over its title), in
    `ncol` columns (None: as many as fit the figure's width).

    The offset is in points, so it holds however the layout later resizes the
    axes. grow: make the figure taller by the legend's height, so the axes keep
    theirs (for a figure the chart made itself)."""
    from matplotlib.transforms import ScaledTranslation

    fig = ax.figure
    renderer = _renderer(fig)
    fig.draw_without_rendering()  # lay out, so the tick labels' extent is known
    box, frame = ax.get_tightbbox(renderer), ax.get_window_extent(renderer)
    if side == "below":
        drop, y, loc = -((frame.y0 - box.y0) * 72 / fig.dpi + gap), 0.0, "upper center"
    elif side == "above":
        drop, y, loc = (box.y1 - frame.y1) * 72 / fig.dpi + gap, 1.0, "lower center"
    else:
        raise ValueError(f"side must be 'below' or 'above', not {side!r}")
    trans = ax.transAxes + ScaledTranslation(0, drop / 72, fig.dpi_scale_trans)
    opts = {"fontsize": "small", "loc": loc, "bbox_to_anchor": (0.5, y),
            "bbox_transform": trans, **kw}
    if handles is not None:
        opts["handles"] = handles
    if labels is not None:
        opts["labels"] = labels
    # centred on the axes: as wide as twice its centre's distance to the nearer edge
    fig_box = fig.bbox
    centre = (frame.x0 + frame.x1) / 2
    room = 2 * min(centre - fig_box.x0, fig_box.x1 - centre) - 0.1 * fig.dpi
    n = max(1, len(ax.get_legend_handles_labels()[0]) if handles is None
            else len(handles))
    # the fewest rows that fit, their entries spread evenly over the columns
    tries = [ncol] if ncol else list(dict.fromkeys(-(-n // rows)
                                                   for rows in range(1, n + 1)))
    for cols in tries:
        leg = ax.legend(ncol=cols, **opts)
        if ncol or cols == 1 or leg.get_window_extent(renderer).width <= room:
            break
    if grow:
        w, h = fig.get_size_inches()
        extra = leg.get_window_extent(renderer).height / fig.dpi + gap / 72
        fig.set_size_inches(w, h + extra)
    return leg
