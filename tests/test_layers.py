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


_CELLS = """
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
shell.run_cell({cell!r}).raise_error()
import sys
fs = sys.modules.get("labkit.runtime.forkserver")
print(bool(fs and fs.started()))
"""


@pytest.mark.parametrize("cell, starts", [
    ("import labkit", True),  # a chapter's first cell: ranks will follow
    ("import labkit, torch\nfrom labkit import viz", True),
    ("import labkit.theory", False),  # the calculator alone: no process
])
def test_in_a_notebook_the_forkserver_starts_once_the_importing_cell_ends(
        cell, starts):
    env = {k: v for k, v in os.environ.items() if k != "LABKIT_PREWARM"}
    out = subprocess.run([sys.executable, "-c", _CELLS.format(cell=cell)],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == str(starts), (
        f"after a cell {cell!r}: forkserver started {out.stdout!r}, "
        f"expected {starts}")
