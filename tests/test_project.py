"""House rules: clean notebooks, one list of dependencies, the README's commands."""

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from labkit.cli.nbclean import as_saved, clean, dirty_cells, kernelspec, slide_type

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_there_are_chapters():
    assert [p.name for p in NOTEBOOKS][:1] == ["00_lab_tour.ipynb"]
    for p in NOTEBOOKS:
        assert re.fullmatch(r"\d\d_[a-z0-9_]+\.ipynb", p.name), p.name


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebooks_are_committed_clean(path):
    assert dirty_cells(path) == [], f"{path.name}: run `make clean-notebooks`"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_chapters_are_written_as_jupyterlab_saves_them(path):
    """A save in JupyterLab changes nothing (tests/browser/test_save.py saves
    chapters in a real one): the text is nbformat's, cells have ids (4.5), and the
    metadata has what the kernel tells JupyterLab when it opens the notebook."""
    from ipykernel.ipkernel import IPythonKernel

    text = path.read_text(encoding="utf-8")
    nb = json.loads(text)
    assert text == as_saved(nb), (
        f"{path.name}: not as JupyterLab writes it (nbformat: keys sorted, one "
        "space a level); run `make clean-notebooks`")
    assert (nb["nbformat"], nb["nbformat_minor"]) == (4, 5), (
        f"{path.name}: nbformat {nb['nbformat']}.{nb['nbformat_minor']}, want 4.5")
    missing = [i for i, c in enumerate(nb["cells"]) if not c.get("id")]
    assert not missing, f"{path.name}: cells without an id: {missing}"
    meta = nb["metadata"]
    assert meta["kernelspec"] == kernelspec(), (
        f"{path.name}: kernelspec {meta['kernelspec']}, JupyterLab writes "
        f"{kernelspec()}; run `make clean-notebooks`")
    lacking = set(IPythonKernel.language_info) - set(meta["language_info"])
    assert not lacking, (f"{path.name}: language_info lacks {sorted(lacking)}, "
                         "which JupyterLab adds; run `make clean-notebooks`")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_chapters_are_slides_too(path):
    # `make slides`: every heading starts a slide (`make clean-notebooks` marks them)
    cells = json.loads(path.read_text())["cells"]
    marks = [c["metadata"].get("slideshow", {}).get("slide_type") for c in cells]
    assert marks == [slide_type(c) for c in cells], "run `make clean-notebooks`"
    assert marks[0] == "slide" and marks.count("slide") >= 4
    # RISE (live slides): a slide taller than the window scrolls, as make slides'
    rise = json.loads(path.read_text())["metadata"].get("rise", {})
    assert rise.get("scroll") is True, "run `make clean-notebooks`"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_section_has_speaker_notes(path):
    # a lecturer's notes (markdown tagged `notes`: the decks' speaker view, an
    # aside on the site) for each `## ` section but the exercises
    sections, current = {}, None
    for c in json.loads(path.read_text())["cells"]:
        text = "".join(c["source"])
        tagged = "notes" in c["metadata"].get("tags", [])
        for line in text.splitlines():
            if c["cell_type"] == "markdown" and line.startswith("## ") and (
                    not tagged):
                current = line[3:].strip()
                sections[current] = []
        if tagged and current is not None:
            sections[current].append(text)
    missing = [s for s, notes in sections.items()
               if not notes and not s.startswith("Exercises")]
    assert sections and not missing, f"{path.name}: sections without notes: {missing}"
    for s, notes in sections.items():
        assert all(n.startswith("*Speaker notes.*") for n in notes), (
            f"{path.name}, {s}: notes must open with *Speaker notes.*")


