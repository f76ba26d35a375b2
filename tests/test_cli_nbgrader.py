"""`make nbgrader`: the chapters as nbgrader assignments.

The fast tests check the source notebooks assignments.py writes (an answer cell
per exercise holding the stub and the solution region, a locked test cell worth
the exercise's points, every other code cell read-only, `graded()` first) and
what `graded()` changes in a check. The slow one runs nbgrader's own
generate_assignment and autograde on chapter 02 with two submissions, one
correct and one partly wrong, and reads their scores from nbgrader's gradebook.
"""

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from labkit.checks import NotAnswered, check_answer, graded
from labkit.cli.assignments import BEGIN, END, assignment, build, total_points
from labkit.cli.student import EXERCISE, layout_problems, source, student_notebook, tags

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CHAPTER = "02_ring_allreduce"
IMAGE = re.compile(r"""(?:\]\(\s*<?|src\s*=\s*["'])images/([^)"'>\s]+)""")


def _load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _nbgrader(cell: dict) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {})


def _cell(kind, text, *tag, **meta):
    cell = {"cell_type": kind, "source": text, "metadata": {"tags": list(tag), **meta}}
    if kind == "code":
        cell.update(outputs=[], execution_count=None)
    return cell


def _toy():
    return {"metadata": {}, "nbformat": 4, "nbformat_minor": 5, "cells": [
        _cell("markdown", "# A chapter"),
        _cell("code", "x = 1"),
        _cell("code", 'def f():\n    raise NotImplementedError("exercise: f")\n',
              "exercise", points=3),
        _cell("code", "def f():\n    return 2\n", "solution"),
        _cell("code", "from labkit.checks import check_answer\n\n"
                      'check_answer("f", f(), 2)'),
        _cell("markdown", "**Your answer:** (double-click)", "exercise"),
        _cell("markdown", "**A worked answer.** Because.", "solution"),
    ]}


def test_each_exercise_becomes_an_answer_and_a_locked_test_worth_its_points():
    nb = assignment(_toy(), "toy.ipynb")
    graded_cell, x, answer, check, written = [c for c in nb["cells"][1:]]
    assert "graded()" in source(graded_cell) and _nbgrader(graded_cell)["locked"]
    assert _nbgrader(x) == {"grade": False, "grade_id": "cell-1", "locked": True,
                            "schema_version": 3, "solution": False}
    assert source(answer) == ('def f():\n    raise NotImplementedError("exercise: f")'
                              f"\n{BEGIN}\ndef f():\n    return 2\n{END}")
    assert _nbgrader(answer)["solution"] and not _nbgrader(answer)["grade"]
    assert "points" not in answer["metadata"]
    meta = _nbgrader(check)
    assert (meta["grade"], meta["locked"], meta["points"], meta["solution"]) == (
        True, True, 3, False)
    meta = _nbgrader(written)  # a written answer: graded by hand, 1 point
    assert (meta["solution"], meta["grade"], meta["points"]) == (True, True, 1)
    assert total_points(nb) == (3, 1)


@pytest.mark.parametrize("bad", [0, -1, "2", True, None])
def test_points_must_be_a_positive_number(bad):
    nb = _toy()
    nb["cells"][2]["metadata"]["points"] = bad
    problems = layout_problems(nb, "toy.ipynb")
    assert any("points" in p and repr(bad) in p for p in problems), problems
    with pytest.raises(ValueError, match="points"):
        assignment(nb, "toy.ipynb")


def test_graded_turns_not_answered_yet_into_a_failure(capsys):
    check_answer("x", None, 2)
    assert "not answered yet" in capsys.readouterr().out
    graded()
    try:
        with pytest.raises(NotAnswered, match="not answered yet"):
            check_answer("x", None, 2)
    finally:
        graded(False)
    check_answer("x", None, 2)  # self-study again
    assert "not answered yet" in capsys.readouterr().out


def test_every_chapter_with_exercises_is_an_assignment(tmp_path):
    written = {p.stem: p for p in build(out=tmp_path)}
    assert (tmp_path / "nbgrader_config.py").is_file()
    for path in NOTEBOOKS:
        nb = _load(path)
        stubs = [c for c in student_notebook(nb)["cells"] if EXERCISE in tags(c)]
        if not stubs:
            assert path.stem not in written, f"{path.stem} has no exercise to grade"
            continue
        book = _load(written[path.stem])
        answers = [c for c in book["cells"] if _nbgrader(c).get("solution")]
        assert [source(a).split(BEGIN)[0].rstrip() for a in answers] == [
            source(s).rstrip() for s in stubs], f"{path.stem}: answers keep the stubs"
        ids = [_nbgrader(c)["grade_id"] for c in book["cells"] if _nbgrader(c)]
        assert len(ids) == len(set(ids)), f"{path.stem}: grade ids repeat"
        code = [c for c in book["cells"] if c["cell_type"] == "code"]
        assert all(_nbgrader(c) for c in code), f"{path.stem}: a code cell unmarked"
        want = sum(c["metadata"].get("points", 1) for c in nb["cells"]
                   if EXERCISE in tags(c))
        assert sum(total_points(book)) == want, (
            f"{path.stem}: {total_points(book)} points, the exercises say {want}")
        text = "".join(source(c) for c in book["cells"] if c["cell_type"] == "markdown")
        for name in IMAGE.findall(text):
            assert (written[path.stem].parent / "images" / name).is_file(), (
                f"{path.stem} shows images/{name}, which is not beside it")


