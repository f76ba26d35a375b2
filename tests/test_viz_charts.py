"""labkit.viz charts (ledger, network and theory charts, tables): the data each figure
draws, not pixels."""

import re

import matplotlib
import numpy as np
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


def test_memory_by_rank_colours_parts_that_are_not_categories():
    split = {"Parameter": MiB, "Activation, whole": MiB, "Activation, split": MiB}
    fig = viz.memory_by_rank([split], colors={"Activation, split": "#ff0000"})
    got = {c.get_label(): c.patches[0].get_facecolor()[:3]
           for c in fig.axes[0].containers}
    assert got["Activation, split"] == (1.0, 0.0, 0.0)
    assert got["Parameter"] == (0x4C / 255, 0x72 / 255, 0xB0 / 255)  # its own


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
    ax = viz.timeline_by_rank(ledgers).axes[0]
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
    assert bars["Parameter"] == pytest.approx([15, 15, 15, 15 / 64])
    assert bars["Optstate"][1] == pytest.approx(90 / 64)
    assert [t.get_text() for t in ax.texts] == ["120.0", "31.4", "16.6", "1.9"]
    cost = theory.PLACEMENTS["ZeRO-3"].cost(1e9, 8, activations=4e9)
    ax = viz.placement_bars(cost).axes[0]
    heights = [p.get_height() for c in ax.containers for p in c.patches]
    assert sum(heights) == pytest.approx((cost.persistent_total + cost.peak_total)
                                         / 1e9)


@pytest.mark.parametrize("kw", [
    dict(activations=4e9),
    # chapter 08: the note's fp32 example, one of 32 layers gathered at a time
    dict(k=8, param_bytes=4, grad_bytes=4, gather_fraction=1 / 32)])
def test_placement_bars_write_each_total_inside_the_axes(kw):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from labkit import theory

    cost = theory.PLACEMENTS["ZeRO-3"].cost(1e9, 8, **kw)
    fig = viz.placement_bars(cost)
    ax = fig.axes[0]
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    totals = [f"{cost.persistent_total / 1e9:,.2f}", f"{cost.peak_total / 1e9:,.2f}"]
    assert [t.get_text() for t in ax.texts] == totals
    heights = [p.get_height() for c in ax.containers for p in c.patches]
    assert sum(heights) == pytest.approx((cost.persistent_total + cost.peak_total)
                                         / 1e9)
    # a legend entry for each colour drawn: no activations when there are none
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["P: Parameter", "O: Optstate", "G: Gradient"] + (
        ["A: Activation"] if kw.get("activations") else [])
    box = ax.get_window_extent(renderer)
    for t in ax.texts:
        text = t.get_window_extent(renderer)
        assert box.x0 <= text.x0 and text.x1 <= box.x1, t.get_text()
        assert box.y0 <= text.y0 and text.y1 <= box.y1, (t.get_text(), text, box)


def test_memory_bars_with_named_keys_keep_order_and_labels():
    d = {"Parameter": 4 * MiB, "Optstate": 8 * MiB}
    fig = viz.memory_by_rank({"fp32": d, "bf16 + fp32 master": d, 3: d})
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels == ["fp32", "bf16 +\nfp32\nmaster", "rank 3"]  # no "rank fp32"


# ------------------------------------------------------------- network charts


def _cable_lines(fig):
    """gid "link a|b" -> the Line2Ds drawn for that cable."""
    out = {}
    for line in fig.axes[0].lines:
        gid = line.get_gid() or ""
        if gid.startswith("link "):
            out.setdefault(tuple(gid[5:].split("|")), []).append(line)
    return out


def _luminance(color):
    r, g, b, a = matplotlib.colors.to_rgba(color)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b, a


