"""labkit.theory.layout: published layouts through the calculator, and the chooser."""

import dataclasses

import pytest

from labkit import theory
from labkit.theory.layout import (
    DEEPSEEK_V3_CLUSTER,
    H100_NODE,
    LLAMA3_CLUSTER,
    PUBLISHED_RUNS,
    WASTEFUL_MFU,
    Layout,
    choose,
    estimate,
    explain,
    find,
    flops_per_token,
    group_nodes,
    params_per_device,
    scale,
)

M = theory.MODELS


@pytest.fixture(scope="module")
def ranked():
    return {k: r.choose() for k, r in PUBLISHED_RUNS.items()}


def test_layout_gpus_and_str():
    lay = Layout(tp=8, pp=16, cp=16, dp=8)
    assert lay.gpus == 16384
    assert str(lay) == "TP 8 · PP 16 · CP 16 · DP 8"
    ds = PUBLISHED_RUNS["deepseek-v3"].layout
    assert ds.gpus == 2048 == PUBLISHED_RUNS["deepseek-v3"].cluster.gpus
    assert str(ds) == "TP 1 · PP 16 · EP 64 · DP 128 (ZeRO-1)"
    assert PUBLISHED_RUNS["llama3-405b"].layout.gpus == 16384 == LLAMA3_CLUSTER.gpus


@pytest.mark.parametrize("key", list(PUBLISHED_RUNS))
def test_published_layout_fits_and_is_ranked(key, ranked):
    run = PUBLISHED_RUNS[key]
    est = run.estimate()
    assert est.fits, (key, est.memory_total)
    assert est.layout.gpus == run.cluster.gpus
    mine = find(ranked[key], run.layout)
    assert mine is not None and mine.estimate.step_time == est.step_time
    text = explain(ranked[key], run.layout)
    assert f"ranks {mine.rank} of {len(ranked[key])}" in text
    if mine.rank > 1:  # it must say which it prefers, and why
        assert f"prefers {ranked[key][0].layout}" in text and "spends more on" in text
        best = ranked[key][0].layout
        if best.schedule != run.layout.schedule:  # and whether the schedule differs
            same = [r for r in ranked[key] if r.layout.schedule == run.layout.schedule]
            assert (f"among the {len(same)} layouts on the published schedule "
                    f"({run.layout.schedule}) the published one ranks "
                    f"{same.index(mine) + 1}") in text
        if best.recompute != run.layout.recompute:
            assert f"uses {run.layout.recompute} recomputation" in text
    tie = "a tie at this calculator's precision" in text
    assert tie == (mine.rank > 1 and mine.step_time <= 1.02 * ranked[key][0].step_time)
    times = [r.step_time for r in ranked[key]]
    assert times == sorted(times)
    assert all(r.estimate.fits for r in ranked[key])


def test_llama3_weights_per_gpu():
    # 405.9e9 bf16 weights = 812 GB over TP 8 x PP 16 = 128 ways: 6.34 GB per
    # GPU on average; the busiest stage holds 8 of the 126 layers (the end
    # stages 7, with the embedding or the head): 8/126 of the layers, over TP 8
    est = PUBLISHED_RUNS["llama3-405b"].estimate()
    m = theory.MODELS["llama3-405b"]
    psi = theory.param_count("llama3-405b")
    assert 2 * psi / 128 / 1e9 == pytest.approx(6.34, abs=0.01)
    layers = psi - 2 * m.vocab * m.hidden - m.hidden  # no embedding, head, norm
    busiest = 8 * layers / 126 / 8
    assert est.memory["Parameter"] == pytest.approx(2 * busiest, rel=1e-12), (
        f"bf16 weights of the busiest stage {est.memory['Parameter']:.6g} B, "
        f"closed form 2 x {busiest:.6g}")
    assert est.memory["Parameter"] / 1e9 == pytest.approx(6.38, abs=0.01)
    psi = 128 * busiest  # ZeRO shards the busiest stage's parameters
    # ZeRO-2 over DP 128: gradients and the 12-byte optimizer state are sharded
    assert est.memory["Gradient"] == pytest.approx(2 * psi / 128 / 128)
    assert est.memory["Optstate"] == pytest.approx(12 * psi / 128 / 128)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_pure_data_parallel_is_zero_paper(stage):
    # plain ZeRO over 64 ranks: model states match theory.zero_memory exactly
    cl = H100_NODE.__class__(80e9, 8, 8, 450e9, 50e9, 989e12)
    est = estimate(M["llama3-8b"], Layout(dp=64, zero=stage, microbatches=1), cl,
                   64 * 8192, 8192)
    psi = theory.param_count("llama3-8b")
    model_state = sum(v for k, v in est.memory.items() if k != "Activation")
    assert model_state == pytest.approx(theory.zero_memory(psi, 64, stage))
    assert est.traffic["dp"] == pytest.approx(
        sum(theory.zero_traffic(psi, 64, stage).values()))
    assert est.traffic["tp"] == est.traffic["pp"] == 0


