"""labkit.checks.three_d (chapter 14): each check passes a right answer on the
cases it draws, says "not written yet" for a stub, names the usual mistakes, and
fails every shortcut: labkit's own implementation (grid code, model and ledger,
ring pricing, the layout calculator) or the check's reference, answers written
down for the cases the checks used to fix, NaN and non-numbers. Its references
are held to torch's layout, the traffic ledger and theory.estimate here."""

import dataclasses
import math
import random

import pytest

from labkit import theory
from labkit.checks import three_d
from labkit.checks.common import ExerciseError
from labkit.checks.three_d import (
    check_dp_bytes,
    check_peers_any_order,
    check_ring_seconds,
    check_traffic_ratios,
)


def _stub(*args):
    raise NotImplementedError("exercise")


# ---------------------------------------------------------------- my_peers


def _peers(rank, dims):
    sizes, out = list(dims.values()), {}
    for k, name in enumerate(dims):
        stride = math.prod(sizes[k + 1:])
        coord = rank // stride % sizes[k]
        out[name] = [rank + (i - coord) * stride for i in range(sizes[k])]
    return out


def _tp_always_innermost(rank, dims):  # the chapter's order, whatever dims says
    order = [d for d in ("dp", "pp", "cp", "tp") if d in dims]
    return _peers(rank, {d: dims[d] for d in order})


def _first_innermost(rank, dims):  # column-major
    return _peers(rank, dict(reversed(dims.items())))


def _descending(rank, dims):
    return {d: g[::-1] for d, g in _peers(rank, dims).items()}


def _coordinates(rank, dims):
    return {d: list(range(n)) for d, n in dims.items()}


_OLD_ORDER_CASES = ({"dp": 2, "pp": 2, "tp": 2}, {"tp": 2, "pp": 2, "dp": 2},
                    {"pp": 2, "dp": 4, "tp": 2}, {"dp": 2, "pp": 4, "cp": 2, "tp": 4})
_WRITTEN_DOWN = {(tuple(d.items()), r): _peers(r, d) for d in _OLD_ORDER_CASES
                 for r in range(math.prod(d.values()))}


def test_peers_right_answer_passes_on_every_draw(capsys):
    for _ in range(3):
        assert check_peers_any_order(_peers)
    out = capsys.readouterr().out
    assert "correct: every rank of 5 grids named its groups" in out
    assert "4 drawn this run" in out


def test_peers_stub_is_not_written_yet(capsys):
    assert not check_peers_any_order(_stub)
    assert "not written yet" in capsys.readouterr().out


@pytest.mark.parametrize("seed", range(20))
def test_peers_reference_is_torchs_row_major_layout(seed):
    # DeviceMesh numbers the ranks as arange(world).reshape(sizes)
    import torch

    for dims in three_d._peer_cases(seed):
        sizes = list(dims.values())
        grid = torch.arange(math.prod(sizes)).reshape(sizes)
        for rank in range(grid.numel()):
            where = (grid == rank).nonzero()[0].tolist()
            for k, name in enumerate(dims):
                idx = list(where)
                idx[k] = slice(None)
                assert three_d._mesh_groups(rank, dims)[name] == \
                    grid[tuple(idx)].tolist(), (seed, dims, rank, name)


def test_peers_cases_are_drawn_fresh_and_move_tp():
    drawn = [three_d._peer_cases(s) for s in range(30)]
    assert len({str(c[1:]) for c in drawn}) == 30  # no two runs alike
    for cases in drawn:
        assert cases[0] == {"dp": 2, "pp": 2, "tp": 2}  # section 6's
        assert list(cases[1])[-1] != "tp" and len(cases[1]) == 4
        assert all(math.prod(d.values()) <= 64 for d in cases)


@pytest.mark.parametrize("answer, hint", [
    (_tp_always_innermost, "that is the chapter's order, tp innermost"),
    (_first_innermost, "the first dimension taken as the innermost"),
    (_descending, "the right ranks in another order"),
    (_coordinates, "those are the coordinates along each dimension"),
    (lambda r, d: {k: [r] * n for k, n in d.items()}, "ranks are"),
    (lambda r, d: {"tp": [r]}, "return a dict with the keys"),
    (lambda r, d: None, "return a dict with the keys"),
    (lambda r, d: {k: [float("nan")] * n for k, n in d.items()},
     "return a list of whole-number global ranks"),
    (lambda r, d: _WRITTEN_DOWN.get((tuple(d.items()), r), {}),
     "return a dict with the keys"),  # the old fixed grids, written down
])
def test_peers_slips_and_written_down_answers_are_named(answer, hint):
    with pytest.raises(ExerciseError, match="my_peers") as e:
        check_peers_any_order(answer)
    assert hint in str(e.value)