def test_clean_interrupted_leaves_the_chapter_whole(tmp_path, monkeypatch):
    """clean rewrites a chapter in place: a death between writing and renaming
    leaves the old text, and no temporary file behind."""
    from labkit.cli import atomic

    nb = {"cells": [{"cell_type": "code", "id": "c1", "source": "1", "metadata": {},
                     "execution_count": 3, "outputs": []}],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    p = tmp_path / "x.ipynb"
    p.write_text(json.dumps(nb))
    before = p.read_bytes()

    def killed(src, dst):
        raise KeyboardInterrupt("killed before the rename")
    monkeypatch.setattr(atomic.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        clean(p)
    assert p.read_bytes() == before, "the chapter changed though the write never ended"
    assert [q.name for q in tmp_path.iterdir()] == ["x.ipynb"], "a temporary was left"


def test_clean_strips_outputs_and_counts(tmp_path):
    nb = {"cells": [{"cell_type": "code", "source": "1", "metadata": {},
                     "execution_count": 3,
                     "outputs": [{"output_type": "stream", "name": "stdout",
                                  "text": "1"}]}],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 4}
    p = tmp_path / "x.ipynb"
    p.write_text(json.dumps(nb))
    assert dirty_cells(p) == [0]
    assert clean(p) is True
    assert dirty_cells(p) == []
    assert clean(p) is False


def _pyproject_requirements() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"].values()
    return list(project["dependencies"]) + [s for group in extras for s in group]


def test_environment_yml_installs_from_the_lock():
    # conda gives Python and pip; the packages come from pip under the lock, as
    # in `make install`, so a conda user gets the versions CI tested
    text = (ROOT / "environment.yml").read_text().split("\ndependencies:", 1)[1]
    items = [m.group(1).strip() for m in re.finditer(r"^\s+- (\S.*)$", text, re.M)]
    conda = [i for i in items[:items.index("pip:")]]
    assert conda[0] == "python=3.11" and conda[1:] == ["pip"], conda
    assert items[items.index("pip:") + 1:] == ["-c requirements.lock", "torch==2.13.0",
                                                "-e .[dev]"]
    assert "-c $(LOCK)" in (ROOT / "Makefile").read_text()


def test_the_lock_pins_every_dependency_within_its_range():
    from packaging.requirements import Requirement

    from labkit.cli.lock import read

    pins = read(ROOT / "requirements.lock")
    assert pins["torch"] == "2.13.0"
    for spec in _pyproject_requirements():
        req = Requirement(spec)
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        assert name in pins, f"requirements.lock does not pin {name} ({spec})"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"requirements.lock pins {name}=={pins[name]}, outside pyproject's {spec}")


@pytest.mark.skipif(os.environ.get("LABKIT_ENV") in ("newest", "torch"),
                    reason="the newest-releases environment is not the locked one")
def test_the_installed_versions_are_the_locks():
    # `make install` installed every package the lock names at its pin; a
    # developer's extra packages (not in the lock) are not checked
    from labkit.cli.lock import installed, read

    have = installed()
    off = {n: (v, have[n]) for n, v in read(ROOT / "requirements.lock").items()
           if n in have and have[n] != v}
    assert not off, f"installed versions differ from the lock (pinned, installed): " \
                    f"{off}; run `make install`"


def test_torch_is_pinned_where_it_is_installed_and_a_tested_range_elsewhere():
    # make install takes the lock's torch first (a plain `pip install torch` can
    # pull a CUDA build of several GB); pyproject allows what make test-torch tests
    from packaging.requirements import Requirement

    from labkit.ledger._torch_memtracker import TESTED_TORCH

    assert "TORCH  := torch==2.13.0" in (ROOT / "Makefile").read_text()
    assert "TORCH_OTHER ?= torch==2.14.1" in (ROOT / "Makefile").read_text()
    (torch,) = [Requirement(s) for s in _pyproject_requirements()
                if Requirement(s).name == "torch"]
    for version in ("2.13.0", "2.14.1"):
        assert torch.specifier.contains(version), f"pyproject's {torch} leaves out " \
                                                  f"{version}, a tested release"
        assert version.rsplit(".", 1)[0] in TESTED_TORCH, (version, TESTED_TORCH)
    assert not torch.specifier.contains("2.15.0"), f"{torch}: 2.15 is untested"


def test_readme_starts_with_the_two_commands():
    text = (ROOT / "README.md").read_text()
    first_block = text.split("```")[1]
    assert "make lab" in first_block and "make test" in first_block
    for heading in ("For students", "For lecturers", "For cluster users", "conda",
                    "Troubleshooting"):
        assert heading in text


def test_ci_runs_make_test():
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_the_wheel_holds_every_module(tmp_path):
    # packages are found automatically: a new layer folder must not be left out.
    # Built from a copy, so that build/ and *.egg-info never land in the tree.
    src = tmp_path / "src"
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info")
    shutil.copytree(ROOT / "labkit", src / "labkit", ignore=skip)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                          "--no-build-isolation", "--no-index", "-q", "-w",
                          str(tmp_path / "dist"), str(src)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    (wheel,) = (tmp_path / "dist").glob("labkit-*.whl")
    with zipfile.ZipFile(wheel) as z:
        packed = {n for n in z.namelist() if n.startswith("labkit/")}
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "labkit").rglob("*.py")
               if "__pycache__" not in p.parts}
    assert len(modules) > 20
    assert sorted(modules - packed) == []


