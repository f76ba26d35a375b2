"""Other CPUs' kernels, emulated: the numerics tests and chapters run again with
MKL's and PyTorch's code paths for another CPU, and the largest measured/allowed
error of each chapter and test file is printed (`make test-cpus`).

Which BLAS and ATen kernels run depends on the CPU, and with them the rounding
of every sum. Two switches pick them on any x86 machine: MKL_CBWR (MKL's code
path: AVX2, AVX512, or COMPATIBLE, about what MKL runs on AMD processors) and
ATEN_CPU_CAPABILITY (PyTorch's own kernels: avx2, avx512 or default). A corner
the CPU lacks is skipped and said so (torch would accept avx512 and crash on its
first AVX-512 instruction).

    python -m labkit.cli.cpus [--corners avx2,avx512,compatible]
        [--tests FILE...] [--chapters NOTEBOOK...] [--out DIR] [--jobs N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CORNERS = {
    "avx2": {"MKL_CBWR": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
    "avx512": {"MKL_CBWR": "AVX512", "ATEN_CPU_CAPABILITY": "avx512"},
    "compatible": {"MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "default"},
}
NEEDS = {"avx2": "avx2", "avx512": "avx512f", "compatible": None}


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def supported(corner: str, flags: set[str]) -> bool:
    need = NEEDS[corner]
    return need is None or need in flags


def margins(path: Path) -> dict[str, tuple[float, int]]:
    """Where (chapter or test file) -> (largest error/allowed, comparisons)."""
    out: dict[str, tuple[float, int]] = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        row = json.loads(line)
        worst, n = out.get(row["where"], (0.0, 0))
        out[row["where"]] = (max(worst, row["margin"]), n + 1)
    return out


def run_corner(corner: str, tests: list[str], chapters: list[str], out: Path,
               cell_timeout: int, jobs: int = 1) -> int:
    log = out / f"{corner}.jsonl"
    log.unlink(missing_ok=True)
    env = {**os.environ, **CORNERS[corner], "LABKIT_MARGINS": str(log.resolve())}
    # one pytest for the corner: the numerics tests and the chapters' cells (this
    # module, as a plugin, marks them numerics too) share its workers, a file each
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "-p", "labkit.cli.cpus", "-m", "numerics"]
    if jobs > 1:
        cmd += ["-n", str(jobs), "--dist", "loadfile"]
    if chapters:
        cmd += ["--nbval-lax", "--nbval-current-env",
                f"--nbval-cell-timeout={cell_timeout}"]
    return subprocess.run([*cmd, *tests, *chapters], env=env).returncode


@pytest.hookimpl(tryfirst=True)  # before -m numerics deselects
def pytest_collection_modifyitems(config, items):
    """As a pytest plugin (`-p labkit.cli.cpus`): a chapter's cells (nbval's items)
    are numerics tests, since that is why a corner runs the chapter."""
    for item in items:
        if type(item).__name__ == "IPyNbCell":
            item.add_marker(pytest.mark.numerics)


def report(out: Path, corners: list[str]) -> str:
    rows = {c: margins(out / f"{c}.jsonl") for c in corners}
    where = sorted({w for r in rows.values() for w in r})
    if not where:
        return "no comparisons were recorded"
    width = max(len(w) for w in where) + 2
    lines = ["largest measured/allowed error (1 = at the limit), comparisons made:",
             f"{'where':<{width}}" + "".join(f"{c:>20}" for c in corners)]
    for w in where:
        cells = []
        for c in corners:
            m = rows[c].get(w)
            cells.append(f"{m[0]:>13.2f} ({m[1]:>3})" if m else f"{'-':>20}")
        lines.append(f"{w:<{width}}" + "".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m labkit.cli.cpus")
    p.add_argument("--corners", default="avx2,avx512,compatible")
    p.add_argument("--tests", nargs="*", default=["tests"])
    p.add_argument("--chapters", nargs="*", default=[])
    p.add_argument("--out", default="_build/margins")
    p.add_argument("--cell-timeout", type=int, default=120)
    p.add_argument("--jobs", type=int, default=1,
                   help="pytest-xdist workers (a test file or chapter each at a time)")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    flags, ran, status = cpu_flags(), [], 0
    for corner in [c.strip() for c in args.corners.split(",") if c.strip()]:
        if corner not in CORNERS:
            p.error(f"unknown corner {corner!r}: one of {', '.join(CORNERS)}")
        settings = " ".join(f"{k}={v}" for k, v in CORNERS[corner].items())
        if not supported(corner, flags):
            print(f"cpus: {corner} ({settings}) skipped: this CPU has no "
                  f"{NEEDS[corner]}", flush=True)
            continue
        print(f"cpus: {corner}: {settings}", flush=True)
        code = run_corner(corner, args.tests, args.chapters, out, args.cell_timeout,
                          args.jobs)
        print(f"cpus: {corner}: {'passed' if code == 0 else 'FAILED'}", flush=True)
        status |= code
        ran.append(corner)
    print(report(out, ran))
    return 1 if status else 0


if __name__ == "__main__":
    sys.exit(main())
