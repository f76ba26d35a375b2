"""`make book`: one site from the executed chapters, read without a network.

    python -m labkit.cli.site EXECUTED OUT [VENDOR [EDITION]]

Imports labkit.cli's own modules, and labkit.theory for the formula sheet; runs
Sphinx (MyST-NB, sphinx-book-theme) in a subprocess.

Chapters are taken as they are, outputs and widgets' state included: nothing is
executed here. Scripts come from _build/vendor (vendor.py).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from labkit.cli import (
    atomic,
    editions,
    page_assets,
    references,
    search_text,
    student,
)
from labkit.cli.nbclean import NOTES, as_saved

ROOT = Path(__file__).resolve().parents[2]
MATHJAX = "mathjax/MathJax.js?config=TeX-AMS_CHTML-full,Safe"  # under _static/

CONF = """\
project = "Parallelism Lab"
author = "the Parallelism Lab authors"
copyright = "2026, the Parallelism Lab authors"
extensions = ["myst_nb"]
nb_execution_mode = "off"  # the chapters come executed, widgets' state included
myst_enable_extensions = ["dollarmath", "amsmath"]
html_theme = "sphinx_book_theme"
html_title = "Parallelism Lab"
html_static_path = [{vendor!r}, "_labkit"]  # reveal.js, MathJax, widgets; ours
html_css_files = ["labkit.css"]
html_js_files = ["labkit.js"]
html_theme_options = {{"show_navbar_depth": 1, "home_page_in_toc": True{repo}}}
html_show_sourcelink = False
html_use_index = False  # no general index: the chapters define no index entries
mathjax_path = {mathjax!r}
# MyST-NB marks a chapter's text "ignore" and its formulas' spans "math"
mathjax2_config = {{"tex2jax": {{"processClass": "tex2jax_process|math|output_area"}}}}
nb_ipywidgets_js = {{"requirejs/require.js": {{}},
                     "html-manager/dist/embed-amd.js": {{}}}}
exclude_patterns = ["_build"]
suppress_warnings = ["mystnb.unknown_mime_type", "myst.header"]


def setup(app):  # the pages' text for search snippets (search_text.py)
    def search_page_only(app, pagename, templatename, context, doctree):
        if pagename == "search":
            app.add_js_file({search_js!r})
    app.connect("html-page-context", search_page_only)
"""

WORDS_A_MINUTE = 80  # technical prose with formulas, its cells run and looked at
SESSION_MINUTES = 90

INDEX = """\
# Parallelism Lab

A hands-on course on how large models are trained across many devices: collective
communication, data parallelism, ZeRO and FSDP, tensor, pipeline, sequence and
expert parallelism, and how they combine. Each chapter starts real
`torch.distributed` ranks from inside the notebook, lets them exchange real
tensors, measures what every rank holds and sends, and checks each measured
number against its formula. Everything runs on a laptop without a GPU.

**For whom.** Students and engineers who train models with PyTorch and want to
know what happens between the devices. **Prerequisites**: Python and PyTorch (a
module, a training step, autograd); linear algebra of matrix products; no
distributed-systems background. **Get it**: {get_it} then `make lab` opens the
chapters in JupyterLab (`make test` checks everything). **Start** with chapter 00,
the lab tour; the chapters build on each other in order.

The pages below are the chapters as they ran when this site was built, outputs
included; the exercises are there without their solutions ({edition} edition).
Widgets are snapshots of that run: the outlined controls (a few whose states were
all drawn then) work here; to move the others, run the chapter.

| Chapter | Reading | Sessions of {session} min | Exercises |
|---|---|---|---|
{table}

Times are the chapter's prose at {wpm} words a minute plus its exercises, a
guide for planning, not a measurement of a class.

```{{toctree}}
:maxdepth: 1
:caption: Chapters

{chapters}
```

```{{toctree}}
:maxdepth: 1
:caption: For the course

teaching
glossary
references
formulas
```
"""

TEACHING = """\
# Teaching with Parallelism Lab

## A schedule

One row per session of {session} minutes; a chapter longer than one session is
split at a section boundary of your choice. Reading times are the chapter's prose
at {wpm} words a minute plus 10 minutes an exercise.

| Session | Chapter | Reading |
|---|---|---|
{schedule}

## What each chapter sets out to do

{objectives}

## Exercises and points

