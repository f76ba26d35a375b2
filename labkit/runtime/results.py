"""What a call on the ranks gives back: results, and the errors that explain a
failure (formatted here, in the kernel, where the notebook's cell sources are)."""

from __future__ import annotations

import html
import reprlib

import cloudpickle

from labkit.runtime.messages import RemoteError


class RankError(RuntimeError):
    """One or more ranks failed. The message has each failed rank's traceback.

    ``failures`` maps rank -> formatted traceback, ``exceptions`` rank -> the
    exception object (None if it could not travel), ``busy`` rank -> what a rank
    still running was doing, ``finished`` the ranks that returned; after a
    timeout, ``collectives`` rank -> its flight recorder's record by group
    (runtime.flight.GroupLog) and ``mismatch`` what they disagree on, a sentence
    each.
    """

    def __init__(self, message, *, failures=None, exceptions=None, busy=None,
                 finished=()):
        super().__init__(message)
        self.failures = dict(failures or {})
        self.exceptions = dict(exceptions or {})
        self.busy = dict(busy or {})
        self.finished = list(finished)
        self.mismatch: list[str] = []
        self.collectives: dict = {}

    def _render_traceback_(self):  # IPython shows this instead of labkit's frames
        return [f"{type(self).__name__}: {self}"]


class ClusterClosed(RuntimeError):
    """`run` on a Cluster that `close()` (or the end of a `with` block) stopped."""

    def _render_traceback_(self):  # a one-line message in a notebook, no frames
        return [f"{type(self).__name__}: {self}"]


class CallInterrupted(RuntimeError):
    """A call that `restart()` from another thread stopped (the ranks it ran on
    were stopped and started again, without its results)."""

    def _render_traceback_(self):  # a one-line message in a notebook, no frames
        return [f"{type(self).__name__}: {self}"]


class SendTimeout(RankError, TimeoutError):
    """A rank did not take the call in Timeouts.send seconds: alive, but not
    reading (stopped, or stuck outside a call). ``busy`` names it."""


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


def first_line(error: RemoteError) -> str:
    msg = error.message.strip().split("\n")[0]
    msg = msg if len(msg) <= 100 else msg[:100] + "…"
    return f"raised {error.type}" + (f": {msg}" if msg else "")


def loads_or_none(data):
    if data is None:
        return None
    try:
        return cloudpickle.loads(data)
    except Exception:  # noqa: BLE001
        return None


def format_remote(error: RemoteError) -> str:
    """Format a rank's traceback here, where the notebook's cell sources are."""
    te = loads_or_none(error.te)
    if te is None:
        return error.text
    try:
        return "".join(te.format())
    except Exception:  # noqa: BLE001
        return error.text


def build_error(failed: dict, busy: dict[int, str], finished: list[int],
                timeout: float | None, mismatch: list[str] = (),
                collectives: dict | None = None) -> RankError:
    """The exception for a call that did not end well on every rank.

    failed: rank -> a RemoteError, or a string saying how the rank died; busy:
    rank -> what a rank still running was doing; finished: ranks that returned;
    mismatch: what the ranks' flight recorders disagree on (flight.find_mismatch),
    from `collectives`, rank -> its record."""
    texts, excs, heads = {}, {}, []
    for r, f in sorted(failed.items()):
        if isinstance(f, str):
            texts[r], excs[r] = f"rank {r} died: {f}", None
            heads.append(f"rank {r} {f}")
        else:
            texts[r], excs[r] = format_remote(f), loads_or_none(f.exc)
            heads.append(f"rank {r} {first_line(f)}")
    if failed:
        lines = ["; ".join(heads)]
        for r, t in texts.items():
            lines += ["", f"--- rank {r} ---", t.rstrip()]
    else:
        lines = [f"ranks {sorted(busy)} still busy after {timeout:g} s "
                 "(did every rank call the same collectives, in the same order?)"]
    if mismatch:
        lines += ["", "--- the flight recorders (each rank's last collectives) ---",
                  *mismatch]
    if busy or finished:
        lines += ["", "--- the other ranks ---" if failed else "--- ranks ---"]
        for r in sorted([*busy, *finished]):
            lines.append(f"rank {r}: " + (busy[r] if r in busy else "finished"))
    lines += ["", "The ranks were stopped; the next run starts them again."]
    cls = RankError if failed else CollectiveTimeout
    error = cls("\n".join(lines), failures=texts, exceptions=excs, busy=busy,
                finished=finished)
    error.mismatch, error.collectives = list(mismatch), dict(collectives or {})
    return error