def test_llama3_traffic_and_compute():
    run = PUBLISHED_RUNS["llama3-405b"]
    c, est = M["llama3-405b"], run.estimate()
    # TP: 4 all-reduces per layer, 8 layers per stage (ceil(126 / 16)), 16
    # micro-batches of one 8192-token sequence
    lt = theory.layer_traffic(1, 8192, c.hidden, 8)
    assert est.traffic["tp"] == pytest.approx(lt.bytes_per_rank * 8 * 16)
    # PP: one activation forward and one gradient back per micro-batch and chunk,
    # scattered over TP 8 (v = 2 chunks per stage)
    assert est.traffic["pp"] == pytest.approx(2 * 16 * 8192 * c.hidden * 2 / 8 * 2)
    assert est.traffic["cp"] == est.traffic["ep"] == 0
    # compute: 6N + attention FLOPs per token, 16M tokens over 16,384 GPUs at the
    # GEMM efficiency of 989 TFLOPS (no recomputation): every product of a layer
    # on 8192 tokens with TP 8 is compute-bound (see test_theory_layout_time.py)
    want = flops_per_token(c, 8192) * 2048 * 8192 / 16384 / (989e12 * 794.5 / 989)
    assert est.time["compute"] == pytest.approx(want)
    assert est.gemm_slowdown == pytest.approx(989 / 794.5)
    # interleaved 1F1B, v = 2: bubble (p-1)/(v m) = 15/32 of the busy time
    busy = sum(v for k, v in est.time.items() if k not in ("bubble", "dp"))
    assert est.time["bubble"] == pytest.approx(15 / 32 * busy)


def test_full_recompute_costs_a_forward():
    run = PUBLISHED_RUNS["llama3-405b"]
    c = M["llama3-405b"]
    sel = run.estimate()
    full = estimate(c, dataclasses.replace(run.layout, recompute="full"), run.cluster,
                    run.global_batch_tokens, run.seq)
    assert full.time["compute"] == pytest.approx(4 / 3 * sel.time["compute"])
    assert full.traffic["tp"] == pytest.approx(1.5 * sel.traffic["tp"])
    # only each layer's input is kept: 2sbh/t per layer instead of 32sbh/t
    assert full.memory["Activation"] == pytest.approx(
        sel.memory["Activation"] * 2 / 32)


