"""How long the runtime waits for each thing: one `Timeouts` record, held by a
Cluster (`Cluster(..., timeouts=Timeouts(send=5))`, `cluster.timeouts`).

Standard library only (the forkserver imports it before torch). A call's own
limit is not here: that is `Cluster(timeout=...)` / `run(timeout=...)`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

MAX_SECONDS = 365 * 24 * 3600.0  # a year: the longest wait any timeout may ask for


@dataclass(frozen=True)
class Timeouts:
    """Seconds the runtime waits for each step, each > 0 and at most a year."""

    start: float = 120.0
    """Ranks starting: the forkserver's first torch import, then every rank
    connecting and joining the process group."""

    send: float = 30.0
    """Sending one call to the ranks. A rank alive but not reading (stopped, or
    stuck outside a call) fails the call after this; the ranks are stopped."""

    grace: float = 0.5
    """After one rank failed, how long the others get to finish the call."""

    status: float = 1.0
    """A busy rank's answer to 'what are you doing?' (its status line)."""

    status_after: float = 2.0
    """How long a watched call runs before the live view shows status lines."""

    status_every: float = 1.0
    """Between status requests to the busy ranks of a watched call."""

    redraw: float = 0.2
    """Between redraws of a call's live view, at least."""

    poll: float = 0.1
    """Between looks while waiting: at the ranks' output (live view), at ranks
    that may have died while starting, at the forkserver."""

    exit_report: float = 2.0
    """For the forkserver's report of how a rank that went silent ended."""

    stop: float = 2.0
    """For the ranks to be gone after SIGKILL."""

    collective: float = 1800.0
    """torch.distributed's own limit on one collective when the cluster has no
    `timeout` (with one: 4 x timeout, at least `collective_min`)."""

    collective_min: float = 60.0
    """The least torch.distributed's own limit on one collective may be."""

    store: float = 60.0
    """The rendezvous store's own timeout (the TCPStore the kernel hosts)."""

    preload: float = 30.0
    """Forkserver.wait_preloaded's default: for a successor that imports what
    the layers above asked for."""

    def __post_init__(self):
        for f in fields(self):
            check_seconds(getattr(self, f.name), f"Timeouts.{f.name}", none=None)


def check_seconds(value, name: str, *, none: str | None = "no limit"):
    """`value` as float seconds: a number > 0 and at most MAX_SECONDS; None stays
    None where `none` says what it means (else None is refused). The error names
    `name` (an argument, a field, an environment variable)."""
    allowed = (f"a number > 0 seconds, at most {MAX_SECONDS:.0f} (a year)"
               + (f", or None for {none}" if none else ""))
    if value is None and none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be {allowed}; got {value!r}")
    try:
        seconds = float(value)
    except OverflowError:  # an int past float's range
        seconds = math.inf
    if not (math.isfinite(seconds) and 0 < seconds <= MAX_SECONDS):
        got = repr(value) if isinstance(value, float) or seconds < math.inf \
            else f"an integer of {value.bit_length()} bits"
        raise ValueError(f"{name} must be {allowed}; got {got}")
    return seconds


DEFAULT = Timeouts()
