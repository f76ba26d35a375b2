"""`make test-cpus`: which corners a CPU can run, and the margins report."""

import json

from labkit.cli import cpus


def test_a_corner_runs_only_where_the_cpu_has_its_instructions():
    assert cpus.supported("avx2", {"avx2", "fma"})
    assert not cpus.supported("avx512", {"avx2", "fma"})
    assert cpus.supported("avx512", {"avx2", "avx512f"})
    assert cpus.supported("compatible", set())  # the generic path runs anywhere
    assert set(cpus.CORNERS) == set(cpus.NEEDS)


def test_unsupported_corners_are_skipped_and_said(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cpus, "cpu_flags", lambda: {"avx2"})
    ran = []
    monkeypatch.setattr(cpus, "run_corner", lambda c, *a: ran.append(c) or 0)
    assert cpus.main(["--corners", "avx512,compatible", "--out", str(tmp_path)]) == 0
    assert ran == ["compatible"]
    assert "avx512 (MKL_CBWR=AVX512 ATEN_CPU_CAPABILITY=avx512) skipped: this CPU " \
           "has no avx512f" in capsys.readouterr().out


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
