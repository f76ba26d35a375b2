"""The live view of a call in the calling cell: each rank's latest lines as they are
printed, one progress bar per `labkit.progress` loop, and, once a call has run for
2 s (Timeouts.status_after), a status line per busy rank. When the call returns
the view becomes the final transcript (rank order, as without a live view) and
the bars in their last state.

A live view exists only where a person watches: a kernel whose current request
came from an interactive frontend (JupyterLab and Notebook send the cell's id with
it; nbclient, behind nbval and nbconvert, sends none) - so what CI and `make book`
keep is the plain transcript. LABKIT_LIVE=1 forces a view, =0 turns it off.
"""

from __future__ import annotations

import html
import os
import time
import uuid
from collections import deque

from labkit.runtime.messages import Progress
from labkit.runtime.timeouts import DEFAULT

TAIL = 12  # lines kept on screen per rank while a call runs


def live_frontend() -> bool:
    """Whether the cell running now is watched live (see the module docstring)."""
    choice = os.environ.get("LABKIT_LIVE", "auto")
    if choice == "0":
        return False
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    kernel = getattr(get_ipython(), "kernel", None)
    if kernel is None:
        return False
    if choice == "1":
        return True
    meta = (kernel.get_parent("shell") or {}).get("metadata") or {}
    return "cellId" in meta or "deletedCells" in meta


class CellOutputs:
    """Which cells (execute requests, by msg_id) have sent the frontend an output
    other than labkit's live views: a view with nothing left to show can then be
    taken away with `clear_output` where that loses nothing else. Watches the
    kernel's one Session, through which every stream and display is sent."""

    def __init__(self, session):
        self.views: set[str] = set()    # display ids of labkit's live views
        self.others: set[str] = set()   # msg_ids of cells with any other output
        send = session.send

        def watching(stream, msg_or_type, content=None, parent=None, *args, **kw):
            try:
                self._note(msg_or_type, content, parent)
            except Exception:  # noqa: BLE001  (watching must never break output)
                pass
            return send(stream, msg_or_type, content, parent, *args, **kw)

        session.send = watching

    def _note(self, msg, content, parent) -> None:
        if isinstance(msg, dict):
            kind = msg.get("header", {}).get("msg_type")
            content, parent = msg.get("content") or {}, msg.get("parent_header")
        else:
            kind = msg
        if kind not in ("stream", "display_data", "execute_result", "error"):
            return
        if ((content or {}).get("transient") or {}).get("display_id") in self.views:
            return
        if parent and parent.get("msg_id"):
            self.others.add(parent["msg_id"])


_OUTPUTS: dict = {}


def cell_outputs(kernel) -> CellOutputs | None:
    """The kernel's CellOutputs, made at the first watched call."""
    session = getattr(kernel, "session", None)
    if session is None:
        return None
    if id(session) not in _OUTPUTS:
        _OUTPUTS[id(session)] = CellOutputs(session)
    return _OUTPUTS[id(session)]


def display_publisher():
    """publish(bundle, final) -> shows, then updates, one display in the cell that
    is running now, even if another cell runs by the time it is drawn (a call
    from a thread). publish(None, True): nothing is left to show; the display is
    taken away if the cell has no other output (else it is left empty)."""
    from IPython import get_ipython
    from IPython.display import display

    ip = get_ipython()
    pub = getattr(ip, "display_pub", None)
    parent = ip.kernel.get_parent("shell")
    outputs = cell_outputs(ip.kernel)
    cell = (parent or {}).get("header", {}).get("msg_id")
    handle = None

    def publish(bundle: dict | None, final: bool = False) -> None:
        nonlocal handle
        token = pub.set_thread_parent(parent) if hasattr(pub, "set_thread_parent") \
            else None
        try:
            if bundle is None:
                if handle is not None and outputs is not None and \
                        cell not in outputs.others:
                    pub.clear_output()      # the view was the cell's only output
                elif handle is not None:
                    handle.update({"text/plain": ""}, raw=True)
            elif handle is None:
                view = uuid.uuid4().hex
                if outputs is not None:  # known before its first message is sent
                    outputs.views.add(view)
                handle = display(bundle, raw=True, display_id=view)
            else:
                handle.update(bundle, raw=True)
        finally:
            if token is not None:
                pub.reset_thread_parent(token)

    return publish


