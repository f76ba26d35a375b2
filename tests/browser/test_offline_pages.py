"""`make slides` and `make book` opened with the network cut off, as in a lecture hall
without Wi-Fi: Chromium may load file:// and localhost only, anything else is
aborted (and listed in the failure).

The chapters come as they ran under nbval (_build/executed/, the conftest's
`executed`: nothing is executed again), in their public edition (editions.py: no
solutions). Chapter 02's slide deck (math, subslides, a widget with a figure),
beside a copy of _build/vendor/ as the Makefile lays it out, opens from disk,
navigates (next, down, overview), its ring stepper's step slider works with no
kernel (dragged through every step, each shows its own state), and MathJax
typesets every formula (no raw `$...$`
or `\\(...\\)` left in the text); on a 1280x720 screen every slide, the first
included, fits or scrolls, and no code runs off its side. The book's site is built
from every executed chapter and served on localhost: the walk goes from the index
through every chapter by "next" to the lecturer's, glossary, references and formula
pages, chapter 02 shows its math, every chapter that stored widgets shows their
figures; a widget's controls are disabled and it is marked a snapshot, except
controls whose states were drawn ahead (chapter 02's ring step, the ZeRO
explorer's stage and precision), which are moved through every value and must
show the state they name; no code block runs off the side of the page, no
figure is shrunk to fit it (its smallest text stays ≥ 10 px at 1280 px), and no
solution is on a page or in a page's download; search finds pages and shows
their text around the query, from disk as over http.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
import sys
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from labkit.cli import editions, vendor
from labkit.cli import site as course_site
from labkit.cli.page_assets import PARTLY_LIVE_NOTE, SNAPSHOT_NOTE
from labkit.cli.student import SOLUTION, source, tags
from labkit.viz.widgets import LIVE_CLASS, STAGES

ROOT = Path(__file__).resolve().parents[2]
CHAPTER = ROOT / "notebooks" / "02_ring_allreduce.ipynb"
SECONDS = 60  # a page's scripts on 2 busy cores; loading from disk takes ~2 s

# MathJax done: loaded, its queue empty, and at least one formula typeset.
MATH_DONE = """() => window.MathJax && MathJax.isReady
  && MathJax.Hub.queue.pending === 0
  && document.querySelectorAll('.MathJax_CHTML, .mjx-chtml').length > 0"""
# TeX left as text in the rendered markdown: $...$, $$...$$, \(...\), \[...\]
RAW_TEX = re.compile(r"\$[^$\s][^$]*\$|\\\(|\\\[")
TEXT_JS = """() => [...document.querySelectorAll(
  '.jp-RenderedMarkdown, article .cell_markdown, article section > p')]
  .map(e => e.innerText).join('\\n')"""


def _run(*args: str, cwd: Path):
    out = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True,
                         text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]


@pytest.fixture(scope="module")
def site_dir(tmp_path_factory, executed) -> Path:
    """tmp/chapters/ (the executed chapters), tmp/vendor/, tmp/images/."""
    tmp = tmp_path_factory.mktemp("offline")
    _run("-m", "labkit.cli.vendor", str(ROOT / "_build" / "vendor"), cwd=ROOT)
    shutil.copytree(ROOT / "_build" / "vendor", tmp / "vendor")
    shutil.copytree(ROOT / "images", tmp / "images")
    (tmp / "chapters").mkdir()
    for nb in (ROOT / "notebooks").glob("*.ipynb"):
        shutil.copy(executed / nb.name, tmp / "chapters" / nb.name)
    return tmp


@pytest.fixture(scope="module")
def deck(site_dir) -> Path:
    """Chapter 02's deck from its public edition, as `make slides` makes it."""
    flags = vendor.flags("../vendor", site_dir / "vendor")
    editions.write(site_dir / "chapters", site_dir / "public", "public", deck=True)
    _run("-m", "nbconvert", "--to", "slides", "--output-dir", "../slides", *flags,
         "--SlidesExporter.reveal_scroll=True", CHAPTER.name,
         cwd=site_dir / "public")
    return site_dir / "slides" / f"{CHAPTER.stem}.slides.html"


