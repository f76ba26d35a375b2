"""`make newest`: an environment with the newest releases pyproject.toml allows,
kept outside the clone (a fresh clone, as CI makes, finds it again).

    python -m labkit.cli.newest VENV --torch SPEC [--refresh-hours H]

Standard library only: it runs with the system's Python. The environment holds
labkit's dependencies, not labkit (`make test-newest` imports labkit from the
clone); it is built anew when pyproject.toml, Python or torch change (`key`),
else upgraded in place at most every H hours (default 12; 0: every time).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARK = ".labkit-newest"


def requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """labkit's dependencies, the dev extra's included (not labkit itself)."""
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    return [*project["dependencies"], *project["optional-dependencies"]["dev"]]


def key(torch: str, pyproject: Path = ROOT / "pyproject.toml") -> str:
    """What an environment is made for, as a hash (kept in VENV/.labkit-newest):
    pyproject.toml, this Python and the torch requirement."""
    h = hashlib.sha256(pyproject.read_bytes())
    h.update(f"\0{sys.version}\0{torch}".encode())
    return h.hexdigest()


def _pip(venv: Path, *args: str) -> None:
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install",
                    "--quiet", "--disable-pip-version-check", *args], check=True)


def _upgrade(venv: Path, torch: str) -> None:
    """Everything to its newest allowed release, torch kept at `torch` (pyproject
    allows a range; the newest torch on PyPI is a CUDA build of several GB)."""
    reqs = [r for r in requirements() if _name(r) != "torch"]
    _pip(venv, "--upgrade", "--upgrade-strategy", "eager", torch, *reqs)


def _name(requirement: str) -> str:
    for i, ch in enumerate(requirement):
        if not (ch.isalnum() or ch in "-_."):
            return requirement[:i].lower()
    return requirement.lower()


def _build(venv: Path, torch: str, stamp: str) -> None:
    """A new environment in `venv`'s place (a venv cannot be moved once made); the
    old one waits beside it until the new one is complete, and comes back if the
    build fails. The mark is written first, so a build killed halfway is known as
    ours and rebuilt next time."""
    for stale in venv.parent.glob(f".{venv.name}.*.old"):  # killed builds' leftovers
        if (stale / MARK).exists():
            shutil.rmtree(stale, ignore_errors=True)
    old = venv.with_name(f".{venv.name}.{os.getpid()}.old")
    if venv.exists():
        venv.rename(old)
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        (venv / MARK).write_text("building")
        _pip(venv, "--upgrade", "pip")
        _pip(venv, torch)  # first and pinned: a plain `torch` can pull a CUDA build
        _upgrade(venv, torch)
        (venv / MARK).write_text(stamp)
    except BaseException:
        shutil.rmtree(venv, ignore_errors=True)
        if old.exists():
            old.rename(venv)
        raise
    shutil.rmtree(old, ignore_errors=True)


def ensure(venv: Path, torch: str, refresh_hours: float) -> str:
    """Make or refresh the environment; return what was done."""
    stamp, mark = key(torch), venv / MARK
    if venv.exists() and not mark.exists():
        raise SystemExit(f"{venv} exists but `make newest` did not make it (no {MARK} "
                         "in it): remove it yourself, or set NEWEST= to another folder")
    if not mark.exists() or mark.read_text() != stamp:
        why = ("none yet" if not mark.exists()
               else "pyproject.toml, Python or torch changed, or a build was cut short")
        print(f"newest: building {venv} ({why})", flush=True)
        venv.parent.mkdir(parents=True, exist_ok=True)
        _build(venv, torch, stamp)
        return "built"
    age = (time.time() - mark.stat().st_mtime) / 3600
    if age < refresh_hours:
        print(f"newest: {venv} was refreshed {age:.1f} h ago (under {refresh_hours:g} "
              "h): used as it is", flush=True)
        return "cached"
    print(f"newest: upgrading {venv} in place (last refreshed {age:.1f} h ago)",
          flush=True)
    _upgrade(venv, torch)
    mark.touch()
    return "upgraded"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m labkit.cli.newest",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("venv", type=Path)
    ap.add_argument("--torch", required=True, help="the torch requirement, pinned")
    ap.add_argument("--refresh-hours", type=float, default=12.0)
    args = ap.parse_args(argv)
    ensure(args.venv.expanduser().absolute(), args.torch, args.refresh_hours)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