class LiveView:
    """What one call shows while it runs. `publish(bundle, final)` draws it."""

    def __init__(self, ranks: list[int], width: int, publish,
                 redraw: float = DEFAULT.redraw):
        self.ranks = ranks
        self.redraw = redraw  # seconds between redraws, at least
        self.width = width
        self.publish = publish
        self.lines: dict[int, deque] = {r: deque(maxlen=TAIL) for r in ranks}
        self.counts = dict.fromkeys(ranks, 0)
        self.bars: dict[tuple[int, int], Progress] = {}
        self.statuses: dict[int, str] = {}
        self._drawn = 0.0
        self._dirty = False
        self.shown = False  # whether anything was drawn in the cell yet
        self.broken = False  # a frontend that failed once is not asked again

    def _send(self, bundle: dict, final: bool) -> bool:
        if self.broken:
            return False
        try:
            self.publish(bundle, final)
            self.shown = True
            return True
        except Exception:  # noqa: BLE001  (a view must never break the call)
            self.broken = True
            return False

    # -- what arrives --------------------------------------------------------

    def add_lines(self, rank: int, stream: str, lines: list[str]) -> None:
        if lines:
            self.lines[rank].extend((stream, ln) for ln in lines)
            self.counts[rank] += len(lines)
            self._dirty = True

    def progress(self, rank: int, msg: Progress) -> None:
        self.bars[(rank, msg.bar)] = msg
        self._dirty = True

    def set_status(self, statuses: dict[int, str]) -> None:
        self.statuses = dict(statuses)
        self._dirty = True

    def refresh(self, now: float | None = None) -> None:
        """Redraw if something changed and the last redraw is `redraw` old."""
        now = time.monotonic() if now is None else now
        if self._dirty and now - self._drawn >= self.redraw:
            self._send(self._bundle(), False)
            self._drawn, self._dirty = now, False

    def finish(self, transcript: list) -> bool:
        """The final picture: the bars as they ended, then the transcript. False
        if the frontend failed (the caller then prints the transcript)."""
        bars = self._bars_text()
        text = "".join(t for _, t in transcript)
        red = " style='color:#b22'"
        body = "".join(f"<span{red if s == 'stderr' else ''}>{html.escape(t)}</span>"
                       for s, t in transcript)
        if not bars and not text:  # nothing to keep: no output, not a blank one
            return self._send(None, True) if self.shown else True
        else:
            body_html = self._bars_html() + (f"<pre style='{_PRE}'>{body}</pre>"
                                             if text else "")
        return self._send({"text/plain": "\n".join(filter(None, [bars,
                                                            text.rstrip()])),
                           "text/html": body_html}, True)

    # -- drawing -------------------------------------------------------------

    def _prefix(self, rank: int) -> str:
        return f"[rank {rank:>{self.width}}] "

    def _bars_text(self) -> str:
        return "\n".join(self._prefix(r) + _bar_text(p)
                         for (r, _), p in sorted(self.bars.items()))

    def _bars_html(self) -> str:
        rows = "".join(
            f"<tr><td style='{_TD}'>{html.escape(self._prefix(r))}"
            f"{html.escape(p.desc)}</td><td style='{_TD}'>{_bar_html(p)}</td>"
            f"<td style='{_TD}'>{html.escape(_counts(p))}</td></tr>"
            for (r, _), p in sorted(self.bars.items()))
        return f"<table style='border-collapse:collapse'>{rows}</table>" if rows else ""

    def _bundle(self) -> dict:
        text, spans = [], []
        for r in self.ranks:
            hidden = self.counts[r] - len(self.lines[r])
            if hidden:
                text.append(f"{self._prefix(r)}... ({hidden} earlier lines)")
                spans.append(("more", text[-1]))
            for stream, ln in self.lines[r]:
                text.append(self._prefix(r) + ln)
                spans.append((stream, text[-1]))
        status = [f"rank {r}: {s}" for r, s in sorted(self.statuses.items())]
        plain = "\n".join(filter(None, [self._bars_text(), "\n".join(text),
                                        "\n".join(status)]))
        colour = {"stderr": "#b22", "more": "#888"}
        lines_html = "\n".join(
            f"<span style='color:{colour[s]}'>{html.escape(t)}</span>" if s in colour
            else html.escape(t) for s, t in spans)
        status_html = "\n".join(html.escape(s) for s in status)
        parts = [self._bars_html()]
        if spans:
            parts.append(f"<pre style='{_PRE}'>{lines_html}</pre>")
        if status:
            parts.append(f"<pre style='{_PRE};color:#555;font-style:italic'>"
                         f"{status_html}</pre>")
        return {"text/plain": plain, "text/html": "".join(parts)}


_PRE = "margin:0;padding:0;font-size:12px;line-height:1.3"
_TD = "padding:0 8px 0 0;font-family:monospace;font-size:12px;text-align:left"


def _counts(p: Progress) -> str:
    done = f"{p.n}/{p.total}" if p.total else f"{p.n}"
    rate = f", {p.n / p.elapsed:.1f} it/s" if p.elapsed > 0 and p.n else ""
    return f"{done} [{p.elapsed:.1f} s{rate}]"


def _fraction(p: Progress) -> float:
    if not p.total:
        return 1.0 if p.done else 0.0
    return min(1.0, p.n / p.total)


def _bar_text(p: Progress, width: int = 20) -> str:
    filled = round(_fraction(p) * width)
    return f"{p.desc} |{'#' * filled}{'.' * (width - filled)}| {_counts(p)}"


def _bar_html(p: Progress) -> str:
    pct = 100 * _fraction(p)
    colour = "#55A868" if p.done else "#4C72B0"
    return (f"<div style='width:160px;height:10px;background:#e6e6e6'>"
            f"<div style='width:{pct:.0f}%;height:10px;background:{colour}'></div>"
            "</div>")
