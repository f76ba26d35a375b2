"""The real-browser test: JupyterLab in headless Chromium, as a student runs it.

Collected only where Chromium is (`/usr/bin/chromium`, or $LABKIT_CHROMIUM): Debian
and Ubuntu's `chromium` package, never a browser downloaded by `playwright
install`. `make test` runs it when Chromium is there; `make browser-test` alone.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import alive, descendants_of, wait_gone

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path(os.environ.get("LABKIT_CHROMIUM", "/usr/bin/chromium"))
SHOTS = ROOT / "_build" / "browser"

if not CHROMIUM.exists():
    collect_ignore_glob = ["test_*.py"]

# JupyterLab's settings for this run only: nothing saved behind our back (so
# nothing is written, not even into the copy), no news or update requests.
SETTINGS = {
    "@jupyterlab/docmanager-extension/plugin": {"autosave": False},
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false",
                                                    "checkForUpdates": False},
}


# The order pytest-xdist hands the files out in (`--dist loadfile
# --no-loadscope-reorder`, two workers): the two longest first, one to each worker;
# the worker that finishes first takes the third, the other the fourth. Measured on
# 2 cores (s): widget chapters ~68, executed chapters ~51, RISE ~40, offline ~33.
FILE_ORDER = ("test_widget_chapters.py", "test_executed_chapters.py", "test_rise.py",
              "test_offline_pages.py")


@pytest.hookimpl(trylast=True)  # after tests/conftest.py's longest-first order
def pytest_collection_modifyitems(config, items):
    """The browser's files in FILE_ORDER, in the places they held among the
    session's items (other tests keep theirs); each file's tests keep their order."""
    here = Path(__file__).parent
    places = [i for i, item in enumerate(items) if item.path.parent == here]
    rank = {name: k for k, name in enumerate(FILE_ORDER)}
    ordered = sorted((items[i] for i in places),
                     key=lambda item: rank.get(item.path.name, len(rank)))
    for i, item in zip(places, ordered):
        items[i] = item


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Lab:
    """A JupyterLab server serving a copy of notebooks/ and images/."""

    proc: subprocess.Popen
    port: int
    token: str
    root: Path
    log: Path

    def url(self, path: str = "") -> str:
        return f"http://127.0.0.1:{self.port}/{path}"

    def api(self, path: str, method: str = "GET"):
        req = urllib.request.Request(self.url(f"api/{path}"), method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read()
        return json.loads(body) if body else None

    def shut_down_kernels(self) -> None:
        """Free the cores for the next chapter (each kernel holds 4 ranks)."""
        for k in self.api("kernels"):
            self.api(f"kernels/{k['id']}", method="DELETE")

    def trust(self, folder: Path) -> None:
        _trust(folder, self.root.parent / "data")

    def log_tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:]


def _start(tmp: Path) -> Lab:
    root = tmp / "course"  # executed/ may already be there
    for name in ("notebooks", "images"):
        shutil.copytree(ROOT / name, root / name)
    settings = tmp / "settings"
    for plugin, values in SETTINGS.items():
        f = settings / f"{plugin}.jupyterlab-settings"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps(values))
    env = dict(os.environ, JUPYTERLAB_SETTINGS_DIR=str(settings),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp / "workspaces"),
               JUPYTER_CONFIG_DIR=str(tmp / "config"),
               JUPYTER_DATA_DIR=str(tmp / "data"),
               JUPYTER_RUNTIME_DIR=str(tmp / "runtime"))
    _trust(root / "executed", tmp / "data")
    port, token = free_port(), secrets.token_hex(16)
    log = tmp / "jupyterlab.log"
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser",
           "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
           "--ServerApp.port_retries=0", f"--ServerApp.root_dir={root}",
           f"--IdentityProvider.token={token}",
           "--LabApp.expose_app_in_browser=True",  # the test reads the cells' model
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")  # JupyterLab refuses root without it
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=tmp, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    lab = Lab(proc, port, token, root, log)
    deadline = time.monotonic() + 120
    while True:
        try:
            lab.api("status")
            return lab
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                _stop(lab)
                raise RuntimeError("JupyterLab did not start:\n"
                                   + lab.log_tail()) from None
            time.sleep(0.3)


def _trust(folder: Path, data_dir: Path) -> None:
    """Sign the executed chapters with this server's key (in its data folder), as
    JupyterLab signs a notebook it ran and saved: an unsigned one is untrusted, and
    JupyterLab shows only the text of its HTML and widget outputs."""
    from nbformat import read, write
    from nbformat.sign import NotebookNotary

    data_dir.mkdir(parents=True, exist_ok=True)
    notary = NotebookNotary(data_dir=str(data_dir))
    for path in sorted(folder.glob("*.ipynb")):
        nb = read(path, as_version=4)
        notary.sign(nb)
        write(nb, path)


def _stop(lab: Lab) -> None:
    """Stop the server by its pid; its kernels (and their ranks) go with it."""
    family = descendants_of(lab.proc.pid)
    if lab.proc.poll() is None:
        lab.proc.send_signal(signal.SIGTERM)  # JupyterLab shuts its kernels down
        try:
            lab.proc.wait(30)
        except subprocess.TimeoutExpired:
            lab.proc.kill()
            lab.proc.wait(10)
    for pid in wait_gone(family, 15):
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="session")
def executed() -> Path:
    """_build/executed/: every chapter as it ran, outputs and widget state included.
    `make test` wrote them while nbval ran the chapters; a copy that is missing, or
    older than its chapter or labkit, is executed here (labkit.cli.executed)."""
    from labkit.cli import executed as copies

    chapters = sorted((ROOT / "notebooks").glob("*.ipynb"))
    folder = ROOT / "_build" / "executed"
    folder.mkdir(parents=True, exist_ok=True)
    # one test worker executes what is stale; another waits, then finds it current
    with open(folder / ".browser-test.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stale = [str(c) for c in chapters if not copies.current(c, folder)]
        if stale:
            assert copies.main(["--jobs", "2", str(folder), *stale]) == 0, (
                f"executing {len(stale)} chapters for the browser test failed")
    return folder


@pytest.fixture(scope="session")
def lab(tmp_path_factory, executed):
    """JupyterLab serving copies of notebooks/, images/ and the executed chapters
    (in executed/, beside notebooks/, so their images resolve the same way)."""
    before = sorted(p.name for p in (ROOT / "notebooks").iterdir())
    tmp = tmp_path_factory.mktemp("lab")
    shutil.copytree(executed, tmp / "course" / "executed",
                    ignore=shutil.ignore_patterns(".*"))
    server = _start(tmp)
    try:
        yield server
    finally:
        _stop(server)
    # the course itself is untouched: no checkpoints, no saved outputs
    assert sorted(p.name for p in (ROOT / "notebooks").iterdir()) == before


@pytest.fixture(scope="session")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api",
                                   reason="pip install playwright (no browser "
                                   "download: Chromium comes from the system)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=[
            "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"])
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="session")
def shots():
    SHOTS.mkdir(parents=True, exist_ok=True)
    return SHOTS