def _drawn(fig):
    """Lay the figure out as it will be shown (an Agg canvas: no pyplot)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return canvas.get_renderer()


def _assert_every_cable_drawn_visibly(fig, topo):
    _drawn(fig)
    lines = _cable_lines(fig)
    assert set(lines) == set(topo.cables)                       # every cable, once
    w, h = fig.bbox.width, fig.bbox.height
    for cable, drawn in lines.items():
        length = 0.0
        for line in drawn:
            lum, alpha = _luminance(line.get_color())
            assert line.get_visible() and alpha >= 0.9, cable
            assert lum <= 0.8, (cable, line.get_color())            # shows on white
            assert line.get_linewidth() >= 1.0, cable
            px = line.get_transform().transform(line.get_xydata())
            assert (px[:, 0] >= 0).all() and (px[:, 0] <= w).all(), cable   # on the
            assert (px[:, 1] >= 0).all() and (px[:, 1] <= h).all(), cable   # canvas
            length += float(((px[1:] - px[:-1]) ** 2).sum(axis=1).sum() ** 0.5)
        assert length >= 20, (cable, length)   # longer than the markers it joins


def _content_share(fig):
    """Share of the figure's area inside the bounding box of what the axes draw."""
    from matplotlib.transforms import Bbox

    renderer, ax = _drawn(fig), fig.axes[0]
    boxes = [a.get_window_extent(renderer) for a in (*ax.lines, *ax.collections,
                                                     *ax.patches)]
    boxes = [b for b in boxes if np.isfinite(b.get_points()).all()]
    box = Bbox.union(boxes)
    assert boxes and np.isfinite(box.get_points()).all()
    return box.width * box.height / (fig.bbox.width * fig.bbox.height)


def _colorbar(fig):
    (cax,) = [a for a in fig.axes[1:] if getattr(a, "_colorbar", None)]
    return cax._colorbar


def test_link_load_draws_every_torus_cable_with_its_load():
    from labkit.comm.topology import ring_all_reduce_transfers, ring_order, route, torus

    t = torus((4, 4), 45e9)
    r = route(t, ring_all_reduce_transfers(ring_order(t), 1e9))
    fig = viz.link_load(r, t)
    _assert_every_cable_drawn_visibly(fig, t)
    cb = _colorbar(fig)
    assert "GB" in cb.ax.get_ylabel() and cb.mappable.norm.vmax == pytest.approx(1.875)
    lines = _cable_lines(fig)
    used = {tuple(sorted(k)) for k in r.link_bytes}
    assert len(used) == 16                                   # half the 32 cables
    for cable, drawn in lines.items():
        want = (cb.cmap(cb.mappable.norm(1.875)) if cable in used
                else matplotlib.colors.to_rgba("#B0B0B0"))
        assert all(matplotlib.colors.to_rgba(x.get_color()) == pytest.approx(want)
                   for x in drawn), cable
        assert all(x.get_linestyle() == ("-" if cable in used else "--")
                   for x in drawn), cable
    # the 8 wraparound cables are two stubs each, one out of each end
    assert all(len(lines[c]) == 2 for c in t.wraparound) and len(t.wraparound) == 8
    labels = [t_.get_text() for t_ in fig.axes[0].get_legend().get_texts()]
    assert labels == ["device", "cable not used",
                      "wraparound cable: a stub at each end"]


def test_link_load_draws_every_fat_tree_cable_and_fills_the_figure():
    from labkit.comm.topology import all_to_all_transfers, fat_tree, route

    ft = fat_tree(2, 8, 450e9, 50e9)
    r = route(ft, all_to_all_transfers(ft.devices, 1e9))
    fig = viz.link_load(r, ft, metric="seconds")
    _assert_every_cable_drawn_visibly(fig, ft)
    assert len(ft.cables) == 32 and _content_share(fig) >= 0.35   # not a blank image
    cb = _colorbar(fig)
    assert "ms" in cb.ax.get_ylabel()
    assert cb.mappable.norm.vmax == pytest.approx(0.5e9 / 50e9 * 1e3)   # 10 ms on IB
    lines = _cable_lines(fig)
    spine = [c for c in ft.cables if "spine" in c]
    nvlink = [c for c in ft.cables if "spine" not in c]
    lum = {c: _luminance(lines[c][0].get_color())[0] for c in ft.cables}
    assert max(lum[c] for c in spine) < min(lum[c] for c in nvlink)  # IB is darker
    texts = {t.get_text() for t in fig.axes[0].texts}
    assert texts == {"InfiniBand spine", "NVSwitch, node 0", "NVSwitch, node 1"}
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels == ["device", "switch", "cable not used"]


def test_link_load_ring_and_3d_torus_draw_every_cable():
    from labkit.comm.topology import all_to_all_transfers, ring, route, torus

    for topo in (ring(6, 1.0), torus((4, 4, 4), 1.0), torus((2, 4), 1.0)):
        r = route(topo, all_to_all_transfers(topo.devices, 1.0))
        fig = viz.link_load(r, topo)
        assert set(_cable_lines(fig)) == set(topo.cables)
    with pytest.raises(ValueError, match="metric"):
        viz.link_load(r, topo, metric="GB")


