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
from labkit.checks import grading
from labkit.cli.assignments import (
    BEGIN,
    END,
    GUARD,
    HIDDEN,
    assignment,
    build,
    total_points,
)
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
    # the guard first, the chapter's check, then the check again, hidden
    assert source(check) == (
        f"{GUARD}\n\nfrom labkit.checks import check_answer\n\n"
        f'check_answer("f", f(), 2)\n\n{HIDDEN[0]}\n# the check again: its '
        "inputs are drawn afresh\nfrom labkit.checks import check_answer\n\n"
        f'check_answer("f", f(), 2)\n{HIDDEN[1]}')
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
        grading._graded = False  # a test may; an answer cell cannot (graded(False))
    check_answer("x", None, 2)  # self-study again
    assert "not answered yet" in capsys.readouterr().out


def test_a_test_cell_imports_again_the_checks_an_earlier_cell_imported():
    nb = _toy()
    nb["cells"][1]["source"] = "from labkit.checks import check_answer\nx = 1"
    nb["cells"][4]["source"] = 'check_answer("f", f(), 2)'
    check = assignment(nb, "toy.ipynb")["cells"][4]
    assert source(check).startswith(f"{GUARD}\nfrom labkit.checks import "
                                    "check_answer\n\ncheck_answer(")


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


# chapter 02's exercises as cheats would answer them (the stubs' names)
_RS = "def my_reduce_scatter(rank, world_size, chunks):\n"
_AG = "def my_all_gather(rank, world_size, chunks):\n"
_CROSS = "def crossover_bytes(n, alpha, beta):\n"
_STUBS = {"exercise-1": _RS + "    raise NotImplementedError\n",
          "exercise-2": _AG + "    raise NotImplementedError\n",
          "exercise-3": _CROSS + "    raise NotImplementedError\n"}
_SWITCH_OFF = """\
import os
import labkit.checks.grading as g
from labkit.checks import graded
os.environ.pop("NBGRADER_EXECUTION", None)
try:
    graded(False)
except Exception:
    pass
g._graded = False
"""
_PATCH = """\
import sys
import labkit.checks
for name in list(sys.modules):
    if name.startswith("labkit.checks"):
        for attr in dir(sys.modules[name]):
            if attr.startswith("check_"):
                setattr(sys.modules[name], attr, lambda *a, **k: print("correct"))
check_ring_reduce_scatter = check_ring_all_gather = check_crossover = print
"""
_CHEATS = {
    # the answers stubs; exercise 1's cell switches grading off (every way an
    # answer cell can: its test cell is the first after it), exercise 2's replaces
    # every check, in labkit and in the notebook (its and exercise 3's test cells
    # follow). One submission, one execution of the chapter: a defence that fails
    # scores its exercise's points
    "switched_off_then_patched": {
        **_STUBS, "exercise-1": _SWITCH_OFF + _STUBS["exercise-1"],
        "exercise-2": _PATCH + _STUBS["exercise-2"]},
    # the usual shortcuts, one to an exercise: the built-in collective, values
    # written down, labkit's own α-β model. Each exercise's other shortcuts (labkit's
    # ring, the built-in all-gather, the chapter's number) are refused by the same
    # checks in tests/test_checks_ring.py, which these test cells call
    "shortcuts": {
        "exercise-1": _RS + "    dist.all_reduce(chunks[(rank + 1) % world_size])\n",
        "exercise-2": _AG + "    for c, x in enumerate(chunks):\n"
                            "        x.fill_(10.0 * (c + 1))\n",
        "exercise-3": _CROSS + "    from labkit import theory\n"
                               "    t = theory.alpha_beta_time\n"
                               "    lat = t('all_reduce', 0, n, alpha, beta)\n"
                               "    lo, hi = 0.0, 1e15\n"
                               "    for _ in range(200):\n"
                               "        s = (lo + hi) / 2\n"
                               "        if t('all_reduce', s, n, alpha, beta)"
                               " < 2 * lat:\n"
                               "            lo = s\n"
                               "        else:\n"
                               "            hi = s\n"
                               "    return lo\n"},
}


@pytest.mark.slow
def test_nbgrader_generates_and_autogrades_a_chapter(tmp_path):
    """generate_assignment releases the stubs; autograde gives a correct
    submission every point; one with grading switched off in exercise 1 and the
    checks replaced in exercise 2 (_CHEATS), exercise 3 right, exercise 3's points
    only (a defence costs its own exercise); one with the usual shortcuts and
    exercise 2's test cell replaced by `pass` (nbgrader puts the locked cell
    back) none. Three executions of the chapter; a wrong answer's message is the
    checks' tests' (tests/test_checks_ring.py)."""
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

    zero = dict.fromkeys(points, 0.0)
    submissions = {  # name: (answers by grade id, the score each should get)
        "right": (solutions, points),
        "switched_off_then_patched": (
            {**_CHEATS["switched_off_then_patched"],
             "exercise-3": solutions["exercise-3"]},
            {**zero, "exercise-3-check": points["exercise-3-check"]}),
        "shortcuts": ({**_CHEATS["shortcuts"], "exercise-2-check": "pass"}, zero),
    }
    assert set(_CHEATS) < set(submissions)
    for name, (answers, _) in submissions.items():
        nb = copy.deepcopy(release)
        for c in nb["cells"]:
            if _nbgrader(c).get("grade_id") in answers:
                c["source"] = answers[_nbgrader(c)["grade_id"]]
        _submit(tmp_path, name, nb)
    _nbgrader_cli("autograde", CHAPTER, "--create", cwd=tmp_path)

    with Gradebook(f"sqlite:///{tmp_path / 'gradebook.db'}") as gb:
        scores = {s: {g.cell.name: g.score
                      for g in gb.find_submission(CHAPTER, s).notebooks[0].grades}
                  for s in submissions}
    for name, (_, want) in submissions.items():
        assert scores[name] == want, (
            f"the submission {name!r} scored {scores[name]}; expected {want}")
