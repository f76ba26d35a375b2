"""The layers hold by construction: `make lint` runs import-linter's contract (in
pyproject.toml: runtime below ledger and theory, below comm and parallel, below viz,
checks and cli), and importing a layer loads nothing above it: the calculator
(`labkit.theory`) starts no rank process, even in a notebook."""

import os
import subprocess
import sys

import pytest


def _loaded(code: str) -> list[str]:
    env = {**os.environ, "LABKIT_PREWARM": "1"}  # as in a notebook: prewarm on
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys\nprint(sorted("
                          "m for m in sys.modules if m.startswith('labkit')))"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return eval(out.stdout.splitlines()[-1])


@pytest.mark.parametrize("module", ["labkit.theory", "labkit.units",
                                    "labkit.conventions"])
def test_importing_a_layer_loads_no_runtime(module):
    runtime = [m for m in _loaded(f"import {module}")
               if m.startswith("labkit.runtime")]
    assert not runtime, f"import {module} loaded {runtime}; no runtime expected"


def test_runtime_names_load_on_first_use():
    mods = _loaded("import labkit\nassert 'labkit.runtime' not in "
                   "__import__('sys').modules\nlabkit.Cluster")
    assert "labkit.runtime.cluster" in mods, mods
    with pytest.raises(AttributeError, match="no attribute 'Clustr'"):
        import labkit

        labkit.Clustr  # noqa: B018


# a cell run as a kernel runs it (store_history: its text is kept before it runs;
# without it, labkit looks once the cell has ended)
_CELLS = """
import sys
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
shell.run_cell({cell!r} + "\\nimport sys\\nduring = 'labkit.runtime' in sys.modules",
               store_history={history}).raise_error()
fs = sys.modules.get("labkit.runtime.forkserver")
print(shell.user_ns["during"], bool(fs and fs.started()))
"""


@pytest.mark.parametrize("history", [True, False])
@pytest.mark.parametrize("cell, starts", [
    ("import labkit, torch", True),  # a chapter's first cell: ranks will follow
    ("import labkit.theory", False),  # the calculator alone: no process
])
def test_in_a_notebook_the_forkserver_starts_with_the_importing_cell(
        cell, starts, history):
    """Started during the cell when its text can be read (so its torch import
    overlaps the kernel's own), else once the cell has ended; never for the
    process-free layers alone."""
    env = {k: v for k, v in os.environ.items() if k != "LABKIT_PREWARM"}
    code = _CELLS.format(cell=cell, history=history)
    out = subprocess.run([sys.executable, "-c", code],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    during, after = out.stdout.strip().splitlines()[-1].split()
    assert (during, after) == (str(starts and history), str(starts)), (
        f"after a cell {cell!r} (its text kept: {history}): forkserver started "
        f"during the cell {during}, by its end {after}; expected "
        f"{starts and history}, {starts}")


@pytest.mark.parametrize("cell, free", [
    ("import labkit", False), ("import labkit, torch\nfrom labkit import viz", False),
    ("from labkit import theory, Cluster", False), ("%load_ext labkit", False),
    ("get_ipython().run_line_magic('load_ext', 'labkit')", False),
    ("import labkit.theory", True), ("from labkit import theory", True),
    ("from labkit.theory import zero_memory", True),
    ("import labkit.theory as t, labkit.units", True)])
def test_which_cells_import_only_the_process_free_layers(cell, free):
    import labkit

    assert labkit._only_process_free(cell) is free, cell
