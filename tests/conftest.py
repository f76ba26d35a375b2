import os
import time

import pytest


def alive(pid: int) -> bool:
    """True while the process exists and is not a zombie.

    A thread-group leader shows as a zombie while its other threads still exit
    (and hold its files open); use `reaped` below when that matters.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def reaped(pid: int) -> bool:
    return not os.path.exists(f"/proc/{pid}")


def wait_gone(pids, seconds: float, *, until_reaped: bool = False) -> list[int]:
    """Wait until every pid is gone; return those still alive after `seconds`."""
    end = time.monotonic() + seconds
    while True:
        left = [p for p in pids if (not reaped(p) if until_reaped else alive(p))]
        if not left or time.monotonic() > end:
            return left
        time.sleep(0.02)


@pytest.fixture(scope="module")
def cluster():
    import labkit

    with labkit.Cluster(4, timeout=20) as c:
        yield c


def children_of(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
                out.append(int(d))
    return out


def descendants_of(pid: int) -> list[int]:
    """Children, their children, ... (ranks may be forked by a successor)."""
    out, todo = [], [pid]
    while todo:
        kids = children_of(todo.pop())
        out += kids
        todo += kids
    return out
