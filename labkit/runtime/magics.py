"""The %%ranks cell magic: run a cell's body on every rank (sugar over `run`).

    %load_ext labkit
    %%ranks -n 4
    x = torch.ones(2) * rank
    dist.all_reduce(x)
    print(x)

`rank`, `world_size`, `torch` and `dist` are bound. `-c NAME` runs on the cluster
held in the notebook variable NAME instead of the shared one of size -n. Each rank
keeps one namespace
for its %%ranks cells, so a later cell sees what an earlier one defined (until the
ranks restart after a failure).
"""

from __future__ import annotations

import argparse
import itertools
import linecache
import shlex

from labkit.runtime.cluster import Cluster, default_cluster

_COUNTER = itertools.count(1)


class CellOnRanks:
    """A cell's source, compiled and run on each rank in the rank's namespace."""

    def __init__(self, source: str, filename: str):
        self.source = source
        self.filename = filename

    def __call__(self, rank: int, world_size: int) -> None:
        import torch
        import torch.distributed as dist

        from labkit.runtime.rank import NAMESPACE

        NAMESPACE.setdefault("__name__", "__ranks__")
        NAMESPACE.update(rank=rank, world_size=world_size, torch=torch, dist=dist)
        exec(compile(self.source, self.filename, "exec"), NAMESPACE)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="%%ranks", add_help=False)
    p.add_argument("-n", "--world-size", type=int, default=4)
    p.add_argument("-t", "--timeout", type=float, default=None)
    p.add_argument("-c", "--cluster", default=None)
    return p


def ranks_magic(line: str, cell: str):
    """%%ranks [-n WORLD_SIZE] [-t TIMEOUT]: run this cell on every rank."""
    try:
        opts = _parser().parse_args(shlex.split(line))
    except SystemExit:
        raise ValueError(
            "usage: %%ranks [-n WORLD_SIZE | -c CLUSTER_VARIABLE] [-t TIMEOUT_SECONDS]"
            f", got {line!r}"
        ) from None
    filename = f"<%%ranks cell {next(_COUNTER)}>"
    # so tracebacks from the ranks show this cell's lines
    linecache.cache[filename] = (len(cell), None, cell.splitlines(True), filename)
    cluster = _named_cluster(opts.cluster) if opts.cluster else default_cluster(
        opts.world_size)
    kwargs = {} if opts.timeout is None else {"timeout": opts.timeout}
    cluster.run(CellOnRanks(cell, filename), **kwargs)


def _named_cluster(name: str) -> Cluster:
    from IPython import get_ipython

    ip = get_ipython()
    obj = ip.user_ns.get(name) if ip is not None else None
    if not isinstance(obj, Cluster):
        raise ValueError(f"%%ranks -c {name}: no labkit.Cluster named {name!r} here")
    return obj


def register(ipython) -> None:
    ipython.register_magic_function(ranks_magic, "cell", "ranks")
