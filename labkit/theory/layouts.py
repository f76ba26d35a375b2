"""Real parallel layouts through the calculator, and a chooser that ranks them.

`estimate` (in _layout_cost) prices one layout: memory per device by category,
bytes sent per step by parallel dimension, and step time split into compute,
exposed communication and the pipeline bubble. `choose` enumerates the layouts
a cluster can run and ranks the ones that fit by estimated step time; `explain`
says where a published layout lands among them, and why the chooser prefers
another where it does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from itertools import product

from labkit.theory import hardware
from labkit.theory._layout_cluster import (
    ALPHA_NETWORK,
    ALPHA_NVLINK,
    GEMM_EFFICIENCY_A100,
    HBM_A100,
)
from labkit.theory._layout_cost import (
    DIMS,
    Cluster,
    Estimate,
    Layout,
    check_layout,
    estimate,
    flops_per_token,
)
from labkit.theory._layout_scale import WASTEFUL_MFU, Scale
from labkit.theory._layout_scale import scale as _scale
from labkit.theory.models import MODELS, ModelConfig

__all__ = ["A100_SELENE", "DEEPSEEK_V3_CLUSTER", "DIMS", "H100_NODE",
           "LLAMA3_CLUSTER", "LLAMA3_LONG_CONTEXT", "PUBLISHED_LAYOUTS",
           "PUBLISHED_RUNS", "Cluster", "Estimate", "Layout", "PublishedRun",
           "Ranked", "Scale", "WASTEFUL_MFU", "check_layout", "choose",
           "estimate", "explain", "find", "flops_per_token", "scale"]

# ------------------------------------------------------------------ clusters
# H100 SXM: 80 GB HBM3, dense bf16 peak, NVLink 4 per direction per GPU and one
# InfiniBand NDR NIC per GPU: hardware.py. HBM, GEMM efficiency and α: the
# defaults of Cluster, each sourced in labkit.theory._layout_cluster.
H100_NODE = Cluster(80e9, 8, 1, hardware.NVLINK4_GPU.bandwidth,
                    hardware.IB_NDR_GPU.bandwidth, hardware.H100_BF16_DENSE,
                    name="one H100 node")
# Llama Team 2024, "The Llama 3 Herd of Models", sec. 3.3.1: up to 16K H100 80 GB
# (700 W) in Grand Teton servers of 8, NVLink inside a server, 400 Gb/s RoCE
# between GPUs; table 4: 38-43 % BF16 MFU (41 % at 16K GPUs and 8K tokens, 38 %
# at 131K). NCCL's α over RoCE is taken to be its network figure.
LLAMA3_CLUSTER = dataclasses.replace(H100_NODE, nodes=2048,
                                     name="Llama 3: 16,384 H100 80 GB")
# DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", sec. 3.1 and 3.2.2: 2048 H800
# GPUs, 8 per node; NVLink 160 GB/s and InfiniBand 50 GB/s per GPU. The H800's
# dense bf16 peak is the H100 SXM's (its NVLink is what was cut); DeepSeek-V3 ran
# its GEMMs in FP8, which this calculator does not model.
DEEPSEEK_V3_CLUSTER = Cluster(80e9, 8, 256, 160e9, hardware.IB_NDR_GPU.bandwidth,
                              hardware.H100_BF16_DENSE,
                              name="DeepSeek-V3: 2048 H800 80 GB")
# Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
# Clusters Using Megatron-LM", sec. 5: Selene, DGX A100 80 GB nodes of 8 (the
# A100's figures: hardware.py); GEMMs at 86.9 % of the peak (_layout_cluster).
A100_SELENE = Cluster(80e9, 8, 192, hardware.NVLINK3_GPU.bandwidth,
                      hardware.IB_HDR_GPU.bandwidth, hardware.A100_BF16_DENSE,
                      hbm_bw=HBM_A100, gemm_efficiency=GEMM_EFFICIENCY_A100,
                      alpha_intra=ALPHA_NVLINK, alpha_inter=ALPHA_NETWORK,
                      name="Selene: 1536 A100 80 GB")


@dataclass(frozen=True)
class PublishedRun:
    model: str  # key of theory.MODELS
    layout: Layout
    cluster: Cluster
    global_batch_tokens: int
    seq: int
    source: str
    notes: str = ""

    def estimate(self) -> Estimate:
        return estimate(MODELS[self.model], self.layout, self.cluster,
                        self.global_batch_tokens, self.seq)

    def choose(self) -> list[Ranked]:
        """The layouts this run's cluster could have run for this model and batch,
        ranked (`choose`), with sequence parallelism only where the published
        layout could have used it (GPT-3's 2021 run could not)."""
        return choose(self.model, self.cluster, self.global_batch_tokens, self.seq,
                      sequence_parallel=self.layout.sequence_parallel)


# Llama Team 2024, table 4, the long-context stage: 131,072-token sequences.
# The first arXiv versions print DP 4 with 16,384 GPUs, 16 sequences per DP rank
# and 16M tokens per batch; TP 8 x CP 16 x PP 16 x DP 4 is 8,192 GPUs and 8M
# tokens. The revision (arXiv v3) prints DP 8, which makes the row's GPUs and
# tokens agree: we take DP 8.
LLAMA3_LONG_CONTEXT = Layout(tp=8, pp=16, dp=8, cp=16, zero=2, microbatches=16,
                             recompute="selective", interleave=2,
                             name="Llama 3 405B (128K)")

PUBLISHED_RUNS = {
    # Brown et al. 2020 publish no parallel layout for GPT-3. Narayanan et al. 2021
    # train the same shape (174.6B: 96 layers, hidden 12288, 96 heads) with
    # model-parallel size 96 on 1536 A100s, batch 1536 (table 2, micro-batch 1:
    # 141 teraFLOP/s per GPU). The split of 96 is not published: every model of
    # their table 1 from 18B up runs TP 8, a DGX node (sec. 3.3 and 5.4.1), so we
    # read it as TP 8 x PP 12. Megatron's 2021 optimizer is not sharded: ZeRO 0.
    # Its runs recomputed every layer (full recomputation, which eq. 3's FLOPs
    # count: Korthikanti et al. 2022, sec. 1) and had no sequence parallelism,
    # which Korthikanti et al. 2022 introduced a year later.
    "gpt3-175b": PublishedRun(
        "gpt3-175b", Layout(tp=8, pp=12, dp=16, microbatches=96, recompute="full",
                            sequence_parallel=False,
                            name="Megatron-LM GPT-3 175B"),
        A100_SELENE, 1536 * 2048, 2048,
        "Narayanan et al. 2021 (SC21), table 2 (Brown et al. 2020 give none)",
        "TP x PP = 96 is published; the split 8 x 12 is TP filling a node"),
    # Llama Team 2024, table 4, 16,384 GPUs at 8K context: TP 8, CP 1, PP 16, DP
    # 128, 16M tokens per batch (16 sequences per DP replica); groups in the order
    # [TP, CP, PP, DP]. Sec. 3.3.2: FSDP shards optimizer state and gradients and
    # keeps the weights after the forward: ZeRO-2's memory. It runs an
    # interleaved pipeline schedule without publishing v; we take v = 2. It does
    # not say what it recomputes; without dropout and with FlashAttention the
    # activations fit without recomputation (selective keeps the same here).
    "llama3-405b": PublishedRun(
        "llama3-405b", Layout(tp=8, pp=16, dp=128, zero=2, microbatches=16,
                              recompute="selective", interleave=2,
                              name="Llama 3 405B (8K)"),
        LLAMA3_CLUSTER, 2048 * 8192, 8192,
        "Llama Team 2024, 'The Llama 3 Herd of Models', table 4",
        "long-context stage: TP 8, CP 16, PP 16, DP 8 at 131,072 tokens"),
    "llama3-405b-128k": PublishedRun(
        "llama3-405b", LLAMA3_LONG_CONTEXT, LLAMA3_CLUSTER, 128 * 131072, 131072,
        "Llama Team 2024, 'The Llama 3 Herd of Models', table 4 (16M tokens per "
        "batch: 128 sequences of 131,072)"),
    # DeepSeek-AI 2024, sec. 3.2: PP 16 (DualPipe), EP 64 spanning 8 nodes,
    # ZeRO-1 data parallelism, no tensor parallelism, 2048 H800s: DP = 2048 / 16
    # = 128. Sec. 4.2: sequences of 4K, batch size 15360 sequences at the end.
    # Sec. 3.2.3 recomputes RMSNorm and MLA up-projections: "selective" here.
    "deepseek-v3": PublishedRun(
        "deepseek-v3", Layout(tp=1, pp=16, dp=128, ep=64, zero=1, microbatches=120,
                              recompute="selective", dualpipe=True,
                              name="DeepSeek-V3"),
        DEEPSEEK_V3_CLUSTER, 15360 * 4096, 4096,
        "DeepSeek-AI 2024, 'DeepSeek-V3 Technical Report', sec. 3.2 and 4.2"),
}
PUBLISHED_LAYOUTS = {k: r.layout for k, r in PUBLISHED_RUNS.items()}



# ------------------------------------------------------------------- chooser


@dataclass(frozen=True)
class Ranked:
    rank: int  # 1 = fastest of those that fit
    estimate: Estimate

    @property
    def layout(self) -> Layout:
        return self.estimate.layout

    @property
    def reasons(self) -> list[str]:
        return self.estimate.reasons

    @property
    def step_time(self) -> float:
        return self.estimate.step_time


def _powers(limit: int) -> list[int]:
    out, x = [], 1
    while x <= limit:
        out.append(x)
        x *= 2
    return out


def _bare(layout: Layout) -> Layout:
    return dataclasses.replace(layout, name="")


def _schedules(pp: int) -> list[dict]:
    if pp == 1:
        return [{}]
    out = [{"interleave": v} for v in (1, 2, 4)]
    return out + ([{"dualpipe": True}] if pp % 2 == 0 else [])


def candidates(model: ModelConfig, cluster: Cluster, global_batch_tokens: int,
               seq: int, gpus: int, inter_node_tp: bool = False,
               sequence_parallel: bool = True):
    """Every layout on exactly `gpus` GPUs: powers of two and the published
    degrees, micro-batch size 1 (as many micro-batches as the batch allows),
    each pipeline schedule (1F1B, interleaved v = 2 and 4, DualPipe), with or
    without sequence parallelism as `sequence_parallel` says."""
    published = list(PUBLISHED_LAYOUTS.values()) + [LLAMA3_LONG_CONTEXT]
    extra = {d: {getattr(p, d) for p in published} for d in ("tp", "pp", "cp", "ep")}
    tp_max = model.heads if inter_node_tp else cluster.gpus_per_node
    tps = sorted({t for t in set(_powers(tp_max)) | extra["tp"] if t <= tp_max})
    pps = sorted({p for p in set(_powers(model.layers)) | extra["pp"]
                  if p <= model.layers})
    cps = sorted(set(_powers(16)) | extra["cp"])
    eps = sorted(set(_powers(model.experts)) | extra["ep"]) if model.experts else [1]
    seqs = global_batch_tokens // seq
    for tp in tps:
        for cp in cps:
            for pp in pps:
                if gpus % (tp * cp * pp):
                    continue
                dp = gpus // (tp * cp * pp)
                if dp < 1 or seqs % dp or seqs // dp < pp:
                    continue  # a pipeline needs at least PP micro-batches
                for ep in eps:
                    if (dp * cp) % ep or (model.experts and model.experts % ep):
                        continue
                    for zero, rc, sched in product((0, 1, 2, 3), ("selective", "full"),
                                                   _schedules(pp)):
                        yield Layout(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, zero=zero,
                                     microbatches=seqs // dp, recompute=rc,
                                     sequence_parallel=sequence_parallel, **sched)


def choose(model: ModelConfig | str, cluster: Cluster, global_batch_tokens: int,
           seq: int, max_gpus: int | None = None,
           inter_node_tp: bool = False,
           sequence_parallel: bool = True) -> list[Ranked]:
    """The layouts that fit on `max_gpus` (default: the whole cluster), fastest
    first by estimated step time. TP stays within a node unless inter_node_tp;
    sequence_parallel=False ranks the layouts without it (a 2021 Megatron-LM).
    ("none" recomputation is left out: with FlashAttention it keeps what
    "selective" keeps.)"""
    c = MODELS[model] if isinstance(model, str) else model
    gpus = cluster.gpus if max_gpus is None else max_gpus
    if gpus > cluster.gpus:
        raise ValueError(f"max_gpus {gpus} is more than the cluster's {cluster.gpus}")
    if global_batch_tokens % seq:
        raise ValueError(f"global batch {global_batch_tokens} tokens is not a whole "
                         f"number of {seq}-token sequences")
    fits = []
    for lay in candidates(c, cluster, global_batch_tokens, seq, gpus, inter_node_tp,
                          sequence_parallel):
        try:
            est = estimate(c, lay, cluster, global_batch_tokens, seq)
        except ValueError:
            continue
        if est.fits:
            fits.append(est)
    fits.sort(key=lambda e: (e.step_time, e.memory_total))
    return [Ranked(i + 1, e) for i, e in enumerate(fits)]


def scale(model: ModelConfig | str, cluster: Cluster, global_batch_tokens: int,
          seq: int, ranked: list[Ranked] | None = None,
          inter_node_tp: bool = False) -> Scale:
    """The fewest GPUs the model fits on and, where its fastest layout on all of
    `cluster` reaches under WASTEFUL_MFU, the most GPUs on which one does not;
    `.advice()` says it in sentences."""
    name = MODELS[model].name if isinstance(model, str) else model.name
    got = _scale(choose, model, cluster, global_batch_tokens, seq, ranked,
                 inter_node_tp)
    return dataclasses.replace(got, model=name)


def find(ranked: list[Ranked], layout: Layout) -> Ranked | None:
    """The entry of `ranked` with this layout's degrees (its name ignored)."""
    want = _bare(layout)
    return next((r for r in ranked if _bare(r.layout) == want), None)


_KIND = {"compute": "compute", "tp": "exposed TP all-reduces",
         "cp": "exposed CP all-gathers", "pp": "pipeline sends",
         "dp": "exposed DP/ZeRO traffic", "ep": "EP all-to-alls",
         "bubble": "the pipeline bubble"}


def explain(ranked: list[Ranked], published: Layout) -> str:
    """Where `published` ranks among the feasible layouts, and why the chooser
    prefers the first one if it is not the published one."""
    if not ranked:
        return "no layout fits this cluster."
    best, mine = ranked[0], find(ranked, published)
    name = published.name or str(published)
    if mine is None:
        return (f"{name} ({published}) is not among the {len(ranked)} layouts that "
                f"fit: it does not fit in memory here or does not use these GPUs.")
    head = (f"{name} ({published}) ranks {mine.rank} of {len(ranked)} feasible "
            f"layouts at {mine.step_time:.2f} s per step")
    if mine.rank == 1:
        return head + "; the chooser agrees with it. " + " ".join(
            s + "." for s in mine.reasons)
    gap = {k: mine.estimate.time[k] - best.estimate.time[k] for k in best.estimate.time}
    worse = sorted((k for k in gap if gap[k] > 0), key=lambda k: -gap[k])[:2]
    better = sorted((k for k in gap if gap[k] < 0), key=lambda k: gap[k])[:1]
    why = "; ".join(f"{_KIND[k]} {gap[k]:+.2f} s" for k in worse)
    text = (f"{head}; the chooser prefers {best.layout} at {best.step_time:.2f} s "
            f"({best.step_time / mine.step_time - 1:+.0%}). The published layout "
            f"spends more on {why}")
    if better:
        k = better[0]
        text += f", and less on {_KIND[k]} ({gap[k]:+.2f} s)"
    if best.layout.schedule != mine.layout.schedule:
        same = [r for r in ranked if r.layout.schedule == mine.layout.schedule]
        text += (f". The fastest runs {best.layout.schedule}; among the {len(same)} "
                 f"layouts on the published schedule ({mine.layout.schedule}) the "
                 f"published one ranks {same.index(mine) + 1}")
    if best.layout.recompute != mine.layout.recompute:
        text += (f". It uses {mine.layout.recompute} recomputation where the "
                 f"fastest uses {best.layout.recompute}")
    if mine.step_time <= 1.02 * best.step_time:
        text += (". That is within 2 % of the fastest: a tie at this calculator's "
                 "precision")
    mem = mine.estimate.memory_total - best.estimate.memory_total
    text += (f". It uses {abs(mem) / 1e9:,.1f} GB {'more' if mem > 0 else 'less'} "
             f"memory per GPU. The calculator prices matrix products by a roofline "
             f"and collectives by α-β; it does not see elementwise kernels, how well "
             f"communication really overlaps, stragglers and failures, checkpoints, "
             f"or FP8.")
    return text
