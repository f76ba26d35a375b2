"""Each chapter executed once per run: what nbval ran is kept, outputs included.

A pytest plugin (`make test-notebooks`: `-p labkit.cli.executed --executed-to
_build/executed`) and `python -m labkit.cli.executed OUT CHAPTER...`; imports
nbformat, pytest, nbclient (when executing) and labkit.cli.atomic.

A copy records what it was executed from (a hash of the chapter's cells and of
labkit's source) and whether every cell passed; where `current()` says it holds,
the browser test, `make book` and `make slides` open it instead of executing.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
import pytest

from labkit.cli import atomic

ROOT = Path(__file__).resolve().parents[2]
KEY = "labkit_executed"  # the copy's notebook metadata: what it was executed from


@functools.cache
def _labkit_hash() -> str:
    h = hashlib.sha256()
    pkg = ROOT / "labkit"
    for f in sorted(pkg.rglob("*.py")):
        h.update(str(f.relative_to(pkg)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def fingerprint(nb) -> str:
    """What an execution depends on: the chapter's cells (kind, text) and labkit."""
    cells = [(c["cell_type"], "".join(c["source"])) for c in nb["cells"]]
    h = hashlib.sha256(json.dumps(cells).encode())
    h.update(_labkit_hash().encode())
    return h.hexdigest()


def copy_of(chapter: Path, out: Path) -> Path:
    return out / chapter.name


def current(chapter: Path, out: Path) -> bool:
    """The copy of `chapter` in `out` exists, passed, and was executed from this
    chapter's cells and this labkit."""
    copy = copy_of(chapter, out)
    if not copy.exists():
        return False
    try:
        meta = json.loads(copy.read_text(encoding="utf-8"))["metadata"].get(KEY, {})
    except (OSError, ValueError, KeyError):
        return False
    source = json.loads(chapter.read_text(encoding="utf-8"))
    return meta.get("passed") is True and meta.get("fingerprint") == fingerprint(source)


def write(nb, chapter: Path, out: Path, failed: list[int]) -> Path:
    """Write an executed copy of `chapter` into `out`: a temporary file, renamed."""
    source = json.loads(chapter.read_text(encoding="utf-8"))
    nb.metadata[KEY] = {"fingerprint": fingerprint(source), "passed": not failed,
                        "failed_cells": failed}
    out.mkdir(parents=True, exist_ok=True)
    dest = copy_of(chapter, out)
    atomic.write_text(dest, nbformat.writes(nb) + "\n")
    return dest


def _client(nb):
    """nbclient's handling of kernel messages (outputs, display updates, clear_output,
    widget state, Output widgets' captured outputs), fed messages that nbval read.
    Its stand-in for an Output widget's view stays off the wire: nbval owns the
    kernel, and the copy needs only the state."""
    from nbclient import NotebookClient
    from nbclient.output_widget import OutputWidget

    class _Output(OutputWidget):
        def sync_state(self) -> None:
            pass

    client = NotebookClient(nb, store_widget_state=True, record_timing=False)
    client.widget_registry = {"@jupyter-widgets/output": {"OutputModel": _Output}}
    client.reset_execution_trackers()
    client.clear_before_next_output = False
    return client


# ------------------------------------------------------------------ pytest plugin


def pytest_addoption(parser):
    parser.addoption("--executed-to", metavar="DIR", default=None,
                     help="write each notebook nbval executed, outputs and widget "
                          "state included, into DIR (labkit.cli.executed)")


class _Recorder:
    """One notebook's run under nbval: the iopub messages of each cell, turned
    into that cell's outputs as they come."""

    def __init__(self, path: Path):
        self.path = path
        self.nb = nbformat.read(str(path), as_version=4)
        self.code = [i for i, c in enumerate(self.nb.cells) if c.cell_type == "code"]
        for i in self.code:
            self.nb.cells[i].outputs, self.nb.cells[i].execution_count = [], None
        self.client = _client(self.nb)
        self.failed: list[int] = []
        self.count = 0
        self.kernel = None
        self.msg_id = None
        self.messages: list[dict] = []

    def attach(self, kernel) -> None:
        """Read what nbval reads: wrap the kernel's send and receive (once)."""
        if kernel is self.kernel:
            return
        self.kernel = kernel
        send, receive = kernel.execute_cell_input, kernel.get_message

        def execute_cell_input(*args, **kwargs):
            self.msg_id = send(*args, **kwargs)
            return self.msg_id

        def get_message(stream, timeout=None):
            msg = receive(stream, timeout=timeout)
            if stream == "iopub":
                self.messages.append(msg)
            return msg

        kernel.execute_cell_input, kernel.get_message = execute_cell_input, get_message

    def cell_done(self, number: int, passed: bool) -> None:
        from nbclient.exceptions import CellExecutionComplete

        index = self.code[number]
        cell = self.nb.cells[index]
        mine = [m for m in self.messages
                if self.msg_id and m["parent_header"].get("msg_id") == self.msg_id]
        self.messages, self.msg_id = [], None
        for msg in mine:
            try:
                self.client.process_message(msg, cell, index)
            except CellExecutionComplete:
                break
        if cell.source.strip():  # numbered as a Run All numbers them (nbval's own
            self.count += 1      # requests leave the kernel's count alone)
            cell.execution_count = self.count
        if not passed:
            self.failed.append(index)