def test_peers_labkits_own_grid_code_is_refused():
    def with_grid(rank, dims):
        from labkit.parallel.groups import grid

        grid(8, tp=2, pp=2, dp=2)  # any use of it
        return _peers(rank, dims)

    with pytest.raises(ExerciseError, match=r"labkit.parallel.groups.grid, "
                                            r"labkit's own rank grid"):
        check_peers_any_order(with_grid)
    with pytest.raises(ExerciseError, match=r"three_d._mesh_groups"):
        check_peers_any_order(three_d._mesh_groups)


def test_peers_exception_is_reported_not_raised():
    with pytest.raises(ExerciseError, match="raised ZeroDivisionError"):
        check_peers_any_order(lambda r, d: 1 / 0)


# ------------------------------------------------------------- my_dp_bytes


def _dp_bytes(stage, tp, pp, dp, cfg):
    h, V, s, L = cfg["hidden"], cfg["vocab"], cfg["seq"], cfg["layers"]
    modules = ([V * h + s * h] + [theory.layer_params(h, tp).total] * L
               + [2 * h + V * h])
    k = len(modules) // pp
    return 4 * sum(modules[stage * k:(stage + 1) * k]) * 2 * (dp - 1) / dp


def _scaled(factor):
    return lambda *a: _dp_bytes(*a) * factor(a[3])


def _every_stage(stage, tp, pp, dp, cfg):
    return sum(_dp_bytes(s, tp, pp, dp, cfg) for s in range(pp))


def _whole_blocks(stage, tp, pp, dp, cfg):
    return _dp_bytes(stage, 1, pp, dp, cfg)


def _head_bias(stage, tp, pp, dp, cfg):
    return _dp_bytes(stage, tp, pp, dp, cfg) + (
        8 * cfg["vocab"] * (dp - 1) / dp if stage == pp - 1 else 0)


def _blocks_cut(stage, tp, pp, dp, cfg):  # the blocks alone cut into pp
    h, V, s, L = cfg["hidden"], cfg["vocab"], cfg["seq"], cfg["layers"]
    k = L // pp
    n = (k if stage < pp - 1 else L - k * (pp - 1))
    p = (n * theory.layer_params(h, tp).total + (V * h + s * h) * (stage == 0)
         + (2 * h + V * h) * (stage == pp - 1))
    return 8 * p * (dp - 1) / dp


def _flipped(stage, tp, pp, dp, cfg):
    return _dp_bytes(pp - 1 - stage, tp, pp, dp, cfg)


_OLD_DP = {}  # what the old fixed grids' right answers were, written down


def _written_down(stage, tp, pp, dp, cfg):
    return _OLD_DP.get((stage, tp, pp, dp), 0.0)


for _g in ((2, 2, 2), (1, 2, 4)):
    for _s in range(2):
        _OLD_DP[(_s, *_g)] = _dp_bytes(_s, *_g, dict(vocab=64, seq=16, hidden=32,
                                                      heads=4, layers=2))


def test_dp_bytes_right_answer_passes_and_says_what_was_measured(cluster, capsys):
    for _ in range(2):
        assert check_dp_bytes(cluster, _dp_bytes)
    out = capsys.readouterr().out
    assert "correct: your prediction is what every rank sent in its dp group" in out
    assert "(TinyGPTs drawn this run; traffic ledger)" in out


def test_dp_bytes_stub_is_not_written_yet(cluster, capsys):
    assert not check_dp_bytes(cluster, _stub)
    assert "not written yet" in capsys.readouterr().out


@pytest.mark.parametrize("seed", range(30))
def test_dp_count_is_torchs_parameter_count(seed):
    # every module of the one-process TinyGPT, tp = 1, and the stage sums;
    # against the ledger: the check itself, on every run (RuntimeError)
    from labkit.parallel import TinyGPT

    rng = random.Random(seed)
    pp = rng.randint(1, 4)
    cfg = three_d._draw_cfg(rng, 1, pp, small=True)
    model = TinyGPT(**cfg)
    counted = [n for _, n in three_d._modules(cfg, 1)]
    assert counted == [sum(p.numel() for p in m.parameters()) for m in model]
    whole = sum(p.numel() for p in model.parameters())
    assert sum(three_d._stage_params(s, 1, pp, cfg) for s in range(pp)) == whole


