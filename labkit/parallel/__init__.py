"""Layer 3, parallel training techniques: one technique per file, each a wrapper
or transform over a plain nn.Module, each checked against single-process training.

May import theory, ledger and runtime. models (the course's transformer in one
process, [s, b, h], one attention function: what every technique below splits),
data_parallel (naive, overlapped and bucketed all-reduce, and the parameter
server; data_parallel_buckets their flat buckets), precision (bf16 compute with
fp32 master weights), zero (ZeRO-1/2: optimizer state and gradients sharded),
fsdp (ZeRO-3: parameters sharded too, gathered per module; fsdp_hooks its
autograd side), reduce_scatter (gloo's missing reduce-scatter as one all-to-all
and a local sum), guards (the device and optimizer-step checks every wrapper
makes), checkpointing (recompute activations in backward), offload (optimizer
state and its step in host memory, ZeRO-Offload), groups (the tp/cp/pp/dp/ep rank
grid), tensor_parallel (Megatron's column- and row-parallel layers;
tensor_parallel_mappings their f, g and sequence all-gather/reduce-scatter as
autograd functions), sequence_parallel (LayerNorm and dropout on sequence
shards), context parallelism three ways: ring_attention (keys and values passed
round a ring), ulysses (all-to-all from sequence shards to head shards and back)
and allgather_attention (Llama 3's all-gather of keys and values),
expert_parallel and expert_routing (a mixture-of-experts layer, its router, and
the all-to-all dispatch and combine), pipeline_parallel (PipelineParallel: layers
cut into stages over a process group, GPipe and 1F1B, spans and measured bubble),
pipeline_schedules (each stage's order for GPipe, 1F1B, interleaved and ZB-H1;
simulate_schedule), three_d (DP x PP x TP of a tiny GPT on a rank grid).
The spans the wrappers record are labkit.ledger's Span.
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
from labkit.parallel.fsdp import FullyShardedDataParallel
from labkit.parallel.groups import ParallelGroups, grid
from labkit.parallel.models import (
    MLP,
    GPTBlock,
    SelfAttention,
    TinyGPT,
    TransformerLayer,
    attention,
    lm_loss,
)
from labkit.parallel.offload import HostCopy, OffloadedOptimizer
from labkit.parallel.pipeline_parallel import PipelineParallel, bubble_of_total_by_rank
from labkit.parallel.pipeline_schedules import simulate_schedule, stage_order
from labkit.parallel.precision import MasterWeights
from labkit.parallel.ring_attention import ring_attention
from labkit.parallel.sequence_parallel import ParallelTransformerLayer
from labkit.parallel.sharded_checkpoint import (
    checkpoint_bytes,
    load_full_state_dict,
    load_sharded,
    save_sharded,
)
from labkit.parallel.three_d import ThreeD, stage_layers
from labkit.parallel.tensor_parallel import (
    ColumnParallelLinear,
    ParallelMLP,
    ParallelSelfAttention,
    RowParallelLinear,
)
from labkit.parallel.zero import ShardedOptimizer

from labkit.parallel.pipeline_parallel import split_layers
from labkit.parallel.pipeline_schedules import Action, peak_in_flight
from labkit.parallel.recorded_ddp import RecordedDDP
from labkit.parallel.ring_attention import (
    Partial,
    RingBlock,
    block_partial,
    merge_partials,
    ring_schedule,
    shard_sequence,
)
from labkit.parallel.sequence_parallel import (
    forward_activations,
    sync_sequence_parallel_grads,
)
from labkit.parallel.tensor_parallel_mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)

from labkit.parallel.allgather_attention import (
    allgather_attention,
    balanced_rows,
    causal_work,
    shard_balanced,
)
from labkit.parallel.ulysses import (
    heads_to_sequence,
    sequence_to_heads,
    ulysses_attention,
)
from labkit.parallel.expert_parallel import (
    ExpertParallelMoE,
    MoELayer,
    MoEStats,
    all_to_all_rows,
    expert_parameters,
    sync_expert_data_parallel_grads,
)
from labkit.parallel.expert_routing import (
    Router,
    Routing,
    capacity,
    limit_nodes,
    switch_balance_loss,
    update_bias,
    within_capacity,
)

__all__ = ["Checkpointed", "DataParallel", "Flops", "FullyShardedDataParallel",
           "HostCopy", "MasterWeights",
           "OffloadedOptimizer", "ShardedOptimizer", "StepTime",
           "checkpoint", "count_flops", "time_step"]
__all__ += ["ColumnParallelLinear", "ParallelGroups", "ParallelMLP",
            "ParallelSelfAttention", "ParallelTransformerLayer", "RowParallelLinear",
            "TransformerLayer", "grid", "ring_attention"]
__all__ += ["PipelineParallel", "bubble_of_total_by_rank", "simulate_schedule",
            "stage_order"]
__all__ += ["ThreeD", "TinyGPT", "lm_loss", "stage_layers"]
__all__ += ["checkpoint_bytes", "load_full_state_dict", "load_sharded", "save_sharded"]
# named by chapters (one face per layer: tests/test_public_faces.py)
__all__ += ["Action", "GPTBlock", "Partial", "RingBlock",
            "MLP", "RecordedDDP", "SelfAttention", "attention", "block_partial",
            "copy_to_tensor_model_parallel_region", "forward_activations",
            "gather_from_sequence_parallel_region", "merge_partials", "peak_in_flight",
            "reduce_from_tensor_model_parallel_region",
            "reduce_scatter_to_sequence_parallel_region", "ring_schedule",
            "shard_sequence", "split_layers", "sync_sequence_parallel_grads"]
# context parallelism beside the ring; mixture of experts
__all__ += ["allgather_attention", "balanced_rows", "causal_work",
            "heads_to_sequence", "sequence_to_heads", "shard_balanced",
            "ulysses_attention"]
__all__ += ["ExpertParallelMoE", "MoELayer", "MoEStats", "Router",
            "Routing", "all_to_all_rows", "capacity", "expert_parameters",
            "limit_nodes", "switch_balance_loss", "sync_expert_data_parallel_grads",
            "update_bias", "within_capacity"]
