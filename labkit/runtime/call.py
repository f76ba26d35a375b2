"""One call on the ranks: send it, collect what each rank answers (or how it
failed), ask the ranks still busy what they are doing, and print what they wrote.

Every wait is bounded by the cluster's Timeouts (sending included), and a call
stops early, raising Interrupted, when close() or restart() from another thread
wakes it (RankLinks.wake, .stop_for)."""

from __future__ import annotations

import io
import itertools
import os
import selectors
import time
import types
from collections import ChainMap
from collections.abc import Callable
from dataclasses import dataclass, field

import cloudpickle

from labkit.runtime import wire
from labkit.runtime.forkserver import select_one
from labkit.runtime.live import LiveView, display_publisher, live_frontend
from labkit.runtime.messages import Call, Progress, Raised, Returned, StatusRequest
from labkit.runtime.output import write_transcript
from labkit.runtime.results import RankResults, SendTimeout, build_error
from labkit.runtime.flight import find_mismatch
from labkit.runtime.status import describe_busy, describe_live
from labkit.runtime.timeouts import DEFAULT, Timeouts
from labkit.units import human_bytes

_CALL_IDS = itertools.count(1)
WAKE = "wake"  # the selector key's data of the cluster's wake-up pipe


class Interrupted(Exception):
    """close() or restart(), from another thread, stopped the call; `by` says
    which ('close()', 'restart()')."""

    def __init__(self, by: str):
        super().__init__(by)
        self.by = by


def _never() -> None:
    return None


def _publisher():
    """Where a call's live view is drawn: the calling cell if a person watches it."""
    return display_publisher() if live_frontend() else None


@dataclass(frozen=True)
class RankLinks:
    """What a call needs of a cluster whose ranks run (Cluster.links()): each
    rank's call and status connections, the selector that watches the call
    connections, the ranks' output files, and how a rank that went silent ended."""

    calls: dict
    status: dict
    selector: selectors.BaseSelector
    output: object  # labkit.runtime.output.RankOutput
    how_ended: Callable[[int], str]
    world_size: int
    timeouts: Timeouts = DEFAULT
    wake: int | None = None  # a pipe's read end, in `selector` with data WAKE
    stop_for: Callable[[], str | None] = field(default=_never)  # who woke it


