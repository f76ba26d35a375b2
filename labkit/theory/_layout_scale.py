"""How many GPUs a model can use well: the fewest it fits on, and the most on
which its fastest layout still keeps them busy (for the chooser).

The chooser ranks the layouts of *all* the GPUs it is offered by step time. A
124M-parameter model offered 16,384 GPUs gets a layout that uses them all, and
each GPU then spends almost all of its time waiting: the fastest way to use every
GPU is not a good way to use any. `scale` says so, and what to use instead."""

from __future__ import annotations

from dataclasses import dataclass

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
    gpus: int               # offered
    best: object            # Ranked on all of them, or None
    fewest: int | None      # the fewest GPUs some layout fits on
    at_fewest: object
    suggested: int | None   # the most GPUs whose fastest layout is not wasteful
    at_suggested: object

    @property
    def wasteful(self) -> bool:
        return self.best is not None and self.best.estimate.mfu < WASTEFUL_MFU

    def advice(self) -> str:
        """Plain sentences: where it fits, and whether using every GPU is sane."""
        if self.fewest is None:
            return ""
        def run(r) -> str:
            return (f"{r.layout}, {seconds(r.step_time)} per step, "
                    f"{percent(r.estimate.mfu)} MFU")
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
    out, x = [], 1
    while x < gpus:
        out.append(x)
        x *= 2
    return out + [gpus]


def scale(choose, model: str, cluster, global_batch_tokens: int, seq: int,
          ranked: list | None = None, inter_node_tp: bool = False) -> Scale:
    """The fewest GPUs (1, 2, 4, ..., all) the model fits on, and, where the
    fastest layout on all of them is wasteful, the most GPUs whose fastest layout
    is not (or, if none is, the count whose fastest layout does best).
    `choose` is labkit.theory.layouts.choose (passed in: this module sits under
    it)."""
    def best_on(g: int):
        r = choose(model, cluster, global_batch_tokens, seq, max_gpus=g,
                   inter_node_tp=inter_node_tp)
        return r[0] if r else None

    counts = _counts(cluster.gpus)
    ranked = choose(model, cluster, global_batch_tokens, seq,
                    inter_node_tp=inter_node_tp) if ranked is None else ranked
    best = ranked[0] if ranked else None
    fewest = at_fewest = None
    for g in counts:
        at_fewest = best_on(g) if g < cluster.gpus else best
        if at_fewest is not None:
            fewest = g
            break
    suggested = at_suggested = None
    if fewest is not None and best is not None and \
            best.estimate.mfu < WASTEFUL_MFU:
        tried = [(g, best_on(g)) for g in counts if fewest <= g < cluster.gpus]
        tried = [(g, r) for g, r in tried if r is not None] + [(cluster.gpus, best)]
        good = [(g, r) for g, r in tried if r.estimate.mfu >= WASTEFUL_MFU]
        suggested, at_suggested = good[-1] if good else max(
            tried, key=lambda gr: gr[1].estimate.mfu)
    name = getattr(model, "name", model)
    return Scale(name, cluster.gpus, best, fewest, at_fewest, suggested,
                 at_suggested)
