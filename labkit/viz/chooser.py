"""The strategy chooser: a cluster's shape in, feasible layouts ranked by
estimated step time out, with the reasons and a chart of where the time goes.

Headless like labkit.viz.widgets: set a control's `.value`, then read `.last`
(the ranking), `.value` (the table's text) and `.figure` (the chart drawn)."""

from __future__ import annotations

import dataclasses
import html

import ipywidgets as W
from matplotlib.figure import Figure

from labkit.theory import (
    MODELS,
    PUBLISHED_RUNS,
    WASTEFUL_MFU,
    ClusterSpec,
    choose,
    explain,
    find,
    gemm_time,
    scale,
)
from labkit.units import percent, seconds, si_bytes
from labkit.viz.style import (
    MIN_FONT_PT,
    PAGE_WIDTH_IN,
    figure_and_axes,
    legend_outside,
)
from labkit.viz.widgets import show_output

TIME_COLORS = {"compute": "#4c72b0", "tp": "#dd8452", "cp": "#937860",
               "pp": "#8172b3", "dp": "#55a868", "ep": "#c44e52",
               "bubble": "#bbbbbb"}
TIME_LABELS = {"compute": "compute", "tp": "TP all-reduce (exposed)",
               "cp": "CP all-gather (exposed)", "pp": "PP send (exposed)",
               "dp": "DP / ZeRO (exposed)", "ep": "EP all-to-all (exposed)",
               "bubble": "pipeline bubble"}


def _short_schedule(lay) -> str:
    """A tick label's last line: the pipeline schedule, short."""
    if lay.pp == 1:
        return "no pipeline"
    if lay.dualpipe:
        return "DualPipe"
    return f"1F1B, v = {lay.interleave}" if lay.interleave > 1 else "1F1B"


def step_time_bars(ranked, *, published=None, top: int = 5) -> Figure:
    """Stacked bars of each layout's step time (compute, exposed communication by
    kind, bubble) for the `top` fastest, and the published layout if given; each
    label ends with the layout's pipeline schedule. A kind that takes no time in
    any bar shown is neither drawn nor in the legend."""
    rows = list(ranked[:top])
    mine = find(ranked, published) if published is not None else None
    if mine is not None and mine not in rows:
        rows.append(mine)
    # a bar per layout, its label under it (up to 15 characters a line): the
    # legend goes below, so the bars get the page's width
    fig, ax = figure_and_axes(None, (min(1.2 + 1.1 * max(len(rows), 1),
                                         PAGE_WIDTH_IN), 4.0))
    bottom = [0.0] * len(rows)
    for part, color in TIME_COLORS.items():
        h = [r.estimate.time[part] for r in rows]
        if not any(h):
            continue
        ax.bar(range(len(rows)), h, bottom=bottom, color=color,
               label=TIME_LABELS[part], width=0.6)
        bottom = [b + x for b, x in zip(bottom, h)]
    for i, total in enumerate(bottom):
        ax.text(i, total, seconds(total).removesuffix(" s"), ha="center",
                va="bottom", fontsize=8)
    labels = [f"#{r.rank}\n" + str(r.layout).replace(" · ", "\n") + "\n"
              + _short_schedule(r.layout) for r in rows]
    ax.set_xticks(range(len(rows)), labels, fontsize=MIN_FONT_PT)
    if mine is not None:
        ax.get_xticklabels()[rows.index(mine)].set_fontweight("bold")
    ax.set_ylim(0, 1.15 * (max(bottom, default=0.0) or 1.0))
    ax.set_ylabel("estimated seconds per step")
    ax.set_title("Where each layout's step goes (last line: pipeline schedule"
                 + ("; bold: published)" if mine else ")"), wrap=True)
    if ax.containers:
        legend_outside(ax)
    return fig


