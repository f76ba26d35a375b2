"""Traffic ledger: every collective and point-to-point call a rank makes.

    with labkit.ledger.traffic() as t:
        dist.all_reduce(x)
    t.records[0].wire_bytes      # bytes this rank really wrote to its sockets

Imports torch, labkit.runtime, labkit.conventions, labkit.units and labkit.ledger's
common and c10d_calls. To give each call its own bytes it waits for every
collective before the next starts: inside it, async collectives run synchronously.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from labkit.conventions import BUS_FACTOR
from labkit.ledger.c10d_calls import (
    classify,
    group_of,
    io_path_ok,
    sent_to_others,
    tensors,
    wait_for,
    wchar,
)
from labkit.ledger.common import Ledger
from labkit.probe import set_activity
from labkit.units import human_bytes as human

FIELDS = ("payload_bytes", "bus_bytes", "wire_bytes", "seconds", "elements")


@dataclass(frozen=True)
class Record:
    """One collective or point-to-point call, as one rank saw it."""

    op: str  # all_reduce, all_gather, reduce_scatter, broadcast, ...
    group_size: int
    dtype: str
    elements: int  # elements in the payload S
    payload_bytes: int  # S, nccl-tests convention (whole array for gather/scatter)
    bus_bytes: float  # S * nccl-tests' bus factor; an all-to-all: S less its own chunk
    wire_bytes: int | None  # written to sockets during the call; None: unknown
    seconds: float  # until the call finished (complete) or was only issued (not)
    start: float  # time.perf_counter() (CLOCK_MONOTONIC: one clock for all ranks)
    complete: bool  # False for send/recv: issued, not waited for (see `written`)
    phase: str
    module: str | None
    rank: int
    # the global ranks of the group the call travelled in, in the group's order
    # (so a 3D run can tell its tensor-, pipeline- and data-parallel bytes apart)
    group_ranks: tuple[int, ...] = ()
    # a send's destination or a recv's source, as a global rank (None for a
    # collective, and for a recv from any source)
    peer: int | None = None

    def as_dict(self) -> dict:
        return asdict(self)


class TrafficLedger(Ledger, TorchDispatchMode):
    """Records every collective made inside it; see `traffic()`. A
    TorchDispatchMode: it also sees the calls PyTorch makes itself (DDP's bucket
    all-reduces, FSDP2's all-gathers)."""

    kind = "traffic"
    fields = ("records", "rank", "start", "stop", "written")  # what pickles

    def __init__(self, modules: dict[str, torch.nn.Module] | None = None):
        super().__init__()
        self.records: list[Record] = []
        self.rank = -1
        self.start = self.stop = 0.0  # perf_counter at enter and exit
        self.written: int | None = None  # all bytes written inside the block
        self._names = {id(m): name for name, m in (modules or {}).items()}
        self._wire_ok = False
        self._w0: int | None = None

    # -- the mode ----------------------------------------------------------------

    def __enter__(self):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "labkit.ledger.traffic() needs a torch.distributed process group: "
                "use it inside a function you run on the ranks (cluster.run(fn))."
            )
        self._claim()
        try:
            self.rank = dist.get_rank()
            self._wire_ok = io_path_ok()
            self._install_phase_hooks(self._names)
            self._w0 = wchar() if self._wire_ok else None
            self.start = time.perf_counter()
            return super().__enter__()
        except BaseException:
            self._remove_hooks()
            raise

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self.stop = time.perf_counter()
            if self._w0 is not None:
                self.written = wchar() - self._w0
            self._remove_hooks()

    def _remove_hooks(self) -> None:
        self._remove_phase_hooks()
        self._release()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ns, name, kind = classify(func)
        if kind is None:
            return func(*args, **kwargs)
        op, arg, times_n = kind
        n, members = group_of(ns, args)
        payload = tensors(args[arg]) if arg is not None and arg < len(args) else []
        elements = sum(t.numel() for t in payload) * (n if times_n else 1)
        nbytes = sum(t.numel() * t.element_size() for t in payload) * (n if times_n
                                                                        else 1)
        dtype = str(payload[0].dtype).removeprefix("torch.") if payload else "-"
        # point-to-point calls pair with a peer's later call (a ring's isend/irecv),
        # so they are not waited for here: their bytes count only in `written`
        p2p = op in ("send", "recv")
        wire = self._wire_ok and not p2p and not any(t.is_cuda for t in payload)
        set_activity(f"{op} of {human(nbytes)} (group of {n})")
        w0 = wchar() if wire else 0
        t0 = time.perf_counter()
        try:
            res = func(*args, **kwargs)
            if not p2p:
                wait_for(ns, res)
        finally:
            set_activity(None)
        t1 = time.perf_counter()
        w1 = wchar() if wire else 0
        self.records.append(Record(
            op=op, group_size=n, dtype=dtype, elements=elements, payload_bytes=nbytes,
            bus_bytes=(sent_to_others(name, args, payload, nbytes, n,
                                       members.index(self.rank))
                       if op == "all_to_all" and self.rank in members
                       else nbytes * BUS_FACTOR[op](n)),
            wire_bytes=(w1 - w0) if wire else None,
            seconds=t1 - t0, start=t0, complete=not p2p, phase=self._current_phase(),
            module=self._module_stack[-1] if self._module_stack else None,
            rank=self.rank, group_ranks=members, peer=_peer(name, args, members),
        ))
        return res

    # -- summaries ---------------------------------------------------------------

    @property
    def total(self) -> float:
        """Wire bytes of every call (a send's, not waited for, count as 0)."""
        return self.sum("wire_bytes")

    def sum(self, field: str = "wire_bytes", **where) -> float:
        """Sum of a field over the records matching `where` (e.g. op="all_reduce")."""
        return sum_records(self.records, field, **where)

    def by_op(self) -> dict[str, dict[str, float]]:
        return summarize(self.records, "op")

    def by_phase(self) -> dict[str, dict[str, float]]:
        return summarize(self.records, "phase")

    def by_group(self, names: dict[str, tuple[int, ...]] | None = None
                 ) -> dict[tuple[int, ...] | str, dict[str, float]]:
        """Totals per group the calls travelled in, keyed by the group's global
        ranks; with `names` ({"tp": (0, 1), "dp": (0, 4), ...}, e.g. from
        ParallelGroups) keyed by name instead, and a group not named keeps its
        ranks as key. Sends count their payload as `sent`: a point-to-point
        call is not waited for, so its `wire_bytes` is unknown."""
        return by_group(self.records, names)

    def __repr__(self) -> str:
        return (f"TrafficLedger(rank={self.rank}, {len(self.records)} calls, "
                f"{human(self.sum('payload_bytes'))} payload)")


