"""labkit.theory: each closed form against a published number."""

import pytest

from labkit import theory


def test_bus_factors_match_nccl_tests_performance_doc():
    # nccl-tests doc/PERFORMANCE.md: all-reduce busbw = algbw * 2(n-1)/n, ...
    assert theory.bus_factor("all_reduce", 8) == 1.75
    assert theory.bus_factor("all_gather", 8) == 0.875
    assert theory.bus_factor("reduce_scatter", 8) == 0.875
    assert theory.bus_factor("all_to_all", 8) == 0.875
    assert theory.bus_factor("broadcast", 8) == theory.bus_factor("reduce", 8) == 1.0


def test_ring_all_reduce_bytes_patarasuk_yuan():
    # Patarasuk & Yuan 2009: the ring sends 2(p-1)/p * n per process; p = 4 -> 1.5n
    assert theory.ring_bytes_per_rank("all_reduce", 1.0, 4) == 1.5
    assert theory.ring_bytes_per_rank("all_reduce", 1.0, 1) == 0.0
    assert theory.ring_bytes_per_rank("all_reduce", 1.0, 1024) < 2


def test_ring_steps_thakur_et_al():
    # Thakur, Rabenseifner & Gropp 2005: ring allgather takes p-1 steps
    assert theory.latency_steps("all_gather", 16) == 15
    assert theory.latency_steps("all_reduce", 16) == 30


def test_alpha_beta_model_and_fit_recovers_its_parameters():
    t = theory.alpha_beta_time("all_reduce", 1e9, 8, alpha=5e-6, beta=50e9)
    assert t == pytest.approx(14 * 5e-6 + 1.75e9 / 50e9)
    sizes = [2**k for k in range(10, 27, 2)]
    truth = theory.AlphaBeta("all_reduce", 4, 2e-3, 3e8)
    fit = theory.fit_alpha_beta("all_reduce", 4, sizes, [truth.time(s) for s in sizes])
    assert fit.alpha == pytest.approx(2e-3) and fit.beta == pytest.approx(3e8)
    assert fit.time(1 << 20) == pytest.approx(truth.time(1 << 20))


@pytest.mark.parametrize("call", [
    lambda: theory.bus_factor("allreduce", 4),
    lambda: theory.bus_factor("all_reduce", 0),
    lambda: theory.ring_bytes_per_rank("all_reduce", -1, 4),
    lambda: theory.alpha_beta_time("all_reduce", 1, 4, alpha=-1, beta=1),
    lambda: theory.fit_alpha_beta("all_reduce", 4, [1], [1]),
    lambda: theory.fit_alpha_beta("all_reduce", 4, [8, 8], [1, 2]),
])
def test_bad_input_is_a_value_error(call):
    with pytest.raises(ValueError):
        call()


# ---------------------------------------------------------------- model states


def test_bytes_per_param_zero_paper_and_megatron_table():
    # ZeRO paper sec. 3.1: mixed-precision Adam, 2 + 2 + 12 = 16 bytes per parameter
    mixed = theory.bytes_per_param("adam", "mixed")
    assert (mixed.params, mixed.grads, mixed.optimizer, mixed.total) == (2, 2, 12, 16)
    # Megatron-LM README, distributed optimizer table (non-distributed column):
    assert theory.bytes_per_param("adam", "mixed", fp32_grad_accum=True).total == 20
    assert theory.bytes_per_param("adam", "fp32").total == 16
    assert theory.bytes_per_param("sgd", "fp32").total == 8
    assert theory.bytes_per_param("sgd-momentum", "mixed").total == 12
    with pytest.raises(ValueError):
        theory.bytes_per_param("lamb")
    with pytest.raises(ValueError):
        theory.bytes_per_param("adam", "fp8")


def test_zero_paper_7_5b_on_64_gpus():
    # ZeRO paper, fig. 1: Ψ = 7.5B, N = 64, K = 12 -> 120, 31.4, 16.6, 1.9 GB
    got = [theory.zero_memory(7.5e9, 64, s) / 1e9 for s in range(4)]
    assert [round(g, 1) for g in got] == [120.0, 31.4, 16.6, 1.9]


