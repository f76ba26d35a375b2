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


# DeepEP's README (deepseek-ai/DeepEP), "Low-latency kernels with pure RDMA": H800s,
# one CX7 InfiniBand 400 Gb/s NIC each (~50 GB/s), 128 tokens per rank, hidden
# 7168, top-8 experts, FP8 dispatch and BF16 combine; latency in µs by EP size.
DEEPEP_LL = {8: (77, 114), 16: (118, 195), 32: (155, 273), 64: (173, 314),
             128: (192, 369), 256: (194, 360)}
TOKENS, TOP_K, HIDDEN = 128, 8, 7168
ROW = {"dispatch": HIDDEN + HIDDEN // 128 * 4,  # FP8, a float32 scale per 128
       "combine": 2 * HIDDEN}                   # BF16


def test_all_to_all_latency_is_one_alpha_held_to_deepep():
    # an all-to-all's sends go at once: one α, whatever the number of ranks
    assert [theory.latency_steps("all_to_all", n) for n in (1, 2, 64)] == [0, 1, 1]
    alpha, beta = 14.0e-6, 50e9  # NCCL's network α; one NIC's line rate
    for ep, published in DEEPEP_LL.items():
        for (what, row), t_us in zip(ROW.items(), published):
            sent = TOKENS * TOP_K * row                       # bytes, every copy
            rate = sent / (t_us * 1e-6)
            if ep <= 16:
                # one or two nodes: more than one NIC could carry, so part of it
                # stayed in the node (NVLink); the NIC-bound model does not apply
                assert rate > beta, f"EP {ep} {what}: {rate / 1e9:.0f} GB/s"
                continue
            model = theory.alpha_beta_time("all_to_all", sent, ep, alpha, beta)
            # DeepEP's own bandwidth column puts its NICs at 78-96 % of line rate
            # for EP >= 32: measured / model within [0.85, 1 / 0.75]
            ratio = t_us * 1e-6 / model
            assert 0.85 < ratio < 1 / 0.75, (
                f"EP {ep} {what}: DeepEP {t_us} µs, the α-β all-to-all "
                f"{model * 1e6:.0f} µs ({ratio:.2f}x); allowed 0.85-1.33x")
            # priced as a ring's ep-1 steps in turn, it is several times too slow
            ring = (ep - 1) * alpha + (ep - 1) / ep * sent / beta
            assert ring > 2.5 * t_us * 1e-6, (
                f"EP {ep} {what}: {ep - 1} sequential α give {ring * 1e6:.0f} µs "
                f"against DeepEP's {t_us} µs")
