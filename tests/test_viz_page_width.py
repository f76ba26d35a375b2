"""Every chart fits the course site's article column: saved as the notebook shows
it (LabFigure._repr_png_, 100 dpi, tight), a PNG at most 780 px wide (the 752 px
column shows up to 783 px at 96 % or more: text stays >= 10 px), no text under
MIN_FONT_PT, and a legend moved below the axes sits under the tick labels,
inside the image. Inputs as large as the chapters'."""

import struct

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.text import Text

from labkit import viz
from labkit.comm import all_to_all_transfers, fat_tree, ring_steps, route
from labkit.ledger import Record, Span
from labkit.parallel.pipeline_schedules import simulate_schedule
from labkit.parallel.ring_attention import ring_schedule
from labkit.theory import PUBLISHED_RUNS, activation_terms, hardware
from labkit.units import KiB, MiB
from labkit.viz.style import MIN_FONT_PT, PAGE_WIDTH_IN

MAX_PX = 780  # the browser test holds the built pages to 96 %


def _rec(op, rank):
    return Record(op=op, group_size=4, dtype="float32", elements=0, payload_bytes=0,
                  bus_bytes=MiB, wire_bytes=MiB, seconds=0.001, start=0.001 * rank,
                  complete=True, phase="other", module=None, rank=rank)


def _spans(k=6):
    return {r: [Span("compute", "backward", 0.001 * r, 0.03)]
            + [Span("comm", f"all_reduce bucket {i}", 0.03 + 0.001 * i,
                    0.05 + 0.01 * i, 8) for i in range(k)] for r in range(4)}


def _pipe_spans():
    return {0: [Span("compute", "forward 0", 0.0, 0.01),
                Span("comm", "send activation 0", 0.01, 0.011, 64),
                Span("comm", "recv gradient 0", 0.011, 0.04, 64),
                Span("compute", "backward 0", 0.04, 0.06)],
            1: [Span("comm", "recv activation 0", 0.0, 0.011, 64),
                Span("compute", "forward 0", 0.011, 0.021),
                Span("compute", "backward 0", 0.021, 0.04),
                Span("comm", "send gradient 0", 0.04, 0.041, 64)]}


def _ops(a, b, c):
    return {"all_reduce": a, "all_to_all": b, "all_gather": c}


def _holds():
    full = {s: 1.0 for s in "ABCDE"}
    return [{f"L{lay}": dict(full) for lay in range(1, 5)} for _ in range(4)]


def _memory():
    return {f"{how}, rank {r}": {"Parameter": MiB, "Gradient": MiB, "Optstate": MiB}
            for how in ("FSDP", "FSDP2", "DDP") for r in range(4)}


def _activations():
    kw = {"seq": 64, "batch": 2, "hidden": 64, "heads": 4}
    return {"one process": activation_terms(**kw),
            "TP": activation_terms(**kw, tp=4),
            "TP + SP": activation_terms(**kw, tp=4, sp=True),
            "TP + selective": activation_terms(**kw, tp=4, recompute="selective"),
            "TP + SP + selective": activation_terms(**kw, tp=4, sp=True,
                                                    recompute="selective"),
            "TP + full": activation_terms(**kw, tp=4, recompute="full"),
            "TP + SP + full": activation_terms(**kw, tp=4, sp=True,
                                               recompute="full")}


def _fat_tree():
    ft = fat_tree(2, 8, 450e9, 50e9)
    return route(ft, all_to_all_transfers(ft.devices, 1e9)), ft


def _llama():
    return PUBLISHED_RUNS["llama3-405b"]


OPS8 = ["broadcast", "reduce", "all_reduce", "reduce_scatter", "all_gather",
        "scatter", "gather", "all_to_all"]
SCHEMES = ["naive: all-reduce after backward", "naive, buckets of 1 MiB (control)",
           "per parameter, overlapped", "buckets of 1 MiB, overlapped",
           "PyTorch DDP, buckets of 1 MiB"]