Each exercise is checked by `labkit.checks` on inputs drawn afresh each run; the
points are what `make nbgrader` gives it (the exercise cell's metadata).

| Chapter | Exercise | Points |
|---|---|---|
{exercises}

## Recipes

- **Slides**: `make slides` writes one reveal.js deck a chapter in
  `_build/slides/` (the public edition; `make slides EDITION=lecturer` keeps the
  solutions). Set-up cells, asserts, checks and solutions are left out of the
  decks; markdown tagged `notes` is speaker notes. In JupyterLab, RISE (Alt+R)
  shows the same slides live.
- **This site**: `make book` builds it from the public edition (no solutions);
  `make book EDITION=lecturer` builds the lecturer's copy with every solution
  labelled.
- **Student edition**: `make student` writes the notebooks without solutions or
  outputs to `dist/student/`.
- **Grading**: `make nbgrader` writes an nbgrader course to `dist/nbgrader/`.
- **A JupyterHub**: the repository's `docs/servers.md` sizes a server per
  student (memory, threads, isolation, idle ranks); `docs/teaching.md` has
  every recipe in full.
"""

REFERENCES = """\
# References

The works the chapters cite, with the chapters that cite them.

{rows}
"""

FORMULAS = """\
# Formula sheet

The closed forms of `labkit.theory` that the chapters measure their ranks against,
each as its docstring states it, with the works it follows and the chapters that
call it (each such chapter asserts a measurement against it, or applies it at a
published scale).

{rows}
"""

GLOSSARY = """\
# Glossary

Every term the chapters' glossaries list, English and Chinese, with the chapters
that introduce it.

| English | 中文 | Chapters |
|---|---|---|
{rows}
"""


def title(nb_path: Path) -> str:
    """The chapter's first heading, without its leading #."""
    cells = json.loads(nb_path.read_text(encoding="utf-8"))["cells"]
    first = "".join(cells[0]["source"]).splitlines()[0]
    return first.lstrip("#").strip()


@dataclass(frozen=True)
class Chapter:
    """What the course's pages say of one chapter, read from its notebook."""

    stem: str
    title: str
    words: int  # of prose (markdown, code blocks left out)
    objectives: tuple[str, ...]  # its "In this chapter" list
    exercises: tuple[tuple[str, float], ...]  # (title, points)
    glossary: tuple[tuple[str, str], ...]  # (English, 中文)

    @property
    def minutes(self) -> int:
        return round(self.words / WORDS_A_MINUTE + 10 * len(self.exercises))

    @property
    def sessions(self) -> int:
        return max(1, math.ceil(self.minutes / SESSION_MINUTES))


def _md(nb: dict) -> list[str]:
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown"]


def _list_after(text: str, lead: str) -> list[str]:
    """The numbered items of the list that follows `lead` in `text`, each
    joined onto one line."""
    if lead not in text:
        return []
    items: list[str] = []
    for line in text.split(lead, 1)[1].strip("\n").splitlines():
        if re.match(r"\d+\.\s", line):
            items.append(re.sub(r"^\d+\.\s+", "", line).strip())
        elif line.startswith("   ") and items:
            items[-1] += " " + line.strip()
        else:
            break
    return items


def chapter(nb_path: Path) -> Chapter:
    """The Chapter the notebook at `nb_path` describes: its prose's words (code
    blocks left out), its "**In this chapter**" list, its exercises (bold title,
    else first sentence, and points) and its "**Glossary**" rows."""
    nb = json.loads(nb_path.read_text(encoding="utf-8"))
    texts = _md(nb)
    prose = "\n".join(re.sub(r"```.*?```", "", t, flags=re.S) for t in texts)
    start = next((k for k, t in enumerate(texts)
                  if t.lstrip().startswith("## Exercises")), len(texts))
    exercise_text = "\n".join(texts[start:])  # the list, or one cell an exercise
    names = [bold or re.split(r"(?<=[.?:])\s", line)[0][:70]  # its bold title, or
             for bold, line in re.findall(  # its first line's first sentence
                 r"^\d+\.\s+(?:\*\*(.+?)\*\*.*|(.+))$", exercise_text, flags=re.M)]
    points = [student.points(c) for c in nb["cells"]
              if student.EXERCISE in student.tags(c)]
    names += [f"Exercise {k + 1}" for k in range(len(names), len(points))]
    glossary = []
    for t in texts:
        if "**Glossary**" in t:
            for row in t.split("**Glossary**", 1)[1].splitlines():
                cols = [c.strip() for c in row.strip().strip("|").split("|")]
                if (len(cols) == 2 and cols[0] and not set(cols[0]) <= set("-: ")
                        and cols[0] != "English"):
                    glossary.append((cols[0], cols[1]))
    return Chapter(nb_path.stem, title(nb_path), len(prose.split()),
                   tuple(_list_after(texts[0], "**In this chapter**")),
                   tuple(zip(names, points)), tuple(glossary))


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def index_page(chapters: list[Chapter], edition: str, repo_url: str | None) -> str:
    table = "\n".join(
        f"| [{_cell(c.title)}](notebooks/{c.stem}) | {c.minutes} min | {c.sessions} "
        f"| {len(c.exercises)} |" for c in chapters)
    get_it = (f"clone [the repository]({repo_url}),"
              if repo_url else "copy the course's repository (your lecturer has "
              "its address),")
    return INDEX.format(get_it=get_it, edition=edition, session=SESSION_MINUTES,
                        wpm=WORDS_A_MINUTE, table=table,
                        chapters="\n".join(f"notebooks/{c.stem}" for c in chapters))


def teaching_page(chapters: list[Chapter]) -> str:
    """The "Teaching with Parallelism Lab" page: a schedule in sessions of
    SESSION_MINUTES (a long chapter over several), each chapter's objectives,
    and every exercise with its points."""
    schedule, n = [], 0
    for c in chapters:
        for part in range(c.sessions):
            n += 1
            of = f" (part {part + 1} of {c.sessions})" if c.sessions > 1 else ""
            schedule.append(f"| {n} | {_cell(c.title)}{of} | "
                            f"{c.minutes if part == 0 else ''}"
                            f"{' min' if part == 0 else ''} |")
    objectives = "\n\n".join(
        f"**{_cell(c.title)}**\n\n" + "\n".join(f"- {o}" for o in c.objectives)
        for c in chapters if c.objectives)
    exercises = "\n".join(f"| {c.title.split(' ')[0]} | {_cell(name)} | {pts:g} |"
                          for c in chapters for name, pts in c.exercises)
    return TEACHING.format(session=SESSION_MINUTES, wpm=WORDS_A_MINUTE,
                           schedule="\n".join(schedule), objectives=objectives,
                           exercises=exercises)


def glossary_page(chapters: list[Chapter]) -> str:
    terms: dict[tuple[str, str], list[str]] = {}
    for c in chapters:
        for english, chinese in c.glossary:
            terms.setdefault((english, chinese), []).append(c.title.split(" ")[0])
    rows = "\n".join(f"| {_cell(e)} | {_cell(z)} | {', '.join(where)} |"
                     for (e, z), where in sorted(terms.items(),
                                                 key=lambda kv: kv[0][0].lower()))
    return GLOSSARY.format(rows=rows)


def _texts(notebooks: list[Path], kind: str) -> dict[str, str]:
    """Chapter number -> the text of its cells of `kind` (markdown or code)."""
    out = {}
    for path in notebooks:
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        out[path.stem[:2]] = "\n".join("".join(c["source"]) for c in cells
                                       if c["cell_type"] == kind)
    return out


def references_page(notebooks: list[Path]) -> str:
    rows = "\n".join(f"- {ref} *Cited in chapter{'s' * (len(where) > 1)} "
                     f"{', '.join(where)}.*"
                     for ref, where in references.cited_in(_texts(notebooks,
                                                                  "markdown")))
    return REFERENCES.format(rows=rows)


def closed_forms() -> list[tuple[str, str, str]]:
    """(name, signature, docstring) of labkit.theory's public functions."""
    import inspect

    from labkit import theory

    out = []
    for name in sorted(theory.__all__):
        f = getattr(theory, name)
        if inspect.isfunction(f) and f.__doc__ and name not in ("check_counts",):
            out.append((name, str(inspect.signature(f)), inspect.cleandoc(f.__doc__)))
    return out


def formula_page(notebooks: list[Path]) -> str:
    code = _texts(notebooks, "code")
    rows = []
    for name, signature, doc in closed_forms():
        used = [ch for ch, text in code.items() if re.search(rf"\b{name}\(", text)]
        if not used:
            continue
        cites = [ref[:ref.index(")") + 1] for pattern, ref in references.REFERENCES
                 if re.search(pattern, references.flat(doc))]
        rows.append(f"**`{name}{signature}`** (chapter{'s' * (len(used) > 1)} "
                    f"{', '.join(used)})\n\n```text\n{doc}\n```"
                    + (f"\n\nFollows: {'; '.join(cites)}." if cites else ""))
    return FORMULAS.format(rows="\n\n".join(rows))


def notes_as_asides(path: Path) -> None:
    """A chapter's speaker notes (markdown tagged `notes`; the decks' speaker
    view) shown on its page as an aside titled so, not as the chapter's own
    text."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    for c in nb["cells"]:
        if c["cell_type"] == "markdown" and NOTES in student.tags(c):
            text = student.source(c).strip()
            text = re.sub(r"^\*Speaker notes\.?\*\s*", "", text)
            c["source"] = (f"````{{admonition}} Speaker notes\n:class: "
                           f"labkit-notes\n{text}\n````")
    atomic.write_text(path, as_saved(nb))


def write_project(executed: Path, src: Path, vendor: Path,
                  edition: str = "public") -> list[str]:
    """The Sphinx project in src: conf.py, the index, teaching and glossary pages,
    the chapters' `edition` (editions.py) in notebooks/, images/, our style and
    script in _labkit/."""
    shutil.rmtree(src, ignore_errors=True)
    (src / "notebooks").mkdir(parents=True)
    (src / "_labkit").mkdir()
    shutil.copytree(ROOT / "images", src / "images")  # chapters link ../images
    (src / "_labkit" / "labkit.css").write_text(page_assets.SITE_CSS)
    (src / "_labkit" / "labkit.js").write_text(page_assets.SNAPSHOT_JS)
    for path in editions.write(executed, src / "notebooks", edition):
        notes_as_asides(path)
    chapters = [chapter(nb) for nb in sorted((src / "notebooks").glob("*.ipynb"))]
    repo_url = os.environ.get("LABKIT_REPO_URL") or None
    repo = (f', "repository_url": {repo_url!r}, "use_repository_button": True'
            if repo_url else "")
    (src / "conf.py").write_text(CONF.format(vendor=str(vendor.resolve()),
                                             mathjax=MATHJAX, repo=repo,
                                             search_js=search_text.SCRIPT))
    (src / "index.md").write_text(index_page(chapters, edition, repo_url))
    (src / "teaching.md").write_text(teaching_page(chapters))
    (src / "glossary.md").write_text(glossary_page(chapters))
    notebooks = sorted((src / "notebooks").glob("*.ipynb"))
    (src / "references.md").write_text(references_page(notebooks))
    (src / "formulas.md").write_text(formula_page(notebooks))
    return [f"notebooks/{c.stem}" for c in chapters]


def build(executed: Path, out: Path, vendor: Path, edition: str = "public") -> None:
    """Write the Sphinx project beside `out` (OUT-src) and build it into `out`,
    replaced whole (SystemExit with sphinx's errors if it fails); then the search
    text and the widgets' icon fonts where their renderer looks for them."""
    src = out.parent / f"{out.name}-src"
    write_project(executed, src, vendor, edition)
    shutil.rmtree(out, ignore_errors=True)
    run = subprocess.run([sys.executable, "-m", "sphinx", "-q", "-b", "html",
                          "-d", str(src / ".doctrees"), str(src), str(out)],
                         capture_output=True, text=True, check=False)
    if run.returncode:
        raise SystemExit(f"sphinx-build failed:\n{run.stderr[-3000:]}")
    pages = sorted(str(p.relative_to(out).with_suffix("")) for p in out.rglob("*.html")
                   if p.parts[len(out.parts)][0] != "_" and p.stem != "search")
    search_text.write(out, pages)
    # the widget renderer looks for its icon fonts under the page's folder, at
    # the path of the module that asks for them
    for fonts in ("@jupyter-widgets", "@jupyter-widgets/html-manager/dist"):
        (out / "notebooks" / fonts).mkdir(parents=True, exist_ok=True)
        for f in (out / "_static" / "html-manager" / "dist").iterdir():
            if f.suffix in (".woff", ".woff2", ".ttf"):
                shutil.copy(f, out / "notebooks" / fonts / f.name)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    executed, out = Path(args[0]), Path(args[1])
    vendor = Path(args[2]) if len(args) > 2 else Path("_build/vendor")
    edition = args[3] if len(args) > 3 else "public"
    build(executed, out, vendor, edition)
    print(f"{out / 'index.html'}: {len(list(executed.glob('*.ipynb')))} chapters")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