@pytest.fixture(scope="module")
def book(site_dir):
    """The site, served on 127.0.0.1: yields its base URL."""
    course_site.build(site_dir / "chapters", site_dir / "book", site_dir / "vendor")
    handler = functools.partial(_Quiet, directory=str(site_dir / "book"))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def offline(browser):
    """A page that may load file:// (and localhost) only; what it tried beyond
    that, and what failed to load, are listed in .blocked and .failed."""
    context = browser.new_context()
    blocked, failed = [], []

    def guard(route):
        url = route.request.url
        if url.startswith(("file://", "data:", "http://127.0.0.1", "http://localhost")):
            route.continue_()
        else:
            blocked.append(url)
            route.abort()

    context.route("**/*", guard)
    page = context.new_page()
    # a load cut short by leaving the page (ERR_ABORTED) is not a missing file
    page.on("requestfailed", lambda r: r.failure == "net::ERR_ABORTED"
            or failed.append(f"{r.url} ({r.failure})"))
    page.blocked, page.failed = blocked, failed
    try:
        yield page
    finally:
        context.close()


def _check_loaded_alone(page) -> None:
    assert not page.blocked, f"the page asked the network for {page.blocked}"
    assert not page.failed, f"files missing beside the page: {page.failed}"


def _check_math(page, shots: Path, name: str) -> None:
    page.wait_for_function(MATH_DONE, timeout=SECONDS * 1000)
    typeset = page.locator(".mjx-chtml.MathJax_CHTML").count()
    raw = RAW_TEX.findall(page.evaluate(TEXT_JS))
    page.screenshot(path=str(shots / f"offline_{name}.png"))
    assert typeset > 0 and not raw, (
        f"{name}: {typeset} formulas typeset by MathJax, TeX left as text: {raw[:5]}")


@pytest.mark.slow
def test_slides_navigate_and_typeset_offline(deck, offline, shots):
    page = offline
    page.goto(deck.as_uri())
    page.wait_for_selector(".reveal.ready", timeout=SECONDS * 1000)  # reveal.js up
    _check_math(page, shots, "slides")
    moves = []
    for key, want in (("ArrowRight", "#/1"), ("ArrowDown", "#/1/1")):
        page.keyboard.press(key)
        page.wait_for_function(f"() => location.hash === '{want}'",
                               timeout=SECONDS * 1000)
        moves.append(page.evaluate("location.hash"))
    assert moves == ["#/1", "#/1/1"], f"next, down went to {moves}"
    page.wait_for_selector(".labkit-snapshot", state="attached",
                           timeout=SECONDS * 1000)
    page.evaluate(TO_WIDGET_JS)  # the slide with the ring stepper
    page.wait_for_timeout(1000)  # reveal's transition
    assert _check_snapshots(page, shots, "slides") == ["step"]
    page.keyboard.press("Escape")  # reveal.js's overview of all slides
    page.wait_for_selector(".reveal.overview", timeout=SECONDS * 1000)
    _check_loaded_alone(page)


# go to the first slide holding a widget
TO_WIDGET_JS = """() => {
  const s = document.querySelector('.labkit-snapshot').closest('section');
  const top = [...document.querySelectorAll('.slides > section')];
  const h = top.findIndex(x => x.contains(s));
  const v = [...top[h].querySelectorAll(':scope > section')].indexOf(s);
  location.hash = `#/${h}/${Math.max(v, 0)}`;
}"""


# the slide shown: whether it is taller than the screen without scrolling, and
# how many of its code blocks run off their side
SLIDE_JS = """() => {
  const s = document.querySelector('section.present section.present')
            || document.querySelector('section.present');
  const clipped = [...s.querySelectorAll('pre')]
    .filter(e => e.scrollWidth > e.clientWidth + 1).length;
  const scrolls = ['auto', 'scroll'].includes(getComputedStyle(s).overflowY);
  return {hash: location.hash, cut: s.scrollHeight > s.clientHeight + 2 && !scrolls,
          clipped: clipped};
}"""


@pytest.mark.slow
def test_every_slide_fits_or_scrolls_on_a_projector(deck, browser, shots):
    page = browser.new_page(viewport={"width": 1280, "height": 720})
    try:
        page.goto(deck.as_uri())
        page.wait_for_selector(".reveal.ready", timeout=SECONDS * 1000)
        page.wait_for_function(MATH_DONE, timeout=SECONDS * 1000)
        page.wait_for_timeout(2000)  # the deck's fit runs again after typesetting
        # no slide transition (reveal's are CSS transitions; the deck loads reveal
        # through require.js, so there is no global to configure): each slide
        # is laid out where it stops at once
        page.add_style_tag(content=".reveal .slides section, .reveal .slides "
                           "section * { transition: none !important; }")
        page.screenshot(path=str(shots / "slides_first.png"))
        seen, bad = [], []
        while True:
            state = page.evaluate(SLIDE_JS)
            if state["hash"] in seen:
                break
            seen.append(state["hash"])
            if state["cut"] or state["clipped"]:
                bad.append(state)
            page.keyboard.press("Space")  # next (sub)slide; the last stays put
            page.wait_for_timeout(120)  # two frames and more, without a transition
        assert len(seen) > 5, f"walked only {seen}"
        assert not bad, (f"slides cut off below the screen without a scrollbar, or "
                         f"with code running off the side: {bad}")
    finally:
        page.close()


