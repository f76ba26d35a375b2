"""Silent data corruption (静默数据损坏): data-parallel replicas must be the same bits.
A 64-bit digest of every parameter's raw bits, all-gathered (8·(N-1) bytes a rank),
catches a rank whose bits differ, one flipped bit included, on every rank at once.

    check_replicas(model)          # after optimizer.step(): raises ReplicaMismatch
    first_difference(model)        # then, on every rank: which element, which bits

Imports torch and labkit.probe. Bits, not values: -0.0 and 0.0 differ, two NaNs
with different payloads differ, and one NaN held by every rank agrees.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from labkit.probe import phase

__all__ = ["CHECK_PHASE", "SEARCH_PHASE", "Difference", "ReplicaMismatch",
           "check_replicas", "first_difference", "replica_digest"]

# the traffic ledger's phases for the two exchanges
CHECK_PHASE = "replicas: one digest a rank compared"
SEARCH_PHASE = "replicas: bisecting for the first difference"

_MASK = (1 << 64) - 1
_COLS = 64  # word w of a tensor sits in column w % 64, and is rotated by that much
_ROW = 8 * _COLS  # bytes a row
_CHUNK_ROWS = 1 << 14  # rows folded at a time (8 MiB): bounds the temporary
_SEED = 0x243F6A8885A308D3  # the digest of no tensors (any constant would do)


# -- the digest ---------------------------------------------------------------------

def replica_digest(tensors, *, buffers: bool = False) -> int:
    """A 64-bit digest (an int in [0, 2**64)) of the exact bits of a module's
    parameters (tied ones once; frozen ones too), and of its buffers with
    buffers=True; or of a list (or name -> tensor dict) of tensors, in order.

    Each tensor's bytes are read as 64-bit words, in one pass. Word w is rotated
    left by w mod 64 and all are XORed together: t's 64-bit column digest. The
    tensors are then chained, each through a bijective mix (SplitMix64's
    finalizer) with its dtype and shape, so their order counts.

    Guaranteed, not likely: any odd number of flipped bits in one tensor (one
    flip above all) changes the digest, and so does any change confined to one
    word (any one element of up to 8 bytes: none straddles two words), since
    each step maps its input one-to-one. Also caught: two words of one tensor
    swapped, unless they lie a multiple of 64 words apart or their XOR repeats
    under the rotation between them; and, with probability about 1 - 2**-64 but
    not for sure, tensors in another order and changes in several tensors.
    Not guaranteed: an even number of flips in one tensor whose rotated
    positions pair up (the same bit of two words 64 words apart is missed), and
    anything a 64-bit digest cannot do: it is a checksum, not a cryptographic
    hash, so it catches accidents, not an adversary.
    """
    return _chain(_tensor_digests(_named(tensors, buffers)))[-1]


def _named(tensors, buffers: bool) -> list[tuple[str, torch.Tensor]]:
    if isinstance(tensors, torch.nn.Module):
        out = list(tensors.named_parameters())  # tied parameters once
        return out + list(tensors.named_buffers()) if buffers else out
    if isinstance(tensors, dict):
        return list(tensors.items())
    return [(f"tensor {i}", t) for i, t in enumerate(tensors)]


def _raw(t: torch.Tensor) -> torch.Tensor:
    """t's bytes, in element order: (nbytes,) uint8."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _xor_rows(rows: torch.Tensor) -> torch.Tensor:
    """(r, 64) int64 -> (64,): XOR of the rows, by halving (about r words of work;
    torch has no XOR reduction)."""
    if rows.shape[0] == 1:
        return rows[0].clone()
    half = rows.shape[0] // 2
    x = rows[:half] ^ rows[half:2 * half]  # the only temporary: r/2 rows
    if rows.shape[0] % 2:
        x[0] ^= rows[-1]
    while x.shape[0] > 1:
        n, half = x.shape[0], x.shape[0] // 2
        x[:half] ^= x[half:2 * half]
        if n % 2:
            x[0] ^= x[n - 1]
        x = x[:half]
    return x[0]


