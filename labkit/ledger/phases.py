"""Which phase of a training step is running, as both ledgers label it."""

from __future__ import annotations

import torch


def current_phase(explicit: list[str], in_optimizer: bool, in_forward: bool) -> str:
    """A label set with `ledger.phase(...)` wins; then the optimizer step, the
    backward pass (autograd is running a graph task), a module's forward, "other"."""
    if explicit:
        return explicit[-1]
    if in_optimizer:
        return "optimizer"
    if torch._C._current_graph_task_id() != -1:
        return "backward"
    return "forward" if in_forward else "other"
