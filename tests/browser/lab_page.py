"""Driving JupyterLab's page from playwright: Run All through the menu, the
cells' state as JupyterLab's model holds it, markdown images, and the widgets'
sliders and dropdowns. JupyterLab renders only what is on screen, so whatever is
read is scrolled into view first."""

from __future__ import annotations

import contextlib
import json
import re
import time
from pathlib import Path

from labkit.cli.student import source, tags

ROOT = Path(__file__).resolve().parents[2]

RUN_ALL_SECONDS = 420  # a whole chapter on 2 busy cores; nbval allows 120 a cell
WIDGET_SECONDS = 60  # one control's effect (a widget may run ranks)
TRY_SECONDS = 10  # a move that may show nothing new: the next is tried after it

CELLS_JS = """path => {
  const where = o => {  // the cell's line that IPython marks with an arrow
    const lines = o.traceback.join('\\n').replace(/\\x1b\\[[0-9;]*m/g, '')
                   .split('\\n').filter(l => /^-+>/.test(l.trim()));
    return lines.length ? ' at ' + lines[0].trim() : '';
  };
  for (const w of window.jupyterapp.shell.widgets('main')) {
    if (!w.context || w.context.path !== path) continue;
    const cells = w.content.model.cells, out = [];
    for (let i = 0; i < cells.length; i++) {
      const c = cells.get(i), code = c.type === 'code';
      out.push({code, empty: !c.sharedModel.getSource().trim(),
        count: code ? c.executionCount : null,
        running: code && c.executionState === 'running',
        errors: code ? c.outputs.toJSON().filter(o => o.output_type === 'error')
                          .map(o => o.ename + ': ' + o.evalue + where(o)) : []});
    }
    return out;
  }
  return null;
}"""

# What a widget shows, its controls' values apart; images by a hash of their data.
VIEW_JS = """root => {
  const hash = s => { let h = 2166136261;
    for (let i = 0; i < s.length; i++) h = Math.imul(h ^ s.charCodeAt(i), 16777619);
    return (h >>> 0).toString(16) + ':' + s.length; };
  const imgs = [...root.querySelectorAll('.widget-output img')];
  const text = [...root.querySelectorAll(
      '.widget-html-content, .widget-output .jp-RenderedText, ' +
      '.widget-output .jp-RenderedHTMLCommon')].map(e => e.innerText);
  return {controls: [...root.querySelectorAll(
            '.widget-slider .widget-readout, .widget-dropdown select')]
            .map(e => e.tagName === 'SELECT' ? e.value : e.textContent),
          text: text.join('\\n'), images: imgs.map(e => hash(e.src)),
          loaded: imgs.every(e => e.complete && e.naturalWidth > 0)};
}"""


def wait(what: str, seconds: float, probe):
    """Poll probe() until it returns something true; fail saying `what`."""
    deadline = time.monotonic() + seconds
    while True:
        got = probe()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up after {seconds:.0f} s waiting for {what}")
        time.sleep(0.25)


def no_dialog(page):
    dialog = page.locator(".jp-Dialog")
    if dialog.count():
        raise AssertionError("JupyterLab opened a dialog: " + dialog.first.inner_text())


def run_all(page, path: str):
    page.wait_for_selector(".jp-Notebook .jp-Cell", state="attached", timeout=120_000)

    def kernel_ready():  # Run All before the kernel is up asks which kernel to start
        no_dialog(page)
        return "Idle" in page.inner_text("#jp-main-statusbar")

    wait("the kernel to start (Idle in the status bar)", 120, kernel_ready)
    page.click(".lm-MenuBar-itemLabel:text-is('Run')")
    page.click(".lm-Menu-itemLabel:text-is('Run All Cells')")

    seen: list = []

    def finished():
        no_dialog(page)
        cells = page.evaluate(CELLS_JS, path)
        status = page.inner_text("#jp-main-statusbar")
        if cells is None or "Idle" not in status or any(c["running"] for c in cells):
            return None
        stopped = any(c["errors"] for c in cells)  # Run All stops at an error
        done = all(c["count"] is not None
                   for c in cells if c["code"] and not c["empty"])
        # unchanged for 1.5 s: a reply (the count) may overtake its last output
        seen[:] = [*seen, cells][-7:] if seen and seen[-1] == cells else [cells]
        return cells if (done or stopped) and len(seen) == 7 else None

    return wait("Run All Cells to finish and the kernel to be Idle",
                 RUN_ALL_SECONDS, finished)