def _columns(raw: torch.Tensor) -> torch.Tensor:
    """(nbytes,) uint8 -> (64,) int64: the XOR of the words in each column, the
    bytes past the last whole word read as if followed by zeros."""
    acc = torch.zeros(_COLS, dtype=torch.int64, device=raw.device)
    full = raw.numel() // _ROW
    if full:
        body = raw[:full * _ROW]
        try:
            rows = body.view(torch.int64).view(full, _COLS)
        except RuntimeError:  # a view not aligned to 8 bytes: copy it
            rows = body.clone().view(torch.int64).view(full, _COLS)
        for start in range(0, full, _CHUNK_ROWS):
            acc ^= _xor_rows(rows[start:start + _CHUNK_ROWS])
    rest = raw.numel() - full * _ROW
    if rest:
        tail = torch.zeros(_ROW, dtype=torch.uint8, device=raw.device)
        tail[:rest] = raw[full * _ROW:]
        acc ^= tail.view(torch.int64)
    return acc


def _rotate_fold(columns: list[int]) -> int:
    """XOR of column c rotated left by c bits (each column's words, one-to-one)."""
    out = 0
    for c, w in enumerate(columns):
        w &= _MASK
        out ^= ((w << c) | (w >> (64 - c))) & _MASK
    return out


def _mix(z: int) -> int:
    """SplitMix64's finalizer (Steele, Lea & Flood 2014, "Fast splittable
    pseudorandom number generators"; constants as in Java's SplittableRandom):
    a bijection on 64-bit words that spreads every input bit over all of them."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _tag(t: torch.Tensor) -> int:
    """dtype and shape as a number every process computes alike (hash() of a
    string is salted per process)."""
    return zlib.crc32(f"{t.dtype} {tuple(t.shape)}".encode())


def _tensor_digests(named) -> list[tuple[int, int]]:
    """(tag, column digest) of each tensor; one transfer to the host for all."""
    if not named:
        return []
    cols = torch.stack([_columns(_raw(t)).cpu() for _, t in named]).tolist()
    return [(_tag(t), _rotate_fold(c)) for (_, t), c in zip(named, cols)]


def _chain(digests) -> list[int]:
    """Digests of every prefix: out[m] covers the first m tensors."""
    out = [_SEED]
    for tag, d in digests:
        out.append(_mix(_mix(out[-1] ^ tag) ^ d))  # one-to-one in d
    return out


# -- the exchange -------------------------------------------------------------------

def _signed(u: int) -> int:
    return u - (1 << 64) if u >= 1 << 63 else u


def _gather(words: list[int], group, device) -> list[tuple[int, ...]]:
    """All-gather len(words) 64-bit words a rank: each rank's, in group order."""
    mine = torch.tensor([_signed(w & _MASK) for w in words], dtype=torch.int64,
                        device=device)
    n = dist.get_world_size(group)
    out = torch.empty(n * len(words), dtype=torch.int64, device=device)
    dist.all_gather_single(out, mine, group=group)
    flat = [w & _MASK for w in out.tolist()]
    return [tuple(flat[i * len(words):(i + 1) * len(words)]) for i in range(n)]


def _device(named, group) -> torch.device:
    if named:
        return named[0][1].device
    backend = str(dist.get_backend(group))
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" \
        else torch.device("cpu")


def _global_ranks(group) -> tuple[int, ...]:
    return tuple(dist.get_global_rank(group, i)
                 for i in range(dist.get_world_size(group)))


def _who(ranks) -> str:
    """'rank 2', 'ranks 0 and 1', 'ranks 0, 1 and 3'."""
    rs = [str(r) for r in ranks]
    if len(rs) == 1:
        return f"rank {rs[0]}"
    return f"ranks {', '.join(rs[:-1])} and {rs[-1]}"


