"""Layer 5, exercise checks that explain what is wrong: one module per chapter.

May import every layer below it (viz, parallel, comm, ledger, theory, runtime, and
numerics, conventions, units); of labkit, only labkit.cli imports it.

A check runs the student's function against a reference and either prints one
success line or raises one `ExerciseError` naming the rank, the tensor and the
element; a stub still raising NotImplementedError is "not written yet" and does
not fail the notebook, except under `graded()`.
"""

from labkit.checks.collectives import (
    check_all_to_all,
    check_bytes_per_rank,
    check_cheap_reduce_scatter,
)
from labkit.checks.common import ExerciseError, NotAnswered, check_answer
from labkit.checks.data_parallel import (
    check_bucket_flush,
    check_bytes_per_step,
    check_uneven_shards,
)
from labkit.checks.fsdp import check_peak_share, check_zero3_hooks
from labkit.checks.memory import check_optimizer_bytes, check_smallest_n
from labkit.checks.networks import check_moe_combine, check_two_rings
from labkit.checks.pipeline import (
    check_1f1b_order,
    check_bubble_budget,
    check_in_flight,
)
from labkit.checks.placement import check_placement
from labkit.checks.ring import (
    check_ring_all_gather,
    check_ring_reduce_scatter,
    check_crossover,
)
from labkit.checks.sequence_parallel import (
    check_online_softmax_merge,
    check_sequence_parallel_mlp,
)
from labkit.checks.three_d import check_dp_bytes, check_ring_seconds
from labkit.checks.tensor_parallel import (
    check_conjugate_operators,
    check_row_parallel_forward,
)
from labkit.checks.zero import SliceSGD, check_zero1_step, check_zero2_peak

from labkit.checks.data_parallel import check_bucket_count
from labkit.checks.fsdp import check_min_units
from labkit.checks.placement import check_design
from labkit.checks.tensor_parallel import check_tp_layer_bytes, check_whole_over_half
from labkit.checks.three_d import check_peers_any_order, check_traffic_ratios
from labkit.checks.zero import elements_shared

from labkit.checks.expert_parallel import (
    check_balance,
    check_dispatch,
    check_ib_bytes,
)

from labkit.checks.sequence_parallel import check_cp_choice, check_ring_growth

from labkit.checks.mfu import MISCOUNT_NAMES, check_mfu, check_miscount
from labkit.checks.failures import (
    check_diloco_bytes,
    check_hung,
    check_interval,
    check_resume,
)

from labkit.checks.grading import graded, intact, remember

__all__ = ["ExerciseError", "SliceSGD", "check_answer", "check_bucket_flush",
           "check_placement", "check_ring_reduce_scatter", "check_uneven_shards",
           "check_zero1_step", "check_zero3_hooks"]
__all__ += ["check_all_to_all", "check_bytes_per_rank", "check_cheap_reduce_scatter",
            "check_conjugate_operators", "check_moe_combine",
            "check_online_softmax_merge", "check_optimizer_bytes", "check_peak_share",
            "check_ring_all_gather", "check_crossover", "check_row_parallel_forward",
            "check_sequence_parallel_mlp", "check_smallest_n", "check_two_rings"]
__all__ += ["check_1f1b_order", "check_bubble_budget", "check_in_flight",
            "check_tp_layer_bytes"]
__all__ += ["check_dp_bytes", "check_ring_seconds"]
__all__ += ["check_bytes_per_step", "check_zero2_peak"]
# named by chapters (one face per layer: tests/test_public_faces.py)
__all__ += ["check_bucket_count", "check_design", "check_min_units",
            "check_peers_any_order", "check_traffic_ratios", "check_whole_over_half",
            "elements_shared"]
__all__ += ["check_balance", "check_dispatch", "check_ib_bytes"]
__all__ += ["check_cp_choice", "check_ring_growth"]
__all__ += ["check_diloco_bytes", "check_hung", "check_interval", "check_resume"]
# an nbgrader assignment's first code cell and its locked test cells
# (labkit/cli/assignments.py)
__all__ += ["NotAnswered", "graded", "intact"]
__all__ += ["MISCOUNT_NAMES", "check_mfu", "check_miscount"]

# last: the checks' and closed forms' names as labkit's files define them
remember()
