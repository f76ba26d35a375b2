"""What ranks print. Each rank's stdout and stderr go to files (file descriptors 1
and 2, so C++ warnings and output written just before a crash are kept too). While
a call runs, `tail` reads the whole lines written since it last looked (for the
live view); when the call returns, `transcript` prints everything each rank wrote
during it, in rank order, so what a notebook keeps never depends on timing."""

from __future__ import annotations

import os
import sys

MAX_OUTPUT = 1 << 20  # bytes of one rank's output shown per call


class RankOutput:
    """The files a cluster's ranks write to, and how far each has been shown."""

    def __init__(self, directory: str, world_size: int):
        self.directory = directory
        self.width = len(str(world_size - 1))
        self._shown: dict[tuple[int, str], int] = {}  # end of the last transcript
        self._tailed: dict[tuple[int, str], int] = {}  # end of the last whole line

    def path(self, rank: int, stream: str) -> str:
        return os.path.join(self.directory, f"rank{rank}.{stream}")

    def restarted(self) -> None:
        """New rank processes truncate their files: start from the top."""
        self._shown.clear()
        self._tailed.clear()

    def read(self, rank: int, stream: str, limit: int = MAX_OUTPUT) -> str:
        """What `rank` wrote to `stream` since the last read (at most `limit` bytes
        of it, then a note saying where the rest is)."""
        path = self.path(rank, stream)
        start = self._shown.get((rank, stream), 0)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size <= start:
                    return ""
                f.seek(start)
                data = f.read(min(size - start, limit))
        except FileNotFoundError:
            return ""
        self._shown[(rank, stream)] = size
        text = data.decode(errors="replace")
        if size - start > limit:
            text += f"\n... ({size - start - limit} more bytes in {path})"
        return text

    def tail(self, rank: int, stream: str, limit: int = 1 << 16) -> list[str]:
        """Whole lines `rank` wrote to `stream` since the last tail (or transcript);
        a line still being written waits for its newline."""
        key = (rank, stream)
        start = max(self._tailed.get(key, 0), self._shown.get(key, 0))
        try:
            with open(self.path(rank, stream), "rb") as f:
                f.seek(start)
                data = f.read(limit)
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        if end == 0:
            return []
        self._tailed[key] = start + end
        return data[:end].decode(errors="replace").split("\n")[:-1]

    def prefix(self, rank: int) -> str:
        return f"[rank {rank:>{self.width}}] "

    def transcript(self, ranks: list[int]
                   ) -> tuple[dict[int, str], dict[int, str], list]:
        """What each rank wrote, in rank order: (rank -> its stdout, rank -> its
        stderr, and a list of (stream, text) with every line prefixed by its
        rank)."""
        outputs, errors, parts = {}, {}, []
        for r in sorted(ranks):
            out, err = self.read(r, "out"), self.read(r, "err")
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
