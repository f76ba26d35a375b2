"""`make book`: one site from the executed chapters, read without a network.

`python -m labkit.cli.site EXECUTED OUT` writes a Sphinx project (MyST-NB, the
engine of Jupyter Book 1, with sphinx-book-theme) beside OUT and builds it into
OUT: an index page saying what the course is with the chapter list, the table of
contents in the sidebar, previous/next links, Sphinx's search, math, figures and
the widgets' stored state. Chapters are taken as they are (outputs included,
nothing executed here); scripts come from _build/vendor (labkit/cli/vendor.py).

Jupyter Book 2 (MyST's own site) is not used: its sites show a placeholder where
an ipywidget is, not the widget from its stored state (jupyter-book/myst-theme
issue 428, open), and the course's figures live in widgets."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MATHJAX = "mathjax/MathJax.js?config=TeX-AMS_CHTML-full,Safe"  # under _static/

CONF = """\
project = "Parallelism Lab"
extensions = ["myst_nb"]
nb_execution_mode = "off"  # the chapters come executed, widgets' state included
myst_enable_extensions = ["dollarmath", "amsmath"]
html_theme = "sphinx_book_theme"
html_title = "Parallelism Lab"
html_static_path = [{vendor!r}]  # reveal.js, MathJax, require.js, widgets
html_theme_options = {{"show_navbar_depth": 1, "home_page_in_toc": True}}
mathjax_path = {mathjax!r}
# MyST-NB marks a chapter's text "ignore" and its formulas' spans "math"
mathjax2_config = {{"tex2jax": {{"processClass": "tex2jax_process|math|output_area"}}}}
nb_ipywidgets_js = {{"requirejs/require.js": {{}},
                     "html-manager/dist/embed-amd.js": {{}}}}
exclude_patterns = ["_build"]
suppress_warnings = ["mystnb.unknown_mime_type", "myst.header"]
"""

INDEX = """\
# Parallelism Lab

A hands-on course on how large models are trained across many devices. Each
chapter starts real `torch.distributed` ranks from inside the notebook, lets them
exchange real tensors, measures what every rank holds and sends, and checks each
measured number against its formula. The pages below are the chapters as they
ran when this site was built, outputs and widgets included; to run them
yourself, `make lab` opens them in JupyterLab.

```{{toctree}}
:maxdepth: 1
:caption: Chapters

{chapters}
```
"""


def title(nb_path: Path) -> str:
    """The chapter's first heading, without its leading #."""
    cells = json.loads(nb_path.read_text(encoding="utf-8"))["cells"]
    first = "".join(cells[0]["source"]).splitlines()[0]
    return first.lstrip("#").strip()


def write_project(executed: Path, src: Path, vendor: Path) -> list[str]:
    """The Sphinx project in src: conf.py, index.md, notebooks/, images/."""
    shutil.rmtree(src, ignore_errors=True)
    (src / "notebooks").mkdir(parents=True)
    shutil.copytree(ROOT / "images", src / "images")  # chapters link ../images
    names = []
    for nb in sorted(executed.glob("*.ipynb")):
        shutil.copy(nb, src / "notebooks" / nb.name)
        names.append(f"notebooks/{nb.stem}")
    (src / "conf.py").write_text(CONF.format(vendor=str(vendor.resolve()),
                                             mathjax=MATHJAX))
    (src / "index.md").write_text(INDEX.format(chapters="\n".join(names)))
    return names


def build(executed: Path, out: Path, vendor: Path) -> None:
    src = out.parent / f"{out.name}-src"
    write_project(executed, src, vendor)
    shutil.rmtree(out, ignore_errors=True)
    run = subprocess.run([sys.executable, "-m", "sphinx", "-q", "-b", "html",
                          "-d", str(src / ".doctrees"), str(src), str(out)],
                         capture_output=True, text=True, check=False)
    if run.returncode:
        raise SystemExit(f"sphinx-build failed:\n{run.stderr[-3000:]}")
    # the widget renderer looks for its icon fonts under the page's folder, at
    # the path of the module that asks for them
    for fonts in ("@jupyter-widgets", "@jupyter-widgets/html-manager/dist"):
        (out / "notebooks" / fonts).mkdir(parents=True, exist_ok=True)
        for f in (out / "_static" / "html-manager" / "dist").iterdir():
            if f.suffix in (".woff", ".woff2", ".ttf"):
                shutil.copy(f, out / "notebooks" / fonts / f.name)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    executed, out = Path(args[0]), Path(args[1])
    vendor = Path(args[2]) if len(args) > 2 else Path("_build/vendor")
    build(executed, out, vendor)
    print(f"{out / 'index.html'}: {len(list(executed.glob('*.ipynb')))} chapters")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