def test_zero_matches_megatron_distributed_optimizer_column():
    # Megatron-LM README: distributed optimizer, d = data-parallel size
    d = 16
    fp16 = theory.zero_memory(1, d, 1, k=16)  # fp16 params + grads, fp32 main grads
    bf16 = theory.zero_memory(1, d, 1, k=12, grad_bytes=4)  # bf16 params, fp32 grads
    fp32 = theory.zero_memory(1, d, 1, k=8, param_bytes=4, grad_bytes=4)
    assert fp16 == pytest.approx(4 + 16 / d)
    assert bf16 == pytest.approx(6 + 12 / d)
    assert fp32 == pytest.approx(8 + 8 / d)


def test_zero_traffic_is_2_psi_then_3_psi():
    n, psi = 64, 1e9
    dp = sum(theory.zero_traffic(psi, n, 0, elem_bytes=1).values())
    for stage in (1, 2):
        assert sum(theory.zero_traffic(psi, n, stage, elem_bytes=1).values()) == \
            pytest.approx(dp)
    z3 = sum(theory.zero_traffic(psi, n, 3, elem_bytes=1).values())
    assert dp == pytest.approx(2 * (n - 1) / n * psi)
    assert z3 / dp == pytest.approx(1.5)  # ZeRO paper sec. 7.3: 1.5x


@pytest.mark.parametrize("call", [
    lambda: theory.zero_memory(-1, 8, 1),
    lambda: theory.zero_memory(1e9, 0, 1),
    lambda: theory.zero_memory(1e9, 8, 4),
    lambda: theory.zero_traffic(1e9, 8, -1),
])
def test_zero_bad_input(call):
    with pytest.raises(ValueError):
        call()


# ------------------------------------------------------------------ activations

PAPER_MODELS = {  # Korthikanti et al. 2022, table 3: (heads, hidden), s = 2048, t = 8
    "22B": (48, 6144), "175B": (96, 12288), "530B": (128, 20480), "1T": (160, 25600),
}


@pytest.mark.parametrize("name", list(PAPER_MODELS))
def test_sequence_parallel_plus_selective_saves_about_5x(name):
    # the paper's abstract: together they "reduce activation memory by 5x"
    a, h = PAPER_MODELS[name]
    base = theory.activation_memory(2048, 1, h, a, tp=8)
    both = theory.activation_memory(2048, 1, h, a, tp=8, sp=True, recompute="selective")
    assert 4.5 <= base / both <= 5.5


def test_activation_formulas_by_hand():
    s, b, h, a = 2048, 1, 12288, 96
    sbh = s * b * h
    assert 5 * a * s / h == 80  # GPT-3's attention term
    assert theory.activation_memory(s, b, h, a) == sbh * (34 + 80)
    assert theory.activation_memory(s, b, h, a, tp=8) == sbh * (10 + 24 / 8 + 80 / 8)
    assert theory.activation_memory(s, b, h, a, tp=8, sp=True) == sbh / 8 * (34 + 80)
    assert theory.activation_memory(s, b, h, a, recompute="selective") == 34 * sbh
    assert theory.activation_memory(s, b, h, a, recompute="full") == 2 * sbh
    assert theory.activation_memory(s, b, h, a, attention_scores=False) == 34 * sbh
    assert theory.activation_memory(s, b, h, a, tp=8, sp=True, recompute="full") == \
        2 * sbh / 8


@pytest.mark.parametrize("kw", [
    {"seq": 0}, {"heads": 7}, {"tp": 3}, {"recompute": "some"},
    {"tp": 8, "sp": True, "seq": 100},
])
def test_activation_bad_input(kw):
    args = {"seq": 2048, "batch": 1, "hidden": 4096, "heads": 32} | kw
    with pytest.raises(ValueError):
        theory.activation_memory(**args)


# -------------------------------------------------------------------- pipelines


def test_pipeline_bubble():
    # GPipe (Huang et al. 2019): (p-1)/(m+p-1); Megatron (Narayanan et al. 2021):
    # (p-1)/m relative to ideal, divided by v with the interleaved schedule
    b = theory.pipeline_bubble(4, 8)
    assert b.of_total == pytest.approx(3 / 11) and b.of_ideal == pytest.approx(3 / 8)
    assert theory.pipeline_bubble(4, 8, v=2).of_ideal == pytest.approx(3 / 16)
    assert theory.pipeline_bubble(1, 8).of_total == 0
    assert theory.activations_in_flight("gpipe", 4, 16) == 16
    assert theory.activations_in_flight("1f1b", 4, 16) == 4
    with pytest.raises(ValueError):
        theory.pipeline_bubble(0, 8)
    with pytest.raises(ValueError):
        theory.activations_in_flight("zb", 4, 8)


