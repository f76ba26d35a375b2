"""The chooser: every layout a cluster can run, priced (estimate) and ranked by
step time; `explain` says where a published layout lands among them, and why
the chooser prefers another where it does."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from itertools import product

from labkit.theory.layout.costs import Estimate, estimate
from labkit.theory.layout.cluster import ClusterSpec
from labkit.theory.layout.layout import Layout
from labkit.theory.layout.published import PUBLISHED_LAYOUTS
from labkit.theory.models import MODELS, ModelConfig


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
    out, power = [], 1
    while power <= limit:
        out.append(power)
        power *= 2
    return out


def _bare(layout: Layout) -> Layout:
    return dataclasses.replace(layout, name="")


def _schedules(pp: int) -> list[dict]:
    if pp == 1:
        return [{}]
    out = [{"interleave": v} for v in (1, 2, 4)]
    return out + ([{"dualpipe": True}] if pp % 2 == 0 else [])


def candidates(model: ModelConfig, cluster: ClusterSpec, global_batch_tokens: int,
               seq: int, gpus: int, inter_node_tp: bool = False,
               sequence_parallel: bool = True):
    """Every layout on exactly `gpus` GPUs: powers of two and the published
    degrees, micro-batch size 1 (as many micro-batches as the batch allows),
    each pipeline schedule (1F1B, interleaved v = 2 and 4, DualPipe), with or
    without sequence parallelism as `sequence_parallel` says."""
    published = {dim: {getattr(layout, dim) for layout in PUBLISHED_LAYOUTS.values()}
                 for dim in ("tp", "pp", "cp", "ep")}
    tp_max = model.heads if inter_node_tp else cluster.gpus_per_node
    tps = sorted({degree for degree in set(_powers(tp_max)) | published["tp"]
                  if degree <= tp_max})
    pps = sorted({degree for degree in set(_powers(model.layers)) | published["pp"]
                  if degree <= model.layers})
    cps = sorted(set(_powers(16)) | published["cp"])
    eps = (sorted(set(_powers(model.experts)) | published["ep"]) if model.experts
           else [1])
    sequences = global_batch_tokens // seq
    for tp in tps:
        for cp in cps:
            for pp in pps:
                if gpus % (tp * cp * pp):
                    continue
                dp = gpus // (tp * cp * pp)
                if dp < 1 or sequences % dp or sequences // dp < pp:
                    continue  # a pipeline needs at least PP micro-batches
                for ep in eps:
                    if (dp * cp) % ep or (model.experts and model.experts % ep):
                        continue
                    for zero, recompute, schedule in product(
                            (0, 1, 2, 3), ("selective", "full"), _schedules(pp)):
                        yield Layout(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, zero=zero,
                                     microbatches=sequences // dp, recompute=recompute,
                                     sequence_parallel=sequence_parallel, **schedule)


def choose(model: ModelConfig | str, cluster: ClusterSpec, global_batch_tokens: int,
           seq: int, max_gpus: int | None = None,
           inter_node_tp: bool = False,
           sequence_parallel: bool = True) -> list[Ranked]:
    """The layouts that fit on `max_gpus` (default: the whole cluster), fastest
    first by estimated step time. TP stays within a node unless inter_node_tp;
    sequence_parallel=False ranks the layouts without it (a 2021 Megatron-LM).
    ("none" recomputation is left out: with FlashAttention it keeps what
    "selective" keeps.)"""
    config = MODELS[model] if isinstance(model, str) else model
    gpus = cluster.gpus if max_gpus is None else max_gpus
    if gpus > cluster.gpus:
        raise ValueError(f"max_gpus {gpus} is more than the cluster's {cluster.gpus}")
    if global_batch_tokens % seq:
        raise ValueError(f"global batch {global_batch_tokens} tokens is not a whole "
                         f"number of {seq}-token sequences")
    fits = []
    for layout in candidates(config, cluster, global_batch_tokens, seq, gpus,
                             inter_node_tp, sequence_parallel):
        try:
            est = estimate(config, layout, cluster, global_batch_tokens, seq)
        except ValueError:
            continue
        if est.fits:
            fits.append(est)
    fits.sort(key=lambda e: (e.step_time, e.memory_total))
    return [Ranked(i + 1, e) for i, e in enumerate(fits)]


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
    gap = {term: mine.estimate.time[term] - best.estimate.time[term]
           for term in best.estimate.time}
    worse = sorted((term for term in gap if gap[term] > 0), key=lambda t: -gap[t])[:2]
    better = sorted((term for term in gap if gap[term] < 0), key=lambda t: gap[t])[:1]
    why = "; ".join(f"{_KIND[term]} {gap[term]:+.2f} s" for term in worse)
    text = (f"{head}; the chooser prefers {best.layout} at {best.step_time:.2f} s "
            f"({best.step_time / mine.step_time - 1:+.0%}). The published layout "
            f"spends more on {why}")
    if better:
        text += f", and less on {_KIND[better[0]]} ({gap[better[0]]:+.2f} s)"
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
    extra_memory = mine.estimate.memory_total - best.estimate.memory_total
    text += (f". It uses {abs(extra_memory) / 1e9:,.1f} GB "
             f"{'more' if extra_memory > 0 else 'less'} memory per GPU. The "
             f"calculator prices matrix products by a roofline and collectives by "
             f"α-β; it does not see elementwise kernels, how well communication "
             f"really overlaps, stragglers and failures, checkpoints, or FP8.")
    return text
