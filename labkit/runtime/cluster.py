"""labkit.Cluster: real torch.distributed ranks, started once, driven from a cell.

    cluster = labkit.Cluster(world_size=4)
    res = cluster.run(fn, x)          # fn(rank, world_size, x) on every rank
    res[2], res.values

Ranks are forked from a per-kernel forkserver that has torch imported
(forkserver.py, rank.py), join a gloo (CPU) or NCCL (GPU) process group through a
TCPStore this process hosts on 127.0.0.1, and wait for work. Any failure (an
exception, a hang past `timeout`, a dead rank, an interrupt) stops every rank; the
next `run` starts them again. So does `idle_timeout` (or LABKIT_IDLE_TIMEOUT, for a
whole server): ranks left idle that long are stopped and their memory given back.
"""

from __future__ import annotations

import atexit
import os
import selectors
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import weakref

from labkit.runtime import forkserver, wire
from labkit.runtime.backend import (
    check_ranks,
    check_timeout,
    check_world_size,
    make_store,
    rank_threads,
    resolve_backend,
)
from labkit.runtime.call import CallInFlight, RankLinks, pack_call
from labkit.runtime.forkserver import select_one
from labkit.runtime.idle import IdleTimer, idle_seconds
from labkit.runtime.messages import Hello, JoinFailed, RankSpec
from labkit.runtime.output import RankOutput
from labkit.runtime.results import ClusterClosed, RankResults

START_TIMEOUT = 120.0  # first start waits for the forkserver's torch import
_DEFAULT = object()


_CLUSTERS: weakref.WeakSet = weakref.WeakSet()