@pytest.mark.slow
def test_book_walks_from_the_index_to_the_last_chapter_offline(book, site_dir, offline,
                                                               shots):
    widgets = _stored_widgets(site_dir / "chapters")
    assert CHAPTER.stem in widgets, widgets
    page = offline
    page.goto(book + "index.html")
    listed = page.locator("article .toctree-wrapper a.reference").all_inner_texts()
    want = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert [t.split(" ")[0] for t in listed] == [w[:2] for w in want] + [
        "Teaching", "Glossary", "References", "Formula"], listed
    article = page.inner_text("article")
    assert "how large models are trained" in article and "Prerequisites" in article
    page.screenshot(path=str(shots / "book_index.png"))
    walked, figures, clipped, live, shrunk = [], [], {}, {}, {}
    while page.locator("a.right-next").count():
        page.locator("a.right-next").first.click()
        page.wait_for_load_state("load")
        walked.append(page.url.rsplit("/", 1)[-1].removesuffix(".html"))
        if walked[-1] == CHAPTER.stem:
            _check_math(page, shots, "book")
        if walked[-1] in widgets:
            _check_widget_figures(page)
            live[walked[-1]] = _check_snapshots(page, shots, walked[-1])
            figures.append(walked[-1])
        wide = page.evaluate(CLIPPED_JS)
        if wide:
            clipped[walked[-1]] = wide
        small = page.evaluate(SHRUNK_JS)
        if small:
            shrunk[walked[-1]] = small
        if page.evaluate(PANEL_OVERFLOWS_JS):  # the narrowed contents panel
            shrunk.setdefault(walked[-1], []).append("contents panel overflows")
    assert walked == want + ["teaching", "glossary", "references", "formulas"], (
        f"index, then next: {walked}")
    assert not clipped, f"code blocks that run off the page's side: {clipped}"
    assert not shrunk, (f"figures shown under 96 % of their size, their smallest "
                        f"text below 10 px (natural/shown px), or a contents "
                        f"panel cut off: {shrunk}")
    assert not (site_dir / "book" / "genindex.html").exists(), "an empty index page"
    assert figures == sorted(widgets), f"pages whose widgets' figures show: {figures}"
    # the ring stepper's step and the ZeRO explorer's stage and precision work
    # on the page with no kernel; the chapters that show them:
    assert {k: v for k, v in live.items() if v} == {
        "02_ring_allreduce": ["step"], "04_memory_anatomy": ["precision", "stage"],
        "06_zero": ["precision", "stage"]}, live
    assert page.locator("a.left-prev").count(), "the last chapter links back"
    _check_loaded_alone(page)


@pytest.mark.slow
def test_book_search_finds_chapters_offline(book, site_dir, offline):
    """Over http and from disk (file://, where a page may not fetch another),
    search finds the chapter and shows a snippet of its text: the query's
    words, no theme buttons, no raw TeX."""
    page = offline
    for base in (book, (site_dir / "book").as_uri() + "/"):
        page.goto(base + "search.html?q=all-reduce")
        found = page.locator("#search-results li")
        found.first.wait_for(timeout=SECONDS * 1000)
        page.wait_for_function(
            "() => [...document.querySelectorAll('#search-results li')]"
            ".every(li => li.querySelector('p.context'))", timeout=SECONDS * 1000)
        titles = found.locator("a").all_inner_texts()
        assert any(CHAPTER.stem[:2] in t for t in titles), titles
        snippets = found.locator("p.context").all_inner_texts()
        bad = [t for t in snippets if re.search(
            r"Settings|Light|Dark|\\\(|\\frac|\$", t)]
        assert not bad, f"{base}: snippets with the theme's buttons or TeX: {bad}"
        assert sum("all-reduce" in t.lower() for t in snippets) >= len(
            snippets) // 2, f"{base}: snippets without the query: {snippets}"
        _check_loaded_alone(page)


# figures the page shows at under 96 % of their size: a chart's smallest text,
# 7.5 pt (labkit.viz.style.MIN_FONT_PT: 10.4 px at 100 dpi), lands under 10 px
SHRUNK_JS = """() => [...document.querySelectorAll('article img')]
  .filter(e => e.complete && e.clientWidth > 0
               && 0.96 * e.naturalWidth > e.clientWidth)
  .map(e => `${e.src.split('/').pop().slice(0, 16)} ${e.naturalWidth}/`
            + `${e.clientWidth}`)"""


