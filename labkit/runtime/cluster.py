"""labkit.Cluster: real torch.distributed ranks, started once, driven from a cell.

    cluster = labkit.Cluster(world_size=4)
    res = cluster.run(fn, x)          # fn(rank, world_size, x) on every rank
    res[2], res.values

Ranks are forked from a per-kernel forkserver that has torch imported
(forkserver.py, worker.py), join a gloo (CPU) or NCCL (GPU) process group through a
TCPStore this process hosts on 127.0.0.1, and wait for work. Any failure (an
exception, a hang past `timeout`, a dead rank, an interrupt) stops every rank; the
next `run` starts them again.
"""

from __future__ import annotations

import atexit
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from datetime import timedelta

import cloudpickle

from labkit.runtime import forkserver, wire as _wire
from labkit.runtime.forkserver import select_one
from labkit.runtime.results import (
    CollectiveTimeout,
    RankError,
    RankResults,
    describe_busy,
    first_line,
    format_remote,
    loads_or_none,
)

MAX_WORLD_SIZE = 64
START_TIMEOUT = 120.0  # first start waits for the zygote's torch import
GRACE = 0.5  # after one rank fails, how long the others get to finish
STATUS_TIMEOUT = 1.0
MAX_OUTPUT = 1 << 20  # bytes of one rank's output shown per call
_DEFAULT = object()


# ------------------------------------------------------------------ backend


_GPU_COUNT: int | None = None


def gpu_count() -> int:
    """CUDA devices visible, found without initialising CUDA in this process."""
    global _GPU_COUNT
    if _GPU_COUNT is None:
        import torch

        if torch.version.cuda is None or not torch.backends.cuda.is_built():
            _GPU_COUNT = 0
        else:
            n = torch.cuda._device_count_nvml()
            if n < 0:  # no NVML: ask a throwaway process
                out = subprocess.run(
                    [sys.executable, "-c",
                     "import torch; print(torch.cuda.device_count())"],
                    capture_output=True, text=True, timeout=120,
                )
                n = int(out.stdout.strip() or 0)
            _GPU_COUNT = n
    return _GPU_COUNT


def resolve_backend(backend: str, world_size: int) -> str:
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', not {backend!r}")
    if backend == "gloo":
        return "gloo"
    gpus = gpu_count()
    if backend == "nccl" and gpus < world_size:
        raise ValueError(
            f"backend='nccl' needs one GPU per rank: world_size={world_size} but "
            f"{gpus} CUDA device(s) are visible. Use backend='gloo' (CPU) or fewer "
            "ranks."
        )
    return "nccl" if gpus >= world_size else "gloo"


# ------------------------------------------------------------------ results


# ------------------------------------------------------------------ the cluster


_CLUSTERS: weakref.WeakSet = weakref.WeakSet()


