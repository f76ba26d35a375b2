"""What a cluster runs on: the backend (gloo on CPU, NCCL with one GPU per rank),
the TCPStore its ranks meet at, and the checks on what a student passes in."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from datetime import timedelta

from labkit.arguments import whole
from labkit.runtime.timeouts import DEFAULT, check_seconds

MAX_WORLD_SIZE = 64

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
                    capture_output=True, text=True, timeout=DEFAULT.start,
                )
                n = int(out.stdout.strip() or 0)
            _GPU_COUNT = n
    return _GPU_COUNT


def resolve_backend(backend: str, world_size: int, gpus: int | None = None) -> str:
    """"auto" -> "nccl" when there is one GPU per rank, else "gloo"."""
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', not {backend!r}")
    if backend == "gloo":
        return "gloo"
    gpus = gpu_count() if gpus is None else gpus
    if backend == "nccl" and gpus < world_size:
        raise ValueError(
            f"backend='nccl' needs one GPU per rank: world_size={world_size} but "
            f"{gpus} CUDA device(s) are visible. Use backend='gloo' (CPU) or fewer "
            "ranks."
        )
    return "nccl" if gpus >= world_size else "gloo"


def make_store(timeout: float = DEFAULT.store):
    """A TCPStore for rendezvous, listening on 127.0.0.1 only, on a free port."""
    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(512)
        port = sock.getsockname()[1]
        store = dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=timeout),
                              wait_for_workers=False, master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the descriptor now and closes it
    return store, port


def check_world_size(world_size) -> int:
    return whole(world_size, "world_size", 1, MAX_WORLD_SIZE)


THREADS_ENV = "LABKIT_THREADS"  # torch threads per rank, for a whole server
MAX_THREADS = 1024


def rank_threads(given, world_size: int) -> int:
    """Torch threads per rank: `given`, else $LABKIT_THREADS, else the cores this
    process may run on (its CPU affinity) shared among the ranks, at least 1."""
    where = "threads"
    allowed = f"an integer in [1, {MAX_THREADS}]"
    if given is None and os.environ.get(THREADS_ENV):
        given, where = os.environ[THREADS_ENV], f"${THREADS_ENV}"
        try:
            given = int(given)
        except ValueError:
            raise ValueError(f"{where} must be {allowed}, got {given!r}") from None
    if given is None:
        cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                 else os.cpu_count() or 1)
        return max(1, cores // world_size)
    return whole(given, where, 1, MAX_THREADS)


def check_timeout(timeout, name: str = "timeout", none: str = "no limit"
                  ) -> float | None:
    """Seconds, or None (`none` says what None means there); the error names
    `name`, the argument or variable the value came from."""
    return check_seconds(timeout, name, none=none)


def check_ranks(ranks, world_size: int) -> list[int]:
    """None -> every rank; an int or a list of distinct ranks -> sorted list."""
    if ranks is None:
        return list(range(world_size))
    if isinstance(ranks, int):
        ranks = [ranks]
    ranks = list(ranks)
    bad = [r for r in ranks if not isinstance(r, int) or not 0 <= r < world_size]
    if bad or not ranks or len(set(ranks)) != len(ranks):
        raise ValueError(f"ranks must be distinct integers in 0..{world_size - 1}, "
                         f"got {ranks!r}")
    return sorted(ranks)