def scroll_through(page):
    """Bring every cell into view once: JupyterLab renders only what is on screen.
    A cell at a time, from here: with a page script that scrolled through at
    once instead, chapter 06's saved widget was once never drawn on a loaded
    machine (the cause not found), so this stays as it ran many times."""
    cells = page.locator(".jp-Notebook .jp-Cell")
    for i in range(cells.count()):
        cells.nth(i).scroll_into_view_if_needed()


def markdown_images(page) -> list[str]:
    """Each markdown image, scrolled into view: its src; fails if one is broken."""
    imgs, srcs = page.locator(".jp-MarkdownCell .jp-RenderedMarkdown img"), []
    for i in range(imgs.count()):
        img = imgs.nth(i)
        img.scroll_into_view_if_needed()
        img.evaluate("e => e.complete || new Promise(ok => "
                     "{ e.onload = e.onerror = ok; })")
        src = img.get_attribute("src")
        assert img.evaluate("e => e.naturalWidth") > 0, f"image did not load: {src}"
        srcs.append(src)
    return srcs


# ---------------------------------------------------------------------- controls


def slug(text: str, k: int) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or f"control{k}"


def controls(root):
    """(label, kind, locator) for each slider and dropdown of a widget."""
    out = []
    sliders = root.locator(".widget-slider")
    for i in range(sliders.count()):
        s = sliders.nth(i)
        out.append((s.locator(".widget-label").inner_text(), "slider", s))
    drops = root.locator(".widget-dropdown")
    for i in range(drops.count()):
        d = drops.nth(i)
        out.append((d.locator(".widget-label").inner_text(), "dropdown", d))
    return out


def tries(kind: str, control):
    """(moves, back): moves to try in turn until one changes what the widget shows
    (a slider's next steps; a dropdown's other options, since two may show the
    same thing: presets ZeRO-3 and FSDP place everything alike), and the move
    back to where the control was."""
    if kind == "slider":
        handle = control.locator(".noUi-handle")

        def value() -> float:
            return float(handle.get_attribute("aria-valuenow"))

        start, top = value(), float(handle.get_attribute("aria-valuemax"))
        key, undo = ("ArrowLeft", "ArrowRight") if start >= top else (
            "ArrowRight", "ArrowLeft")

        def back():
            for _ in range(8):
                if value() == start:
                    return
                handle.press(undo)

        return [lambda: handle.press(key)] * 3, back
    select = control.locator("select")
    i, n = select.evaluate("s => [s.selectedIndex, s.options.length]")
    moves = [lambda j=(i + d) % n: select.select_option(index=j) for d in range(1, n)]
    return moves, lambda: select.select_option(index=i)


def settle(root, seconds: float, what: str, done) -> dict:
    """The widget's view once done(view) holds, the kernel is Idle and nothing has
    changed for a second (a redraw sends the text first, the chart after it)."""
    deadline, seen = time.monotonic() + seconds, []
    while True:
        view = root.evaluate(VIEW_JS)
        idle = "Idle" in root.page.inner_text("#jp-main-statusbar")
        seen = [*seen[-1:], view]
        if idle and view["loaded"] and seen.count(view) == 2 and done(view):
            return view
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up after {seconds:.0f} s waiting for {what}")
        time.sleep(0.5)


def shows(view: dict) -> tuple:
    return view["text"], view["images"]


