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


def _prewarm_in_a_notebook() -> None:
    """In a notebook, start the rank forkserver (its torch import) now, so that it
    imports torch beside the kernel and is ready by the first cluster cell. Not
    when the importing cell loads only the process-free layers (`import
    labkit.theory`), nor with LABKIT_PREWARM=0. Where the cell's text cannot be
    read, once that cell ends, if it loaded more than those layers."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is None or os.environ.get("LABKIT_PREWARM") == "0":
        return
    cell = (shell.user_ns.get("_ih") or [None])[-1]  # stored before it runs
    if isinstance(cell, str) and "labkit" in cell:
        if not _only_process_free(cell):
            importlib.import_module("labkit.runtime")  # it prewarms in IPython
        return

    def after_cell(*_):
        shell.events.unregister("post_run_cell", after_cell)
        loaded = {m.split(".")[1] for m in sys.modules if m.startswith("labkit.")}
        if not loaded or not loaded <= PROCESS_FREE:
            importlib.import_module("labkit.runtime")

    shell.events.register("post_run_cell", after_cell)


def _only_process_free(cell: str) -> bool:
    """Whether every labkit import in `cell` names a process-free layer."""
    import ast

    try:
        tree = ast.parse(cell)
    except SyntaxError:  # IPython syntax (magics): ranks may follow
        return False
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names if a.name.split(".")[0] == "labkit"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (
                node.module or "").split(".")[0] == "labkit":
            names += ([f"labkit.{a.name}" for a in node.names]
                      if node.module == "labkit" else [node.module])
    return bool(names) and all(
        n.count(".") >= 1 and n.split(".")[1] in PROCESS_FREE for n in names)


_prewarm_in_a_notebook()

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
