"""labkit.cli.executed: each chapter is executed once per run.

nbval's run keeps the notebook it executed (the plugin), and that copy is the one
`nbconvert --execute --ExecutePreprocessor.store_widget_state=True` (here: nbclient,
which `make book` runs for a stale chapter) would write: the same outputs, cell by
cell, and the same widgets' stored state, the figure an Output widget shows
included. A copy knows what it was executed from: a changed cell, a failed cell
or another labkit make it stale.
"""

import base64
import json
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from labkit.cli import executed

pytestmark = pytest.mark.slow

STATE = "application/vnd.jupyter.widget-state+json"
VIEW = "application/vnd.jupyter.widget-view+json"
PNG = base64.b64decode("iVBORw0KGgo=")  # the first bytes of every PNG file

CELLS = [
    ("markdown", "# A toy chapter", []),
    ("code", "import random\nprint('drawn', random.random() >= 0)\nprint('two')", []),
    ("code", "from IPython.display import display, update_display, clear_output\n"
             "display('first', display_id='d')\nupdate_display('second', "
             "display_id='d')", []),
    ("code", "print('gone')\nclear_output(wait=True)\nprint('kept')", []),
    ("code", "1 / 0", ["raises-exception"]),
    ("code", "from labkit import viz\nviz.ring_stepper(4)", []),  # chapter 02's
    ("code", "{'a': 1}", []),
]


def toy_chapter(folder: Path) -> Path:
    nb = nbformat.v4.new_notebook()
    for kind, text, tags in CELLS:
        make = nbformat.v4.new_code_cell if kind == "code" else \
            nbformat.v4.new_markdown_cell
        nb.cells.append(make(text, metadata={"tags": tags}))
    nb.metadata["kernelspec"] = {"name": "python3", "language": "python",
                                 "display_name": "Python 3"}
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "toy.ipynb"
    nbformat.write(nb, str(path))
    return path


def _nbval(path: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "--nbval-lax", "--nbval-current-env", "-p", "labkit.cli.executed",
         "--executed-to", str(out), str(path)],
        capture_output=True, text=True, timeout=600, cwd=path.parent)


def _outputs(nb: dict) -> list[list[dict]]:
    """Each code cell's outputs, without what differs between two runs by design
    (widget model ids, a traceback's colours, execution counts)."""
    def text(v):
        return "".join(v) if isinstance(v, list) else v

    def clean(o):
        o = {k: v for k, v in o.items() if k not in ("execution_count", "metadata")}
        if "text" in o:
            o["text"] = text(o["text"])
        if "data" in o:
            o["data"] = {k: text(v) for k, v in o["data"].items()}
        if "data" in o and VIEW in o["data"]:
            o["data"] = {**o["data"], VIEW: "a widget view"}
            o["data"].pop("text/plain", None)
        if "traceback" in o:
            o["traceback"] = len(o["traceback"])
        return o
    return [[clean(o) for o in c["outputs"]] for c in nb["cells"]
            if c["cell_type"] == "code"]


def _widgets(nb: dict) -> list[tuple]:
    """The stored widgets by kind, and the first bytes of each Output's figures."""
    state = nb["metadata"]["widgets"][STATE]["state"]
    return sorted((m["model_name"], tuple(
        base64.b64decode(o["data"]["image/png"])[:8]
        for o in m["state"].get("outputs", []) if "image/png" in o.get("data", {})))
        for m in state.values())


def test_nbvals_copy_is_what_nbclient_writes(tmp_path):
    path = toy_chapter(tmp_path)
    run = _nbval(path, tmp_path / "nbval")
    assert run.returncode == 0, run.stdout[-3000:]
    assert "6 passed" in run.stdout, run.stdout[-500:]
    ours = json.loads((tmp_path / "nbval" / "toy.ipynb").read_text())
    theirs = json.loads(executed.execute(path, tmp_path / "nbclient", 60).read_text())

    outs = _outputs(ours)
    assert outs == _outputs(theirs), "nbval's copy and nbclient's differ"
    assert outs[0] == [{"output_type": "stream", "name": "stdout",
                        "text": "drawn True\ntwo\n"}]
    assert outs[1] == [{"output_type": "display_data",
                        "data": {"text/plain": "'second'"}}]  # updated in place
    assert outs[2] == [{"output_type": "stream", "name": "stdout", "text": "kept\n"}]
    assert outs[3][0]["ename"] == "ZeroDivisionError"
    assert _widgets(ours) == _widgets(theirs)
    assert any(figs and figs[0] == PNG for kind, figs in _widgets(ours)
               if kind == "OutputModel"), "the stepper's figure is not stored"
    assert ours["metadata"][executed.KEY]["passed"] is True
    assert executed.current(path, tmp_path / "nbval")
    assert sorted(p.name for p in (tmp_path / "nbval").iterdir()) == ["toy.ipynb"]

    # the copy is stale once a cell changes, and a failing cell is recorded
    nb = json.loads(path.read_text())
    nb["cells"][1]["source"] = "print('changed')"
    path.write_text(json.dumps(nb))
    assert not executed.current(path, tmp_path / "nbval")
    nb["cells"][-1]["source"] = "undefined_name"
    path.write_text(json.dumps(nb))
    run = _nbval(path, tmp_path / "nbval")
    assert run.returncode == 1, run.stdout[-3000:]
    meta = json.loads((tmp_path / "nbval" / "toy.ipynb").read_text())["metadata"]
    assert meta[executed.KEY]["passed"] is False
    assert meta[executed.KEY]["failed_cells"] == [len(CELLS) - 1]
    assert not executed.current(path, tmp_path / "nbval")


def test_the_command_executes_only_what_is_stale(tmp_path, capsys):
    path = toy_chapter(tmp_path)
    assert executed.main([str(tmp_path / "out"), str(path)]) == 0
    said = capsys.readouterr().out
    assert re.search(r"toy.ipynb: executing .* every cell passed", said, re.S), said
    copy = tmp_path / "out" / "toy.ipynb"
    before = copy.stat().st_mtime_ns
    assert executed.main([str(tmp_path / "out"), str(path)]) == 0
    assert "its executed copy is current" in capsys.readouterr().out
    assert copy.stat().st_mtime_ns == before
    with pytest.raises(SystemExit):
        executed.main([str(tmp_path / "out"), str(tmp_path / "nope.ipynb")])
    assert "no such notebook" in capsys.readouterr().err


def test_labkits_source_is_part_of_what_a_copy_was_executed_from(monkeypatch):
    nb = {"cells": [{"cell_type": "code", "source": "x = 1"}]}
    before = executed.fingerprint(nb)
    assert executed.fingerprint({"cells": [{"cell_type": "code",
                                            "source": ["x = 1"]}]}) == before
    monkeypatch.setattr(executed, "_labkit_hash", lambda: "another labkit")
    assert executed.fingerprint(nb) != before
