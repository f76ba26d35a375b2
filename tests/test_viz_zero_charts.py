"""labkit.viz.zero_charts: the steward grid and the bars by stage, read back from
what they draw (colours, fill, labels, legend entries), not from pixels."""

import matplotlib
import pytest
from matplotlib.colors import to_hex

from labkit import viz
from labkit.units import MiB
from labkit.viz.style import LabFigure
from labkit.viz.zero_charts import STATE_COLORS


def _strips(ax) -> dict:
    """gid "rank/layer/state" -> (colour, filled height out of 0.8)."""
    return {p.get_gid(): (to_hex(p.get_facecolor()), round(p.get_height() / 0.8, 6))
            for p in ax.patches if p.get_gid()}


# G0 holds all of L1's optimizer state and a quarter of L2's; every rank all of A
HOLDS = {0: {"L1": {"A": 1.0, "C": 1.0, "E": 1.0}, "L2": {"A": 1.0, "C": 0.25}},
         1: {"L1": {"A": 1.0}, "L2": {"A": 1.0, "C": 0.75, "E": 1.0}}}


def test_steward_grid_fills_each_strip_to_the_share_held():
    fig = viz.steward_grid(HOLDS, rank_label="G{}", title="ZeRO-1")
    ax = fig.axes[0]
    strips = _strips(ax)
    # 2 ranks x 2 layers x the 3 states met (A, C, E in that order), each drawn
    assert len(strips) == 12
    assert strips["0/L1/C"] == (STATE_COLORS["C"].lower(), 1.0)
    assert strips["0/L2/C"] == (STATE_COLORS["C"].lower(), 0.25)
    assert strips["1/L2/C"][1] == 0.75
    assert strips["1/L1/E"][1] == 0.0 and strips["0/L2/E"][1] == 0.0  # not held
    assert strips["1/L1/A"] == (STATE_COLORS["A"].lower(), 1.0)
    # strips go A, C, E from left to right inside a cell
    xs = {g.rsplit("/", 1)[1]: p.get_x() for p in ax.patches
          if (g := p.get_gid()) and g.startswith("0/L1/")}
    assert xs["A"] < xs["C"] < xs["E"]
    texts = [t.get_text() for t in ax.texts]
    assert {"G0", "G1", "L1", "L2"} <= set(texts)
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["A: bf16 weights (Parameter)", "C: Adam's m (Optstate)",
                      "E: bf16 gradients (Gradient)", "not held"]
    assert ax.get_title() == "ZeRO-1"


def test_steward_grid_takes_other_states_and_names():
    holds = [{"W": {"opt": 0.5}}, {"W": {"opt": 0.5}}]
    ax = viz.steward_grid(holds, names={"opt": "optimizer state"}).axes[0]
    assert _strips(ax)["1/W/opt"][1] == 0.5
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "optimizer state", "not held"]


def test_steward_grids_one_panel_per_stage_and_one_legend():
    panels = {"DP": HOLDS, "ZeRO-1": HOLDS, "ZeRO-2": HOLDS}
    fig = viz.steward_grids(panels, ncols=2)
    titled = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title() for ax in titled] == ["DP", "ZeRO-1", "ZeRO-2"]
    assert len(fig.axes) == 4  # 2 x 2, the fourth left empty
    assert all(ax.get_legend() is None for ax in fig.axes)
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()][-1] == "not held"
    assert len(legend.get_texts()) == 4  # A, C, E and "not held"


def test_stage_bars_stack_parts_per_rank_and_draw_the_expected_line():
    per_stage = {"DP": [{"Parameter": 2 * MiB, "Optstate": 12 * MiB}] * 2,
                 "ZeRO-1": [{"Parameter": 2 * MiB, "Optstate": 6 * MiB}] * 2}
    fig = viz.stage_bars(per_stage, {"DP": 14 * MiB, "ZeRO-1": 8 * MiB},
                         expected_label="theory", title="model states")
    ax = fig.axes[0]
    bars = {}
    for c in ax.containers:
        bars[c.patches[0].get_gid()] = [p.get_height() for p in c.patches]
    assert bars == {"DP/Parameter": [2, 2], "DP/Optstate": [12, 12],
                    "ZeRO-1/Parameter": [2, 2], "ZeRO-1/Optstate": [6, 6]}
    opt = [c for c in ax.containers if c.patches[0].get_gid() == "ZeRO-1/Optstate"]
    assert [p.get_y() for p in opt[0].patches] == [2, 2]  # stacked on the parameters
    assert to_hex(opt[0].patches[0].get_facecolor()) == viz.CATEGORY_COLORS[
        "Optstate"].lower()
    lines = {c.get_gid(): c.get_segments()[0][0][1] for c in ax.collections}
    assert lines == {"DP/expected": 14, "ZeRO-1/expected": 8}
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "Parameter", "Optstate", "theory"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0", "1", "0", "1"]


