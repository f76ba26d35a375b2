"""Going to a cluster: a notebook's workers exported to a module, run under torchrun
(two "nodes" on loopback), each rank's result written, merged in rank order and
charted; and what needs GPUs, skipped cleanly without them."""

import contextlib
import errno
import os
import random
import signal
import socket
import subprocess
import sys
import time

import nbformat
import pytest
import torch

from labkit.cli.export import export_notebook
from labkit.cli.results import summary
from labkit.runtime.launch import parse_args
from labkit.runtime.results_io import ResultsError, load_results, save_rank_result

PY = sys.executable
N_NODES, PER_NODE = 2, 2
N = N_NODES * PER_NODE
M = 1 << 16  # elements all-reduced: 256 KiB of float32

def notebook(tmp_path, cells):
    """A notebook of code cells: (source, tags)."""
    nb = nbformat.v4.new_notebook()
    for src, tags in cells:
        cell = nbformat.v4.new_code_cell(src)
        if tags:
            cell.metadata["tags"] = tags
        nb.cells.append(cell)
    path = tmp_path / "99_test.ipynb"
    nbformat.write(nb, path)
    return path


CHAPTER = [
    ("import torch\nimport torch.distributed as dist\n\nimport labkit\n"
     "from labkit import ledger", None),
    (f"M, N = {M}, {N}        # elements, ranks\nBYTES = 4 * M\n"
     "SHAPE = (M // N, N)\nlabkit.Cluster  # a bare expression: skipped", None),
    ("def ring_all_reduce(rank, world_size, m=M):\n"
     "    with ledger.traffic() as t:\n"
     "        x = torch.full((m,), float(rank + 1))\n"
     "        dist.all_reduce(x)\n"
     "    return {'sum': x[0].item(), 'rank': rank, 'traffic': t}\n\n\n"
     "def uses_result(rank, world_size):\n"
     "    return out[rank]", None),
    ("cluster = labkit.Cluster(4)\nout = cluster.run(ring_all_reduce)\n"
     "print(out)", None),
    ("def my_answer(x):\n    raise NotImplementedError('exercise: ...')",
     ["exercise"]),
    ("def my_answer(x):\n    return x", ["solution"]),
    ("%%ranks\nprint(rank)", None),
    ("LATE = sum(range(M))  # upper case: a constant, even with a call\n"
     "later = len(SHAPE)   # lower case with a call: skipped", None),
]