def test_make_student_and_browser_test_are_wired():
    make = (ROOT / "Makefile").read_text()
    for target in ("student", "browser-test"):
        assert re.search(rf"^{target}: install$", make, re.M), target
    # `make test` runs the browser test exactly where Chromium is, and only once
    # (its steps, each timed, in TEST_STEPS)
    (steps,) = re.findall(r"^TEST_STEPS := (.*)$", make, re.M)
    assert steps.split()[:4] == ["install", "lint", "test-lib", "test-notebooks"], steps
    assert steps.endswith(" $(if $(wildcard $(CHROMIUM)),browser-test)"), steps
    assert steps.count("browser-test") == 1, steps
    assert re.search(r"^test:\n\t@\$\(PYTHON\) -m labkit\.cli\.steps "
                     r"\$\(TEST_STEPS\)$", make, re.M)
    assert "pytest tests -q --ignore=tests/browser" in make
    assert "dist/" in (ROOT / ".gitignore").read_text().split()


def test_ci_installs_debians_chromium_and_a_cjk_font_never_a_downloaded_one():
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"apt-get install .*\\\n\s+chromium fonts-wqy-microhei", ci)
    assert ci.index("apt-get install") < ci.index("\nmake test")
    for name in ("Makefile", ".ci/run"):
        code = [ln.split("#")[0] for ln in (ROOT / name).read_text().splitlines()]
        assert not any("playwright install" in ln for ln in code), name
    assert "fonts-wqy-microhei" in (ROOT / "README.md").read_text()


def _glossary(path) -> list[tuple[str, str]]:
    """(English, 中文) pairs of a chapter's glossary table, a row "a / b | x / y"
    split into its terms, a parenthesis in the English dropped."""
    pairs = []
    for cell in json.loads(path.read_text())["cells"]:
        text = "".join(cell["source"])
        if cell["cell_type"] != "markdown" or "| English | 中文 |" not in text:
            continue
        for line in text.split("| English | 中文 |", 1)[1].splitlines():
            m = re.fullmatch(r"\|\s*(.+?)\s*\|\s*(.+?)\s*\|\s*", line)
            if not m or set(m[1]) <= set("-: "):
                continue
            en = [re.sub(r"\s*\(.*?\)", "", e).strip().lower()
                  for e in m[1].split(" / ")]
            zh = [z.strip() for z in m[2].split(" / ")]
            pairs += zip(en, zh) if len(en) == len(zh) else [(m[1].lower(), m[2])]
    return pairs


def test_every_chapter_has_a_glossary_and_a_term_has_one_translation():
    seen: dict[str, tuple[str, str]] = {}
    for path in NOTEBOOKS:
        pairs = _glossary(path)
        assert len(pairs) >= 5, f"{path.name}: no glossary (| English | 中文 |)"
        for en, zh in pairs:
            first = seen.setdefault(en, (zh, path.name))
            assert first[0] == zh, (f"{en!r} is {first[0]} in {first[1]} but {zh} "
                                    f"in {path.name}")
        assert "规约" not in path.read_text(), f"{path.name}: 归约, not 规约"
    assert len(seen) > 100
