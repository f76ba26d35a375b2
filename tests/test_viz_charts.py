"""labkit.viz charts (ledger_charts, tables, theory_charts): the data each figure
draws, not pixels."""

import matplotlib
import pytest

from labkit import viz
from labkit.ledger import Record
from labkit.units import MiB


def _rec(op, wire, bus, start, seconds, rank=0):
    return Record(op=op, group_size=4, dtype="float32", elements=0, payload_bytes=0,
                  bus_bytes=bus, wire_bytes=wire, seconds=seconds, start=start,
                  complete=True, phase="other", module=None, rank=rank)


def _bars(ax):
    return {c.get_label(): [p.get_height() for p in c.patches] for c in ax.containers}


def test_memory_by_rank_stacks_categories_and_draws_expectations():
    per_rank = [{"Parameter": 4 * MiB, "Gradient": 4 * MiB, "Optstate": 0},
                {"Parameter": 4 * MiB, "Gradient": 2 * MiB, "Activation": 1 * MiB}]
    fig = viz.memory_by_rank(per_rank, expected=[8 * MiB, 7 * MiB])
    ax = fig.axes[0]
    assert _bars(ax) == {"Parameter": [4, 4], "Gradient": [4, 2], "Activation": [0, 1]}
    bottoms = [p.get_y() for p in ax.containers[2].patches]  # Activation sits on top
    assert bottoms == [8, 6]
    lines = [seg[0][1] for coll in ax.collections for seg in coll.get_segments()]
    assert lines == [8, 7]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["rank 0", "rank 1"]


def test_traffic_by_rank_puts_wire_next_to_model():
    ledgers = {0: [_rec("all_reduce", 3 * MiB, 3 * MiB, 0, 1),
                   _rec("broadcast", 2 * MiB, 1 * MiB, 1, 1)],
               1: [_rec("all_reduce", 3 * MiB, 3 * MiB, 0, 1),
                   _rec("broadcast", 0, 1 * MiB, 1, 1)]}
    bars = _bars(viz.traffic_by_rank(ledgers).axes[0])
    assert bars == {"all_reduce (wire)": [3, 3], "all_reduce (bus model)": [3, 3],
                    "broadcast (wire)": [2, 0], "broadcast (bus model)": [1, 1]}


def test_unknown_wire_bytes_are_not_drawn_as_zero():
    ledgers = {0: [_rec("send", None, 2 * MiB, 0, 1)], 1: [_rec("recv", None, 2 * MiB,
                                                             0, 1)]}
    ax = viz.traffic_by_rank(ledgers).axes[0]
    bars = _bars(ax)
    wire = bars["send (wire: not measured)"]
    assert wire[0] != wire[0] and wire[1] == 0  # NaN: nothing drawn; rank 1 sent none
    assert bars["send (bus model)"] == [2, 0]


def test_timeline_has_one_lane_per_rank_with_compute_between_collectives():
    class L:  # what a TrafficLedger carries back from a rank
        def __init__(self, start, stop, records):
            self.start, self.stop, self.records = start, stop, records

    ledgers = [L(10.0, 14.0, [_rec("all_reduce", 1, 1, 11.0, 1.0)]),
               L(10.5, 13.0, [_rec("all_gather", 1, 1, 12.0, 0.5, rank=1)])]
    ax = viz.timeline(ledgers).axes[0]
    got = []
    for coll in ax.collections:
        for path in coll.get_paths():
            xs = path.vertices[:, 0]
            ys = path.vertices[:, 1]
            got.append((round(float(xs.min()), 3), round(float(xs.max()), 3),
                        round(float(ys.mean()))))
    # rank 0 (lane 0): compute 0-1, all_reduce 1-2, compute 2-4
    # rank 1 (lane 1): compute 0.5-2, all_gather 2-2.5, compute 2.5-3
    assert sorted(got) == sorted([(0.0, 1.0, 0), (2.0, 4.0, 0), (1.0, 2.0, 0),
                                  (0.5, 2.0, 1), (2.5, 3.0, 1), (2.0, 2.5, 1)])
    assert "timing" in ax.get_title()


def test_measured_vs_expected_table():
    t = viz.measured_vs_expected([("all_reduce", 101.0, 100.0), ("zero", 0, 0)],
                                   tolerance=0.02)
    assert t.rows[0].rel_error == pytest.approx(0.01)
    assert t.rows[1].rel_error == 0
    assert t.max_rel_error == pytest.approx(0.01)
    html = t._repr_html_()
    assert html.count("<tr>") == 3 and "+1.000%" in html and "✓" in html
    assert "all_reduce" in repr(t)


def test_plots_draw_on_a_given_ax_and_leave_global_state_alone():
    import matplotlib.pyplot as plt

    before = dict(matplotlib.rcParams)
    fig = matplotlib.figure.Figure()
    ax = fig.add_subplot()
    out = viz.memory_by_rank([{"Parameter": MiB}], ax=ax)
    assert out is fig and ax.containers
    assert dict(matplotlib.rcParams) == before
    assert plt.get_fignums() == []


def test_zero_bars_and_placement_bars_draw_the_numbers():
    from labkit import theory

    bd = {f"stage {s}": theory.zero_breakdown(7.5e9, 64, s) for s in range(4)}
    ax = viz.zero_bars(bd, highlight="stage 3", capacity=80e9).axes[0]
    bars = _bars(ax)
    assert bars["params"] == pytest.approx([15, 15, 15, 15 / 64])
    assert bars["optimizer"][1] == pytest.approx(90 / 64)
    assert [t.get_text() for t in ax.texts] == ["120.0", "31.4", "16.6", "1.9"]
    cost = theory.PLACEMENTS["ZeRO-3"].cost(1e9, 8, activations=4e9)
    ax = viz.placement_bars(cost).axes[0]
    heights = [p.get_height() for c in ax.containers for p in c.patches]
    assert sum(heights) == pytest.approx((cost.persistent_total + cost.peak_total)
                                         / 1e9)


def test_memory_bars_with_named_keys_keep_order_and_labels():
    d = {"Parameter": 4 * MiB, "Optstate": 8 * MiB}
    fig = viz.memory_by_rank({"fp32": d, "bf16 + fp32 master": d, 3: d})
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels == ["fp32", "bf16 +\nfp32\nmaster", "rank 3"]  # no "rank fp32"
