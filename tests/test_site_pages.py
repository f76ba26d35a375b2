"""The site's own pages (labkit/cli/site.py), built from the chapters: what the
landing page, the lecturer's page, the glossary, the references and the formula
sheet say is what the notebooks hold."""

import json
import re
from pathlib import Path

from labkit.cli import references, site, student
from labkit.cli.search_text import page_text, tex_text

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def _cells(path):
    return json.loads(path.read_text(encoding="utf-8"))["cells"]


def test_every_citation_has_a_full_reference_and_every_reference_a_citation():
    texts = site._texts(NOTEBOOKS, "markdown")
    assert references.unknown_citations(texts) == [], (
        "author-year citations with no entry in labkit/cli/references.py")
    uncited = [ref for ref, where in references.cited_in(texts) if not where]
    assert uncited == [], f"references no chapter cites: {uncited}"
    page = site.references_page(NOTEBOOKS)
    assert page.count("\n- ") == len(references.REFERENCES)
    # 14 (putting it together) cites Megatron-LM at scale; 13 (failures) may too
    (line,) = [ln for ln in page.splitlines() if "arXiv:2104.04473" in ln]
    assert re.search(r"\*Cited in chapters 09, 10, (13, )?14\.\*$", line), (
        f"Narayanan et al. 2021: {line!r}, cited in chapters 09, 10, 14 expected")


def test_a_citation_the_list_lacks_is_found():
    texts = {"99": "as shown (Nobody et al. 2031, sec. 2), and (Llama Team 2024)"}
    assert references.unknown_citations(texts) == ["99: Nobody et al. 2031"]


def test_teaching_page_lists_every_exercise_with_its_points():
    chapters = [site.chapter(p) for p in NOTEBOOKS]
    for path, ch in zip(NOTEBOOKS, chapters):
        stubs = [c for c in _cells(path) if student.EXERCISE in student.tags(c)]
        assert [p for _, p in ch.exercises] == [student.points(c) for c in stubs]
        assert not any(name.startswith(("Exercise ", "*")) for name, _ in ch.exercises
                       ), f"{path.stem}: exercises named {ch.exercises}"
    page = site.teaching_page(chapters)
    rows = re.findall(r"^\| \d\d \| .+ \| [\d.]+ \|$", page, flags=re.M)
    assert len(rows) == sum(len(c.exercises) for c in chapters) >= 40
    long = [c for c in chapters if c.sessions > 1]
    assert long and all(f"{c.title} (part 2 of" in page for c in long)
    assert all(c.objectives for c in chapters), "each chapter lists its sections"


def test_glossary_holds_every_chapters_terms():
    chapters = [site.chapter(p) for p in NOTEBOOKS]
    page = site.glossary_page(chapters)
    for c in chapters:
        assert c.glossary, f"{c.stem} has no glossary table"
        for english, chinese in c.glossary:
            assert f"| {english.replace('|', chr(92) + '|')} | {chinese}" in page


def test_formula_sheet_has_every_closed_form_a_chapter_calls():
    page = site.formula_page(NOTEBOOKS)
    code = site._texts(NOTEBOOKS, "code")
    called = {name for name, _, _ in site.closed_forms()
              if any(re.search(rf"\b{name}\(", t) for t in code.values())}
    assert called >= {"ring_bytes_per_rank", "zero_memory", "expert_traffic",
                      "context_parallel_traffic", "pipeline_bubble"}
    for name in called:
        assert f"**`{name}(" in page, name
    assert "Follows: Korthikanti" in page


def test_landing_page_says_what_the_course_is():
    chapters = [site.chapter(p) for p in NOTEBOOKS]
    page = site.index_page(chapters, "public", None)
    for words in ("For whom", "Prerequisites", "Get it", "Start", "make lab"):
        assert words in page
    assert len(re.findall(r"^\| \[", page, flags=re.M)) == len(NOTEBOOKS)
    assert "https://example.org/lab" in site.index_page(chapters, "public",
                                                        "https://example.org/lab")


def test_search_text_reads_formulas_in_plain_letters():
    assert tex_text(r"\(2\frac{N-1}{N}M\)") == "2(N-1)/N M"
    assert tex_text(r"\(\alpha + \beta \cdot n\)") == "α + β · n"
    assert tex_text(r"\(16\Psi/N_d\)") == "16Ψ/N_d"
    assert tex_text(r"\(\mathrm{busbw} = \frac{2(n-1)}{n}\)") == (
        "busbw = (2(n-1))/n")
    # a command it does not know loses its backslash, never shows as TeX
    assert "\\" not in tex_text(r"\(\widehat{x} \oplus y\)")


def test_search_text_is_the_article_without_buttons_or_outputs():
    html = """<html><body><main role="main"><button>Settings Light Dark</button>
    <article class="bd-article"><h1>Ring<a class="headerlink">#</a></h1>
    <p>It sends <span class="math">\\(2\\frac{N-1}{N}M\\)</span> , in all.</p>
    <div class="cell_input"><pre><span>x</span><span>.</span><span>sum</span>()</pre>
    </div><div class="cell_output"><pre>tensor([6.])</pre></div>
    <div class="jupyter-widgets">slider</div></article></main></body></html>"""
    assert page_text(html) == "Ring It sends 2(N-1)/N M, in all. x.sum()"


def test_speaker_notes_are_an_aside_on_the_site(tmp_path):
    nb = {"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [
        {"cell_type": "markdown", "id": "a", "metadata": {}, "source": ["## 1. Why"]},
        {"cell_type": "markdown", "id": "b", "metadata": {"tags": ["notes"]},
         "source": ["*Speaker notes.*\n", "\n", "- Land: `2(N-1)/N`."]}]}
    path = tmp_path / "x.ipynb"
    path.write_text(json.dumps(nb))
    site.notes_as_asides(path)
    cells = _cells(path)
    assert student.source(cells[0]) == "## 1. Why"
    assert student.source(cells[1]) == (
        "````{admonition} Speaker notes\n:class: labkit-notes\n"
        "- Land: `2(N-1)/N`.\n````")
