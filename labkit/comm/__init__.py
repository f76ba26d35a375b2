"""Layer 3, communication: the collectives by definition (plain Python), built from
send/recv on real ranks and timed (algbw/busbw); the networks they run on
(topology as graphs; the published hardware figures are theory.hardware).

May import theory, ledger and runtime.
"""

from labkit.comm import bandwidth, collectives, topology

__all__ = ["bandwidth", "collectives", "topology"]
