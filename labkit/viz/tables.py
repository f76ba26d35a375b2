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
