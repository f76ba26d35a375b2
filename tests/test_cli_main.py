"""python -m labkit: the command line."""

import json
import subprocess
import sys

import pytest


def _labkit(*args, **kw):
    return subprocess.run([sys.executable, "-m", "labkit", *args], capture_output=True,
                          text=True, timeout=300, **kw)


def test_doctor_reports_and_runs_a_smoke_test():
    out = _labkit("doctor")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "torch       2.13.0" in out.stdout
    assert "every rank holds 3.0" in out.stdout


@pytest.mark.parametrize("where", ["win32", "no fork"])
def test_doctor_on_a_platform_without_fork_says_to_use_wsl(where, monkeypatch,
                                                            capsys):
    from labkit.cli import doctor

    if where == "win32":
        monkeypatch.setattr(sys, "platform", "win32")
    else:
        monkeypatch.delattr("os.fork")
    monkeypatch.setattr("labkit.Cluster", None)  # what a run there would reach
    assert doctor.doctor() == 1
    out = capsys.readouterr().out
    assert "cannot run ranks here" in out and "has no fork" in out, out
    assert "wsl --install" in out and "make lab" in out, out
    assert "smoke test" not in out


def test_clean_notebooks_command(tmp_path):
    p = tmp_path / "a.ipynb"
    cell = {"cell_type": "code", "source": "", "metadata": {}, "execution_count": 1,
            "outputs": []}
    p.write_text(json.dumps({"cells": [cell], "metadata": {}, "nbformat": 4,
                             "nbformat_minor": 4}))
    out = _labkit("clean-notebooks", str(p))
    assert out.returncode == 0 and "cleaned" in out.stdout
    assert json.loads(p.read_text())["cells"][0]["execution_count"] is None


def test_unknown_command_is_an_error():
    out = _labkit("frobnicate")
    assert out.returncode == 2 and "invalid choice" in out.stderr


@pytest.mark.slow
def test_launch_runs_a_worker_function_under_torchrun(tmp_path):
    work = tmp_path / "work.py"
    work.write_text(
        "import torch\nimport torch.distributed as dist\n\n\n"
        "def work(rank, world_size):\n"
        "    x = torch.arange(4.0) + rank\n"
        "    dist.all_reduce(x)\n"
        "    return x.tolist()\n")
    out = _labkit("launch", f"{work}:work", "--nproc", "2", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("[rank")]
    assert lines == ["[rank 0] [1.0, 3.0, 5.0, 7.0]", "[rank 1] [1.0, 3.0, 5.0, 7.0]"]
    bad = _labkit("launch", f"{work}:nothing")
    assert bad.returncode == 2 and "no function 'nothing'" in bad.stderr


def test_bench_model_parallel_runs_both_benches_on_two_ranks(monkeypatch, capsys):
    # the dispatch only (the benches themselves are timings, run by `make bench`)
    from labkit.cli import bench_pipeline, bench_tensor_parallel, main
    from labkit.cli.bench import Row

    seen = []
    monkeypatch.setattr(bench_tensor_parallel, "bench_tensor_parallel",
                        lambda n: seen.append(("tp", n)) or [Row("a / b", 1.3, 1.2,
                                                                 unit="x")])
    monkeypatch.setattr(bench_pipeline, "bench_pipeline",
                        lambda n: seen.append(("pp", n)) or [Row("c / d", 0.9, 1.2,
                                                                 unit="x")])
    assert main.main(["bench", "model-parallel"]) == 1  # one figure short
    assert seen == [("tp", 2), ("pp", 2)]
    out = capsys.readouterr().out
    assert "a / b" in out and "short" in out and "c / d" in out
