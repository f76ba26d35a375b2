"""`make nbgrader`: every chapter as an nbgrader assignment, for a class that grades.

Imports labkit.cli.student (the exercise layout) and labkit.checks' names.

Each exercise becomes an answer cell (the stub, then the solution between
nbgrader's markers) and a locked test cell worth its points (`intact()`, the
check, and the check again as a hidden test on fresh inputs); every other code
cell is locked, and a first locked cell calls `graded()`. docs/design.md gives
the whole layout.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
from pathlib import Path

from labkit.cli import atomic
from labkit.cli.nbclean import as_saved
from labkit.cli.student import (
    EXERCISE,
    ROOT,
    cleared,
    layout_problems,
    points,
    source,
    tags,
    with_cells,
)

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
HIDDEN = "### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS"
SCHEMA_VERSION = 3  # nbgrader 0.9's cell metadata schema
_IMAGE = re.compile(r"""(?:\]\(\s*<?|src\s*=\s*["'])images/([^)"'>\s]+)""")

CONFIG = '''\
# nbgrader's settings for Parallelism Lab's chapters (written by `make nbgrader`).
c = get_config()  # noqa: F821
# A solution region is released as nothing: the exercise's stub stays above it,
# the same stub `make student` hands out.
c.ClearSolutions.code_stub = {"python": ""}
c.ClearSolutions.text_stub = ""
# Chapters start 4-rank clusters; their longest cells take tens of seconds on
# 2 cores (`make test-notebooks` allows 120 s a cell).
c.Execute.timeout = %(timeout)d
'''


def _nbgrader(cell: dict, grade_id: str, *, solution=False, grade=False, locked=False,
              pts: float | None = None) -> dict:
    meta = {"grade": grade, "grade_id": grade_id, "locked": locked,
            "schema_version": SCHEMA_VERSION, "solution": solution}
    if grade:
        meta["points"] = pts
    cell.setdefault("metadata", {})["nbgrader"] = meta
    return cell


GRADED = """\
# Graded with nbgrader: from here on, a check whose exercise is still its stub
# (or whose answer is still None) fails, and that exercise scores no points.
from labkit.checks import graded

graded()"""


GUARD = """\
# Graded (locked): labkit's checks run as its files define them; a check or
# closed form an answer cell replaced, or grading switched off, fails here.
from labkit.checks import intact

intact()"""


def _checks_used(code: str) -> list[str]:
    """The names labkit.checks exports that `code` reads but does not import
    itself (imported in an earlier cell, which an answer cell may rebind)."""
    import labkit.checks

    tree = ast.parse(code)
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    imported = {a.asname or a.name for n in ast.walk(tree)
                if isinstance(n, ast.ImportFrom) and n.module == "labkit.checks"
                for a in n.names}
    return sorted(used & set(labkit.checks.__all__) - imported)


def _test(check: dict) -> dict:
    """The locked test cell made of a chapter's check cell: GUARD, the checks it
    calls imported again (an answer cell may have rebound their names), the
    check, and the check again as a hidden test on inputs drawn afresh."""
    cell = cleared(check)
    body = source(cell).strip("\n")
    names = _checks_used(body)
    again = ""
    if names:
        again = "\nfrom labkit.checks import " + ", ".join(names)
        if len(again) > 80:
            again = ("\nfrom labkit.checks import (\n"
                     + "".join(f"    {n},\n" for n in names) + ")")
    cell["source"] = (f"{GUARD}{again}\n\n{body}\n\n{HIDDEN[0]}\n# the check "
                      f"again: its inputs are drawn afresh\n{body}\n{HIDDEN[1]}")
    return cell


def _answer(stub: dict, solution: dict) -> dict:
    """One cell: the stub, then the solution as nbgrader's solution region."""
    cell = cleared(stub)
    body = source(cleared(solution)).rstrip("\n")
    cell["source"] = f"{source(cell).rstrip()}\n{BEGIN}\n{body}\n{END}"
    cell["metadata"].pop("points", None)
    return cell


def assignment(nb: dict, name: str) -> dict:
    """`nb` as an nbgrader source notebook (the layout: docs/design.md, cli).
    ValueError naming each cell when `nb` breaks the exercise layout."""
    problems = layout_problems(nb, name)
    if problems:
        raise ValueError("the exercise layout is broken:\n  " + "\n  ".join(problems))
    cells, out, k, i = nb["cells"], [], 0, 0
    while i < len(cells):
        c = cells[i]
        if EXERCISE in tags(c):
            k += 1
            pts, answer = points(c), _answer(c, cells[i + 1])
            if answer["cell_type"] == "markdown":   # a written answer: graded by hand
                out.append(_nbgrader(answer, f"exercise-{k}", solution=True,
                                     grade=True, pts=pts))
                i += 2
                continue
            out.append(_nbgrader(answer, f"exercise-{k}", solution=True))
            out.append(_nbgrader(_test(cells[i + 2]), f"exercise-{k}-check",
                                 grade=True, locked=True, pts=pts))
            i += 3
            continue
        c = cleared(c)
        if c["cell_type"] == "code":
            _nbgrader(c, f"cell-{i}", locked=True)
        out.append(c)
        i += 1
    first_code = next(j for j, c in enumerate(out) if c["cell_type"] == "code")
    out.insert(first_code, _nbgrader({"cell_type": "code", "execution_count": None,
                                      "id": "labkit-graded", "metadata": {},
                                      "outputs": [], "source": GRADED},
                                     "graded", locked=True))
    return with_cells(nb, out)


def total_points(nb: dict) -> tuple[float, float]:
    """(autograded, graded by hand) points of an nbgrader source notebook."""
    auto = manual = 0.0
    for c in nb["cells"]:
        g = c.get("metadata", {}).get("nbgrader", {})
        if g.get("grade"):
            if g.get("solution"):
                manual += g["points"]
            else:
                auto += g["points"]
    return auto, manual


def build(out: Path = ROOT / "dist" / "nbgrader", notebooks: Path = ROOT / "notebooks",
          images: Path = ROOT / "images", chapters: list[str] | None = None,
          timeout: int = 300) -> list[Path]:
    """Write the nbgrader course folder `out`: its nbgrader_config.py and
    source/<chapter>/<chapter>.ipynb (with the images it links) for each chapter
    that has exercises (only `chapters`, stems, when given). Returns the
    notebooks written; ValueError, naming each cell, when one breaks the layout
    (nothing is written)."""
    paths = sorted(Path(notebooks).glob("*.ipynb"))
    if chapters:
        unknown = set(chapters) - {p.stem for p in paths}
        if unknown:
            raise ValueError(f"no such chapter: {sorted(unknown)} (the chapters are "
                             f"{[p.stem for p in paths]})")
        paths = [p for p in paths if p.stem in chapters]
    books = {}
    for p in paths:
        nb = json.loads(p.read_text(encoding="utf-8"))
        if any(EXERCISE in tags(c) for c in nb["cells"]):
            books[p] = assignment(nb, p.name)
    out = Path(out)
    (out / "source").mkdir(parents=True, exist_ok=True)
    atomic.write_text(out / "nbgrader_config.py", CONFIG % {"timeout": timeout})
    written = []
    for p, book in books.items():
        folder = out / "source" / p.stem
        folder.mkdir(parents=True, exist_ok=True)
        for c in book["cells"]:
            if c["cell_type"] == "markdown":
                for image in _IMAGE.findall(source(c)):
                    (folder / "images").mkdir(exist_ok=True)
                    shutil.copy2(Path(images) / image, folder / "images" / image)
        dest = folder / p.name
        atomic.write_text(dest, as_saved(book))
        written.append(dest)
    return written


def nbgrader_course(out: str | Path | None = None,
                    chapters: list[str] | None = None) -> int:
    """The `nbgrader` command: build the course folder and say what it holds."""
    out = Path(out) if out else ROOT / "dist" / "nbgrader"
    try:
        written = build(out=out, chapters=chapters)
    except ValueError as e:
        print(f"labkit nbgrader: {e}")
        return 1
    for path in written:
        nb = json.loads(path.read_text(encoding="utf-8"))
        auto, manual = total_points(nb)
        n = sum(c.get("metadata", {}).get("nbgrader", {}).get("solution", False)
                for c in nb["cells"])
        by_hand = f" + {manual:g} graded by hand" if manual else ""
        print(f"wrote {path}: {n} exercise{'s' * (n != 1)}, {auto:g} points "
              f"autograded{by_hand}")
    print(f"then: cd {out} && nbgrader generate_assignment <chapter> "
          "(nbgrader's own steps from there; docs/teaching.md)")
    return 0