def test_dualpipe_hides_ep_and_keeps_two_copies():
    run = PUBLISHED_RUNS["deepseek-v3"]
    c, dual = M["deepseek-v3"], run.estimate()
    plain = estimate(c, dataclasses.replace(run.layout, dualpipe=False), run.cluster,
                     run.global_batch_tokens, run.seq)
    # DualPipe overlaps EP and PP with compute: only what exceeds compute shows.
    # DeepSeek-V3's EP and PP fit inside its compute: "both all-to-all and PP
    # communication can be fully hidden" (sec. 3.2.1), and so they are here
    left = plain.time["ep"] + plain.time["pp"] - dual.time["compute"]
    assert left < 0 and dual.time["ep"] == dual.time["pp"] == 0, (
        f"EP + PP exceed compute by {left:.3f} s; DualPipe hides them fully")
    # bytes over the network, plus α: 4 all-to-alls per MoE layer (ceil(58 / 16) =
    # 4 per stage) per micro-batch (120), each one α across nodes (its sends go
    # at once), 14 us
    alpha = 4 * 4 * 120 * 14e-6
    assert plain.time["ep"] == pytest.approx(plain.traffic["ep"] / 50e9 + alpha)
    # node-limited routing: one copy of each token to each of its 4 nodes, not 8
    # copies, 7 in 8 of them another of the group's 8 nodes: 3.5 cross the network
    # (dispatch and combine, forward and backward; 4096 tokens x 7168 x bf16)
    assert plain.traffic["ep"] == pytest.approx(
        2 * 2 * 4 * 7 / 8 * 4096 * 7168 * 2 * 4 * 120)
    # two mirrored stages per device, each the average (ZeRO-1 keeps bf16
    # weights whole): 2 copies x 2 bytes x (dense + routed experts) per stage
    per_stage = sum(params_per_device(c, run.layout))
    assert dual.memory["Parameter"] == pytest.approx(2 * 2 * per_stage), (
        f"DualPipe weights {dual.memory['Parameter']:.6g} B, closed form "
        f"2 x 2 x {per_stage:.6g}")
    assert dual.step_time < plain.step_time


def test_reasons_name_the_published_placement():
    llama = PUBLISHED_RUNS["llama3-405b"].estimate().reasons
    assert any(s.startswith("TP 8 stays inside a node") for s in llama)
    assert any(s.startswith("PP 16 runs across nodes") for s in llama)
    assert any("DP 128 is outermost" in s for s in llama)
    est = PUBLISHED_RUNS["llama3-405b"].estimate()
    assert any(s.startswith("its matrix products run at 80% of the 989 TFLOPS") and
               s.endswith(f"the step reaches {est.mfu:.0%} MFU") for s in llama)
    gpt3 = PUBLISHED_RUNS["gpt3-175b"].estimate().reasons  # full recomputation: 6
    assert any(s.startswith("TP 8 (no sequence parallelism) stays inside a node: "
                            "its 6 all-reduces")
               for s in gpt3)
    ds = PUBLISHED_RUNS["deepseek-v3"].estimate()
    assert ds.traffic["tp"] == 0 and ds.traffic["ep"] > 0
    assert not any(s.startswith("TP") for s in ds.reasons)
    assert any(s.startswith("EP 64 spans 8 nodes") for s in ds.reasons)
    assert any("ZeRO-1 DP 128 is outermost" in s for s in ds.reasons)


def test_llama3_long_context_splits_the_sequence_across_nodes():
    run = PUBLISHED_RUNS["llama3-405b-128k"]
    est, short = run.estimate(), PUBLISHED_RUNS["llama3-405b"].estimate()
    assert str(run.layout) == "TP 8 · PP 16 · CP 16 · DP 8 (ZeRO-2)"
    # 131,072 / CP 16 = 8192 tokens per rank: the 8K stage's activations per GPU
    assert est.memory == pytest.approx(short.memory)
    # CP all-gathers K and V (8 KV heads x 128 x 2, /TP) of the whole sequence
    # forward and reduce-scatters their gradients backward, per layer and
    # micro-batch: 2 x 15/16 x 131072 x 2048 / 8 x 2 bytes x 8 layers x 16
    assert est.traffic["cp"] == pytest.approx(
        2 * 15 / 16 * 131072 * 2048 / 8 * 2 * 8 * 16)
    assert not est.in_node["cp"]
    assert any(s.startswith("CP 16 splits each sequence across nodes")
               for s in est.reasons)


def test_inter_node_tp_only_when_asked():
    cl = H100_NODE.__class__(80e9, 8, 4, 450e9, 50e9, 989e12)
    inside = choose("llama3-8b", cl, 256 * 8192, 8192)
    assert inside and max(r.layout.tp for r in inside) <= 8
    wide = choose("llama3-8b", cl, 256 * 8192, 8192, inter_node_tp=True)
    spanning = [r for r in wide if r.layout.tp == 16]
    assert spanning and not spanning[0].estimate.in_node["tp"]
    assert any("TP 16 spans nodes" in s for s in spanning[0].reasons)


