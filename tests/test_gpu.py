"""What runs on GPUs: NCCL with one GPU per rank, the memory ledger on CUDA beside
the allocator's own peak, and the traffic ledger on NCCL. Every test here skips
cleanly on a machine without CUDA; with one GPU they run on one rank (NCCL puts
one rank on each GPU), with two or more on two."""

import inspect
import subprocess
import sys

import pytest
import torch

from labkit.runtime.backend import gpu_count
from labkit.runtime.results_io import load_results

N_GPU = min(2, gpu_count())
requires_cuda = pytest.mark.skipif(
    N_GPU < 1, reason=f"needs a CUDA device, {gpu_count()} visible")
pytestmark = requires_cuda


def _cuda_step(rank, world_size):
    import torch.distributed as dist

    from labkit import ledger

    model = torch.nn.Linear(256, 256).cuda()
    with ledger.memory(model) as m:
        model(torch.ones(64, 256, device="cuda")).sum().backward()
    x = torch.ones(4, device="cuda") * (rank + 1)
    with ledger.traffic() as t:
        dist.all_reduce(x)
    y = torch.ones(4) * (rank + 1)  # a CPU tensor beside it still works (gloo)
    dist.all_reduce(y)
    return {"device": torch.cuda.current_device(), "backend": dist.get_backend(),
            "sum": x.tolist(), "cpu_sum": y.tolist(), "traffic": t,
            "cuda_peak": m.cuda_peak, "peak": m.peak_total}


def _check_step(out, n):
    total = float(n * (n + 1) // 2)  # ranks add 1, 2, ..., n
    assert [o["device"] for o in out] == list(range(n))
    assert all("nccl" in o["backend"] for o in out)
    assert all(o["sum"] == [total] * 4 and o["cpu_sum"] == [total] * 4 for o in out)
    for o in out:
        # the allocator's peak is at least what the ledger counted
        assert o["cuda_peak"] is not None and o["cuda_peak"] >= o["peak"] > 0
        (rec,) = o["traffic"].records
        assert rec.op == "all_reduce" and rec.payload_bytes == 16
        assert rec.bus_bytes == pytest.approx(2 * (n - 1) / n * 16)
        assert rec.wire_bytes is None  # CUDA tensors never touch gloo's sockets


def test_cluster_on_gpus_uses_nccl_one_gpu_per_rank_and_reports_cuda_peak():
    import labkit

    with labkit.Cluster(N_GPU, timeout=60) as c:
        assert c.backend == "nccl"
        _check_step(c.run(_cuda_step).values, N_GPU)


def test_launch_on_gpus_uses_nccl_one_gpu_per_local_rank(tmp_path):
    work = tmp_path / "gpu_work.py"
    work.write_text("import torch\nimport pytest\n\n\n"
                    + inspect.getsource(_cuda_step))
    cmd = subprocess.run([sys.executable, "-m", "labkit", "launch",
                          f"{work}:_cuda_step", "--nproc", str(N_GPU),
                          "--results", str(tmp_path / "runs")],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert cmd.returncode == 0, cmd.stdout + cmd.stderr
    _check_step(load_results(tmp_path / "runs").values, N_GPU)


def _bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("precision", ["fp32", "bf16-master"])
def test_memory_ledger_on_cuda_counts_adam_to_the_byte(precision):
    """The ZeRO paper's 4+4+8 (fp32) and 2+2+12 (mixed precision) bytes per
    parameter, counted on a GPU; the CUDA allocator's peak is at least the
    ledger's (it adds cuBLAS's workspace and rounds blocks up)."""
    from labkit import ledger
    from labkit.parallel.precision import MasterWeights

    torch.manual_seed(0)
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 512)).to("cuda", dtype)
    params = list(model.parameters())
    psi = sum(p.numel() for p in params)
    opt = (torch.optim.Adam(params, lr=1e-3) if precision == "fp32"
           else MasterWeights(params, torch.optim.Adam, lr=1e-3))
    with ledger.memory(model, opt) as m:
        model(torch.randn(64, 512, device="cuda", dtype=dtype)).float().sum().backward()
        opt.step()
    counters = _bytes(s["step"] for s in opt.state.values())  # Adam's step counts
    p, k = (4, 8) if precision == "fp32" else (2, 12)
    assert m.current["Parameter"] == m.current["Gradient"] == p * psi
    assert m.current["Optstate"] - counters == k * psi
    assert m.current["Temp"] == m.current["Activation"] == 0
    assert m.peak_total > (2 * p + k) * psi
    # what the allocator grew by in the block, against what the ledger grew by (the
    # parameters, and the fp32 master copy, were there before it): equal, plus
    # cuBLAS's workspaces where the block made them (measured 68 MB on an H100,
    # torch 2.11), which are no tensor's
    # Adam's step counters are CPU tensors here: in the ledger, not the allocator
    assert all(not s["step"].is_cuda for s in opt.state.values())
    before = p * psi + (4 * psi if precision == "bf16-master" else 0)
    grew, counted = m.cuda_peak - m.cuda_start, m.peak_total - before - counters
    assert counted <= grew <= counted + 2**27, (grew, counted)


def _cpu_rank(rank, world_size):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    # FSDP2 with no mesh makes its own on the default device: the CPU, here
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    model(torch.ones(3, 8)).sum().backward()
    return {"cuda": torch.cuda.is_available(), "backend": dist.get_backend(),
            "grad_device": model[0].weight.grad.device.type}


