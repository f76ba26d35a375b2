"""labkit: the library behind Parallelism Lab.

Real torch.distributed ranks driven from a notebook cell (`Cluster`, `run`,
`%%ranks`), and, in later layers, what they hold and send, measured.
"""

from labkit.runtime import forkserver as _forkserver

_forkserver.prewarm()  # the rank forkserver imports torch while this process does too

from labkit.runtime import (  # noqa: E402
    Cluster,
    ClusterClosed,
    CollectiveTimeout,
    RankError,
    RankResults,
    default_cluster,
    progress,
    run,
)

__version__ = "0.1.0"
__all__ = [
    "Cluster",
    "ClusterClosed",
    "CollectiveTimeout",
    "RankError",
    "RankResults",
    "default_cluster",
    "progress",
    "run",
]


def load_ipython_extension(ipython):
    """`%load_ext labkit`: adds the %%ranks cell magic."""
    from labkit.runtime.magics import register

    register(ipython)