def exercise_widget(root, name: str, k: int, shots: Path,
                     seconds: float = WIDGET_SECONDS) -> list[str]:
    """Move each control of one widget and back; return what was checked. Moved
    (a step or an option at a time, up to a few), the text or the chart must
    change; moved back to the same controls, both must be what they were (the
    view follows the controls, it does not lag)."""
    root.scroll_into_view_if_needed()
    root.screenshot(path=str(shots / f"{name}-widget{k}.png"))
    done = []
    for j, (label, kind, control) in enumerate(controls(root)):
        before = settle(root, seconds, f"widget {k} to settle", lambda v: True)
        control.scroll_into_view_if_needed()
        moves, back = tries(kind, control)
        for t, move in enumerate(moves):
            move()
            final = t == len(moves) - 1
            try:
                after = settle(root, seconds if final else min(seconds, TRY_SECONDS),
                                f"'{label}' ({kind}) to change the widget's text or "
                                f"chart ({len(moves)} moves tried)",
                                lambda v, b=before: shows(v) != shows(b))
                break
            except AssertionError:
                if final:
                    raise
        assert after["controls"] != before["controls"], f"'{label}' did not move"
        root.screenshot(path=str(shots / f"{name}-widget{k}-{slug(label, j)}.png"))
        back()
        # a control that set another one (a model sets Ψ) cannot be undone here
        settle(root, seconds, f"'{label}' moved back: the same controls to show "
                "the same text and chart as before",
                lambda v, b=before: v["controls"] != b["controls"]
                or shows(v) == shows(b))
        done.append(f"{kind} '{label}'")
    return done


def new_page(browser):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(90_000)  # clicks and loads on 2 busy cores
    return page


def open_and_run(page, lab, path: str, nb: dict) -> list[str]:
    """Open `path` afresh (?reset: no workspace restored), Run All, and return
    the cells that show an error without a `raises-exception` tag."""
    page.goto(lab.url(f"lab/tree/{path}?reset&token={lab.token}"))
    cells = run_all(page, path)
    scroll_through(page)
    assert len(cells) == len(nb["cells"])
    return [f"cell {i}: {'; '.join(c['errors'])}" for i, c in enumerate(cells)
            if c["errors"] and "raises-exception" not in tags(nb["cells"][i])]


def widget_roots(page) -> list:
    """The outermost widget of each output (a widget shown inside another's
    Output is tried as part of it)."""
    roots = page.locator(".jp-Cell-outputArea .jp-OutputArea-output > .jupyter-widgets")
    return [roots.nth(k) for k in range(roots.count()) if not roots.nth(k).evaluate(
        "e => !!e.parentElement.closest('.jupyter-widgets')")]


def open_saved(page, lab, path: str, nb: dict) -> list[str]:
    """Open `path` as it was saved (nothing run) and return the cells that show an
    error without a `raises-exception` tag."""
    page.goto(lab.url(f"lab/tree/{path}?reset&token={lab.token}"))
    page.wait_for_selector(".jp-Notebook .jp-Cell", state="attached", timeout=120_000)

    def ready():  # the kernel up: the widget manager restores the stored state then
        no_dialog(page)
        return ("Idle" in page.inner_text("#jp-main-statusbar")
                and page.evaluate(CELLS_JS, path))

    cells = wait("the notebook to open and its kernel to be Idle", 120, ready)
    scroll_through(page)
    assert len(cells) == len(nb["cells"])
    return [f"cell {i}: {'; '.join(c['errors'])}" for i, c in enumerate(cells)
            if c["errors"] and "raises-exception" not in tags(nb["cells"][i])]


VIEW_MIME = "application/vnd.jupyter.widget-view+json"


