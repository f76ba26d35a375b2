"""`python -m labkit results DIR... [--chart OUT]`: a summary of what a torchrun run's
ranks wrote under `labkit.launch --results DIR` (runtime/results_io.py reads the
files) and, with --chart, its ledgers drawn by rank. Its exit status says which
kind of trouble (EXIT_STATUS)."""

from __future__ import annotations

import reprlib
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from labkit.runtime import RankResults


EXIT_STATUS = {"failed": 1, "missing": 2, "unreadable": 3}  # ResultsError.kind
EXIT_HELP = ("exit status: 0: every rank's result read; 1: a rank failed (its "
             "traceback is shown); 2: a rank's file is missing, from another run, "
             "or not labkit's; 3: a file cannot be read (truncated or damaged: "
             "it is named)")


def ledgers_in(value) -> dict[str, object]:
    """The ledgers in one rank's value: the value itself, or a dict's entries."""
    from labkit.ledger import Ledger

    if isinstance(value, Ledger):
        return {value.kind: value}
    if isinstance(value, dict):
        return {str(k): v for k, v in value.items() if isinstance(v, Ledger)}
    return {}


def brief(value, depth: int = 0) -> str:
    """One short line for a value: tensors by shape and dtype, dicts by entry."""
    import torch

    from labkit.ledger import Ledger

    if isinstance(value, torch.Tensor):
        if value.numel() <= 8:
            return repr(value.tolist()) if value.dim() else repr(value.item())
        return f"Tensor{list(value.shape)} {str(value.dtype).replace('torch.', '')}"
    if isinstance(value, Ledger):
        return repr(value)
    if isinstance(value, dict) and depth == 0:
        return "{" + ", ".join(f"{k!r}: {brief(v, 1)}" for k, v in value.items()) + "}"
    if isinstance(value, (dict, list, tuple)) and not (
            len(value) <= 8 and all(isinstance(v, (int, float, str, bool)) for v in
                                    (value.values() if isinstance(value, dict)
                                     else value))):
        return f"{type(value).__name__} of {len(value)}"
    r = reprlib.Repr()
    r.maxstring = r.maxother = 80
    return r.repr(value)


def summary(*directories) -> str:
    """A few lines on a run: who ran where, for how long, and what each returned."""
    from labkit.runtime import merge_records, read_records

    recs = merge_records(read_records(*directories))
    first = recs[0]
    hosts = sorted({rec["host"] for rec in recs.values()})
    args = ", ".join(map(repr, first["args"]))
    lines = [f"{first['target']}({args}) on {len(recs)} ranks, {len(hosts)} "
             f"host(s): {', '.join(hosts)}   run id {first['run_id'] or '-'}"]
    for r, rec in recs.items():
        what = (f"FAILED: {rec['error'].strip().splitlines()[-1]}" if rec["error"]
                else brief(rec["value"]))
        lines.append(f"  rank {r} ({rec['host']}, local {rec['local_rank']}, "
                     f"{rec['seconds']:.2f} s in fn, a timing): {what}")
    return "\n".join(lines)


def chart(results: RankResults, out_dir) -> list[Path]:
    """Draw the ledgers the ranks returned (memory by rank, traffic by rank) into
    PNG files in out_dir; returns the files written."""
    from labkit.viz import memory_by_rank, traffic_by_rank

    per_rank = [ledgers_in(v) for v in results.values]
    names = [k for k in per_rank[0] if all(k in p for p in per_rank)]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name in names:
        ledgers = [p[name] for p in per_rank]
        kind = ledgers[0].kind
        where, _, fn = results.target.rpartition(":")
        title = f"{Path(where).name}:{fn}: {name}, by rank"
        if kind == "memory":
            fig = memory_by_rank([m.peak for m in ledgers],
                                 title=title + " (each category's peak)")
        elif kind == "traffic":
            fig = traffic_by_rank(ledgers, title=title)
        else:
            continue
        path = out_dir / f"{name}.png"
        fig.savefig(path, bbox_inches="tight", dpi=110)
        written.append(path)
    return written


def results_command(directories, chart_dir=None) -> int:
    """`python -m labkit results DIR... [--chart OUT]`: its exit status, as
    EXIT_HELP says."""
    from labkit.runtime import ResultsError, load_results

    try:
        results = load_results(*directories)
        print(summary(*directories))
    except ResultsError as e:
        print(f"labkit results: {e}")
        return EXIT_STATUS.get(e.kind, 2)
    if chart_dir is not None:
        written = chart(results, chart_dir)
        for path in written:
            print(f"wrote {path}")
        if not written:
            print("no ledgers to draw: fn returns none (return the ledger, or a "
                  "dict with ledgers in it, on every rank)")
    return 0
