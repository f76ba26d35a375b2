"""python -m labkit bench: each figure beside its target, and a failing exit status
when one falls short. Made-up figures only: nothing here is timed."""

import math

import pytest

from labkit.cli import bench, main
from labkit.cli.bench import Row, cluster_rows, exit_code, table
from labkit.cli.bench_ring import ring_rows

GOOD = dict(warm=(0.1, 3.0), cold=(1.2, 5.0), first_restart=0.2, restart=0.1,
            p50=5e-4, p99=2e-3, ar50=0.05, spawn=4.0, file_s=0.2, live_s=0.25)


def _by_name(rows):
    return {r.name: r for r in rows}


def test_a_time_is_ok_up_to_its_target_and_short_beyond():
    assert Row("t", 0.3, 0.3).status == "ok"
    assert Row("t", 0.31, 0.3).status == "short"
    assert Row("t", math.nan, 0.3).status == "short"
    assert Row("t", 99.0).status == ""  # no target: never short


def test_a_ratio_is_ok_from_its_target_up():
    assert Row("r", 0.8, 0.8, unit="", at_least=True).status == "ok"
    assert Row("r", 0.79, 0.8, unit="", at_least=True).status == "short"


def test_exit_code_is_1_when_any_figure_falls_short():
    assert exit_code([Row("a", 1.0, 2.0), Row("b", 50.0)]) == 0
    assert exit_code([Row("a", 1.0, 2.0), Row("b", 3.0, 2.0)]) == 1
    assert exit_code([]) == 0


def test_table_prints_each_figure_beside_its_target():
    lines = table([Row("fast enough", 0.2, 0.3), Row("too slow", 0.5, 0.3),
                   Row("no target", 7.0)]).splitlines()
    assert lines[1].startswith("fast enough")
    assert lines[1].endswith("0.200000 s  ≤ 0.3 s       ok")
    assert lines[2].endswith("≤ 0.3 s       short")
    assert lines[3].endswith("7.000000 s")
    assert lines[-1] == "1 figure(s) short of target"


def test_cluster_figures_and_their_targets():
    rows = cluster_rows(**GOOD)
    assert exit_code(rows) == 0, table(rows)
    fresh = "first restart after a fault in a fresh process (+ no-op), worst"
    assert _by_name(rows)[fresh].target == 0.3
    slow = cluster_rows(**dict(GOOD, first_restart=0.45))
    assert _by_name(slow)[fresh].status == "short"
    assert exit_code(slow) == 1
    late = cluster_rows(**dict(GOOD, warm=(0.5, 3.0)))  # prewarmed, 0.2 s at most
    assert exit_code(late) == 1, table(late)
    cold = cluster_rows(**dict(GOOD, cold=(1.6, 5.0)))
    assert exit_code(cold) == 1, table(cold)
    # the portable start's starts and restarts are printed, not held to the fork's
    portable = cluster_rows(**dict(GOOD, warm=(3.0, 6.0), cold=(5.0, 9.0),
                                   first_restart=2.0, restart=1.0), start="portable")
    assert exit_code(portable) == 0, table(portable)
    # spawn per call must be >= 1000x a warm no-op: 4 s / 5 ms is only 800x
    slow_live = _by_name(cluster_rows(**dict(GOOD, live_s=0.31)))  # 1.55x
    assert slow_live["  live / files only"].status == "short"
    few = _by_name(cluster_rows(**dict(GOOD, p50=5e-3)))
    assert few["spawn per call / warm no-op p50"].status == "short"
    assert few["warm no-op round trip, p50"].status == "short"  # over 1 ms


def test_ring_ratio_target():
    ok = ring_rows({"all_reduce": 1e9, "ring_all_reduce": 0.9e9})
    assert exit_code(ok) == 0
    short = ring_rows({"all_reduce": 1e9, "ring_all_reduce": 0.5e9})
    assert exit_code(short) == 1
    assert short[-1].name == "ring / built-in busbw" and short[-1].status == "short"