CHARTS = {
    "memory_by_rank, 12 bars": lambda: viz.memory_by_rank(
        _memory(), title="Held by each rank after a step (ledger)"),
    "traffic_by_rank, 8 ranks": lambda: viz.traffic_by_rank(
        {r: [_rec("all_reduce", r), _rec("broadcast", r)] for r in range(8)}),
    "timeline_by_rank": lambda: viz.timeline_by_rank(
        {r: [_rec("all_reduce", r), _rec("broadcast", r)] for r in range(4)}),
    "traffic_by_collective, 8 ops": lambda: viz.traffic_by_collective(
        {r: [_rec(op, r) for op in OPS8] for r in range(4)}),
    "dp_traffic, 8 ranks": lambda: viz.dp_traffic(
        {"a": [MiB] * 8, "b": [2 * MiB] * 8}, {"a": [MiB] * 8, "b": [2 * MiB] * 8}),
    "dp_timeline": lambda: viz.dp_timeline(_spans(), title=SCHEMES[0]),
    "dp_timelines, 5 panels": lambda: viz.dp_timelines(
        {name: _spans() for name in SCHEMES}, share_label="in this step",
        title="The last of six steps, rank by rank (a timing)", tick_labels=True),
    "stage_bars, 4 stages": lambda: viz.stage_bars(
        {"DP": [_ops(3 * MiB, 0, 0)] * 4, "ZeRO-1": [_ops(0, MiB, MiB)] * 4,
         "ZeRO-2": [_ops(0, MiB, MiB)] * 4,
         "ZeRO-1\nafter all-reduce": [_ops(3 * MiB, 0, MiB)] * 4},
        {"DP": 3 * MiB, "ZeRO-1": 2 * MiB, "ZeRO-2": 2 * MiB,
         "ZeRO-1\nafter all-reduce": 4 * MiB},
        labels={"all_to_all": "all_to_all (gloo's reduce-scatter)"}, totals=True,
        expected_label="theory.zero_traffic", title="Traffic per rank: measured"),
    "stage_bars, long stage names": lambda: viz.stage_bars(
        {k: [_ops(KiB, KiB, KiB)] * 4 for k in (
            "TP", "TP + SP, gathered input kept", "TP + SP (Megatron)")},
        unit=KiB, unit_name="KiB"),
    "steward_grids, 2 x 2": lambda: viz.steward_grids(
        {f"panel {i}": _holds() for i in range(4)}, rank_label="G{}"),
    "steward_grid, 6 layers": lambda: viz.steward_grid(
        [{f"L{lay}": {s: 1.0 for s in "ABCDEF"} for lay in range(6)}] * 4),
    "zero_bars, 6 bars": lambda: viz.zero_bars(
        {f"N = {n}": type("Z", (), {"parameter": 2e9, "gradient": 2e9,
                                     "optstate": 12e9 / n})() for n in range(1, 7)}),
    "pipeline_timeline": lambda: viz.pipeline_timeline(_pipe_spans(), title="GPipe"),
    "pipeline_timelines, 3 runs": lambda: viz.pipeline_timelines(
        {"one batch (m = 1)": _pipe_spans(), "GPipe, m = 4": _pipe_spans(),
         "1F1B, m = 4": _pipe_spans()}, title="Two stages (a timing)"),
    "schedule_timeline": lambda: viz.schedule_timeline(
        simulate_schedule("zb-h1", 4, 8)),
    "schedule_timelines, 3 schedules": lambda: viz.schedule_timelines(
        {"GPipe": simulate_schedule("gpipe", 4, 8),
         "1F1B": simulate_schedule("1f1b", 4, 8),
         "ZB-H1": simulate_schedule("zb-h1", 4, 8)}, title="p = 4, m = 8"),
    "schedule_timelines, interleaved": lambda: viz.schedule_timelines(
        {"interleaved": simulate_schedule("interleaved", 4, 8, 2)}, lane=0.6,
        label_size=8),
    "step_time_bars": lambda: viz.step_time_bars(
        _llama().choose(), published=_llama().layout),
    "gemm_roofline": lambda: viz.gemm_roofline(
        _llama().cluster, {f"QKV, {t} tokens": (t, 2304, 16384)
                           for t in (8192, 1024, 256, 32)}),
    "activation_bars, 7 strategies": lambda: viz.activation_bars(
        _activations(), {k: sum(v.values()) for k, v in _activations().items()},
        unit=KiB, unit_name="KiB"),
    "link_load, 2 x 8 fat tree": lambda: viz.link_load(*_fat_tree(),
                                                       metric="seconds"),
    "hierarchy": lambda: viz.hierarchy(hardware.H100_HIERARCHY
                                       + hardware.TPU_FIGURES),
    "ring_grid, 16 ranks": lambda: viz.ring_grid(ring_steps(16)[3]),
    "ring_steps_chart, 8 ranks": lambda: viz.ring_steps_chart(
        ring_schedule(8, True)),
}


