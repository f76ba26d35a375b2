"""Layer 2, measurement: what a rank holds and sends, the memory and traffic ledgers.

Imports torch, labkit.runtime, labkit.probe, labkit.conventions and
labkit.units; nothing above it. Ranks start with it imported (PRELOAD_IN_RANKS).

`traffic()` records every collective a rank makes; `memory(...)` tracks the bytes a
process holds by category (`steps`: one entry per optimizer step); `holdings(...)`
counts what a model and optimizer hold (both count a DTensor by its local shard);
`timeline()` records compute and communication spans (a timing) without changing
when anything runs.
"""

from labkit.conventions import MODEL_STATES
from labkit.ledger.activations import forward_activations
from labkit.ledger.common import Ledger, recording
from labkit.ledger.holdings_ledger import Holdings, holdings
from labkit.ledger.memory_ledger import MEMORY_CATEGORIES, MemoryLedger, Step, memory
from labkit.ledger.timeline_ledger import TimelineLedger, overlap_fraction, timeline
from labkit.probe import Span, count_as, in_backward, on_host, union
from labkit.ledger.traffic_ledger import (
    Record,
    TrafficLedger,
    by_group,
    sum_records,
    summarize,
    traffic,
)

__all__ = ["MEMORY_CATEGORIES", "MODEL_STATES", "Holdings", "MemoryLedger", "Record",
           "Step", "Span", "TimelineLedger", "TrafficLedger", "count_as", "holdings",
           "memory", "on_host", "overlap_fraction", "sum_records", "summarize",
           "timeline", "traffic"]
__all__ += ["Ledger", "by_group", "forward_activations", "in_backward", "recording",
            "union"]

# the runtime has ranks start with this imported once the kernel has (it pulls
# in DTensor, slow to import: `python -X importtime` shows how slow)
PRELOAD_IN_RANKS = True