def gemm_roofline(cluster: ClusterSpec, gemms: dict, *, title: str = "") -> Figure:
    """One GPU's roofline (Williams, Waterman & Patterson 2009): attainable
    TFLOPS against arithmetic intensity (FLOPs per byte of HBM traffic), the
    roof min(peak x gemm_efficiency, intensity x HBM bandwidth), and each bf16
    product {label: (m, n, k)} as a point on it."""
    peak = cluster.flops * cluster.gemm_efficiency
    ridge = peak / cluster.hbm_bw
    pts = {name: (2 * m * n * k / (2 * (m * k + k * n + m * n)),
                  2 * m * n * k / gemm_time(m, n, k, cluster))
           for name, (m, n, k) in gemms.items()}
    xs = [x for x, _ in pts.values()] + [ridge]
    lo, hi = min(xs) / 4, max(xs) * 4
    fig, ax = figure_and_axes(None, (6.4, 3.6))  # the legend below it
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax.plot(grid, [min(peak, x * cluster.hbm_bw) / 1e12 for x in grid],
            color="#333333", label=f"roof: min({peak / 1e12:.0f} TFLOPS, "
                                   f"intensity x {cluster.hbm_bw / 1e12:.2f} TB/s)")
    ax.axvline(ridge, color="#999999", ls=":", label=f"ridge: {ridge:.0f} FLOPs/B")
    colors = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860"]
    for (label, (x, y)), c in zip(pts.items(), colors * 4):
        ax.plot([x], [y / 1e12], "o", color=c, ms=7, label=f"{label}: {x:,.0f} FLOPs/B")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(min(y for _, y in pts.values()) / 1e12 / 3, peak / 1e12 * 3)
    ax.set_xlabel("arithmetic intensity (FLOPs per byte of HBM traffic)")
    ax.set_ylabel("attainable TFLOPS")
    ax.set_title(title or f"Roofline of one GPU ({cluster.flops / 1e12:,.0f} TFLOPS "
                          f"peak, {cluster.hbm_bw / 1e12:.2f} TB/s HBM)", wrap=True)
    legend_outside(ax, ncol=2)
    return fig


def _defaults(model: str) -> tuple[int, int, ClusterSpec | None]:
    run = next((r for r in PUBLISHED_RUNS.values() if r.model == model), None)
    if run is not None:
        return run.global_batch_tokens, run.seq, run.cluster
    seq = MODELS[model].seq
    return 1024 * seq, seq, None


