"""The forkserver, kernel side: `Forkserver` is the kernel's handle on the process
that forks ranks (forkserver_process.py), `shared(start)` the one per kernel and
start method (platform.py). Imports labkit.runtime's platform, wire, messages and
timeouts, and the standard library.

Ranks start with what the kernel imported of the modules that say
`PRELOAD_IN_RANKS = True` (the runtime looks; importing one changes nothing
here). What is asked for after the start a serving forkserver never imports
itself, since it could not fork meanwhile: once idle it forks a successor that
imports it and takes over the forking.
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict

from labkit.runtime import platform, wire
from labkit.runtime.messages import (
    ROLE_ENV,
    ForkserverReady,
    RankExited,
    Preload,
    Retire,
    Spawn,
    Spawned,
    Successor,
)
from labkit.runtime.timeouts import DEFAULT

# what ranks would otherwise import on first use: what a rank's first
# optimizer.step() imports (torch._dynamo, ~1.5 s) and the memory tracker
PRELOAD_WHEN_IDLE = ("torch.distributed._tools.mem_tracker", "torch._dynamo")
_WANTED: list[str] = list(PRELOAD_WHEN_IDLE)  # + what preload_when_idle adds
# a labkit module with this set to True at its top level is imported in ranks
# too once the kernel has imported it (the memory ledger: it pulls in DTensor)
PRELOAD_FLAG = "PRELOAD_IN_RANKS"
KEEP_EXITS = 512  # rank exits remembered (Forkserver.exits), the latest


def wanted() -> tuple[str, ...]:
    """What ranks should start with imported: PRELOAD_WHEN_IDLE, what
    preload_when_idle was asked for, and each labkit module imported here that
    says PRELOAD_IN_RANKS = True."""
    flagged = sorted(name for name, module in list(sys.modules.items())
                     if name.startswith("labkit.")
                     and getattr(module, PRELOAD_FLAG, False) is True)
    return tuple(dict.fromkeys((*_WANTED, *flagged)))


def preload_when_idle(*names: str) -> None:
    """Ask the forkserver to have `names` imported before it forks ranks (when
    idle, by a successor)."""
    for name in names:
        if name not in _WANTED:
            _WANTED.append(name)
    ask_for_new_preloads()


def ask_for_new_preloads() -> None:
    """Pass on to each live forkserver what ranks should now start with that it
    has not heard of (a cell, or a spawn, after the kernel imported more)."""
    for server in list(_SHARED.values()):
        if server.alive():
            server.ask_new_preloads()


# ---------------------------------------------------------- the kernel's handle


class Forkserver:
    """The kernel's handle on its forkserver (and the successor that takes over)."""

    def __init__(self, start: str = "fork"):
        self.start = start
        lifeline_r, self._lifeline_w = os.pipe()
        mine, theirs = socket.socketpair()
        src_root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
        env = dict(os.environ)
        env[ROLE_ENV] = "forkserver"
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (os.path.abspath(src_root), env.get("PYTHONPATH")) if p)
        # nameless (deleted at once): gone with the last process that holds it,
        # even when the kernel is killed
        self.log = tempfile.TemporaryFile(prefix="labkit-forkserver-")
        code = "import sys; from labkit.runtime.forkserver_process import serve; " \
               "serve(*map(int, sys.argv[1:4]), sys.argv[4])"
        # a fresh python, not a fork of the multi-threaded kernel, in a session
        # of its own; it imports torch once and forks every rank after that (the
        # portable start: it forks spares, which import torch themselves)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, str(theirs.fileno()), str(lifeline_r),
             str(os.getpid()), start],
            pass_fds=(theirs.fileno(), lifeline_r),
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        os.close(lifeline_r)
        theirs.close()
        self.sock = mine  # the one that forks: the first, then its successor
        self._first = mine
        self._socks = [mine]  # all, for the exit reports of the ranks each forked
        self._pid_of = {mine: self.proc.pid}
        self._ready: set[socket.socket] = set()
        self._successor: socket.socket | None = None
        # how ranks ended, the last KEEP_EXITS (one is asked for soon after)
        self.exits: OrderedDict[int, str] = OrderedDict()
        self.preloaded: tuple[str, ...] = ()
        # each connection's answer to its last Spawn, whoever read it: spawn()'s
        # liveness check (alive(), poll()) drains every connection, its own too
        self._spawned: dict[socket.socket, tuple[int, ...]] = {}
        self.lock = threading.RLock()
        # read once torch is imported there; successors get it again (_take)
        self.asked = wanted()
        wire.send(mine, Preload(self.asked))

    @property
    def pid(self) -> int:
        """The process that forks: the first, or the successor that took over."""
        return self._pid_of[self.sock]

    @property
    def pids(self) -> list[int]:
        """Every forkserver process whose connection is still open, oldest first."""
        return [self._pid_of[s] for s in self._socks]

    def alive(self) -> bool:
        """Whether the process that forks (the first, or the successor that took
        over from it) is still running."""
        if self.sock is self._first:
            return self.proc.poll() is None
        self.poll()  # a successor's exit is the end of its connection
        return self.sock in self._socks

    def close(self) -> None:
        """Let go of the forkserver: close the lifeline (what is left of it and
        the ranks it forked exit), the connections and the log. Safe to call
        twice; shared() calls it on one that died before starting another."""
        with self.lock:
            if self._lifeline_w is not None:
                os.close(self._lifeline_w)
                self._lifeline_w = None
            for sock in {*self._socks, *self._pid_of, self._first}:
                sock.close()
            self._socks.clear()
            self._successor = None
            self._ready.clear()
            self._spawned.clear()
            self.log.close()
            self.proc.poll()  # reap it, if it has exited

    def _take(self, sock: socket.socket):
        """Read one message from `sock` and act on it; None on EOF."""
        msg = wire.recv(sock)
        if msg is None:  # that process has exited
            if sock in self._socks:
                self._socks.remove(sock)
            if sock is self._successor:
                self._successor = None
            if sock is self._first:
                self.proc.poll()  # reap it
            self._ready.discard(sock)
            if sock is not self.sock:  # retired: nothing more to say about it
                self._pid_of.pop(sock, None)
            sock.close()
            return None
        if isinstance(msg, RankExited):
            self.exits[msg.pid] = msg.how
            while len(self.exits) > KEEP_EXITS:
                self.exits.popitem(last=False)
        elif isinstance(msg, Spawned):
            for pid in msg.pids:  # a reused pid: not the rank that had it before
                self.exits.pop(pid, None)
            self._spawned[sock] = msg.pids
        elif isinstance(msg, ForkserverReady):
            self._ready.add(sock)
            if sock is self._successor:  # it has imported more: it forks from now
                old, self.sock, self._successor = self.sock, sock, None
                try:
                    wire.send(old, Retire())
                except OSError:
                    pass  # gone already
            if sock is self.sock:
                self.preloaded = msg.preloaded
        elif isinstance(msg, Successor):
            _, fds, _, _ = socket.recv_fds(sock, 1, 1)
            self._successor = socket.socket(fileno=fds[0])
            self._socks.append(self._successor)
            self._pid_of[self._successor] = msg.pid
            # what was asked for after it was forked, it has not heard of
            wire.send(self._successor, Preload(self.asked))
        return msg

    def ask_new_preloads(self) -> None:
        """Tell every forkserver process of ours (the one that forks and a
        successor on its way) to have imported what `wanted()` now adds."""
        with self.lock:
            new = tuple(n for n in wanted() if n not in self.asked)
            if not new:
                return
            self.asked += new
            for sock in self._socks:
                try:
                    wire.send(sock, Preload(new))
                except OSError:
                    pass  # gone: its exit is seen elsewhere

    def _drain(self, timeout: float) -> None:
        """Take in whatever arrives within `timeout` seconds (0: only what's there),
        including what a successor announced in the same breath says."""
        while self._socks:
            ready = select.select(self._socks, [], [], timeout)[0]
            if not ready:
                return
            for sock in ready:
                self._take(sock)
            timeout = 0

    def _died(self) -> str:
        self.log.seek(0)
        tail = self.log.read().decode(errors="replace")[-4000:]
        how = f" ({self.proc.returncode})" if self.sock is self._first else ""
        return f"labkit's rank forkserver (pid {self.pid}) exited{how}; its log:\n" \
               f"{tail}"

    def spawn(self, specs, deadline: float, poll: float = DEFAULT.poll
              ) -> tuple[int, ...]:
        """Fork one rank per spec; their pids (looking every `poll` seconds)."""
        with self.lock:
            self.ask_new_preloads()  # for the ranks after these: a successor's
            self._drain(0)  # a successor that has said ready takes over now
            while self.sock not in self._ready:
                if not self.alive():
                    raise RuntimeError(self._died())
                if time.monotonic() > deadline:
                    raise TimeoutError("the rank forkserver did not start in time")
                self._drain(poll)
            sock = self.sock
            self._spawned.pop(sock, None)
            wire.send(sock, Spawn(tuple(specs)))
            while True:
                if select_one(sock, min(max(deadline - time.monotonic(), 0),
                                        poll))[0]:
                    self._take(sock)
                alive = self.alive()  # a successor's: drains every connection
                if sock in self._spawned:  # read just now, or by alive()
                    return self._spawned.pop(sock)
                if not alive or sock not in self._socks:
                    raise RuntimeError(self._died())
                if time.monotonic() > deadline:
                    raise TimeoutError("the rank forkserver did not answer in time")

    def poll(self) -> None:
        """Take in exit reports and hand-overs without blocking."""
        if self.lock.acquire(blocking=False):
            try:
                self._drain(0)
            finally:
                self.lock.release()

    def wait_preloaded(self, timeout: float = DEFAULT.preload) -> bool:
        """Wait until the forkserver that forks has imported what was asked for
        (`wanted()`). The portable start preloads nothing (its ranks import
        on first use): True at once."""
        if self.start == "portable":
            return True
        self.ask_new_preloads()
        end = time.monotonic() + timeout
        while not set(self.asked) <= set(self.preloaded):
            if time.monotonic() > end:
                return False
            with self.lock:
                self._drain(DEFAULT.poll)
        return True

    def exit_status(self, pid: int, wait: float = 0.0) -> str | None:
        """How rank `pid` ended, as its forkserver saw it (None: not yet known)."""
        end = time.monotonic() + wait
        while True:
            self.poll()
            if pid in self.exits or time.monotonic() >= end:
                return self.exits.pop(pid, None)
            time.sleep(0.01)


