"""labkit.cli.editions: the public edition the site and decks are built from has
no solution and no output naming an answer; the lecturer's keeps and labels them.
And the static decks leave set-up, asserts, checks and solutions out
(nbclean.deck_slide_type), where RISE, live, keeps every cell; they keep an idea
and its code on one slide while it fits a screen, and cut tall text at its
paragraphs (deck_layout)."""

import json

from labkit.cli import editions
from labkit.cli.deck_layout import (
    deck_slide_types,
    height,
    split_at_headings,
    split_tall_text,
)
from labkit.cli.nbclean import deck_slide_type, slide_type
from labkit.cli.student import SOLUTION, source, tags


def _code(text, *tag, outputs=("shown",)):
    return {"cell_type": "code", "id": text[:8].replace(" ", "_"), "source": [text],
            "metadata": {"tags": list(tag)}, "execution_count": 1,
            "outputs": [{"output_type": "stream", "name": "stdout", "text": [o]}
                        for o in outputs]}


def _md(text, *tag):
    return {"cell_type": "markdown", "id": "m" + str(abs(hash(text)) % 999),
            "source": [text], "metadata": {"tags": list(tag)}}


NB = {"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [
    _md("## Exercises"),
    _code("def f(x):\n    raise NotImplementedError('exercise: f')", "exercise"),
    _code("def f(x):\n    return 2 * x  # the answer", "solution"),
    _code("check_f(f)", outputs=("f is right: f(3) = 6",)),
    _md("Why is it 6? *Because 2 x 3.*", "solution"),
    _code("plot()", outputs=("a figure",)),
]}


def test_public_drops_solutions_and_clears_the_outputs_naming_answers():
    pub = editions.public(json.loads(json.dumps(NB)))
    text = "\n".join(source(c) for c in pub["cells"])
    assert "return 2 * x" not in text and "Because" not in text
    assert not any(SOLUTION in tags(c) for c in pub["cells"])
    check = next(c for c in pub["cells"] if source(c).startswith("check_f"))
    assert check["outputs"] == [], "the check's message names the answer"
    assert pub["cells"][-1]["outputs"], "other outputs stay"
    assert NB["cells"][3]["outputs"], "the executed notebook is not changed"


def test_lecturer_keeps_and_labels_every_solution():
    lec = editions.lecturer(NB)
    labels = [i for i, c in enumerate(lec["cells"])
              if source(c) == editions.SOLUTION_LABEL]
    assert [SOLUTION in tags(lec["cells"][i + 1]) for i in labels] == [True, True]
    assert len(lec["cells"]) == len(NB["cells"]) + 2


def test_write_refuses_an_unknown_edition(tmp_path):
    try:
        editions.write(tmp_path, tmp_path / "out", "draft")
    except ValueError as e:
        assert "public" in str(e)
    else:
        raise AssertionError("an unknown edition was accepted")


def test_decks_leave_out_set_up_claims_checks_and_solutions():
    kinds = {
        "import torch\nfrom labkit import viz": "skip",
        "assert x == 1, 'x'\nassert y": "skip",
        "check_ring(cluster, my_ring)": "skip",
        "cluster.close()": "skip",
        "x = 1\nassert x == 1": "subslide",
        "%%ranks\nprint(rank)": "subslide",
        "plot()": "subslide",
    }
    for text, want in kinds.items():
        assert deck_slide_type(_code(text)) == want, text
        assert slide_type(_code(text)) == "subslide", f"RISE runs {text!r} live"
    assert deck_slide_type(_code("x = 1", "solution")) == "skip"
    assert slide_type(_md("## A heading")) == "slide"
    assert slide_type(_md("Say this aloud.", "notes")) == "notes"
    assert slide_type(_md("Plain text.")) == "-"


def _png(width, height):
    import base64
    raw = (b"\x89PNG\r\n\x1a\n" + b"\x00\x00\x00\rIHDR" + width.to_bytes(4, "big")
           + height.to_bytes(4, "big") + b"\x08\x06\x00\x00\x00" + b"\x00" * 40)
    return base64.b64encode(raw).decode()


def test_a_deck_keeps_an_idea_and_its_code_on_one_slide_while_it_fits():
    short = _code("y = f(x)", outputs=("6",))
    figure = _code("plot()", outputs=())
    figure["outputs"] = [{"output_type": "display_data", "metadata": {},
                          "data": {"image/png": _png(600, 400)}}]
    cells = [_md("## The idea\n\nOne line of text."), _code("import torch"), short,
             figure, short, _md("## Next idea"), short, _md("A remark.", "notes")]
    assert deck_slide_types(cells) == [
        "slide", "skip", "-",      # the code that shows it, under its heading
        "subslide", "-",           # a 400 px figure does not fit: below, with
        "slide", "-", "notes"]     # what follows it; a heading starts a slide
    assert height(figure) > 400 and height(short) < 120


def test_a_deck_cuts_a_text_cell_taller_than_the_screen_at_its_paragraphs():
    paras = [f"Paragraph {k}: " + "words " * 60 for k in range(12)]
    fence = "```python\nx = 1\n\ny = 2\n```"
    text = "\n\n".join(["## Long", *paras[:6], fence, *paras[6:]])
    cell = _md(text)
    assert height(cell) > 640
    parts = split_tall_text([cell, _code("x")])
    assert len(parts) > 3 and parts[-1]["cell_type"] == "code"
    texts = ["".join(p["source"]) for p in parts[:-1]]
    assert "\n\n".join(texts) == text, "the same text, in order"
    assert any("x = 1\n\ny = 2" in t for t in texts), "a code fence stays whole"
    assert all(height(p) <= 640 for p in parts[:-1])
    assert len({p["id"] for p in parts}) == len(parts)
    both = split_tall_text(split_at_headings([_md(text + "\n\n## After\n\nEnd.")]))
    ids = [p["id"] for p in both]  # cut at headings, then for height, as a deck is
    assert len(set(ids)) == len(ids), f"two parts share an id: {ids}"
    kinds = deck_slide_types(parts)
    assert kinds[0] == "slide" and "subslide" in kinds


def test_a_deck_starts_a_slide_at_a_heading_inside_a_text_cell():
    cells = split_at_headings([_md("## 4. Measured\n\nText.\n\n## 5. Next\n\nMore."),
                               _md("Say it.", "notes")])
    assert ["".join(c["source"]) for c in cells] == [
        "## 4. Measured\n\nText.", "## 5. Next\n\nMore.", "Say it."]
    assert deck_slide_types(cells) == ["slide", "slide", "notes"]