def test_unknown_chapter_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no such chapter"):
        build(out=tmp_path, chapters=["99_nothing"])


def _nbgrader_cli(*args, cwd):
    """nbgrader's own command, from this environment (it runs `alembic` by name:
    the environment's bin/ goes first on PATH)."""
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    r = subprocess.run([os.path.join(bin_dir, "nbgrader"), *args], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"nbgrader {' '.join(args)} failed:\n{r.stderr[-3000:]}"
    return r


def _submit(course: Path, student: str, nb: dict):
    folder = course / "submitted" / student / CHAPTER
    folder.mkdir(parents=True)
    (folder / f"{CHAPTER}.ipynb").write_text(json.dumps(nb), encoding="utf-8")


@pytest.mark.slow
def test_nbgrader_generates_and_autogrades_a_chapter(tmp_path):
    """generate_assignment releases the stubs; autograde gives a correct
    submission every point, and one with exercise 1 right, exercise 2 left as its
    stub with its test cell replaced by `pass` (nbgrader restores locked cells)
    and exercise 3 wrong, exercise 1's points only."""
    from nbgrader.api import Gradebook

    (source_nb,) = build(out=tmp_path, chapters=[CHAPTER])
    _nbgrader_cli("generate_assignment", CHAPTER, cwd=tmp_path)
    release = _load(tmp_path / "release" / CHAPTER / f"{CHAPTER}.ipynb")
    assert BEGIN not in json.dumps(release) and END not in json.dumps(release)
    student = student_notebook(_load(ROOT / "notebooks" / f"{CHAPTER}.ipynb"))
    stubs = [source(c).rstrip() for c in student["cells"] if EXERCISE in tags(c)]
    released = [source(c).rstrip() for c in release["cells"]
                if _nbgrader(c).get("solution")]
    assert released == stubs, "the released answer cells are make student's stubs"

    solutions = {_nbgrader(c)["grade_id"]: "\n".join(
        line for line in source(c).splitlines() if line.strip() not in (BEGIN, END))
        for c in _load(source_nb)["cells"] if _nbgrader(c).get("solution")}
    points = {_nbgrader(c)["grade_id"]: _nbgrader(c)["points"]
              for c in release["cells"] if _nbgrader(c).get("grade")}
    assert sorted(points) == ["exercise-1-check", "exercise-2-check",
                              "exercise-3-check"], points

    right = copy.deepcopy(release)
    partly = copy.deepcopy(release)
    for r, p in zip(right["cells"], partly["cells"]):
        gid = _nbgrader(r).get("grade_id")
        if gid in solutions:
            r["source"] = solutions[gid]
        if gid == "exercise-1":
            p["source"] = solutions[gid]
        elif gid == "exercise-2-check":
            p["source"] = "pass"
        elif gid == "exercise-3":  # the bytes over beta, without the 2(N-1)/N
            p["source"] = ("def ring_seconds(n, size, alpha, beta):\n"
                           "    return 2 * (n - 1) * alpha + size / beta\n")
    _submit(tmp_path, "right", right)
    _submit(tmp_path, "partly", partly)
    _nbgrader_cli("autograde", CHAPTER, "--create", cwd=tmp_path)

    with Gradebook(f"sqlite:///{tmp_path / 'gradebook.db'}") as gb:
        scores = {s: {g.cell.name: g.score
                      for g in gb.find_submission(CHAPTER, s).notebooks[0].grades}
                  for s in ("right", "partly")}
    want_right = points
    want_partly = {**dict.fromkeys(points, 0.0),
                   "exercise-1-check": points["exercise-1-check"]}
    assert scores["right"] == want_right, (
        f"a correct submission scored {scores['right']}, every point is {want_right}")
    assert scores["partly"] == want_partly, (
        f"exercise 1 right, 2 a stub with its test replaced, 3 wrong scored "
        f"{scores['partly']}; expected {want_partly}")