def _peer(name: str, args, members: tuple[int, ...]) -> int | None:
    """The global rank a send goes to or a recv comes from: c10d's send and recv_
    name it (their third argument) as a rank of their group."""
    if name not in ("send", "recv_") or len(args) < 3:
        return None
    peer = int(args[2])
    return members[peer] if peer < len(members) else peer


def traffic(modules: dict[str, torch.nn.Module] | torch.nn.Module | None = None
            ) -> TrafficLedger:
    """A ledger of this rank's collectives: `with labkit.ledger.traffic() as t:`.

    Pass a model (or a name -> module dict) to label calls with module names.
    """
    if isinstance(modules, torch.nn.Module):
        modules = {name or type(modules).__name__: m
                   for name, m in modules.named_modules()}
    return TrafficLedger(modules)


def sum_records(records, field: str = "wire_bytes", **where) -> float:
    """`TrafficLedger.sum` over any records."""
    if field not in FIELDS:
        raise ValueError(f"field must be one of {FIELDS}, not {field!r}")
    return sum(getattr(r, field) or 0 for r in records
               if all(getattr(r, k) == v for k, v in where.items()))


def by_group(records, names: dict[str, tuple[int, ...]] | None = None
             ) -> dict[tuple[int, ...] | str, dict[str, float]]:
    """`TrafficLedger.by_group` over any records: summarize by `group_ranks`,
    plus `sent`, the bytes this rank sent: wire bytes of a collective (its bus
    bytes where the wire is unknown), the payload of a send, 0 for a recv."""
    label = {tuple(v): k for k, v in (names or {}).items()}
    out = summarize(records, "group_ranks")
    for key, row in out.items():
        row["sent"] = sum(_sent(r) for r in records if r.group_ranks == key)
    return {label.get(k, k): v for k, v in out.items()}


def _sent(r: Record) -> float:
    if r.op == "send":
        return r.payload_bytes
    if r.op == "recv":
        return 0
    return r.wire_bytes if r.wire_bytes is not None else r.bus_bytes


def summarize(records, key: str) -> dict[str, dict[str, float]]:
    """{key value: {"calls": n, "payload_bytes": ..., "bus_bytes": ..., ...}}"""
    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for r in records:
        row = out[getattr(r, key)]
        row["calls"] += 1
        for f in FIELDS:
            row[f] += getattr(r, f) or 0
    return {k: dict(v) for k, v in out.items()}
