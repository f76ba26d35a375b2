"""`make student`: the student edition, and CI's check that it works.

What CI checks, and which part checks it:
- each student notebook runs up to (not including) its first exercise: before it,
  its code cells are the chapter's own, which nbval runs
  (`test_student_edition_of_each_chapter`), and its images are where its links
  say; one edition is executed from its own folder with nbclient
  (`test_a_student_notebook_runs_from_its_own_folder`);
- every solution passes its check: `make test-notebooks` runs each original
  chapter under nbval, solutions and the check cell after each included (a wrong
  solution raises ExerciseError there). `test_every_chapter_keeps_the_exercise_
  layout` makes that run meaningful: each solution follows its stub, defines every
  name the stub defines (so the check sees the solution, not the stub) and is
  followed by a check cell. Nothing here runs a solution or a check a second time.
"""

import itertools
import json
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from labkit.cli.student import (
    PrefixError,
    build,
    first_exercise,
    layout_problems,
    run_prefix,
    source,
    student_notebook,
    tags,
)

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
IMAGE = re.compile(r"""!\[[^\]]*\]\(\s*<?([^)\s>]+)"""  # ![alt](path)
                   r"""|<img[^>]*\bsrc\s*=\s*["']([^"']+)""")  # <img src="path">


_IDS = itertools.count()


def _cell(kind, text, *tag, outputs=()):
    cell = {"id": f"cell-{next(_IDS)}", "cell_type": kind, "source": text,
            "metadata": {"tags": list(tag)}}
    if kind == "code":
        cell.update(outputs=list(outputs), execution_count=7 if outputs else None)
    return cell


def _nb(*cells):
    return {"cells": list(cells), "metadata": {"widgets": {"state": {}}},
            "nbformat": 4, "nbformat_minor": 5}


STUB = 'def my_sum(x):\n    raise NotImplementedError("exercise: sum x")\n'
ANSWER = "def my_sum(x):\n    return sum(x)\n"
CHECK = "check_sum(my_sum)\n"
PRINTED = {"output_type": "stream", "name": "stdout", "text": "1\n"}


def _chapter():
    return _nb(_cell("markdown", "# A chapter\n\n![ring](../images/ring.svg)"),
               _cell("code", "print(1)", outputs=[PRINTED]),
               _cell("code", STUB, "exercise"), _cell("code", ANSWER, "solution"),
               _cell("code", CHECK))


def test_student_notebook_drops_solutions_outputs_and_widget_state():
    nb = _chapter()
    before = json.dumps(nb)
    st = student_notebook(nb)
    assert [source(c) for c in st["cells"][1:]] == ["print(1)", STUB, CHECK]
    assert [tags(c) for c in st["cells"]] == [[], [], ["exercise"], []]
    assert st["cells"][1]["outputs"] == [] and st["cells"][1]["execution_count"] is None
    assert "widgets" not in st["metadata"]
    assert source(st["cells"][0]).endswith("![ring](images/ring.svg)")
    assert json.dumps(nb) == before  # the original is left as it was


def test_image_links_keep_the_source_as_lines():
    md = _cell("markdown", ["see\n", '<img src="../images/a.svg" width=300>\n'])
    (cell,) = student_notebook(_nb(md))["cells"]
    assert cell["source"] == ["see\n", '<img src="images/a.svg" width=300>\n']


