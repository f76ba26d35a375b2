"""Layer 3, communication: the collectives by definition (plain Python), built from
send/recv on real ranks and timed (algbw/busbw); the networks they run on
(topology as graphs; the published hardware figures are theory.hardware).

May import theory, ledger and runtime.
"""

from labkit.comm import bandwidth, collectives, topology
from labkit.comm.bandwidth import sweep, time_collective
from labkit.comm.collectives import (
    OPS,
    course_example,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
    ring_steps,
    simulate,
)
from labkit.comm.two_hosts import cannot_make_namespaces, run_on_two_hosts
from labkit.comm.topology import (
    all_to_all_transfers,
    fat_tree,
    ring,
    ring_all_reduce_transfers,
    ring_order,
    route,
    switch,
    torus,
)

__all__ = ["bandwidth", "collectives", "topology"]
__all__ += ["OPS", "course_example", "ring_all_gather", "ring_all_reduce",
            "ring_reduce_scatter", "ring_steps", "simulate", "sweep",
            "time_collective"]
__all__ += ["all_to_all_transfers", "fat_tree", "ring", "ring_all_reduce_transfers",
            "ring_order", "route", "switch", "torus"]
# two network stacks on one Linux machine (root): chapter 13, make two-hosts
__all__ += ["cannot_make_namespaces", "run_on_two_hosts"]
