"""A cluster's idle timeout: ranks left idle `seconds` after their last call (or
their start) are stopped, to give their memory back; the next `run` starts them
again (Cluster.idle_timeout, or LABKIT_IDLE_TIMEOUT for a whole server)."""

from __future__ import annotations

import os
import threading
import weakref

from labkit.runtime.backend import check_timeout
from labkit.runtime.timeouts import MAX_SECONDS

IDLE_ENV = "LABKIT_IDLE_TIMEOUT"  # seconds; a lecturer sets it server-wide


def idle_seconds(given, default) -> float | None:
    """The timeout a cluster uses: `given`, or else $LABKIT_IDLE_TIMEOUT, else None
    (never), when `given` is `default` (the argument was left out). A bad value
    is an error that names where it came from."""
    if given is not default:
        return check_timeout(given, "idle_timeout", none="never")
    text = os.environ.get(IDLE_ENV, "").strip()
    where = f"${IDLE_ENV}"
    try:
        seconds = float(text or 0)
    except ValueError:
        seconds = None
    if seconds == 0:
        return None  # unset, empty or 0: never
    try:
        return check_timeout(seconds, where, none="")
    except (TypeError, ValueError):
        raise ValueError(
            f"{where} must be a number > 0 seconds, at most {MAX_SECONDS:.0f} "
            f"(a year), or 0 or unset for never; got {text!r}") from None


class IdleTimer:
    """One timer at a time per cluster: `arm` after each call, `disarm` before the
    next; each arming reads the cluster's `idle_timeout`, so setting it on a
    running cluster takes effect from its next call. `fired` says the ranks were
    stopped for being idle."""

    def __init__(self, cluster):
        self._cluster = weakref.ref(cluster)
        self._armed, self._timer, self.fired = 0, None, False
        self.seconds: float | None = None  # what the last timer armed waited

    def arm(self) -> None:
        self.disarm()
        c = self._cluster()
        seconds = None if c is None else c.idle_timeout
        if seconds and c.running:
            self.seconds = seconds
            self._timer = threading.Timer(seconds, self._fire, (self._armed,))
            self._timer.daemon = True
            self._timer.start()

    def disarm(self) -> None:
        self._armed += 1  # a timer already firing sees it is out of date
        if self._timer is not None:
            self._timer.cancel()

    def _fire(self, armed: int) -> None:
        """Stop the ranks unless a call came (or runs) meanwhile."""
        c = self._cluster()
        if c is not None and c.stop_if_idle(lambda: self._armed == armed):
            self.fired = True