@pytest.mark.parametrize("cells, problem", [
    ([_cell("code", STUB, "exercise"), _cell("code", CHECK)],
     "cell 0: an `exercise` whose next cell is not its `solution`"),
    ([_cell("code", "x = 1"), _cell("code", ANSWER, "solution"), _cell("code", CHECK)],
     "cell 1: a `solution` that does not follow an `exercise` cell"),
    ([_cell("code", STUB, "exercise"), _cell("code", ANSWER, "solution")],
     "cell 1: a code `solution` not followed by an untagged check cell"),
    ([_cell("code", STUB, "exercise"), _cell("code", ANSWER, "solution"),
      _cell("code", "print(my_sum([1]))")],
     "cell 1: a code `solution` not followed by an untagged check cell"),
    ([_cell("code", STUB + "N = None\n", "exercise"), _cell("code", ANSWER, "solution"),
      _cell("code", CHECK)],
     "cell 1: the solution does not define ['N'], which the exercise stub does"),
    ([_cell("code", STUB, "exercise", "solution")],
     "cell 0: tagged both `exercise` and `solution`"),
])
def test_layout_problems_name_the_cell(cells, problem):
    (line,) = layout_problems(_nb(*cells), "x.ipynb")
    assert line.startswith("x.ipynb " + problem), line


def test_a_good_layout_has_no_problems():
    magic = _cell("code", "%time y = 2\n" + ANSWER, "solution")  # read as IPython
    nb = _nb(_cell("code", STUB, "exercise"), magic, _cell("code", CHECK))
    assert layout_problems(nb) == [] and layout_problems(_chapter()) == []
    ranks = _cell("code", "%%ranks -n 2\nx = 1", "solution")  # body runs on ranks
    nb["cells"][1] = ranks
    assert layout_problems(nb) == []
    nb["cells"][:2] = [_cell("code", "from labkit.checks import check_sum\n" + STUB,
                             "exercise"), _cell("code", ANSWER, "solution")]
    assert layout_problems(nb) == []  # the stub's import has run before
    assert first_exercise(_chapter()) == 2 and first_exercise(_nb()) is None


def _write(folder: Path, name: str, nb: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(nb))
    return folder / name


def test_build_writes_the_edition_with_its_images(tmp_path):
    src, images, out = tmp_path / "nb", tmp_path / "images", tmp_path / "dist"
    _write(src, "01_a.ipynb", _chapter())
    images.mkdir()
    (images / "ring.svg").write_text("<svg/>")
    gone = _write(src, "00_gone.ipynb", _chapter())
    build(src, out, images)
    gone.unlink()  # a chapter removed from the course: its edition goes too
    assert build(src, out, images) == [out / "01_a.ipynb"]
    assert sorted(p.name for p in out.iterdir()) == [
        ".labkit-student.json", "01_a.ipynb", "images"]
    assert (out / "images" / "ring.svg").read_text() == "<svg/>"
    nbformat.validate(nbformat.read(out / "01_a.ipynb", as_version=4))


def test_build_never_deletes_or_overwrites_what_it_did_not_write(tmp_path):
    src, images, out = tmp_path / "nb", tmp_path / "images", tmp_path / "dist"
    _write(src, "01_a.ipynb", _chapter())
    homework = _write(out, "my_homework.ipynb", _nb(_cell("code", "x = 42")))
    own = homework.read_text()
    assert build(src, out, images) == [out / "01_a.ipynb"]
    assert homework.read_text() == own, "the student's own notebook was changed"
    # a chapter gone from the course: its old edition goes, as this build wrote it
    # and nobody changed it; one a student worked in stays
    _write(src, "02_b.ipynb", _chapter())
    build(src, out, images)
    worked = out / "02_b.ipynb"
    worked.write_text(worked.read_text().replace("print(1)", "print(2)"))
    (src / "01_a.ipynb").unlink()
    (src / "02_b.ipynb").unlink()
    _write(src, "03_c.ipynb", _chapter())
    assert build(src, out, images) == [out / "03_c.ipynb"]
    assert sorted(p.name for p in out.glob("*.ipynb")) == [
        "02_b.ipynb", "03_c.ipynb", "my_homework.ipynb"]
    assert "print(2)" in worked.read_text()
    # a chapter's name taken by a file it did not write (or that was changed
    # since): refused, naming it, and nothing written
    _write(src, "my_homework.ipynb", _chapter())
    _write(src, "02_b.ipynb", _chapter())
    before = {p: p.read_text() for p in out.glob("*.ipynb")}
    with pytest.raises(ValueError) as e:
        build(src, out, images)
    assert "my_homework.ipynb" in str(e.value) and "02_b.ipynb" in str(e.value), e
    assert "03_c.ipynb" not in str(e.value), e  # its own, unchanged: replaced
    assert {p: p.read_text() for p in out.glob("*.ipynb")} == before


