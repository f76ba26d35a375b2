"""The two editions the site and the slide decks are built from: public, lecturer.

    python -m labkit.cli.editions EXECUTED OUT public|lecturer

Imports labkit.cli's atomic, deck_layout and student modules only.

**public** drops every cell tagged `solution` and clears the outputs that would
give an answer away (an exercise's stub and its check cell, whose message names
the right answer); **lecturer** keeps everything, each solution headed by a line
that says it is one.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

from labkit.cli import atomic
from labkit.cli.nbclean import as_saved
from labkit.cli.deck_layout import (
    deck_slide_types,
    split_at_headings,
    split_tall_text,
)
from labkit.cli.student import CHECK_CALL, EXERCISE, SOLUTION, source, tags

EDITIONS = ("public", "lecturer")
SOLUTION_LABEL = "**Solution** (lecturer edition: not in the public site or decks)"


def _without_outputs(cell: dict) -> dict:
    cell = copy.deepcopy(cell)
    cell["outputs"], cell["execution_count"] = [], None
    return cell


def _answers_check(cells: list[dict], i: int) -> bool:
    """Whether cell i is an exercise's check: a code cell calling check_...()
    that follows a solution (the layout student.layout_problems enforces)."""
    c = cells[i]
    return (c["cell_type"] == "code" and bool(CHECK_CALL.search(source(c)))
            and any(SOLUTION in tags(p) for p in cells[max(0, i - 2):i]))


def public(nb: dict) -> dict:
    """`nb` without its solutions, and without the outputs that name answers."""
    cells, out = nb["cells"], []
    for i, c in enumerate(cells):
        if SOLUTION in tags(c):
            continue
        if c["cell_type"] == "code" and (EXERCISE in tags(c)
                                         or _answers_check(cells, i)):
            c = _without_outputs(c)
        out.append(c)
    return _with_cells(nb, out)


def _with_cells(nb: dict, cells: list[dict]) -> dict:
    """A copy of `nb` holding `cells` (its metadata, widgets' state included,
    kept: student.with_cells drops that state, which the site draws)."""
    return {**copy.deepcopy({k: v for k, v in nb.items() if k != "cells"}),
            "cells": copy.deepcopy(cells)}


def lecturer(nb: dict) -> dict:
    """`nb` whole, each solution headed by a markdown line naming it one."""
    out = []
    for c in nb["cells"]:
        if SOLUTION in tags(c):
            out.append({"cell_type": "markdown", "id": f"{c.get('id', 'x')}-label",
                        "metadata": {}, "source": [SOLUTION_LABEL]})
        out.append(c)
    return _with_cells(nb, out)


def write(executed: Path, out: Path, edition: str, *,
          deck: bool = False) -> list[Path]:
    """Each executed chapter's `edition` in `out`; returns the files written.
    deck: for `make slides`, its text cells cut at headings inside them and,
    taller than a screen, at their paragraphs (deck_layout; the site keeps
    them whole). Each file goes through a temporary file and a rename; nothing
    else in `out` is touched."""
    if edition not in EDITIONS:
        raise ValueError(f"edition must be one of {EDITIONS}, not {edition!r}")
    make = public if edition == "public" else lecturer
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for path in sorted(Path(executed).glob("*.ipynb")):
        nb = make(json.loads(path.read_text(encoding="utf-8")))
        if deck:
            nb["cells"] = split_tall_text(split_at_headings(nb["cells"]))
        for c, kind in zip(nb["cells"], deck_slide_types(nb["cells"])):
            label = source(c) == SOLUTION_LABEL  # goes with its solution
            c.setdefault("metadata", {})["slideshow"] = {
                "slide_type": "skip" if label else kind}
        target = out / path.name
        atomic.write_text(target, as_saved(nb))
        written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3:
        print("usage: python -m labkit.cli.editions EXECUTED OUT public|lecturer",
              file=sys.stderr)
        return 2
    written = write(Path(args[0]), Path(args[1]), args[2], deck=True)
    print(f"{args[1]}: the {args[2]} edition of {len(written)} chapters")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
