"""labkit.viz's chapter-13 charts: what each draws (its lines, marks and bars),
not pixels."""

from labkit import viz


def _by_gid(ax):
    return {a.get_gid(): a for a in [*ax.lines, *ax.patches] if a.get_gid()}


def test_waste_curve_draws_minutes_percent_and_a_line_per_mark():
    fig = viz.waste_curve([60, 120, 180], [0.5, 0.25, 0.3],
                          {"Young": 120, "Daly": 110})
    ax = fig.axes[0]
    lines = _by_gid(ax)
    assert list(lines["line:waste"].get_xdata()) == [1, 2, 3]
    assert list(lines["line:waste"].get_ydata()) == [50, 25, 30]
    assert list(lines["mark:Young"].get_xdata()) == [2, 2]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["checkpoint cost + expected loss", "Young: 2.0 min",
                      "Daly: 1.8 min"], labels


def test_loss_curves_one_line_per_run_from_step_one():
    fig = viz.loss_curves({"DDP": [3.0, 2.0], "DiLoCo": [3.0, 2.5]})
    lines = _by_gid(fig.axes[0])
    assert list(lines["line:DiLoCo"].get_xdata()) == [1, 2]
    assert list(lines["line:DDP"].get_ydata()) == [3.0, 2.0]


def test_bytes_per_step_groups_the_runs_bars_by_step():
    fig = viz.bytes_per_step({"DDP": [2048, 2048], "H=2": [0, 4096]}, unit=1024)
    ax = fig.axes[0]
    heights = {c.get_label(): [p.get_height() for p in c.patches]
               for c in ax.containers}
    assert heights == {"DDP": [2, 2], "H=2": [0, 4]}, heights
    assert ax.get_ylabel() == "sent (KiB)"