def _png_width(fig) -> int:
    return struct.unpack(">I", fig._repr_png_()[16:20])[0]


@pytest.mark.parametrize("name", CHARTS)
def test_chart_fits_the_page_with_readable_text(name):
    fig = CHARTS[name]()
    assert fig.get_figwidth() <= PAGE_WIDTH_IN + 1e-9
    assert _png_width(fig) <= MAX_PX, name
    sizes = [t.get_fontsize() for t in fig.findobj(Text)
             if t.get_visible() and t.get_text().strip()]
    assert min(sizes) >= MIN_FONT_PT, name
    # every legend lies inside the saved figure and clear of its axes' tick labels
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    r = canvas.get_renderer()
    box = fig.bbox
    for ax in fig.axes:
        leg = ax.get_legend()
        if leg is None:
            continue
        b = leg.get_window_extent(r)
        assert b.x0 >= box.x0 - 1 and b.x1 <= box.x1 + 1, (name, b, box)
        assert b.y0 >= box.y0 - 1 and b.y1 <= box.y1 + 1, (name, b, box)
        frame = ax.get_window_extent(r)
        if ax.axison and b.y1 <= frame.y0:  # below the axes: under its ticks too
            for t in ax.get_xticklabels():
                if t.get_visible() and t.get_text():
                    assert b.y1 <= t.get_window_extent(r).y0 + 0.5, (name, t)


def test_a_few_bars_keep_the_legend_beside_them():
    fig = viz.memory_by_rank([{"Parameter": MiB}] * 4)
    ax = fig.axes[0]
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    r = canvas.get_renderer()
    assert ax.get_legend().get_window_extent(r).x0 >= ax.get_window_extent(r).x1
    assert fig.get_figwidth() < PAGE_WIDTH_IN


def test_many_bars_put_the_legend_below_and_the_page_width_to_the_bars():
    fig = viz.memory_by_rank(_memory())
    ax = fig.axes[0]
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    r = canvas.get_renderer()
    assert ax.get_legend().get_window_extent(r).y1 < ax.get_window_extent(r).y0
    assert fig.get_figwidth() == PAGE_WIDTH_IN
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["Parameter", "Gradient", "Optstate"]


def test_stacked_timelines_name_every_kind_over_the_top_panel():
    fig = viz.dp_timelines({"a": _spans(), "b": {0: [
        Span("compute", "backward", 0.0, 0.01),
        Span("comm", "all_gather", 0.01, 0.02, 4)]}})
    top, below = fig.axes
    assert below.get_legend() is None
    labels = [t.get_text() for t in top.get_legend().get_texts()]
    assert labels == ["backward (compute)", "all_reduce: issued to done",
                      "all_gather: issued to done"]
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    r = canvas.get_renderer()
    # over the top panel's title, under the figure's top
    assert top.get_legend().get_window_extent(r).y0 >= (
        top.title.get_window_extent(r).y1 - 0.5)


@pytest.mark.parametrize("n", [4, 8])
def test_a_grid_keeps_its_legend_beside_it_while_the_figure_fits(n):
    fig = viz.ring_steps_chart(ring_schedule(n, True))
    ax = fig.axes[0]
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    r = canvas.get_renderer()
    legend, frame = ax.get_legend().get_window_extent(r), ax.get_window_extent(r)
    beside = legend.x0 >= frame.x1 - 1
    assert beside == (n == 4)  # 4 ranks fit with the legend beside, 8 do not
    assert _png_width(fig) <= MAX_PX
