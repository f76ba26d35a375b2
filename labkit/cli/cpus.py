"""Other CPUs' kernels, emulated (`make test-cpus`): the numerics tests and chapters
run again under MKL's and ATen's code paths for another CPU, and the largest
measured/allowed error of each test file and chapter is printed.

    python -m labkit.cli.cpus [--corners avx2,avx512,compatible] [--even-covered]
        [--tests FILE...] [--chapters NOTEBOOK...] [--out DIR] [--jobs N]

Imports the standard library, pytest (it is a pytest plugin too), numpy and torch.
A corner is skipped, and said so, where the CPU lacks it (torch would accept avx512
and crash on its first AVX-512 instruction) or nothing in it is new on this CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Two switches pick the kernels at startup on any x86 machine: MKL_CBWR is MKL's
# code path (COMPATIBLE: its generic one), ATEN_CPU_CAPABILITY PyTorch's own.
CORNERS = {
    "avx2": {"MKL_CBWR": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
    "avx512": {"MKL_CBWR": "AVX512", "ATEN_CPU_CAPABILITY": "avx512"},
    "compatible": {"MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "default"},
}
NEEDS = {"avx2": "AVX2", "avx512": "AVX512", "compatible": None}
WIDTHS = ["DEFAULT", "AVX2", "AVX512"]  # ATen's x86 capabilities, narrow to wide


def cpu_capability() -> str:
    """The widest vector instructions ATen's kernels use on this CPU, as torch
    tells it (torch.backends.cpu.get_cpu_capability()), asked of a fresh
    process without ATEN_CPU_CAPABILITY (which lowers it): "AVX512", "AVX2",
    "DEFAULT", or another architecture's name."""
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    out = subprocess.run(
        [sys.executable, "-c", "import torch; "
         "print(torch.backends.cpu.get_cpu_capability())"],
        env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def supported(corner: str, capability: str) -> bool:
    """Whether this CPU (ATen's `capability` on it) can run `corner`."""
    need = NEEDS[corner]
    return need is None or (capability in WIDTHS
                            and WIDTHS.index(capability) >= WIDTHS.index(need))


def kernels() -> dict[str, str]:
    """Which kernels this process's torch runs: ATen's (its CPU capability) and
    MKL's (a hash of what its BLAS and LAPACK return on fixed inputs: float32
    and float64 matrix products of the course's shapes, plain, transposed,
    batched and matrix-vector, and a solve). The inputs come from numpy, so no
    ATen kernel touches them first."""
    import hashlib

    import numpy as np
    import torch

    rng, digest = np.random.default_rng(0), hashlib.sha256()
    for dtype in (torch.float32, torch.float64):
        def rand(*shape, dtype=dtype):
            return torch.from_numpy(rng.standard_normal(shape)).to(dtype)

        for m, k, n in [(7, 13, 5), (64, 64, 64), (128, 300, 77), (513, 257, 129),
                        (32, 768, 3072), (1, 1024, 1)]:
            a, b = rand(m, k), rand(k, n)
            outs = [a @ b, a.T.contiguous().T @ b, a @ b.T.contiguous().T,
                    torch.bmm(rand(3, m, k), rand(3, k, n)), a @ b[:, 0]]
            for out in outs:
                digest.update(out.numpy().tobytes())
        digest.update(torch.linalg.solve(rand(50, 50), rand(50, 3)).numpy().tobytes())
    return {"aten": torch.backends.cpu.get_cpu_capability(),
            "blas": digest.hexdigest()[:16]}


def kernels_under(env: dict[str, str]) -> dict[str, str]:
    """kernels() in a fresh process with `env` (the switches act at startup)."""
    code = ("import json; from labkit.cli.cpus import kernels; "
            "print(json.dumps(kernels()))")
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[-1])


def covered(new: dict[str, str], seen: dict[str, dict[str, str]]) -> str | None:
    """Why a corner need not run, or None: each of its kernels, ATen's and MKL's,
    is one that a run in `seen` (name -> kernels) already ran, bit for bit."""
    aten = [name for name, k in seen.items() if k["aten"] == new["aten"]]
    blas = [name for name, k in seen.items() if k["blas"] == new["blas"]]
    if not (aten and blas):
        return None
    return (f"ATen's {new['aten']} kernels are {aten[0]}'s and MKL's results "
            f"(probe {new['blas']}) {blas[0]}'s, bit for bit")


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
    """Run each corner this CPU supports and that is new on it (every supported
    one with --even-covered), then print the margins report; 1 if a corner's
    run failed, else 0."""
    p = argparse.ArgumentParser(prog="python -m labkit.cli.cpus")
    p.add_argument("--corners", default="avx2,avx512,compatible")
    p.add_argument("--tests", nargs="*", default=["tests"])
    p.add_argument("--chapters", nargs="*", default=[])
    p.add_argument("--out", default="_build/margins")
    p.add_argument("--cell-timeout", type=int, default=120)
    p.add_argument("--even-covered", action="store_true",
                   help="run a corner whose kernels make test or an earlier "
                        "corner already ran")
    p.add_argument("--jobs", type=int, default=1,
                   help="pytest-xdist workers (a test file or chapter each at a time)")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    capability, ran, status = cpu_capability(), [], 0
    # make test ran under this shell's settings: the CPU's own kernels
    seen = {} if args.even_covered else {"make test": kernels_under(dict(os.environ))}
    for corner in [c.strip() for c in args.corners.split(",") if c.strip()]:
        if corner not in CORNERS:
            p.error(f"unknown corner {corner!r}: one of {', '.join(CORNERS)}")
        settings = " ".join(f"{k}={v}" for k, v in CORNERS[corner].items())
        if not supported(corner, capability):
            print(f"cpus: {corner} ({settings}) skipped: this CPU has no "
                  f"{NEEDS[corner]}", flush=True)
            continue
        if not args.even_covered:
            mine = kernels_under({**os.environ, **CORNERS[corner]})
            if why := covered(mine, seen):
                print(f"cpus: {corner} ({settings}) skipped: nothing in it is new "
                      f"on this CPU: {why} (--even-covered runs it)", flush=True)
                continue
            seen[f"the {corner} corner"] = mine
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
