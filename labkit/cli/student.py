"""`make student`: the student edition, solutions out.

Imports labkit.cli.atomic; IPython, nbformat and nbclient inside functions.

Each notebooks/NN_x.ipynb becomes dist/student/NN_x.ipynb without its `solution`
cells, outputs or widget state, with images/ copied in. The build never deletes
or overwrites what it did not write (RECORD keeps a hash of each notebook it
wrote), and refuses a notebook that breaks the exercise layout (`layout_problems`).
"""

from __future__ import annotations

import ast
import copy
import hashlib
import json
import re
import shutil
from pathlib import Path

from labkit.cli import atomic
from labkit.cli.nbclean import as_saved

ROOT = Path(__file__).resolve().parents[2]
EXERCISE, SOLUTION, RAISES = "exercise", "solution", "raises-exception"
RECORD = ".labkit-student.json"  # in the edition's folder: what the build wrote
_IMAGE_LINK = re.compile(r"""(\]\(\s*<?|src\s*=\s*["'])\.\./images/""")
CHECK_CALL = re.compile(r"\bcheck_\w*\s*\(")


def points(cell: dict):
    """What an exercise is worth as an nbgrader assignment: its cell's metadata
    "points", else 1 (layout_problems refuses anything but a number > 0)."""
    return cell.get("metadata", {}).get("points", 1)


def tags(cell: dict) -> list[str]:
    return list(cell.get("metadata", {}).get("tags", []))


def source(cell: dict) -> str:
    s = cell.get("source", "")
    return s if isinstance(s, str) else "".join(s)


def first_exercise(nb: dict) -> int | None:
    """Index of the first cell tagged `exercise`, None when there is none."""
    return next((i for i, c in enumerate(nb["cells"]) if EXERCISE in tags(c)), None)


def _defined_names(code: str) -> set[str] | None:
    """Top-level names a cell defines (def, class, assignment; imports are left
    out, the stub's have run before the solution); None when it is not Python we
    can read (a cell magic such as %%ranks runs its body elsewhere)."""
    from IPython.core.inputtransformer2 import TransformerManager

    if code.lstrip().startswith("%%"):
        return None
    try:
        tree = ast.parse(TransformerManager().transform_cell(code))
    except SyntaxError:
        return None
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def layout_problems(nb: dict, name: str = "notebook") -> list[str]:
    """Every place where `nb` breaks the exercise layout, one line each. The
    layout: a cell tagged `exercise` (a stub raising NotImplementedError; its
    "points" a number > 0), next its `solution`, defining every name the stub
    does, then for code an untagged cell calling a labkit.checks `check_...`."""
    cells, out = nb["cells"], []
    for i, c in enumerate(cells):
        t = tags(c)
        if EXERCISE in t and SOLUTION in t:
            out.append(f"{name} cell {i}: tagged both `exercise` and `solution`")
        elif EXERCISE in t:
            pts = points(c)
            if isinstance(pts, bool) or not isinstance(pts, (int, float)) or pts <= 0:
                out.append(f"{name} cell {i}: an exercise's points (metadata "
                           f"\"points\", for nbgrader) must be a number > 0, "
                           f"not {pts!r}")
            nxt = cells[i + 1] if i + 1 < len(cells) else None
            if nxt is None or SOLUTION not in tags(nxt):
                out.append(f"{name} cell {i}: an `exercise` whose next cell is not "
                           "its `solution`")
        elif SOLUTION in t:
            prev = cells[i - 1] if i else None
            if prev is None or EXERCISE not in tags(prev):
                out.append(f"{name} cell {i}: a `solution` that does not follow an "
                           "`exercise` cell")
                continue
            if c["cell_type"] != "code":
                continue
            stub, answer = _defined_names(source(prev)), _defined_names(source(c))
            if stub is not None and answer is not None and stub - answer:
                out.append(f"{name} cell {i}: the solution does not define "
                           f"{sorted(stub - answer)}, which the exercise stub does, "
                           "so the check would see the stub")
            nxt = cells[i + 1] if i + 1 < len(cells) else None
            if (nxt is None or nxt["cell_type"] != "code" or tags(nxt)
                    or not CHECK_CALL.search(source(nxt))):
                out.append(f"{name} cell {i}: a code `solution` not followed by an "
                           "untagged check cell (a call to labkit.checks' check_...)")
    return out


def cleared(cell: dict) -> dict:
    cell = copy.deepcopy(cell)
    cell.get("metadata", {}).pop("execution", None)
    if cell["cell_type"] == "code":
        cell["outputs"], cell["execution_count"] = [], None
    elif cell["cell_type"] == "markdown":
        text = _IMAGE_LINK.sub(r"\1images/", source(cell))
        keep_lines = isinstance(cell.get("source"), list)
        cell["source"] = text.splitlines(keepends=True) if keep_lines else text
    return cell


def student_notebook(nb: dict) -> dict:
    """The student's copy of `nb`: no `solution` cells, no outputs or counts, no
    saved widget state, image links into the edition's own images/."""
    return with_cells(nb, [cleared(c) for c in nb["cells"] if SOLUTION not in tags(c)])


