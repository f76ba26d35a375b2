"""labkit: the library behind Parallelism Lab.

Real torch.distributed ranks driven from a notebook cell (`Cluster`, `run`,
`%%ranks`), and, in later layers, what they hold and send, measured.
"""

import importlib

# the runtime (ranks, a forkserver that starts with it in a notebook) loads when a
# name of it is first used, or a layer above it is imported: `import labkit.theory`
# or `labkit.units` alone starts no process
_RUNTIME = ("Cluster", "ClusterClosed", "CollectiveTimeout", "RankError",
            "RankResults", "default_cluster", "progress", "run")


_LAYERS = ("runtime", "ledger", "theory", "comm", "parallel", "viz", "checks", "cli")


def __getattr__(name: str):
    if name in _RUNTIME:
        return getattr(importlib.import_module("labkit.runtime"), name)
    if name in _LAYERS:  # `import labkit; labkit.theory.zero_memory(...)`
        return importlib.import_module(f"labkit.{name}")
    raise AttributeError(f"module 'labkit' has no attribute {name!r}")


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
