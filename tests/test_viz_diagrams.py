"""labkit.viz.diagrams: what each diagram draws, read back from its artists (cell
colours by gid, legend entries, text sizes, bars), not pixels."""

import re

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgb
from matplotlib.patches import Rectangle

from labkit.cli.images import IMAGES, RING_WIDTH_IN, _figure, smallest_text_px, specs
from labkit.comm.collectives import OPS, course_example, ring_steps, simulate
from labkit.ledger import Record
from labkit.units import MiB
from labkit.viz.diagrams import (
    SUM_FACE,
    UNDEFINED,
    collective_diagram,
    rank_color,
    ring_grid,
    sources,
    traffic_by_collective,
)


def _cells(fig) -> dict:
    """gid -> RGB face colour of every cell and stripe the diagram drew."""
    return {p.get_gid(): to_rgb(p.get_facecolor()) for p in fig.axes[0].patches
            if isinstance(p, Rectangle) and p.get_gid()}


def _legend_colors(fig) -> set:
    legends = [leg for ax in fig.axes for leg in ([ax.get_legend()] if ax.get_legend()
                                                  else [])]
    return {to_rgb(h.get_facecolor()) for leg in legends for h in leg.legend_handles}


def _diagram(op):
    data = specs()[f"collective_{op}"]
    return collective_diagram(op, data["before"], data["after"])


def test_after_cells_are_coloured_by_the_rank_they_came_from():
    n = 4
    cells = _cells(_diagram("all_to_all"))
    for r in range(n):  # rank r's cell i is chunk r of rank i
        for i in range(n):
            assert cells[f"after:{r}:{i}"] == to_rgb(rank_color(i))
            assert cells[f"before:{r}:{i}"] == to_rgb(rank_color(r))
    cells = _cells(_diagram("scatter"))
    assert all(cells[f"after:{r}:0"] == to_rgb(rank_color(0)) for r in range(n))
    cells = _cells(_diagram("gather"))  # gather undoes scatter: one value per rank
    assert [cells[f"after:0:{i}"] for i in range(n)] == [to_rgb(rank_color(i))
                                                         for i in range(n)]
    assert all(cells[f"after:{r}:none"] == to_rgb(UNDEFINED) for r in (1, 2, 3))


def test_a_sum_says_which_ranks_it_holds():
    cells = _cells(_diagram("reduce_scatter"))
    for r in range(4):
        assert cells[f"after:{r}:0"] == to_rgb(SUM_FACE)
        assert [cells[f"after:{r}:0:from:{q}"] for q in range(4)] == [
            to_rgb(rank_color(q)) for q in range(4)]


def test_sources_follow_the_definitions():
    ex = course_example(4)
    assert sources("broadcast", ex, simulate("broadcast", ex), root=2)[0] == [
        {2}] * 4
    assert sources("reduce", ex, simulate("reduce", ex))[1] is None
    shards = simulate("reduce_scatter", ex)
    assert sources("all_gather", shards, simulate("all_gather", shards))[3] == [
        {0}, {1}, {2}, {3}]
    assert sources("all_to_all", ex, simulate("all_to_all", ex))[1] == [
        {0}, {1}, {2}, {3}]
    with pytest.raises(ValueError, match="unknown collective 'shuffle'"):
        sources("shuffle", ex, ex)


@pytest.mark.parametrize("op", OPS)
def test_every_colour_is_in_the_legend_and_nothing_is_off_canvas(op):
    fig = _diagram(op)
    drawn = set(_cells(fig).values())
    assert drawn - {to_rgb(SUM_FACE)} <= _legend_colors(fig)
    if to_rgb(SUM_FACE) in drawn:
        assert any("a sum" in t.get_text() for t in fig.axes[0].get_legend().texts)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    box = fig.bbox
    renderer = canvas.get_renderer()
    texts = [t for t in fig.axes[0].texts if t.get_text()]
    assert "title" in [t.get_gid() for t in texts]
    for artist in [*texts, fig.axes[0].get_legend()]:
        ext = artist.get_window_extent(renderer)
        assert box.x0 - 1 <= ext.x0 and ext.x1 <= box.x1 + 1, (op, artist)
        assert box.y0 - 1 <= ext.y0 and ext.y1 <= box.y1 + 1, (op, artist)