def with_cells(nb: dict, cells: list[dict]) -> dict:
    """A copy of `nb` (its metadata deep-copied, without saved widget state)
    holding `cells`: an edition of it."""
    out = copy.deepcopy({k: v for k, v in nb.items() if k != "cells"})
    out.get("metadata", {}).pop("widgets", None)
    out["cells"] = cells
    return out


def build(notebooks: Path = ROOT / "notebooks", out: Path = ROOT / "dist" / "student",
          images: Path = ROOT / "images") -> list[Path]:
    """Write the student edition of every notebooks/*.ipynb into `out` (and its
    images into out/images); return the notebooks written. ValueError, before
    anything is written, when a notebook breaks the exercise layout (naming each
    cell) or a notebook in `out` that this build did not write, or that changed
    since, has a chapter's name (naming each). An edition of a chapter no longer
    in the course is removed if it is as this build wrote it, else left."""
    sources = sorted(Path(notebooks).glob("*.ipynb"))
    books = {p: json.loads(p.read_text(encoding="utf-8")) for p in sources}
    problems = [line for p, nb in books.items() for line in layout_problems(nb, p.name)]
    if problems:
        raise ValueError("the exercise layout is broken:\n  " + "\n  ".join(problems))
    out = Path(out)
    texts = {p.name: as_saved(student_notebook(nb)) for p, nb in books.items()}
    record = _record(out)
    taken = [out / name for name, text in texts.items() if (out / name).exists()
             and not _ours(out / name, record) and (out / name).read_text(
                 encoding="utf-8") != text]
    if taken:
        raise ValueError(
            "not written by this command, or changed since it was (someone's work?), "
            "and named as a chapter:\n  " + "\n  ".join(map(str, taken)) +
            f"\nmove them out of {out}, or choose another --out; nothing was written")
    out.mkdir(parents=True, exist_ok=True)
    new = {name: _digest(text.encode("utf-8")) for name, text in texts.items()}
    # before writing, the record names both versions: a build cut short leaves
    # each file one of them, so the next build knows it as its own
    _write_record(out, {n: sorted({*record.get(n, []), h}) for n, h in new.items()}
                  | {n: v for n, v in record.items() if n not in new})
    for name in set(record) - set(texts):  # a chapter renamed or removed since
        if _ours(out / name, record):
            (out / name).unlink()
    if Path(images).is_dir():
        shutil.copytree(images, out / "images", dirs_exist_ok=True)
    written = []
    for name, text in texts.items():
        atomic.write_text(out / name, text)
        written.append(out / name)
    _write_record(out, {n: [h] for n, h in new.items()})
    return written


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _record(out: Path) -> dict[str, list[str]]:
    """notebook name -> hashes of what a build wrote there (none: {})."""
    try:
        got = json.loads((out / RECORD).read_text(encoding="utf-8"))["written"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}  # none, or damaged: nothing there counts as the build's own
    return {n: list(h) for n, h in got.items()} if isinstance(got, dict) else {}


def _ours(path: Path, record: dict) -> bool:
    """`path` is as a build wrote it (so it may be replaced or removed)."""
    return path.is_file() and _digest(path.read_bytes()) in record.get(path.name, ())


def _write_record(out: Path, written: dict) -> None:
    atomic.write_text(out / RECORD, json.dumps({"written": written}, indent=1,
                                      sort_keys=True) + "\n")


class PrefixError(AssertionError):
    """A student notebook failed before its first exercise."""


def run_prefix(path: str | Path, timeout: int = 120) -> int:
    """Execute `path` (in its own folder) up to, not including, its first
    `exercise` cell, as a student's Run All would before reaching it; cells tagged
    `raises-exception` may raise. Returns how many code cells ran; PrefixError
    with the cell and the error otherwise."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError

    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    stop = first_exercise(nb)
    nb.cells = nb.cells[:stop]
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    try:
        client.execute()
    except CellTimeoutError as e:
        raise PrefixError(f"{path.name}: a cell ran past {timeout} s: {e}") from None
    except CellExecutionError as e:
        failed = next((i for i, c in enumerate(nb.cells) if c.cell_type == "code"
                       and any(o.get("output_type") == "error" for o in c.outputs)
                       and RAISES not in tags(c)), "?")
        raise PrefixError(f"{path.name} cell {failed}: {e.ename}: {e.evalue}") from None
    return sum(c.cell_type == "code" for c in nb.cells)


def student(out: str | Path | None = None, run: bool = False) -> int:
    """The `student` command: build the edition, say what it holds, and with
    `run` execute each notebook up to its first exercise. Exit status 1 on a
    broken layout or a failing prefix."""
    out = Path(out) if out else ROOT / "dist" / "student"
    try:
        written = build(out=out)
    except ValueError as e:
        print(f"labkit student: {e}")
        return 1
    status = 0
    for path in written:
        nb = json.loads(path.read_text(encoding="utf-8"))
        n = sum(EXERCISE in tags(c) for c in nb["cells"])
        print(f"wrote {path} ({n} exercise{'s' * (n != 1)})")
        if run:
            try:
                ran = run_prefix(path)
            except PrefixError as e:
                print(f"  FAILED before its first exercise: {e}")
                status = 1
            else:
                print(f"  ran {ran} code cells up to its first exercise: no error")
    return status
