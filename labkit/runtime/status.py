"""What a busy rank is doing, in the student's terms: the collective it waits in,
and the innermost line of the student's own code that led there.

A rank's stack runs through Python's machinery (importlib while it unpickles a
function, `inspect`, code generated from strings), the standard library, torch
and labkit. None of that is the student's: a status line names the student's
line (a notebook cell, or a file of their own) and, where no such line is on the
stack yet, what the rank is doing instead ("unpickling your function (importing
torch.distributed.tensor)")."""

from __future__ import annotations

import io
import linecache
import os
import sysconfig
import tokenize

from labkit.runtime.messages import Status

_TORCH_DIR = os.sep + "torch" + os.sep
_LABKIT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _library_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    dirs = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")
            if paths.get(k)}
    return tuple(sorted(os.path.realpath(d) + os.sep for d in dirs)) + (
        os.path.realpath(_LABKIT_DIR) + os.sep,)


_LIBRARY_DIRS = _library_dirs()


# code typed by a person that has no file of its own; every other "<...>" name is
# code made by a program: "<string>" (a dataclass's or namedtuple's generated
# __init__), "<frozen importlib._bootstrap>", "<attrs generated init ...>"
_TYPED = ("<ipython-input", "<%%ranks", "<stdin>", "<console")


def is_cell(filename: str) -> bool:
    """A notebook cell's code (ipykernel names cells /tmp/ipykernel_PID/HASH.py)."""
    return ("ipykernel_" in filename or filename.startswith("<ipython-input")
            or filename.startswith("<%%ranks"))


def is_users(filename: str) -> bool:
    """The student's own code: a cell, code typed at a prompt, or a file outside
    Python, its installed packages, torch and labkit. Never '<frozen ...>',
    '<string>' or other code generated at run time."""
    if is_cell(filename):
        return True
    if filename.startswith("<") or not filename:
        return filename.startswith(_TYPED)
    if _TORCH_DIR in filename:
        return False
    path = os.path.realpath(filename)
    return not path.startswith(_LIBRARY_DIRS)


def innermost_users(stack) -> int | None:
    """The index in `stack` ((file, line, function), outermost first) of the
    innermost frame of the student's own code (is_users); None if there is none.
    Status lines and the checks' explanations (checks/explain.py) both use it."""
    mine = [i for i, f in enumerate(stack) if is_users(f[0])]
    return mine[-1] if mine else None


def line_of(filename: str, lineno: int) -> str:
    """'line 4 of your cell', or 'line 4 of ring.py' for a file of theirs."""
    where = "your cell" if is_cell(filename) else os.path.basename(filename)
    return f"line {lineno} of {where}"


def _library_name(filename: str) -> str:
    if _TORCH_DIR in filename:
        return "torch"
    if os.path.realpath(filename).startswith(os.path.realpath(_LABKIT_DIR)):
        return "labkit"
    return "Python"


def code_only(line: str) -> str:
    """A source line without its trailing comment (status lines stay short)."""
    try:
        for tok in tokenize.generate_tokens(io.StringIO(line.strip()).readline):
            if tok.type == tokenize.COMMENT:
                return line.strip()[:tok.start[1]].rstrip()
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass
    return line.strip()


def _collective(status: Status) -> str | None:
    """'all_reduce of 1.0 MiB (group of 4)' (the rank measured it), else the
    torch.distributed collective on the stack, else None."""
    if status.activity:
        return status.activity
    calls = [f for f in status.stack if f[0].endswith("distributed_c10d.py")
             and not f[2].startswith(("<", "_"))]  # all_reduce, not its helpers
    return calls[-1][2] if calls else None


def _where(status: Status):
    """(the innermost frame of the student's code, the first library frame it
    called), either None."""
    stack = status.stack
    inner = innermost_users(stack)
    if inner is None:
        return None, None
    called = stack[inner + 1] if inner + 1 < len(stack) else None
    return stack[inner], called


def _doing(status: Status) -> str | None:
    """What a rank does where none of the student's code is on its stack."""
    if status.phase is None and status.importing is None:
        return None
    what = status.phase or "running"
    return what + (f" (importing {status.importing})" if status.importing else "")


def describe_live(status: Status) -> str:
    """'in all_reduce of 1.0 MiB (group of 4), line 4 of your cell:
    dist.all_reduce(x), 1.8 s': one status line for the live view of a call."""
    collective = _collective(status)
    frame, called = _where(status)
    parts = []
    if frame is None and not collective and status.phase:
        parts.append(_doing(status))  # none of the student's code runs yet
    elif collective:
        parts.append(f"in {collective}")
    elif status.importing:
        parts.append(f"importing {status.importing}")
    elif frame is not None and called is not None and not called[2].startswith("<"):
        parts.append(f"in {called[2]} ({_library_name(called[0])})")
    if frame is not None:
        filename, lineno, _ = frame
        src = code_only(linecache.getline(filename, lineno))
        parts.append(line_of(filename, lineno) + (f": {src}" if src else ""))
    parts.append(f"{status.seconds:.1f} s")
    return ", ".join(parts) if len(parts) > 1 else f"running, {parts[0]}"


def describe_busy(status: Status) -> str:
    """'in all_reduce (torch.distributed), called at File ..., line 4: x = ...':
    what a rank still busy after a call gave up was doing."""
    if status.call_id is None and not status.phase:
        return "idle"
    parts = []
    collective = _collective(status)
    if collective:
        parts.append(f"in {collective} (torch.distributed)")
    frame, _ = _where(status)
    if frame is not None:
        filename, lineno, name = frame
        src = linecache.getline(filename, lineno).strip()
        where = f'File "{filename}", line {lineno}, in {name}'
        parts.append(("called at " if parts else "at ") + where
                     + (f": {src}" if src else ""))
    elif not parts and (doing := _doing(status)):
        parts.append(doing)
    return ", ".join(parts) or "busy"
