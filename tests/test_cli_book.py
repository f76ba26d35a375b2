"""make book / make slides: a widget chapter runs through `jupyter nbconvert
--execute` in about the time its cells take, and the page keeps the widgets' state,
the figure a widget shows included."""

import base64
import json
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHAPTER = ROOT / "notebooks" / "02_ring_allreduce.ipynb"  # viz.ring_stepper
TIMEOUT = 60  # per cell; a stalled cell waits all of it
STATE = "application/vnd.jupyter.widget-state+json"
PNG = base64.b64decode("iVBORw0KGgo=")  # the first bytes of every PNG file


def _nbconvert(*args, cwd):
    return subprocess.run([sys.executable, "-m", "nbconvert", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=20 * TIMEOUT)


def _busy_seconds(nb) -> float:
    """Seconds the kernel spent on the code cells (busy to idle, its own clock)."""
    total = 0.0
    for cell in nb["cells"]:
        t = cell["metadata"].get("execution", {})
        if cell["cell_type"] == "code" and t:
            busy, idle = (datetime.fromisoformat(t[k].replace("Z", "+00:00"))
                          for k in ("iopub.status.busy", "iopub.status.idle"))
            total += (idle - busy).total_seconds()
    return total


def _figures(state: dict) -> list[bytes]:
    """The PNG images held by Output widgets in a stored widget state."""
    out = []
    for model in state["state"].values():
        if model["model_name"] == "OutputModel":
            for o in model["state"]["outputs"]:
                if "image/png" in o.get("data", {}):
                    out.append(base64.b64decode(o["data"]["image/png"]))
    return out


@pytest.mark.slow
def test_widget_chapter_executes_without_waiting_out_the_timeout(tmp_path):
    before = sorted(p.name for p in CHAPTER.parent.iterdir())
    start = time.monotonic()
    out = _nbconvert("--to", "notebook", "--execute", "--output-dir", str(tmp_path),
                     f"--ExecutePreprocessor.timeout={TIMEOUT}",
                     "--ExecutePreprocessor.store_widget_state=True", str(CHAPTER),
                     cwd=tmp_path)
    wall = time.monotonic() - start
    assert out.returncode == 0, out.stderr[-3000:]
    assert sorted(p.name for p in CHAPTER.parent.iterdir()) == before  # no output
    nb = json.loads((tmp_path / CHAPTER.name).read_text())

    # Everything beyond the cells' own work (start-up, waiting for replies) is
    # seconds; a cell that waits for a reply it already has costs TIMEOUT.
    busy = _busy_seconds(nb)
    assert 0 < busy < wall
    assert wall - busy < TIMEOUT / 2, (
        f"{wall:.0f} s for {busy:.0f} s of cells: a cell waited out its timeout")

    # The widget's state is stored, with the figure it shows as a PNG.
    state = nb["metadata"]["widgets"][STATE]
    figures = _figures(state)
    assert figures and all(f.startswith(PNG) for f in figures)

    # ... and the book's page carries it.
    page = _nbconvert("--to", "html", "--output-dir", str(tmp_path / "book"),
                      str(tmp_path / CHAPTER.name), cwd=tmp_path)
    assert page.returncode == 0, page.stderr[-3000:]
    html = (tmp_path / "book" / CHAPTER.with_suffix(".html").name).read_text()
    m = re.search(rf'<script type="{re.escape(STATE)}">(.*?)</script>', html, re.S)
    assert m, "no widget state in the page"
    assert _figures(json.loads(m.group(1))) == figures