def test_dp_cases_cover_the_grids():
    for seed in range(30):
        measured, computed = three_d._dp_cases(seed, 8)
        assert measured[0][0] == (2, 2, 2) and measured[1][0][2] > 1
        assert computed[0][0] == (2, 2, 2)
        tp, pp, dp = computed[1][0]
        assert tp > 1 and pp >= 3 and dp > 1
        for (tp, pp, _dp), cfg in computed + [(g, c) for g, c, _, _ in measured]:
            assert (cfg["layers"] + 2) % pp == 0 and cfg["heads"] % tp == 0
        measured4, _ = three_d._dp_cases(seed, 4)
        assert all(g[0] * g[1] * g[2] == 4 and g[2] > 1 for g, *_ in measured4)


@pytest.mark.parametrize("answer, hint", [
    (_every_stage, "that is every stage's parameters"),
    (_whole_blocks, "the blocks counted whole"),
    (_blocks_cut, "cuts all L + 2 modules"),
    (_flipped, "stage 0 is the first"),
    (_head_bias, "the head's Linear(h, V) has no bias"),
    (_scaled(lambda dp: 0.5), "(dp-1)/dp is a reduce-scatter's share"),
    (_scaled(lambda dp: 0.5), "not bf16's 2"),  # 2 bytes a gradient: the same
    (_scaled(lambda dp: dp / (dp - 1) / 2 if dp > 1 else 1),
     "that is the gradients' size"),
    (_scaled(lambda dp: 0.5 * dp / (dp - 1) * 2 if dp > 1 else 1),
     "not twice all of them"),
    (_scaled(lambda dp: 0.25), "that counts gradients, not bytes"),
    (lambda *a: float("nan"), "is not a number an answer can be"),
    (lambda *a: "35 KiB", "return a number"),
    (_written_down, "Hint:"),
])
def test_dp_bytes_slips_and_written_down_answers_are_named(cluster, answer, hint):
    with pytest.raises(ExerciseError, match="my_dp_bytes") as e:
        check_dp_bytes(cluster, answer)
    assert hint in str(e.value)


def test_two_slips_that_give_the_same_number_are_both_named():
    # CI drew this model once: V = s*h - 2h, so the head given a bias and the
    # pipeline flipped both send the same bytes on the last of two stages
    cfg = {"vocab": 44, "seq": 13, "hidden": 4, "heads": 1, "layers": 4}
    want = three_d._dp_bytes(three_d._stage_params(1, 1, 2, cfg), 2)
    for answer in (_head_bias, _flipped):
        got = answer(1, 1, 2, 2, cfg)
        with pytest.raises(ExerciseError) as e:
            three_d._compare_dp("my_dp_bytes(1, ...)", got, want, 1, (1, 2, 2),
                                cfg, f"expected {float(want):,.0f} B")
        assert "the head's Linear(h, V) has no bias" in str(e.value), str(e.value)
        assert "stage 0 is the first" in str(e.value), str(e.value)


def test_dp_bytes_a_wrong_answer_is_held_to_the_ledger(cluster):
    # the first measured grid fails first: its message names the measurement
    with pytest.raises(ExerciseError, match=r"but rank \d+ sent [\d,]+ B in its "
                                            r"dp group in one step .*measured by "
                                            r"its traffic ledger"):
        check_dp_bytes(cluster, _scaled(lambda dp: 2))