class StrategyChooser(W.VBox):
    """Model preset, GPU memory, GPUs per node, nodes, NVLink and network
    bandwidth -> the layouts that fit, fastest first, with reasons."""

    def __init__(self, model: str = "llama3-405b", rows: int = 8):
        self.rows = rows
        tokens, seq, cl = _defaults(model)
        cl = cl or PUBLISHED_RUNS["llama3-405b"].cluster
        opts = dict(continuous_update=False, style={"description_width": "130px"})
        self.model = W.Dropdown(options=list(MODELS), value=model,
                                description="model")
        self.gpu_memory = W.FloatSlider(value=cl.gpu_memory / 1e9, min=16, max=192,
                                        step=8, description="GPU memory (GB)", **opts)
        self.gpus_per_node = W.SelectionSlider(options=[1, 2, 4, 8, 16],
                                               value=cl.gpus_per_node,
                                               description="GPUs per node", **opts)
        counts = {2**i for i in range(13)} | {r.cluster.nodes
                                              for r in PUBLISHED_RUNS.values()}
        self.nodes = W.SelectionSlider(options=sorted(counts),
                                       value=cl.nodes, description="nodes", **opts)
        self.intra_bw = W.FloatSlider(value=cl.intra_bw / 1e9, min=25, max=900,
                                      step=25, description="NVLink (GB/s)", **opts)
        self.inter_bw = W.FloatSlider(value=cl.inter_bw / 1e9, min=5, max=100,
                                      step=5, description="network (GB/s)", **opts)
        self.info = W.HTML()
        self.table = W.HTML()
        self.out = W.Output()
        self.last: list = []
        self.scale = None  # what the model can use well (theory.scale)
        self.figure = None
        self.value = ""  # the table as plain text, for tests and screen readers
        self._syncing = False
        self.model.observe(self._on_model, names="value")
        for w in (self.gpu_memory, self.gpus_per_node, self.nodes, self.intra_bw,
                  self.inter_bw):
            w.observe(self._draw, names="value")
        super().__init__([W.HBox([self.model, self.gpu_memory, self.gpus_per_node]),
                          W.HBox([self.nodes, self.intra_bw, self.inter_bw]),
                          self.info, self.table, self.out])
        self._draw()

    def cluster(self) -> ClusterSpec:
        """The controls' cluster; its GPU (peak, HBM, GEMM efficiency) and
        latencies are the model's published run's (A100 for GPT-3, H100/H800
        otherwise)."""
        _, _, cl = _defaults(self.model.value)
        return dataclasses.replace(
            cl or PUBLISHED_RUNS["llama3-405b"].cluster,
            gpu_memory=self.gpu_memory.value * 1e9,
            gpus_per_node=self.gpus_per_node.value, nodes=self.nodes.value,
            intra_bw=self.intra_bw.value * 1e9, inter_bw=self.inter_bw.value * 1e9,
            name="")

    def _on_model(self, change=None) -> None:
        _, _, cl = _defaults(self.model.value)
        if cl is not None:  # a published run: its cluster, in one redraw
            self._syncing = True
            try:
                self.gpu_memory.value = cl.gpu_memory / 1e9
                self.gpus_per_node.value = cl.gpus_per_node
                self.nodes.value = cl.nodes
                self.intra_bw.value = cl.intra_bw / 1e9
                self.inter_bw.value = cl.inter_bw / 1e9
            finally:
                self._syncing = False
        self._draw()

    def _draw(self, change=None) -> None:
        if self._syncing:
            return
        name = self.model.value
        tokens, seq, _ = _defaults(name)
        cl = self.cluster()
        run = PUBLISHED_RUNS.get(name)
        published = run.layout if run else None
        sp = published.sequence_parallel if published is not None else True
        try:  # a published run's model: the software of its day (GPT-3: no SP)
            ranked = choose(name, cl, tokens, seq, sequence_parallel=sp)
        except ValueError as e:
            ranked, self.info.value = [], f"<b>no layout:</b> {html.escape(str(e))}"
        self.last = ranked
        self.scale = scale(name, cl, tokens, seq, ranked) if ranked else None
        lines = [f"{r.rank:>4}  {seconds(r.step_time):>9}  "
                 f"{si_bytes(r.estimate.memory_total):>8}  {r.layout} "
                 f"[{r.layout.schedule}, recompute {r.layout.recompute}]"
                 + ("  wasteful" if r.estimate.mfu < WASTEFUL_MFU else "")
                 for r in ranked[:self.rows]]
        self.value = "\n".join(lines) if ranked else "no layout fits"
        head = (f"{MODELS[name].name}, {tokens:,} tokens per step of {seq:,}: "
                f"{len(ranked):,} layouts fit on {cl.gpus:,} GPUs "
                f"({cl.gpus_per_node} per node, {cl.flops / 1e12:,.0f} TFLOPS "
                f"bf16 each, large GEMMs at {cl.gemm_efficiency:.0%} of it; α "
                f"{cl.alpha_intra * 1e6:.1f} µs per ring step in a node, "
                f"{cl.alpha_inter * 1e6:.1f} µs between nodes). Ranked by "
                f"estimated step time on all {cl.gpus:,} GPUs, fastest first"
                + ("" if sp else ", without sequence parallelism (as in 2021)")
                + f"; a layout under {WASTEFUL_MFU:.0%} MFU is marked wasteful.")
        if ranked:
            head += " " + self.scale.advice()
        if published is not None and ranked:
            head += " " + explain(ranked, published)
        if ranked:
            self.info.value = html.escape(head)
        self.table.value = _table(ranked[:self.rows])
        self.figure = step_time_bars(ranked, published=published)
        show_output(self.out, self.figure)


_CELL = "padding:2px 8px;text-align:left;vertical-align:top"


def _table(rows) -> str:
    """Rank, layout (never wrapped), step time, MFU, memory; the reasons folded
    under each row, so eight layouts stay a screen tall."""
    def row(r) -> str:
        mfu = percent(r.estimate.mfu)
        if r.estimate.mfu < WASTEFUL_MFU:
            mfu += " <b style='color:#b22'>wasteful</b>"
        why = "".join(f"<li>{html.escape(x)}</li>" for x in r.reasons)
        return (f"<tr><td style='{_CELL}'>{r.rank}</td>"
                f"<td style='{_CELL};white-space:nowrap'>"
                f"{html.escape(str(r.layout))}<br><small>{r.layout.schedule}, "
                f"recompute {r.layout.recompute}</small></td>"
                f"<td style='{_CELL}'>{seconds(r.step_time)}</td>"
                f"<td style='{_CELL}'>{mfu}</td>"
                f"<td style='{_CELL}'>{si_bytes(r.estimate.memory_total)}</td>"
                f"<td style='{_CELL}'><details><summary>why</summary>"
                f"<ul style='margin:0;padding-left:1.2em'>{why}</ul></details></td>"
                "</tr>")
    head = "".join(f"<th style='{_CELL}'>{h}</th>" for h in
                   ("rank", "layout", "step", "MFU", "memory per GPU", ""))
    return f"<table><tr>{head}</tr>{''.join(row(r) for r in rows)}</table>"


def strategy_chooser(**kw) -> StrategyChooser:
    """A widget: cluster shape in, feasible layouts ranked by step time out."""
    return StrategyChooser(**kw)
