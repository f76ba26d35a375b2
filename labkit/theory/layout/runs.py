"""Published training runs: each published layout (published.py) with its
model, cluster and batch, priced (estimate) and ranked among the layouts its
cluster could have run (choose)."""

from __future__ import annotations

from dataclasses import dataclass

from labkit.theory.layout.costs import Estimate, estimate
from labkit.theory.layout.cluster import (
    A100_SELENE,
    DEEPSEEK_V3_CLUSTER,
    LLAMA3_CLUSTER,
    ClusterSpec,
)
from labkit.theory.layout.layout import Layout
from labkit.theory.layout.published import PUBLISHED_LAYOUTS
from labkit.theory.layout.ranking import Ranked, choose
from labkit.theory.models import MODELS


@dataclass(frozen=True)
class PublishedRun:
    model: str  # key of theory.MODELS
    layout: Layout
    cluster: ClusterSpec
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


# Each layout's source is beside it in published.py; the batches are the same
# sources': GPT-3 batch 1536 of 2048 tokens (Narayanan et al. 2021, table 2),
# Llama 3 16M tokens (table 4), DeepSeek-V3 15360 sequences of 4K (sec. 4.2).
PUBLISHED_RUNS = {
    "gpt3-175b": PublishedRun(
        "gpt3-175b", PUBLISHED_LAYOUTS["gpt3-175b"], A100_SELENE, 1536 * 2048, 2048,
        "Narayanan et al. 2021 (SC21), table 2 (Brown et al. 2020 give none)",
        "TP x PP = 96 is published; the split 8 x 12 is TP filling a node"),
    "llama3-405b": PublishedRun(
        "llama3-405b", PUBLISHED_LAYOUTS["llama3-405b"], LLAMA3_CLUSTER,
        2048 * 8192, 8192,
        "Llama Team 2024, 'The Llama 3 Herd of Models', table 4",
        "long-context stage: TP 8, CP 16, PP 16, DP 8 at 131,072 tokens"),
    "llama3-405b-128k": PublishedRun(
        "llama3-405b", PUBLISHED_LAYOUTS["llama3-405b-128k"], LLAMA3_CLUSTER,
        128 * 131072, 131072,
        "Llama Team 2024, 'The Llama 3 Herd of Models', table 4 (16M tokens per "
        "batch: 128 sequences of 131,072)"),
    "deepseek-v3": PublishedRun(
        "deepseek-v3", PUBLISHED_LAYOUTS["deepseek-v3"], DEEPSEEK_V3_CLUSTER,
        15360 * 4096, 4096,
        "DeepSeek-AI 2024, 'DeepSeek-V3 Technical Report', sec. 3.2 and 4.2"),
}
