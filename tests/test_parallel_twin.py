"""The logical-scale twin (labkit.parallel.scale_twin) against the closed-form
calculator, for two published layouts: Llama 3 405B 8K (TP 8 x PP 16 x DP 128,
ZeRO-2 FSDP) and Megatron GPT-3 175B (TP 8 x PP 12 x DP 16, plain DP, full
recomputation). Each expected figure is written here in closed form from the
model's shape (labkit.theory.models.MODELS), not read back from the twin."""

import resource
import threading

import pytest
import torch.distributed as dist

from labkit.conventions import GRADIENT, OPTSTATE, PARAMETER
from labkit.parallel.scale_twin import calculator, compare, padded_vocab, twin
from labkit.theory import (
    MODELS,
    PUBLISHED_RUNS,
    busiest_stage_params,
    param_count,
    params_per_device,
    ring_bytes_per_rank,
    stage_layer_counts,
    stage_params,
)

LLAMA3_8K = PUBLISHED_RUNS["llama3-405b"].layout
LLAMA3_LONG_CONTEXT = PUBLISHED_RUNS["llama3-405b-128k"].layout
GPT3_MEGATRON = PUBLISHED_RUNS["gpt3-175b"].layout
DEEPSEEK_V3 = PUBLISHED_RUNS["deepseek-v3"].layout

LLAMA, GPT3 = MODELS["llama3-405b"], MODELS["gpt3-175b"]


def rank_of(pp, dp, tp, layout):
    """The twin's rank order: TP fastest, then PP, then DP (Llama 3's)."""
    return (dp * layout.pp + pp) * layout.tp + tp


def rows(report):
    return {row.item: row for row in compare(report)}