def stored_widgets(page, nb: dict, seconds: float = 2 * WIDGET_SECONDS) -> int:
    # 2x: a large stored state, on 2 cores the other browser worker also uses
    """Every widget a cell's saved output shows is drawn from the notebook's stored
    state, its figures loaded; returns how many. A widget whose state was not
    stored shows as an error or as its text instead."""
    wanted = sum(VIEW_MIME in o.get("data", {}) for c in nb["cells"]
                 if c["cell_type"] == "code" for o in c["outputs"])
    state = nb["metadata"].get("widgets", {}).get(
        "application/vnd.jupyter.widget-state+json", {}).get("state", {})
    figures = sum("image/png" in o.get("data", {}) for m in state.values()
                  if m["model_name"] == "OutputModel" for o in m["state"]["outputs"])
    assert wanted, "the executed chapter's outputs show no widget"

    def drawn():
        scroll_through(page)
        roots = widget_roots(page)
        return roots if len(roots) == wanted else None

    roots = wait(f"{wanted} widgets drawn from the stored state", seconds, drawn)
    shown = 0
    for k, root in enumerate(roots):
        root.scroll_into_view_if_needed()
        view = wait(f"widget {k}'s figures to load", seconds,
                    lambda r=root: (v := r.evaluate(VIEW_JS))["loaded"] and v)
        assert view["text"] or view["images"], f"widget {k} is drawn empty"
        shown += len(view["images"])
    assert "Error displaying widget" not in page.inner_text(".jp-Notebook")
    assert shown >= min(figures, 1), (
        f"the stored state holds {figures} figures; the widgets show {shown}")
    return wanted


# ---------------------------------------------------------------------- chapters


def widget_factories() -> set[str]:
    """labkit.viz's names that make a widget: its ipywidgets classes and the
    functions that return one."""
    import typing

    import ipywidgets

    from labkit import viz

    names = set()
    for name in dir(viz):
        obj = getattr(viz, name)
        if isinstance(obj, type) and issubclass(obj, ipywidgets.Widget):
            names.add(name)
        elif callable(obj):
            try:
                ret = typing.get_type_hints(obj).get("return")
            except Exception:  # noqa: BLE001  (a hint that cannot resolve)
                continue
            if isinstance(ret, type) and issubclass(ret, ipywidgets.Widget):
                names.add(name)
    return names


def uses_widgets(nb: dict, factories: set[str]) -> bool:
    calls = r"\b(?:" + "|".join(sorted(factories)) + r")\s*\(" if factories else "$^"
    pattern = re.compile(rf"\bipywidgets\b|\binteract(?:ive)?\s*\(|{calls}")
    return any(c["cell_type"] == "code" and pattern.search(source(c))
               for c in nb["cells"])


def widget_chapters() -> list[Path]:
    factories = widget_factories()
    return [p for p in sorted((ROOT / "notebooks").glob("*.ipynb"))
            if uses_widgets(json.loads(p.read_text(encoding="utf-8")), factories)]


CHAPTERS = widget_chapters()
LIVE = ROOT / "notebooks" / "02_ring_allreduce.ipynb"  # the ring stepper


@contextlib.contextmanager
def chapter_page(browser, lab, shots, name: str):
    """A fresh page; the page's script errors saved beside the screenshots, the
    page closed and the kernels shut down after."""
    page = new_page(browser)
    page_errors: list[str] = []
    page.on("pageerror", lambda e: page_errors.append(str(e)))
    try:
        yield page
    finally:
        if page_errors:
            (shots / f"{name}.page-errors.txt").write_text("\n".join(page_errors))
        page.close()
        lab.shut_down_kernels()


def check_cells_and_images(page, nb: dict, errors: list[str]) -> None:
    """No cell shows an error; every markdown image the chapter links loads."""
    assert errors == [], "cells show errors:\n" + "\n".join(errors)
    linked = sum(len(re.findall(r"!\[[^\]]*\]\(|<img\b", source(c)))
                 for c in nb["cells"] if c["cell_type"] == "markdown")
    assert len(markdown_images(page)) == linked