def test_the_command_returns_the_benchmarks_status(monkeypatch):
    monkeypatch.setattr(bench, "bench_cluster", lambda n: exit_code(
        [Row("x", 2.0, 1.0)]))
    from labkit.cli import bench_ring

    monkeypatch.setattr(bench_ring, "bench_ring", lambda n: 0)
    assert main.main(["bench", "cluster"]) == 1
    assert main.main(["bench", "ring"]) == 0


@pytest.mark.parametrize("what, flags, says", [
    ("cluster", ["--world-size", "0"], "--world-size 0: at least 2 ranks"),
    ("cluster", ["--world-size", "-3"], "--world-size -3: at least 2 ranks"),
    ("cluster", ["--world-size", "1"], "--world-size 1: at least 2 ranks"),
    ("ring", ["--world-size", "1"], "--world-size 1: at least 2 ranks"),
    ("strategies", ["--world-size", "0"], "at least 2 ranks"),
    ("model-parallel", ["--world-size", "3"], "--world-size 3: 2 or 4"),
    ("expert", ["--world-size", "3"], "--world-size 3: 2, 4 or 8"),
    ("roofline", ["--world-size", "4"], "roofline starts no ranks"),
])
def test_bad_world_sizes_are_refused_before_anything_runs(monkeypatch, capsys, what,
                                                          flags, says):
    from labkit.cli import bench_expert, bench_ring, bench_roofline, bench_strategies

    ran = []
    for module, fn in ((bench, "bench_cluster"), (bench_ring, "bench_ring"),
                       (bench_strategies, "bench_strategies"),
                       (bench_roofline, "bench_roofline"), (bench_expert, "run")):
        monkeypatch.setattr(module, fn, lambda *a, fn=fn: ran.append(fn) or 0)
    monkeypatch.setattr(main, "bench_model_parallel",
                        lambda n: ran.append("model-parallel") or 0)
    assert main.main(["bench", what, *flags]) == 2, ran
    assert ran == [], f"bench {what} {flags} ran {ran}"
    err = capsys.readouterr().err
    assert f"labkit bench {what}: " in err and says in err, err


def test_strategy_rows_ratios_and_state_share():
    from labkit.cli.bench_strategies import strategy_rows

    step = {"DataParallel": 1.05, "DDP": 1.0, "ShardedOptimizer": 1.3,
            "ZeroRedundancyOptimizer": 1.0}
    full = 8 * 1000 + 32  # plain Adam on every rank: 8 bytes/param + step counters
    state = {"DDP": [full] * 4, "ShardedOptimizer": [2004, 2004, 2004, 2004],
             "ZeroRedundancyOptimizer": [2016] * 4}
    rows = _by_name(strategy_rows(step, state, 4))
    assert rows["DataParallel / DDP"].status == "ok"  # 1.05 <= 1.05
    assert rows["ShardedOptimizer / ZeroRedundancyOptimizer"].status == "short"
    share = rows["ShardedOptimizer: largest rank's state x N / DDP's"]
    assert share.value == 2004 * 4 / full and share.status == "ok"
    lopsided = dict(state, ShardedOptimizer=[4000, 1000, 1000, 1000])
    assert _by_name(strategy_rows(step, lopsided, 4))[
        "ShardedOptimizer: largest rank's state x N / DDP's"].status == "short"


