"""Measured next to expected: a table with relative errors, as HTML and text."""

from __future__ import annotations

import html
from dataclasses import dataclass


@dataclass(frozen=True)
class Row:
    name: str
    measured: float
    expected: float

    @property
    def rel_error(self) -> float:
        if self.expected == 0:
            return 0.0 if self.measured == 0 else float("inf")
        return (self.measured - self.expected) / abs(self.expected)


class Comparison:
    """Measured vs expected, one row each, with the relative error. Renders as HTML."""

    def __init__(self, rows, *, unit: float = 1.0, unit_name: str = "bytes",
                 tolerance: float | None = None):
        self.rows = [r if isinstance(r, Row) else Row(*r) for r in rows]
        self.unit, self.unit_name, self.tolerance = unit, unit_name, tolerance

    @property
    def max_rel_error(self) -> float:
        return max((abs(r.rel_error) for r in self.rows), default=0.0)

    def _fmt(self, v: float) -> str:
        v = v / self.unit
        return f"{v:,.0f}" if float(v).is_integer() else f"{v:,.4g}"

    def _repr_html_(self) -> str:
        body = []
        for r in self.rows:
            ok = ""
            if self.tolerance is not None:
                ok = "✓" if abs(r.rel_error) <= self.tolerance else "✗"
            body.append(
                f"<tr><td style='text-align:left'>{html.escape(r.name)}</td>"
                f"<td>{self._fmt(r.measured)}</td><td>{self._fmt(r.expected)}</td>"
                f"<td>{r.rel_error:+.3%}</td><td>{ok}</td></tr>")
        tol = "" if self.tolerance is None else f" (tolerance {self.tolerance:.1%})"
        return (f"<table><caption>measured vs expected, in {self.unit_name}{tol}"
                "</caption><tr><th style='text-align:left'>what</th><th>measured</th>"
                "<th>expected</th><th>rel. error</th><th></th></tr>"
                + "".join(body) + "</table>")

    def __repr__(self) -> str:
        w = max([38] + [len(r.name) for r in self.rows]) + 2  # names stay aligned
        lines = [f"{'what':<{w}}{'measured':>14}{'expected':>14}{'rel.err':>10}"]
        for r in self.rows:
            lines.append(f"{r.name:<{w}}{self._fmt(r.measured):>14}"
                         f"{self._fmt(r.expected):>14}{r.rel_error:>+10.3%}")
        return "\n".join(lines)


def measured_vs_expected(rows, *, unit: float = 1.0, unit_name: str = "bytes",
                         tolerance: float | None = None) -> Comparison:
    """rows: (name, measured, expected) triples -> a table with relative errors."""
    return Comparison(rows, unit=unit, unit_name=unit_name, tolerance=tolerance)


class Prose:
    """Paragraphs and bullet lists a cell prints, shown as HTML, which wraps at
    words at whatever width the notebook has; as plain text (CI, a terminal),
    wrapped at words at 88 columns. Never a word cut in two."""

    def __init__(self, items):
        self.items = [it if isinstance(it, str) else list(it) for it in items]

    def _repr_html_(self) -> str:
        out = []
        for it in self.items:
            if isinstance(it, str):
                out.append(f"<p style='margin:0.3em 0'>{html.escape(it)}</p>")
            else:
                lis = "".join(f"<li>{html.escape(x)}</li>" for x in it)
                out.append(f"<ul style='margin:0 0 0.5em 0'>{lis}</ul>")
        return "<div style='max-width:60em'>" + "".join(out) + "</div>"

    def __repr__(self) -> str:
        import textwrap

        fill = lambda text, first="", rest="": textwrap.fill(
            text, 88, initial_indent=first, subsequent_indent=rest,
            break_long_words=False, break_on_hyphens=False)
        return "\n".join(fill(it) if isinstance(it, str) else
                         "\n".join(fill(x, "  - ", "    ") for x in it)
                         for it in self.items)


def prose(*items) -> Prose:
    """viz.prose("a paragraph", ["a bullet", "another"], ...): text that wraps at
    words in the notebook (display it, or end the cell with it)."""
    return Prose(items)