# ----------------------------------------------------------------------- models


@pytest.mark.parametrize("key", list(theory.MODELS))
def test_parameter_counts_reproduce_published_totals(key):
    n = theory.param_count(key)
    assert abs(n / theory.PUBLISHED_PARAMS[key] - 1) < 0.01, n


def test_exact_counts_where_published_to_the_parameter():
    assert theory.param_count("gpt2-small") == 124_439_808  # HF "gpt2"
    assert theory.param_count("llama3-8b") == 8_030_261_248  # HF Meta-Llama-3-8B
    assert theory.param_count("llama3-70b") == 70_553_706_496


def test_deepseek_v3_active_parameters():
    # "671B total parameters with 37B activated for each token"; our count includes
    # the input embedding and output head among the active ones (1.9B)
    active = theory.param_count("deepseek-v3", active=True)
    assert abs(active / 37e9 - 1) < 0.02
    assert theory.param_count("llama3-8b", active=True) == \
        theory.param_count("llama3-8b")


# ------------------------------------------------------------ placement semantics


def test_named_placements_reproduce_zero():
    for stage, name in enumerate(["DP", "ZeRO-1", "ZeRO-2", "ZeRO-3"]):
        cost = theory.PLACEMENTS[name].cost(7.5e9, 64)
        assert cost.persistent_total == pytest.approx(theory.zero_memory(7.5e9, 64,
                                                                         stage))
        assert cost.traffic_total == pytest.approx(
            sum(theory.zero_traffic(7.5e9, 64, stage).values()))
        assert theory.PLACEMENTS[name].check().ok


def test_zero3_and_fsdp_come_out_identical():
    z3, fsdp = theory.PLACEMENTS["ZeRO-3"], theory.PLACEMENTS["FSDP"]
    assert z3.cost(1e9, 16, activations=5e8) == fsdp.cost(1e9, 16, activations=5e8)


def test_placement_paper_abstract_figures():
    # Mehta 2026, abstract: "ZeRO-3 uses 8x less memory than data parallelism at
    # 1.5x communication cost" (N = 8 here); intro: a 70B model needs ~1120 GB of
    # model state
    dp = theory.PLACEMENTS["DP"].cost(1e9, 8)
    z3 = theory.PLACEMENTS["ZeRO-3"].cost(1e9, 8)
    assert dp.persistent_total / z3.persistent_total == pytest.approx(8)
    assert z3.traffic_total / dp.traffic_total == pytest.approx(1.5)
    assert theory.PLACEMENTS["DP"].cost(70e9, 1).persistent_total == 1120e9


def test_peak_includes_gathered_layers_and_activations():
    z3 = theory.PLACEMENTS["ZeRO-3"].cost(1e9, 8, activations=1e9,
                                          gather_fraction=1 / 10)
    assert z3.persistent["A"] == 0 and z3.peak["A"] == 1e9
    assert z3.peak["P"] == pytest.approx(2e9 / 8 + 0.1 * 2e9 * 7 / 8)


def test_correctness_conditions_explain_what_breaks():
    no_rs = theory.Placement("Replicated", "Sharded", "Sharded", "Replicated",
                             grad_sync=None)
    v = no_rs.check()
    assert not v.ok and "gradient integrity" in str(v) and "sharded gradients" in str(v)
    drift = theory.Placement("Replicated", "Sharded", "Replicated", "Replicated",
                             param_sync=None)
    assert "state consistency" in str(drift.check())
    mixed = theory.Placement("Replicated", "Replicated", "Sharded", "Replicated")
    assert "replicas update with different gradients" in str(mixed.check())
    assert "tensor parallelism" in str(theory.Placement(P="Sharded").check())
    with pytest.raises(ValueError, match="P must be one of"):
        theory.Placement(P="Everywhere")
    with pytest.raises(ValueError, match="grad_sync"):
        theory.Placement(grad_sync="broadcast")
    with pytest.raises(ValueError, match="gather_fraction"):
        theory.PLACEMENTS["DP"].cost(1e9, 8, gather_fraction=0)
