"""Rank processes: the zygote that forks them and the loop each rank runs.

A kernel starts one zygote (a fresh ``python`` running ``zygote_main``). The zygote
imports torch once and then forks ranks on request, so a cluster starts in a
fraction of a second after the first. Each rank leaves the kernel's session (the
kernel's SIGINT never reaches it), watches the kernel's pid and exits if the kernel
dies, connects back to its cluster over a Unix socket, joins the process group, and
runs what it is sent.

Messages, kernel -> rank: cloudpickled ``("call", call_id, fn, args, kwargs)``;
rank -> kernel: ``("ok", call_id, value, seconds)`` or ``("error", call_id, info,
seconds)``. A second socket per rank answers ``("status",)`` from a thread with the
main thread's stack, so a busy or hung rank can say what it is doing.
"""

from __future__ import annotations

import importlib
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback

from labkit.runtime import wire as _wire
from labkit.units import human_bytes

ROLE_ENV = "LABKIT_ROLE"  # "zygote" or "rank": importing labkit there starts nothing

# What this rank is doing, for status requests. Ledgers set "activity".
STATE: dict = {"call": None, "activity": None}
# Namespace shared by the %%ranks cells a rank runs (reset when the rank restarts).
NAMESPACE: dict = {}

# Imported by the zygote once it has served a cluster and sat idle for a second, so
# ranks forked later have them for free (the memory ledger pulls in DTensor: ~2 s).
PRELOAD_WHEN_IDLE = ("labkit.ledger", "torch.distributed._tools.mem_tracker")
IDLE_BEFORE_PRELOAD = 1.0

_LIFELINE = -1  # read end of a pipe only the kernel writes to: EOF = kernel gone
_KERNEL_PIDFD = -1  # pidfd of the kernel, where the OS has them


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


# ----------------------------------------------------------------------------- zygote


def zygote_main(ctrl_fd: int, lifeline_fd: int, kernel_pid: int) -> None:
    global _LIFELINE, _KERNEL_PIDFD
    os.environ[ROLE_ENV] = "zygote"
    import cloudpickle  # noqa: F401  (imported once here, inherited by every rank)
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    ctrl = socket.socket(fileno=ctrl_fd)
    _LIFELINE = lifeline_fd
    _KERNEL_PIDFD = _pidfd_open(kernel_pid)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select via wake_w
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    gone = [fd for fd in (_LIFELINE, _KERNEL_PIDFD) if fd >= 0]
    if os.getppid() != kernel_pid:  # the kernel died while we imported torch
        return
    _wire.send(ctrl, ("ready", os.getpid()))
    later = list(PRELOAD_WHEN_IDLE)
    served = False
    while True:
        idle = IDLE_BEFORE_PRELOAD if (served and later) else None
        ready, _, _ = select.select([ctrl, wake_r, *gone], [], [], idle)
        if not ready:  # idle after serving a cluster: import what later ranks use
            name = later.pop(0)
            importlib.import_module(name)
            _wire.send(ctrl, ("preloaded", name))
            continue
        if any(fd in ready for fd in gone):
            return
        if wake_r in ready:
            os.read(wake_r, 4096)
            _reap(ctrl)
        if ctrl in ready:
            msg = _wire.recv(ctrl)
            if msg is None:
                return
            if msg[0] == "spawn":
                sys.stdout.flush()
                sys.stderr.flush()
                keep = (ctrl.fileno(), wake_r, wake_w)
                pids = [_fork_rank(spec, keep) for spec in msg[1]]
                _wire.send(ctrl, ("spawned", pids))
                served = True


