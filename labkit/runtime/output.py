"""What ranks print: each rank's stdout and stderr (file descriptors 1 and 2, so C++
warnings and output written just before a crash are kept too) go to files.

Imports labkit.units and the standard library.

While a call runs, `tail` reads the whole lines written since it last looked (the
live view); when it returns, `transcript` prints everything in rank order, so what
a notebook keeps never depends on timing. Bounded on disk by the rank itself
(RankFiles): of one call's output it keeps the first HEAD bytes and the last
SEGMENT or more, and what lies between becomes one '... left out ...' line.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time

from labkit.units import human_bytes

SEGMENT = 256 << 10  # bytes in one segment file before the next one starts
HEAD = 1 << 20  # bytes kept from the start of one call's output (per stream)
WATCH = 0.1  # seconds between a rank's looks at the size of its own files
# every name a rank or the kernel writes here (restarted() and scratch.py clean up)
FILE_NAME = re.compile(r"rank\d+\.(out|err)\.\d+\.\d+(\.left)?(\.new)?")


# ------------------------------------------------------------- the kernel's side


class RankOutput:
    """The files a cluster's ranks write to, and how far each has been shown."""

    def __init__(self, directory: str, world_size: int):
        self.directory = directory
        self.width = len(str(world_size - 1))
        self._gen = 0  # one set of files per start of the ranks
        # (rank, stream) -> position (segment, 0 data / 1 note, offset) up to which
        # the last transcript showed, or the last tail read whole lines
        self._shown: dict[tuple[int, str], tuple[int, int, int]] = {}
        self._tailed: dict[tuple[int, str], tuple[int, int, int]] = {}

    def path(self, rank: int, stream: str) -> str:
        """The stem of `rank`'s `stream` files: segment n is f"{stem}.{n}"."""
        return os.path.join(self.directory, f"rank{rank}.{stream}.{self._gen}")

    def restarted(self) -> None:
        """New rank processes write new files: delete the old ones, start anew."""
        self._gen += 1
        self._shown.clear()
        self._tailed.clear()
        for name in os.listdir(self.directory):
            if FILE_NAME.fullmatch(name):
                try:
                    os.unlink(os.path.join(self.directory, name))
                except FileNotFoundError:
                    pass

    def _index(self, names=None) -> dict[str, list[tuple[int, int, str]]]:
        """stem -> (segment, 0 data or 1 note, path) of its files, in order, for
        every file in the folder (`names`: its listing, if already made)."""
        names = os.listdir(self.directory) if names is None else names
        index: dict[str, list] = {}
        for name in names:
            stem, dot, rest = name.partition(".")  # rank3 . out.2.5[.left]
            stream, _, rest = rest.partition(".")
            gen, _, rest = rest.partition(".")
            n, dot, left = rest.partition(".")
            if n.isdigit() and (not dot or left == "left"):
                index.setdefault(f"{stem}.{stream}.{gen}", []).append(
                    (int(n), 1 if dot else 0, os.path.join(self.directory, name)))
        for pieces in index.values():
            pieces.sort()
        return index

    def _gather(self, rank: int, stream: str, start: tuple[int, int, int],
                limit: int | None, index=None) -> list[tuple[tuple, bytes]]:
        """What `rank` wrote to `stream` from position `start` on: (position
        each piece starts at, its bytes), at most `limit` bytes in all."""
        index = self._index() if index is None else index
        stem = os.path.basename(self.path(rank, stream))
        chunks, got = [], 0
        for n, kind, path in index.get(stem, ()):
            if (n, kind) < start[:2]:
                continue
            offset = start[2] if (n, kind) == start[:2] else 0
            try:
                if not kind and os.stat(path).st_size == offset:
                    continue  # nothing new (a stat is cheaper than an open)
                with open(path, "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    if kind and size != offset:
                        offset = 0  # a note the rank has rewritten since: again
                    offset = min(offset, size)  # cut short since: nothing new
                    f.seek(offset)
                    data = f.read(-1 if limit is None else limit - got)
            except FileNotFoundError:
                continue  # left out (deleted) since it was listed
            chunks.append(((n, kind, offset), data))
            got += len(data)
            if limit is not None and got >= limit:
                break
        return chunks

    def read(self, rank: int, stream: str, limit: int | None = None,
             index=None) -> str:
        """What `rank` wrote to `stream` since the last read (at most `limit`
        bytes of it, then a note saying how much more there was)."""
        key = (rank, stream)
        chunks = self._gather(rank, stream, self._shown.get(key, (0, 0, 0)), None,
                              index)
        if not chunks:
            return ""
        (n, kind, offset), last = chunks[-1]
        self._shown[key] = (n, kind, offset + len(last))
        data = b"".join(c for _, c in chunks)
        text = data[:limit].decode(errors="replace")
        if limit is not None and len(data) > limit:
            text += f"\n... ({len(data) - limit} more bytes not shown)"
        return text

    def tail(self, rank: int, stream: str, limit: int = 1 << 16) -> list[str]:
        """Whole lines `rank` wrote to `stream` since the last tail (or transcript);
        a line still being written waits for its newline."""
        key = (rank, stream)
        start = max(self._tailed.get(key, (0, 0, 0)), self._shown.get(key, (0, 0, 0)))
        chunks = self._gather(rank, stream, start, limit)
        for (n, kind, offset), data in reversed(chunks):  # the last newline
            end = data.rfind(b"\n") + 1
            if end:
                self._tailed[key] = (n, kind, offset + end)
                break
        else:
            return []
        text = b"".join(c for _, c in chunks)
        return text[:text.rfind(b"\n")].decode(errors="replace").split("\n")

    def prefix(self, rank: int) -> str:
        return f"[rank {rank:>{self.width}}] "

    def transcript(self, ranks: list[int]
                   ) -> tuple[dict[int, str], dict[int, str], list]:
        """What each rank wrote, in rank order: (rank -> its stdout, rank -> its
        stderr, and a list of (stream, text) with every line prefixed by its
        rank)."""
        index = self._index()
        outputs, errors, parts = {}, {}, []
        for r in sorted(ranks):
            out, err = (self.read(r, "out", index=index),
                        self.read(r, "err", index=index))
            outputs[r], errors[r] = out, err
            for text, stream in ((out, "stdout"), (err, "stderr")):
                if text:
                    lines = text.rstrip("\n").split("\n")
                    parts.append((stream, "".join(self.prefix(r) + ln + "\n"
                                                  for ln in lines)))
        return outputs, errors, parts


def write_transcript(parts: list) -> None:
    """Print a transcript to this process's stdout and stderr."""
    for stream, text in parts:
        (sys.stdout if stream == "stdout" else sys.stderr).write(text)
    sys.stdout.flush()
    sys.stderr.flush()


# --------------------------------------------------------------- the rank's side


class _Stream:
    """One stream's segments, on the rank (file descriptor `fd`)."""

    def __init__(self, fd: int, stem: str, name: str):
        self.fd, self.stem, self.name = fd, stem, name
        self.n = 0  # the segment being written
        self.on_disk = [0]  # segments on disk (notes: in `notes`)
        self.notes: set[int] = set()  # f"{stem}.{s}.left": what left out after s
        self.window = (0, 0)  # (segment, offset) where this call's output starts
        self.head_end: int | None = None  # its last segment kept whole, once full
        self.left_out = (0, 0)  # lines and bytes of this call's output left out
        self.read_below = 0  # the kernel has read the segments before this one

    def _path(self, s: int) -> str:
        return f"{self.stem}.{s}"

    def _open(self, n: int) -> None:
        path = self._path(n)
        fd = os.open(path + ".new", os.O_WRONLY | os.O_CREAT | os.O_TRUNC |
                     os.O_APPEND, 0o600)
        os.dup2(fd, self.fd)  # from here on every write goes to the new file
        os.close(fd)
        os.rename(path + ".new", path)  # so the kernel sees it only now

    def check(self) -> None:
        """Start the next segment once this one is full; keep the call's bounds."""
        if os.fstat(self.fd).st_size >= SEGMENT:
            self.n += 1
            self._open(self.n)
            self.on_disk.append(self.n)
        self.prune()

    def prune(self) -> None:
        """Of this call's output, keep the first HEAD bytes and the last SEGMENT
        or more (the segment being written, and the end of the one before), and
        say, in a note after the head, how much went. Only finished segments are
        cut: no write is ever lost but those left out."""
        first, offset = self.window
        segs = [s for s in self.on_disk if s >= first]
        if len(segs) < 2:
            return
        room, rest, went = HEAD, [], [0, 0]
        for s in segs[:-1]:
            if self.head_end is not None:
                if s > self.head_end:
                    rest.append(s)
                continue
            start = offset if s == first else 0
            size = os.path.getsize(self._path(s))
            if size - start >= room:  # the head ends in this one: cut it there
                self._cut(s, start, start + room, went)
                self.head_end = s
            room -= size - start
        for s in rest[:-1]:  # between the head and the last two: all of it
            self._cut(s, 0, 0, went)
            _unlink(self._path(s))
            self.on_disk.remove(s)
        if rest:
            self._keep_end(rest[-1], went)
        if went[1]:
            self.left_out = (self.left_out[0] + went[0], self.left_out[1] + went[1])
            self._write_note(self.head_end)

    def _cut(self, s: int, start: int, at: int, went: list) -> None:
        """Cut segment `s` short at byte `at` (at the line break before it, if
        one comes after `start`), counting the lines and bytes that go into
        `went`."""
        with open(self._path(s), "r+b") as f:
            data = f.read()
            at = data.rfind(b"\n", start, at) + 1 or at
            went[0] += data.count(b"\n", at)
            went[1] += len(data) - at
            f.truncate(at)

    def _keep_end(self, s: int, went: list) -> None:
        """Keep only the last SEGMENT bytes (from a line break) of segment `s`."""
        path = self._path(s)
        with open(path, "rb") as f:
            data = f.read()
        if len(data) <= SEGMENT:
            return
        keep = len(data) - SEGMENT
        keep = data.find(b"\n", keep) + 1 or keep
        went[0] += data.count(b"\n", 0, keep)
        went[1] += keep
        with open(path + ".new", "wb") as f:
            f.write(data[keep:])
        os.rename(path + ".new", path)

    def _write_note(self, after: int) -> None:
        lines, nbytes = self.left_out
        with open(self._path(after), "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 1))
            newline = "" if f.read(1) in (b"\n", b"") else "\n"
        text = (f"{newline}... {lines} lines ({human_bytes(nbytes)}) left out: of "
                f"what a rank writes to {self.name} in one call, labkit keeps the "
                f"first {human_bytes(HEAD)} and the last {human_bytes(SEGMENT)} "
                "or more\n")
        path = f"{self.stem}.{after}.left"
        with open(path + ".new", "w") as f:
            f.write(text)
        os.rename(path + ".new", path)
        self.notes.add(after)

    def new_window(self, read: bool) -> None:
        """A call starts (read=False: first delete what the kernel has read) or
        has ended (read=True: what is on disk now, the kernel reads next)."""
        self.check()
        if read:
            self.read_below = self.n
        else:
            for s in [s for s in self.on_disk if s < self.read_below]:
                _unlink(self._path(s))
                self.on_disk.remove(s)
            for s in [s for s in self.notes if s < self.read_below]:
                _unlink(f"{self.stem}.{s}.left")
                self.notes.remove(s)
        self.window = (self.n, os.fstat(self.fd).st_size)
        self.head_end, self.left_out = None, (0, 0)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class RankFiles:
    """A rank's stdout and stderr files, kept bounded (see the module's note).
    `call_started` and `call_ended` frame each call; a thread watches sizes."""

    def __init__(self, out_stem: str, err_stem: str):
        self._streams = (_Stream(1, out_stem, "stdout"), _Stream(2, err_stem,
                                                                 "stderr"))
        self._lock = threading.Lock()
        for s in self._streams:
            s._open(0)
        threading.Thread(target=self._watch, daemon=True,
                         name="labkit-output").start()

    def _watch(self) -> None:
        while True:
            time.sleep(WATCH)
            self._each("check")

    def _each(self, method: str, *args) -> None:
        with self._lock:
            for s in self._streams:
                try:
                    getattr(s, method)(*args)
                except OSError:  # a full disk, a file of ours removed by hand
                    pass

    def call_started(self) -> None:
        self._each("new_window", False)

    def call_ended(self) -> None:
        self._each("new_window", True)
