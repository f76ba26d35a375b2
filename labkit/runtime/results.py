"""What a call on the ranks gives back: results, and the errors that explain a
failure (formatted here, in the kernel, where the notebook's cell sources are)."""

from __future__ import annotations

import html
import linecache
import os
import reprlib

import cloudpickle


class RankError(RuntimeError):
    """One or more ranks failed. The message has each failed rank's traceback.

    ``failures`` maps rank -> formatted traceback, ``exceptions`` rank -> the
    exception object (None if it could not travel), ``busy`` rank -> what a rank
    still running was doing, ``finished`` the ranks that returned.
    """

    def __init__(self, message, *, failures=None, exceptions=None, busy=None,
                 finished=()):
        super().__init__(message)
        self.failures = dict(failures or {})
        self.exceptions = dict(exceptions or {})
        self.busy = dict(busy or {})
        self.finished = list(finished)

    def _render_traceback_(self):  # IPython shows this instead of labkit's frames
        return [f"{type(self).__name__}: {self}"]


class CollectiveTimeout(RankError, TimeoutError):
    """Some ranks were still busy after `timeout` seconds (usually a collective that
    not every rank called). ``busy`` says where each was waiting."""


class RankResults:
    """What each rank returned, indexable by rank."""

    def __init__(self, values: dict, outputs: dict, seconds: dict, world_size: int):
        self._values = dict(sorted(values.items()))
        self.outputs = dict(sorted(outputs.items()))  # rank -> what it printed
        self.seconds = dict(sorted(seconds.items()))  # rank -> time in fn (a timing)
        self.world_size = world_size

    @property
    def values(self) -> list:
        return list(self._values.values())

    @property
    def ranks(self) -> list[int]:
        return list(self._values)

    def __getitem__(self, rank: int):
        try:
            return self._values[rank]
        except (KeyError, TypeError):
            raise IndexError(
                f"no result for rank {rank!r}: this call ran on ranks {self.ranks}"
            ) from None

    def __iter__(self):
        return iter(self.values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        r = reprlib.Repr()
        r.maxstring, r.maxother = 120, 120
        rows = [f"  rank {k}: {r.repr(v)}" for k, v in self._values.items()]
        return f"RankResults(world_size={self.world_size})\n" + "\n".join(rows)

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{k}</td><td style='text-align:left'><pre style='margin:0'>"
            f"{html.escape(_short(v))}</pre></td></tr>"
            for k, v in self._values.items()
        )
        return (
            f"<table><caption>RankResults, world_size={self.world_size}</caption>"
            "<tr><th>rank</th><th style='text-align:left'>value</th></tr>"
            f"{rows}</table>"
        )


def _short(v, limit: int = 2000) -> str:
    s = repr(v)
    return s if len(s) <= limit else s[:limit] + " …"


def first_line(info: dict) -> str:
    msg = info["message"].strip().split("\n")[0]
    msg = msg if len(msg) <= 100 else msg[:100] + "…"
    return f"raised {info['type']}" + (f": {msg}" if msg else "")


def loads_or_none(data):
    if data is None:
        return None
    try:
        return cloudpickle.loads(data)
    except Exception:  # noqa: BLE001
        return None


def format_remote(info: dict) -> str:
    """Format a rank's traceback here, where the notebook's cell sources are."""
    te = loads_or_none(info["te"])
    if te is None:
        return info["text"]
    try:
        return "".join(te.format())
    except Exception:  # noqa: BLE001
        return info["text"]


_TORCH_DIR = os.sep + "torch" + os.sep


def describe_busy(status: dict) -> str:
    """'in all_reduce (torch.distributed), called at File ..., line 4: x = ...'"""
    stack = status.get("stack") or []
    if status.get("call") is None and not stack:
        return "idle"
    parts = []
    if status.get("activity"):
        parts.append(f"in {status['activity']} (torch.distributed)")
    # the innermost torch.distributed frame names the collective
    dist_frames = [f for f in stack if _TORCH_DIR + "distributed" in f[0]]
    if dist_frames and not status.get("activity"):
        parts.append(f"in {dist_frames[-1][2]} (torch.distributed)")
    user = [f for f in stack if _TORCH_DIR not in f[0]]
    if user:
        filename, lineno, name = user[-1]
        src = linecache.getline(filename, lineno).strip()
        where = f'File "{filename}", line {lineno}, in {name}'
        parts.append(("called at " if parts else "at ") + where + (f": {src}" if src
                                                                    else ""))
    return ", ".join(parts) or "busy"
