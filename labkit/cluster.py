"""labkit.Cluster: real torch.distributed ranks, started once, driven from a cell.

    cluster = labkit.Cluster(world_size=4)
    res = cluster.run(fn, x)          # fn(rank, world_size, x) on every rank
    res[2], res.values

Ranks are forked from a per-kernel zygote that has torch imported (see worker.py),
join a gloo (CPU) or NCCL (GPU) process group through a TCPStore this process hosts
on 127.0.0.1, and wait for work. Any failure (an exception, a hang past `timeout`,
a dead rank, an interrupt) stops every rank; the next `run` starts them again.
"""

from __future__ import annotations

import atexit
import html
import linecache
import os
import reprlib
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from datetime import timedelta

import cloudpickle

from labkit import _wire
from labkit.worker import ROLE_ENV

MAX_WORLD_SIZE = 64
START_TIMEOUT = 120.0  # first start waits for the zygote's torch import
GRACE = 0.5  # after one rank fails, how long the others get to finish
STATUS_TIMEOUT = 1.0
MAX_OUTPUT = 1 << 20  # bytes of one rank's output shown per call
_DEFAULT = object()


class RankError(RuntimeError):
    """One or more ranks failed. The message has each failed rank's traceback.

    ``failures`` maps rank -> formatted traceback, ``exceptions`` rank -> the
    exception object (None if it could not travel), ``busy`` rank -> what a rank
    still running was doing, ``finished`` the ranks that returned.
    """

    def __init__(self, message, *, failures=None, exceptions=None, busy=None,
                 finished=()):
        super().__init__(message)
        self.failures = dict(failures or {})
        self.exceptions = dict(exceptions or {})
        self.busy = dict(busy or {})
        self.finished = list(finished)

    def _render_traceback_(self):  # IPython shows this instead of labkit's frames
        return [f"{type(self).__name__}: {self}"]


class CollectiveTimeout(RankError, TimeoutError):
    """Some ranks were still busy after `timeout` seconds (usually a collective that
    not every rank called). ``busy`` says where each was waiting."""


# ------------------------------------------------------------------ the zygote


class _Zygote:
    """One forkserver per kernel process, with torch preloaded."""

    def __init__(self):
        lifeline_r, self._lifeline_w = os.pipe()
        mine, theirs = socket.socketpair()
        pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ)
        env[ROLE_ENV] = "zygote"
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (pkg_root, env.get("PYTHONPATH")) if p
        )
        self.log = tempfile.NamedTemporaryFile(prefix="labkit-zygote-", suffix=".log")
        code = "import sys; from labkit.worker import zygote_main; " \
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
        from labkit.worker import PRELOAD_WHEN_IDLE

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


_ZYGOTE: _Zygote | None = None
_ZYGOTE_LOCK = threading.Lock()


def _zygote() -> _Zygote:
    global _ZYGOTE
    with _ZYGOTE_LOCK:
        if _ZYGOTE is None or not _ZYGOTE.alive():
            _ZYGOTE = _Zygote()
        return _ZYGOTE


def prewarm() -> None:
    """Start the rank forkserver now, so its torch import overlaps the kernel's.

    LABKIT_PREWARM=1 always does, =0 never; unset, only inside IPython/Jupyter,
    where `import labkit` is a sign that ranks will follow."""
    if os.environ.get(ROLE_ENV):
        return
    choice = os.environ.get("LABKIT_PREWARM", "auto")
    if choice == "0" or (choice == "auto" and not _in_ipython()):
        return
    _zygote()


def _in_ipython() -> bool:
    ipython = sys.modules.get("IPython")
    return ipython is not None and ipython.get_ipython() is not None


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


