"""The layouts of published training runs, each with its source. runs.py pairs
each with its model, cluster and batch; the chooser (ranking.py) also tries
their degrees."""

from __future__ import annotations

from labkit.theory.layout.layout import Layout

# Brown et al. 2020 publish no parallel layout for GPT-3. Narayanan et al. 2021
# train the same shape (174.6B: 96 layers, hidden 12288, 96 heads) with
# model-parallel size 96 on 1536 A100s, batch 1536 (table 2, micro-batch 1:
# 141 teraFLOP/s per GPU). The split of 96 is not published: every model of
# their table 1 from 18B up runs TP 8, a DGX node (sec. 3.3 and 5.4.1), so we
# read it as TP 8 x PP 12. Megatron's 2021 optimizer is not sharded: ZeRO 0.
# Its runs recomputed every layer (full recomputation, which eq. 3's FLOPs
# count: Korthikanti et al. 2022, sec. 1) and had no sequence parallelism,
# which Korthikanti et al. 2022 introduced a year later.
GPT3_MEGATRON = Layout(tp=8, pp=12, dp=16, microbatches=96, recompute="full",
                       sequence_parallel=False, name="Megatron-LM GPT-3 175B")
# Llama Team 2024, table 4, 16,384 GPUs at 8K context: TP 8, CP 1, PP 16, DP
# 128, 16M tokens per batch (16 sequences per DP replica); groups in the order
# [TP, CP, PP, DP]. Sec. 3.3.2: FSDP shards optimizer state and gradients and
# keeps the weights after the forward: ZeRO-2's memory. It runs an
# interleaved pipeline schedule without publishing v; we take v = 2. It does
# not say what it recomputes; without dropout and with FlashAttention the
# activations fit without recomputation (selective keeps the same here).
LLAMA3_8K = Layout(tp=8, pp=16, dp=128, zero=2, microbatches=16,
                   recompute="selective", interleave=2, name="Llama 3 405B (8K)")
# Llama Team 2024, table 4, the long-context stage: 131,072-token sequences.
# The first arXiv versions print DP 4 with 16,384 GPUs, 16 sequences per DP rank
# and 16M tokens per batch; TP 8 x CP 16 x PP 16 x DP 4 is 8,192 GPUs and 8M
# tokens. The revision (arXiv v3) prints DP 8, which makes the row's GPUs and
# tokens agree: we take DP 8.
LLAMA3_LONG_CONTEXT = Layout(tp=8, pp=16, dp=8, cp=16, zero=2, microbatches=16,
                             recompute="selective", interleave=2,
                             name="Llama 3 405B (128K)")
# DeepSeek-AI 2024, sec. 3.2: PP 16 (DualPipe), EP 64 spanning 8 nodes,
# ZeRO-1 data parallelism, no tensor parallelism, 2048 H800s: DP = 2048 / 16
# = 128. Sec. 4.2: sequences of 4K, batch size 15360 sequences at the end.
# Sec. 3.2.3 recomputes RMSNorm and MLA up-projections: "selective" here.
DEEPSEEK_V3 = Layout(tp=1, pp=16, dp=128, ep=64, zero=1, microbatches=120,
                     recompute="selective", dualpipe=True, name="DeepSeek-V3")

PUBLISHED_LAYOUTS = {"gpt3-175b": GPT3_MEGATRON, "llama3-405b": LLAMA3_8K,
                     "llama3-405b-128k": LLAMA3_LONG_CONTEXT,
                     "deepseek-v3": DEEPSEEK_V3}