def test_strategy_rows_fsdp_time_and_peak_memory_ratios():
    from labkit.cli.bench_strategies import strategy_rows

    step = {"DataParallel": 1.0, "DDP": 1.0, "ShardedOptimizer": 1.0,
            "ZeroRedundancyOptimizer": 1.0, "FullyShardedDataParallel": 0.95,
            "FSDP2": 1.0}
    state = {"DDP": [8000] * 4, "ShardedOptimizer": [2000] * 4,
             "ZeroRedundancyOptimizer": [2000] * 4}
    peak = {"FullyShardedDataParallel": [90, 94, 90, 90],
            "FSDP2": [90, 95, 95, 95]}  # the fullest ranks: 94 / 95 = 0.99
    rows = _by_name(strategy_rows(step, state, 4, peak))
    assert rows["FullyShardedDataParallel / FSDP2"].status == "ok"  # 0.95 <= 1.0
    ratio = rows["FullyShardedDataParallel / FSDP2: peak memory per rank"]
    assert ratio.value == 94 / 95 and ratio.status == "ok"
    fat = dict(peak, FullyShardedDataParallel=[90, 96, 90, 90])  # 1.01
    slow = dict(step, FullyShardedDataParallel=1.05)
    assert _by_name(strategy_rows(step, state, 4, fat))[
        "FullyShardedDataParallel / FSDP2: peak memory per rank"].status == "short"
    assert _by_name(strategy_rows(slow, state, 4, peak))[
        "FullyShardedDataParallel / FSDP2"].status == "short"
    # without FSDP's figures (an older run) the other rows stand alone
    assert "FullyShardedDataParallel / FSDP2" not in _by_name(
        strategy_rows({k: step[k] for k in list(step)[:4]}, state, 4))
    # the second model's rows carry its name
    gpt = _by_name(strategy_rows(step, state, 4, peak, model="GPT"))
    assert gpt["FullyShardedDataParallel / FSDP2 [GPT]"].status == "ok", list(gpt)


def test_roofline_rows_hold_each_product_between_floor_and_roof():
    """Made-up timings against the calculator's own roofline prices."""
    from labkit.cli.bench_roofline import cluster_for, roofline_rows, shapes
    from labkit.theory import gemm_time

    h100 = cluster_for("NVIDIA H100 80GB HBM3")
    assert h100 is not None and cluster_for("NVIDIA H800").hbm_bw == h100.hbm_bw
    assert cluster_for("NVIDIA A100-SXM4-80GB").name.startswith("Selene")
    assert cluster_for("NVIDIA H200") is None  # no constants: the bench says so
    price = {label: gemm_time(*mnk, h100) for label, mnk in shapes().items()}
    assert len(price) == 5 and all(p > 0 for p in price.values())
    on_roof = roofline_rows(price, h100)
    assert exit_code(on_roof) == 0 and all(r.value == 1.0 for r in on_roof)
    slow = roofline_rows({k: v / 0.5 for k, v in price.items()}, h100)
    assert {r.status for r in slow if r.at_least} == {"short"}  # half the speed
    fast = roofline_rows({k: v / 1.2 for k, v in price.items()}, h100)
    assert {r.status for r in fast if not r.at_least} == {"short"}  # beats a bound
    assert exit_code(slow) == exit_code(fast) == 1


def test_roofline_bench_says_it_needs_a_gpu(capsys, monkeypatch):
    import torch

    from labkit.cli.bench_roofline import bench_roofline

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_roofline() == 2
    assert "on a CUDA GPU, and this machine has none" in capsys.readouterr().out


# -- bench expert: the rows from made-up timings and byte counts -------------------

_MOE = {"hidden": 2, "ffn": 4, "experts": 8, "k": 2, "tokens": 4}


def _moe_bytes(sent_away, received_away, backward=True):
    """A rank's ledger by hand: rows of h=2 float32 elements (8 bytes), sent to
    other ranks by the dispatch and the combine, forward and (the same again)
    backward, plus the counts exchanged first: E/ep = 2 int64 to each of the 3
    others, 48 bytes."""
    rows = (sent_away + received_away) * (2 if backward else 1)
    return {"ledger": rows * 8 + 48, "tokens": 4, "sent_away": sent_away,
            "received_away": received_away, "element_size": 4}


