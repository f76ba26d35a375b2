"""Layer 3, parallel training techniques: one technique per file, each a wrapper
or transform over a plain nn.Module, each checked against single-process training.

May import theory, ledger and runtime. Today: precision (bf16 compute with fp32
master weights).
"""

from labkit.parallel.precision import MasterWeights

__all__ = ["MasterWeights"]
