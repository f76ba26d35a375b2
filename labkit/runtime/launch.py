"""`python -m labkit launch FILE.py:FUNCTION --nproc N`: run a chapter's worker
function under torchrun, unchanged, on a real machine or a cluster.

Imports the standard library; torch and labkit.runtime's backend and results_io
inside functions.

The `fn(rank, world_size, *args)` that `cluster.run` calls is called in every
torchrun process after `init_process_group` (NCCL with one GPU per local rank,
else gloo); rank 0 prints what every rank returned, and `--results DIR` saves it.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import os
import reprlib
import subprocess
import sys
import time
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


def parse_args(words) -> tuple:
    """Command-line words -> fn's extra arguments (literals, else strings)."""
    out = []
    for w in words:
        try:
            out.append(ast.literal_eval(w))
        except (ValueError, SyntaxError):
            out.append(w)
    return tuple(out)


def launch_torchrun(target: str, nproc: int, torchrun_args: list[str], args=(),
           results: str | None = None) -> int:
    """Start torchrun, which starts this module's `_main` in every process."""
    if nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {nproc}")
    load(target)  # fail here, once, rather than in every process
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           *torchrun_args, "-m", "labkit.launch", target, *args]
    if results is not None:
        cmd += ["--results", str(results)]
    if not any(a.startswith(("--rdzv", "--master", "--nnodes")) for a in torchrun_args):
        cmd[3:3] = ["--standalone"]  # one machine: a free local port, no setup
    # torchrun's rendezvous shares its TCP store with the workers and keeps it
    # across --max-restarts: restarted gloo workers read the dead ones' addresses
    # and cannot connect (pytorch/pytorch#135712, seen with torch 2.13); each
    # worker group then hosts a store of its own
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **os.environ}
    return subprocess.call(cmd, env=env)


def _short(value) -> str:
    r = reprlib.Repr()
    r.maxstring, r.maxother, r.maxlist, r.maxdict = 200, 200, 8, 8
    return r.repr(value)


def _init() -> None:
    from labkit.runtime.backend import gpu_count  # counts without starting CUDA

    local = int(os.environ.get("LOCAL_RANK", 0))
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    nccl = gpu_count() >= local_size
    if not nccl:  # a CPU rank sees no GPU (see runtime/rank.py)
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch
    import torch.distributed as dist

    if nccl:
        torch.cuda.set_device(local)  # one GPU per rank on this node
        dist.init_process_group("cpu:gloo,cuda:nccl")  # CPU tensors keep working
    else:
        dist.init_process_group("gloo")


def _main(argv: list[str] | None = None) -> int:
    import torch.distributed as dist

    p = argparse.ArgumentParser(prog="python -m labkit.launch")
    p.add_argument("target", help="FILE.py:FUNCTION or module:FUNCTION")
    p.add_argument("args", nargs="*", help="fn's arguments after (rank, world_size)")
    p.add_argument("--results", default=None,
                   help="folder: every rank writes what fn returned to rank{r}.pt")
    a = p.parse_args(argv)
    args = parse_args(a.args)
    _init()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "") + ":" + os.environ.get(
        "TORCHELASTIC_RESTART_COUNT", "0")
    try:
        fn = load(a.target)
        t0 = time.perf_counter()
        try:
            out = fn(rank, world_size, *args)
        except BaseException as e:
            if a.results is not None:
                from labkit.runtime.results_io import save_rank_result

                save_rank_result(a.results, rank, world_size, error=e,
                                 target=a.target, args=args, run_id=run_id)
            raise
        seconds = time.perf_counter() - t0
        if a.results is not None:
            from labkit.runtime.results_io import save_rank_result

            save_rank_result(a.results, rank, world_size, out, seconds=seconds,
                             target=a.target, args=args, run_id=run_id)
        everyone = [None] * world_size
        dist.all_gather_object(everyone, _short(out))  # printed in rank order, by 0
        if rank == 0:
            for r, text in enumerate(everyone):
                print(f"[rank {r}] {text}", flush=True)
            if a.results is not None:
                print(f"results: {a.results}/rank{{0..{world_size - 1}}}.pt "
                      f"(python -m labkit results {a.results})", flush=True)
        dist.barrier()  # every rank is done with every collective before teardown
    finally:
        dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> None:
    """What each torchrun process runs. After a clean finish it leaves with
    os._exit: gloo's threads can abort the process (SIGABRT) while the interpreter
    shuts down, which torchrun would report as a failed rank and, on several nodes,
    leave the other agents waiting at their exit barrier."""
    code = _main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