class ReplicaMismatch(RuntimeError):
    """The ranks' parameter digests differ; raised on every rank alike.

    ranks: the global ranks of the group, in order; digests: each one's digest.
    majority: the ranks that hold the most common digest (None on a tie);
    suspects: the others (every rank, on a tie)."""

    def __init__(self, ranks, digests):
        self.ranks, self.digests = tuple(ranks), tuple(digests)
        holders: dict[int, list[int]] = {}
        for r, d in zip(self.ranks, self.digests):
            holders.setdefault(d, []).append(r)
        most = max(len(rs) for rs in holders.values())
        leaders = [d for d, rs in holders.items() if len(rs) == most]
        if len(leaders) == 1:
            self.majority: tuple[int, ...] | None = tuple(holders[leaders[0]])
            self.suspects = tuple(r for r in self.ranks if r not in self.majority)
            others = [(d, rs) for d, rs in holders.items() if d != leaders[0]]
            if len(others) == 1:
                d, rs = others[0]
                diff = (f"{_who(rs)}'s parameters differ from "
                        f"{_who(self.majority)}'s (digest {d:#018x} vs "
                        f"{leaders[0]:#018x})")
            else:
                diff = (" and ".join(f"{_who(rs)}'s ({d:#018x})" for d, rs in others)
                        + f" parameters differ from {_who(self.majority)}'s "
                          f"({leaders[0]:#018x})")
            which = "one rank" if len(self.suspects) == 1 else "those ranks"
            msg = f"{diff}: a flipped bit, or a step {which} did differently"
        else:
            self.majority, self.suspects = None, self.ranks
            held = ", ".join(f"{_who(rs)} {'holds' if len(rs) == 1 else 'hold'} "
                             f"digest {d:#018x}" for d, rs in holders.items())
            msg = (f"the ranks' parameters differ and split evenly, so no majority "
                   f"says which are right: {held}: a flipped bit, or a step some "
                   f"ranks did differently")
        super().__init__(msg)

    def __reduce__(self):  # rebuilt from its data, in the kernel
        return type(self), (self.ranks, self.digests)


def check_replicas(module, group: dist.ProcessGroup | None = None, *,
                   buffers: bool = False) -> None:
    """Raise ReplicaMismatch on every rank of `group` (default: all) unless every
    rank's replica_digest(module, buffers=buffers) is the same.

    One all-gather of one int64 a rank: 8·(N-1) bytes each rank sends on a ring
    (labelled CHECK_PHASE in the traffic ledger). Call it on every rank, at the
    same point of the step (after optimizer.step(), say)."""
    group = group if group is not None else dist.group.WORLD
    named = _named(module, buffers)
    mine = _chain(_tensor_digests(named))[-1]
    with phase(CHECK_PHASE):
        got = _gather([mine], group, _device(named, group))
    digests = [g[0] for g in got]
    if len(set(digests)) > 1:
        raise ReplicaMismatch(_global_ranks(group), digests)


# -- where they differ ----------------------------------------------------------------

@dataclass(frozen=True)
class Difference:
    """The first tensor (and element) where the ranks' bits differ.

    index is None where the tensor's dtype or shape differs; bits and values are
    then None too. words: the 64-bit words each rank contributed to the search,
    so each rank sent 8·words·(N-1) bytes (`bus_bytes`)."""

    name: str
    index: tuple[int, ...] | None
    dtype: str
    ranks: tuple[int, ...]  # global ranks, in group order
    bits: tuple[int, ...] | None  # the element's bits on each rank
    values: tuple | None  # the element's value on each rank
    words: int

    @property
    def bus_bytes(self) -> int:
        return 8 * self.words * (len(self.ranks) - 1)

    def __str__(self) -> str:
        if self.index is None:
            return f"{self.name!r}: dtype or shape differs between the ranks"
        width = 2 * torch.empty(0, dtype=getattr(torch, self.dtype)).element_size()
        holders: dict[int, list[int]] = {}
        for r, b in zip(self.ranks, self.bits):
            holders.setdefault(b, []).append(r)
        value = dict(zip(self.bits, self.values))
        held = ", ".join(
            f"{_who(rs)} {'holds' if len(rs) == 1 else 'hold'} "
            f"0x{b:0{width}x} ({value[b]!r})"
            for b, rs in sorted(holders.items(), key=lambda kv: len(kv[1])))
        return f"{self.name}{list(self.index)} ({self.dtype}): {held}"


