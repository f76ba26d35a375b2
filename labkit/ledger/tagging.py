"""Telling the recording memory ledger what a tensor is: `count_as` (a gradient
shard kept outside any `.grad`, optimizer state in host memory) and `on_host`
(storages created in a block live in host memory)."""

from __future__ import annotations

import contextlib

import torch

from labkit.ledger.memory_ledger import MEMORY_CATEGORIES


def _recording_ledger():
    from labkit.ledger.common import recording

    led = recording("memory")
    if led is None or getattr(led, "tracker", None) is None:
        return None
    return led


def count_as(t: torch.Tensor, category: str, *, host: bool = False) -> None:
    """Tell the memory ledger recording in this process (if any) that `t` is held
    as `category` (e.g. a gradient shard kept outside any `.grad`), in host memory
    with host=True; else nothing."""
    if category not in MEMORY_CATEGORIES:
        raise ValueError(f"category must be one of {MEMORY_CATEGORIES}, "
                         f"not {category!r}")
    led = _recording_ledger()
    if led is not None:
        if host:
            led.to_host(t, category)
        else:
            led.tracker.track_as(t, category)


@contextlib.contextmanager
def on_host(category: str | None = None):
    """Storages created inside this block are host memory (the ledger's `host`), as
    `category`; without one: Temp inside an optimizer step (Optstate if it survives
    the step), else Other. A no-op when no memory ledger records."""
    if category is not None and category not in MEMORY_CATEGORIES:
        raise ValueError(f"category must be one of {MEMORY_CATEGORIES}, "
                         f"not {category!r}")
    led = _recording_ledger()
    if led is None:
        yield
        return
    led.host_ctx.append(category)
    try:
        yield
    finally:
        led.host_ctx.pop()
