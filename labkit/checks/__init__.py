"""Layer 5, exercise checks that explain what is wrong.

A check runs the student's function on real ranks, compares it with a reference,
and either prints a short success line or raises `ExerciseError` naming the rank,
the tensor (or chunk) and the element that is wrong. A function that still raises
NotImplementedError is "not written yet": the check says so and returns False
without failing the notebook. May import every layer below; one module per
chapter that has checks.
"""

from labkit.checks.common import ExerciseError, check_answer
from labkit.checks.data_parallel import check_bucket_flush, check_uneven_shards
from labkit.checks.fsdp import check_zero3_hooks
from labkit.checks.placement import check_placement
from labkit.checks.ring import check_ring_reduce_scatter
from labkit.checks.zero import SliceSGD, check_zero1_step

__all__ = ["ExerciseError", "SliceSGD", "check_answer", "check_bucket_flush",
           "check_placement", "check_ring_reduce_scatter", "check_uneven_shards",
           "check_zero1_step", "check_zero3_hooks"]
