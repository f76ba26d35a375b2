"""What this platform lets the runtime do: the one place that asks.

"fork" (Linux): ranks forked from a forkserver that imported torch once; pidfds.
"portable" (macOS, any other platform; LABKIT_START=portable or Cluster(start=)
forces it): the forkserver never imports torch (fork after importing torch is
unsafe on macOS); ranks come from spares forked from it that import torch after
the fork and wait. It needs no pidfd, /proc or `socket.send_fds`.
"""

from __future__ import annotations

import os
import socket
import sys

LINUX = sys.platform.startswith("linux")
STARTS = ("fork", "portable")
# a forkserver hands over to a successor that imported more (fork start only)
CAN_HAND_OVER = hasattr(socket, "send_fds")


def start_method(asked: str | None = None) -> str:
    """The start `asked` (None: $LABKIT_START, else this platform's own)."""
    how = asked if asked is not None else os.environ.get("LABKIT_START") or "auto"
    if how == "auto":
        return "fork" if LINUX else "portable"
    if how not in STARTS:
        raise ValueError(f"start must be 'auto', 'fork' or 'portable', not {how!r} "
                         "(LABKIT_START or Cluster(start=...))")
    if how == "fork" and not LINUX:
        raise ValueError(f"start='fork' forks a process that has imported torch, "
                         f"which is unsafe on {sys.platform}; use 'portable'")
    return how


def available_starts() -> tuple[str, ...]:
    """The start methods this platform can use, its own first."""
    return STARTS if LINUX else ("portable",)


def pidfd_open(pid: int) -> int | None:
    """A file descriptor that turns readable when process `pid` exits (Linux 5.3+);
    None where there is none (the caller falls back to its pipe or a poll)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None