@pytest.mark.parametrize("layout, message", [
    (Layout(tp=8, pp=16, dp=256, microbatches=8), "needs 32768 GPUs"),
    (Layout(tp=3, pp=16, dp=8, microbatches=16), "TP 3 does not divide the 128"),
    (Layout(pp=127, dp=1, microbatches=127), "PP 127 is more stages"),
    (Layout(tp=8, pp=16, dp=128, ep=2, microbatches=16), "has no experts"),
    (Layout(tp=8, pp=16, dp=96, microbatches=1), "do not split over DP 96"),
])
def test_impossible_layouts_raise(layout, message):
    with pytest.raises(ValueError, match=message):
        estimate(M["llama3-405b"], layout, LLAMA3_CLUSTER, 2048 * 8192, 8192)


def test_bad_layout_fields_raise():
    with pytest.raises(ValueError, match="EP 64 must divide DP 32"):
        Layout(pp=16, dp=32, ep=64)
    with pytest.raises(ValueError, match="DualPipe needs an even PP"):
        Layout(pp=3, dualpipe=True)
    with pytest.raises(ValueError, match="zero must be"):
        Layout(zero=4)
    with pytest.raises(ValueError, match="more than the cluster"):
        choose("llama3-8b", H100_NODE, 8 * 8192, 8192, max_gpus=16)


def test_scale_says_how_many_gpus_a_model_can_use_well():
    seq = M["gpt2-small"].seq
    small = scale("gpt2-small", LLAMA3_CLUSTER, 1024 * seq, seq)
    # 124M parameters x 16 B of model states fit one 80 GB GPU; on all 16,384
    # the fastest layout keeps them busy well under WASTEFUL_MFU
    assert small.fewest == 1 and small.at_fewest.layout.gpus == 1
    assert small.wasteful and small.best.estimate.mfu < WASTEFUL_MFU
    assert small.at_suggested.estimate.mfu >= WASTEFUL_MFU
    assert small.at_suggested.layout.gpus == small.suggested < 16_384
    assert small.advice().startswith("GPT-2 small fits on as few as 1 GPU (")
    run = PUBLISHED_RUNS["llama3-405b"]
    big = scale(run.model, run.cluster, run.global_batch_tokens, run.seq)
    assert not big.wasteful and big.suggested is None
    assert 16 <= big.fewest < 16_384  # 405.9e9 x 16 B needs many 80 GB GPUs


def test_dualpipe_leaves_a_dense_model_no_all_to_all_time():
    # what DualPipe cannot hide of the PP sends stays PP's: a model without
    # experts has no EP all-to-alls to charge (the chart would show a false EP)
    seq = M["gpt2-small"].seq
    ranked = choose("gpt2-small", DEEPSEEK_V3_CLUSTER, 1024 * seq, seq)
    duals = [r for r in ranked if r.layout.dualpipe]
    assert duals and all(r.estimate.time["ep"] == 0 for r in duals)
    assert any(r.estimate.time["pp"] > 0 for r in duals)
    run = PUBLISHED_RUNS["deepseek-v3"]  # MoE: all-to-all time, where not hidden
    e = estimate(M["deepseek-v3"], dataclasses.replace(run.layout, dualpipe=False),
                 run.cluster, run.global_batch_tokens, run.seq)
    assert e.time["ep"] > e.time["pp"] > 0


def test_gpt3_2021_has_no_sequence_parallelism():
    # Megatron-LM's 2021 run predates sequence parallelism (Korthikanti et al.
    # 2022): full recomputation keeps each layer's input whole, 2 s b h bytes,
    # not split over TP 8; the bytes sent are the same either way
    run = PUBLISHED_RUNS["gpt3-175b"]
    assert not run.layout.sequence_parallel
    c, est = M[run.model], run.estimate()
    with_sp = estimate(c, dataclasses.replace(run.layout, sequence_parallel=True),
                       run.cluster, run.global_batch_tokens, run.seq)
    held = 12 * 8  # min(p, m) micro-batches x 96 / 12 layers on a stage
    assert est.memory["Activation"] == pytest.approx(2 * 2048 * c.hidden * held)
    assert with_sp.memory["Activation"] == pytest.approx(
        est.memory["Activation"] / 8)
    assert with_sp.traffic == est.traffic and with_sp.step_time == est.step_time
    assert any("no sequence parallelism" in r for r in est.reasons)
    ranked = run.choose()
    assert all(not r.layout.sequence_parallel for r in ranked)


