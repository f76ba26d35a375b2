"""labkit.Cluster: real torch.distributed ranks, started once, driven from a cell.

    cluster = labkit.Cluster(world_size=4)
    res = cluster.run(fn, x)          # fn(rank, world_size, x) on every rank
    res[2], res.values

Imports labkit.runtime's own modules and the standard library. Any failure (an
exception, a hang past `timeout`, a dead rank, an interrupt) stops every rank, and
the next `run` starts them again. One call at a time: `run` holds the cluster's
lock, and `close()` or `restart()` from another thread interrupts the call.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import selectors
import signal
import socket
import sys
import threading
import time
import weakref

from labkit.runtime import forkserver, platform, wire
from labkit.runtime.backend import (
    check_ranks,
    check_timeout,
    check_world_size,
    make_store,
    rank_threads,
    resolve_backend,
)
from labkit.runtime.call import (
    WAKE,
    CallInFlight,
    Interrupted,
    RankLinks,
    drain,
    pack_call,
)
from labkit.runtime.forkserver import select_one
from labkit.runtime.idle import IdleTimer, idle_seconds
from labkit.runtime.messages import Hello, JoinFailed, RankSpec
from labkit.runtime.output import RankOutput
from labkit.runtime.results import CallInterrupted, ClusterClosed, RankResults
from labkit.runtime.scratch import Scratch
from labkit.runtime.timeouts import Timeouts

_DEFAULT = object()
FLIGHT_RECORDS = 64  # collectives each rank's flight recorder keeps ($TORCH_FR_...)


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
    $LABKIT_IDLE_TIMEOUT, else None: never). timeouts: how long every other
    wait may take (a Timeouts record; default Timeouts()). start: how ranks are
    started, "fork" (Linux) or "portable" (macOS; no fork after importing torch);
    default $LABKIT_START, else this platform's (labkit/runtime/platform.py).
    """

    def __init__(self, world_size: int = 4, backend: str = "auto",
                 timeout: float | None = 30.0, *, threads: int | None = None,
                 idle_timeout=_DEFAULT, timeouts: Timeouts | None = None,
                 start: str | None = None):
        self._closed = False
        self.start = platform.start_method(start)
        self._lock = threading.RLock()  # held by a call, close(), restart()
        self._turn = threading.Condition(threading.Lock())  # guards the next 3
        self._waiting = 0  # close()/restart() waiting for the lock
        self._caller: int | None = None  # the thread whose call holds the lock
        self._stop_for: str | None = None  # who asked that call to stop
        self.world_size = check_world_size(world_size)
        self.timeout = check_timeout(timeout)
        self.timeouts = timeouts
        self.idle_timeout = idle_seconds(idle_timeout, _DEFAULT)
        self._idle = IdleTimer(self)
        self.backend = resolve_backend(backend, self.world_size)
        self.threads = rank_threads(threads, self.world_size)
        self._gen = 0
        self._calls = 0
        self._pids: dict[int, int] = {}
        self._pidfds: dict[int, int] = {}
        self._main: dict[int, socket.socket] = {}
        self._status: dict[int, socket.socket] = {}
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()  # close()/restart() wake a call
        for fd in (self._wake_r, self._wake_w):
            os.set_blocking(fd, False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, WAKE)
        self._scratch = Scratch()  # removes what killed kernels left
        self._dir = self._scratch.path
        self._output = RankOutput(self._dir, self.world_size)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._store = None
        _CLUSTERS.add(self)
        try:
            _bind(self._listener, os.path.join(self._dir, "ranks.sock"))
            self._listener.listen(2 * self.world_size)
            self._store, self.port = make_store(self.timeouts.store)
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
        self._idle_timeout = check_timeout(seconds, "idle_timeout", none="never")

    @property
    def timeouts(self) -> Timeouts:
        """How long each wait of the runtime may take (see Timeouts); set a new
        record, e.g. dataclasses.replace(cluster.timeouts, send=5)."""
        return self._timeouts

    @timeouts.setter
    def timeouts(self, value) -> None:
        if value is None:
            value = Timeouts()
        if not isinstance(value, Timeouts):
            raise TypeError("timeouts must be a labkit.runtime.Timeouts record "
                            f"(or None for the defaults), got {value!r}")
        self._timeouts = value

    @property
    def pids(self) -> dict[int, int]:
        """rank -> process id of the running ranks (empty while stopped)."""
        return dict(self._pids)

    @property
    def running(self) -> bool:
        """Ranks are up: a call would not have to start them."""
        return bool(self._pids) and not self._closed

    def stop_if_idle(self, still_idle) -> bool:
        """Stop the running ranks unless a call holds the cluster or
        `still_idle()` says one came meanwhile (its idle timer's check, made
        under the cluster's lock); True if they were stopped."""
        if not self._lock.acquire(blocking=False):
            return False  # a call runs: it arms a new timer when it ends
        try:
            if still_idle() and self.running:
                self._stop_ranks()
                return True
            return False
        finally:
            self._lock.release()

    def run(self, fn, *args, ranks=None, timeout=_DEFAULT, publish=None,
            **kwargs) -> RankResults:
        """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank (or `ranks`).
        publish: where the live view is drawn; None: in the calling cell when a
        person watches it, False: nowhere, or a callable(bundle, final)."""
        if not callable(fn):
            raise TypeError(f"run() needs a function to run, got {type(fn).__name__}")
        ranks = check_ranks(ranks, self.world_size)
        timeout = self.timeout if timeout is _DEFAULT else check_timeout(timeout)
        payload = pack_call(fn, args, kwargs)
        with self._call_turn():  # one call at a time: a call from a thread waits
            if self._closed:
                raise ClusterClosed(
                    "this Cluster is closed (cluster.close() stopped its ranks); "
                    f"start another: cluster = labkit.Cluster({self.world_size})")
            self._idle.disarm()
            try:
                self._ensure_running()
                self._calls += 1
                return CallInFlight(self.links(), ranks, timeout,
                                    publish).collect(payload)
            except Interrupted as e:  # close() or restart() from another thread
                self._stop_ranks()
                raise self._interrupted(e.by) from None
            except BaseException:
                self._stop_ranks()  # unknown state: start clean on the next run
                raise
            finally:
                self._idle.arm()

    def restart(self) -> None:
        """Stop the ranks and start them again. A call running in another thread
        is interrupted first (it raises CallInterrupted); this runs before any
        call that was waiting."""
        with self._op_turn("restart()"):
            if self._closed:
                raise ClusterClosed(
                    "restart(): this Cluster is closed (cluster.close() stopped "
                    "its ranks); start another: cluster = "
                    f"labkit.Cluster({self.world_size})")
            self._idle.disarm()
            self._stop_ranks()
            self._ensure_running()
            self._idle.arm()

    def close(self) -> None:
        """Stop the ranks and free the port and files. Safe to call twice, and
        from another thread while a call runs (which it interrupts: that call
        raises ClusterClosed)."""
        if self._closed:
            return
        with self._op_turn("close()"):
            if self._closed:
                return
            self._closed = True
            self._idle.disarm()
            self._stop_ranks()
            self._sel.close()
            for fd in (self._wake_r, self._wake_w):
                os.close(fd)
            self._listener.close()
            self._store = None  # the store owns and closes its listening socket
            self._scratch.remove()
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

    # -- whose turn --------------------------------------------------------

    @contextlib.contextmanager
    def _call_turn(self):
        """The lock, for one call: after every close()/restart() already waiting
        (they interrupt the call that holds it, and go first)."""
        me = threading.get_ident()
        if self._caller == me:  # a call made while this thread runs one
            with self._lock:
                yield
            return
        while True:
            with self._turn:
                self._turn.wait_for(lambda: not self._waiting)
            self._lock.acquire()
            with self._turn:
                if not self._waiting:
                    self._caller, self._stop_for = me, None
                    if not self._closed:  # a wake-up meant for an earlier call
                        drain(self._wake_r)
                    break
            self._lock.release()
        try:
            yield
        finally:
            with self._turn:
                self._caller = None
            self._lock.release()

    @contextlib.contextmanager
    def _op_turn(self, by: str):
        """The lock, for close() or restart() (`by`): a call that another thread
        runs is asked to stop (it raises, naming `by`) and lets go of it."""
        me = threading.get_ident()
        with self._turn:
            self._waiting += 1
            if self._caller not in (None, me) and not self._closed:
                self._stop_for = by
                try:
                    os.write(self._wake_w, b"!")
                except BlockingIOError:
                    pass  # the pipe is full: the call is being woken already
        try:
            self._lock.acquire()
        finally:
            with self._turn:
                self._waiting -= 1
                if self._caller != me:
                    self._stop_for = None
                self._turn.notify_all()
        try:
            yield
        finally:
            self._lock.release()

    def _stop_requested(self) -> str | None:
        """Who (close() or restart(), from another thread) asked the call that
        runs now to stop; None if nobody."""
        return self._stop_for

    def _interrupted(self, by: str) -> Exception:
        """What a call that close() or restart() interrupted raises."""
        if by == "close()":
            return ClusterClosed(
                "this call was interrupted: cluster.close() was called from "
                "another thread while it ran, which stopped its ranks and closed "
                "this Cluster; start another: cluster = "
                f"labkit.Cluster({self.world_size})")
        return CallInterrupted(
            f"this call was interrupted: cluster.{by} was called from another "
            "thread while it ran; the ranks were stopped and started again, "
            "without this call's results: run it again")

    # -- starting and stopping ---------------------------------------------

    def _ensure_running(self) -> None:
        if self._idle.fired and not self._pids:
            print(f"labkit: the ranks were stopped after {self._idle.seconds:g} s "
                  "idle (idle_timeout); starting them again", file=sys.stderr)
            self._idle.fired = False
        if self._pids:
            # an idle rank that died (killed, OOM) shows as a readable socket: EOF
            events = [(key, ev) for key, ev in self._sel.select(0)
                      if key.data != WAKE]
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
                         self._how_ended, self.world_size, self.timeouts,
                         self._wake_r, self._stop_requested)

    def _how_ended(self, rank: int) -> str:
        """'killed by SIGKILL', as the forkserver that reaped the rank saw it."""
        return forkserver.shared(self.start).exit_status(
            self._pids[rank], wait=self.timeouts.exit_report) or "exited"

    def _start(self) -> None:
        self._gen += 1
        deadline = time.monotonic() + self.timeouts.start
        self._output.restarted()
        pids = forkserver.shared(self.start).spawn(
            [self._spec(r) for r in range(self.world_size)], deadline,
            poll=self.timeouts.poll)
        self._pids = dict(enumerate(pids))
        for r, pid in self._pids.items():
            fd = platform.pidfd_open(pid)
            if fd is not None:
                self._pidfds[r] = fd
        try:
            self._connect_ranks(deadline)
        except BaseException:
            self._stop_ranks()
            raise

    def _spec(self, rank: int) -> RankSpec:
        n, times = self.world_size, self.timeouts
        return RankSpec(
            rank=rank, world_size=n, gen=self._gen,
            address=self._listener.getsockname(), port=self.port,
            backend=self.backend, threads=self.threads, init_timeout=times.start,
            pg_timeout=times.collective if self.timeout is None else max(
                times.collective_min, 4 * self.timeout),
            out=self._output.path(rank, "out"), err=self._output.path(rank, "err"),
            cwd=os.getcwd(), sys_path=tuple(sys.path),
            env={"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(n),
                 "LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(self.port),
                 # gloo and NCCL open their own sockets: keep them on loopback
                 "GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo",
                 "OMP_NUM_THREADS": str(self.threads),
                 # torch's flight recorder: each rank's last collectives, read
                 # after a timeout to name the rank that did not enter one
                 "TORCH_FR_BUFFER_SIZE": os.environ.get("TORCH_FR_BUFFER_SIZE",
                                                        str(FLIGHT_RECORDS))},
        )

    def _connect_ranks(self, deadline: float) -> None:
        """Accept each rank's two connections, then wait for its process group."""
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ, None)
        if self._caller == threading.get_ident():  # a call's start: interruptible
            sel.register(self._wake_r, selectors.EVENT_READ, WAKE)
        ready: set[int] = set()
        try:
            while len(ready) < self.world_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(self.world_size)) - ready)
                    raise TimeoutError(f"ranks {missing} did not start within "
                                       f"{self.timeouts.start:g} s (Timeouts.start)")
                events = sel.select(min(left, self.timeouts.poll))
                if not events:
                    self._check_start_deaths()
                for key, _ in events:
                    if key.data == WAKE:  # close() or restart() from another thread
                        drain(self._wake_r)
                        if self._stop_for is not None:
                            raise Interrupted(self._stop_for)
                        continue
                    if key.data is None:  # the listener: a new connection
                        conn, _ = self._listener.accept()
                        sel.register(conn, selectors.EVENT_READ, "new")
                        continue
                    msg = wire.recv(key.fileobj)
                    sel.unregister(key.fileobj)
                    if key.data == "new":
                        self._hello(key.fileobj, msg, sel)
                    elif msg is None:
                        self._check_start_deaths(wait=self.timeouts.exit_report)
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
        """Raise if a rank has exited while starting, as its forkserver reports
        (waiting up to `wait` seconds in all for the report)."""
        end = time.monotonic() + wait
        while True:
            for rank, pid in self._pids.items():
                how = forkserver.shared(self.start).exit_status(pid)
                if how:
                    err = self._output.read(rank, "err", 4000)
                    raise RuntimeError(
                        f"rank {rank} {how} while starting\n{err}".rstrip())
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(left, self.timeouts.poll))

    def _stop_ranks(self) -> None:
        """SIGKILL every rank by pid and wait (Timeouts.stop at most) until they
        are gone. Called with the lock held; it first takes the ranks' pidfds and
        connections out of the cluster, so each is used and closed once, by this
        call only (a second call finds nothing left to close)."""
        with self._lock:
            pids, self._pids = self._pids, {}
            pidfds, self._pidfds = self._pidfds, {}
            socks = [*self._main.values(), *self._status.values()]
            self._main, self._status = {}, {}
        for rank, pid in pids.items():
            fd = pidfds.get(rank)
            try:
                if fd is not None:
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
                else:
                    os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        end = time.monotonic() + self.timeouts.stop
        for fd in pidfds.values():
            try:
                select_one(fd, max(0.0, end - time.monotonic()))
            finally:
                os.close(fd)
        for sock in socks:
            try:
                self._sel.unregister(sock)
            except (KeyError, ValueError, RuntimeError):
                pass  # not registered, or the selector is closed
            sock.close()


def _bind(listener: socket.socket, path: str) -> None:
    """Bind the ranks' Unix socket; a temp directory whose path leaves no room
    for the socket's name (108 bytes on Linux, 104 on macOS) is said as such."""
    try:
        listener.bind(path)
    except OSError as e:
        if "too long" not in str(e):
            raise
        raise OSError(
            f"the ranks' socket {path!r} is {len(os.fsencode(path))} bytes, too long "
            "for a Unix socket (108 bytes on Linux, 104 on macOS): the temporary "
            f"directory {os.path.dirname(os.path.dirname(path))!r} is too deep. Set "
            "TMPDIR to a shorter folder (e.g. TMPDIR=/tmp) before starting Python"
        ) from None


# ------------------------------------------------------------------ defaults


_DEFAULT_CLUSTERS: dict[int, Cluster] = {}


_DEFAULT_LOCK = threading.Lock()


def default_cluster(world_size: int = 4) -> Cluster:
    """The shared cluster for this world size (created on first use: by one
    thread, the others wait for it)."""
    check_world_size(world_size)
    with _DEFAULT_LOCK:
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