def test_export_keeps_imports_constants_and_functions_only(tmp_path):
    ex = export_notebook(notebook(tmp_path, CHAPTER))
    assert ex.functions == ["ring_all_reduce", "uses_result"]
    assert "labkit.Cluster(4)" not in ex.source and "print(out)" not in ex.source
    assert "my_answer" not in ex.source and "%%ranks" not in ex.source
    assert "later" not in ex.source and "LATE = sum(range(M))" in ex.source
    assert ex.unresolved == {"uses_result": ["out"]}  # computed by a skipped cell
    why = dict(ex.skipped)
    assert why[4] == "tagged exercise" and why[5] == "tagged solution"
    assert why[6].startswith("not plain Python")
    ns = {}
    exec(compile(ex.source, "exported", "exec"), ns)  # imports, starts nothing
    assert (ns["M"], ns["N"], ns["BYTES"], ns["SHAPE"]) == (M, N, 4 * M, (M // N, N))
    assert ns["LATE"] == M * (M - 1) // 2


def test_export_command_writes_the_module(tmp_path):
    out = tmp_path / "build" / "99_test.py"
    run = subprocess.run([PY, "-m", "labkit", "export",
                          str(notebook(tmp_path, CHAPTER)), "--out", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "2 functions (ring_all_reduce, uses_result)" in run.stdout
    assert "uses_result uses out" in run.stdout
    assert out.read_text() == export_notebook(tmp_path / "99_test.ipynb").source


def test_arguments_are_literals_else_strings():
    assert parse_args(["4", "FSDP", "'DDP'", "(2, 3)", "1e-3", "None"]) == (
        4, "FSDP", "DDP", (2, 3), 1e-3, None)


def test_results_merge_in_rank_order_and_refuse_gaps_and_stale_files(tmp_path):
    for r in (2, 0, 1):  # written in any order
        save_rank_result(tmp_path, r, 3, {"rank": r, "x": torch.arange(3) * r},
                         seconds=0.5, target="w.py:f", args=("a",), run_id="run1")
    res = load_results(tmp_path)
    assert [v["rank"] for v in res.values] == [0, 1, 2] and len(res) == 3
    assert torch.equal(res[2]["x"], torch.tensor([0, 2, 4]))
    assert (res.target, res.args, res.run_id) == ("w.py:f", ("a",), "run1")
    assert "w.py:f('a') on 3 ranks" in summary(tmp_path)

    (tmp_path / "rank1.pt").unlink()
    with pytest.raises(ResultsError, match=r"no result for rank\(s\) \[1\]"):
        load_results(tmp_path)
    save_rank_result(tmp_path, 1, 3, {}, run_id="run0")  # an older run's file
    with pytest.raises(ResultsError, match=r"rank\(s\) \[1\] come from another run"):
        load_results(tmp_path)
    save_rank_result(tmp_path, 1, 3, error=ValueError("shapes (3,) and (4,)"),
                     run_id="run1")
    with pytest.raises(ResultsError, match=r"rank 1 failed:(.|\n)*shapes"):
        load_results(tmp_path)
    assert "rank 1 (" in summary(tmp_path) and "FAILED: ValueError" in summary(
        tmp_path)
    (tmp_path / "rank2.pt").unlink()  # torchrun stopped it: the failure comes first
    with pytest.raises(ResultsError, match=r"rank 1 failed:(.|\n)*shapes"):
        load_results(tmp_path)


def _free_port() -> int | None:
    """A port that binds now, below the kernel's ephemeral range (so that no
    outgoing connection takes it before torchrun's rendezvous listens on it)."""
    rng = random.Random()
    for _ in range(50):
        port = rng.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    return None


def _two_nodes(tmp_path, target, results, port):
    """Two torchrun agents, each a "node" of PER_NODE processes, meeting through
    c10d rendezvous on loopback. Returns (returncode, output) per agent."""
    def cmd(node):  # node 0 hosts the rendezvous store: no race for the port
        return [PY, "-m", "torch.distributed.run", "--nnodes", str(N_NODES),
                "--nproc-per-node", str(PER_NODE), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"labkit-{port}",
                "--rdzv-conf", f"is_host={int(node == 0)},join_timeout=100",
                "--max-restarts", "0", "-m", "labkit.launch", target,
                "--results", str(results)]

    agents = [subprocess.Popen(cmd(node), cwd=tmp_path, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)  # a group: its ranks too
              for node in range(N_NODES)]
    out = []
    deadline = time.monotonic() + 150
    try:
        for a in agents:
            text, _ = a.communicate(timeout=max(1, deadline - time.monotonic()))
            out.append((a.returncode, text))
    except subprocess.TimeoutExpired:
        texts = []
        for a in agents:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(a.pid, signal.SIGKILL)
            texts.append(a.communicate()[0])
        pytest.fail("two torchrun agents still running after 150 s:\n"
                    + "\n---\n".join(texts))
    return out


@pytest.mark.slow
def test_two_nodes_under_torchrun_write_results_merged_in_rank_order(tmp_path):
    port = _free_port()
    if port is None:
        pytest.skip("cannot bind a TCP socket on 127.0.0.1: torchrun's c10d "
                    "rendezvous needs one")
    worker = tmp_path / "build" / "99_test.py"
    worker.parent.mkdir()
    worker.write_text(export_notebook(notebook(tmp_path, CHAPTER)).source)
    results = tmp_path / "runs" / "ring"
    agents = _two_nodes(tmp_path, f"{worker}:ring_all_reduce", results, port)
    text = "\n".join(t for _, t in agents)
    if any(rc for rc, _ in agents) and any(
            s in text for s in ("EADDRINUSE", "Address already in use",
                                f"[Errno {errno.EADDRNOTAVAIL}]")):
        pytest.skip("torchrun's c10d rendezvous could not bind 127.0.0.1:"
                    f"{port} on this machine")
    assert [rc for rc, _ in agents] == [0, 0], text

    res = load_results(results)
    assert res.ranks == list(range(N)) and res.world_size == N
    assert [v["rank"] for v in res.values] == list(range(N))  # rank order
    assert [v["sum"] for v in res.values] == [N * (N + 1) / 2] * N
    assert sorted(rec for rec in res.hosts.values()) == [socket.gethostname()] * N
    S = 4 * M
    for v in res.values:
        (rec,) = v["traffic"].records
        assert (rec.op, rec.group_size, rec.payload_bytes) == ("all_reduce", N, S)
        ring = 2 * (N - 1) / N * S  # the ring formula: 384 KiB per rank
        assert rec.bus_bytes == ring
        assert abs(rec.wire_bytes - ring) <= 0.01 * ring, rec.wire_bytes
    # rank 0 printed every rank's value, in rank order
    lines = [ln for _, t in agents for ln in t.splitlines() if ln.startswith("[rank")]
    assert [ln.split("]")[0] for ln in lines] == [f"[rank {r}" for r in range(N)]

    charts = tmp_path / "charts"
    cmd = subprocess.run([PY, "-m", "labkit", "results", str(results), "--chart",
                          str(charts)], capture_output=True, text=True, timeout=120)
    assert cmd.returncode == 0, cmd.stdout + cmd.stderr
    assert f"ring_all_reduce() on {N} ranks, 1 host(s)" in cmd.stdout
    assert [ln.split(" (")[0] for ln in cmd.stdout.splitlines()[1:N + 1]] == [
        f"  rank {r}" for r in range(N)]
    assert (charts / "traffic.png").stat().st_size > 0


def test_results_command_reports_missing_ranks(tmp_path):
    save_rank_result(tmp_path, 0, 2, 1.0, run_id="r")
    cmd = subprocess.run([PY, "-m", "labkit", "results", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert cmd.returncode == 2 and "no result for rank(s) [1]" in cmd.stdout
