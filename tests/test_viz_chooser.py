"""labkit.viz.chooser, headless: move a control, read the table and the chart."""

import re

import pytest

from labkit.theory import (
    H100_NODE,
    LLAMA3_CLUSTER,
    PUBLISHED_RUNS,
    WASTEFUL_MFU,
    choose,
    find,
    gemm_time,
)
from labkit.units import seconds
from labkit.viz.chooser import (
    TIME_LABELS,
    StrategyChooser,
    gemm_roofline,
    step_time_bars,
    strategy_chooser,
)


def _bar_totals(fig):
    ax = fig.axes[0]
    parts = [[p.get_height() for p in c.patches] for c in ax.containers]
    return [sum(col) for col in zip(*parts)]


def _legend(fig):
    return [t.get_text() for t in fig.axes[0].get_legend().get_texts()]


def _check_agree(w):
    """Table text, ranking and chart say the same thing."""
    lines = w.value.splitlines()
    assert len(lines) == min(w.rows, len(w.last))
    for line, r in zip(lines, w.last):
        assert line.split()[0] == str(r.rank) and str(r.layout) in line
        assert seconds(r.step_time) in line
    bars = _bar_totals(w.figure)
    top = [r.step_time for r in w.last[:5]]
    assert bars[:len(top)] == pytest.approx(top)
    # every colour drawn is named, and nothing else: each part in the legend has
    # a bar of more than zero seconds somewhere, each part of the five fastest
    # that takes any time is there
    ax = w.figure.axes[0]
    if not w.last:
        assert ax.get_legend() is None
        return
    assert _legend(w.figure) == [c.get_label() for c in ax.containers]
    assert all(any(p.get_height() > 0 for p in c.patches) for c in ax.containers)
    busy = {TIME_LABELS[k] for r in w.last[:5] for k, t in r.estimate.time.items()
            if t > 0}
    assert busy <= set(_legend(w.figure))


def test_return_type_is_a_widget():
    import typing

    assert typing.get_type_hints(strategy_chooser)["return"] is StrategyChooser


def test_moving_controls_changes_table_and_chart():
    w = strategy_chooser(model="gpt3-175b")
    run = PUBLISHED_RUNS["gpt3-175b"]
    assert w.nodes.value == run.cluster.nodes and w.cluster().gpus == 1536
    _check_agree(w)
    assert "ranks" in w.info.value and "Megatron-LM GPT-3 175B" in w.info.value
    # the header names the GPU's GEMM efficiency and the α it prices with
    assert "large GEMMs at 87% of it" in w.info.value
    assert "α 3.4 µs per ring step in a node, 14.0 µs between nodes" in w.info.value
    # on its published cluster the widget's numbers are the calculator's
    assert w.cluster() == run.cluster.__class__(**{**run.cluster.__dict__,
                                                   "name": ""})
    mine = find(w.last, run.layout)
    assert mine.step_time == pytest.approx(run.estimate().step_time)
    # the published layout is drawn too, after the five fastest
    assert len(_bar_totals(w.figure)) == 6
    before = w.value
    w.nodes.value = 64  # 512 GPUs: other layouts, other times
    assert w.cluster().gpus == 512 and w.value != before
    assert all(r.layout.gpus == 512 for r in w.last)
    _check_agree(w)
    # the published 1536-GPU layout cannot be among them, and the text says so
    assert "is not among" in w.info.value
    w.gpu_memory.value = 16  # less memory: fewer layouts fit, each within 16 GB
    assert all(r.estimate.memory_total <= 16e9 for r in w.last)
    _check_agree(w)
    slow = w.last[0].step_time
    w.inter_bw.value = 5  # a slower network can only slow the best layout down
    assert w.last[0].step_time >= slow
    _check_agree(w)


def test_nothing_fits():
    w = strategy_chooser(model="gpt3-175b")
    w.nodes.value = 1
    assert w.last == [] and w.value == "no layout fits"
    assert _bar_totals(w.figure) == []
    assert w.figure.axes[0].get_legend() is None  # nothing drawn, nothing named


def test_step_time_bars_bold_published():
    run = PUBLISHED_RUNS["gpt3-175b"]
    ranked = run.choose()          # as in 2021: no sequence parallelism
    fig = step_time_bars(ranked, published=run.layout, top=3)
    labels = fig.axes[0].get_xticklabels()
    assert len(labels) == 4 and labels[-1].get_fontweight() == "bold"


