"""The forkserver process (forkserver.py is the kernel's handle on it).

Both starts keep spares: processes forked from here when idle that wait for a
rank's spec, so that a start or a restart does not wait for the forks.
Fork start: import torch and what the kernel asked for at its start (Preload), say
ready, start a rank per request (a spare, or a fresh fork) and report how each
ended; hand over to a successor that has imported what was asked for later once
idle, and exit once the kernel says the successor forks (Retire) and the ranks it
forked have exited.
Portable start (platform.py): import no torch; the spares import it themselves."""

from __future__ import annotations

import importlib
import os
import select
import signal
import socket
import sys

from labkit.runtime import platform, wire
from labkit.runtime.messages import (
    ROLE_ENV,
    ForkserverReady,
    Preload,
    RankExited,
    Retire,
    Spawn,
    Spawned,
    Successor,
)

IDLE_BEFORE_PRELOAD = 1.0  # seconds idle after serving a cluster
IDLE_UNSERVED = 3.0  # ... or after starting, when no cluster came (a student reads)
# spares fork once the server has been idle this long, after its own start (in a
# script the first start comes at once: its ranks are forked then, none wasted)
# and after each start (not meanwhile: the forks, and the portable spares' torch
# imports, would slow the ranks'; and a short-lived process never makes them).
# A fork-start spare costs a fork (~10 ms here, its page tables), a portable one
# a torch import (~1 s of CPU), so the fork start makes them sooner.
IDLE_BEFORE_FIRST_SPARES = 0.2
IDLE_BEFORE_SPARES = {"fork": 1.0, "portable": 3.0}


def serve(ctrl_fd: int, lifeline_fd: int, kernel_pid: int,
          start: str = "fork") -> None:
    """The forkserver's main: import torch (fork start), say ready, start ranks
    on request."""
    os.environ[ROLE_ENV] = "forkserver"
    if start == "fork":
        _import_torch()  # once here, inherited by every rank
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # what says the kernel is gone: EOF on a pipe only it writes to, or its pidfd
    gone = tuple(fd for fd in (lifeline_fd, platform.pidfd_open(kernel_pid))
                 if fd is not None)
    if os.getppid() != kernel_pid:  # the kernel died while we imported torch
        return
    ctrl = socket.socket(fileno=ctrl_fd)
    if start == "portable":  # ranks import what is wanted, on first use
        wanted = _asked_at_start(ctrl)
    else:
        wanted = _import_asked_at_start(ctrl)
    if wanted is not None:  # None: the kernel is gone
        _loop(ctrl, gone, wanted, Spares(gone, start))
    # gone or retired: exit now, without tearing torch down (seconds of a process
    # that holds nothing anyone needs), as a successor does
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _import_torch() -> None:
    import cloudpickle  # noqa: F401
    import torch
    import torch.distributed  # noqa: F401


def _asked_at_start(ctrl: socket.socket) -> tuple[str, ...] | None:
    """The kernel's first message, a Preload: what ranks should have imported."""
    msg = wire.recv(ctrl)
    if msg is None:
        return None
    if not isinstance(msg, Preload):
        raise RuntimeError(f"the forkserver's first message: {msg!r}, not Preload")
    return tuple(dict.fromkeys(msg.names))


def _import_asked_at_start(ctrl: socket.socket) -> tuple[str, ...] | None:
    """Import what the kernel asked for when it started this process (its first
    message, a Preload, waiting by now), before saying ready: nothing can ask for
    a fork yet. Otherwise every rank of the first cluster imports it on first use,
    all at once (torch._dynamo, with an optimizer or a dispatch mode: a second of
    CPU per rank, and memory not shared). Names asked for later go to a successor."""
    if not select.select([ctrl], [], [], 0)[0]:
        return ()
    wanted = _asked_at_start(ctrl)
    for name in wanted or ():
        _try_import(name)  # never forked with it: ranks import it on first use
    return wanted


