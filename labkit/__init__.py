"""labkit: the library behind Parallelism Lab.

Real torch.distributed ranks driven from a notebook cell (`Cluster`, `run`,
`%%ranks`), and, in later layers, what they hold and send, measured.
"""

import importlib
import os
import sys

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


# what a cell may import and still start no process (labkit.theory's layers)
PROCESS_FREE = frozenset({"arguments", "conventions", "theory", "units"})


def _prewarm_after_the_importing_cell() -> None:
    """In a notebook, start the rank forkserver (its torch import) as soon as the
    cell that imported labkit ends, so that it is ready by the first cluster cell,
    while the student reads. Not when that cell loaded only the process-free
    layers (`import labkit.theory`), nor with LABKIT_PREWARM=0."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is None or os.environ.get("LABKIT_PREWARM") == "0":
        return

    def after_cell(*_):
        shell.events.unregister("post_run_cell", after_cell)
        loaded = {m.split(".")[1] for m in sys.modules if m.startswith("labkit.")}
        if not loaded or not loaded <= PROCESS_FREE:
            importlib.import_module("labkit.runtime")  # it prewarms in IPython

    shell.events.register("post_run_cell", after_cell)


_prewarm_after_the_importing_cell()

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