def select_one(sock, timeout):
    return select.select([sock], [], [], timeout)


_SHARED: dict[str, Forkserver] = {}  # by start method
_SHARED_LOCK = threading.Lock()


def shared(start: str | None = None) -> Forkserver:
    """This process's forkserver for `start` (None: platform.start_method()),
    started on first use (or again if it died)."""
    start = platform.start_method(start)
    with _SHARED_LOCK:
        server = _SHARED.get(start)
        if server is None or not server.alive():
            if server is not None:
                server.close()  # dead: let go of what the kernel held for it
            server = _SHARED[start] = Forkserver(start)
        return server


def started() -> list[str]:
    """The start methods whose forkserver this process has started and is alive."""
    return [start for start, server in _SHARED.items() if server.alive()]


def prewarm() -> None:
    """Start the rank forkserver now, so its torch import overlaps the kernel's.

    LABKIT_PREWARM=1 always does, =0 never; unset, only inside IPython/Jupyter,
    where `import labkit` is a sign that ranks will follow."""
    if os.environ.get(ROLE_ENV):
        return
    _after_each_cell()
    choice = os.environ.get("LABKIT_PREWARM", "auto")
    if choice == "0" or (choice == "auto" and not _in_ipython()):
        return
    shared()


def _after_each_cell() -> None:
    """In IPython: once each cell has run, pass on what it imported that ranks
    should start with, so a successor imports it while the student reads."""
    shell = _shell()
    if shell is not None and \
            _pass_on_preloads not in shell.events.callbacks["post_run_cell"]:
        shell.events.register("post_run_cell", _pass_on_preloads)


def _pass_on_preloads(*_) -> None:
    try:
        ask_for_new_preloads()
    except OSError:  # a forkserver gone meanwhile: the next start says so
        pass


def _shell():
    """The running IPython shell, or None (IPython itself is never imported)."""
    ipython = sys.modules.get("IPython")
    return ipython.get_ipython() if ipython is not None else None


def _in_ipython() -> bool:
    return _shell() is not None
