"""make book / make slides: a notebook with chapter 02's widget (the ring stepper)
executes as `make book` executes a stale chapter (labkit.cli.executed, nbclient) in
about the time its cells take, and the page keeps the widgets' state, the figure a
widget shows included; with labkit.cli.vendor's options the pages load no script
or style sheet from the network (tests/browser opens them offline)."""

import base64
import json
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import nbformat
import pytest
from traitlets.config.loader import KVArgParseConfigLoader

from labkit.cli import executed, vendor
from tests.test_cli_executed import toy_chapter

ROOT = Path(__file__).resolve().parent.parent
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
    chapter = toy_chapter(tmp_path / "chapters")
    start = time.monotonic()
    copy = executed.execute(chapter, tmp_path / "executed", TIMEOUT)
    wall = time.monotonic() - start
    assert sorted(p.name for p in chapter.parent.iterdir()) == [chapter.name]
    nb = json.loads(copy.read_text())
    assert nb["metadata"][executed.KEY]["passed"], "a cell failed"

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
                      str(copy), cwd=tmp_path)
    assert page.returncode == 0, page.stderr[-3000:]
    html = (tmp_path / "book" / copy.with_suffix(".html").name).read_text()
    m = re.search(rf'<script type="{re.escape(STATE)}">(.*?)</script>', html, re.S)
    assert m, "no widget state in the page"
    assert _figures(json.loads(m.group(1))) == figures


# a script or style sheet the page names, in an attribute or in its own scripts
REMOTE = re.compile(r"""["'](https?://[^"'\s]+\.(?:m?js|css)(?:\?[^"'\s]*)?)["']""")
# the book's template imports mermaid only where a ```mermaid diagram is
MERMAID = "https://cdnjs.cloudflare.com/ajax/libs/mermaid"


def _remote_urls(html: str) -> list[str]:
    return REMOTE.findall(html)


def test_pages_load_nothing_from_the_network(tmp_path):
    from nbconvert import HTMLExporter, SlidesExporter

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# Title\n\n$2\\frac{N-1}{N}M$"),
                nbformat.v4.new_markdown_cell("Down", metadata={
                    "slideshow": {"slide_type": "subslide"}})]
    nb.metadata["widgets"] = {STATE: {"state": {}, "version_major": 2,
                                      "version_minor": 0}}
    vendor.write_template(tmp_path)
    config = KVArgParseConfigLoader(vendor.flags("../vendor", tmp_path)).load_config()
    book, _ = HTMLExporter(config=config).from_notebook_node(nb)
    slides, _ = SlidesExporter(config=config).from_notebook_node(nb)

    assert "../vendor/mathjax/MathJax.js" in book and "../vendor/reveal.js" in slides
    assert _remote_urls(slides) == [], _remote_urls(slides)
    remote = [u for u in _remote_urls(book) if not u.startswith(MERMAID)]
    assert remote == [], remote
    diagrams = [p.name for p in (ROOT / "notebooks").glob("*.ipynb")
                if "```mermaid" in p.read_text(encoding="utf-8")]
    assert not diagrams, f"{diagrams} draw mermaid: add it to labkit/cli/vendor.py"
