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
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
shell.run_cell({cell!r}, store_history={history}).raise_error()
import sys
fs = sys.modules.get("labkit.runtime.forkserver")
print(bool(fs and fs.started()))
"""


@pytest.mark.parametrize("history", [True, False])
@pytest.mark.parametrize("cell, starts", [
    ("import labkit", True),  # a chapter's first cell: ranks will follow
    ("import labkit, torch\nfrom labkit import viz", True),
    ("from labkit import theory, Cluster", True),
    ("import labkit.theory", False),  # the calculator alone: no process
    ("from labkit.theory import zero_memory", False),
])
def test_in_a_notebook_the_forkserver_starts_with_the_importing_cell(
        cell, starts, history):
    env = {k: v for k, v in os.environ.items() if k != "LABKIT_PREWARM"}
    code = _CELLS.format(cell=cell, history=history)
    out = subprocess.run([sys.executable, "-c", code],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == str(starts), (
        f"after a cell {cell!r}: forkserver started {out.stdout!r}, "
        f"expected {starts}")


def test_in_a_kernel_the_forkserver_starts_during_the_importing_cell():
    """So its torch import overlaps the kernel's own (`import labkit, torch`)."""
    code = ("from IPython.core.interactiveshell import InteractiveShell\n"
            "shell = InteractiveShell.instance()\n"
            "shell.run_cell('import labkit, sys\\n"
            "during = \"labkit.runtime\" in sys.modules', store_history=True)\n"
            "print(shell.user_ns['during'])\n")
    env = {k: v for k, v in os.environ.items() if k != "LABKIT_PREWARM"}
    out = subprocess.run([sys.executable, "-c", code], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "True", out.stdout
