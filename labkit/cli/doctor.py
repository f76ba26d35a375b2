"""`python -m labkit doctor`: what this machine offers, and a smoke test.

Imports the standard library; torch, labkit and labkit.cli.class_size inside
functions."""

from __future__ import annotations

import os
import platform
import sys


def _smoke(rank, world_size):
    import torch
    import torch.distributed as dist

    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x)
    return x.item(), dist.get_backend()


WSL = ("Run the course in WSL2 instead: in PowerShell `wsl --install -d Ubuntu`, "
       "then, inside Ubuntu, `sudo apt install python3-venv make git`, clone the "
       "course and run `make lab` (or `make test`) as the README says; open the "
       "address it prints in the Windows browser.")


def cannot_run_here() -> str | None:
    """Why labkit's ranks cannot start on this platform (what to do instead), or
    None. Asked before anything that would fail deep inside on such a platform."""
    if sys.platform == "win32" or not hasattr(os, "fork") or not hasattr(
            os, "setsid"):
        return (f"labkit starts ranks by forking processes that talk over Unix "
                f"sockets; {platform.system() or sys.platform} has no fork. " + WSL)
    return None


def doctor() -> int:
    """Print the machine's versions, cores, GPUs and class size, then run 2 ranks;
    exit status 1 if they fail, or if this platform cannot run them (said)."""
    print(f"python      {sys.version.split()[0]} ({platform.platform()})")
    why = cannot_run_here()
    if why:
        print(f"platform    cannot run ranks here\n{why}")
        return 1
    import torch

    import labkit
    from labkit.runtime import available_starts, gpu_count, resolve_backend

    gpus = gpu_count()
    start = available_starts()[0]
    print(f"ranks start {start}" + (" (forked from a helper with torch imported)"
                                    if start == "fork" else
                                    " (spares that import torch after the fork)"))
    print(f"torch       {torch.__version__} (CUDA build: {torch.version.cuda or 'no'})")
    print(f"labkit      {labkit.__version__}")
    print(f"cpu cores   {os.cpu_count()}")
    print(f"gpus        {gpus}")
    print(f"backend     auto -> {resolve_backend('auto', 2)} for 2 ranks")
    for i, line in enumerate(_class_size()):
        print(("class size  " if i == 0 else " " * 12) + line)
    print("smoke test  2 ranks, all_reduce of [1] and [2] ...", end=" ", flush=True)
    try:
        with labkit.Cluster(2, timeout=60) as cluster:
            res = cluster.run(_smoke)
    except Exception as e:  # noqa: BLE001  (the doctor reports, it does not crash)
        print(f"FAILED\n{type(e).__name__}: {e}")
        return 1
    sums = [v[0] for v in res]
    if sums != [3.0, 3.0]:
        print(f"FAILED: expected [3.0, 3.0], got {sums}")
        return 1
    print(f"ok ({res[0][1]}: every rank holds 3.0)")
    return 0


def _class_size() -> list[str]:
    """How many students this machine holds, from the footprint figures."""
    from labkit.cli.class_size import class_lines, load_figures, meminfo

    available = meminfo()["MemAvailable"]
    fig, source = load_figures()
    if not fig:
        return ["unknown: run `python -m labkit footprint` to measure it"]
    return class_lines(available, os.cpu_count() or 1, fig, source)
