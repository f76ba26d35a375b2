"""Notebooks are committed clean: no outputs, no execution counts."""

from __future__ import annotations

import json
from pathlib import Path


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
    new = json.dumps(nb, indent=1, ensure_ascii=False) + "\n"
    if new != text:
        path.write_text(new, encoding="utf-8")
        return True
    return False


def slide_type(cell: dict) -> str:
    """Reveal.js slides from a chapter: each heading starts a slide, each code cell
    is a sub-slide below it (so long outputs get room), other text stays put."""
    source = "".join(cell.get("source", ""))
    if cell.get("cell_type") == "markdown" and source.lstrip().startswith("#"):
        return "slide"
    return "subslide" if cell.get("cell_type") == "code" else "-"


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
    new = json.dumps(nb, indent=1, ensure_ascii=False) + "\n"
    if new != text:
        path.write_text(new, encoding="utf-8")
        return True
    return False
