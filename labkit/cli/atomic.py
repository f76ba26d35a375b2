"""Writes that an interruption cannot leave half done: the text goes to a
temporary file beside the destination, which is then renamed over it (a rename
within a folder is atomic), so a reader sees the old file or the new, never part."""

from __future__ import annotations

import os
from pathlib import Path


def write_text(path: Path, text: str) -> None:
    """Write `path` via `.NAME.PID.tmp` beside it and a rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
