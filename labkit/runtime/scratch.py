"""A cluster's folder in the temp directory (its ranks' socket and output files),
and the removal of those a killed kernel left behind.

Standard library only. A folder is named for its owner, labkit-<pid>-<start>-<hex>
(<start>: the process's start time, so a reused pid is told apart), and holds
owner.lock, locked while its cluster lives. Each new folder first removes the
folders whose owner is gone (no such pid, or one that started at another time)
and whose lock is free, and of those only the files labkit writes: a folder with
anything else in it stays.
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import tempfile

from labkit.runtime.output import FILE_NAME

_FOLDER = re.compile(r"labkit-(\d+)-(\d+)-[0-9a-f]{8}")
_OURS = re.compile(rf"ranks\.sock|owner\.lock(\.new)?|{FILE_NAME.pattern}")


def start_time(pid: int) -> str | None:
    """When process `pid` started (clock ticks since boot, from /proc), "0" where
    there is no /proc; None when there is no such process."""
    if not os.path.isdir("/proc/self"):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except OSError:  # PermissionError: it runs, as another user
            pass
        return "0"
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (FileNotFoundError, ProcessLookupError):
        return None


class Scratch:
    """A new folder of this process's, locked until `remove()`."""

    def __init__(self):
        sweep()
        me = f"labkit-{os.getpid()}-{start_time(os.getpid())}"
        while True:
            self.path = os.path.join(tempfile.gettempdir(),
                                     f"{me}-{secrets.token_hex(4)}")
            try:
                os.mkdir(self.path, 0o700)
                break
            except FileExistsError:
                continue
        # locked before it has its name, so no one ever sees it free
        lock = os.path.join(self.path, "owner.lock")
        self._lock = os.open(lock + ".new", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pass  # a file system without locks: the owner's pid alone tells
        os.rename(lock + ".new", lock)

    def remove(self) -> None:
        """Delete what labkit wrote in the folder, the folder if that empties it,
        and let go of the lock. Safe to call twice."""
        if self._lock is not None:
            remove_ours(self.path)
            os.close(self._lock)
            self._lock = None


def remove_ours(folder: str) -> bool:
    """Delete the files labkit writes in `folder`, then `folder` if it is empty
    (else it stays, with what labkit did not write). Whether it is gone."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return True
    for name in names:
        if _OURS.fullmatch(name):
            try:
                os.unlink(os.path.join(folder, name))
            except (FileNotFoundError, IsADirectoryError, PermissionError):
                pass
    try:
        os.rmdir(folder)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


def _lock_free(folder: str) -> bool:
    try:
        fd = os.open(os.path.join(folder, "owner.lock"), os.O_RDONLY)
    except FileNotFoundError:
        return True  # its owner died before it took the lock
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        return True  # no locks here: the owner's pid alone tells
    finally:
        os.close(fd)
    return True


def sweep(directory: str | None = None) -> list[str]:
    """Remove the folders of clusters whose kernel is gone (see the module's
    note) from `directory` (the temp directory); the folders removed."""
    directory = directory or tempfile.gettempdir()
    removed = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        m = _FOLDER.fullmatch(entry.name)
        if m is None:
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or \
                    entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
        except OSError:
            continue
        pid, started = int(m[1]), m[2]
        if pid <= 0 or start_time(pid) == started or not _lock_free(entry.path):
            continue  # its owner runs, or holds the lock
        if remove_ours(entry.path):
            removed.append(entry.path)
    return removed
