"""The loop each rank runs, in a process the forkserver forked.

A rank leaves the kernel's session (the kernel's SIGINT never reaches it), exits if
the kernel dies, connects back to its cluster twice over a Unix socket (calls on
one, status requests on the other, answered by a thread even while a call runs),
joins the process group, and runs each Call it is sent.
"""

from __future__ import annotations

import os
import select
import socket
import sys
import threading
import time
import traceback
from dataclasses import replace

from labkit import probe
from labkit.runtime import flight, wire
from labkit.runtime.messages import (
    ROLE_ENV,
    Call,
    Hello,
    Joined,
    JoinFailed,
    Raised,
    RankSpec,
    RemoteError,
    Returned,
    Status,
)
from labkit.runtime.output import RankFiles
from labkit.units import human_bytes

# What this rank is doing, for status requests (what a layer above says it is
# doing, labkit.probe.activity(), is read at the request, never written here).
STATE: dict = {"call": None, "started": 0.0, "bars": 0, "phase": "starting"}


# Namespace shared by the %%ranks cells a rank runs (reset when the rank restarts).
NAMESPACE: dict = {}
# The connection calls arrive on (labkit.progress reports over it).
CONNECTION: dict = {"main": None, "lock": threading.Lock()}


def rank_main(spec: RankSpec, kernel_gone: tuple[int, ...]) -> int:
    """A forked rank's life: its own session and output files, both connections
    to the kernel, the process group joined (JoinFailed, and 1, if that fails),
    then calls served until the end; 0 after a clean end."""
    os.setsid()  # own session: the kernel's SIGINT (sent to its group) never arrives
    os.environ[ROLE_ENV] = "rank"
    os.environ.update(spec.env)
    files = RankFiles(spec.out, spec.err)  # file descriptors 1 and 2, bounded
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    os.chdir(spec.cwd)
    sys.path[:] = list(spec.sys_path)
    threading.Thread(target=_exit_with_kernel, args=(kernel_gone,), daemon=True).start()

    main = _connect(spec, "main")
    status = _connect(spec, "status")
    threading.Thread(
        target=_serve_status, args=(status, threading.get_ident()), daemon=True
    ).start()
    t0 = time.perf_counter()
    STATE["phase"] = "joining the process group"
    try:
        _init_process_group(spec)
    except BaseException as e:  # noqa: BLE001
        wire.send(main, JoinFailed("".join(traceback.format_exception(e))))
        return 1
    wire.send(main, Joined(time.perf_counter() - t0))
    STATE["phase"] = None
    CONNECTION["main"] = main
    _serve_calls(main, spec.rank, spec.world_size, files)
    return 0


