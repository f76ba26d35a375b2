"""labkit.viz.sp_charts: the activation bars and the ring-attention steps, read
back from what they draw (heights, colours, labels, legend entries)."""

import matplotlib
from matplotlib.colors import to_hex

from labkit.parallel.ring_attention import ring_schedule
from labkit.theory.activations import activation_terms
from labkit.viz.sp_charts import (
    EXTRA_COLOR,
    GROUPS,
    KIND_COLORS,
    activation_bars,
    ring_steps_chart,
)


def _segments(ax) -> dict:
    """gid -> (bottom, height, colour) of every bar segment."""
    return {p.get_gid(): (p.get_y(), p.get_height(), to_hex(p.get_facecolor()))
            for p in ax.patches if p.get_gid()}


def test_activation_bars_stack_the_groups_and_mark_the_measurement():
    s, b, h, a = 64, 2, 32, 4
    sbh = s * b * h
    terms = {"one process": activation_terms(s, b, h, a),
             "TP + SP": activation_terms(s, b, h, a, tp=4, sp=True),
             "full recomputation": activation_terms(s, b, h, a, recompute="full")}
    measured = {"one process": 42 * sbh + 5 * a * s * s * b, "TP + SP": 11 * sbh}
    extras = {"one process": {"LayerNorm statistics": 8 * s * b}}
    ax = activation_bars(terms, measured, extras, unit=1).axes[0]
    seg = _segments(ax)
    assert seg["one process/sp"] == (0, 10 * sbh, GROUPS["sp"][1].lower())
    assert seg["one process/tp"] == (10 * sbh, 24 * sbh, GROUPS["tp"][1].lower())
    assert seg["one process/scores"][:2] == (34 * sbh, 5 * a * s * s * b)
    assert seg["one process/extra: LayerNorm statistics"] == (
        34 * sbh + 5 * a * s * s * b, 8 * s * b, EXTRA_COLOR.lower())
    assert seg["TP + SP/sp"][1] == 10 * sbh / 4 and seg["TP + SP/tp"][1] == 6 * sbh
    assert seg["full recomputation/input"][1] == 2 * sbh
    assert seg["TP + SP/extra: LayerNorm statistics"][1] == 0
    marks = {ln.get_gid(): ln.get_ydata()[0] for ln in ax.lines}
    assert marks == {"one process/measured": 42 * sbh + 5 * a * s * s * b,
                     "TP + SP/measured": 11 * sbh}  # none where none was measured
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == [GROUPS[g][0] for g in ("sp", "tp", "scores", "input")] + [
        "LayerNorm statistics (not in the formula)", "measured (memory ledger)"]
    assert [t.get_text() for t in ax.get_xticklabels()] == [
        "one process", "TP + SP", "full\nrecomputation"]
    top = max(p.get_y() + p.get_height() for p in ax.patches)
    assert ax.get_ylim()[1] > top  # nothing off the canvas


def test_ring_steps_chart_colours_each_cell_by_what_the_rank_does():
    import matplotlib.pyplot as plt

    before = dict(matplotlib.rcParams)
    ax = ring_steps_chart(ring_schedule(4, causal=True)).axes[0]
    cells = {p.get_gid(): to_hex(p.get_facecolor()) for p in ax.patches if p.get_gid()}
    assert len(cells) == 16
    assert cells["0/2"] == KIND_COLORS["diagonal"].lower()   # step 0: its own chunk
    assert cells["1/2"] == KIND_COLORS["full"].lower()       # chunk 1, before it
    assert cells["1/0"] == KIND_COLORS["skipped"].lower()    # chunk 3, after it
    texts = [t.get_text() for t in ax.texts]
    assert "rank 3 (Q 3)" in texts and "step 3" in texts
    assert texts.count("K,V 0") == 4  # chunk 0 visits every rank once
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "attends to the whole chunk", "own chunk, causal mask inside",
        "skipped (keys after all its queries)"]
    plain = ring_steps_chart(ring_schedule(2)).axes[0]
    assert len(plain.get_legend().get_texts()) == 1  # no mask, nothing skipped
    assert dict(matplotlib.rcParams) == before and plt.get_fignums() == []
