"""The rank forkserver ("zygote"), seen from the kernel: one per process.

It is a fresh Python that imports torch once and then forks rank processes on
request (the other half is labkit.runtime.rank.zygote_main). It runs in its own session
and exits when this process does. Forked ranks are its children: it reaps them and
reports how each ended.
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

from labkit.runtime import wire as _wire
from labkit.runtime.rank import ROLE_ENV


class Forkserver:
    """One forkserver per kernel process, with torch preloaded."""

    def __init__(self):
        lifeline_r, self._lifeline_w = os.pipe()
        mine, theirs = socket.socketpair()
        pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ)
        env[ROLE_ENV] = "zygote"
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (pkg_root, env.get("PYTHONPATH")) if p
        )
        self.log = tempfile.NamedTemporaryFile(prefix="labkit-zygote-", suffix=".log")
        code = "import sys; from labkit.runtime.rank import zygote_main; " \
               "zygote_main(*map(int, sys.argv[1:]))"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, str(theirs.fileno()), str(lifeline_r),
             str(os.getpid())],
            pass_fds=(theirs.fileno(), lifeline_r),
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        os.close(lifeline_r)
        theirs.close()
        self.sock = mine
        self.ready = False
        self.exits: dict[int, str] = {}
        self.preloaded: set[str] = set()
        self.lock = threading.Lock()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _handle(self, msg) -> None:
        if msg[0] == "exited":
            self.exits[msg[1]] = msg[2]
        elif msg[0] == "preloaded":
            self.preloaded.add(msg[1])

    def wait_preloaded(self, timeout: float = 30.0) -> bool:
        """Wait until the zygote has imported what it imports when idle."""
        from labkit.runtime.rank import PRELOAD_WHEN_IDLE

        end = time.monotonic() + timeout
        while len(self.preloaded) < len(PRELOAD_WHEN_IDLE):
            if time.monotonic() > end:
                return False
            self.poll()
            time.sleep(0.05)
        return True

    def _recv(self, deadline: float):
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the rank forkserver did not answer in time")
            if select_one(self.sock, min(left, 0.5))[0]:
                msg = _wire.recv(self.sock)
                if msg is not None:
                    return msg
                self.proc.wait(5)  # EOF: it is exiting
            if not self.alive():
                self.log.seek(0)
                tail = self.log.read().decode(errors="replace")[-4000:]
                raise RuntimeError(
                    "labkit's rank forkserver exited "
                    f"({self.proc.returncode}); its log:\n{tail}"
                )

    def spawn(self, specs: list[dict], deadline: float) -> list[int]:
        with self.lock:
            while not self.ready:
                msg = self._recv(deadline)
                self.ready = msg[0] == "ready"
            _wire.send(self.sock, ("spawn", specs))
            while True:
                msg = self._recv(deadline)
                if msg[0] == "spawned":
                    return msg[1]
                self._handle(msg)

    def poll(self) -> None:
        """Take in exit reports without blocking."""
        if not self.lock.acquire(blocking=False):
            return
        try:
            while select_one(self.sock, 0)[0]:
                msg = _wire.recv(self.sock)
                if msg is None:
                    return
                self._handle(msg)
        finally:
            self.lock.release()

    def exit_status(self, pid: int, wait: float = 0.0) -> str | None:
        end = time.monotonic() + wait
        while True:
            self.poll()
            if pid in self.exits or time.monotonic() >= end:
                return self.exits.pop(pid, None)
            time.sleep(0.01)


def select_one(sock, timeout):
    return select.select([sock], [], [], timeout)


_SHARED: Forkserver | None = None
_SHARED_LOCK = threading.Lock()


def shared() -> Forkserver:
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None or not _SHARED.alive():
            _SHARED = Forkserver()
        return _SHARED


def prewarm() -> None:
    """Start the rank forkserver now, so its torch import overlaps the kernel's.

    LABKIT_PREWARM=1 always does, =0 never; unset, only inside IPython/Jupyter,
    where `import labkit` is a sign that ranks will follow."""
    if os.environ.get(ROLE_ENV):
        return
    choice = os.environ.get("LABKIT_PREWARM", "auto")
    if choice == "0" or (choice == "auto" and not _in_ipython()):
        return
    shared()


def _in_ipython() -> bool:
    ipython = sys.modules.get("IPython")
    return ipython is not None and ipython.get_ipython() is not None
