"""Gradient accumulation on 4 gloo ranks, k = 3 micro-batches a step:
DataParallel.no_sync() in each mode, ShardedOptimizer stage 1 under it and stage 2
on its own, against one process on the global batch (micro-batch x k x N); the
traffic per step (one all-reduce instead of k) and the gradient memory, measured
with the ledgers."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.models import TinyGPT

from labkit.numerics import Oracle
from labkit.parallel.data_parallel import DataParallel

pytestmark = pytest.mark.numerics  # run again under other CPUs' kernels

N, K, STEPS, MICRO = 4, 3, 3, 2  # ranks, micro-batches, steps, rows a micro-batch
ADAMW = {"lr": 1e-2, "weight_decay": 0.1, "eps": 1e-6}  # eps: test_parallel_zero
UNUSED = ("cross_kv.weight", "cross_kv.bias")  # TinyGPT never calls them
GPT_MB = 4096 / 2**20  # 1,024 float32: TinyGPT's 6,288 parameters in 6 buckets


def _setup(llama):
    torch.manual_seed(0)
    model = TinyGPT(llama=llama)
    g = torch.Generator().manual_seed(1)
    return model, torch.randint(0, 37, (STEPS, N * K * MICRO, 8), generator=g)


def _snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _reference(llama, dtype=torch.float32, pieces=1):
    """One process, AdamW, each step's global batch of N*K*MICRO sequences; its
    gradient summed from `pieces` equal parts, each loss divided by `pieces`."""
    model, ids = _setup(llama)
    model.to(dtype)
    o = torch.optim.AdamW(model.parameters(), **ADAMW)
    for batch in ids:
        o.zero_grad()
        for part in batch.chunk(pieces):
            (model(input_ids=part, labels=part) / pieces).backward()
        o.step()
    return _snapshot(model)


# mode -> (DataParallel mode or None, no_sync?, ShardedOptimizer's arguments or None)
RUNS = {"overlap, no_sync": ("overlap", True, None),
        "overlap, buckets, no_sync": ("overlap:buckets", True, None),
        "naive, no_sync": ("naive", True, None),
        "parameter_server, no_sync": ("parameter_server", True, None),
        "overlap, every micro-batch": ("overlap", False, None),
        "ZeRO-1 under no_sync": ("overlap", True, {}),
        "ZeRO-2": (None, False, {"stage": 2, "bucket_mib": GPT_MB})}


def _micro_batches(rank, world_size, batch):
    # rank r's share of the global batch, cut in K micro-batches
    return batch.chunk(world_size)[rank].chunk(K)


def _train(rank, world_size, llama, run):
    from labkit.parallel import ShardedOptimizer

    mode, skip_sync, zero = RUNS[run]
    model, ids = _setup(llama)
    dp = None
    if mode is not None:
        mode, _, buckets = mode.partition(":")
        dp = DataParallel(model, GPT_MB if buckets else None, mode)
    o = (torch.optim.AdamW(model.parameters(), **ADAMW) if zero is None else
         ShardedOptimizer(model.parameters(), torch.optim.AdamW, **zero, **ADAMW))
    server = mode == "parameter_server"
    for batch in ids:
        o.zero_grad()
        micro = _micro_batches(rank, world_size, batch)
        for j, x in enumerate(micro):
            last = j == len(micro) - 1
            if dp is None:  # ZeRO-2: each backward reduce-scatters into the slice
                (model(input_ids=x, labels=x) / K).backward()
            elif skip_sync and not last:
                with dp.no_sync():
                    (dp(input_ids=x, labels=x) / K).backward()
            else:
                (dp(input_ids=x, labels=x) / K).backward()
                if last or not skip_sync:  # every micro-batch: k all-reduces
                    dp.finish_gradient_synchronization()
        if not server or rank == 0:
            o.step()
        if server:
            dp.broadcast_parameters()
    return _snapshot(model)


@pytest.fixture(scope="module")
def oracles():
    out = {}
    for llama in (False, True):
        exact = _reference(llama, torch.float64)
        out[llama] = Oracle(exact, {
            "whole batch": _reference(llama),
            f"{N * K} micro-batches": _reference(llama, pieces=N * K)})
    return out


@pytest.mark.parametrize("llama", [False, True], ids=["gpt2", "llama"])
@pytest.mark.parametrize("run", [r for r in RUNS if r != "overlap, every micro-batch"])
def test_k_micro_batches_match_one_process_on_the_global_batch(
        cluster, oracles, run, llama):
    oracle = oracles[llama]
    start = _snapshot(_setup(llama)[0])
    oracle.resolves(start, "the untrained model")
    runs = [run] + (["overlap, every micro-batch"] if run == "overlap, no_sync"
                    else [])  # without no_sync, as DDP does by default: k syncs
    for run in runs:
        res = cluster.run(_train, llama, run).values
        for rank, params in enumerate(res):
            oracle.check(params, f"{run}, llama={llama}, rank {rank}, {STEPS} steps "
                         f"of {K} micro-batches")
            for k in [k for k in start if k.endswith(UNUSED)]:
                assert torch.equal(params[k], start[k]), (
                    f"{run}, rank {rank}: {k}, never used, moved")
            differ = [k for k, v in params.items() if not torch.equal(v, res[0][k])]
            assert not differ, f"{run}: rank {rank}'s {differ} differ from rank 0's"


# -- traffic and memory per step, on an MLP of 3 MiB -----------------------------
W = 512
PSI = 3 * (W * W + W) + W * 10 + 10  # 793,098 float32 parameters
MLP_MB = 1.0  # DataParallel's buckets: L3+L4, L2, L1 (3 all-reduces a sync)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(W, W), nn.ReLU(), nn.Linear(W, W), nn.ReLU(),
                         nn.Linear(W, W), nn.ReLU(), nn.Linear(W, 10))


# what -> (optimizer, no_sync?, micro-batches a step)
MEASURE = {"DataParallel, no_sync": ("dp", True, K),
           "DataParallel, every micro-batch": ("dp", False, K),
           "DataParallel, one batch": ("dp", False, 1),
           "ZeRO-1 under no_sync": ("zero1", True, K), "ZeRO-2": ("zero2", False, K)}


def _one_step(rank, world_size, what):
    from labkit import ledger
    from labkit.parallel import ShardedOptimizer

    kind, skip_sync, k = MEASURE[what]
    model = _mlp()
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(K * 4, W, generator=g), torch.randint(0, 10, (K * 4,),
                                                               generator=g)
    dp = DataParallel(model, MLP_MB) if kind != "zero2" else None
    o = (torch.optim.Adam(model.parameters(), lr=1e-3) if kind == "dp" else
         ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3,
                          **({"stage": 2, "bucket_mib": MLP_MB} if kind == "zero2"
                             else {})))
    with ledger.memory(model, o) as m, ledger.traffic() as t:
        for j, (xs, ys) in enumerate(zip(x.chunk(k), y.chunk(k))):
            if dp is None:
                (F.cross_entropy(model(xs), ys) / k).backward()
            elif skip_sync and j < k - 1:
                with dp.no_sync():
                    (F.cross_entropy(dp(xs), ys) / k).backward()
            else:
                (F.cross_entropy(dp(xs), ys) / k).backward()
                dp.finish_gradient_synchronization()
        o.step()
    return {"traffic": t, "memory": m}


@pytest.fixture(scope="module")
def measured(cluster):
    return {what: cluster.run(_one_step, what).values for what in MEASURE}


def test_no_sync_sends_one_all_reduce_a_step_instead_of_k(measured):
    all_reduce = 2 * (N - 1) / N * 4 * PSI  # ring all-reduce, per rank (chapter 02)
    # wire bytes: the payload plus gloo's headers, a few hundred bytes a call,
    # under the 1% allowed
    for what, times in (("DataParallel, no_sync", 1),
                        ("DataParallel, every micro-batch", K),
                        ("ZeRO-1 under no_sync", 1)):
        for rank, r in enumerate(measured[what]):
            t = r["traffic"]
            calls = sum(rec.op == "all_reduce" for rec in t.records)
            assert calls == 3 * times, f"{what}, rank {rank}: {calls} all-reduces"
            payload = t.sum("payload_bytes", op="all_reduce")
            assert payload == times * 4 * PSI, (
                f"{what}, rank {rank}: {payload:,} B all-reduced, "
                f"{times} x 4Ψ = {times * 4 * PSI:,} expected")
            sent = t.sum("wire_bytes", op="all_reduce")
            assert abs(sent - times * all_reduce) <= 0.01 * times * all_reduce, (
                f"{what}, rank {rank}: wrote {sent:,} B, {times} x 2(N-1)/N·4Ψ = "
                f"{times * all_reduce:,.0f} ± 1% expected")


def test_zero2_reduce_scatters_every_micro_batch(measured):
    s = math.ceil(PSI / N)
    share = (N - 1) / N * 4 * N * s  # (N-1)/N of the padded buffer, per rank
    for rank, (z1, z2) in enumerate(zip(measured["ZeRO-1 under no_sync"],
                                        measured["ZeRO-2"])):
        # stage 2: K reduce-scatters (all-to-all + local sum), one all-gather (on
        # gloo N broadcasts); stage 1 under no_sync: one all-reduce (above), the
        # same gather
        for op, times in (("all_to_all", K), ("broadcast", 1)):
            sent = z2["traffic"].sum("wire_bytes", op=op)
            assert abs(sent - times * share) <= 0.01 * times * share, (
                f"ZeRO-2, rank {rank}: {op} wrote {sent:,} B, {times} x "
                f"(N-1)/N·4·padded = {times * share:,.0f} ± 1% expected")
        sent = z1["traffic"].sum("wire_bytes", op="broadcast")
        assert abs(sent - share) <= 0.01 * share, (
            f"ZeRO-1, rank {rank}: broadcasts wrote {sent:,} B, {share:,.0f} ± 1%")
        assert set(z2["traffic"].by_op()) == {"all_to_all", "broadcast"}, (
            z2["traffic"].by_op())


def test_gradient_memory_is_the_same_with_no_sync_and_a_slice_in_zero2(measured):
    # one batch: backward's new gradient becomes .grad, 4Ψ in all. Accumulating,
    # with no_sync or without: a later micro-batch's new gradient is added into
    # .grad, so one tensor's gradient (the largest, a W x W weight) is held twice
    # for a moment: 4Ψ + 4W², to the byte, the same either way
    for what, want in (("DataParallel, one batch", 4 * PSI),
                       ("DataParallel, no_sync", 4 * PSI + 4 * W * W),
                       ("DataParallel, every micro-batch", 4 * PSI + 4 * W * W),
                       ("ZeRO-1 under no_sync", 4 * PSI + 4 * W * W)):
        for rank, r in enumerate(measured[what]):
            peak = r["memory"].peak["Gradient"]
            assert peak == want, (
                f"{what}, rank {rank}: Gradient peak {peak:,} B, {want:,} expected")
    # stage 2: its averaged slice, plus at most one bucket's full gradients
    s, bucket = math.ceil(PSI / N), W * W + W + W * 10 + 10  # L3 and L4
    for rank, r in enumerate(measured["ZeRO-2"]):
        peak = r["memory"].peak["Gradient"]
        assert 4 * s < peak <= 4 * (s + bucket), (
            f"ZeRO-2, rank {rank}: Gradient peak {peak:,} B, expected in "
            f"({4 * s:,}, {4 * (s + bucket):,}]")


# -- misuse ----------------------------------------------------------------------


def _misuse(rank, world_size):
    errors = {}

    def expect(name, fn):
        try:
            fn()
        except RuntimeError as e:
            errors[name] = str(e)

    model = nn.Linear(7, 5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for mode in ("overlap", "naive"):
        dp = DataParallel(model, mode=mode)
        with dp.no_sync():
            dp(torch.randn(4, 7)).sum().backward()
            expect(f"{mode}: finish inside", dp.finish_gradient_synchronization)
        expect(f"{mode}: step", opt.step)  # local gradients, not averaged
        dp(torch.randn(4, 7)).sum().backward()
        dp.finish_gradient_synchronization()
        opt.step()  # fine now
        opt.zero_grad()
        dp.close()
    dp = DataParallel(model)
    dp(torch.randn(4, 7)).sum().backward()  # its all-reduces are in flight ...
    with dp.no_sync():  # ... and this backward would add into what they send
        expect("overlap: backward after", lambda: dp(torch.randn(4, 7)).sum()
               .backward())
    dp.finish_gradient_synchronization()
    return errors


def test_misuse_of_no_sync_raises_clear_errors(cluster):
    for errors in cluster.run(_misuse).values:
        for mode in ("overlap", "naive"):
            assert "inside no_sync()" in errors[f"{mode}: finish inside"], errors
            assert "accumulated under no_sync()" in errors[f"{mode}: step"], errors
        assert "second backward" in errors["overlap: backward after"], errors