def test_step_time_bars_legend_only_what_is_drawn():
    # Llama 3 405B's five fastest layouts send nothing exposed between pipeline
    # stages and have no experts: no PP or EP colour, so no PP or EP legend entry
    run = PUBLISHED_RUNS["llama3-405b"]
    ranked = choose(run.model, run.cluster, run.global_batch_tokens, run.seq)
    assert all(r.estimate.time["pp"] == 0 == r.estimate.time["ep"]
               for r in ranked[:5])
    fig = step_time_bars(ranked)
    assert _legend(fig) == ["compute", "TP all-reduce (exposed)",
                            "CP all-gather (exposed)", "DP / ZeRO (exposed)",
                            "pipeline bubble"]
    assert _bar_totals(fig) == pytest.approx([r.step_time for r in ranked[:5]])
    # the published layout (PP 16) does send between stages: then PP is drawn
    mine = find(ranked, run.layout)
    assert mine.estimate.time["pp"] > 0
    fig = step_time_bars(ranked, published=run.layout)
    assert "PP send (exposed)" in _legend(fig)
    assert "EP all-to-all (exposed)" not in _legend(fig)


def test_gemm_roofline_draws_the_roof_and_each_product():
    gemms = {"QKV, 8192 tokens": (8192, 2304, 16384),
             "QKV, 64 tokens": (64, 2304, 16384)}
    fig = gemm_roofline(H100_NODE, gemms)
    ax = fig.axes[0]
    lines = ax.get_lines()
    assert len(lines) == 2 + len(gemms)  # the roof, the ridge, one point each
    texts = [t.get_text() for t in ax.get_legend().get_texts()]
    assert len(texts) == len(lines) and texts[0].startswith("roof")
    for line, (m, n, k) in zip(lines[2:], gemms.values()):  # each point on its roof
        (x,), (y,) = line.get_data()
        assert x == pytest.approx(m * n * k / (m * k + k * n + m * n))
        assert y * 1e12 == pytest.approx(2 * m * n * k / gemm_time(m, n, k, H100_NODE))
        lo, hi = ax.get_xlim()
        ylo, yhi = ax.get_ylim()
        assert lo < x < hi and ylo < y < yhi  # inside the axes
    # the thin product sits on the slope (HBM-bound), the wide one on the flat
    (_, (y_wide,)), (_, (y_thin,)) = (ln.get_data() for ln in lines[2:])
    assert y_wide == pytest.approx(989 * 794.5 / 989)
    assert y_thin < 0.3 * y_wide


def test_a_small_model_on_a_huge_cluster_is_told_what_it_needs():
    # GPT-2 small (124M parameters) offered Llama 3's 16,384 GPUs: every layout
    # that uses them all leaves them idle, and the chooser says so
    w = strategy_chooser(model="gpt2-small")
    assert w.cluster().gpus == LLAMA3_CLUSTER.gpus == 16_384
    best = w.last[0]
    assert best.estimate.mfu < WASTEFUL_MFU and w.scale.wasteful
    assert w.scale.fewest == 1  # 124M x 16 B of model states: one 80 GB GPU
    assert w.scale.at_suggested.estimate.mfu >= WASTEFUL_MFU
    assert 1 < w.scale.suggested < 16_384
    info = w.info.value
    assert "fits on as few as 1 GPU" in info and "wasteful, not a recommendation" in \
        info and f"{w.scale.suggested:,} GPUs is the most" in info
    assert "Ranked by estimated step time on all 16,384 GPUs, fastest first" in info
    # units that fit the numbers: no figure reads 0.0 GB or 0%
    text = info + w.table.value + w.value
    assert not re.findall(r"(?<![\d.])0\.0 [kMGT]?B|(?<![\d.])0% MFU|0\.00 s", text)
    assert all(line.endswith("wasteful") for line in w.value.splitlines())
    # a compact table: each layout on one line, the reasons folded away
    assert w.table.value.count("<details>") == len(w.last[:w.rows])
    assert "white-space:nowrap" in w.table.value
    _check_agree(w)


def test_a_large_model_is_not_called_wasteful():
    w = strategy_chooser(model="llama3-405b")
    assert not w.scale.wasteful and "wasteful, not" not in w.info.value
    assert w.scale.fewest is not None and w.scale.fewest < 16_384