def _reap(ctrl: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _wire.send(ctrl, ("exited", pid, describe_status(status)))


def _pidfd_open(pid: int) -> int:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return -1


def _fork_rank(spec: dict, close_fds: tuple[int, ...]) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        for fd in close_fds:
            os.close(fd)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        code = _rank_main(spec)
    except BaseException:  # noqa: BLE001  (whatever happens, report it and leave)
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


# ------------------------------------------------------------------------------- rank


def _rank_main(spec: dict) -> int:
    os.setsid()  # own session: the kernel's SIGINT (sent to its group) never arrives
    os.environ[ROLE_ENV] = "rank"
    os.environ.update(spec["env"])
    for fd, path in ((1, spec["out"]), (2, spec["err"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    os.chdir(spec["cwd"])
    sys.path[:] = spec["sys_path"]
    watched = [fd for fd in (_LIFELINE, _KERNEL_PIDFD) if fd >= 0]
    threading.Thread(target=_exit_with_kernel, args=(watched,), daemon=True).start()

    rank, world_size = spec["rank"], spec["world_size"]
    main = _connect(spec, "main")
    status = _connect(spec, "status")
    threading.Thread(
        target=_serve_status, args=(status, threading.get_ident()), daemon=True
    ).start()

    t0 = time.perf_counter()
    try:
        _init_process_group(spec)
    except BaseException as e:  # noqa: BLE001
        _wire.send(main, ("init-error", "".join(traceback.format_exception(e))))
        return 1
    _wire.send(main, ("ready", time.perf_counter() - t0))
    _serve_calls(main, rank, world_size)
    return 0


def _connect(spec: dict, kind: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(spec["address"])
    _wire.send(sock, ("hello", spec["gen"], spec["rank"], kind, os.getpid()))
    return sock


def _exit_with_kernel(fds: list[int]) -> None:
    if fds:
        select.select(fds, [], [])  # readable = EOF on the lifeline, or the pid exited
        os._exit(0)


def _init_process_group(spec: dict) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(spec["threads"])
    store = dist.TCPStore(
        "127.0.0.1",
        spec["port"],
        None,
        False,
        timeout=timedelta(seconds=spec["init_timeout"]),
    )
    store = dist.PrefixStore(f"labkit/gen{spec['gen']}", store)
    backend = "gloo"
    if spec["backend"] == "nccl":
        torch.cuda.set_device(spec["device"])
        backend = "cpu:gloo,cuda:nccl"  # CPU tensors keep working beside CUDA ones
    dist.init_process_group(
        backend,
        store=store,
        rank=spec["rank"],
        world_size=spec["world_size"],
        timeout=timedelta(seconds=spec["pg_timeout"]),
    )


def _serve_calls(main: socket.socket, rank: int, world_size: int) -> None:
    import cloudpickle

    while True:
        frame = _wire.recv_bytes(main)
        if frame is None:
            return
        t0 = time.perf_counter()
        call_id = None
        try:
            _, call_id, fn, args, kwargs = cloudpickle.loads(frame)
            STATE["call"] = call_id
            reply = ("ok", call_id, _to_cpu(fn(rank, world_size, *args, **kwargs)))
        except BaseException as e:  # noqa: BLE001  (SystemExit too: report, don't die)
            reply = ("error", call_id, describe_exception(e))
        finally:
            STATE["call"] = STATE["activity"] = None
        reply += (time.perf_counter() - t0,)
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            data = cloudpickle.dumps(reply, protocol=5)
        except Exception as e:  # noqa: BLE001
            err = TypeError(f"rank {rank} returned a value that cannot be pickled: {e}")
            data = cloudpickle.dumps(
                ("error", call_id, describe_exception(err), reply[-1]))
        _wire.send_bytes(main, data)


def _to_cpu(value):
    """CUDA tensors come back as CPU tensors, so the kernel never touches CUDA."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return value
    from torch.utils._pytree import tree_map

    return tree_map(
        lambda x: x.cpu() if isinstance(x, torch.Tensor) and x.is_cuda else x, value
    )


def describe_exception(e: BaseException) -> dict:
    """What the kernel needs to show an exception raised on a rank.

    The traceback is pickled before any source line is looked up, so the kernel,
    which holds the notebook's cell sources in its linecache, fills them in.
    """
    import cloudpickle

    te = traceback.TracebackException(type(e), e, e.__traceback__, lookup_lines=False)
    while te.stack and te.stack[0].filename == __file__:
        del te.stack[0]  # our own call frame is noise to a student
    info = {"type": type(e).__name__, "message": str(e), "te": None, "exc": None}
    try:
        info["te"] = cloudpickle.dumps(te)
    except Exception:  # noqa: BLE001
        pass
    try:
        info["exc"] = cloudpickle.dumps(e)
    except Exception:  # noqa: BLE001
        pass
    info["text"] = "".join(te.format())  # rank-side fallback
    return info


def _serve_status(sock: socket.socket, main_ident: int) -> None:
    while _wire.recv(sock) is not None:
        frame = sys._current_frames().get(main_ident)
        stack = []
        if frame is not None:
            summary = traceback.StackSummary.extract(
                traceback.walk_stack(frame), lookup_lines=False
            )
            stack = [
                (f.filename, f.lineno, f.name)
                for f in reversed(summary)
                if f.filename != __file__
            ]
        activity = STATE["activity"] or (_collective_in(frame) if frame else None)
        _wire.send(sock, {"call": STATE["call"], "activity": activity, "stack": stack})


_PAYLOAD_NAMES = ("tensor", "tensor_list", "output_tensor", "output_tensor_list",
                  "input_tensor", "input_tensor_list", "output", "input")


def _collective_in(frame) -> str | None:
    """'all_reduce of 4.0 MiB' when the innermost frame is a torch.distributed call."""
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    if frame is None or not frame.f_code.co_filename.endswith("distributed_c10d.py"):
        return None
    nbytes = 0
    for name in _PAYLOAD_NAMES:
        nbytes += _nbytes(frame.f_locals.get(name))
    size = f" of {human_bytes(nbytes)}" if nbytes else ""
    return f"{frame.f_code.co_name}{size}"


def _nbytes(x) -> int:
    if hasattr(x, "element_size") and hasattr(x, "numel"):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(v) for v in x)
    return 0