def test_dp_bytes_measuring_instead_of_counting_is_refused(cluster):
    def built(stage, tp, pp, dp, cfg):
        from labkit.parallel import TinyGPT

        TinyGPT(vocab=8, seq=4, hidden=8, heads=1, layers=1)  # count a model
        return _dp_bytes(stage, tp, pp, dp, cfg)

    def ran(stage, tp, pp, dp, cfg):
        cluster.run(lambda r, w: None)  # measure on the ranks
        return _dp_bytes(stage, tp, pp, dp, cfg)

    with pytest.raises(ExerciseError, match=r"calls labkit.parallel.models.*"
                                            r"labkit's own model, 3D run or ledger"):
        check_dp_bytes(cluster, built)
    with pytest.raises(ExerciseError, match=r"calls labkit.runtime.cluster."
                                            r"Cluster.run"):
        check_dp_bytes(cluster, ran)
    with pytest.raises(ExerciseError, match=r"three_d._modules"):
        check_dp_bytes(cluster, lambda s, t, p, d, c: 8 * (d - 1) / d * sum(
            n for _, n in three_d._modules(c, t)[s * (len(three_d._modules(
                c, t)) // p):(s + 1) * (len(three_d._modules(c, t)) // p)]))


# --------------------------------------------------------- my_ring_seconds


def right(op, size, n, nodes, cl):
    inter = theory.latency_steps(op, nodes) if nodes > 1 else 0
    bw = cl.intra_bw if nodes == 1 else cl.inter_bw
    return ((theory.latency_steps(op, n) - inter) * cl.alpha_intra
            + inter * cl.alpha_inter + theory.ring_bytes_per_rank(op, size, n) / bw)


def test_ring_right_answer_passes(capsys):
    for _ in range(3):
        assert check_ring_seconds(right)
    assert ("correct: your α-β seconds are the ring's on 4 fixed collectives on "
            "Llama 3's cluster and on 6 drawn this run") in capsys.readouterr().out


def test_ring_stub_is_not_written_yet(capsys):
    assert not check_ring_seconds(_stub)
    assert "not written yet" in capsys.readouterr().out


def test_ring_reference_is_the_calculators():
    from labkit.theory import ring_latency

    for seed in range(30):
        for op, size, n, nodes, cl in three_d._ring_cases(seed):
            want = (ring_latency(op, n, nodes, cl.alpha_intra, cl.alpha_inter)
                    + theory.ring_bytes_per_rank(op, size, n)
                    / (cl.intra_bw if nodes == 1 else cl.inter_bw))
            assert float(three_d._ring_exact(op, size, n, nodes, cl)) == \
                pytest.approx(want, rel=1e-12)


def _bytes_only(op, size, n, nodes, cl):
    return theory.ring_bytes_per_rank(op, size, n) / (
        cl.intra_bw if nodes == 1 else cl.inter_bw)


def _with(**change):
    def answer(op, size, n, nodes, cl):
        return right(op, size, n, nodes, dataclasses.replace(cl, **{
            k: getattr(cl, v) for k, v in change.items()}))
    return answer


def _extra_inter_steps(op, size, n, nodes, cl):  # inter steps on top of the ring's
    inter = theory.latency_steps(op, nodes) if nodes > 1 else 0
    return right(op, size, n, nodes, cl) + inter * cl.alpha_intra


def _once_across(op, size, n, nodes, cl):  # all-reduce crosses nodes-1 times
    inter = theory.latency_steps(op, nodes) if nodes > 1 else 0
    once = nodes - 1 if nodes > 1 else 0
    return right(op, size, n, nodes, cl) + (inter - once) * (
        cl.alpha_intra - cl.alpha_inter)


def _half_all_reduce(op, size, n, nodes, cl):  # n-1 steps for every op
    return (right(op, size, n, nodes, cl) if op != "all_reduce"
            else right("all_gather", size, n, nodes, cl)
            + theory.ring_bytes_per_rank("all_gather", size, n) / (
                cl.intra_bw if nodes == 1 else cl.inter_bw))


def _whole_size(op, size, n, nodes, cl):
    bw = cl.intra_bw if nodes == 1 else cl.inter_bw
    return right(op, size, n, nodes, cl) + (
        size - theory.ring_bytes_per_rank(op, size, n)) / bw


_OLD_RINGS = {c: right(*c, theory.LLAMA3_CLUSTER) for c in (
    ("all_reduce", 268e6, 8, 1), ("reduce_scatter", 64e6, 16, 2),
    ("all_reduce", 1e6, 64, 8), ("all_gather", 797e6, 2048, 2048))}


@pytest.mark.parametrize("answer, where, hint", [
    (_bytes_only, "n=8, nodes=1", "the bytes alone: every ring step also pays α"),
    (_with(alpha_intra="alpha_inter"), "n=8, nodes=1",
     "every step paid the network's α"),
    (_with(alpha_inter="alpha_intra"), "n=16, nodes=2", "every step paid NVLink's α"),
    (_extra_inter_steps, "n=16, nodes=2", "not extra ones"),
    (_once_across, "n=64, nodes=8", "crosses each node boundary twice"),
    (_half_all_reduce, "n=8, nodes=1", "an all-reduce takes 2(n-1) steps"),
    (_with(inter_bw="intra_bw"), "n=16, nodes=2", "at the network's inter_bw"),
    (_with(intra_bw="inter_bw"), "n=8, nodes=1", "inside one node the bytes go "
                                                 "over NVLink"),
    (_whole_size, "n=8, nodes=1", "that sends the whole array"),
    (lambda *a: 2 * right(*a), "n=8, nodes=1", "theory.latency_steps(op, n)"),
    (lambda *a: "fast", "n=8, nodes=1", "return a number"),
    (lambda *a: float("inf"), "n=8, nodes=1", "not a number an answer can be"),
    (lambda *a: _OLD_RINGS.get(a[:4], 0.0), "spec)", "Hint:"),  # written down
])
def test_ring_slips_and_written_down_answers_are_named(answer, where, hint):
    with pytest.raises(ExerciseError, match="my_ring_seconds") as e:
        check_ring_seconds(answer)
    assert where in str(e.value) and hint in str(e.value)


def test_ring_labkits_own_pricing_is_refused():
    def calculator(op, size, n, nodes, cl):
        bw = cl.intra_bw if nodes == 1 else cl.inter_bw
        return (theory.ring_latency(op, n, nodes, cl.alpha_intra, cl.alpha_inter)
                + theory.ring_bytes_per_rank(op, size, n) / bw)

    def alpha_beta(op, size, n, nodes, cl):
        theory.alpha_beta_time(op, size, n, cl.alpha_intra, cl.intra_bw)
        return right(op, size, n, nodes, cl)

    with pytest.raises(ExerciseError, match=r"calls labkit.theory.layout.costs."
                                            r"ring_latency, labkit's own α-β"):
        check_ring_seconds(calculator)
    with pytest.raises(ExerciseError, match=r"alpha_beta_time, labkit's own"):
        check_ring_seconds(alpha_beta)
    with pytest.raises(ExerciseError, match=r"three_d._ring_exact"):
        check_ring_seconds(three_d._ring_exact)


def test_ring_exception_is_reported_not_raised():
    with pytest.raises(ExerciseError, match="raised ZeroDivisionError"):
        check_ring_seconds(lambda *a: 1 / 0)


# ------------------------------------------------------- my_traffic_ratios


def ratios(cp, dp, seq, microbatches):
    def per_gpu(cp, dp, seq, m):
        seqs = 128 * 131072 / seq / dp
        tokens = seqs * seq / cp
        n = dp * cp
        return {"tp": tokens, "pp": tokens, "cp": seqs * seq * (cp - 1) / cp,
                "dp": (m + 1) * (n - 1) / n}

    new, old = per_gpu(cp, dp, seq, microbatches), per_gpu(16, 8, 131072, 16)
    return {d: new[d] / old[d] for d in new}


def test_ratios_right_answer_passes(capsys):
    for _ in range(3):
        assert check_traffic_ratios(ratios)
    assert ("correct: your tp, cp, pp and dp ratios are section 7's pricing (the "
            "check's own closed forms) for CP 32 x DP 4 and for 5 layouts drawn "
            "this run") in capsys.readouterr().out


def test_ratios_stub_is_not_written_yet(capsys):
    assert not check_traffic_ratios(_stub)
    assert "not written yet" in capsys.readouterr().out


def test_ratios_reference_is_what_estimate_prices():
    run = theory.PUBLISHED_RUNS["llama3-405b-128k"]
    old = run.estimate().traffic
    assert run.layout.cp * run.layout.dp == 128 and run.seq == 131072
    for seed in range(25):
        for lay in three_d._ratio_cases(seed):
            gpus = 128 * lay["cp"] * lay["dp"]
            cluster = dataclasses.replace(run.cluster, nodes=max(
                run.cluster.nodes, gpus // run.cluster.gpus_per_node))
            layout = dataclasses.replace(run.layout, cp=lay["cp"], dp=lay["dp"],
                                         microbatches=lay["microbatches"], name="")
            new = theory.estimate(theory.MODELS[run.model], layout, cluster,
                                  run.global_batch_tokens, lay["seq"]).traffic
            want = three_d._ratios(lay)
            for d in ("tp", "cp", "pp", "dp"):
                assert new[d] / old[d] == pytest.approx(float(want[d]), rel=1e-12)


def test_ratio_cases_are_drawn_fresh():
    drawn = [three_d._ratio_cases(s) for s in range(30)]
    assert len({str(c[1:]) for c in drawn}) == 30
    for cases in drawn:
        assert cases[0] == dict(cp=32, dp=4, seq=131072, microbatches=32)
        second = cases[1]
        per_replica = 128 * 131072 // second["seq"] // second["dp"]
        assert per_replica > second["microbatches"]  # several sequences each
        assert second["cp"] * second["dp"] != 128


def _ratio_slip(slip):
    """ratios() with one mistake (the check's own _ratios is refused)."""
    def per_gpu(cp, dp, seq, m):
        seqs = 128 * 131072 / seq / dp
        b = 1 if slip == "one sequence a micro-batch" else seqs / m
        tokens = m * b * seq / cp
        kv = m * b * (seq / cp if slip == "local K, V" else seq)
        n = dp if slip == "ZeRO over dp" else dp * cp
        calls = {"RS once": 2, "no AG": m}.get(slip, m + 1)
        return {"tp": tokens, "pp": tokens,
                "cp": kv * (1 if slip == "no ring factor" else (cp - 1) / cp),
                "dp": calls * (n - 1) / n}

    def answer(cp, dp, seq, microbatches):
        new, old = per_gpu(cp, dp, seq, microbatches), per_gpu(16, 8, 131072, 16)
        return {d: new[d] / old[d] for d in new}
    return answer


def _unchanged_tokens(*layout):
    return ratios(*layout) | {"tp": 1.0, "pp": 1.0}


@pytest.mark.parametrize("answer, dim, hint", [
    (_unchanged_tokens, "tp", "a GPU's tokens per step"),
    (_ratio_slip("one sequence a micro-batch"), "tp", "a micro-batch holds b = "),
    (_ratio_slip("local K, V"), "cp", "the K and V of the whole sequence"),
    (_ratio_slip("no ring factor"), "cp", "a ring all-gather over cp ranks sends"),
    (_ratio_slip("ZeRO over dp"), "dp", "ZeRO-2 shards over DP x CP ranks"),
    (_ratio_slip("RS once"), "dp", "after every micro-batch's "
                                                 "backward"),
    (_ratio_slip("no AG"), "dp", "all-gathers the updated weights once"),
    (lambda *a: ratios(*a) | {"pp": "same"}, "pp", "return a number"),
    (lambda *a: ratios(*a) | {"dp": float("nan")}, "dp", "not a number an answer"),
    (lambda *a: {"tp": 1.0}, "keys", "return a dict with the keys"),
    # the old exercise's one right answer, written down
    (lambda *a: {"tp": 1.0, "pp": 1.0, "cp": 2 * (31 / 32) / (15 / 16),
                 "dp": 33 / 17}, "Hint", "Hint:"),
])
def test_ratio_slips_and_written_down_answers_are_named(answer, dim, hint):
    with pytest.raises(ExerciseError, match="my_traffic_ratios") as e:
        check_traffic_ratios(answer)
    assert dim in str(e.value) and hint in str(e.value)


def test_ratios_the_old_zero_argument_function_is_told_so():
    with pytest.raises(ExerciseError, match="raised TypeError"):
        check_traffic_ratios(lambda: {"tp": 1.0, "pp": 1.0, "cp": 2.0, "dp": 2.0})


def test_ratios_the_calculator_is_refused():
    def priced(cp, dp, seq, microbatches):  # section 7's cell, generalised
        run = theory.PUBLISHED_RUNS["llama3-405b-128k"]
        gpus = 128 * cp * dp
        cluster = dataclasses.replace(run.cluster, nodes=max(
            run.cluster.nodes, gpus // run.cluster.gpus_per_node))
        layout = dataclasses.replace(run.layout, cp=cp, dp=dp,
                                     microbatches=microbatches, name="")
        new = theory.estimate(theory.MODELS[run.model], layout, cluster,
                              run.global_batch_tokens, seq).traffic
        old = run.estimate().traffic
        return {d: new[d] / old[d] for d in ("tp", "cp", "pp", "dp")}

    with pytest.raises(ExerciseError, match=r"calls labkit.theory.layout.*labkit's "
                                            r"own layout calculator"):
        check_traffic_ratios(priced)
    with pytest.raises(ExerciseError, match=r"three_d._per_gpu"):
        check_traffic_ratios(lambda *a: {d: float(v) for d, v in three_d._ratios(
            dict(zip(("cp", "dp", "seq", "microbatches"), a))).items()})
