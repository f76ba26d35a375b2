"""What a rank holds and sends: the memory and traffic ledgers.

`traffic()` records every collective a rank makes; `memory(...)` tracks the bytes a
process holds by category; `holdings(...)` counts what a model and optimizer hold.
"""

from labkit.ledger.memory import CATEGORIES, Holdings, MemoryLedger, holdings, memory
from labkit.ledger.traffic import Record, TrafficLedger, summarize, total, traffic

__all__ = ["CATEGORIES", "Holdings", "MemoryLedger", "Record", "TrafficLedger",
           "holdings", "memory", "summarize", "total", "traffic"]