class Cluster:
    """`world_size` rank processes, each in a torch.distributed process group.

    backend: "auto" (NCCL when there is one GPU per rank, else gloo on CPU),
    "gloo" or "nccl". timeout: seconds a `run` may take before the busy ranks are
    reported and stopped (None: no limit). threads: torch threads per rank
    (default: cores // world_size, at least 1).
    """

    def __init__(self, world_size: int = 4, backend: str = "auto",
                 timeout: float | None = 30.0, *, threads: int | None = None):
        self.world_size = _check_world_size(world_size)
        self.timeout = _check_timeout(timeout)
        self.backend = resolve_backend(backend, self.world_size)
        self.threads = threads or max(1, (os.cpu_count() or 1) // self.world_size)
        self._closed = False
        self._gen = 0
        self._calls = 0
        self._pids: dict[int, int] = {}
        self._pidfds: dict[int, int] = {}
        self._main: dict[int, socket.socket] = {}
        self._status: dict[int, socket.socket] = {}
        self._offsets: dict[tuple[int, str], int] = {}
        self._sel = selectors.DefaultSelector()
        self._dir = tempfile.mkdtemp(prefix="labkit-")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._store = None
        _CLUSTERS.add(self)
        try:
            self._listener.bind(os.path.join(self._dir, "ranks.sock"))
            self._listener.listen(2 * self.world_size)
            self._store, self.port = _make_store()
            self._start()
        except BaseException:
            self.close()
            raise

    # -- public -------------------------------------------------------------

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
        ranks = self._check_ranks(ranks)
        timeout = self.timeout if timeout is _DEFAULT else _check_timeout(timeout)
        payload = _pack_call(fn, args, kwargs)
        if self._closed:
            raise RuntimeError("this Cluster is closed; create a new one")
        try:
            self._ensure_running()
            self._calls += 1
            return self._call(payload, ranks, timeout)
        except BaseException:
            self._stop_ranks()  # unknown state: start clean on the next run
            raise

    def restart(self) -> None:
        """Stop the ranks and start them again."""
        self._stop_ranks()
        self._ensure_running()

    def close(self) -> None:
        """Stop the ranks and free the port and files. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
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
        if self._pids:
            # an idle rank that died (killed, OOM) shows as a readable socket: EOF
            events = self._sel.select(0)
            if not events:
                return
            dead = self._describe_deaths(events)
            print(f"labkit: {dead}; restarting the ranks", file=sys.stderr)
            self._stop_ranks()
        self._start()

    def _how_ended(self, rank: int, wait: float = 2.0) -> str:
        """'killed by SIGKILL', as the forkserver that reaped the rank saw it."""
        return forkserver.shared().exit_status(self._pids[rank], wait=wait) or "exited"

    def _describe_deaths(self, events) -> str:
        parts = []
        for key, _ in events:
            rank = key.data
            parts.append(f"rank {rank} {self._how_ended(rank)}")
        return ", ".join(parts)

    def _start(self) -> None:
        self._gen += 1
        deadline = time.monotonic() + START_TIMEOUT
        specs = [self._spec(r) for r in range(self.world_size)]
        self._offsets = {}
        pids = forkserver.shared().spawn(specs, deadline)
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

    def _spec(self, rank: int) -> dict:
        pg_timeout = 1800 if self.timeout is None else max(60, 4 * self.timeout)
        return {
            "rank": rank,
            "world_size": self.world_size,
            "gen": self._gen,
            "address": self._listener.getsockname(),
            "port": self.port,
            "backend": self.backend,
            "device": rank,
            "threads": self.threads,
            "init_timeout": START_TIMEOUT,
            "pg_timeout": pg_timeout,
            "out": os.path.join(self._dir, f"rank{rank}.out"),
            "err": os.path.join(self._dir, f"rank{rank}.err"),
            "cwd": os.getcwd(),
            "sys_path": list(sys.path),
            "env": {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(self.world_size),
                "LOCAL_WORLD_SIZE": str(self.world_size),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(self.port),
                # gloo and NCCL open their own sockets: keep them on loopback
                "GLOO_SOCKET_IFNAME": "lo",
                "NCCL_SOCKET_IFNAME": "lo",
                "OMP_NUM_THREADS": str(self.threads),
            },
        }

    def _connect_ranks(self, deadline: float) -> None:
        """Accept each rank's two connections, then wait for its process group."""
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ, ("listener", None))
        ready: set[int] = set()
        try:
            while len(ready) < self.world_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"ranks {sorted(set(range(self.world_size)) - ready)} did not "
                        f"start within {START_TIMEOUT:.0f} s"
                    )
                events = sel.select(min(left, 0.2))
                if not events:
                    self._check_start_deaths()
                for key, _ in events:
                    kind, rank = key.data
                    if kind == "listener":
                        conn, _ = self._listener.accept()
                        sel.register(conn, selectors.EVENT_READ, ("new", None))
                        continue
                    msg = _wire.recv(key.fileobj)
                    sel.unregister(key.fileobj)
                    if kind == "new":
                        self._hello(key.fileobj, msg, sel)
                    elif msg is None:
                        self._check_start_deaths(wait=0.5)
                        raise RuntimeError(f"rank {rank} exited while starting")
                    elif msg[0] == "init-error":
                        raise RuntimeError(
                            f"rank {rank} could not join the process group:\n{msg[1]}"
                        )
                    else:
                        ready.add(rank)
        finally:
            sel.close()
        for r, sock in self._main.items():
            self._sel.register(sock, selectors.EVENT_READ, r)

    def _hello(self, conn: socket.socket, msg, sel) -> None:
        if not msg or msg[0] != "hello" or msg[1] != self._gen:
            conn.close()  # a straggler from an earlier generation
            return
        _, _, rank, kind, _pid = msg
        if kind == "main":
            self._main[rank] = conn
            sel.register(conn, selectors.EVENT_READ, ("main", rank))
        else:
            self._status[rank] = conn

    def _check_start_deaths(self, wait: float = 0.0) -> None:
        for rank, pid in self._pids.items():
            how = forkserver.shared().exit_status(pid, wait=wait)
            if how:
                err = self._read_file(rank, "err", 4000)
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

    # -- calls -------------------------------------------------------------

    def _call(self, payload: bytes, ranks: list[int], timeout: float | None):
        for r in ranks:
            try:
                _wire.send_bytes(self._main[r], payload)
            except OSError:
                pass  # a dead rank: its EOF is reported below
        deadline = None if timeout is None else time.monotonic() + timeout
        pending = set(ranks)
        replies: dict[int, tuple] = {}
        failures: dict[int, dict] = {}
        first_failure = None
        while pending:
            stop = deadline
            if first_failure is not None:
                grace_end = first_failure + GRACE
                stop = grace_end if stop is None else min(stop, grace_end)
            left = None if stop is None else stop - time.monotonic()
            if left is not None and left <= 0:
                break
            for key, _ in self._sel.select(left):
                r = key.data
                data = _wire.recv_bytes(key.fileobj)
                if data is None:
                    self._sel.unregister(key.fileobj)
                    failures[r] = {"died": self._how_ended(r)}
                else:
                    msg = cloudpickle.loads(data)
                    (replies if msg[0] == "ok" else failures)[r] = msg
                pending.discard(r)
                if failures and first_failure is None:
                    first_failure = time.monotonic()
        busy = self._ask_status(sorted(pending)) if pending else {}
        outputs = self._print_outputs(ranks)
        if failures or pending:
            raise self._error(failures, busy, sorted(replies), timeout)
        return RankResults(
            {r: m[2] for r, m in replies.items()},
            outputs,
            {r: m[3] for r, m in replies.items()},
            self.world_size,
        )

    def _ask_status(self, ranks: list[int]) -> dict[int, str]:
        asked = []
        for r in ranks:
            try:
                _wire.send(self._status[r], ("status",))
                asked.append(r)
            except (OSError, KeyError):
                pass
        out = {r: "not answering" for r in ranks}
        end = time.monotonic() + STATUS_TIMEOUT
        for r in asked:
            if select_one(self._status[r], max(0.0, end - time.monotonic()))[0]:
                st = _wire.recv(self._status[r])
                if st is not None:
                    out[r] = describe_busy(st)
        return out

    def _read_file(self, rank: int, stream: str, limit: int = MAX_OUTPUT) -> str:
        path = os.path.join(self._dir, f"rank{rank}.{stream}")
        start = self._offsets.get((rank, stream), 0)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size <= start:
                    return ""
                f.seek(start)
                data = f.read(min(size - start, limit))
        except FileNotFoundError:
            return ""
        self._offsets[(rank, stream)] = size
        text = data.decode(errors="replace")
        if size - start > limit:
            text += f"\n... ({size - start - limit} more bytes in {path})"
        return text

    def _print_outputs(self, ranks: list[int]) -> dict[int, str]:
        """Print what each rank wrote, prefixed by rank, in rank order."""
        width = len(str(self.world_size - 1))
        outputs = {}
        for r in sorted(ranks):
            out, err = self._read_file(r, "out"), self._read_file(r, "err")
            outputs[r] = out
            for text, stream in ((out, sys.stdout), (err, sys.stderr)):
                if text:
                    lines = text.rstrip("\n").split("\n")
                    stream.write("".join(f"[rank {r:>{width}}] {ln}\n" for ln in lines))
        sys.stdout.flush()
        return outputs

    def _error(self, failures, busy, finished, timeout) -> RankError:
        texts, excs = {}, {}
        for r, f in sorted(failures.items()):
            if "died" in f:
                texts[r] = f"rank {r} died: {f['died']}"
                excs[r] = None
                continue
            info = f[2]
            texts[r] = format_remote(info)
            excs[r] = loads_or_none(info["exc"])
        lines = []
        if failures:
            heads = []
            for r, f in sorted(failures.items()):
                heads.append(f"rank {r} " + (f["died"] if "died" in f else
                                             first_line(f[2])))
            lines.append("; ".join(heads))
            for r, t in texts.items():
                lines += ["", f"--- rank {r} ---", t.rstrip()]
        else:
            lines.append(
                f"ranks {sorted(busy)} still busy after {timeout:g} s "
                "(did every rank call the same collectives, in the same order?)"
            )
        if busy or finished:
            lines += ["", "--- the other ranks ---" if failures else "--- ranks ---"]
            for r in sorted([*busy, *finished]):
                lines.append(f"rank {r}: " + (busy[r] if r in busy else "finished"))
        lines += ["", "The ranks were stopped; the next run starts them again."]
        cls = RankError if failures else CollectiveTimeout
        return cls("\n".join(lines), failures=texts, exceptions=excs, busy=busy,
                   finished=finished)

    # -- input checks ------------------------------------------------------

    def _check_ranks(self, ranks) -> list[int]:
        if ranks is None:
            return list(range(self.world_size))
        if isinstance(ranks, int):
            ranks = [ranks]
        ranks = list(ranks)
        bad = [r for r in ranks if not isinstance(r, int) or not
               0 <= r < self.world_size]
        if bad or not ranks or len(set(ranks)) != len(ranks):
            raise ValueError(
                f"ranks must be distinct integers in 0..{self.world_size - 1}, "
                f"got {ranks!r}"
            )
        return sorted(ranks)


