"""Gradient buckets, one abstraction for DataParallel, ZeRO and ThreeD: `fill`
groups parameters in backward's order by DDP's rule, and a `Bucket` holds its
gradients in one flat buffer that every `.grad` becomes a view into (as DDP's
gradient_as_bucket_view), so a bucket goes on the wire without packing and its
average is in the .grads without a copy back. Imports torch and labkit.probe.

Also the bitmask DataParallel's usage check sends (pack_bits, unpack_bits).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from labkit.probe import count_as


def fill(params: list, cap: float | None, first_cap: float | None = None,
         size=lambda p: p.numel() * p.element_size()) -> list[list]:
    """Parameters, in the order given (backward's: reverse registration), into
    groups: a group closes once it holds >= cap (by `size`, bytes unless told) and
    at a change of dtype; the first closes at >= first_cap, so the first
    collective starts early (DDP's rule: bucket_cap_mb, 25 MiB, and 1 MiB first).
    cap None: one parameter a group."""
    groups: list[list] = []
    held = 0.0
    for p in params:
        new_dtype = bool(groups) and p.dtype != groups[-1][0].dtype
        limit = first_cap if len(groups) == 1 and first_cap is not None else cap
        if not groups or cap is None or held >= limit or new_dtype:
            groups.append([])
            held = 0.0
        groups[-1].append(p)
        held += size(p)
    return groups


@dataclass(eq=False)
class Bucket:
    """Gradients sent together: with two or more parameters, one flat buffer whose
    slices become the .grads (it lives as long as they do: zero_grad(set_to_none=
    True) frees it, as it frees torch's own .grads); a lone contiguous gradient
    goes as it is. `sent` is what went on the wire this step."""

    index: int
    params: list
    names: list
    ready: int = 0  # gradients ready in this backward (overlap)
    sent: torch.Tensor | None = None  # the tensor the collective carries
    gathered: list | None = None  # the server's receive buffers (parameter_server)
    work: object = None  # the async collective
    done: object = None  # future of when it completed (labkit.probe.completed_at)
    issued: float = 0.0
    _flat: object = None  # weak ref to the buffer: its views, the .grads, hold it
    _lent: list = field(default_factory=list)  # weak refs to the .grad views made

    def __post_init__(self):
        if len({p.dtype for p in self.params}) > 1:
            raise ValueError("a bucket's parameters must share one dtype, got "
                             f"{sorted({str(p.dtype) for p in self.params})}")

    def to_send(self) -> torch.Tensor:
        """The tensor to send: the lone parameter's .grad itself (or a copy); else
        the flat buffer, after each .grad not yet a view of it is copied in and
        made one, and the slot of a parameter without a gradient is zeroed (this
        rank's part of the sum; its .grad stays None)."""
        ps = self.params
        if len(ps) == 1:
            g = ps[0].grad
            if g is not None and g.is_contiguous():
                return g
            copy = (torch.zeros(ps[0].numel(), dtype=ps[0].dtype, device=ps[0].device)
                    if g is None else g.reshape(-1).clone())
            count_as(copy, "Temp")  # made to send
            return copy
        # the last buffer is used again while its .grads live and nobody else
        # holds one (after zero_grad(set_to_none=False): summed in place);
        # otherwise a new one, so a .grad kept from the last step stays as it was
        flat = self._flat() if self._flat is not None else None
        grads = {id(p.grad) for p in ps if p.grad is not None}
        self._lent = [r for r in self._lent if r() is not None]
        if flat is None or any(id(r()) not in grads for r in self._lent):
            flat = torch.empty(sum(p.numel() for p in ps), dtype=ps[0].dtype,
                               device=ps[0].device)
            self._flat, self._lent = weakref.ref(flat), []
            count_as(flat, "Temp")  # being filled: the .grads are still theirs
        slots, at = [], 0
        for p in ps:
            slots.append(flat[at:at + p.numel()].view_as(p))
            at += p.numel()
        moved = []
        for p, slot in zip(ps, slots):  # every copy first, then the .grads move:
            if p.grad is None:  # never both counted as Gradient
                slot.zero_()
            elif p.grad.data_ptr() != slot.data_ptr() or not p.grad.is_contiguous():
                slot.copy_(p.grad)
                moved.append((p, slot))
        for p, slot in moved:
            p.grad = slot
            self._lent.append(weakref.ref(slot))
        if moved:
            count_as(flat, "Gradient")
        return flat

    def received(self, sent: torch.Tensor) -> None:
        """After the collective: where `sent` is not the .grads' storage (a lone
        gradient sent as a copy), copy it back into the .grad."""
        p = self.params[0]
        if len(self.params) == 1 and p.grad is not None and sent is not p.grad:
            p.grad.copy_(sent.view_as(p.grad))


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
