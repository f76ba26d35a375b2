"""`python -m labkit launch FILE.py:FUNCTION --nproc N`: run a chapter's worker
function under torchrun, unchanged, on a real machine or a cluster.

The same `fn(rank, world_size)` that `cluster.run` calls in a notebook is called
here in every torchrun process, after `init_process_group` (NCCL with one GPU per
local rank, else gloo). Rank 0 prints what every rank's `fn` returned, in rank
order.
Extra torchrun options (--nnodes, --rdzv-endpoint, ...) go after `--torchrun`.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path


def load(target: str):
    """'path/to/file.py:fn' or 'package.module:fn' -> the function."""
    where, sep, name = target.rpartition(":")
    if not sep or not where or not name:
        raise ValueError(
            f"expected FILE.py:FUNCTION or module:FUNCTION, got {target!r}")
    if where.endswith(".py"):
        path = Path(where).resolve()
        if not path.exists():
            raise ValueError(f"no such file: {where}")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(path.parent))
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"{where} has no function {name!r}")
    return fn


def launch(target: str, nproc: int, torchrun_args: list[str]) -> int:
    """Start torchrun, which starts this module's `_main` in every process."""
    if nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {nproc}")
    load(target)  # fail here, once, rather than in every process
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           *torchrun_args, "-m", "labkit.runtime.launch", target]
    if not any(a.startswith(("--rdzv", "--master", "--nnodes")) for a in torchrun_args):
        cmd[3:3] = ["--standalone"]  # one machine: a free local port, no setup
    return subprocess.call(cmd)


def _main(target: str) -> int:
    import torch
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", 0))
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_size:
        torch.cuda.set_device(local)
        dist.init_process_group("cpu:gloo,cuda:nccl")
    else:
        dist.init_process_group("gloo")
    try:
        fn = load(target)
        out = fn(dist.get_rank(), dist.get_world_size())
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, out)  # printed in rank order, by rank 0
        if dist.get_rank() == 0:
            for r, value in enumerate(everyone):
                print(f"[rank {r}] {value!r}", flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1]))
