"""labkit.theory.collective_cost: bus factors, ring bytes, latency steps, α-β."""

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
    assert theory.ring_bytes_per_rank("all_gather", 8.0, 4) == 6.0  # (p-1)/p * n


def test_latency_steps_thakur_et_al():
    # Thakur, Rabenseifner & Gropp 2005: ring allgather and reduce-scatter take p-1
    # steps; ring allreduce is the two in a row, 2(p-1)
    assert theory.latency_steps("all_gather", 16) == 15
    assert theory.latency_steps("reduce_scatter", 16) == 15
    assert theory.latency_steps("all_reduce", 16) == 30
    assert theory.latency_steps("all_reduce", 1) == 0
    with pytest.raises(ValueError, match="unknown collective"):
        theory.latency_steps("ring_steps", 4)


def test_alpha_beta_model_and_fit_recovers_its_parameters():
    # 8 ranks: 14 steps of α, 1.75 GB sent per rank at 50 GB/s
    t = theory.alpha_beta_time("all_reduce", 1e9, 8, alpha=5e-6, beta=50e9)
    assert t == pytest.approx(7e-5 + 0.035)
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
