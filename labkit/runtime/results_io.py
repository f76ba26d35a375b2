"""What a torchrun run gives back, as `cluster.run` gives it in a notebook.

Imports labkit.runtime's results and rank; torch and cloudpickle inside functions.

Under `labkit.launch ... --results DIR` every rank writes `DIR/rank{r}.pt`;
`load_results(DIR)` merges the files in rank order into a `RankResults` (its
`.values` is what `cluster.run(fn).values` would be). On several nodes without a
shared file system, copy every node's files into one folder, or pass every
node's folder.
"""

from __future__ import annotations

import os
import re
import socket
import traceback
from pathlib import Path

from labkit.runtime.results import RankResults

_NAME = re.compile(r"rank(\d+)\.pt$")


class ResultsError(ValueError):
    """The result files are missing, stale (from another run) or not labkit's
    (kind "missing"), a rank raised ("failed"), or a file cannot be read, as a
    truncated copy cannot ("unreadable")."""

    def __init__(self, message: str, kind: str = "missing"):
        super().__init__(message)
        self.kind = kind


def save_rank_result(directory, rank: int, world_size: int, value=None, *,
                     error: BaseException | None = None, seconds: float = 0.0,
                     target: str = "", args: tuple = (), run_id: str = "") -> Path:
    """Write one rank's result (or its error) to DIR/rank{rank}.pt, atomically;
    CUDA tensors are moved to the CPU first (ledgers pickle their data only)."""
    import cloudpickle
    import torch

    from labkit.runtime.rank import to_cpu

    record = {"labkit_result": 1, "rank": rank, "world_size": world_size,
              "run_id": run_id, "target": target, "args": tuple(args),
              "host": socket.gethostname(), "seconds": seconds,
              "local_rank": int(os.environ.get("LOCAL_RANK", rank)),
              "value": None if error is not None else to_cpu(value),
              "error": None if error is None else
              "".join(traceback.format_exception(error))}
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"rank{rank}.pt"
    tmp = directory / f".rank{rank}.pt.{os.getpid()}.tmp"
    try:
        # cloudpickle: classes defined in the worker module travel by value
        torch.save(record, tmp, pickle_module=cloudpickle)
    except Exception as e:  # noqa: BLE001
        record["value"], record["error"] = None, (
            f"rank {rank}'s result could not be saved: {type(e).__name__}: {e}")
        torch.save(record, tmp, pickle_module=cloudpickle)
    os.replace(tmp, path)
    return path


def read_records(*directories) -> dict[int, dict]:
    """rank -> record, from every DIR/rank{r}.pt (later folders win on a clash)."""
    found: dict[int, dict] = {}
    for d in directories:
        d = Path(d)
        if not d.is_dir():
            raise ResultsError(f"no such folder: {d}")
        for path in sorted(d.iterdir()):
            m = _NAME.fullmatch(path.name)
            if not m:
                continue
            rec = _read(path)
            if not isinstance(rec, dict) or rec.get("labkit_result") != 1:
                raise ResultsError(f"{path} is not a labkit result file")
            if rec["rank"] != int(m.group(1)):
                raise ResultsError(f"{path} holds rank {rec['rank']}'s result")
            found[rec["rank"]] = rec
    if not found:
        raise ResultsError("no rank*.pt files in " + ", ".join(map(str, directories)))
    return found


def _read(path: Path):
    """torch.load of one rank's file; a ResultsError naming it if it cannot."""
    import zipfile

    import torch

    if not zipfile.is_zipfile(path):  # torch.save's format is a zip archive
        raise ResultsError(
            f"{path} cannot be read: not a whole zip archive (torch.save's format), "
            f"{path.stat().st_size:,} B: truncated (a copy that did not finish, a full "
            "disk) or not a result file; copy it again from its node, or run again",
            kind="unreadable")
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 (a damaged pickle raises many kinds)
        hint = ("a module its value needs cannot be imported here: run this where "
                "fn's module imports" if isinstance(e, ImportError) else
                "the file is damaged: copy it again from its node, or run again")
        raise ResultsError(f"{path} cannot be read ({type(e).__name__}: {e}): "
                           f"{hint}", kind="unreadable") from None


def merge_records(records: dict[int, dict]) -> dict[int, dict]:
    """The records of one run, every rank 0..world_size-1; else ResultsError."""
    if 0 not in records:
        raise ResultsError(f"no result for rank 0 (found ranks {sorted(records)})")
    first = records[0]
    n, run = first["world_size"], first["run_id"]
    missing = [r for r in range(n) if r not in records]
    if missing:
        raise ResultsError(f"rank 0 says world_size={n}, but there is no result for "
                           f"rank(s) {missing}: did every node write its files "
                           "here, and are they copied into one folder?")
    stale = [r for r in range(n) if (records[r]["run_id"], records[r]["world_size"])
             != (run, n)]
    if stale:
        raise ResultsError(f"rank(s) {stale} come from another run than rank 0 "
                           f"(run id {run!r}, world_size={n}): clear the folder and "
                           "run again")
    return {r: records[r] for r in range(n)}


def load_results(*directories) -> RankResults:
    """A torchrun run's results, merged in rank order, as `cluster.run` returns them.

    `.values` (rank order), `[rank]`, `.seconds` (time in fn: a timing); `.hosts`
    (rank -> hostname), `.target`, `.args` and `.run_id` say where it ran. A rank
    that raised makes this raise ResultsError with that rank's traceback."""
    found = read_records(*directories)
    run = found[0]["run_id"] if 0 in found else None
    failed = {r: rec["error"] for r, rec in found.items()
              if rec["error"] and run in (None, rec["run_id"])}
    if failed:  # before gaps: torchrun stops the others when one rank raises
        raise ResultsError("\n".join(f"rank {r} failed:\n{tb}"
                                     for r, tb in failed.items()), kind="failed")
    recs = merge_records(found)
    out = RankResults({r: rec["value"] for r, rec in recs.items()}, {},
                      {r: rec["seconds"] for r, rec in recs.items()}, len(recs))
    out.hosts = {r: rec["host"] for r, rec in recs.items()}
    out.target, out.args, out.run_id = recs[0]["target"], recs[0]["args"], \
        recs[0]["run_id"]
    return out