def test_stage_bars_labels_collectives_and_leaves_global_state_alone():
    import matplotlib.pyplot as plt

    before = dict(matplotlib.rcParams)
    per_stage = {"ZeRO-2": {0: {"all_to_all": 3 * MiB, "all_gather": 3 * MiB}}}
    fig = viz.stage_bars(per_stage, labels={"all_to_all": "reduce-scatter"})
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "reduce-scatter", "all_gather"]
    heights = [p.get_height() for c in ax.containers for p in c.patches]
    assert heights == pytest.approx([3, 3])
    assert dict(matplotlib.rcParams) == before and plt.get_fignums() == []


def test_stage_bars_can_write_each_total():
    per_stage = {"a": [{"Optstate": 8 * MiB}, {"Optstate": 0.004 * MiB}]}
    ax = viz.stage_bars(per_stage, totals=True).axes[0]
    assert [t.get_text() for t in ax.texts] == ["8", "0.004"]


def _drawn(fig):
    """The figure laid out and drawn (constrained layout runs at draw time), and
    its renderer, to read text extents back in display units."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return canvas.get_renderer()


# chapter 07's traffic chart: the tallest stack (FSDP2) has a part of zero bytes
# (all_reduce) on top, which pinned the y-axis to that stack's top
SENT = {"FSDP": [{"all_gather": 2 * MiB, "all_to_all": 1 * MiB}] * 4,
        "FSDP2": [{"all_gather": 3 * MiB, "all_to_all": 1 * MiB}] * 4,
        "DDP\nafter": [{"all_reduce": 2 * MiB}] * 4}
EXPECTED = {"FSDP": 3 * MiB, "FSDP2": 4 * MiB, "DDP\nafter": 2 * MiB}


@pytest.mark.parametrize("totals", [False, True])
def test_stage_bars_keep_every_expected_line_and_total_inside_the_axes(totals):
    fig = viz.stage_bars(SENT, EXPECTED, totals=totals)
    ax = fig.axes[0]
    renderer = _drawn(fig)
    lo, hi = ax.get_ylim()
    ys = {c.get_gid(): c.get_segments()[0][0][1] for c in ax.collections}
    assert ys == {"FSDP/expected": 3, "FSDP2/expected": 4, "DDP\nafter/expected": 2}
    assert all(lo < y < hi for y in ys.values()), (ys, (lo, hi))
    # with room to see the line above the tallest bar: at least 4 points
    top = ax.transData.transform((0, 4))[1]
    assert ax.get_window_extent(renderer).y1 - top >= 4 * fig.dpi / 72
    inside = ax.get_window_extent(renderer)
    for t in ax.texts:  # the totals, when written, fit under the top spine
        box = t.get_window_extent(renderer)
        assert box.y1 <= inside.y1 and box.y0 >= inside.y0, t.get_text()


@pytest.mark.parametrize("height", [None, 3.0, 2.4])
def test_stage_bars_put_the_rank_label_between_ranks_and_stage_names(height):
    # the stage names hung at a fraction of the axes' height below it: on a
    # shorter axes they rose into the "rank" label. None: the chart's own figure
    if height is None:
        fig = viz.stage_bars(SENT, EXPECTED)
    else:
        fig = LabFigure(figsize=(8, height), layout="constrained")
        viz.stage_bars(SENT, EXPECTED, ax=fig.add_subplot())
    ax = fig.axes[0]
    renderer = _drawn(fig)
    (sec,) = ax.child_axes
    groups = [t for t in sec.get_xticklabels() if t.get_text()]
    assert [t.get_text() for t in groups] == ["FSDP", "FSDP2", "DDP\nafter"]
    label = ax.xaxis.label.get_window_extent(renderer)
    assert ax.xaxis.label.get_text() == "rank"
    ranks = [t.get_window_extent(renderer) for t in ax.get_xticklabels()]
    names = [t.get_window_extent(renderer) for t in groups]
    for box in ranks + names:
        assert not label.overlaps(box), (label, box)
    # top to bottom: the ranks, "rank", the stages' names, a few points apart
    gap = 4 * fig.dpi / 72
    assert min(b.y0 for b in ranks) >= label.y1
    assert label.y0 - max(b.y1 for b in names) >= gap
    # and all of it on the canvas
    canvas = fig.bbox
    for box in [label] + ranks + names:
        assert canvas.x0 <= box.x0 and box.x1 <= canvas.x1 and canvas.y0 <= box.y0
