"""Layer 3, parallel training techniques: one technique per file, each a wrapper
or transform over a plain nn.Module, each checked against single-process training.

May import theory, ledger and runtime. data_parallel (naive, overlapped and
bucketed all-reduce, and the parameter server), events (compute and communication
spans, and how much of one hides the other), precision (bf16 compute with fp32
master weights), zero (ZeRO-1/2: optimizer state and gradients sharded), fsdp (ZeRO-3:
parameters sharded too, gathered per module; fsdp_hooks its autograd side),
guards (the device and optimizer-step checks every wrapper makes),
checkpointing (recompute activations in backward), offload (optimizer state and
its step in host memory, ZeRO-Offload), groups (the tp/cp/pp/dp rank grid),
tensor_parallel (Megatron's column- and row-parallel layers; tensor_parallel_mappings
their f, g and sequence all-gather/reduce-scatter as autograd functions),
sequence_parallel (LayerNorm and dropout on sequence shards), ring_attention
(context parallelism), pipeline_parallel (PipelineParallel: layers cut into stages
over a process group, GPipe and 1F1B, spans and measured bubble), pipeline_schedules
(each stage's order for GPipe, 1F1B, interleaved and ZB-H1; simulate_schedule),
three_d (DP x PP x TP of a tiny GPT on a rank grid).
"""

from labkit.parallel.checkpointing import (
    Checkpointed,
    Flops,
    StepTime,
    checkpoint,
    count_flops,
    time_step,
)
from labkit.parallel.data_parallel import DataParallel
from labkit.parallel.events import Span, overlap_fraction
from labkit.parallel.fsdp import FullyShardedDataParallel
from labkit.parallel.groups import ParallelGroups, grid
from labkit.parallel.offload import OffloadedOptimizer, Transfer
from labkit.parallel.pipeline_parallel import PipelineParallel, bubble_fractions
from labkit.parallel.pipeline_schedules import simulate_schedule, stage_order
from labkit.parallel.precision import MasterWeights
from labkit.parallel.ring_attention import ring_attention
from labkit.parallel.sequence_parallel import ParallelTransformerLayer, TransformerLayer
from labkit.parallel.sharded_checkpoint import (
    checkpoint_bytes,
    load_full_state_dict,
    load_sharded,
    save_sharded,
)
from labkit.parallel.three_d import ThreeD, TinyGPT, lm_loss, stage_layers
from labkit.parallel.tensor_parallel import (
    ColumnParallelLinear,
    ParallelMLP,
    ParallelSelfAttention,
    RowParallelLinear,
)
from labkit.parallel.zero import ShardedOptimizer

__all__ = ["Checkpointed", "DataParallel", "Flops", "FullyShardedDataParallel",
           "MasterWeights",
           "OffloadedOptimizer", "ShardedOptimizer", "Span", "StepTime", "Transfer",
           "checkpoint", "count_flops", "overlap_fraction", "time_step"]
__all__ += ["ColumnParallelLinear", "ParallelGroups", "ParallelMLP",
            "ParallelSelfAttention", "ParallelTransformerLayer", "RowParallelLinear",
            "TransformerLayer", "grid", "ring_attention"]
__all__ += ["PipelineParallel", "bubble_fractions", "simulate_schedule", "stage_order"]
__all__ += ["ThreeD", "TinyGPT", "lm_loss", "stage_layers"]
__all__ += ["checkpoint_bytes", "load_full_state_dict", "load_sharded", "save_sharded"]