def _loop(ctrl: socket.socket, gone: tuple[int, ...], wanted: tuple[str, ...],
          spares: Spares):
    """Serve `ctrl` until the kernel is gone; ranks come from `spares`, kept
    filled when idle. `wanted`: modules asked for so far (Preload); once idle with
    some not imported, hand over to a successor that imports them and makes its
    own spares (once: a forkserver that handed over lets its spares go and only
    serves until its successor is ready). The portable start's spares import
    what is wanted themselves: no successor. Returns, to exit, when the kernel is
    gone, or once retired (Retire) with no rank of its own left."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select via wake_w
    wire.send(ctrl, ForkserverReady(os.getpid(), _imported(wanted)))
    served = retired = successor = False
    handed_over = spares.import_torch or not platform.CAN_HAND_OVER
    ranks: set[int] = set()  # forked here and not yet reaped
    keep = (ctrl.fileno(), wake_r, wake_w)
    while True:
        if retired and not ranks:
            return
        missing = () if handed_over else tuple(
            m for m in wanted if m not in sys.modules)
        idle = None
        if missing:
            idle = IDLE_BEFORE_PRELOAD if served else IDLE_UNSERVED
        elif not successor and spares.short():
            idle = spares.idle_before(served)
        ready, _, _ = select.select([ctrl, wake_r, *gone], [], [], idle)
        if not ready and missing:  # idle: let a successor import more, take over
            spares.release()  # it makes its own, with what it imported
            _start_successor(ctrl, gone, wanted, close=(wake_r, wake_w))
            handed_over = successor = True
            continue
        if not ready:  # idle: spares for the next start
            spares.fill(keep)
            continue
        if any(fd in ready for fd in gone):
            return
        if wake_r in ready:
            os.read(wake_r, 4096)
            reaped = _reap(ctrl)
            ranks -= reaped
            spares.forget(reaped)
        if ctrl in ready:
            msg = wire.recv(ctrl)
            if msg is None:
                return
            if isinstance(msg, Retire):
                retired = True
            elif isinstance(msg, Preload):
                wanted = tuple(dict.fromkeys((*wanted, *msg.names)))
                if not handed_over and set(wanted) <= sys.modules.keys():
                    # imported already (by torch, say): no successor; say so
                    # (portable start: handed_over; ranks import it on first use)
                    wire.send(ctrl, ForkserverReady(os.getpid(), wanted))
            elif isinstance(msg, Spawn):
                sys.stdout.flush()
                sys.stderr.flush()
                pids = tuple(spares.start(spec, keep) for spec in msg.specs)
                ranks.update(pids)
                wire.send(ctrl, Spawned(pids))
                served = True
                spares.target = len(msg.specs)  # once idle, ready for these again


def _start_successor(ctrl, gone, wanted, close) -> None:
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the successor: import, then serve on its own connection
        try:
            signal.set_wakeup_fd(-1)
            for fd in (ctrl.fileno(), ours.fileno(), *close):
                os.close(fd)
            for name in wanted:
                importlib.import_module(name)
            _loop(theirs, gone, wanted, Spares(gone, "fork"))
        finally:
            os._exit(0)
    theirs.close()
    wire.send(ctrl, Successor(pid))
    socket.send_fds(ctrl, [b"s"], [ours.fileno()])
    ours.close()


def _imported(wanted) -> tuple[str, ...]:
    return tuple(m for m in wanted if m in sys.modules)


def _reap(ctrl: socket.socket) -> set[int]:
    """Wait for every child that has exited, report each; their pids."""
    gone = set()
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return gone
        if pid == 0:
            return gone
        gone.add(pid)
        wire.send(ctrl, RankExited(pid, describe_status(status)))


def describe_status(status: int) -> str:
    """'exited with code 1' / 'killed by SIGKILL' from a waitpid status."""
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}"
    return f"exited with code {code}"


def _child(close_fds, main) -> None:
    """In a process just forked here: drop the server's descriptors and signal
    handlers, run main(), report whatever it raised, exit with its code."""
    code = 1
    try:
        for fd in close_fds:
            os.close(fd)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        code = main()
    except BaseException:  # noqa: BLE001  (whatever happens, report it and leave)
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


# ------------------------------------------------------------------ spares

SPARES = 4  # spares kept ready by default ($LABKIT_SPARES): the default cluster's


class Spares:
    """Processes forked from the forkserver that wait for a rank's spec: a start
    or a restart takes them instead of waiting for the forks (fork start: the
    forks of a process that holds torch, ~10 ms each here) or for torch's import
    (portable start: the spares import it themselves, and what ranks import on
    first use, Preload's torch._dynamo..., each its own: nothing is shared after
    the fork anyway). As many are kept as the last start asked for
    ($LABKIT_SPARES before the first; 0: none), forked once the server has idled
    (IDLE_BEFORE_*); none is made ahead for more."""

    def __init__(self, gone: tuple[int, ...], start: str):
        self.gone = gone
        self.import_torch = start == "portable"
        self.idle = IDLE_BEFORE_SPARES[start]
        self.waiting: list[tuple[int, socket.socket]] = []  # oldest first
        self.target = int(os.environ.get("LABKIT_SPARES", SPARES))

    def short(self) -> bool:
        return len(self.waiting) < self.target

    def idle_before(self, served: bool) -> float:
        """Seconds idle before filling: after a start, or after the server's."""
        return self.idle if served else IDLE_BEFORE_FIRST_SPARES

    def release(self) -> None:
        """Let every waiting spare go (it reads EOF and exits)."""
        for _, sock in self.waiting:
            sock.close()
        self.waiting.clear()

    def fill(self, keep: tuple[int, ...]) -> None:
        while len(self.waiting) < self.target:
            self.waiting.append(self._fork(keep))

    def start(self, spec, keep: tuple[int, ...]) -> int:
        """Hand `spec` to the oldest spare (a fresh one if none waits); its pid."""
        while self.waiting:
            pid, sock = self.waiting.pop(0)
            try:
                wire.send(sock, spec)
                return pid
            except OSError:
                pass  # it died waiting: the next
            finally:
                sock.close()
        pid, sock = self._fork(keep)
        with sock:
            wire.send(sock, spec)
        return pid

    def forget(self, pids: set[int]) -> None:
        """Drop the spares among `pids`, which have exited while waiting."""
        for pid, sock in [w for w in self.waiting if w[0] in pids]:
            sock.close()
            self.waiting.remove((pid, sock))

    def _fork(self, keep: tuple[int, ...]) -> tuple[int, socket.socket]:
        ours, theirs = socket.socketpair()
        pid = os.fork()
        if pid:
            theirs.close()
            return pid, ours
        close = (*keep, ours.fileno(), *(s.fileno() for _, s in self.waiting))
        _child(close, lambda: _spare(theirs, self.gone, self.import_torch))


def _spare(sock: socket.socket, gone: tuple[int, ...], import_torch: bool) -> int:
    """A spare's life: import torch (portable start), wait for a spec, be that
    rank."""
    if import_torch:
        _import_torch()
    from labkit.runtime.rank import rank_main

    ready = select.select([sock, *gone], [], [])[0]
    if any(fd in ready for fd in gone):
        return 0  # the kernel is gone
    spec = wire.recv(sock)
    if spec is None:
        return 0  # the forkserver is gone, or let this spare go
    sock.close()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    return rank_main(spec, gone)


def _try_import(name: str) -> None:
    try:
        importlib.import_module(name)
    except ImportError:
        pass  # the rank imports it (or fails) on first use
