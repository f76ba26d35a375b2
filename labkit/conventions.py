"""Conventions shared by measurement and theory (standard library only).

Bus-bandwidth factors of nccl-tests (github.com/NVIDIA/nccl-tests,
doc/PERFORMANCE.md): busbw = algbw * factor(n). For the ring algorithms, S times
the factor is also the number of bytes each rank sends (Patarasuk & Yuan 2009).
"""

from __future__ import annotations

BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "scatter": lambda n: (n - 1) / n,
    "gather": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "send": lambda n: 1.0,
    "recv": lambda n: 1.0,
    "barrier": lambda n: 0.0,
}
