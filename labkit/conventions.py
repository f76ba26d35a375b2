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

# Memory categories: one vocabulary for what a rank holds, in every layer. The names
# are PyTorch's MemTracker's (torch.distributed._tools.mem_tracker._MemRefType), so
# a measured ledger, a closed form and a chart say the same word for the same bytes:
# a dict of bytes by category uses these keys, and a record with one field per
# category names the field `category.lower()` (BytesPerParam.optstate).
# Optstate is everything the optimizer owns: m and v, momentum, and fp32 master
# weights (the K of the ZeRO paper, sec. 3.1).
PARAMETER, BUFFER, GRADIENT = "Parameter", "Buffer", "Gradient"
OPTSTATE, ACTIVATION, TEMP, OTHER = "Optstate", "Activation", "Temp", "Other"
MEMORY_CATEGORIES = (PARAMETER, BUFFER, GRADIENT, OPTSTATE, ACTIVATION, TEMP, OTHER)
MODEL_STATES = (PARAMETER, GRADIENT, OPTSTATE)  # what ZeRO shards

# Placement semantics (course note 002) and the ZeRO paper write the training
# states as letters (P, G, O; A for activations): this is the one place they map.
STATE_LETTERS = {"P": PARAMETER, "O": OPTSTATE, "G": GRADIENT, "A": ACTIVATION}
