"""What the site's search shows under each result: a page's own text.

Imports bs4 and labkit.cli.atomic.

Sphinx's search fetches each page found and reads its `[role=main]`, which on our
theme holds buttons and raw TeX, and which browsers refuse to fetch over file://.
So each page's article text is read here once after the build (prose and code,
formulas in plain letters), and `write` stores it in `_static/labkit-search.js`,
which answers the search's fetch of a page from disk and over http alike.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import bs4

from labkit.cli import atomic

SCRIPT = "labkit-search.js"
DROP = (".headerlink", "script", "style", ".cell_output", ".jupyter-widgets",
        "button", ".prev-next-area", "nav", ".toctree-wrapper")

_SYMBOLS = {r"\cdot": "·", r"\times": "×", r"\approx": "≈", r"\le": "≤",
            r"\leq": "≤", r"\ge": "≥", r"\geq": "≥", r"\ne": "≠", r"\to": "→",
            r"\rightarrow": "→", r"\infty": "∞", r"\sum": "Σ", r"\ldots": "…",
            r"\dots": "…", r"\cdots": "…", r"\lceil": "⌈", r"\rceil": "⌉",
            r"\lfloor": "⌊", r"\rfloor": "⌋", r"\sqrt": "√", r"\pm": "±",
            r"\%": "%", r"\,": " ", r"\;": " ", r"\!": "", r"\quad": " "}
_GREEK = ("alpha beta gamma delta epsilon theta lambda mu pi rho sigma tau phi "
          "psi omega Delta Gamma Lambda Phi Psi Sigma Omega").split()
_LETTERS = "αβγδεθλμπρστφψωΔΓΛΦΨΣΩ"


def tex_text(tex: str) -> str:
    """A formula in plain letters, as a snippet can show it."""
    t = tex.strip()
    for a, b in (("\\(", ""), ("\\)", ""), ("\\[", ""), ("\\]", ""), ("$", "")):
        t = t.replace(a, b)
    frac = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
    while frac.search(t):
        t = frac.sub(lambda m: f"{_group(m[1])}/{_group(m[2])} ", t)
    t = re.sub(r"\\(?:mathrm|text|mathit|mathbf|operatorname|textrm)\{([^{}]*)\}",
               r"\1", t)
    t = re.sub(r"\\(?:left|right|big|Big|bigl|bigr)\b", "", t)
    for name, letter in zip(_GREEK, _LETTERS):
        t = re.sub(rf"\\{name}(?![A-Za-z])", letter, t)
    for cmd in sorted(_SYMBOLS, key=len, reverse=True):
        t = re.sub(re.escape(cmd) + r"(?![A-Za-z])", _SYMBOLS[cmd], t)
    t = re.sub(r"\\[A-Za-z]+", "", t).replace("{", "").replace("}", "")
    return re.sub(r"\s+", " ", t).strip()


def _group(part: str) -> str:
    """A fraction's side: bracketed when it is more than one term."""
    return f"({part})" if re.search(r"[+\-\s]", part.strip()) else part


def page_text(html: str) -> str:
    """The article of a built page as a reader sees it, outputs left out."""
    soup = bs4.BeautifulSoup(html, "html.parser")
    article = soup.select_one("article.bd-article") or soup.select_one("article")
    if article is None:
        return ""
    for sel in DROP:
        for el in article.select(sel):
            el.decompose()
    for el in article.select(".math"):
        el.replace_with(" " + tex_text(el.get_text()) + " ")
    for el in article.select("pre"):  # highlighted code: one span a token
        el.replace_with(" " + el.get_text() + " ")
    text = re.sub(r"\s+", " ", article.get_text(" ")).strip()
    return re.sub(r" ([,.;:!?)])", r"\1", text).replace("( ", "(")


def write(out: Path, pages: list[str]) -> Path:
    """_static/labkit-search.js in the built site `out`, for `pages` (docnames,
    e.g. "notebooks/02_ring_allreduce"): their text, and a fetch that answers
    the search with it."""
    text = {p: page_text((out / f"{p}.html").read_text(encoding="utf-8"))
            for p in pages if (out / f"{p}.html").exists()}
    js = SEARCH_JS % json.dumps(text, ensure_ascii=False)
    path = out / "_static" / SCRIPT
    atomic.write_text(path, js)
    return path


# the search fetches "<root><docname>.html"; a page we hold is answered from
# here (from disk too, where fetch is refused), anything else goes on as asked
SEARCH_JS = """\
(function () {
  var TEXT = %s;
  var fetchPage = window.fetch.bind(window);
  window.fetch = function (url, options) {
    var path = new URL(String(url), location.href).pathname;
    for (var doc in TEXT) {
      if (path.endsWith("/" + doc + ".html")) {
        var div = document.createElement("div");
        div.setAttribute("role", "main");
        div.textContent = TEXT[doc];
        return Promise.resolve(new Response(div.outerHTML,
          {headers: {"Content-Type": "text/html"}}));
      }
    }
    return fetchPage(url, options);
  };
})();
"""