def test_hierarchy_table_lists_every_source_once_per_level():
    from labkit.theory import hardware
    from labkit.viz.network_charts import hierarchy_table

    levels = hardware.H100_HIERARCHY + hardware.TPU_FIGURES
    t = hierarchy_table(levels)
    html = t._repr_html_()
    assert html.count("<tr>") == len(levels) + 1
    assert all(f"href='{lv.source}'" in html for lv in levels)
    text = repr(t)
    assert "http" not in text and len(text.splitlines()) == len(levels)
    assert re.search(r"^TPU v4 ICI \(per chip, 6 links\) +270 GB/s  \(jax-ml", text,
                     re.M)
    assert re.search(r"^registers \(per SM\) +n/a  \(developer\.nvidia", text)


def test_zero_bars_scale_to_small_models():
    from labkit import theory

    bd = {f"stage {s}": theory.zero_breakdown(124e6, 8, s) for s in range(4)}
    ax = viz.zero_bars(bd, capacity=80e9).axes[0]
    top = 16 * 124e6 / 1e9                                     # 1.98 GB of DP
    assert top <= ax.get_ylim()[1] <= 1.2 * top               # the bars fill the plot
    assert not [x for x in ax.lines if x.get_linestyle() == "--"]  # no line at 80
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels[-1] == "device memory 80 GB:\nabove the chart,\nevery bar fits"
    # 16Ψ, 4Ψ + 12Ψ/8, 2Ψ + 14Ψ/8, 16Ψ/8 for Ψ = 0.124e9: 1.98, 0.68, 0.47, 0.25 GB
    assert [t.get_text() for t in ax.texts] == ["2.0", "0.68", "0.47", "0.25"]


def test_activation_chart_draws_korthikanti_per_sequence_length():
    from labkit import theory

    cfg = theory.MODELS["llama3-8b"]
    seqs = [1024, 2048, 4096, 8192]
    ax = viz_activation_chart(cfg, seqs, capacity=80e9).axes[0]
    lines = {x.get_label(): x.get_ydata() for x in ax.lines}
    want = [32 * theory.activation_memory(s, 1, 4096, 32) / 1e9 for s in seqs]
    assert list(lines["attention scores stored"]) == pytest.approx(want)
    flash = lines["no scores (FlashAttention)"]
    assert flash[3] / flash[2] == pytest.approx(2.0)          # linear in s
    full = lines["full recomputation"]
    assert full[0] == pytest.approx(32 * 2 * 1024 * 4096 / 1e9)
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"


def viz_activation_chart(*a, **kw):
    from labkit.viz.theory_charts import activation_chart

    return activation_chart(*a, **kw)


def test_prose_wraps_at_words_as_text_and_as_html():
    long = "DualPipe interleaved all-reduces " * 5
    p = viz.prose(long.strip(), ["first " * 20, "<b> escaped"])
    text = repr(p)
    assert all(len(line) <= 88 for line in text.splitlines())
    words = set(long.split()) | {"first", "<b>", "escaped"}
    assert set(text.replace("  - ", " ").split()) == words  # no word cut in two
    html = p._repr_html_()
    assert html.count("<p ") == 1 and html.count("<li>") == 2
    assert "&lt;b&gt; escaped" in html  # text, never markup


def test_flops_by_length_draws_each_count_over_the_baseline():
    from labkit.viz.theory_charts import flops_by_length

    seqs = [2048, 8192, 131072]
    counts = {"6N": [6.0, 6.0, 6.0], "6N + attention": [7.0, 10.0, 70.0]}
    fig = flops_by_length(seqs, counts, baseline="6N")
    ax = fig.axes[0]
    lines = {line.get_gid(): line for line in ax.get_lines()}
    assert set(lines) == {"line:6N", "line:6N + attention"}, set(lines)
    got = list(lines["line:6N + attention"].get_ydata())
    want = [7 / 6, 10 / 6, 70 / 6]
    assert got == want, f"ratios drawn {got}; the counts over 6N's: {want}"
    assert list(lines["line:6N"].get_ydata()) == [1.0] * 3, "the baseline is 1"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["2K", "8K", "128K"]
    assert "6N's" in ax.get_ylabel(), ax.get_ylabel()
