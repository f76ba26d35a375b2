"""A static deck's slides (`make slides`): one slide per idea, with its code.

Imports labkit.cli.nbclean only.

A heading starts a slide, and the cells after it stay on that slide while they
fit a 1280x720 screen (heights estimated from the cells: `height`); what does not
fit goes on a sub-slide below, from a cell boundary. RISE, live, gives every code
cell a sub-slide instead, which turns a built deck with outputs into a notebook dump.
"""

from __future__ import annotations

import base64
import copy
import math
import re

from labkit.cli.nbclean import deck_slide_type

# Heights in px at the deck's sizes (page_assets.DECK_CSS), fitted to what
# Chromium draws; a slide the estimate gets wrong scrolls (page_assets.DECK_JS).
SCREEN_PX = 640        # 720 less reveal's margins and the slide's padding
PROSE_PX, PROSE_CHARS = 33, 78   # a line of 24 px text, 1.35 high; ~1100 px wide
CODE_PX, CODE_CHARS = 26, 100    # 15 px code, its padding and margins
TABLE_ROW_PX = 30
IMAGE_PX = 380                   # a markdown image of unknown size
WIDGET_PX = 520


def _lines(text: str, width: int) -> int:
    """Lines of `width` characters that text takes, a blank line half one."""
    return math.ceil(sum(max(1, math.ceil(len(ln) / width)) if ln.strip() else 0.5
                         for ln in text.splitlines()))


def _png_height(data: str) -> int:
    raw = base64.b64decode(data[:64] + "=" * (-len(data[:64]) % 4))
    return int.from_bytes(raw[20:24], "big") if raw[:4] == b"\x89PNG" else IMAGE_PX


def height(cell: dict) -> int:
    """A cell's estimated height on a deck's slide, in px."""
    text = "".join(cell.get("source", ""))
    if cell.get("cell_type") == "markdown":
        rows = len(re.findall(r"^\|", text, re.M))
        images = len(re.findall(r"!\[", text))
        prose = re.sub(r"^\|.*$", "", text, flags=re.M)
        return (_lines(prose, PROSE_CHARS) * PROSE_PX + rows * TABLE_ROW_PX
                + images * IMAGE_PX + 45)
    px = _lines(text, CODE_CHARS) * CODE_PX + 40
    for out in cell.get("outputs", []):
        data = out.get("data", {})
        if "application/vnd.jupyter.widget-view+json" in data:
            px += WIDGET_PX
        elif "image/png" in data:
            png = data["image/png"]
            px += _png_height(png if isinstance(png, str) else "".join(png))
        elif "text/html" in data:
            html = "".join(data["text/html"])
            px += max(1, html.count("<tr")) * TABLE_ROW_PX
        else:
            txt = out.get("text") or data.get("text/plain", "")
            px += _lines("".join(txt), CODE_CHARS) * CODE_PX + 10
    return px


def deck_slide_types(cells: list[dict]) -> list[str]:
    """Each cell's slide type in a static deck: as deck_slide_type (headings
    start slides; set-up, asserts, checks, solutions and notes as there), but a
    code or text cell stays on the slide shown while the slide still fits the
    screen, and starts a sub-slide below when it would not."""
    types, used = [], SCREEN_PX
    for cell in cells:
        kind = deck_slide_type(cell)
        if kind in ("skip", "notes"):
            types.append(kind)
            continue
        h = height(cell)
        if kind == "slide":
            used = h
        elif used + h <= SCREEN_PX:
            kind, used = "-", used + h
        else:
            kind, used = "subslide", h
        types.append(kind)
    return types


def _paragraphs(text: str) -> list[str]:
    """Markdown cut at blank lines, never inside a fenced block or $$...$$."""
    parts, current, fenced = [], [], False
    for line in text.split("\n"):
        if not fenced and not line.strip() and current:
            parts.append("\n".join(current))
            current = []
            continue
        if line.lstrip().startswith(("```", "~~~")) or line.strip() == "$$":
            fenced = not fenced
        current.append(line)
    if current:
        parts.append("\n".join(current))
    return [p for p in parts if p.strip()]


def split_at_headings(cells: list[dict]) -> list[dict]:
    """The cells, a markdown cell with a heading below its first line cut
    there, so that the heading starts a slide as one at a cell's top does."""
    out = []
    for cell in cells:
        if cell.get("cell_type") != "markdown":
            out.append(cell)
            continue
        parts: list[list[str]] = [[]]
        for para in _paragraphs("".join(cell.get("source", ""))):
            if para.lstrip().startswith("#") and parts[-1]:
                parts.append([])
            parts[-1].append(para)
        for k, group in enumerate(parts):
            out.append(_part(cell, k, group, "h"))
    return out


def _part(cell: dict, k: int, paragraphs: list[str], cut: str) -> dict:
    """Part k of a markdown cell cut at paragraphs (the first keeps its id; the
    others' say which cut made them, "h" at a heading or "t" for height, so a
    part cut again by the other still has an id of its own)."""
    part = copy.deepcopy(cell)
    part["source"] = "\n\n".join(paragraphs)
    if k:
        part["id"] = f"{cell.get('id', 'cell')}-{cut}{k}"
    return part


def split_tall_text(cells: list[dict]) -> list[dict]:
    """The cells, each markdown cell taller than the screen cut into cells of
    whole paragraphs that fit (a paragraph taller than the screen alone); the
    same text in the same order, so a slide can hold one part at a time."""
    out = []
    for cell in cells:
        if cell.get("cell_type") != "markdown" or height(cell) <= SCREEN_PX:
            out.append(cell)
            continue
        groups = []
        for para in _paragraphs("".join(cell.get("source", ""))):
            grown = "\n\n".join([*groups[-1], para]) if groups else ""
            if groups and height({"cell_type": "markdown",
                                  "source": grown}) <= SCREEN_PX:
                groups[-1].append(para)
            else:
                groups.append([para])
        out += [_part(cell, k, group, "t") for k, group in enumerate(groups)]
    return out
