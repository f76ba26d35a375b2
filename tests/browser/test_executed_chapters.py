"""The chapters with widgets other than the live one (test_widget_chapters.py),
opened in JupyterLab as they ran under nbval (_build/executed/, written by `make
test-notebooks`; each chapter executes once per run): no cell shows an error,
every markdown image loads, and every widget is drawn from its stored state,
figures included. A file of its own, so that pytest-xdist's two workers share
the browser tests evenly. Screenshots go to _build/browser/.
"""

from __future__ import annotations

import json

import pytest

from tests.browser.lab_page import (
    CHAPTERS,
    LIVE,
    chapter_page,
    check_cells_and_images,
    open_saved,
    stored_widgets,
)

pytestmark = pytest.mark.slow  # whole chapters in a browser


@pytest.mark.parametrize("chapter", [c for c in CHAPTERS if c != LIVE],
                         ids=lambda p: p.stem)
def test_executed_chapter_shows_its_outputs_and_stored_widgets(chapter, lab, browser,
                                                               shots):
    nb = json.loads((lab.root / "executed" / chapter.name).read_text(encoding="utf-8"))
    name = f"{chapter.stem}.executed"
    with chapter_page(browser, lab, shots, name) as page:
        errors = open_saved(page, lab, f"executed/{chapter.name}", nb)
        page.screenshot(path=str(shots / f"{name}.png"))
        check_cells_and_images(page, nb, errors)
        drawn = stored_widgets(page, nb)
        print(f"{chapter.name}: {drawn} widgets drawn from their stored state")
