"""How many GPUs a model can use well: the fewest it fits on, and the most on
which its fastest layout still keeps them busy (for the chooser).

The chooser ranks the layouts of *all* the GPUs it is offered by step time. A
124M-parameter model offered 16,384 GPUs gets a layout that uses them all, and
each GPU then spends almost all of its time waiting: the fastest way to use every
GPU is not a good way to use any. `scale` says so, and what to use instead."""

from __future__ import annotations

from dataclasses import dataclass

from labkit.theory.layout.cluster import ClusterSpec
from labkit.theory.layout.ranking import Ranked, choose
from labkit.theory.models import MODELS, ModelConfig
from labkit.units import percent, seconds

# Below this model FLOPs utilisation most of every GPU's time goes to waiting,
# not to the model's arithmetic. Published large runs reach 35-50 % (Llama 3
# 405B: 38-43 %, Llama Team 2024, table 4; GPT models of 1.7B to 1T parameters on
# Selene 44-52 % of peak counting recomputation, about 33-39 % without it,
# Narayanan et al. 2021, table 1): a layout under a quarter of that is wasteful.
WASTEFUL_MFU = 0.10


@dataclass(frozen=True)
class Scale:
    """What a model can use on a cluster. Each `Ranked` is the fastest layout on
    that many GPUs (None where no layout fits)."""

    model: str
    gpus: int                   # offered
    best: Ranked | None         # the fastest on all of them
    fewest: int | None          # the fewest GPUs some layout fits on
    at_fewest: Ranked | None
    suggested: int | None       # the most GPUs whose fastest layout is not wasteful
    at_suggested: Ranked | None

    @property
    def wasteful(self) -> bool:
        return self.best is not None and self.best.estimate.mfu < WASTEFUL_MFU

    def advice(self) -> str:
        """Plain sentences: where it fits, and whether using every GPU is sane."""
        if self.fewest is None:
            return ""
        def run(ranked: Ranked) -> str:
            return (f"{ranked.layout}, {seconds(ranked.step_time)} per step, "
                    f"{percent(ranked.estimate.mfu)} MFU")
        gpu = "GPU" if self.fewest == 1 else "GPUs"
        text = (f"{self.model} fits on as few as {self.fewest:,} {gpu} "
                f"({run(self.at_fewest)}).")
        if not self.wasteful:
            return text
        text += (f" On all {self.gpus:,} GPUs the fastest layout reaches only "
                 f"{percent(self.best.estimate.mfu)} MFU: most of every GPU's time "
                 f"would go to waiting, so it is wasteful, not a recommendation.")
        if self.suggested is not None and \
                self.at_suggested.estimate.mfu >= WASTEFUL_MFU:
            text += (f" {self.suggested:,} GPUs is the most on which a layout still "
                     f"reaches {percent(WASTEFUL_MFU)} MFU ({run(self.at_suggested)}).")
        elif self.suggested is not None:
            text += (f" No layout reaches {percent(WASTEFUL_MFU)} MFU here; it does "
                     f"best on {self.suggested:,} GPUs ({run(self.at_suggested)}).")
        return text


def _counts(gpus: int) -> list[int]:
    out, count = [], 1
    while count < gpus:
        out.append(count)
        count *= 2
    return out + [gpus]


def scale(model: ModelConfig | str, cluster: ClusterSpec, global_batch_tokens: int,
          seq: int, ranked: list[Ranked] | None = None,
          inter_node_tp: bool = False) -> Scale:
    """The fewest GPUs (1, 2, 4, ..., all) the model fits on and, where its
    fastest layout on all of `cluster` reaches under WASTEFUL_MFU, the most GPUs
    on which one does not (or, if none does, the count whose fastest layout does
    best); `.advice()` says it in sentences. `ranked`: choose()'s answer on the
    whole cluster, where the caller has it."""
    def best_on(gpus: int) -> Ranked | None:
        on_these = choose(model, cluster, global_batch_tokens, seq, max_gpus=gpus,
                          inter_node_tp=inter_node_tp)
        return on_these[0] if on_these else None

    counts = _counts(cluster.gpus)
    ranked = choose(model, cluster, global_batch_tokens, seq,
                    inter_node_tp=inter_node_tp) if ranked is None else ranked
    best = ranked[0] if ranked else None
    fewest = at_fewest = None
    for gpus in counts:
        at_fewest = best_on(gpus) if gpus < cluster.gpus else best
        if at_fewest is not None:
            fewest = gpus
            break
    suggested = at_suggested = None
    if fewest is not None and best is not None and \
            best.estimate.mfu < WASTEFUL_MFU:
        tried = [(gpus, best_on(gpus)) for gpus in counts
                 if fewest <= gpus < cluster.gpus]
        tried = [(gpus, r) for gpus, r in tried if r is not None] + [
            (cluster.gpus, best)]
        good = [(gpus, r) for gpus, r in tried if r.estimate.mfu >= WASTEFUL_MFU]
        suggested, at_suggested = good[-1] if good else max(
            tried, key=lambda pair: pair[1].estimate.mfu)
    name = MODELS[model].name if isinstance(model, str) else model.name
    return Scale(name, cluster.gpus, best, fewest, at_fewest, suggested,
                 at_suggested)
