"""labkit.viz.pipeline_charts: what the pipeline charts draw, read back: a bar per
recorded pass, idle where no pass ran, a legend entry per kind drawn, the
micro-batch numbers, and nothing outside the figure."""

import pytest

from labkit.ledger import Span
from labkit.parallel.pipeline_schedules import simulate_schedule
from labkit.viz.pipeline_charts import (
    bubble_vs_m,
    pipeline_timeline,
    pipeline_timelines,
    schedule_timeline,
    schedule_timelines,
)


def _bars(ax) -> dict[str, list[tuple[float, float]]]:
    """gid -> [(x0, x1)] of every broken_barh rectangle."""
    out = {}
    for coll in ax.collections:
        if coll.get_gid():
            out[coll.get_gid()] = sorted(
                (round(float(p.vertices[:, 0].min()), 6),
                 round(float(p.vertices[:, 0].max()), 6)) for p in coll.get_paths())
    return out


def _legend(ax) -> list[str]:
    return [t.get_text() for t in ax.get_legend().get_texts()]


def _inside(fig) -> None:
    """Every axes and legend lies inside the figure, as it is saved."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    r = canvas.get_renderer()
    box = fig.bbox
    for ax in fig.axes:
        things = [ax.get_window_extent(r)]
        if ax.get_legend():
            things.append(ax.get_legend().get_window_extent(r))
        for b in things:
            assert b.x0 >= box.x0 - 1 and b.x1 <= box.x1 + 1, (b, box)
            assert b.y0 >= box.y0 - 1 and b.y1 <= box.y1 + 1, (b, box)


def _events():
    # two stages, two micro-batches, GPipe; times in seconds
    return {0: [Span("compute", "forward 0", 10.000, 10.010),
                Span("comm", "send activation 0", 10.010, 10.011, 64),
                Span("compute", "forward 1", 10.011, 10.021),
                Span("comm", "send activation 1", 10.021, 10.022, 64),
                Span("comm", "recv gradient 0", 10.022, 10.050, 64),
                Span("compute", "backward 0", 10.050, 10.070),
                Span("comm", "recv gradient 1", 10.070, 10.071, 64),
                Span("compute", "backward 1", 10.071, 10.091)],
            1: [Span("comm", "recv activation 0", 10.000, 10.011, 64),
                Span("compute", "forward 0", 10.011, 10.021),
                Span("comm", "recv activation 1", 10.021, 10.022, 64),
                Span("compute", "forward 1", 10.022, 10.032),
                Span("compute", "backward 0", 10.032, 10.050),
                Span("comm", "send gradient 0", 10.050, 10.051, 64),
                Span("compute", "backward 1", 10.051, 10.070),
                Span("comm", "send gradient 1", 10.070, 10.071, 64)]}


def test_measured_timeline_draws_every_span():
    events = _events()
    fig = pipeline_timeline(events, title="GPipe")
    ax = fig.axes[0]
    bars = _bars(ax)
    for rank, evs in events.items():  # one rectangle per recorded span, by kind
        for kind in ("forward", "backward", "send", "recv"):
            n = sum(e.name.startswith(kind) for e in evs)
            assert len(bars[f"{rank}:{kind}"]) == n, (rank, kind)
    # ms since the first pass; idle = the window 0-91 ms minus each stage's passes
    assert bars["0:forward"] == [(0.0, 10.0), (11.0, 21.0)]
    assert bars["0:idle"] == [(10.0, 11.0), (21.0, 50.0), (70.0, 71.0)]
    assert bars["1:idle"] == [(0.0, 11.0), (21.0, 22.0), (50.0, 51.0), (70.0, 91.0)]
    assert _legend(ax) == ["forward (F)", "backward (B)",
                           "receive: posted to arrived", "send: posted to done",
                           "idle (bubble)"]
    labels = sorted(t.get_text() for t in ax.texts)
    assert labels == ["0"] * 4 + ["1"] * 4  # each pass's micro-batch
    # stage 0 computed 60 of 91 ms, stage 1 57
    assert ax.get_title() == "GPipe: idle 34% on stage 0, 37% on stage 1 (a timing)"
    assert [t.get_text() for t in ax.get_yticklabels()] == ["stage 0", "stage 1"]
    _inside(fig)


def test_measured_timeline_counts_from_the_first_pass():
    # stage 1 posted its receive 0.2 s before the step's first pass (it finished the
    # previous step first): drawn from the first pass, not stretching the axis
    events = _events()
    events[1][0] = Span("comm", "recv activation 0", 9.800, 10.011, 64)
    events[0].insert(0, Span("comm", "recv gradient 9", 9.500, 9.600, 64))
    ax = pipeline_timeline(events).axes[0]
    bars = _bars(ax)
    assert bars["1:recv"][0] == (0.0, 11.0)
    assert len(bars["0:recv"]) == 2  # the one that ended before the step is left out
    assert ax.get_xlim()[0] > -2 and ax.get_xlabel() == "ms since the first pass began"
    assert bars["0:forward"] == [(0.0, 10.0), (11.0, 21.0)]


def test_measured_timeline_without_passes_raises():
    with pytest.raises(ValueError, match="no compute spans"):
        pipeline_timeline({0: [Span("comm", "recv activation 0", 1.0, 2.0, 64)]})


def test_measured_timelines_stack_runs_on_one_axis():
    short = {r: [Span("compute", "forward 0", 5.0, 5.001)] for r in (0, 1)}
    fig = pipeline_timelines({"GPipe": _events(), "short": short}, title="two")
    assert [ax.get_title().split(":")[0] for ax in fig.axes] == ["GPipe", "short"]
    assert fig.axes[1].get_xlim()[1] >= 91.0  # the longer run fits
    assert fig.axes[0].get_legend() is not None and fig.axes[1].get_legend() is None
    assert fig.axes[1].get_xlabel() == "ms since each run's first pass began"
    _inside(fig)


def test_simulated_timeline_1f1b():
    sim = simulate_schedule("1f1b", 4, 8)
    fig = schedule_timeline(sim)
    ax = fig.axes[0]
    bars = _bars(ax)
    for r in range(4):
        assert len(bars[f"{r}:forward"]) == len(bars[f"{r}:backward"]) == 8
        assert sum(b - a for a, b in bars[f"{r}:idle"]) == pytest.approx(
            sim.makespan * sim.bubble(r))
    assert _legend(ax) == ["forward (F)", "backward (B)", "idle (bubble)"]
    assert ax.get_title() == "1f1b, p=4, m=8: idle 27.3% of the step (simulated)"
    _inside(fig)


def test_zero_bubble_and_interleaved_name_their_passes():
    ax = schedule_timeline(simulate_schedule("zb-h1", 4, 8)).axes[0]
    assert _legend(ax) == ["forward (F)", "input gradient (B)",
                           "weight gradient (W)", "idle (bubble)"]
    assert len(_bars(ax)["3:weights"]) == 8
    ax = schedule_timeline(simulate_schedule("interleaved", 2, 4, 2)).axes[0]
    assert _legend(ax) == ["forward (F), chunk 0", "forward (F), chunk 1",
                           "backward (B), chunk 0", "backward (B), chunk 1",
                           "idle (bubble)"]
    assert len(_bars(ax)["0:forward/1"]) == 4
    colours = {tuple(c.get_facecolor()[0]) for c in ax.collections
               if c.get_gid() in ("0:forward/0", "0:forward/1")}
    assert len(colours) == 2  # chunks in two shades


def test_stacked_timelines_show_the_longest_whole():
    sims = {"GPipe": simulate_schedule("gpipe", 4, 8),
            "ZB-H1": simulate_schedule("zb-h1", 4, 8)}
    fig = schedule_timelines(sims, title="p=4, m=8")
    assert [ax.get_title().split(":")[0] for ax in fig.axes] == ["GPipe", "ZB-H1"]
    lo, hi = fig.axes[1].get_xlim()  # shared: the longer GPipe step fits
    assert lo < 0 and hi >= sims["GPipe"].makespan
    assert fig.get_suptitle() == "p=4, m=8"
    _inside(fig)


def test_bubble_vs_m():
    ms = [1, 2, 4, 8]
    fig = bubble_vs_m({"GPipe, 1F1B": (ms, [3 / (m + 3) for m in ms])},
                      {"GPipe, 1F1B": (ms, [0.75, 0.6, 3 / 7, 3 / 11]),
                       "measured": ([4], [0.5])})
    ax = fig.axes[0]
    lines = {ln.get_gid(): list(ln.get_ydata()) for ln in ax.lines}
    assert lines["line:GPipe, 1F1B"] == [0.75, 0.6, 3 / 7, 3 / 11]
    assert lines["points:measured"] == [0.5]
    assert _legend(ax) == ["GPipe, 1F1B", "GPipe, 1F1B (simulated)", "measured"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "2", "4", "8"]
    markers = {ln.get_gid(): ln.get_marker() for ln in ax.lines}
    assert markers["points:GPipe, 1F1B"] != markers["points:measured"]
    _inside(fig)


def test_charts_take_an_ax():
    import matplotlib

    fig = matplotlib.figure.Figure()
    ax = fig.add_subplot()
    assert pipeline_timeline(_events(), ax=ax) is fig
    assert schedule_timeline(simulate_schedule("gpipe", 2, 2), ax=ax) is fig


def test_bubble_vs_m_dodges_points_that_share_an_m():
    ms = [1, 2, 4]
    curves = {"closed form": (ms, [0.5, 1 / 3, 0.2])}
    points = {"GPipe": (ms, [0.52, 0.35, 0.26]), "1F1B": ([4], [0.26])}
    ax = bubble_vs_m(curves, points).axes[0]  # default: every marker at its m
    xs = {ln.get_gid(): list(ln.get_xdata()) for ln in ax.lines}
    assert xs["points:GPipe"] == ms and xs["points:1F1B"] == [4]
    fig = bubble_vs_m(curves, points, dodge=True)
    ax = fig.axes[0]
    xs = {ln.get_gid(): list(ln.get_xdata()) for ln in ax.lines}
    sizes = {ln.get_gid(): ln.get_markersize() for ln in ax.lines}
    assert xs["points:GPipe"][:2] == [1, 2]  # alone at its m: not moved
    assert xs["points:GPipe"][2] < 4 < xs["points:1F1B"][0] < 4.5  # side by side
    assert sizes["points:GPipe"] > sizes["points:1F1B"]
    assert xs["line:closed form"] == ms  # lines stay where they are
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "2", "4"]
    _inside(fig)


def test_stacked_timelines_with_the_legend_below():
    sims = {"interleaved": simulate_schedule("interleaved", 4, 8, 2)}
    fig = schedule_timelines(sims, lane=0.6, legend="below", label_size=8)
    ax = fig.axes[0]
    assert _legend(ax)[0] == "forward (F), chunk 0"
    sizes = {t.get_fontsize() for t in ax.texts}
    assert sizes == {8}
    _inside(fig)  # draws it
    r = fig.canvas.get_renderer()
    assert ax.get_legend().get_window_extent(r).y1 < ax.get_window_extent(r).y0
