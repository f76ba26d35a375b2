"""`make images`: the course's diagrams, drawn from labkit's own code.

Each SVG carries a hash of the data it draws (what every rank holds before and
after, computed by labkit.collectives) and of the code that draws it (DRAWN_BY),
so a test can tell when a diagram is out of date, also after a change of style,
without depending on how a matplotlib version lays out pixels.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from labkit import viz
from labkit.comm import OPS, course_example, ring_steps, simulate
from labkit.viz import PAGE_WIDTH_IN

IMAGES = Path(__file__).resolve().parents[2] / "images"
MARK = "labkit-diagram-data:"


def _inputs(op: str, n: int = 4):
    """What each rank holds before `op`, as chapter 01 runs it."""
    if op == "all_gather":  # each rank holds its shard: the reduce-scatter result
        return simulate("reduce_scatter", course_example(n))
    if op == "gather":  # gather undoes scatter: each rank holds its scattered piece
        return simulate("scatter", course_example(n))
    return course_example(n)


def specs() -> dict[str, object]:
    """name -> the data its diagram draws."""
    out: dict[str, object] = {}
    for op in OPS:
        before = _inputs(op)
        out[f"collective_{op}"] = {"op": op, "before": before,
                                   "after": simulate(op, before)}
    out["ring_allreduce_4"] = [
        {"phase": s.phase, "step": s.step, "sends": s.sends,
         "holds": [[sorted(c) for c in row] for row in s.holds]} for s in ring_steps(4)
    ]
    return out


def _drawn_by() -> tuple[Path, ...]:
    """The source files whose code draws the diagrams."""
    from labkit.viz import diagrams, style

    return tuple(Path(m.__file__) for m in (diagrams, style)) + (Path(__file__),)


def digest(data, code: tuple[Path, ...] | None = None) -> str:
    """Hash of the data a diagram draws and of the code that draws it."""
    h = hashlib.sha256(json.dumps(data, sort_keys=True).encode())
    for path in code if code is not None else _drawn_by():
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _figure(name: str, data):
    if name.startswith("collective_"):
        return viz.collective_diagram(data["op"], data["before"], data["after"])
    from labkit.viz import ring_panels

    # three states a row, read left to right: the start, the three reduce-scatter
    # steps, the three all-gather steps, the key (four a row crowd "0+1+2" out
    # of its cell at the page's width)
    fig = ring_panels(ring_steps(4), ncols=3, width_in=RING_WIDTH_IN)
    fig.suptitle("ring all-reduce on 4 ranks: reduce-scatter, then all-gather",
                 fontsize=13)
    return fig


RING_WIDTH_IN = PAGE_WIDTH_IN  # the site's column, as every chart
PAGE_PX = 900  # a notebook's text column in JupyterLab on a laptop, in CSS pixels


def smallest_text_px(fig, page_px: int = PAGE_PX) -> float:
    """The height in CSS pixels of the smallest text in `fig` when the image is
    shown in a page `page_px` wide: at its own size (1 pt = 96/72 px), scaled down
    only if it is wider than the page."""
    from matplotlib.legend import Legend
    from matplotlib.text import Text

    width_px = fig.get_figwidth() * 96
    scale = min(1.0, page_px / width_px) * 96 / 72
    texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]
    texts += [t for leg in fig.findobj(Legend) for t in leg.get_texts()]
    return min(t.get_fontsize() for t in texts) * scale


def render(outdir: Path = IMAGES) -> list[Path]:
    """Write every diagram as SVG; returns the paths written."""
    import matplotlib

    outdir.mkdir(parents=True, exist_ok=True)
    written = []
    with matplotlib.rc_context({"svg.hashsalt": "labkit", "svg.fonttype": "path"}):
        for name, data in specs().items():
            path = outdir / f"{name}.svg"
            _figure(name, data).savefig(path, format="svg", metadata={"Date": None})
            text = path.read_text()
            stamp = f"<!-- {MARK}{digest(data)} -->\n<svg "
            path.write_text(text.replace("<svg ", stamp, 1))
            written.append(path)
    return written


def stale(outdir: Path = IMAGES) -> list[str]:
    """Names of diagrams that are missing or were drawn from other data."""
    bad = []
    for name, data in specs().items():
        path = outdir / f"{name}.svg"
        if not path.exists() or f"{MARK}{digest(data)}" not in path.read_text():
            bad.append(name)
    return bad