def _connect(spec: RankSpec, channel: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(spec.address)
    wire.send(sock, Hello(spec.gen, spec.rank, channel, os.getpid()))
    return sock


def _exit_with_kernel(fds: tuple[int, ...]) -> None:
    if fds:
        select.select(fds, [], [])  # readable = EOF on the lifeline, or the pid exited
        os._exit(0)


def _init_process_group(spec: RankSpec) -> None:
    from datetime import timedelta

    if spec.backend == "gloo":
        # a CPU rank sees no GPU, so code that picks a device for itself (FSDP2's
        # default mesh, DeviceMesh) takes the CPU instead of claiming cuda:<rank>
        # on a machine with fewer GPUs than ranks. Read when CUDA starts, which it
        # has not in this process yet.
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(spec.threads)
    store = dist.TCPStore("127.0.0.1", spec.port, None, False,
                          timeout=timedelta(seconds=spec.init_timeout))
    store = dist.PrefixStore(f"labkit/gen{spec.gen}", store)
    backend = "gloo"
    if spec.backend == "nccl":
        torch.cuda.set_device(spec.rank)
        backend = "cpu:gloo,cuda:nccl"  # CPU tensors keep working beside CUDA ones
    dist.init_process_group(backend, store=store, rank=spec.rank,
                            world_size=spec.world_size,
                            timeout=timedelta(seconds=spec.pg_timeout))


def _serve_calls(main: socket.socket, rank: int, world_size: int,
                 files: RankFiles) -> None:
    import cloudpickle

    while True:
        frame = wire.recv_bytes(main)
        if frame is None:
            return
        files.call_started()
        t0 = time.perf_counter()
        call_id = None
        try:
            STATE.update(started=time.monotonic(), phase="unpickling your function")
            call: Call = cloudpickle.loads(frame)  # may import what the call uses
            call_id = call.call_id
            STATE.update(call=call_id, bars=0, phase=None)
            value = to_cpu(call.fn(rank, world_size, *call.args, **call.kwargs))
            reply = Returned(call_id, value, 0.0)
        except BaseException as e:  # noqa: BLE001  (SystemExit too: report, don't die)
            reply = Raised(call_id, describe_exception(e), 0.0)
        finally:
            STATE.update(call=None, phase=None)
            probe.set_activity(None)
        seconds = time.perf_counter() - t0
        sys.stdout.flush()
        sys.stderr.flush()
        files.call_ended()
        try:
            data = cloudpickle.dumps(replace(reply, seconds=seconds), protocol=5)
        except Exception as e:  # noqa: BLE001
            err = TypeError(f"rank {rank} returned a value that cannot be pickled: {e}")
            data = cloudpickle.dumps(Raised(call_id, describe_exception(err), seconds))
        with CONNECTION["lock"]:
            wire.send_bytes(main, data)


def to_cpu(value):
    """`value` with its CUDA tensors as CPU tensors, so what a rank sends home (to
    the kernel, or to a results file) never needs CUDA to unpickle."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return value
    from torch.utils._pytree import tree_map

    return tree_map(
        lambda x: x.cpu() if isinstance(x, torch.Tensor) and x.is_cuda else x, value
    )


def describe_exception(e: BaseException) -> RemoteError:
    """What the kernel needs to show an exception raised on a rank."""
    import cloudpickle

    te = traceback.TracebackException(type(e), e, e.__traceback__, lookup_lines=False)
    while te.stack and te.stack[0].filename == __file__:
        del te.stack[0]  # our own call frame is noise to a student
    packed = {}
    for key, obj in (("te", te), ("exc", e)):
        try:
            packed[key] = cloudpickle.dumps(obj)
        except Exception:  # noqa: BLE001
            packed[key] = None
    return RemoteError(type(e).__name__, str(e), "".join(te.format()), **packed)


def _serve_status(sock: socket.socket, main_ident: int) -> None:
    while (request := wire.recv(sock)) is not None:
        frame = sys._current_frames().get(main_ident)
        stack = ()
        if frame is not None:
            summary = traceback.StackSummary.extract(
                traceback.walk_stack(frame), lookup_lines=False)
            stack = tuple((f.filename, f.lineno, f.name) for f in reversed(summary)
                          if f.filename != __file__)
        activity = probe.activity() or (_collective_in(frame) if frame else None)
        importing = _importing(frame)
        # let go of the frame before answering: held, it keeps the polled
        # function's locals alive after it returns (the memory ledger would count
        # a finished step's temporaries), and the asker may return at once
        del frame
        call, phase = STATE["call"], STATE["phase"]
        busy = call is not None or phase == "unpickling your function"
        seconds = time.monotonic() - STATE["started"] if busy else 0.0
        collectives = flight.read_recorder() if request.collectives else None
        wire.send(sock, Status(call, activity, stack, seconds, phase, importing,
                               collectives))


def _importing(frame) -> str | None:
    """The module the outermost import in progress loads ('torch.distributed'),
    read from importlib's own frame; None when nothing is being imported."""
    name = None
    while frame is not None:
        if frame.f_code.co_name == "_find_and_load" and \
                frame.f_code.co_filename.startswith("<frozen importlib"):
            name = frame.f_locals.get("name", name)
        frame = frame.f_back
    return name if isinstance(name, str) else None


_PAYLOAD_NAMES = ("tensor", "tensor_list", "output_tensor", "output_tensor_list",
                  "input_tensor", "input_tensor_list", "output", "input")


def _collective_in(frame) -> str | None:
    """'all_reduce of 4.0 MiB' when the innermost frame is a torch.distributed call."""
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    if frame is None or not frame.f_code.co_filename.endswith("distributed_c10d.py"):
        return None
    nbytes = sum(_nbytes(frame.f_locals.get(name)) for name in _PAYLOAD_NAMES)
    size = f" of {human_bytes(nbytes)}" if nbytes else ""
    try:
        import torch.distributed as dist

        n = dist.get_world_size(frame.f_locals.get("group"))
        size += f" (group of {n})"
    except Exception:  # noqa: BLE001  (a description, never a failure)
        pass
    return f"{frame.f_code.co_name}{size}"


def _nbytes(x) -> int:
    if hasattr(x, "element_size") and hasattr(x, "numel"):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(v) for v in x)
    return 0