@pytest.fixture(scope="module")
def llama():
    """Stage 0 (embedding), a middle stage, and the last (head)."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = {pp: twin("llama3-405b", rank=rank_of(pp, 0, 0, LLAMA3_8K))
           for pp in (0, 1, 15)}
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    return out, grown


@pytest.fixture(scope="module")
def gpt3():
    return {pp: twin("gpt3-175b", rank=rank_of(pp, 0, 0, GPT3_MEGATRON))
            for pp in (0, 11)}


def llama_layer():
    """One Llama layer's elements on one TP rank: its matrices / 8, its two
    RMSNorms whole."""
    h, head = LLAMA.hidden, LLAMA.hidden // LLAMA.heads
    matrices = h * (h + 2 * LLAMA.kv_heads * head) + h * h + 3 * h * LLAMA.ffn
    return matrices // 8 + 2 * h


def gpt3_layer():
    """One GPT-3 layer on one TP rank: matrices and column biases / 8; the
    row-parallel biases (o, down) and two LayerNorms (weight, bias) whole."""
    h = GPT3.hidden
    return (12 * h * h + 7 * h) // 8 + 2 * h + 4 * h


def test_published_pipeline_splits():
    assert stage_layer_counts(LLAMA, LLAMA3_8K) == [7] + [8] * 14 + [7], \
        "Llama 3: 126 layers over PP 16 with one fewer on the first and last stage"
    assert stage_layer_counts(GPT3, GPT3_MEGATRON) == [8] * 12, \
        "GPT-3: 96 over PP 12"
    assert padded_vocab(50257, 8, 128) == 51200, \
        "Megatron pads 50,257 to a multiple of 128 x TP 8: 51,200"


def test_llama_elements_and_bytes(llama):
    out, _ = llama
    v_rows, h, n = LLAMA.vocab // 8, LLAMA.hidden, 128
    layer = llama_layer()
    expect = {0: 7 * layer + v_rows * h, 1: 8 * layer,
              15: 7 * layer + v_rows * h + h}
    for pp, report in out.items():
        r = rows(report)
        calc_psi = stage_params(LLAMA, LLAMA3_8K, pp)
        # TP keeps each layer's two RMSNorms (and the final one) whole, where
        # the calculator divides them by TP 8: 7/8 of h each
        norms = 2 * report.stage_layers[pp] + (pp == 15)
        assert report.layer_params == layer, (
            f"stage {pp}: one layer's TP-local elements {report.layer_params}, "
            f"closed form {layer}, exact")
        assert report.coords == {"dp": 0, "pp": pp, "tp": 0}, report.coords
        assert report.params == expect[pp], (
            f"stage {pp}: elements {report.params}, closed form {expect[pp]}")
        row = r["elements held before ZeRO"]
        assert row.calculator == calc_psi and row.difference == norms * h * 7 / 8, (
            f"stage {pp}: twin {row.twin} vs calculator {row.calculator} elements; "
            f"allowed: {norms} norms of {h} kept whole by TP, 7/8 of each")
        # FSDP2 chunks the 16,032 vocabulary rows by ceil(16032 / 128) = 126:
        # DP rank 0 holds 126 rows where an exact split is 125.25
        extra = (-(-v_rows // n) - v_rows / n) * h if pp in (0, 15) else 0
        shard = expect[pp] / n + extra
        assert report.padding == pytest.approx(4 * extra, abs=0), (
            f"stage {pp}: padding {report.padding} B, closed form {4 * extra}")
        assert report.held[PARAMETER] == 2 * expect[pp], (
            f"stage {pp}: bf16 copy kept after forward (ZeRO-2) "
            f"{report.held[PARAMETER]}, expected 2 B x {expect[pp]}")
        assert report.held[GRADIENT] == 4 * shard, (
            f"stage {pp}: fp32 gradient shard {report.held[GRADIENT]} vs 4 x {shard}")
        assert r[GRADIENT + " bytes"].difference == pytest.approx(
            4 * shard - 2 * calc_psi / n, abs=1e-6), "gradient: 4-byte shard vs 2"
        assert report.held[OPTSTATE] == 12 * shard, (
            f"stage {pp}: master + exp_avg + exp_avg_sq {report.held[OPTSTATE]} "
            f"vs 12 x {shard}")
        assert r[OPTSTATE + " bytes"].difference == pytest.approx(
            12 * (shard - calc_psi / n), abs=1e-6), "optstate differs by K x shard"


def test_llama_collectives(llama):
    out, _ = llama
    h, s, n, t = LLAMA.hidden, 8192, 128, 8
    act = s * h * 2  # one micro-batch of one 8192-token sequence, bf16
    ar = ring_bytes_per_rank("all_reduce", act, t)
    for pp, report in out.items():
        r = rows(report)
        layers = report.stage_layers[pp]
        one = r["DP all_gather of one layer, ring bytes sent"]
        assert one.difference == 0 and one.twin == (n - 1) / n * 2 * llama_layer(), (
            f"stage {pp}: one layer's DP all-gather {one.twin} vs calculator "
            f"{one.calculator}, exact")
        tp_one = r["TP ring bytes of one layer per micro-batch"]
        assert tp_one.twin == tp_one.calculator == 4 * ar, (
            f"stage {pp}: TP per layer {tp_one.twin} vs {tp_one.calculator}, "
            f"4 all-reduces = {4 * ar}")
        ends = 1 if pp in (0, 15) else 0  # embedding forward / head backward
        tp = r["TP ring bytes per micro-batch"]
        assert tp.twin == (4 * layers + ends) * ar and (
            tp.calculator == 4 * layers * ar), (
            f"stage {pp}: TP {tp.twin}, closed form {(4 * layers + ends) * ar}; "
            f"calculator {tp.calculator}: 4 all-reduces x {layers} layers; the "
            "embedding's and the head's all-reduce it leaves out")
        held = report.params + (report.padding / 4) * n
        rs = r["DP reduce_scatter per micro-batch, ring bytes sent"]
        assert rs.twin == pytest.approx((n - 1) / n * 4 * held, rel=1e-12), (
            f"stage {pp}: fp32 reduce-scatter {rs.twin} vs (N-1)/N x 4 x {held}")
        assert rs.calculator == pytest.approx(
            (n - 1) / n * 2 * stage_params(LLAMA, LLAMA3_8K, pp), rel=1e-12), (
            "the calculator's reduce-scatter of the stage's 2-byte gradients")
        pipe = r["PP bytes sent per micro-batch"]
        sends = 1 if pp in (0, 15) else 2
        assert pipe.twin == sends * act and pipe.calculator == 2 * act / t * 2, (
            f"stage {pp}: PP {pipe.twin} vs {sends} x {act}; calculator "
            f"{pipe.calculator} = 2 x act / TP x interleave 2")


def test_the_calculator_charges_the_busiest_stage(llama):
    """The calculator charged every device P / (TP x PP), the average; the
    busiest Llama stage (8 layers; the end stages hold 7 and the embedding or
    the head) holds 17.2M more. It now charges the busiest stage, which the
    twin matches but for the norms TP keeps whole."""
    out, _ = llama
    busiest = max(report.params for report in out.values())
    average = params_per_device(LLAMA, LLAMA3_8K)[0]
    assert average == param_count(LLAMA) / 128
    assert busiest == 8 * llama_layer() and busiest - average == 17_203_584, (
        f"busiest stage {busiest} elements vs the average {average}")
    calc = busiest_stage_params(LLAMA, LLAMA3_8K)
    h = LLAMA.hidden
    assert busiest - calc == 8 * 2 * h * 7 / 8, (
        f"busiest stage: twin {busiest} vs calculator {calc} elements; allowed "
        "16 RMSNorms kept whole by TP")
    est = calculator(out[1])
    assert est.memory["Parameter"] == 2 * calc, (
        f"the Estimate's weights {est.memory['Parameter']} vs 2 x {calc}")


def test_gpt3(gpt3):
    h, n, t = GPT3.hidden, 16, 8
    vocab_rows = padded_vocab(GPT3.vocab, t, 128) // t
    layer = gpt3_layer()
    expect = {0: 8 * layer + vocab_rows * h + GPT3.learned_positions * h,
              11: 8 * layer + vocab_rows * h + 2 * h}  # tied head copy, final LN
    act = 2048 * h * 2
    ar = ring_bytes_per_rank("all_reduce", act, t)
    for pp, report in gpt3.items():
        r = rows(report)
        calc_psi = stage_params(GPT3, GPT3_MEGATRON, pp)
        assert report.params == expect[pp], (
            f"GPT-3 stage {pp}: {report.params} elements vs {expect[pp]}")
        # kept whole by TP where the calculator divides by 8: per layer two
        # LayerNorms (2h each) and two row biases (h each); the position
        # table (stage 0) or the final LayerNorm (the last); plus Megatron's
        # vocabulary padding, 943 rows / 8
        whole = 8 * 6 * h + (GPT3.learned_positions * h if pp == 0 else 2 * h)
        pad = (padded_vocab(GPT3.vocab, t, 128) - GPT3.vocab) * h / t
        row = r["elements held before ZeRO"]
        assert row.difference == pytest.approx(whole * 7 / 8 + pad, abs=1e-3), (
            f"GPT-3 stage {pp}: twin {row.twin} vs calculator {row.calculator}; "
            f"allowed 7/8 of {whole} kept whole + {pad} padding rows' elements")
        assert report.held == {PARAMETER: 2 * expect[pp], GRADIENT: 4 * expect[pp],
                               OPTSTATE: 12 * expect[pp]}, (
            f"GPT-3 stage {pp}: held {report.held}; replicate() keeps a bf16 "
            f"copy, fp32 gradients and fp32 master + Adam of {expect[pp]}")
        assert r[GRADIENT + " bytes"].difference == 4 * expect[pp] - 2 * calc_psi
        dp = r["DP all_reduce per micro-batch, ring bytes sent"]
        assert dp.twin == pytest.approx(2 * (n - 1) / n * 2 * expect[pp], rel=1e-12)
        assert dp.difference == pytest.approx(
            2 * (n - 1) / n * 2 * (expect[pp] - calc_psi), rel=1e-9), "DP diff"
        tp_one = r["TP ring bytes of one layer per micro-batch"]
        assert tp_one.twin == 5 * ar and tp_one.calculator == 6 * ar, (
            f"GPT-3 stage {pp}: TP per layer {tp_one.twin} (5 all-reduces: "
            f"checkpoint recomputes 1) vs calculator {tp_one.calculator} (6)")
        assert r["TP ring bytes per micro-batch"].twin == (8 * 5 + 1) * ar


def test_no_real_memory_and_cleanup(llama):
    _, grown = llama
    one_layer_fp32 = 4 * llama_layer()  # 1.6 GB, were one layer real
    assert grown < one_layer_fp32 / 4, (
        f"peak RSS grew {grown / 1e6:.0f} MB over three stages; one real layer "
        f"would be {one_layer_fp32 / 1e6:.0f} MB; allowed a quarter of that")
    assert not dist.is_initialized(), "twin() left a process group behind"


def test_refusals():
    with pytest.raises(ValueError, match="run must be one of"):
        twin("gpt-5")
    with pytest.raises(ValueError, match="CP 16"):
        twin("llama3-405b", LLAMA3_LONG_CONTEXT)
    with pytest.raises(ValueError, match="ZeRO 1"):
        twin("llama3-405b", DEEPSEEK_V3)
    with pytest.raises(ValueError, match="world_size 8192 does not match"):
        twin("llama3-405b", world_size=8192)
    with pytest.raises(ValueError, match="rank must be in"):
        twin("llama3-405b", rank=LLAMA3_8K.gpus)
    with pytest.raises(TypeError, match="rank must be an int"):
        twin("llama3-405b", rank=1.0)
    with pytest.raises(TypeError, match="layout must be a Layout"):
        twin("llama3-405b", "TP8")


def test_refuses_existing_group_and_concurrent_use():
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(RuntimeError, match="exists already"):
            twin("gpt3-175b")
    finally:
        dist.destroy_process_group()
    errors, done = [], []

    def one():  # the last rank: DP rank 15, stage 11, TP rank 7
        try:
            done.append(twin("gpt3-175b", rank=GPT3_MEGATRON.gpus - 1))
        except RuntimeError as e:
            errors.append(str(e))

    threads = [threading.Thread(target=one) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(done) == 1 and len(errors) == 1 and (
        "one at a time" in errors[0] or "exists already" in errors[0]), (
        f"two concurrent twins: {len(done)} finished, errors {errors}; "
        "expected one finished and one refused")
