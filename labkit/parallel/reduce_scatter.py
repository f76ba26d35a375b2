"""Reduce-scatter as the wrappers run it: one all-to-all and a local sum.

gloo's own reduce_scatter sends as much as an all-reduce (2(N-1)/N of the
payload, measured in tests/test_ledger_traffic.py). An all-to-all that sends
chunk q of a rank's tensor to rank q sends exactly the (N-1)/N of a ring
reduce-scatter, takes uneven splits, and can run asynchronously; each rank then
sums the N chunks it received, in rank order, so every rank's sum is computed the
same way. The traffic ledger lists it as all_to_all. Tensor parallelism
(tensor_parallel_mappings.py), ZeRO's buckets (zero_buckets.py) and FSDP's
gradients (fsdp_units.py) all reduce-scatter through these two functions.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.probe import count_as


def send_chunks(send: torch.Tensor, group=None, *, splits: list[int] | None = None,
                receive: int | None = None, category: str | None = None,
                async_op: bool = False):
    """Start the exchange: chunk q of `send` (along dim 0) goes to rank q.

    Equal chunks by default. `splits` gives how many rows go to each rank and
    `receive` how many this rank gets from each (the same from every rank).
    `category` names the receive buffer for the memory ledger (e.g. "Temp").
    Returns (got, work): got holds the N chunks received, rank 0's first; work
    is None unless async_op."""
    n = dist.get_world_size(group)
    if receive is None:
        got = torch.empty_like(send, memory_format=torch.contiguous_format)
    else:
        got = send.new_empty(n * receive, *send.shape[1:])
    if category:
        count_as(got, category)
    work = dist.all_to_all_single(
        got, send.contiguous(), None if receive is None else [receive] * n, splits,
        group=group, async_op=async_op)
    return got, work


def sum_chunks(got: torch.Tensor, n: int, *, average: bool = False,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """The sum (average, if asked; op=AVG) of the n equal chunks of `got` along
    dim 0, added in rank order, in `dtype` (default: got's own)."""
    chunks = got.view(n, got.shape[0] // n, *got.shape[1:])
    if dtype is not None:
        chunks = chunks.to(dtype)
    out = chunks.sum(0)
    return out.div_(n) if average else out
