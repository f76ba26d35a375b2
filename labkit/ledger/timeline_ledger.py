"""Spans of compute and communication a rank recorded, and how much they overlap.

    with labkit.ledger.timeline() as tl:     # any model: ours, DDP, FSDP2, ...
        step()
    overlap_fraction(tl.spans)

Imports torch, labkit.probe and labkit.ledger's common and c10d_calls. It times
every operator a rank runs without changing when anything runs: unlike the traffic
ledger, it never waits for a collective.
"""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from labkit.ledger.common import Ledger
from labkit.probe import Span, union
from labkit.ledger.c10d_calls import classify, tensors

POLL_S = 2e-4  # how often the watcher asks an unfinished work without a future


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _intersect(xs, ys) -> float:
    """Total length of the intersection of two sorted, disjoint interval lists."""
    i = j = 0
    both = 0.0
    while i < len(xs) and j < len(ys):
        lo, hi = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        both += max(0.0, hi - lo)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return both


def overlap_fraction(events) -> float:
    """Share of communication time during which compute also ran (0 ... 1):
    Holistic Trace Analysis's "Comm Comp Overlap".

    Overlapping collectives count once (the union of comm spans), as do
    overlapping compute spans. 0.0 when there is no communication at all.
    """
    comm = union(e for e in events if e.kind == "comm")
    compute = union(e for e in events if e.kind == "compute")
    total = _length(comm)
    return _intersect(comm, compute) / total if total > 0 else 0.0


def _is_async(func, args, kwargs) -> bool:
    """The c10d op's async_op argument (True where it has none: send, recv)."""
    names = [a.name for a in func._schema.arguments]
    if "async_op" not in names:
        return True
    i = names.index("async_op")
    return bool(kwargs.get("async_op", args[i] if i < len(args) else True))


class TimelineLedger(Ledger, TorchDispatchMode):
    """Records this rank's compute and communication spans; see `timeline()`."""

    kind = "timeline"
    fields = ("spans", "rank", "start", "stop", "unfinished")  # what pickles

    def __init__(self, gap: float = 2e-4):
        super().__init__()
        self.spans: list[Span] = []
        self.rank = -1
        self.start = self.stop = 0.0
        self.unfinished = 0  # collectives still running when the block ended
        self._gap = gap
        self._open: list | None = None  # the compute span being extended
        self._comm: list[list] = []  # [name, start, end or None, nbytes]
        self._watched: list[tuple[list, object]] = []  # (record, work) to poll
        self._functional: dict[int, list] = {}  # id(result tensor) -> record
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    def __enter__(self):
        self._claim()
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self._install_phase_hooks()
        self._watcher = threading.Thread(target=self._watch, daemon=True,
                                         name="labkit-timeline")
        self._watcher.start()
        self.start = time.perf_counter()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self.stop = time.perf_counter()
            self._stop.set()
            if self._watcher is not None:
                self._watcher.join()
            self._poll()  # a last look at what the watcher had not seen finish
            self._remove_phase_hooks()
            self._close_compute()
            with self._lock:
                done = [c for c in self._comm if c[2] is not None]
                self.unfinished = len(self._comm) - len(done)
            self.spans += [Span("comm", name, t0, t1, nbytes)
                           for name, t0, t1, nbytes in done]
            self.spans.sort(key=lambda s: (s.start, s.kind))
            self._release()

    # -- communication ------------------------------------------------------------

    def _finish(self, record: list) -> None:
        with self._lock:
            if record[2] is None:
                record[2] = time.perf_counter()

    def _poll(self) -> None:
        with self._lock:
            watched = list(self._watched)
        for record, work in watched:
            if work.is_completed():
                self._finish(record)
        with self._lock:
            self._watched = [(r, w) for r, w in self._watched if r[2] is None]

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            if self._watched:
                self._poll()

    def _issued(self, func, op: str, args, kwargs, arg, res, t0: float) -> None:
        ns = func._schema.name.partition("::")[0]
        payload = tensors(args[arg]) if arg is not None and arg < len(args) else []
        nbytes = sum(t.numel() * t.element_size() for t in payload)
        record = [op, t0, None, nbytes]
        with self._lock:
            self._comm.append(record)
        if ns != "c10d":  # functional: done when its result is waited for
            for t in tensors(res):
                self._functional[id(t)] = record
            return
        works = [dist.distributed_c10d.Work.unbox(a)
                 for a in (res if isinstance(res, tuple) else (res,))
                 if isinstance(a, torch.ScriptObject) and "Work" in str(a._type())]
        if not works:  # returned done (a blocking call)
            self._finish(record)
            return
        work = works[0]
        if not _is_async(func, args, kwargs):  # the caller waits at once: so may we
            work.wait()
            self._finish(record)
            return
        try:
            work.get_future().add_done_callback(lambda _: self._finish(record))
        except RuntimeError:  # no future on this backend's op (gloo's
            # reduce-scatter): the watcher thread polls it every POLL_S
            with self._lock:
                self._watched.append((record, work))

    # -- compute ------------------------------------------------------------------

    def _computed(self, t0: float, t1: float) -> None:  # neighbours < gap: one span
        name = self._current_phase()
        o = self._open
        if o is not None and o[0] == name and t0 - o[2] <= self._gap:
            o[2] = t1
            return
        self._close_compute()
        self._open = [name, t0, t1]

    def _close_compute(self) -> None:
        if self._open is not None:
            name, t0, t1 = self._open
            self.spans.append(Span("compute", name, t0, t1))
            self._open = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ns, name, kind = classify(func)
        t0 = time.perf_counter()
        res = func(*args, **kwargs)
        if kind is not None:
            self._close_compute()
            self._issued(func, kind[0], args, kwargs, kind[1], res, t0)
        elif name == "wait_tensor":
            record = self._functional.pop(id(args[0]), None)
            if record is not None:
                self._finish(record)
        else:
            self._computed(t0, time.perf_counter())
        return res


def timeline(gap: float = 2e-4) -> TimelineLedger:
    """A ledger of this rank's compute and communication spans, for any model:
    `with labkit.ledger.timeline() as tl: ...`, then `tl.spans` (a timing)."""
    return TimelineLedger(gap)
