"""How a check tells what went wrong on the ranks, in the kernel (which has the
notebook's cell sources): the student's own line among a traceback's frames, one
message for ranks that raised, and what every rank waited for when a call ran
past its timeout ("deadlock: every rank is waiting in recv from its left
neighbour")."""

from __future__ import annotations

import linecache
import re

from labkit.checks.watch import AnswerRaised
from labkit.runtime import CollectiveTimeout, RankError, innermost_users, line_of

# ------------------------------------------------------------ where it happened


def student_frame(frames):
    """The innermost (file, line, function) of the student's own code: neither
    labkit's, torch's nor the standard library's, nor code generated at run time
    (the rule status lines use too: labkit.runtime.status.innermost_users). None
    if there is none."""
    frames = list(frames or [])
    i = innermost_users(frames)
    return None if i is None else tuple(frames[i])


def at_line(frame) -> str:
    """' at line 4 of your cell, in my_ring: `x = chunks[rank + 1]`'"""
    if frame is None:
        return ""
    filename, lineno, name = frame
    src = linecache.getline(filename, int(lineno)).strip()
    return f" at {line_of(filename, int(lineno))}, in {name}" + (
        f": `{src}`" if src else "")


def _ranks(rs) -> str:
    rs = sorted(rs)
    if len(rs) == 1:
        return f"rank {rs[0]}"
    return "ranks " + ", ".join(map(str, rs[:-1])) + f" and {rs[-1]}"


_HINTS = (
    ("IndexError", "", "an index past the end: indices run from 0 to len - 1 "
                       "(chunks and ranks: 0 to world_size - 1; wrap around with "
                       "% world_size)"),
    ("RuntimeError", "size", "two tensors of different sizes met: compare the "
                             "sizes of what you send and receive, copy into, or add "
                             "(a receive buffer needs exactly as many elements as "
                             "the send it pairs with)"),
    ("RuntimeError", "shape", "two tensors of different shapes met: compare the "
                              "shapes of what you send, receive and add"),
    ("RuntimeError", "dtype", "two tensors of different dtypes met: make the buffer "
                              "with torch.empty_like(...) of what it receives"),
    ("TypeError", "argument", "a call got arguments it does not take: compare "
                              "your call with the signature in the exercise"),
)


def hint_for(type_name: str, message: str) -> str:
    for kind, word, hint in _HINTS:
        if type_name == kind and word in message.lower():
            return f". Hint: {hint}"
    return ""


def _consequence(message: str) -> bool:
    """An error a rank gets because another rank stopped (gloo's broken pair)."""
    m = message.lower()
    return any(w in m for w in ("connection closed", "connection reset",
                                "broken pipe", "connection refused"))


# what gloo puts around a message, which differs from rank to rank: the rank and
# time its C++ checks put in front ("[rank2]:[F1122 17:12:33.1234
# ProcessGroupGloo.cpp:1536] "), its source location ("[enforce fail at
# /__w/.../pair.cc:456] ", "[/__w/.../pair.cc:537] "), a peer's address and port,
# and its boilerplate
_GLOO_NOISE = (
    re.compile(r"\[rank\d+\]:\s*(\[[A-Z]\d{4} [\d:.]+ [\w./-]+:\d+\]\s*)?"),
    re.compile(r"\[(enforce fail at )?/[^\]]+\.(cc|cpp|h):\d+\]\s*"),
    re.compile(r" ?\[[\d.]+\]:\d+"),
    re.compile(r"\s*This is typically caused by .*$", re.S),
)


def _plain(message: str) -> str:
    """The message without gloo's per-rank prefix, source paths, addresses and
    boilerplate, so that ranks with the same error are one line."""
    for noise in _GLOO_NOISE:
        message = noise.sub("", message)
    return message


def failure_message(err: RankError, what: str = "answer") -> str:
    """One message for ranks that raised: grouped by error and line, the cause
    before its consequences (a peer's closed connection), then by lowest rank; a
    rank that died is said to have died."""
    groups: dict[tuple, list[int]] = {}
    for r in sorted(err.failures):
        e = err.exceptions.get(r)
        if isinstance(e, AnswerRaised):
            key = (e.type_name, _plain(e.message), student_frame(e.frames))
        elif e is not None:
            key = (type(e).__name__, _plain(str(e)), None)
        else:  # the rank died: the failure text says how (and its last words)
            key = ("died", _plain(err.failures[r].split(": ", 1)[-1]), None)
        groups.setdefault(key, []).append(r)
    lines = []
    # a peer's broken connection is a consequence: the cause goes first
    for (kind, message, frame), ranks in sorted(
            groups.items(), key=lambda g: (_consequence(g[0][1]), g[1][0])):
        first = message.strip().splitlines()[0] if message.strip() else ""
        if kind == "died":
            hint = (". Hint: the ranks called one collective with different sizes or "
                    "dtypes: compare what each rank passes" if "size" in first
                    and "match" in first else "")
            lines.append(f"{_ranks(ranks)} died ({first}) while running your "
                         f"{what}{hint}")
            continue
        after = (" (a consequence: a rank it was talking to had stopped)"
                 if _consequence(message) and len(groups) > 1 else "")
        lines.append(f"{_ranks(ranks)}: your {what} raised {kind}"
                     + (f": {first}" if first else "") + after + at_line(frame)
                     + hint_for(kind, message))
    if err.busy:
        were = "was" if len(err.busy) == 1 else "were"
        lines.append(f"({_ranks(err.busy)} had not finished and {were} stopped; the "
                     "next run starts the ranks again)")
    return "\n".join(lines)