# the page's contents panel (narrowed so a chart fits the column) wider inside
# than its box: an entry cut off at the window's edge
PANEL_OVERFLOWS_JS = """() => { const s = document.querySelector(
  '.bd-sidebar-secondary'); return !!s && s.scrollWidth > s.clientWidth + 1; }"""


# code blocks of the page wider than their box (a sideways scrollbar, or clipped)
CLIPPED_JS = """() => [...document.querySelectorAll('article pre')]
  .filter(e => e.scrollWidth > e.clientWidth + 1)
  .map(e => e.innerText.split('\\n')[0].slice(0, 60))"""


def _check_snapshots(page, shots: Path, name: str) -> list[str]:
    """Every widget with controls says what works on a static page: controls
    whose states were drawn ahead (LIVE_CLASS) are enabled, all others disabled,
    and the line above it tells which. Returns the live controls' labels, each
    moved through its values by _check_live."""
    page.wait_for_function(
        "() => document.querySelectorAll('.labkit-snapshot').length > 0",
        timeout=SECONDS * 1000)
    roots = page.locator(".labkit-snapshot")
    moved = []
    for k in range(roots.count()):
        root = roots.nth(k)
        enabled = root.evaluate("""(r, live) => [...r.querySelectorAll(
            'input, select, button, textarea, .noUi-target')]
            .filter(c => !c.hasAttribute('disabled'))
            .map(c => c.closest('.' + live) ? 'live' : 'frozen')""", LIVE_CLASS)
        assert "frozen" not in enabled, (
            f"{name}: widget {k} has a control enabled that no kernel answers")
        badge = root.evaluate("r => r.firstElementChild.innerText")
        want = PARTLY_LIVE_NOTE if enabled else SNAPSHOT_NOTE
        assert badge == want, f"{name}: widget {k} is marked {badge!r}"
        moved += _check_live(page, root, shots, f"{name}-{k}")
    roots.first.scroll_into_view_if_needed()
    page.screenshot(path=str(shots / f"book_{name}_snapshot.png"))
    return moved


# what the caption of the state shown must say for a live control's value
SAYS = {"step": lambda v: f"after step {v} of",
        "stage": lambda v: f"{STAGES[int(v)]} keeps"}
# the caption and figure of the state a widget shows (the others are hidden)
SHOWN_JS = """r => [...r.querySelectorAll(
  '.widget-html-content, .widget-output img')].filter(e => e.offsetParent)
  .map(e => e.tagName === 'IMG' ? e.src.slice(-40) : e.innerText).join(' | ')"""


def _check_live(page, root, shots: Path, name: str) -> list[str]:
    """Move each live control of a widget through every value, in the browser
    with no kernel: each value shows its own figure and caption, the caption
    agrees with the value, and going back shows the first state again."""
    moved = []
    for control in root.locator(f".{LIVE_CLASS}").all():
        label = control.locator(".widget-label").inner_text().strip()
        control.scroll_into_view_if_needed()
        start = root.evaluate(SHOWN_JS)
        seen = {}
        if control.locator("select").count():
            select = control.locator("select")
            first = select.evaluate("s => s.selectedIndex")
            values = select.locator("option").all_inner_texts()
            for i, v in enumerate(values):
                select.select_option(index=i)
                seen[v] = _shown_after(page, root, seen)
            select.select_option(index=first)
        else:  # dragged with the mouse, as in a lecture (a deck takes the keys)
            handle = control.locator(".noUi-handle")
            lo, hi, first = (float(handle.get_attribute(a)) for a in (
                "aria-valuemin", "aria-valuemax", "aria-valuenow"))
            for v in [*range(int(lo), int(hi) + 1), first]:
                _drag(page, control, handle, (v - lo) / (hi - lo))
                now = float(handle.get_attribute("aria-valuenow"))
                assert now == v, f"{name}: dragged '{label}' to {v}, it shows {now}"
                if v == first and len(seen) == hi - lo + 1:
                    break  # back where it started
                seen[v] = _shown_after(page, root, seen)
                if label in SAYS:
                    assert SAYS[label](int(v)) in seen[v], (
                        f"{name}: '{label}' at {v:g} shows {seen[v]!r}")
        root.screenshot(path=str(shots / f"book_{name}_{label}.png"))
        assert len(set(seen.values())) == len(seen) > 1, (
            f"{name}: '{label}' moved through {list(seen)}; states shown: {seen}")
        back = root.evaluate(SHOWN_JS)
        for _ in range(20):
            if back == start:
                break
            page.wait_for_timeout(50)
            back = root.evaluate(SHOWN_JS)
        assert back == start, (
            f"{name}: '{label}' back at its first value shows {back!r}, not "
            f"{start!r}")
        moved.append(label)
    return moved