_recorders: dict[str, _Recorder] = {}


def _cell_item(item):
    from nbval.plugin import IPyNbCell

    return item if isinstance(item, IPyNbCell) else None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    cell = _cell_item(item)
    if cell is None or not item.config.getoption("--executed-to"):
        return
    key = str(cell.parent.fspath)
    rec = _recorders.get(key) or _recorders.setdefault(key, _Recorder(Path(key)))
    if cell.parent.kernel is not None:
        rec.attach(cell.parent.kernel)


def pytest_runtest_makereport(item, call):
    cell = _cell_item(item)
    if cell is None or call.when != "call" or not item.config.getoption(
            "--executed-to"):
        return
    rec = _recorders.get(str(cell.parent.fspath))
    if rec is not None:
        skipped = call.excinfo is not None and call.excinfo.errisinstance(
            pytest.skip.Exception)
        rec.cell_done(cell.cell_num, passed=call.excinfo is None or skipped)


def pytest_runtest_teardown(item, nextitem):
    """After a chapter's last cell under nbval, write its executed copy to
    --executed-to; nothing when some of its cells were deselected (not a whole
    execution)."""
    cell = _cell_item(item)
    out = item.config.getoption("--executed-to")
    if cell is None or not out:
        return
    if nextitem is not None and getattr(nextitem, "parent", None) is cell.parent:
        return
    rec = _recorders.pop(str(cell.parent.fspath), None)
    if rec is None:
        return
    run = {c.cell_num for c in cell.parent.session.items
           if _cell_item(c) is not None and c.parent is cell.parent}
    if len(run) != len(rec.code):  # some cells deselected: not a whole execution
        return
    rec.client.set_widgets_metadata()
    write(rec.nb, rec.path, Path(out), rec.failed)


# ------------------------------------------------------------------ command line


def execute(chapter: Path, out: Path, timeout: int) -> Path:
    """Execute `chapter` with nbclient in its own folder and write its copy (each
    cell's start and end times kept in its metadata, as nbconvert keeps them)."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(str(chapter), as_version=4)
    client = NotebookClient(nb, timeout=timeout, store_widget_state=True,
                            kernel_name="python3",
                            resources={"metadata": {"path": str(chapter.parent)}})
    failed: list[int] = []
    try:
        client.execute()
    except CellExecutionError:
        failed = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and any(
            o.get("output_type") == "error" for o in c.get("outputs", []))]
    return write(nb, chapter, out, failed)


def main(argv: list[str] | None = None) -> int:
    """Execute the chapters whose copy in OUT is missing or stale (--jobs at once,
    each in a process of its own); non-zero when a cell of one failed."""
    ap = argparse.ArgumentParser(
        prog="python -m labkit.cli.executed",
        description="Execute the chapters whose copy in OUT is missing or stale "
                    "(outputs and widget state kept); the others are left as they are.")
    ap.add_argument("out", type=Path)
    ap.add_argument("chapters", type=Path, nargs="+")
    ap.add_argument("--timeout", type=int, default=120, help="seconds a cell may run")
    ap.add_argument("--jobs", type=int, default=1, help="chapters executed at once")
    args = ap.parse_args(argv)
    stale = []
    for chapter in args.chapters:
        if not chapter.is_file():
            ap.error(f"no such notebook: {chapter}")
        if current(chapter, args.out):
            print(f"{chapter.name}: its executed copy is current")
        else:
            stale.append(chapter)
    if len(stale) > 1 and args.jobs > 1:  # each in its own process: one kernel each
        cmd = [sys.executable, "-m", "labkit.cli.executed", "--timeout",
               str(args.timeout), str(args.out)]
        with ThreadPoolExecutor(args.jobs) as pool:
            codes = list(pool.map(lambda c: subprocess.run([*cmd, str(c)]).returncode,
                                  stale))
        return max(codes)
    status = 0
    for k, chapter in enumerate(stale, 1):
        print(f"{chapter.name}: executing ({k} of {len(stale)})", flush=True)
        copy = execute(chapter, args.out, args.timeout)
        if current(chapter, args.out):
            print(f"{chapter.name}: executed, every cell passed", flush=True)
        else:
            print(f"{chapter.name}: a cell failed; its outputs are in {copy}",
                  file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    raise SystemExit(main())