# ----------------------------------------------------------------- deadlocks

_P2P = re.compile(r"(?P<op>recv|send|wait for irecv|wait for isend) (?:from|to) rank "
                  r"(?P<peer>\d+), at File \"(?P<file>[^\"]+)\", line (?P<line>\d+), "
                  r"in (?P<func>[\w<>.]+)")
_COLLECTIVE = re.compile(r"in (?P<op>.+?) \(torch\.distributed\)")
_FRAME = re.compile(r"File \"(?P<file>[^\"]+)\", line (?P<line>\d+), "
                    r"in (?P<func>[\w<>.]+)")


def _waits(busy: dict[int, str]) -> dict[int, dict]:
    """rank -> {"op", "peer" (None for a collective), "frame"} from the status text."""
    out = {}
    for r, text in busy.items():
        m = _P2P.search(text)
        if m:
            out[r] = {"op": m["op"].removeprefix("wait for i"), "peer": int(m["peer"]),
                      "frame": (m["file"], int(m["line"]), m["func"])}
            continue
        m, f = _COLLECTIVE.search(text), _FRAME.search(text)
        frame = (f["file"], int(f["line"]), f["func"]) if f else None
        out[r] = {"op": m["op"] if m else None, "peer": None, "frame": frame}
    return out


def _cycle(waits: dict[int, dict]) -> list[int] | None:
    """A cycle of ranks each waiting for the next, if the waits contain one."""
    for start in sorted(waits):
        path, r = [], start
        while r in waits and waits[r]["peer"] is not None and r not in path:
            path.append(r)
            r = waits[r]["peer"]
        if r in path:
            return path[path.index(r):] + [r]
    return None


def _prep(op: str) -> str:
    return "from" if op == "recv" else "to"


def _wait_line(r: int, w: dict) -> str:
    if w["peer"] is not None:
        what = f"{w['op']} {_prep(w['op'])} rank {w['peer']}"
    else:
        what = f"in {w['op']}" if w["op"] else "running, not waiting on another rank"
    frame = student_frame([w["frame"]]) if w["frame"] else None
    return f"  rank {r}: {what}{at_line(frame)}"


def _head(waits: dict, n: int, finished: list, timeout: float) -> str:
    peers = {r: w["peer"] for r, w in waits.items()}
    ops = {w["op"] for w in waits.values()}
    if all(w["op"] is None for w in waits.values()):
        return (f"{_ranks(waits)} still running after {timeout:g} s without waiting "
                "on another rank: an endless loop, or far more work than this "
                "exercise needs?")
    if any(p is None for p in peers.values()):
        return (f"deadlock: {_ranks(waits)} still waiting after {timeout:g} s; a "
                "collective returns only when every rank of the group has called it")
    if len(waits) == n and len(ops) == 1:
        op = ops.pop()
        for side, d in (("left", -1), ("right", 1)):
            if all(p == (r + d) % n for r, p in peers.items()):
                return (f"deadlock: every rank is waiting in {op} {_prep(op)} its "
                        f"{side} neighbour")
    if cyc := _cycle(waits):
        return ("deadlock: ranks wait for each other in a cycle, "
                + " -> ".join(f"rank {r}" for r in cyc))
    if gone := sorted(r for r, p in peers.items() if p in finished):
        r, op = gone[0], waits[gone[0]]["op"]
        return (f"deadlock: rank {r} waits in {op} {_prep(op)} rank {peers[r]}, which "
                "has already returned: the two disagree on how many messages pass "
                "between them")
    return f"deadlock: {_ranks(waits)} still waiting after {timeout:g} s"


def deadlock_message(err: CollectiveTimeout, world_size: int, timeout: float) -> str:
    """Name what every rank waits for when a call ran past `timeout`."""
    waits = _waits(err.busy)
    lines = [_head(waits, world_size, err.finished, timeout)]
    lines += [_wait_line(r, w) for r, w in sorted(waits.items())]
    lines += [f"  rank {r}: finished" for r in err.finished]
    if any(w["peer"] is not None for w in waits.values()):
        lines.append(
            "A blocking send or recv returns only once its partner has called the "
            "matching recv or send, so ranks that all send first (or all receive "
            "first) wait for each other forever. Post both halves at once with "
            "dist.isend and dist.irecv, then wait on both.")
    elif any(w["op"] for w in waits.values()):
        lines.append("Every rank must call the same collectives, in the same order.")
    lines.append(f"(found after {timeout:g} s; the ranks were stopped and start "
                 "again on the next run)")
    return "\n".join(lines)


def not_written(err: RankError) -> bool:
    """Every rank that failed raised NotImplementedError: a stub, not an answer."""
    excs = list(err.exceptions.values())
    return bool(excs) and all(
        isinstance(e, NotImplementedError) or (isinstance(e, AnswerRaised)
                                               and e.type_name == "NotImplementedError")
        for e in excs)
