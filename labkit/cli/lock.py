"""The lock file: every package of a tested environment at its exact version.

`python -m labkit.cli.lock write requirements.lock` pins what is installed in
the running environment; `... diff requirements.lock` says what the running
environment has that differs from the lock (the newest environment prints it, so
CI's log shows which releases came out since the lock was written).

Imports packaging and the standard library: packaging is a dev dependency, since
only `make lock`, `make newest` and the tests run this."""

from __future__ import annotations

import importlib.metadata as md
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

HEADER = """\
# Every package of the environment `make test` last passed in, at its exact
# version: `make install` installs with `-c requirements.lock`. Written by
# `make lock` (the newest releases pyproject.toml's ranges allow, then frozen);
# after refreshing it, run `make test` and commit it only if that passes.
# torch is the CPU build where pip offers one (2.13.0+cpu satisfies ==2.13.0).
"""
# not pinned: the project itself, and build tools pip brings along on its own
SKIP = {"labkit", "setuptools", "wheel"}


def installed() -> dict[str, str]:
    """Normalised name -> version of every distribution in this environment (the
    one an import finds, where sys.path holds two), a local version label
    (torch's '+cpu') dropped."""
    out = {}
    for dist in md.distributions():  # in sys.path's order: the first is imported
        name = dist.metadata["Name"]
        key = canonicalize_name(name) if name else None
        if key and key not in SKIP and key not in out:
            # (setuptools, once imported, appends its _vendor/ copies to sys.path)
            out[key] = dist.version.split("+", 1)[0]
    return out


def read(path: str | Path) -> dict[str, str]:
    """Normalised name -> pinned version of a lock file."""
    pins = {}
    for line in Path(path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            req = Requirement(line)
            (pin,) = req.specifier  # InvalidRequirement is a ValueError too
        except ValueError:
            pin = None
        if pin is None or pin.operator != "==" or req.extras or req.marker or req.url:
            raise ValueError(f"{path}: not a pin (name==version): {line!r}")
        pins[canonicalize_name(req.name)] = pin.version
    return pins


def write(path: str | Path) -> int:
    pins = installed()
    lines = [f"{name}=={pins[name]}" for name in sorted(pins)]
    Path(path).write_text(HEADER + "\n".join(lines) + "\n")
    print(f"{path}: {len(lines)} packages pinned")
    return 0


def diff(path: str | Path) -> int:
    """Print what this environment has that the lock does not; always 0 (a
    report: whether the newer releases work is for the tests to say)."""
    pins, have = read(path), installed()
    changed = [f"  {n} {pins[n]} -> {have[n]}" for n in sorted(pins)
               if n in have and have[n] != pins[n]]
    added = [f"  {n} {have[n]} (not in the lock)" for n in sorted(have)
             if n not in pins]
    if changed or added:
        print(f"newer than {path}:", *changed, *added, sep="\n")
    else:
        print(f"every package is at the version {path} pins")
    return 0


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("write", "diff"):
        print("usage: python -m labkit.cli.lock write|diff LOCKFILE", file=sys.stderr)
        return 2
    return {"write": write, "diff": diff}[argv[0]](argv[1])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
