"""labkit.theory.zero: bytes per parameter, ZeRO's memory and traffic per device,
each against a published number (Rajbhandari et al. 2020; Megatron-LM's README)."""

import pytest

from labkit import theory


def test_bytes_per_param_zero_paper_and_megatron_table():
    # ZeRO paper sec. 3.1: mixed-precision Adam, 2 + 2 + 12 = 16 bytes per parameter
    mixed = theory.bytes_per_param("adam", "mixed")
    assert (mixed.parameter, mixed.gradient, mixed.optstate,
            mixed.total) == (2, 2, 12, 16)
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
    # and what each bar is made of: stage 2 keeps 2Ψ of parameters, the rest / N
    b = theory.zero_breakdown(7.5e9, 64, 2)
    assert (b.parameter, b.gradient, b.optstate) == (15e9, 15e9 / 64, 90e9 / 64)


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
    # ZeRO paper sec. 7.2-7.3: DP and ZeRO-1/2 move 2Ψ, ZeRO-3 3Ψ (1.5x); with the
    # ring's exact (N-1)/N on N = 64, Ψ = 1e9 one-byte elements: 2 * 63/64 * 1e9
    def total(stage):
        return sum(theory.zero_traffic(1e9, 64, stage, elem_bytes=1).values())

    assert [total(s) for s in range(4)] == pytest.approx(
        [1.96875e9, 1.96875e9, 1.96875e9, 2.953125e9])
    assert set(theory.zero_traffic(1e9, 64, 3)) == {
        "all_gather (parameters, forward)", "all_gather (parameters, backward)",
        "reduce_scatter (gradients)"}


@pytest.mark.parametrize("call", [
    lambda: theory.zero_memory(-1, 8, 1),
    lambda: theory.zero_memory(1e9, 0, 1),
    lambda: theory.zero_memory(1e9, 8, 4),
    lambda: theory.zero_traffic(1e9, 8, -1),
])
def test_zero_bad_input(call):
    with pytest.raises(ValueError):
        call()
