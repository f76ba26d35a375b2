"""The class size `python -m labkit doctor` prints: how many students a machine
holds, from the per-student figures `python -m labkit footprint` measured and
saved here (`saved_path()`), else the ones recorded with labkit (RECORDED).

Imports psutil (this machine's memory) and the standard library."""

from __future__ import annotations

import json
import os
from pathlib import Path

import psutil

MIB = 2**20


def mib(n: int) -> str:
    return f"{n / MIB:,.0f}"


def meminfo() -> dict[str, int]:
    """This machine's memory in bytes: {"MemTotal", "MemAvailable"} (psutil's
    total and available: Linux's /proc/meminfo figures, and macOS's)."""
    vm = psutil.virtual_memory()
    return {"MemTotal": vm.total, "MemAvailable": vm.available}


def class_size(mem_bytes: int, cores: int, fig: dict, world_size: int = 4) -> dict:
    """Students a machine holds: by memory, each a kernel with its cluster open
    at its heaviest chapter (the shared files once); by cores, how many can run
    a step at the same moment with a core for each of their ranks."""
    room = max(0, mem_bytes - fig["shared_files_bytes"])
    return {"by_memory": int(room // fig["per_student_bytes"]),
            "idle_stopped": int(room // fig["idle_stopped_bytes"]),
            "running_at_once": cores // world_size}


def class_lines(mem_bytes: int, cores: int, fig: dict, source: str) -> list[str]:
    """What doctor prints: the class size and the figures it came from."""
    n = class_size(mem_bytes, cores, fig)
    return [f"{n['by_memory']} students with a 4-rank cluster each, by memory "
            f"({mem_bytes / 2**30:.1f} GiB available)",
            f"up to {n['idle_stopped']} while LABKIT_IDLE_TIMEOUT has stopped "
            "their ranks",
            (f"{n['running_at_once']} can run a step at once with a core per rank "
             f"({cores} cores)" if n["running_at_once"] else
             f"a 4-rank step has fewer cores than ranks here ({cores}): they share"),
            f"per student: {mib(fig['per_student_bytes'])} MiB at the heaviest "
            f"chapter, {mib(fig['idle_stopped_bytes'])} MiB with its ranks stopped;",
            f"{mib(fig['shared_files_bytes'])} MiB of libraries once per machine",
            f"figures: {source}"]


def saved_path() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(cache) / "labkit" / "footprint.json"


def load_figures() -> tuple[dict, str]:
    """(summary, where it came from): this machine's saved measurement, else the
    one recorded with labkit (RECORDED)."""
    path = saved_path()
    try:
        return json.loads(path.read_text())["summary"], str(path)
    except (OSError, ValueError, KeyError):
        return RECORDED, f"recorded with labkit ({RECORDED['machine']}, " \
            f"{RECORDED['measured']}); `python -m labkit footprint` measures here"


# written by `python -m labkit footprint` (its saved "summary"); doctor uses it
# until the machine it runs on has measured its own
RECORDED: dict = {
    "per_student_bytes": 796921856,
    "per_student_4_ranks_bytes": 796921856,
    "idle_stopped_bytes": 395935744,
    "shared_files_bytes": 83701760,
    "busy_cores": 1.902,
    "idle_cores": 0.014,
    "cores": 2,
    "measured": "2026-11-26",
    "machine": "2 cores, 24 GiB",
}
