"""`make images`: the course's diagrams, drawn from labkit's own code.

Each SVG carries a hash of the data it draws (what every rank holds before and
after, computed by labkit.collectives), so a test can tell when a diagram is out of
date without depending on how a matplotlib version lays out pixels.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from labkit import viz
from labkit.comm.collectives import OPS, course_example, ring_steps, simulate

IMAGES = Path(__file__).resolve().parents[2] / "images"
MARK = "labkit-diagram-data:"


def _inputs(op: str, n: int = 4):
    if op == "all_gather":  # each rank holds its shard: the reduce-scatter result
        return simulate("reduce_scatter", course_example(n))
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


def digest(data) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def _figure(name: str, data):
    if name.startswith("collective_"):
        return viz.collective_diagram(data["op"], data["before"], data["after"])
    from matplotlib.figure import Figure

    steps = ring_steps(4)
    fig = Figure(figsize=(3.2 * 4, 3.0 * 2), layout="constrained")
    axes = fig.subplots(2, 4)
    for ax, st in zip(axes.flat, steps):
        viz.ring_grid(st, ax=ax)
    axes.flat[-1].axis("off")
    fig.suptitle("ring all-reduce on 4 ranks: reduce-scatter, then all-gather")
    return fig


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
