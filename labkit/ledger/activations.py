"""How many bytes a layer's forward leaves for its backward, measured by the memory
ledger (chapter 11's activation tables)."""

from __future__ import annotations

import gc
import time

import torch
from torch import nn

from labkit.ledger.memory_ledger import memory


def forward_activations(layer: nn.Module, make_input) -> int:
    """Bytes one forward of `layer` leaves for its backward, by the memory ledger:
    its Activation after forward, counting the input (`make_input()` is called
    inside: the previous layer's output, which the first LayerNorm keeps) and not
    the output (the next layer's input). Runs the backward, to free them.

    gloo's worker thread lets go of a collective's buffers a moment after the call
    returns (now and then still held right after a forward), so the count is read
    once it has stayed the same for 100 ms."""
    with memory(layer) as m:
        x = make_input()
        out = layer(x)
        held = _settled(m) - out.untyped_storage().nbytes()
        out.backward(torch.ones_like(out))
    return held


def _settled(m, quiet: float = 0.1, limit: float = 5.0) -> int:
    """The ledger's Activation once unchanged for `quiet` seconds (at most
    `limit` seconds of waiting)."""
    gc.collect()
    last, since, start = m.current["Activation"], time.monotonic(), time.monotonic()
    while time.monotonic() - since < quiet and time.monotonic() - start < limit:
        time.sleep(0.01)
        now = m.current["Activation"]
        if now != last:
            last, since = now, time.monotonic()
    return last