def test_expert_rows_ratios_and_bytes_against_the_closed_form():
    from labkit.cli.bench_expert import expert_rows

    step = {"ExpertParallelMoE": 0.8, "one-process MoELayer": 1.0, "dense MLP": 0.5}
    layer = [_moe_bytes(6, 5), _moe_bytes(8, 8), _moe_bytes(0, 3), _moe_bytes(6, 6)]
    rows = _by_name(expert_rows(step, layer, _MOE, 4, 2, 1))
    assert exit_code(list(rows.values())) == 0, table(list(rows.values()))
    assert rows["ExpertParallelMoE / one-process MoELayer"].value == 0.8
    assert rows["  best cores allow: 1 core(s) / the ranks' 2"].value == 0.5
    assert rows["ExpertParallelMoE / dense MLP (routing + all-to-alls)"].value == 1.6
    exact = rows["  |ledger - expert_traffic|, worst rank"]
    assert exact.value == 0 and exact.status == "ok"
    # rank 1 sent and received 8 + 8 rows of its 8 pairs, the balanced 6 + 6:
    # 2 x 16 x 8 + 48 bytes over 2 x 12 x 8 + 48
    skew = rows["  largest rank / balanced routing's closed form"]
    assert skew.value == (2 * 16 * 8 + 48) / (2 * 12 * 8 + 48)
    slow = _by_name(expert_rows(dict(step, ExpertParallelMoE=1.1), layer, _MOE, 4, 2,
                                1))
    assert slow["ExpertParallelMoE / one-process MoELayer"].status == "short"
    # one core: the ranks cannot beat the loop, so the ratio has no target
    one = _by_name(expert_rows(dict(step, ExpertParallelMoE=1.1), layer, _MOE, 4, 1,
                               1))
    assert one["ExpertParallelMoE / one-process MoELayer"].target is None
    assert one["  best cores allow: 1 core(s) / the ranks' 1"].value == 1.0
    # 16 cores, 4 threads a rank: the loop has 4 of the ranks' 16
    assert _by_name(expert_rows(step, layer, _MOE, 4, 16, 4))[
        "  best cores allow: 4 core(s) / the ranks' 16"].value == 0.25


def test_expert_rows_catch_a_ledger_that_missed_a_byte_or_the_backward():
    from labkit.cli.bench_expert import expert_rows

    step = {"ExpertParallelMoE": 0.8, "one-process MoELayer": 1.0, "dense MLP": 0.5}
    name = "  |ledger - expert_traffic|, worst rank"
    right = _moe_bytes(6, 5)
    for wrong, off in ((dict(right, ledger=right["ledger"] - 1), 1),
                       (_moe_bytes(6, 5, backward=False), 11 * 8)):
        rows = expert_rows(step, [_moe_bytes(6, 6), wrong, right, right], _MOE, 4,
                           2, 1)
        assert _by_name(rows)[name].value == off, table(rows)
        assert _by_name(rows)[name].status == "short" and exit_code(rows) == 1


def test_bench_expert_command(monkeypatch):
    from labkit.cli import bench_expert

    seen = []
    monkeypatch.setattr(bench_expert, "run", lambda n: seen.append(n) or 0)
    assert main.main(["bench", "expert"]) == 0
    assert main.main(["bench", "expert", "--world-size", "2"]) == 0
    assert seen == [4, 2]


@pytest.mark.ranks  # bench_expert starts a Cluster (conftest cannot see it here)
def test_bench_expert_runs_small():
    """The whole bench at toy sizes: its bytes agree with the closed form on
    every rank (bytes, not timings: the times' ratios are not asserted)."""
    from labkit.cli.bench_expert import bench_expert

    rows = _by_name(bench_expert(4, rounds=1, steps=1,
                                 sizes={"hidden": 16, "ffn": 32, "tokens": 32}))
    assert rows["  |ledger - expert_traffic|, worst rank"].status == "ok"
    for r in range(4):
        assert rows[f"all-to-all bytes per layer, rank {r} (ledger)"].value > 0
    assert all(rows[k].value > 0 for k in rows if k.endswith("median of rounds"))