def _element_words(raw: torch.Tensor, j: int, size: int) -> list[int]:
    """Element j's bytes as 64-bit words (zero-padded)."""
    padded = torch.zeros(-(-size // 8) * 8, dtype=torch.uint8)
    padded[:size] = raw[j * size:(j + 1) * size].cpu()
    return [w & _MASK for w in padded.view(torch.int64).tolist()]


def _value(words, dtype: torch.dtype, size: int):
    t = torch.tensor([_signed(w) for w in words], dtype=torch.int64)
    return t.view(torch.uint8)[:size].view(dtype).item()


def first_difference(module, group: dist.ProcessGroup | None = None, *,
                     buffers: bool = False) -> Difference | None:
    """Where the ranks' tensors first differ (in replica_digest's order), found on
    every rank alike; None if every rank holds the same bits. Call it on every
    rank, e.g. after check_replicas raised.

    Bisection over prefixes, one all-gather of one 64-bit word a rank per round:
    the tensor count and whole digest (2 words), ceil(log2 P) rounds over the P
    tensors, the tensor's dtype, shape and size (2), ceil(log2 n) rounds over its
    n elements, and that element's bits (1 word, 2 for 16-byte elements): at
    most 8·(N-1)·(5 + ceil(log2 P) + ceil(log2 n)) bytes a rank, in as many
    rounds less one (each a latency), against 8·(N-1)·P for every tensor's
    digest at once (fewer bytes for P below about 16, and one round)."""
    group = group if group is not None else dist.group.WORLD
    named = _named(module, buffers)
    device = _device(named, group)
    tensor_digests = _tensor_digests(named)
    prefix = _chain(tensor_digests)
    words = 0

    def agree(mine: list[int]) -> bool:
        nonlocal words
        words += len(mine)
        return len(set(_gather(mine, group, device))) == 1

    with phase(SEARCH_PHASE):
        counts = _gather([len(named), prefix[-1]], group, device)
        words += 2
        if len({c[0] for c in counts}) > 1:
            raise ValueError(
                "first_difference: the ranks hold different numbers of tensors ("
                + ", ".join(str(c[0]) for c in counts) + "): not replicas")
        if len({c[1] for c in counts}) == 1:
            return None
        lo, hi = 0, len(named)  # prefix[lo] agrees everywhere, prefix[hi] does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if agree([prefix[mid]]) else (lo, mid)
        name, t = named[hi - 1]
        ranks, dtype = _global_ranks(group), str(t.dtype).removeprefix("torch.")
        if not agree([tensor_digests[hi - 1][0], t.numel()]):
            return Difference(name, None, dtype, ranks, None, None, words)
        raw, size = _raw(t), t.element_size()
        lo, hi = 0, t.numel()  # now over elements: the whole tensor differs
        while hi - lo > 1:
            mid = (lo + hi) // 2
            mine = [_rotate_fold(_columns(raw[:mid * size]).tolist())]
            lo, hi = (mid, hi) if agree(mine) else (lo, mid)
        j = hi - 1
        mine = _element_words(raw, j, size)
        got = _gather(mine, group, device)
        words += len(mine)
    bits = tuple(sum(w << (64 * k) for k, w in enumerate(g)) for g in got)
    values = tuple(_value(g, t.dtype, size) for g in got)
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(j), t.shape))
    return Difference(name, index, dtype, ranks, bits, values, words)