class RankResults:
    """What each rank returned, indexable by rank."""

    def __init__(self, values: dict, outputs: dict, seconds: dict, world_size: int):
        self._values = dict(sorted(values.items()))
        self.outputs = dict(sorted(outputs.items()))  # rank -> what it printed
        self.seconds = dict(sorted(seconds.items()))  # rank -> time in fn (a timing)
        self.world_size = world_size

    @property
    def values(self) -> list:
        return list(self._values.values())

    @property
    def ranks(self) -> list[int]:
        return list(self._values)

    def __getitem__(self, rank: int):
        try:
            return self._values[rank]
        except (KeyError, TypeError):
            raise IndexError(
                f"no result for rank {rank!r}: this call ran on ranks {self.ranks}"
            ) from None

    def __iter__(self):
        return iter(self.values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        r = reprlib.Repr()
        r.maxstring, r.maxother = 120, 120
        rows = [f"  rank {k}: {r.repr(v)}" for k, v in self._values.items()]
        return f"RankResults(world_size={self.world_size})\n" + "\n".join(rows)

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{k}</td><td style='text-align:left'><pre style='margin:0'>"
            f"{html.escape(_short(v))}</pre></td></tr>"
            for k, v in self._values.items()
        )
        return (
            f"<table><caption>RankResults, world_size={self.world_size}</caption>"
            "<tr><th>rank</th><th style='text-align:left'>value</th></tr>"
            f"{rows}</table>"
        )


def _short(v, limit: int = 2000) -> str:
    s = repr(v)
    return s if len(s) <= limit else s[:limit] + " …"


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

    def _describe_deaths(self, events) -> str:
        parts = []
        for key, _ in events:
            rank = key.data
            how = _zygote().exit_status(self._pids[rank], wait=0.5) or "exited"
            parts.append(f"rank {rank} {how}")
        return ", ".join(parts)

    def _start(self) -> None:
        self._gen += 1
        deadline = time.monotonic() + START_TIMEOUT
        specs = [self._spec(r) for r in range(self.world_size)]
        self._offsets = {}
        pids = _zygote().spawn(specs, deadline)
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
            how = _zygote().exit_status(pid, wait=wait)
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
                    how = _zygote().exit_status(self._pids[r], wait=0.5) or "exited"
                    failures[r] = {"died": how}
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
                    out[r] = _describe_busy(st)
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
            texts[r] = _format_remote(info)
            excs[r] = _loads_or_none(info["exc"])
        lines = []
        if failures:
            heads = []
            for r, f in sorted(failures.items()):
                heads.append(f"rank {r} " + (f["died"] if "died" in f else
                                             _first_line(f[2])))
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


def _first_line(info: dict) -> str:
    msg = info["message"].strip().split("\n")[0]
    msg = msg if len(msg) <= 100 else msg[:100] + "…"
    return f"raised {info['type']}" + (f": {msg}" if msg else "")


def _loads_or_none(data):
    if data is None:
        return None
    try:
        return cloudpickle.loads(data)
    except Exception:  # noqa: BLE001
        return None


def _format_remote(info: dict) -> str:
    """Format a rank's traceback here, where the notebook's cell sources are."""
    te = _loads_or_none(info["te"])
    if te is None:
        return info["text"]
    try:
        return "".join(te.format())
    except Exception:  # noqa: BLE001
        return info["text"]


_TORCH_DIR = os.sep + "torch" + os.sep


def _describe_busy(status: dict) -> str:
    """'in all_reduce (torch.distributed), called at File ..., line 4: x = ...'"""
    stack = status.get("stack") or []
    if status.get("call") is None and not stack:
        return "idle"
    parts = []
    if status.get("activity"):
        parts.append(f"in {status['activity']} (torch.distributed)")
    # the innermost torch.distributed frame names the collective
    dist_frames = [f for f in stack if _TORCH_DIR + "distributed" in f[0]]
    if dist_frames and not status.get("activity"):
        parts.append(f"in {dist_frames[-1][2]} (torch.distributed)")
    user = [f for f in stack if _TORCH_DIR not in f[0]]
    if user:
        filename, lineno, name = user[-1]
        src = linecache.getline(filename, lineno).strip()
        where = f'File "{filename}", line {lineno}, in {name}'
        parts.append(("called at " if parts else "at ") + where + (f": {src}" if src
                                                                    else ""))
    return ", ".join(parts) or "busy"


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
