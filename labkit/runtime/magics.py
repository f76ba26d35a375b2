"""The %%ranks cell magic: a cell's body run on every rank (sugar over `run`).

Imports labkit.runtime.cluster; IPython only inside functions, since every rank
imports this module to unpickle a CellOnRanks.

`%load_ext labkit`, then `%%ranks -n 4` (the shared cluster) or `%%ranks -c NAME`
(the labkit.Cluster in variable NAME) atop a cell: `rank`, `world_size`, `torch`
and `dist` are bound, and each rank keeps one namespace for its %%ranks cells.
"""

from __future__ import annotations

import itertools
import linecache

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


def ranks_magic(line: str, cell: str):
    """Run this cell on every rank, with `rank`, `world_size`, `torch` and `dist`."""
    from IPython.core.error import UsageError
    from IPython.core.magic_arguments import parse_argstring

    _declare_options()
    try:
        opts = parse_argstring(ranks_magic, line)
    except UsageError as e:  # one line in a notebook, no traceback
        usage = ranks_magic.parser.format_usage().removeprefix("::").strip()
        raise UsageError(f"usage: {usage}, got {line!r} ({e})") from None
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


def _declare_options() -> None:
    """ranks_magic's options, once, as IPython's @magic_arguments and @argument
    declare them (so `%%ranks?` shows them): applied here, on first use."""
    from IPython.core.magic_arguments import argument, magic_arguments

    if hasattr(ranks_magic, "parser"):
        return
    for declare in (  # bottom up, as decorators apply
        argument("-c", "--cluster", metavar="CLUSTER_VARIABLE",
                 help="run on the labkit.Cluster in this notebook variable"),
        argument("-t", "--timeout", type=float, metavar="TIMEOUT_SECONDS",
                 help="seconds the cell may run (default: the cluster's timeout)"),
        argument("-n", "--world-size", type=int, default=4,
                 help="ranks of the shared cluster, without -c (default 4)"),
        magic_arguments(name="%ranks"),  # IPython's usage line adds one more %
    ):
        declare(ranks_magic)


def register(ipython) -> None:
    _declare_options()
    ipython.register_magic_function(ranks_magic, "cell", "ranks")
