"""labkit.viz.dp_charts: the data each data-parallel chart draws, not pixels."""

from labkit import viz
from labkit.ledger import Span
from labkit.units import MiB


def _bars(ax):
    return {c.get_label(): [p.get_height() for p in c.patches] for c in ax.containers}


def test_dp_traffic_draws_each_scheme_per_rank_and_its_closed_form():
    measured = {"all-reduce": [1.5 * MiB] * 3,
                "parameter server": [2 * MiB, 1 * MiB, 1 * MiB]}
    expected = {"all-reduce": [1.5 * MiB] * 3,
                "parameter server": [2 * MiB, 1 * MiB, 1 * MiB]}
    ax = viz.dp_traffic(measured, expected, title="one step").axes[0]
    assert _bars(ax) == {"all-reduce (wire)": [1.5, 1.5, 1.5],
                         "parameter server (wire)": [2, 1, 1]}
    dashes = [seg[0][1] for coll in ax.collections for seg in coll.get_segments()]
    assert dashes == [1.5, 1.5, 1.5, 2, 1, 1]  # one closed form over every bar
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["all-reduce (wire)", "parameter server (wire)", "closed form"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["rank 0", "rank 1",
                                                            "rank 2"]
    assert ax.get_title() == "one step" and "MiB" in ax.get_ylabel()
    # two schemes' bars sit side by side, not on top of each other
    lefts = sorted(p.get_x() for c in ax.containers for p in c.patches)
    assert all(b - a > 0.1 for a, b in zip(lefts, lefts[1:]))


def test_dp_traffic_without_expectations_has_no_closed_form_entry():
    ax = viz.dp_traffic({"ddp": {0: MiB, 1: MiB}}).axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["ddp (wire)"] and not ax.collections


def _boxes(ax):
    """(x0, x1, y0, y1, colour) of every bar a broken_barh drew."""
    out = []
    for coll in ax.collections:
        for path, fc in zip(coll.get_paths(), coll.get_facecolors()):
            v = path.vertices
            out.append((round(float(v[:, 0].min()), 3), round(float(v[:, 0].max()), 3),
                        round(float(v[:, 1].min()), 3), round(float(v[:, 1].max()), 3),
                        tuple(round(float(c), 3) for c in fc)))
    return out


def test_dp_timeline_lanes_sub_rows_and_overlap_in_the_title():
    events = {0: [Span("compute", "backward", 10.000, 10.010),
                  Span("comm", "all_reduce bucket 0", 10.002, 10.008, 8),
                  Span("comm", "all_reduce bucket 1", 10.004, 10.020, 8)],
              1: [Span("compute", "backward", 10.001, 10.011),
                  Span("comm", "all_reduce bucket 0", 10.011, 10.021, 16)]}
    ax = viz.dp_timeline(events, title="bucketed").axes[0]
    boxes = _boxes(ax)
    xs = sorted((x0, x1) for x0, x1, *_ in boxes)
    # ms from the first span: rank 0 backward 0-10, buckets 2-8 and 4-20;
    # rank 1 backward 1-11, bucket 11-21
    assert xs == [(0.0, 10.0), (1.0, 11.0), (2.0, 8.0), (4.0, 20.0), (11.0, 21.0)]
    # rank 0's two collectives overlap in time: each in its own sub-row
    comm0 = sorted((y0, y1) for x0, x1, y0, y1, _ in boxes if x0 in (2.0, 4.0))
    assert comm0[0][1] <= comm0[1][0]
    # every bar lies inside its rank's lane
    for x0, _x1, y0, y1, _ in boxes:
        lane = 0 if x0 in (0.0, 2.0, 4.0) else 1
        assert lane - 0.5 < y0 < y1 < lane + 0.5
    # overlap: rank 0 comm union 2..20 = 18 ms, under backward 2..10 = 8 -> 4/9;
    # rank 1: none; mean 2/9 = 22%
    assert ax.get_title() == ("bucketed: 22% of communication time under backward "
                              "(a timing)")
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["backward (compute)", "all_reduce: issued to done"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1"]


def test_dp_timelines_one_panel_per_scheme_on_one_time_axis():
    one = {0: [Span("compute", "backward", 0.0, 0.01),
               Span("comm", "all_reduce bucket 0", 0.01, 0.02, 4)]}
    fig = viz.dp_timelines({"naive": one, "overlapped": one}, title="step")
    assert len(fig.axes) == 2
    assert [ax.get_title().split(":")[0] for ax in fig.axes] == ["naive", "overlapped"]
    assert fig.axes[0].get_shared_x_axes().joined(fig.axes[0], fig.axes[1])
    assert fig.get_suptitle() == "step"
    assert fig.axes[0].get_legend() is not None and fig.axes[1].get_legend() is None
    assert fig.axes[0].get_title().endswith("0% of communication time under "
                                            "backward (a timing)")


def test_the_compute_label_names_title_and_legend():
    one = {0: [Span("compute", "forward", 0.0, 0.01),
               Span("comm", "all_gather", 0.005, 0.02, 4)]}
    fig = viz.dp_timelines({"FSDP": one}, compute="compute")
    ax = fig.axes[0]
    # comm 5..20 ms, compute 0..10: a third of the communication under compute
    assert ax.get_title() == "FSDP: 33% of communication time under compute (a timing)"
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["compute", "all_gather: issued to done"]
    ax = viz.dp_timeline(one, compute="forward").axes[0]
    assert ax.get_legend().get_texts()[0].get_text() == "forward (compute)"


def test_colours_come_from_the_ops():
    events = {0: [Span("comm", "gather bucket 0", 0.0, 1.0, 4),
                  Span("comm", "scatter bucket 0", 1.0, 2.0, 4)]}
    ax = viz.dp_timeline(events).axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["backward (compute)", "gather: issued to done",
                      "scatter: issued to done"]
    from matplotlib.colors import to_rgba

    colours = {b[4] for b in _boxes(ax)}
    assert tuple(round(c, 3) for c in to_rgba(viz.OP_COLORS["gather"])) in colours
    assert tuple(round(c, 3) for c in to_rgba(viz.OP_COLORS["scatter"])) in colours


def test_charts_take_an_ax():
    import matplotlib

    fig = matplotlib.figure.Figure()
    ax = fig.add_subplot()
    assert viz.dp_traffic({"a": [1]}, ax=ax) is fig
    assert viz.dp_timeline({0: [Span("compute", "backward", 0, 1)]}, ax=ax) is fig
