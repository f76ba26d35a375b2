"""A chapter saved in JupyterLab is byte for byte the committed one: a student or
lecturer who opens a chapter and saves it sees no change in git. The first
chapter (cell ids, speaker notes, slide marks), opened with its kernel up (the
kernel tells JupyterLab its language_info, which the save writes), then saved
through JupyterLab's own command; tests/test_project.py holds every chapter's
text to the same writer (labkit.cli.nbclean.as_saved) offline."""

from __future__ import annotations

import json

import pytest

from tests.browser.lab_page import ROOT, chapter_page, open_saved

pytestmark = pytest.mark.slow

FIRST = sorted((ROOT / "notebooks").glob("*.ipynb"))[0]


def test_a_save_in_jupyterlab_changes_nothing(lab, browser, shots, chapter=FIRST):
    path = f"notebooks/{chapter.name}"
    copy = lab.root / path
    committed = chapter.read_bytes()
    before = copy.stat().st_mtime_ns
    with chapter_page(browser, lab, shots, f"{chapter.stem}.save") as page:
        open_saved(page, lab, path, json.loads(committed))
        page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
    assert copy.stat().st_mtime_ns != before, f"JupyterLab did not write {path}"
    saved = copy.read_bytes()
    if saved != committed:
        import difflib
        diff = "".join(list(difflib.unified_diff(
            committed.decode().splitlines(True), saved.decode().splitlines(True),
            "committed", "saved by JupyterLab"))[:40])
        pytest.fail(f"{chapter.name}: a save in JupyterLab changed it; run `make "
                    f"clean-notebooks` (labkit.cli.nbclean.as_saved):\n{diff}")
