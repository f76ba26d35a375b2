"""The forkserver process (forkserver.py is the kernel's handle on it).

Fork start: import torch and what the kernel asked for at its start (Preload), say
ready, fork a rank per request and report how each ended; hand over to a successor
that has imported what was asked for later once idle, and exit once the kernel
says the successor forks (Retire) and the ranks it forked have exited.
Portable start (platform.py): import no torch; ranks come from spares, processes
forked from here that import torch themselves and wait for their rank's spec."""

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
# portable start: spares fork once the server has been idle this long, after its
# own start (in a script the first start comes at once: its ranks are forked
# then, none wasted) and after each start (not meanwhile: their imports would
# slow the ranks'; and a short-lived process never makes them)
IDLE_BEFORE_FIRST_SPARES = 0.2
IDLE_BEFORE_SPARES = 3.0


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
        wanted, spares = _asked_at_start(ctrl), Spares(gone)
    else:
        wanted, spares = _import_asked_at_start(ctrl), None
    if wanted is not None:  # None: the kernel is gone
        _loop(ctrl, gone, wanted=wanted, spares=spares)
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
          spares: Spares | None = None):
    """Serve `ctrl` until the kernel is gone. `wanted`: modules asked for so far
    (Preload); once idle with some not imported, hand over to a successor that
    imports them (once: a forkserver that handed over only serves until its
    successor is ready). With `spares` (the portable start) ranks come from them,
    which import what is wanted themselves: no successor. Returns, to exit, when
    the kernel is gone, or once retired (Retire) with no rank of its own left."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select via wake_w
    wire.send(ctrl, ForkserverReady(os.getpid(), _imported(wanted)))
    served = retired = False
    handed_over = spares is not None or not platform.CAN_HAND_OVER
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
        elif spares is not None and spares.short():
            idle = IDLE_BEFORE_SPARES if served else IDLE_BEFORE_FIRST_SPARES
        ready, _, _ = select.select([ctrl, wake_r, *gone], [], [], idle)
        if not ready and spares is not None:  # idle: new spares import torch
            spares.fill(keep)
            continue
        if not ready:  # idle: let a successor import more, then take over
            _start_successor(ctrl, gone, wanted, close=(wake_r, wake_w))
            handed_over = True
            continue
        if any(fd in ready for fd in gone):
            return
        if wake_r in ready:
            os.read(wake_r, 4096)
            reaped = _reap(ctrl)
            ranks -= reaped
            if spares is not None:
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
                    # (with spares, handed_over: ranks import it on first use)
                    wire.send(ctrl, ForkserverReady(os.getpid(), wanted))
            elif isinstance(msg, Spawn):
                sys.stdout.flush()
                sys.stderr.flush()
                if spares is None:
                    pids = tuple(_fork_rank(spec, keep, gone) for spec in msg.specs)
                else:
                    pids = tuple(spares.start(spec, keep) for spec in msg.specs)
                ranks.update(pids)
                wire.send(ctrl, Spawned(pids))
                served = True
                if spares is not None:  # once idle, ready to start these again
                    spares.target = len(msg.specs)


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
            _loop(theirs, gone, wanted=wanted)
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


def _fork_rank(spec, close_fds: tuple[int, ...], gone: tuple[int, ...]) -> int:
    pid = os.fork()
    if pid:
        return pid

    def rank() -> int:
        from labkit.runtime.rank import rank_main

        signal.signal(signal.SIGINT, signal.default_int_handler)
        return rank_main(spec, gone)

    _child(close_fds, rank)


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


# ------------------------------------------------------------ the portable start

SPARES = 4  # spares kept ready by default ($LABKIT_SPARES): the default cluster's


class Spares:
    """Processes forked from the portable forkserver (no torch imported) that
    import torch and wait for a rank's spec: a start or a restart takes them
    instead of waiting for torch's import. What ranks import on first use
    (Preload: torch._dynamo...) they import then, each its own: nothing is shared
    after the fork anyway. As many are kept as the last start asked for
    ($LABKIT_SPARES before the first), forked once the server has idled
    (IDLE_BEFORE_*): each costs a torch import, so none is made ahead for more."""

    def __init__(self, gone: tuple[int, ...]):
        self.gone = gone
        self.waiting: list[tuple[int, socket.socket]] = []  # oldest first
        self.target = int(os.environ.get("LABKIT_SPARES", SPARES))

    def short(self) -> bool:
        return len(self.waiting) < self.target

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
        _child(close, lambda: _spare(theirs, self.gone))


def _spare(sock: socket.socket, gone: tuple[int, ...]) -> int:
    """A spare's life: import torch, wait for a spec, be that rank."""
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
