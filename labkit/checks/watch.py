"""The rank side of a check: run the student's answer so that whatever goes wrong
can be told in one sentence back in the kernel.

Standard library at import; torch.distributed and labkit.runtime inside functions.

While the answer runs, point-to-point calls are patched to set the rank's status
(which peer it waits for, on which line), so a deadlock can be named; the patches
are undone after it.
"""

from __future__ import annotations

import contextlib
import sys
import traceback


class AnswerRaised(Exception):
    """An exception raised inside a student's answer on a rank, as it travels back:
    type name, message and the traceback's (file, line, function) frames."""

    def __init__(self, type_name: str, message: str, frames: list):
        super().__init__(type_name, message, frames)
        self.type_name, self.message, self.frames = type_name, message, frames

    def __str__(self) -> str:
        return f"{self.type_name}: {self.message}"


def watched(rank, world_size, worker, *args):
    """Run `worker(rank, world_size, *args)` with point-to-point calls watched and
    any exception turned into an AnswerRaised (runs on a rank)."""
    with _watch_p2p():
        try:
            return worker(rank, world_size, *args)
        except Exception as e:  # noqa: BLE001  (reported, never swallowed)
            frames = [(f.filename, f.lineno, f.name)
                      for f in traceback.extract_tb(e.__traceback__)]
            raise AnswerRaised(type(e).__name__, str(e), frames) from None


def _where(frame) -> str:
    code = frame.f_code
    return f'at File "{code.co_filename}", line {frame.f_lineno}, in {code.co_name}'


class _WatchedWork:
    """An isend/irecv request whose wait() tells the rank's status what it waits
    for; everything else is the real request's."""

    def __init__(self, work, what: str, wait_for):
        self._work, self._what, self._wait_for = work, what, wait_for

    def wait(self, timeout=None):
        if timeout is not None:
            return self._work.wait(timeout)
        return self._wait_for(self._what, self._work, sys._getframe(1))

    def __getattr__(self, name):
        return getattr(self._work, name)


@contextlib.contextmanager
def _watch_p2p():
    import torch.distributed as dist

    from labkit.probe import set_activity

    names = ("send", "recv", "isend", "irecv")
    real = {name: getattr(dist, name) for name in names}

    def wait_for(what, work, frame):
        # set after the call was issued: a traffic ledger's own status is over
        set_activity(f"{what}, {_where(frame)}")
        try:
            return work.wait()
        finally:
            set_activity(None)

    def send(tensor, dst=None, group=None, tag=0, **kw):
        if dst is None or kw:
            return real["send"](tensor, dst, group, tag, **kw)
        work = real["isend"](tensor, dst, group, tag)  # send = isend + wait
        if work is not None:
            wait_for(f"send to rank {dst}", work, sys._getframe(1))

    def recv(tensor, src=None, group=None, tag=0, **kw):
        if src is None or kw:
            return real["recv"](tensor, src, group, tag, **kw)
        work = real["irecv"](tensor, src, group, tag)  # recv = irecv + wait
        if work is None:
            return -1
        wait_for(f"recv from rank {src}", work, sys._getframe(1))
        return src

    def isend(tensor, dst=None, group=None, tag=0, **kw):
        work = real["isend"](tensor, dst, group, tag, **kw)
        return work if work is None else _WatchedWork(
            work, f"wait for isend to rank {dst}", wait_for)

    def irecv(tensor, src=None, group=None, tag=0, **kw):
        work = real["irecv"](tensor, src, group, tag, **kw)
        return work if work is None else _WatchedWork(
            work, f"wait for irecv from rank {src}", wait_for)

    for name, fn in zip(names, (send, recv, isend, irecv)):
        setattr(dist, name, fn)
    try:
        yield
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