def _make_store():
    """A TCPStore for rendezvous, listening on 127.0.0.1 only, on a free port."""
    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(512)
        port = sock.getsockname()[1]
        store = dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=60),
                              wait_for_workers=False, master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the descriptor now and closes it
    return store, port


def _check_world_size(world_size) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be an int, got {type(world_size).__name__}")
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise ValueError(f"world_size must be between 1 and {MAX_WORLD_SIZE}, "
                         f"got {world_size}")
    return world_size


def _check_timeout(timeout) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds or None, got {timeout!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    return float(timeout)


def _pack_call(fn, args, kwargs) -> bytes:
    """Pickle the call once (cloudpickle: notebook functions travel by value)."""
    try:
        return cloudpickle.dumps(("call", None, fn, args, kwargs), protocol=5)
    except Exception as e:  # noqa: BLE001  (find out which piece, and say so)
        err = e
    pieces = [(f"the function {getattr(fn, '__name__', fn)!r}", fn)]
    pieces += [(f"argument {i} ({type(a).__name__})", a) for i, a in enumerate(args)]
    pieces += [(f"keyword argument {k!r} ({type(v).__name__})", v)
               for k, v in kwargs.items()]
    for what, obj in pieces:
        try:
            cloudpickle.dumps(obj, protocol=5)
        except Exception as e:  # noqa: BLE001
            raise TypeError(
                f"{what} cannot be sent to the ranks: {type(e).__name__}: {e}"
            ) from e
    raise TypeError(f"the call cannot be sent to the ranks: {err}") from err



# ------------------------------------------------------------------ defaults


_DEFAULT_CLUSTERS: dict[int, Cluster] = {}


def default_cluster(world_size: int = 4) -> Cluster:
    """The shared cluster for this world size (created on first use)."""
    _check_world_size(world_size)
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