def _drag(page, control, handle, fraction: float) -> None:
    """Drag a slider's handle to `fraction` of its track, with the mouse."""
    track = control.locator(".noUi-target").bounding_box()
    box = handle.bounding_box()
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    page.mouse.down()
    page.mouse.move(track["x"] + fraction * track["width"],
                    box["y"] + box["height"] / 2, steps=4)
    page.mouse.up()


def _shown_after(page, root, seen: dict) -> str:
    """The state shown once it is not one already seen (the switch is a DOM
    change, drawn on the next frame), or after a second if it stays."""
    for _ in range(20):
        shown = root.evaluate(SHOWN_JS)
        if shown and shown not in seen.values():
            return shown
        page.wait_for_timeout(50)
    return shown


@pytest.mark.slow
def test_public_site_has_no_solution(book, site_dir):
    """No solution's own lines (those its stub and the rest of the chapter do not
    have) on a chapter's page or in the notebook its download button serves; the
    lecturer's build of the same chapters shows them (so the search could find
    them)."""
    chapters = sorted((site_dir / "chapters").glob("*.ipynb"))
    assert not _published_solutions(site_dir / "book", chapters)
    # the lecturer's build of one chapter (a whole site is a minute of CPU that
    # the other browser tests share) shows its solutions: the search finds them
    one = site_dir / "one-chapter"
    one.mkdir()
    shutil.copy(site_dir / "chapters" / "12_expert_parallel.ipynb", one)
    course_site.build(one, site_dir / "book-lecturer", site_dir / "vendor",
                      "lecturer")
    shown = _published_solutions(site_dir / "book-lecturer", sorted(one.glob("*")))
    assert list(shown) == ["12_expert_parallel"] and len(shown[
        "12_expert_parallel"]) > 5, shown


def _published_solutions(out: Path, chapters: list[Path]) -> dict[str, list[str]]:
    """Chapter -> the lines of its solutions found on its page or in its served
    notebook."""
    found = {}
    for path in chapters:
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        if not any(SOLUTION in tags(c) for c in cells):
            continue
        elsewhere = "\n".join(source(c) for c in cells if SOLUTION not in tags(c))
        own = {ln.strip() for c in cells if SOLUTION in tags(c)
               for ln in source(c).splitlines()
               if len(ln.strip()) > 24 and ln.strip() not in elsewhere}
        assert own, f"{path.name}: its solutions have no line of their own to look for"
        page = (out / "notebooks" / f"{path.stem}.html").read_text(encoding="utf-8")
        served = out / "_sources" / "notebooks" / f"{path.stem}.ipynb"
        assert f'href="../_sources/notebooks/{path.stem}.ipynb"' in page, (
            f"{path.stem}: the page's download button serves another file")
        texts = [_plain(page), "\n".join(source(c) for c in json.loads(
            served.read_text(encoding="utf-8"))["cells"])]
        leaked = sorted({ln for ln in own for t in texts if ln in t})
        if leaked:
            found[path.stem] = leaked
    return found


def _plain(html: str) -> str:
    """The page's text as a reader sees it: tags and entities out."""
    import html as entities

    return entities.unescape(re.sub(r"<[^>]+>", "", html))


def _stored_widgets(chapters: Path) -> set[str]:
    """The executed chapters that store an Output widget showing a figure."""
    out = set()
    for path in chapters.glob("*.ipynb"):
        state = json.loads(path.read_text(encoding="utf-8"))["metadata"].get(
            "widgets", {}).get("application/vnd.jupyter.widget-state+json", {})
        if any("image/png" in o.get("data", {})
               for m in state.get("state", {}).values()
               if m["model_name"] == "OutputModel" for o in m["state"]["outputs"]):
            out.add(path.stem)
    return out


def _check_widget_figures(page) -> None:
    views = page.locator('script[type="application/vnd.jupyter.widget-view+json"]')
    wanted = views.count()
    assert wanted > 0, "the executed chapter stored no widget view"
    page.wait_for_function(
        f"() => document.querySelectorAll('.widget-subarea').length >= {wanted}",
        timeout=SECONDS * 1000)
    sizes = page.evaluate("""() => [...document.querySelectorAll(
        '.widget-subarea .widget-output img')]
        .map(e => e.complete && e.naturalWidth)""")
    assert sizes and all(sizes), f"widget figures' widths in pixels: {sizes}"