def test_ranks_beyond_the_gpus_run_on_cpu_and_see_no_gpu():
    """More ranks than GPUs: gloo, and each rank sees no GPU, so code that picks a
    device by itself (FSDP2's default mesh) takes the CPU instead of failing on
    cuda:<rank>, a GPU that is not there."""
    import labkit

    with labkit.Cluster(gpu_count() + 1, timeout=60) as c:
        assert c.backend == "gloo"
        out = c.run(_cpu_rank).values
    assert all(o == {"cuda": False, "backend": "gloo", "grad_device": "cpu"}
               for o in out)


def _moe_worker(rank, world_size):
    import torch.distributed as dist

    from labkit.ledger import traffic
    from labkit.parallel import ExpertParallelMoE, MoELayer

    torch.manual_seed(0)  # the same layer on every rank
    layer = MoELayer(16, 32, experts=4 * world_size, k=2)
    x = torch.randn(8 * world_size, 16, generator=torch.Generator().manual_seed(1))
    ep = ExpertParallelMoE.from_moe(layer, dist.group.WORLD).cuda()
    mine = x.chunk(world_size)[rank].cuda().requires_grad_()  # (8, 16)
    with traffic() as t:
        y = ep(mine)  # (8, 16): counts, then rows out and back over NCCL
        y.backward(torch.ones_like(y))
    return {"out": y.detach().cpu(), "dx": mine.grad.cpu(),
            "experts": ep.routing.experts.cpu(), "traffic": t,
            "device": mine.device.type}


def test_expert_parallel_layer_on_gpus_equals_one_process():
    """ExpertParallelMoE's all-to-alls of uneven splits on NCCL (CUDA tensors),
    against the one-process layer on CPU in float32 and float64 on the same
    routing (labkit.numerics.Oracle: the error allowed comes from this run)."""
    import labkit
    from labkit.numerics import Oracle
    from labkit.parallel import MoELayer

    with labkit.Cluster(N_GPU, timeout=60) as c:
        res = c.run(_moe_worker).values
    torch.manual_seed(0)
    layer = MoELayer(16, 32, experts=4 * N_GPU, k=2)
    x = torch.randn(8 * N_GPU, 16, generator=torch.Generator().manual_seed(1))
    chosen = torch.cat([r["experts"] for r in res])  # the routing the ranks used

    def one_process(model, inp):
        inp = inp.clone().requires_grad_()
        y = model(inp, experts=chosen)
        y.backward(torch.ones_like(y))
        return {"out": y.detach(), "dx": inp.grad}

    oracle = Oracle(exact=one_process(layer.double(), x.double()),
                    one_process={"one process, fp32": one_process(
                        layer.float(), x)})
    got = {"out": torch.cat([r["out"] for r in res]),
           "dx": torch.cat([r["dx"] for r in res])}
    assert {r["device"] for r in res} == {"cuda"}
    print(oracle.check(got, f"MoE layer over {N_GPU} GPU rank(s): output, dx"))
    # over 2 GPUs: counts, rows out and back forward, rows back and out backward;
    # on one GPU the layer has every expert and sends nothing
    want = 5 if N_GPU > 1 else 0
    for rank, r in enumerate(res):
        ops = [rec.op for rec in r["traffic"].records]
        assert ops.count("all_to_all") == want, f"rank {rank}: {ops}, {want} expected"


def _context_worker(rank, world_size):
    import torch.distributed as dist

    from labkit.parallel import (
        allgather_attention,
        shard_balanced,
        shard_sequence,
        ulysses_attention,
    )

    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 4, 8 * world_size, 8, generator=g)
               for _ in range(3))  # (b, a, s, d)
    out = {}
    for name, fn, shard in (("ulysses", ulysses_attention, shard_sequence),
                            ("all-gather", allgather_attention, shard_balanced)):
        mine = [shard(t, dist.group.WORLD).cuda() for t in (q, k, v)]
        out[name] = fn(*mine, causal=True).cpu()  # this rank's rows
    return out


def test_context_parallel_attention_runs_on_gpus():
    """Ulysses and the all-gather of K and V on CUDA tensors (their index and
    mask tensors live on the device too), against one process in float32 and
    float64 (labkit.numerics.Oracle: the error allowed comes from this run)."""
    import labkit
    from labkit.numerics import Oracle
    from labkit.parallel import attention, balanced_rows

    with labkit.Cluster(N_GPU, timeout=60) as c:
        res = c.run(_context_worker).values
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 4, 8 * N_GPU, 8, generator=g) for _ in range(3))
    full = {dt: attention(q.to(dt), k.to(dt), v.to(dt), causal=True)
            for dt in (torch.float64, torch.float32)}  # (1, 4, s, d)
    rows = {"ulysses": [torch.arange(8 * r, 8 * r + 8) for r in range(N_GPU)],
            "all-gather": [balanced_rows(8 * N_GPU, N_GPU, r) for r in range(N_GPU)]}
    for name, held in rows.items():
        mine = torch.cat(held)  # every rank's rows, in rank order
        oracle = Oracle(exact=full[torch.float64][..., mine, :],
                        one_process={"one process": full[torch.float32][..., mine, :]})
        got = torch.cat([r[name] for r in res], dim=-2)
        print(oracle.check(got, f"{name} attention over {N_GPU} GPU rank(s)"))
