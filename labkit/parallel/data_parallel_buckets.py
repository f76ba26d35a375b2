"""DataParallel's buckets: the gradients sent together as one flat tensor (pack,
unpack), filled by DDP's rule, each holding its collective while it is in
flight; and the bitmask of the parameters a rank used (pack_bits)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(eq=False)
class Bucket:
    """Gradients sent together, and their collective while it is in flight."""

    index: int
    params: list
    names: list
    ready: int = 0  # gradients ready in this backward (overlap)
    grads: list | None = None  # the gradients flattened into `flat`
    flat: torch.Tensor | None = None  # what was sent (the grad itself if alone)
    gathered: list | None = None  # the server's receive buffers (parameter_server)
    work: object = None  # the async collective
    done: object = None  # future of when it completed (labkit.probe.completed_at)
    issued: float = 0.0


def pack(tensors: list) -> torch.Tensor:
    """One flat tensor to send for `tensors`: a lone contiguous one as it is (no
    copy), else their concatenation (a copy)."""
    if len(tensors) == 1 and tensors[0].is_contiguous():
        return tensors[0]
    return torch.cat([t.reshape(-1) for t in tensors])


@torch.no_grad()
def unpack(flat: torch.Tensor, tensors: list) -> None:
    """Copy `flat`, pack(tensors) after a collective, back into `tensors`."""
    if flat is tensors[0]:
        return
    flat = flat.reshape(-1)  # a lone gradient keeps its shape
    for t, v in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(v.view(t.shape))


_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def pack_bits(flags: bytes | bytearray) -> torch.Tensor:
    """One bit a flag (0 or 1), 8 to a byte, flag i in bit i % 8 of byte i // 8:
    a uint8 tensor of ceil(len(flags) / 8) elements."""
    bits = torch.zeros(-(-len(flags) // 8) * 8, dtype=torch.uint8)
    if flags:
        bits[:len(flags)] = torch.frombuffer(bytearray(flags), dtype=torch.uint8)
    return (bits.view(-1, 8) * _BITS).sum(1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int) -> list[bool]:
    """The first n flags of pack_bits's result."""
    return ((packed.unsqueeze(1) & _BITS) != 0).reshape(-1)[:n].tolist()


def make_buckets(named, cap: float | None,
                  first_cap: float | None = None) -> list[Bucket]:
    """Fill buckets in order; close one once it holds >= cap bytes (DDP's rule;
    the first bucket >= first_cap, so the first all-reduce starts early)."""
    groups: list[list] = []
    size = 0.0
    for name, p in named:
        new_dtype = bool(groups) and p.dtype != groups[-1][0][1].dtype
        limit = first_cap if len(groups) == 1 and first_cap is not None else cap
        if not groups or cap is None or size >= limit or new_dtype:
            groups.append([])
            size = 0.0
        groups[-1].append((name, p))
        size += p.numel() * p.element_size()
    return [Bucket(i, [p for _, p in g], [n for n, _ in g])
            for i, g in enumerate(groups)]
