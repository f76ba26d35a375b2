"""The chapters with widgets in JupyterLab in Chromium, as a student sees them.

One chapter (LIVE: ranks that print, a widget with controls) is run as a student
runs it: Run ▸ Run All Cells from the menu, wait for the kernel's Idle, then no
cell shows an error unless tagged `raises-exception`, every markdown image loads,
and every slider and dropdown, moved (a step or an option at a time), changes its
widget's text or chart, and moved back gives the same text and chart again (the
view follows the controls, it does not lag).

The others are opened as they ran (test_executed_chapters.py). Screenshots go
to _build/browser/.
"""

from __future__ import annotations

import json

import pytest

from tests.browser.lab_page import (
    CHAPTERS,
    LIVE,
    chapter_page,
    check_cells_and_images,
    exercise_widget,
    markdown_images,
    new_page,
    open_and_run,
    open_saved,
    stored_widgets,
    widget_roots,
)

pytestmark = pytest.mark.slow  # whole chapters in a browser


def test_the_widget_chapters_are_found():
    found = {p.name[:2] for p in CHAPTERS}
    assert {"02", "04"} <= found, found  # the ring stepper, the ZeRO explorer
    assert LIVE in CHAPTERS


def test_chapter_runs_and_its_widgets_respond(lab, browser, shots):
    chapter = LIVE
    nb = json.loads(chapter.read_text(encoding="utf-8"))
    with chapter_page(browser, lab, shots, chapter.stem) as page:
        errors = open_and_run(page, lab, f"notebooks/{chapter.name}", nb)
        page.screenshot(path=str(shots / f"{chapter.stem}.png"))
        check_cells_and_images(page, nb, errors)
        checked = []
        for k, root in enumerate(widget_roots(page)):
            checked += exercise_widget(root, chapter.stem, k, shots)
        assert checked, f"{chapter.name} calls a widget but shows no slider or dropdown"
        print(f"{chapter.name}: {len(checked)} controls respond: {', '.join(checked)}")


SELFTEST = [
    ("markdown", "![ring](../images/ring_allreduce_4.svg) ![gone](nope.png)", []),
    ("code", "1 / 0", ["raises-exception"]),
    ("code", "import ipywidgets as W\n"
             "live, dead = W.IntSlider(1, description='live'), "
             "W.IntSlider(1, description='dead')\n"
             "text = W.HTML('live 1')\n"
             "live.observe(lambda c: setattr(text, 'value', f'live {c.new}'),\n"
             "             'value')\n"
             "W.VBox([live, dead, text])", []),
    ("code", "undefined_name", []),
]


def test_it_sees_errors_broken_images_and_dead_controls(lab, browser, shots):
    """The checks above can fail: a notebook with each fault, served beside the
    chapters."""
    nb = {"cells": [{"id": f"c{i}", "cell_type": kind, "source": text,
                     "metadata": {"tags": t},
                     **({"outputs": [], "execution_count": None} if kind == "code"
                        else {})} for i, (kind, text, t) in enumerate(SELFTEST)],
          "metadata": {"kernelspec": {"name": "python3", "language": "python",
                                      "display_name": "Python 3 (ipykernel)"}},
          "nbformat": 4, "nbformat_minor": 5}
    (lab.root / "selftest").mkdir(exist_ok=True)
    (lab.root / "selftest" / "faults.ipynb").write_text(json.dumps(nb))
    page = new_page(browser)
    try:
        errors = open_and_run(page, lab, "selftest/faults.ipynb", nb)
        assert [e.split(":")[0] for e in errors] == ["cell 3"]  # cell 1 is tagged
        assert "NameError" in errors[0]
        with pytest.raises(AssertionError, match="image did not load: .*nope.png"):
            markdown_images(page)
        (root,) = widget_roots(page)
        with pytest.raises(AssertionError, match="waiting for 'dead' .slider."):
            exercise_widget(root, "selftest", 0, shots, seconds=3)
    finally:
        page.close()
        lab.shut_down_kernels()


def test_it_sees_a_widget_whose_state_was_not_stored(lab, browser):
    """stored_widgets can fail: a saved widget view with no stored state."""
    view = {"model_id": "0" * 32, "version_major": 2, "version_minor": 0}
    nb = {"cells": [{"id": "c0", "cell_type": "code", "source": "W.IntSlider()",
                     "metadata": {}, "execution_count": 1, "outputs": [
                         {"output_type": "execute_result", "execution_count": 1,
                          "metadata": {}, "data": {
                              "application/vnd.jupyter.widget-view+json": view,
                              "text/plain": "IntSlider(value=0)"}}]}],
          "metadata": {"kernelspec": {"name": "python3", "language": "python",
                                      "display_name": "Python 3 (ipykernel)"}},
          "nbformat": 4, "nbformat_minor": 5}
    (lab.root / "selftest").mkdir(exist_ok=True)
    (lab.root / "selftest" / "unstored.ipynb").write_text(json.dumps(nb))
    lab.trust(lab.root / "selftest")
    page = new_page(browser)
    try:
        assert open_saved(page, lab, "selftest/unstored.ipynb", nb) == []
        with pytest.raises(AssertionError, match="1 widgets drawn from the stored"):
            stored_widgets(page, nb, seconds=2)  # none will come: 2 s tell it
    finally:
        page.close()
        lab.shut_down_kernels()
