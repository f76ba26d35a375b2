"""The seam between a technique and what measures it. Imports labkit.conventions
only (torch when asked whether a backward runs), so the runtime reads it cheaply.

A technique says what it does: its own `Spans` of compute and communication (a
wrapper's `events`), what a tensor is held as (`count_as`), that a block's
storages live in host memory (`on_host`), a phase of its traffic (`phase`), what
the rank is doing now (`set_activity`; the runtime's status reads it). A ledger
that records registers here (`listen`) and hears it; with none listening each
call is a dictionary lookup. So parallel/ never imports the ledgers.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from labkit.conventions import MEMORY_CATEGORIES

if TYPE_CHECKING:
    import torch

__all__ = ["Span", "Spans", "activity", "completed_at", "count_as", "in_backward",
           "listen", "listening", "on_host", "phase", "set_activity",
           "stop_listening", "union"]

_LISTENERS: dict[str, object] = {}  # kind ("memory", "traffic", ...) -> its ledger
_ACTIVITY: list = [None]  # what this process is doing now, if someone said


# -- who listens ----------------------------------------------------------------

def listening(kind: str):
    """The ledger of this kind recording in this process, or None."""
    return _LISTENERS.get(kind)


def listen(kind: str, ledger) -> None:
    """Register `ledger` as this process's recording ledger of `kind`; one of each
    kind at a time (a second, nested one is refused)."""
    if kind in _LISTENERS:
        raise RuntimeError(
            f"a {kind} ledger is already recording in this process; nested "
            f"{kind} ledgers are not supported")
    _LISTENERS[kind] = ledger


def stop_listening(kind: str, ledger) -> None:
    """Unregister `ledger` (nothing if another one, or none, is registered)."""
    if _LISTENERS.get(kind) is ledger:
        del _LISTENERS[kind]


# -- what a technique says --------------------------------------------------------

def _category(category: str | None) -> None:
    if category is not None and category not in MEMORY_CATEGORIES:
        raise ValueError(f"category must be one of {MEMORY_CATEGORIES}, "
                         f"not {category!r}")


def count_as(t: torch.Tensor, category: str, *, host: bool = False) -> None:
    """`t` is held as `category` (a gradient shard kept outside any `.grad`, a
    buffer made to send: Temp), in host memory with host=True. Heard by the
    recording memory ledger, if any."""
    _category(category)
    led = _LISTENERS.get("memory")
    if led is not None:
        led.count_as(t, category, host=host)


@contextlib.contextmanager
def on_host(category: str | None = None):
    """Storages created inside this block are host memory, as `category`; without
    one the memory ledger decides (Temp inside an optimizer step, Optstate if it
    survives the step, else Other)."""
    _category(category)
    led = _LISTENERS.get("memory")
    if led is None:
        yield
        return
    with led.on_host(category):
        yield


@contextlib.contextmanager
def phase(name: str, kind: str = "traffic"):
    """Label what this block sends (or holds, kind="memory") in the recording
    ledger of `kind`, if one records."""
    led = _LISTENERS.get(kind)
    with led.phase(name) if led is not None else contextlib.nullcontext():
        yield


def set_activity(what: str | None) -> None:
    """Say what this rank is doing now ('all_reduce of 4.0 MiB (group of 4)'),
    for a status request while it lasts; None when it is over (the traffic
    ledger and the checks' deadlock watcher say it; the runtime reads it)."""
    _ACTIVITY[0] = what


def activity() -> str | None:
    """What this rank said it is doing (set_activity), or None."""
    return _ACTIVITY[0]


def in_backward() -> bool:
    """Autograd runs a graph task on this thread: a backward (a forward now is an
    activation checkpoint's recompute)."""
    import torch

    return torch._C._current_graph_task_id() != -1


# -- spans ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Span:
    """One stretch of work on one rank: compute or a collective. Times are this
    rank's time.perf_counter() (CLOCK_MONOTONIC on Linux: ranks on one machine
    share the clock)."""

    kind: str  # "compute" or "comm"
    name: str  # "backward", "all_reduce bucket 0", ...
    start: float  # compute began, or the collective was issued
    end: float  # compute ended, or the collective completed
    nbytes: int = 0  # payload of a collective (0 for compute)

    @property
    def seconds(self) -> float:
        return self.end - self.start

    def as_dict(self) -> dict:
        return asdict(self)


class Spans:
    """A technique's record of its step: Span on this rank's clock, and a stopwatch
    for compute (`start` it under a name, `lap` at each hook, `resume` after the
    hook's own communication, `stop` when compute leaves the technique)."""

    def __init__(self):
        self.items: list[Span] = []
        self._name = ""
        self._since: float | None = None  # start of the compute now timed

    def clear(self) -> None:
        self.items = []

    def __iter__(self):
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def start(self, name: str) -> None:
        """Time compute as `name` from now."""
        self._name, self._since = name, time.perf_counter()

    def lap(self, name: str | None = None) -> None:
        """Record the compute since the last start or resume; what follows is `name`
        (else the same name). The clock keeps its start until `resume`."""
        now = time.perf_counter()
        if self._since is not None and now > self._since:
            self.items.append(Span("compute", self._name, self._since, now))
        if name is not None:
            self._name = name

    def rename(self, name: str) -> None:
        """What the clock times from here on is `name`."""
        self._name = name

    def resume(self) -> None:
        """Restart the clock now, if it runs (after a hook's own work)."""
        if self._since is not None:
            self._since = time.perf_counter()

    def stop(self) -> None:
        """Record the last lap and stop timing compute."""
        self.lap()
        self._since = None

    def comm(self, name: str, start: float, end: float, nbytes: int) -> None:
        """A collective issued at `start` that completed at `end`."""
        self.items.append(Span("comm", name, start, end, nbytes))

    @contextlib.contextmanager
    def timed(self, name: str, nbytes: int = 0, kind: str = "comm"):
        """A span around this block: a blocking collective (or `kind` of work)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.items.append(Span(kind, name, start, time.perf_counter(), nbytes))


def union(spans) -> list[tuple[float, float]]:
    """Merge spans (or (start, end) pairs) into sorted, disjoint intervals."""
    pairs = sorted((s.start, s.end) if isinstance(s, Span) else tuple(s) for s in spans)
    out: list[tuple[float, float]] = []
    for a, b in pairs:
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        elif b > a:
            out.append((a, b))
    return out


def completed_at(fut) -> float:
    """A collective's future -> when it completed (time.perf_counter()), for
    `.then()`: the callback runs on the thread that finishes the collective."""
    fut.value()  # re-raises a failed collective's error
    return time.perf_counter()