def _cell_width_px(fig) -> float:
    FigureCanvasAgg(fig).draw()
    p = next(p for p in fig.axes[0].patches if p.get_gid() == "before:0:0")
    return p.get_window_extent().width


def test_every_collective_is_drawn_at_one_scale():
    widths = {op: _cell_width_px(_diagram(op)) for op in OPS}
    assert max(widths.values()) - min(widths.values()) < 0.5, widths
    # gather's result is one cell per rank now, as wide as its siblings'
    sizes = {op: _diagram(op).get_figwidth() for op in OPS}
    assert sizes["gather"] <= sizes["broadcast"]


def test_ring_svg_labels_are_readable_at_page_width():
    fig = _figure("ring_allreduce_4", specs()["ring_allreduce_4"])
    assert smallest_text_px(fig) >= 11  # was about 7 px at 900 px
    # ... and the committed file is that figure's size (make images redraws it)
    svg = (IMAGES / "ring_allreduce_4.svg").read_text()
    width_pt = float(re.search(r'<svg [^>]*width="([\d.]+)pt"', svg).group(1))
    assert width_pt == pytest.approx(RING_WIDTH_IN * 72) == fig.get_figwidth() * 72
    shades = {tuple(round(v, 3) for v in p.get_facecolor())
              for p in fig.axes[0].patches if (p.get_gid() or "").startswith("ring:")}
    legend = fig.axes[0].get_legend()
    keyed = {tuple(round(v, 3) for v in h.get_facecolor())
             for h in legend.legend_handles}
    assert shades <= keyed  # one legend entry per shade drawn (1, 2, 3, 4 ranks)
    assert any("sent in this step" in t.get_text() for t in legend.texts)
    assert sum(1 for p in fig.axes[0].patches if (p.get_gid() or "").startswith(
        "ring:")) == 7 * 16  # seven states of 4 x 4 chunks


def test_ring_grid_outlines_what_is_sent():
    step = ring_steps(4)[1]  # reduce-scatter step 1: rank r sends chunk r
    fig = ring_grid(step)
    edges = {p.get_gid(): p.get_linewidth() for p in fig.axes[0].patches
             if (p.get_gid() or "").startswith("ring:")}
    assert {g for g, lw in edges.items() if lw == 2.0} == {
        f"ring:{r}:{r}" for r in range(4)}
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert "0+3" in texts and texts.count("Σ") == 0


def _rec(op, wire, bus, rank):
    return Record(op=op, group_size=4, dtype="float32", elements=0, payload_bytes=0,
                  bus_bytes=bus, wire_bytes=wire, seconds=0.0, start=0.0,
                  complete=True, phase="other", module=None, rank=rank)


def test_traffic_by_collective_has_one_bar_per_rank_and_one_line_per_op():
    ledgers = {r: [_rec("all_reduce", 6 * MiB, 6 * MiB, r),
                   _rec("scatter", (3 * MiB if r == 0 else 0), 3 * MiB, r)]
               for r in range(4)}
    ax = traffic_by_collective(ledgers).axes[0]
    bars = {c.get_label(): [p.get_height() for p in c.patches] for c in ax.containers}
    assert bars == {f"rank {r}": [6, 3 if r == 0 else 0] for r in range(4)}
    lines = [seg[0][1] for coll in ax.collections for seg in coll.get_segments()]
    assert lines == [6, 3]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["all-reduce", "scatter"]
    labels = [t.get_text() for t in ax.get_legend().texts]
    assert labels == ["bus bytes, S × factor", "rank 0", "rank 1", "rank 2", "rank 3"]
