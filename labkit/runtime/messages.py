"""Every message between the kernel, the forkserver and the ranks: one class each.

    kernel -> forkserver   Spawn, Preload, Retire
    forkserver -> kernel   ForkserverReady, Spawned, RankExited, Successor
    rank -> kernel         Hello first on both connections; main: Joined or
                           JoinFailed, Progress, Returned or Raised; status: Status
    kernel -> rank         Call (main connection), StatusRequest (status one)

Standard library only, so the forkserver reads them before it has imported torch;
a Call and its answer travel with cloudpickle, the rest as plain pickle.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ROLE_ENV = "LABKIT_ROLE"  # "forkserver" or "rank": there, importing labkit starts no
# forkserver


@dataclass(frozen=True)
class RankSpec:
    """All a forked process needs to become rank `rank` of generation `gen`."""

    rank: int
    world_size: int
    gen: int  # the cluster's start count: stragglers of an older start are refused
    address: str  # the cluster's Unix socket
    port: int  # the TCPStore's port on 127.0.0.1
    backend: str  # "gloo" or "nccl"
    threads: int
    init_timeout: float
    pg_timeout: float
    out: str  # file the rank's stdout goes to
    err: str  # file the rank's stderr goes to
    cwd: str
    sys_path: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)


# -- kernel <-> forkserver -----------------------------------------------------


@dataclass(frozen=True)
class Spawn:
    specs: tuple[RankSpec, ...]


@dataclass(frozen=True)
class ForkserverReady:
    pid: int
    preloaded: tuple[str, ...] = ()  # of the modules asked for, those imported


@dataclass(frozen=True)
class Preload:
    """Modules for the forkserver to have imported before it forks ranks
    (forkserver.wanted(): a module above the runtime says PRELOAD_IN_RANKS)."""

    names: tuple[str, ...]


@dataclass(frozen=True)
class Spawned:
    pids: tuple[int, ...]


@dataclass(frozen=True)
class RankExited:
    pid: int
    how: str  # "exited with code 1", "killed by SIGKILL"


@dataclass(frozen=True)
class Successor:
    """A forked copy of the forkserver is importing more; its connection (a file
    descriptor) follows this message as ancillary data. It says ForkserverReady
    on that connection when it can take over."""

    pid: int


@dataclass(frozen=True)
class Retire:
    """Kernel -> a forkserver that handed over: its successor forks from now on.
    It exits once every rank it forked has exited (and it has reported each)."""


# -- rank -> kernel, main connection -----------------------------------------


@dataclass(frozen=True)
class Hello:
    gen: int
    rank: int
    channel: str  # "main" or "status"
    pid: int


@dataclass(frozen=True)
class Joined:
    seconds: float  # init_process_group took this long


@dataclass(frozen=True)
class JoinFailed:
    traceback: str


@dataclass(frozen=True)
class Call:
    call_id: int
    fn: object
    args: tuple
    kwargs: dict


@dataclass(frozen=True)
class RemoteError:
    """An exception raised on a rank, ready to be shown in the kernel: its
    traceback pickled before source lines were looked up (`te`), so that the
    kernel, which has the notebook's cell sources, fills them in."""

    type: str
    message: str
    text: str  # formatted on the rank: the fallback
    te: bytes | None = None  # cloudpickled traceback.TracebackException
    exc: bytes | None = None  # cloudpickled exception, where it pickles


@dataclass(frozen=True)
class Returned:
    call_id: int
    value: object
    seconds: float


@dataclass(frozen=True)
class Raised:
    call_id: int | None
    error: RemoteError
    seconds: float


@dataclass(frozen=True)
class Progress:
    """A progress bar on a rank moved (labkit.progress)."""

    call_id: int
    bar: int  # which bar of this call, in the order the rank opened them
    desc: str
    n: int
    total: int | None
    elapsed: float
    done: bool = False


# -- status connection --------------------------------------------------------


@dataclass(frozen=True)
class StatusRequest:
    collectives: bool = False  # the rank's flight recorder too (after a timeout)


@dataclass(frozen=True)
class Status:
    call_id: int | None
    activity: str | None  # "all_reduce of 1.0 MiB (group of 4)", when inside one
    stack: tuple[tuple[str, int, str], ...]  # (file, line, function), outermost first
    seconds: float = 0.0  # how long the current call has run
    phase: str | None = None  # "joining the process group", "unpickling your function"
    importing: str | None = None  # the module an import in progress is loading
    collectives: dict | None = None  # group id -> flight.GroupLog, when asked
