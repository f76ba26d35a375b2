"""Notebooks are committed clean (no outputs, no execution counts) and written as
JupyterLab saves them, so a save in JupyterLab changes nothing: `as_saved`.
Imports nbformat, ipykernel (the kernel's language_info) and cli.atomic."""

from __future__ import annotations

import ast
import json
from pathlib import Path

from labkit.cli import atomic

# markdown a chapter means for the speaker, not the screen (reveal.js's notes)
NOTES = "notes"


def as_saved(nb: dict) -> str:
    """The text JupyterLab's server writes for `nb`: nbformat's (keys sorted, one
    space a level, each source a list of lines), ending in a newline."""
    import nbformat

    return nbformat.writes(nbformat.from_dict(nb)) + "\n"


def language_info(meta: dict) -> dict:
    """`meta`'s language_info completed with the fields the kernel reports when
    JupyterLab opens the notebook (an existing Python version is kept)."""
    from ipykernel.ipkernel import IPythonKernel

    return {**IPythonKernel.language_info, **meta.get("language_info", {})}


def kernelspec() -> dict:
    """The kernelspec JupyterLab writes for ipykernel's Python kernel."""
    from ipykernel.kernelspec import KERNEL_NAME, get_kernel_dict

    spec = get_kernel_dict()
    return {"display_name": spec["display_name"], "language": spec["language"],
            "name": KERNEL_NAME}


def dirty_cells(path: str | Path) -> list[int]:
    """Indices of code cells that carry outputs or an execution count."""
    nb = json.loads(Path(path).read_text(encoding="utf-8"))
    return [
        i
        for i, c in enumerate(nb.get("cells", []))
        if c.get("cell_type") == "code"
        and (c.get("outputs") or c.get("execution_count"))
    ]


def clean(path: str | Path) -> bool:
    """Strip outputs and execution counts in place; True if the file changed."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    nb = json.loads(text)
    for c in nb.get("cells", []):
        if c.get("cell_type") == "code":
            c["outputs"] = []
            c["execution_count"] = None
        c.get("metadata", {}).pop("execution", None)
    meta = nb.setdefault("metadata", {})
    meta["language_info"] = language_info(meta)
    meta["kernelspec"] = kernelspec()
    new = as_saved(nb)
    if new != text:
        atomic.write_text(path, new)  # a chapter, rewritten in place
        return True
    return False


def off_screen(code: str) -> bool:
    """Code a lecture's deck need not show: every top-level statement an import,
    an assert, a check_...() call or a .close() (set-up, a chapter's claims
    checked, an exercise's grading, clean-up). Code Python cannot read (a %%ranks
    cell) stays on screen."""
    try:
        body = ast.parse(code).body
    except SyntaxError:
        return False

    def quiet(node) -> bool:
        if isinstance(node, (ast.Import, ast.ImportFrom, ast.Assert)):
            return True
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            f = node.value.func
            name = f.id if isinstance(f, ast.Name) else (
                f.attr if isinstance(f, ast.Attribute) else "")
            return name.startswith("check_") or name == "close"
        return False

    return bool(body) and all(quiet(node) for node in body)


def slide_type(cell: dict) -> str:
    """Reveal.js slides from a chapter, as RISE shows them live in JupyterLab:
    each heading starts a slide, each code cell is a sub-slide below it (so long
    outputs get room; every cell stays, for a slideshow that runs them), other
    text stays put, markdown tagged `notes` is the speaker's."""
    source = "".join(cell.get("source", ""))
    if cell.get("cell_type") == "markdown":
        if NOTES in cell.get("metadata", {}).get("tags", []):
            return "notes"
        return "slide" if source.lstrip().startswith("#") else "-"
    return "subslide" if cell.get("cell_type") == "code" else "-"


def deck_slide_type(cell: dict) -> str:
    """A static deck's (`make slides`, outputs already there): as slide_type, less
    the solutions and the code that is only set-up, asserts, checks or clean-up
    (off_screen)."""
    if cell.get("cell_type") == "code" and (
            "solution" in cell.get("metadata", {}).get("tags", [])
            or off_screen("".join(cell.get("source", "")))):
        return "skip"
    return slide_type(cell)


def mark_slides(path: str | Path) -> bool:
    """Set every cell's slideshow metadata in place, and RISE's `scroll` (a slide
    taller than the window scrolls, as `make slides`' reveal_scroll makes it);
    True if the file changed."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    nb = json.loads(text)
    for c in nb.get("cells", []):
        c.setdefault("metadata", {})["slideshow"] = {"slide_type": slide_type(c)}
    meta = nb.setdefault("metadata", {})
    meta["rise"] = {**meta.get("rise", {}), "scroll": True}
    new = as_saved(nb)
    if new != text:
        atomic.write_text(path, new)  # a chapter, rewritten in place
        return True
    return False