class CallInFlight:
    """One call on `ranks`: sends it, collects each rank's answer or how it
    failed, asks the ranks still busy what they do, and prints their output."""

    def __init__(self, links: RankLinks, ranks: list[int], timeout: float | None,
                 publish=None):
        self.links = links
        self.ranks = ranks
        self.timeout = timeout
        self.output = links.output
        self.times = links.timeouts
        publish = _publisher() if publish is None else publish
        self.view = LiveView(ranks, self.output.width, publish,
                             self.times.redraw) if publish else None
        self.asked: set[int] = set()  # status requests not yet answered
        self.returned: dict[int, Returned] = {}
        self.failed: dict[int, object] = {}  # rank -> RemoteError, or how it died

    def collect(self, payload: bytes) -> RankResults:
        """Send the packed call to the ranks and wait for them; the RankResults,
        or the error build_error makes (a rank failed, or some were still busy
        at the timeout: what each was doing). The transcript is shown either way."""
        self.started = time.monotonic()
        self._send(payload)
        finished, shown = False, False
        try:
            pending = self._wait()
            busy, logs = {}, {}
            if pending:  # every rank still there, with its flight recorder
                asked = sorted(pending | set(self.returned))
                busy, logs = self._ask_status(asked, collectives=True)
                busy = {r: busy[r] for r in sorted(pending)}
            outputs, errors, transcript = self.output.transcript(self.ranks)
            for r, how in self.failed.items():  # a rank that died: its last words
                if isinstance(how, str) and (words := last_words(errors[r])):
                    self.failed[r] = f"{how}, after writing: {words}"
            finished = True
        finally:
            if self.view is not None:  # also on an interrupt: show where it stopped
                shown = self.view.finish(transcript if finished else self._so_far())
        if not shown:
            write_transcript(transcript)
        if self.failed or pending:
            where = {r: "done with the call (it had returned)" for r in self.returned}
            mismatch = find_mismatch(logs, where | busy) if logs else []
            raise build_error(self.failed, busy, sorted(self.returned), self.timeout,
                              mismatch=mismatch, collectives=logs)
        return RankResults({r: m.value for r, m in self.returned.items()}, outputs,
                           {r: m.seconds for r, m in self.returned.items()},
                           self.links.world_size)

    def _send(self, payload: bytes) -> None:
        """The call to every rank, each send bounded by Timeouts.send (or the
        call's timeout, if shorter): a rank that does not read it fails the
        call (SendTimeout), and close()/restart() from another thread stop it."""
        limit, which = self.times.send, "Timeouts.send"
        if self.timeout is not None and self.timeout < limit:
            limit, which = self.timeout, "the call's timeout"
        deadline = self.started + limit
        for r in self.ranks:
            self._check_stop()
            try:
                wire.send_bytes_by(self.links.calls[r], payload, deadline,
                                   self.links.wake, self._woken)
            except wire.Stalled as e:
                raise SendTimeout(
                    f"rank {r} did not take the call within {limit:g} s ({which}):"
                    f" {human_bytes(e.sent)} of {human_bytes(e.total)} sent. The "
                    "rank is alive but not reading (stopped, or stuck outside a "
                    "call).\n\nThe ranks were stopped; the next run starts them "
                    "again.", busy={r: "not reading the call"},
                    finished=[]) from None
            except OSError:
                continue  # a dead rank: its EOF is reported below

    def _check_stop(self) -> None:
        """Raise Interrupted if close() or restart() from another thread asked
        this call to stop."""
        by = self.links.stop_for()
        if by is not None:
            raise Interrupted(by)

    def _woken(self) -> None:
        """The wake-up pipe is readable: empty it, and stop if asked to."""
        drain(self.links.wake)
        self._check_stop()

    def _wait(self) -> set[int]:
        """Take in replies until every rank answered, one failed (then the
        grace), or the timeout; the ranks still pending."""
        sel = self.links.selector
        start = self.started
        deadline = None if self.timeout is None else start + self.timeout
        pending = set(self.ranks)
        first_failure = None
        next_status = start + self.times.status_after
        while pending:
            stop = deadline
            if first_failure is not None:
                grace_end = first_failure + self.times.grace
                stop = grace_end if stop is None else min(stop, grace_end)
            now = time.monotonic()
            left = None if stop is None else stop - now
            if left is not None and left <= 0:
                break
            if self.view is not None:
                tick = self.times.poll
                left = tick if left is None else min(left, tick)
                self._watch(pending, now, next_status)
                if now >= next_status:
                    next_status = now + self.times.status_every
            for key, _ in sel.select(left):
                r = key.data
                if r == WAKE:  # close() or restart() from another thread?
                    self._woken()
                    continue
                if isinstance(r, tuple):  # ("status", rank): a live status line
                    self._take_status(r[1])
                    continue
                data = wire.recv_bytes(key.fileobj)
                if data is None:
                    sel.unregister(key.fileobj)
                    self.failed[r] = self.links.how_ended(r)
                else:
                    msg = cloudpickle.loads(data)
                    if isinstance(msg, Progress):
                        if self.view is not None:
                            self.view.progress(r, msg)
                        continue
                    if isinstance(msg, Raised):
                        self.failed[r] = msg.error
                    else:
                        self.returned[r] = msg
                pending.discard(r)
                if self.failed and first_failure is None:
                    first_failure = time.monotonic()
        self._forget_status(sel)
        return pending

    # -- the live view ---------------------------------------------------------

    def _watch(self, pending: set[int], now: float, next_status: float) -> None:
        for r in self.ranks:
            for stream in ("out", "err"):
                self.view.add_lines(r, "stderr" if stream == "err" else "stdout",
                                    self.output.tail(r, stream))
        if now >= next_status:
            if self.view.statuses:  # ranks that finished since: no line
                self.view.set_status({r: s for r, s in self.view.statuses.items()
                                      if r in pending})
            for r in sorted(pending - self.asked):
                sock = self.links.status.get(r)
                if sock is None:
                    continue
                try:
                    wire.send(sock, StatusRequest())
                except OSError:
                    continue
                self.asked.add(r)
                self.links.selector.register(sock, selectors.EVENT_READ, ("status", r))
        self.view.refresh(now)

    def _take_status(self, rank: int) -> None:
        sock = self.links.status[rank]
        self.links.selector.unregister(sock)
        self.asked.discard(rank)
        st = wire.recv(sock)
        if st is not None and rank not in self.returned and rank not in self.failed:
            statuses = dict(self.view.statuses)
            statuses[rank] = describe_live(st)
            self.view.set_status(statuses)

    def _forget_status(self, sel) -> None:
        """Read (and drop) the answers to live status requests still on their way,
        so the status connections are clean for the next question."""
        for r in sorted(self.asked):
            sock = self.links.status[r]
            sel.unregister(sock)
            if select_one(sock, self.times.status)[0]:
                wire.recv(sock)
        self.asked.clear()

    def _so_far(self) -> list:
        try:
            return self.output.transcript(self.ranks)[2]
        except Exception:  # noqa: BLE001  (showing what we can is best effort)
            return []

    def _ask_status(self, ranks: list[int], collectives: bool = False
                    ) -> tuple[dict[int, str], dict[int, dict | None]]:
        """What each rank is doing (after the call gave up on some), and with
        `collectives` its flight recorder's record (flight.read_recorder)."""
        status = self.links.status
        asked = []
        for r in ranks:
            try:
                wire.send(status[r], StatusRequest(collectives))
                asked.append(r)
            except (OSError, KeyError):
                pass
        out = {r: "not answering" for r in ranks}
        logs = {}
        end = time.monotonic() + self.times.status
        for r in asked:
            if select_one(status[r], max(0.0, end - time.monotonic()))[0]:
                st = wire.recv(status[r])
                if st is not None:
                    out[r], logs[r] = describe_busy(st), st.collectives
        return out, logs


