"""`make test-cpus`: which corners a CPU can run, and the margins report."""

import json
import os
import subprocess
import sys

import pytest

from labkit.cli import cpus


def test_a_corner_runs_only_where_the_cpu_has_its_instructions():
    assert cpus.supported("avx2", "AVX2")
    assert not cpus.supported("avx512", "AVX2")
    assert cpus.supported("avx512", "AVX512") and cpus.supported("avx2", "AVX512")
    assert not cpus.supported("avx2", "DEFAULT")
    assert not cpus.supported("avx2", "ZVECTOR")  # another architecture's
    assert cpus.supported("compatible", "DEFAULT")  # the generic path runs anywhere
    assert set(cpus.CORNERS) == set(cpus.NEEDS)


@pytest.mark.ranks  # it starts python processes
def test_the_capability_is_the_cpus_not_the_settings(monkeypatch):
    # a shell that lowers ATen's kernels does not make the CPU narrower
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    lowered = subprocess.run(
        [sys.executable, "-c", "import torch; "
         "print(torch.backends.cpu.get_cpu_capability())"],
        capture_output=True, text=True, check=True).stdout.strip()
    assert lowered == "DEFAULT", lowered
    got = cpus.cpu_capability()
    if got == "DEFAULT":
        pytest.skip("this CPU has no AVX2: nothing wider to find")
    assert got in cpus.WIDTHS, got


def test_unsupported_corners_are_skipped_and_said(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cpus, "cpu_capability", lambda: "AVX2")
    ran = []
    monkeypatch.setattr(cpus, "run_corner", lambda c, *a: ran.append(c) or 0)
    assert cpus.main(["--corners", "avx512,compatible", "--out", str(tmp_path),
                      "--even-covered"]) == 0
    assert ran == ["compatible"]
    assert "avx512 (MKL_CBWR=AVX512 ATEN_CPU_CAPABILITY=avx512) skipped: this CPU " \
           "has no AVX512" in capsys.readouterr().out


def test_the_report_gives_the_largest_margin_per_place_and_corner(tmp_path):
    rows = {"avx2": [("notebooks/05.ipynb", 0.25), ("notebooks/05.ipynb", 0.5),
                     ("tests/test_x.py", 0.1)],
            "compatible": [("notebooks/05.ipynb", 0.3)]}
    for corner, items in rows.items():
        (tmp_path / f"{corner}.jsonl").write_text("".join(
            json.dumps({"where": w, "what": "x", "error": m, "allowed": 1.0,
                        "margin": m}) + "\n" for w, m in items))
    text = cpus.report(tmp_path, ["avx2", "compatible"])
    lines = text.splitlines()
    assert lines[2].split() == ["notebooks/05.ipynb", "0.50", "(", "2)", "0.30",
                                "(", "1)"]
    assert lines[3].split() == ["tests/test_x.py", "0.10", "(", "1)", "-"]


def test_a_corner_whose_kernels_already_ran_is_skipped_and_said(tmp_path, monkeypatch,
                                                                capsys):
    """On an AVX-512 machine whose MKL gives its AVX2 and AVX512 paths the same
    results (AMD's): avx2 runs, avx512 would repeat make test's ATen kernels and
    the avx2 corner's MKL ones; compatible is new in both."""
    monkeypatch.setattr(cpus, "cpu_capability", lambda: "AVX512")
    under = {"AVX2": {"aten": "AVX2", "blas": "cnr"},
             "AVX512": {"aten": "AVX512", "blas": "cnr"},
             "COMPATIBLE": {"aten": "DEFAULT", "blas": "compatible"}}
    monkeypatch.setattr(cpus, "kernels_under", lambda env: under.get(
        env.get("MKL_CBWR"), {"aten": "AVX512", "blas": "auto"}))
    ran = []
    monkeypatch.setattr(cpus, "run_corner", lambda c, *a: ran.append(c) or 0)
    assert cpus.main(["--corners", "avx2,avx512,compatible",
                      "--out", str(tmp_path)]) == 0
    assert ran == ["avx2", "compatible"]
    assert ("avx512 (MKL_CBWR=AVX512 ATEN_CPU_CAPABILITY=avx512) skipped: nothing in "
            "it is new on this CPU: ATen's AVX512 kernels are make test's and MKL's "
            "results (probe cnr) the avx2 corner's, bit for bit"
            ) in capsys.readouterr().out
    ran.clear()  # asked to, it runs every corner the CPU has
    assert cpus.main(["--corners", "avx2,avx512", "--out", str(tmp_path),
                      "--even-covered"]) == 0
    assert ran == ["avx2", "avx512"]


@pytest.mark.ranks  # it starts python processes (kernels_under)
def test_the_probe_tells_avx2_kernels_from_this_cpus_own():
    """kernels() really sees the switches: the same settings give the same
    fingerprint twice, and avx2 gives another ATen capability and (MKL's CNR
    path) other results than the CPU's own settings."""
    if not cpus.supported("avx2", cpus.cpu_capability()):
        pytest.skip("this CPU has no avx2")
    env = {k: v for k, v in os.environ.items()
           if k not in ("MKL_CBWR", "ATEN_CPU_CAPABILITY")}
    own = cpus.kernels_under(env)
    assert cpus.kernels_under(env) == own
    avx2 = cpus.kernels_under({**env, **cpus.CORNERS["avx2"]})
    assert avx2["aten"] == "AVX2", avx2
    assert avx2["blas"] != own["blas"] or own["aten"] == "AVX2", (own, avx2)
