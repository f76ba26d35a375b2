"""`python -m labkit.cli.steps STEP...`: run `make STEP` for each step in turn and,
at the end (also when one fails), print how long each took beside its time in the
last run here, so a developer sees which step grew. `make test` and CI run their
steps through it. The times of the last run are kept in build/step-times.json
(not committed: they are this machine's). A step's time is a measurement, not a
test: nothing fails for being slow. Standard library only: `make test` runs it
before the virtual environment exists.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from labkit.cli import atomic

ROOT = Path(__file__).resolve().parents[2]
TIMES = ROOT / "build" / "step-times.json"
BUDGET = {"make test": 600.0}  # seconds, on a 2-core machine (DESIGN.md)


def _clock(seconds: float) -> str:
    """m:ss, or tenths of a second under 10 s (a lint step is under one)."""
    if seconds < 9.95:
        return f"{seconds:.1f} s"
    m, s = divmod(round(seconds), 60)
    return f"{m}:{s:02d}"


def _load(path: Path) -> dict[str, float]:
    try:
        got = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(got, dict):
        return {}
    return {k: float(v) for k, v in got.items() if isinstance(v, (int, float))}


def _save(path: Path, times: dict[str, float]) -> None:
    """Merge `times` into the file, via a temporary file and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    merged = _load(path) | times
    atomic.write_text(path, json.dumps(merged, indent=1, sort_keys=True) + "\n")


def table(times: dict[str, float], before: dict[str, float], failed: str | None,
          title: str) -> str:
    """The lines printed at the end: each step's time, the last run's, the change."""
    rows = [("step", "time", "last run", "change")]
    for step, t in times.items():
        was = before.get(step)
        change = "" if was is None else f"{t - was:+.0f} s"
        mark = "  (failed)" if step == failed else ""
        rows.append((step + mark, _clock(t), "" if was is None else _clock(was),
                     change))
    total = sum(times.values())
    was = sum(before[s] for s in times if s in before) if all(
        s in before for s in times) else None
    rows.append(("all", _clock(total), "" if was is None else _clock(was),
                 "" if was is None else f"{total - was:+.0f} s"))
    width = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [f"{title}: each step's time (the last run's: {TIMES.relative_to(ROOT)})"]
    for r in rows:
        lines.append("  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                      for i, (c, w) in enumerate(zip(r, width))))
    budget = BUDGET.get(title)
    if budget is not None and failed is None:
        over = ("" if total <= budget else f": {_clock(total - budget)} over"
                + ("; each step's change since the last run is above"
                   if was is not None else ""))
        lines.append(f"  {title} took {_clock(total)} of its {_clock(budget)} "
                     f"budget{over}")
    return "\n".join(lines)


def run_steps(steps: list[str], title: str, make: str | None = None,
              times_file: Path = TIMES) -> int:
    """Run each step (`make STEP`), stop at the first that fails; print the
    table; the exit status of the step that failed, else 0."""
    make = make or os.environ.get("MAKE", "make")
    before, times, failed, status = _load(times_file), {}, None, 0
    for step in steps:
        start = time.monotonic()
        try:
            status = subprocess.call([make, "--no-print-directory", step], cwd=ROOT)
        except KeyboardInterrupt:
            status = 130
        times[step] = time.monotonic() - start
        if status:
            failed = step
            break
    print("\n" + table(times, before, failed, title), flush=True)
    if failed is None:
        _save(times_file, times)
    return status


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m labkit.cli.steps",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("steps", nargs="+", help="make targets, run in this order")
    p.add_argument("--title", default="make test",
                   help="what the steps make up, for the table")
    args = p.parse_args(argv)
    return run_steps(args.steps, args.title)


if __name__ == "__main__":
    sys.exit(main())
