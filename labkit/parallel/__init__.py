"""Layer 3, parallel training techniques: one technique per file, each a wrapper
or transform over a plain nn.Module, each checked against single-process training.

May import theory, probe and runtime, never the ledgers (import-linter's second
contract): a technique says what it does through labkit.probe (its spans, what a
tensor is held as) and a ledger that records listens there. docs/design.md says
which file holds which technique.
"""

from labkit.parallel.activation_checkpointing import (
    ActivationCheckpointed,
    Flops,
    StepTime,
    activation_checkpoint,
    count_flops,
    time_step,
)
from labkit.parallel.data_parallel import DataParallel
from labkit.parallel.diloco import DiLoCo, quantized_average
from labkit.parallel.replicas import (
    ReplicaMismatch,
    check_replicas,
    first_difference,
    replica_digest,
)
from labkit.parallel.resume import (
    ResumableSampler,
    Resumed,
    load_train_state,
    rng_state,
    save_train_state,
    set_rng_state,
)
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
from labkit.parallel.sequence_parallel import sync_sequence_parallel_grads
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

__all__ = ["ActivationCheckpointed", "DataParallel", "Flops",
           "FullyShardedDataParallel",
           "HostCopy", "MasterWeights",
           "OffloadedOptimizer", "ShardedOptimizer", "StepTime",
           "activation_checkpoint", "count_flops", "time_step"]
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
            "copy_to_tensor_model_parallel_region",
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
# DiLoCo and Streaming DiLoCo (chapter 13)
__all__ += ["DiLoCo", "quantized_average"]
# resuming exactly (chapter 13)
__all__ += ["ResumableSampler", "Resumed", "load_train_state", "rng_state",
            "save_train_state", "set_rng_state"]
# silent data corruption: replicas compared by digest (chapter 13)
__all__ += ["ReplicaMismatch", "check_replicas", "first_difference",
            "replica_digest"]
# the logical-scale twin (chapter 14): imported on first use, as it pulls in
# FSDP2's replicate and the fake process group (a second of imports)
_SCALE_TWIN = ("Collective", "Row", "TwinReport", "compare", "twin")
__all__ += list(_SCALE_TWIN)


def __getattr__(name):
    if name in _SCALE_TWIN:
        from labkit.parallel import scale_twin

        return getattr(scale_twin, name)
    raise AttributeError(f"module 'labkit.parallel' has no attribute {name!r}")