def drain(fd: int | None) -> None:
    """Read whatever is in the (non-blocking) pipe `fd`."""
    if fd is not None:
        try:
            while os.read(fd, 512):
                pass
        except BlockingIOError:
            pass


def _unwrapped(fn):
    return fn


_REDUCE_CODE = cloudpickle.Pickler.dispatch_table[types.CodeType]


def _code_from(rebuild, args, filename: str) -> types.CodeType:
    """On the rank: cloudpickle's code object, with the file it came from."""
    return rebuild(*args).replace(co_filename=filename)


def _reduce_code(code: types.CodeType):
    """cloudpickle's reduction of a code object, plus its co_filename.

    cloudpickle >= 3.1.3 renames every code object it ships "<dynamic-code>"; the
    rank's tracebacks and status lines then cannot name the student's cell (the
    kernel looks the line up by file name). Whatever cloudpickle writes, the name
    is put back on load, and line numbers are cloudpickle's own."""
    rebuild, args = _REDUCE_CODE(code)
    return _code_from, (rebuild, args, code.co_filename)


class _CallPickler(cloudpickle.Pickler):
    """cloudpickle, with two changes. Code objects keep their file name (above).
    An optimizer's `step` that PyTorch has wrapped in this process travels
    unwrapped: a class defined in a notebook goes by value, and a copied wrapper
    would call the hooks registered here, not those on the rank (where the
    ledgers register theirs). The rank wraps `step` again itself."""

    dispatch_table = ChainMap({types.CodeType: _reduce_code},
                              cloudpickle.Pickler.dispatch_table)

    def reducer_override(self, obj):
        if getattr(obj, "hooked", False) and hasattr(obj, "__wrapped__") and \
                callable(obj):
            return _unwrapped, (obj.__wrapped__,)
        return super().reducer_override(obj)


def _dumps(obj) -> bytes:
    buf = io.BytesIO()
    _CallPickler(buf, protocol=5).dump(obj)
    return buf.getvalue()


def pack_call(fn, args, kwargs) -> bytes:
    """Pickle the call once (cloudpickle: notebook functions travel by value)."""
    try:
        return _dumps(Call(next(_CALL_IDS), fn, args, kwargs))
    except Exception as e:  # noqa: BLE001  (find out which piece, and say so)
        err = e
    pieces = [(f"the function {getattr(fn, '__name__', fn)!r}", fn)]
    pieces += [(f"argument {i} ({type(a).__name__})", a) for i, a in enumerate(args)]
    pieces += [(f"keyword argument {k!r} ({type(v).__name__})", v)
               for k, v in kwargs.items()]
    for what, obj in pieces:
        try:
            cloudpickle.dumps(obj, protocol=5)
        except Exception as e:
            raise TypeError(
                f"{what} cannot be sent to the ranks: {type(e).__name__}: {e}"
            ) from e
    raise TypeError(f"the call cannot be sent to the ranks: {err}") from err


def last_words(stderr: str) -> str:
    """The line that says why a process died, from what it wrote last: the C++
    exception's `what():` (gloo's enforce failures), else the last line."""
    lines = [ln.strip() for ln in stderr.strip().splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith("what():"):
            return ln.removeprefix("what():").strip()
    return lines[-1] if lines else ""