def test_build_refuses_a_broken_layout_and_writes_nothing(tmp_path):
    src, out = tmp_path / "nb", tmp_path / "dist"
    _write(src, "01_a.ipynb", _chapter())
    _write(src, "02_b.ipynb", _nb(_cell("code", STUB, "exercise")))
    with pytest.raises(ValueError, match=r"02_b.ipynb cell 0: an `exercise` whose"):
        build(src, out, tmp_path / "images")
    assert not out.exists()


@pytest.mark.ranks  # runs the chapter's prefix in a kernel (labkit.cli.student)
def test_run_prefix_stops_before_the_first_exercise(tmp_path):
    nb = _nb(_cell("code", "x = 41"), _cell("code", "1 / 0", "raises-exception"),
             _cell("code", "assert x == 41"), _cell("code", STUB + "my_sum()",
                                                    "exercise"),
             _cell("code", "raise SystemExit('past the exercise')"))
    assert run_prefix(_write(tmp_path, "ok.ipynb", nb), timeout=60) == 3
    nb["cells"][2] = _cell("code", "import nope_no_such_module")
    with pytest.raises(PrefixError, match=r"bad.ipynb cell 2: ModuleNotFoundError"):
        run_prefix(_write(tmp_path, "bad.ipynb", nb), timeout=60)


def test_the_command_writes_the_edition(tmp_path):
    out = subprocess.run([sys.executable, "-m", "labkit", "student", "--out",
                          str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert sorted(p.name for p in tmp_path.glob("*.ipynb")) == [
        p.name for p in NOTEBOOKS]
    assert f"wrote {tmp_path / NOTEBOOKS[0].name}" in out.stdout


# ---------------------------------------------------------------- the real chapters


@pytest.fixture(scope="module")
def edition(tmp_path_factory):
    out = tmp_path_factory.mktemp("student")
    build(out=out)
    return out


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_chapter_keeps_the_exercise_layout(path):
    nb = json.loads(path.read_text(encoding="utf-8"))
    assert layout_problems(nb, path.name) == []


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_student_edition_of_each_chapter(path, edition):
    nb = json.loads(path.read_text(encoding="utf-8"))
    st = json.loads((edition / path.name).read_text(encoding="utf-8"))
    kept = [c for c in nb["cells"] if "solution" not in tags(c)]
    assert [c.get("id") for c in st["cells"]] == [c.get("id") for c in kept]
    assert not any("solution" in tags(c) for c in st["cells"])
    assert not any(c.get("outputs") or c.get("execution_count") for c in st["cells"])
    # before the first exercise nothing is removed: the student runs nbval's code
    stop = first_exercise(nb)
    assert [source(c) for c in st["cells"][:stop] if c["cell_type"] == "code"] == [
        source(c) for c in nb["cells"][:stop] if c["cell_type"] == "code"]
    for c in st["cells"]:
        if c["cell_type"] == "markdown":
            for link in filter(None, sum(IMAGE.findall(source(c)), ())):
                if not link.startswith(("http:", "https:", "data:", "attachment:")):
                    assert (edition / link).is_file(), f"{path.name}: {link}"


@pytest.mark.slow
def test_a_student_notebook_runs_from_its_own_folder(edition):
    # the code before every chapter's first exercise is the chapter's own (the
    # test above), which nbval runs; this runs one edition end to end from the
    # handed-out folder, as a student would, rather than all of them twice
    path = edition / "01_collectives.ipynb"
    nb = json.loads(path.read_text(encoding="utf-8"))
    before = nb["cells"][:first_exercise(nb)]
    assert run_prefix(path, timeout=120) == sum(c["cell_type"] == "code"
                                                for c in before) > 0