def test_folded_expert_layout_fields():
    """MoE parallel folding: the experts' own split, refused where it cannot be."""
    folded = Layout(tp=4, pp=16, dp=32, ep=64, expert_tp=1)
    assert (folded.etp, folded.folded, folded.expert_replicas) == (1, True, 2)
    assert str(folded) == "TP 4 · PP 16 · EP 64 (expert TP 1) · DP 32"
    classic = Layout(tp=4, pp=16, dp=32, ep=32)
    assert (classic.etp, classic.folded, classic.expert_replicas) == (4, False, 1)
    with pytest.raises(ValueError, match="expert TP 3 must divide TP 4"):
        Layout(tp=4, dp=32, ep=8, expert_tp=3)
    with pytest.raises(ValueError, match="expert TP 1 x EP 256 must divide TP 4"):
        Layout(tp=4, dp=32, ep=256, expert_tp=1)


def test_folded_layout_holds_deepseek_v3_prefill_unit():
    """DeepSeek-V3's prefilling unit (DeepSeek-AI 2024, sec. 3.4.1): 4 nodes of 8
    GPUs, attention TP 4 with DP 8, the MoE part EP 32: each GPU hosts 8 routed
    experts of a layer ("besides the original 8 experts it hosts"), whole (no TP),
    and an EP group spans the unit's 4 nodes while attention's TP stays in one."""
    ds = M["deepseek-v3"]
    unit = Layout(tp=4, dp=8, ep=32, expert_tp=1)
    experts_per_gpu = ds.experts // unit.ep
    assert experts_per_gpu == 8
    per_expert = 3 * ds.hidden * ds.expert_ffn * (ds.layers - ds.dense_layers)
    dense, experts = params_per_device(ds, unit)
    assert experts == experts_per_gpu * per_expert, (experts, per_expert)
    nodes = group_nodes(unit, 8)
    assert (nodes["ep"], nodes["tp"], nodes["dp_expert"]) == (4, 1, 1), nodes
    # the same degrees unfolded split each expert over TP 4 and need 4 x EP
    assert params_per_device(
        ds, Layout(tp=4, dp=8, ep=8))[1] == experts


def test_folded_equals_classic_where_expert_tp_is_tp():
    run = PUBLISHED_RUNS["deepseek-v3"]
    same = dataclasses.replace(run.layout, expert_tp=run.layout.tp)
    ours, theirs = run.estimate(), estimate(M["deepseek-v3"], same, run.cluster,
                                            run.global_batch_tokens, run.seq)
    assert not same.folded and ours.time == theirs.time
    assert ours.memory == theirs.memory and ours.traffic == theirs.traffic


def test_folding_deepseek_v3_under_tp_4_keeps_its_expert_traffic():
    """Attention TP 4, the experts folded into EP 64 without TP: per GPU the same
    experts and EP bytes as the published TP 1 layout (each GPU dispatches its
    sequence-parallel quarter of the tokens, 4 x the micro-batches) and an EP
    group on the same 8 nodes."""
    run = PUBLISHED_RUNS["deepseek-v3"]
    mb = 4 * run.layout.microbatches
    folded = dataclasses.replace(run.layout, tp=4, dp=32, microbatches=mb,
                                 expert_tp=1)
    ds = M["deepseek-v3"]
    est = estimate(ds, folded, run.cluster, run.global_batch_tokens, run.seq)
    published = run.estimate()
    assert est.traffic["ep"] == pytest.approx(published.traffic["ep"], rel=1e-12)
    assert params_per_device(ds, folded)[1] == params_per_device(ds, run.layout)[1]
    assert group_nodes(folded, 8)["ep"] == 8