class Cluster:
    """`world_size` rank processes, each in a torch.distributed process group.

    backend: "auto" (NCCL when there is one GPU per rank, else gloo on CPU),
    "gloo" or "nccl". timeout: seconds a `run` may take before the busy ranks are
    reported and stopped (None: no limit). threads: torch threads per rank
    (default: $LABKIT_THREADS, else cores // world_size, at least 1).
    idle_timeout: seconds after the last call (or the start) when the ranks are
    stopped, to give their memory back; the next `run` starts them again,
    without the variables earlier %%ranks cells left on them (default:
    $LABKIT_IDLE_TIMEOUT, else None: never).
    """

    def __init__(self, world_size: int = 4, backend: str = "auto",
                 timeout: float | None = 30.0, *, threads: int | None = None,
                 idle_timeout=_DEFAULT):
        self.world_size = check_world_size(world_size)
        self.timeout = check_timeout(timeout)
        self.idle_timeout = idle_seconds(idle_timeout, _DEFAULT)
        self._idle = IdleTimer(self)
        self.backend = resolve_backend(backend, self.world_size)
        self.threads = rank_threads(threads, self.world_size)
        self._closed = False
        self._lock = threading.RLock()
        self._gen = 0
        self._calls = 0
        self._pids: dict[int, int] = {}
        self._pidfds: dict[int, int] = {}
        self._main: dict[int, socket.socket] = {}
        self._status: dict[int, socket.socket] = {}
        self._sel = selectors.DefaultSelector()
        self._dir = tempfile.mkdtemp(prefix="labkit-")
        self._output = RankOutput(self._dir, self.world_size)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._store = None
        _CLUSTERS.add(self)
        try:
            self._listener.bind(os.path.join(self._dir, "ranks.sock"))
            self._listener.listen(2 * self.world_size)
            self._store, self.port = make_store()
            self._start()
            self._idle.arm()
        except BaseException:
            self.close()
            raise

    # -- public -------------------------------------------------------------

    @property
    def idle_timeout(self) -> float | None:
        """Seconds idle before the ranks are stopped (None: never). Set on a
        running cluster, it counts from the end of its next call."""
        return self._idle_timeout

    @idle_timeout.setter
    def idle_timeout(self, seconds) -> None:
        self._idle_timeout = check_timeout(seconds)

    @property
    def pids(self) -> dict[int, int]:
        """rank -> process id of the running ranks (empty while stopped)."""
        return dict(self._pids)

    @property
    def running(self) -> bool:
        return bool(self._pids)

    def run(self, fn, *args, ranks=None, timeout=_DEFAULT, **kwargs) -> RankResults:
        """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank (or `ranks`)."""
        if not callable(fn):
            raise TypeError(f"run() needs a function to run, got {type(fn).__name__}")
        ranks = check_ranks(ranks, self.world_size)
        timeout = self.timeout if timeout is _DEFAULT else check_timeout(timeout)
        payload = pack_call(fn, args, kwargs)
        with self._lock:  # one call at a time: a call from a thread waits its turn
            if self._closed:
                raise ClusterClosed(
                    "this Cluster is closed (cluster.close() stopped its ranks); "
                    f"start another: cluster = labkit.Cluster({self.world_size})")
            self._idle.disarm()
            try:
                self._ensure_running()
                self._calls += 1
                return CallInFlight(self.links(), ranks, timeout).collect(payload)
            except BaseException:
                self._stop_ranks()  # unknown state: start clean on the next run
                raise
            finally:
                self._idle.arm()

    def restart(self) -> None:
        """Stop the ranks and start them again."""
        self._stop_ranks()
        self._ensure_running()
        self._idle.arm()

    def close(self) -> None:
        """Stop the ranks and free the port and files. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._idle.disarm()
        self._stop_ranks()
        self._sel.close()
        self._listener.close()
        self._store = None  # the store owns and closes its listening socket
        shutil.rmtree(self._dir, ignore_errors=True)
        _CLUSTERS.discard(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001  (interpreter shutdown)
            pass

    def __repr__(self) -> str:
        state = "closed" if self._closed else "running" if self.running else "stopped"
        return (f"Cluster(world_size={self.world_size}, backend={self.backend!r}, "
                f"{state})")

    # -- starting and stopping ---------------------------------------------

    def _ensure_running(self) -> None:
        if self._idle.fired and not self._pids:
            print(f"labkit: the ranks were stopped after {self.idle_timeout:g} s idle "
                  "(idle_timeout); starting them again", file=sys.stderr)
            self._idle.fired = False
        if self._pids:
            # an idle rank that died (killed, OOM) shows as a readable socket: EOF
            events = self._sel.select(0)
            if not events:
                return
            dead = ", ".join(f"rank {key.data} {self._how_ended(key.data)}"
                             for key, _ in events)
            print(f"labkit: {dead}; restarting the ranks", file=sys.stderr)
            self._stop_ranks()
        self._start()

    def links(self) -> RankLinks:
        """The running ranks' connections and output, for one call."""
        return RankLinks(self._main, self._status, self._sel, self._output,
                         self._how_ended, self.world_size)

    def _how_ended(self, rank: int, wait: float = 2.0) -> str:
        """'killed by SIGKILL', as the forkserver that reaped the rank saw it."""
        return forkserver.shared().exit_status(self._pids[rank], wait=wait) or "exited"

    def _start(self) -> None:
        self._gen += 1
        deadline = time.monotonic() + START_TIMEOUT
        self._output.restarted()
        pids = forkserver.shared().spawn(
            [self._spec(r) for r in range(self.world_size)], deadline)
        self._pids = dict(enumerate(pids))
        for r, pid in self._pids.items():
            try:
                self._pidfds[r] = os.pidfd_open(pid)
            except (AttributeError, OSError):
                pass
        try:
            self._connect_ranks(deadline)
        except BaseException:
            self._stop_ranks()
            raise

    def _spec(self, rank: int) -> RankSpec:
        n = self.world_size
        return RankSpec(
            rank=rank, world_size=n, gen=self._gen,
            address=self._listener.getsockname(), port=self.port,
            backend=self.backend, threads=self.threads, init_timeout=START_TIMEOUT,
            pg_timeout=1800 if self.timeout is None else max(60, 4 * self.timeout),
            out=self._output.path(rank, "out"), err=self._output.path(rank, "err"),
            cwd=os.getcwd(), sys_path=tuple(sys.path),
            env={"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(n),
                 "LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(self.port),
                 # gloo and NCCL open their own sockets: keep them on loopback
                 "GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo",
                 "OMP_NUM_THREADS": str(self.threads)},
        )

    def _connect_ranks(self, deadline: float) -> None:
        """Accept each rank's two connections, then wait for its process group."""
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ, None)
        ready: set[int] = set()
        try:
            while len(ready) < self.world_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(self.world_size)) - ready)
                    raise TimeoutError(f"ranks {missing} did not start within "
                                       f"{START_TIMEOUT:.0f} s")
                events = sel.select(min(left, 0.2))
                if not events:
                    self._check_start_deaths()
                for key, _ in events:
                    if key.data is None:  # the listener: a new connection
                        conn, _ = self._listener.accept()
                        sel.register(conn, selectors.EVENT_READ, "new")
                        continue
                    msg = wire.recv(key.fileobj)
                    sel.unregister(key.fileobj)
                    if key.data == "new":
                        self._hello(key.fileobj, msg, sel)
                    elif msg is None:
                        self._check_start_deaths(wait=0.5)
                        raise RuntimeError(f"rank {key.data} exited while starting")
                    elif isinstance(msg, JoinFailed):
                        raise RuntimeError(f"rank {key.data} could not join the "
                                           f"process group:\n{msg.traceback}")
                    else:
                        ready.add(key.data)
        finally:
            sel.close()
        for r, sock in self._main.items():
            self._sel.register(sock, selectors.EVENT_READ, r)

    def _hello(self, conn: socket.socket, msg, sel) -> None:
        if not isinstance(msg, Hello) or msg.gen != self._gen:
            conn.close()  # a straggler from an earlier start
            return
        if msg.channel == "main":
            self._main[msg.rank] = conn
            sel.register(conn, selectors.EVENT_READ, msg.rank)
        else:
            self._status[msg.rank] = conn

    def _check_start_deaths(self, wait: float = 0.0) -> None:
        for rank, pid in self._pids.items():
            how = forkserver.shared().exit_status(pid, wait=wait)
            if how:
                err = self._output.read(rank, "err", 4000)
                raise RuntimeError(f"rank {rank} {how} while starting\n{err}".rstrip())

    def _stop_ranks(self) -> None:
        """SIGKILL every rank by pid and wait (≤ 2 s) until they are gone."""
        for rank, pid in self._pids.items():
            fd = self._pidfds.get(rank)
            try:
                if fd is not None:
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
                else:
                    os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        end = time.monotonic() + 2.0
        for rank in self._pids:
            fd = self._pidfds.pop(rank, None)
            if fd is not None:
                select_one(fd, max(0.0, end - time.monotonic()))
                os.close(fd)
        for sock in [*self._main.values(), *self._status.values()]:
            try:
                self._sel.unregister(sock)
            except (KeyError, ValueError):
                pass
            sock.close()
        self._main, self._status, self._pids = {}, {}, {}


# ------------------------------------------------------------------ defaults


_DEFAULT_CLUSTERS: dict[int, Cluster] = {}


def default_cluster(world_size: int = 4) -> Cluster:
    """The shared cluster for this world size (created on first use)."""
    check_world_size(world_size)
    c = _DEFAULT_CLUSTERS.get(world_size)
    if c is None or c._closed:
        c = _DEFAULT_CLUSTERS[world_size] = Cluster(world_size)
    return c


def run(fn, *args, world_size: int = 4, ranks=None, timeout=_DEFAULT, **kwargs):
    """``fn(rank, world_size, *args, **kwargs)`` on the shared cluster of that size."""
    return default_cluster(world_size).run(fn, *args, ranks=ranks, timeout=timeout,
                                           **kwargs)


@atexit.register
def _close_all() -> None:
    for c in list(_CLUSTERS):
        c.close()
