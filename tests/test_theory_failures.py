"""labkit.theory.failures: Llama 3's interruptions and the MTBFs they imply; Young's
and Daly's checkpoint intervals against Daly's published optima and against the
waste models minimised on a grid; DiLoCo's and Streaming DiLoCo's bytes against a
ring all-reduce counted chunk by chunk and against packed tensors; input checks."""

import math
import sys

import numpy as np
import pytest

from labkit.theory import (
    DAY,
    HOUR,
    LLAMA3_FAILURES,
    bytes_across_hosts,
    crossover_bandwidth,
    daly_interval,
    ddp_traffic,
    diloco_traffic,
    expected_interruptions,
    failure_cost,
    failure_snapshot,
    job_mtbf,
    quantized_payload,
    sync_step_time,
    wasted_fraction,
    young_interval,
)

ULPS = 8 * sys.float_info.epsilon  # a few roundings of one closed form, no more
MINUTE = 60.0

# -- failures at scale ------------------------------------------------------------


def test_llama3_interruptions_imply_a_3_hour_job_mtbf():
    # The Llama 3 Herd of Models (arXiv 2407.21783), sec. 3.3.4: 466 interruptions
    # in a 54-day snapshot on 16,384 H100s, 47 planned and 419 unexpected
    s = LLAMA3_FAILURES
    assert (s.interruptions, s.unexpected, s.gpus) == (466, 419, 16_384), s
    assert s.interruptions - s.unexpected == 47, "47 planned interruptions published"
    hours = s.job_mtbf / HOUR
    print(f"\nLlama 3: job MTBF {hours:.2f} h, one GPU's {s.gpu_mtbf / HOUR:,.0f} h "
          f"({s.gpu_mtbf / (365.25 * DAY):.1f} years), {s.per_day:.2f} failures/day")
    assert hours == pytest.approx(54 * 24 / 419, rel=ULPS), (
        f"job MTBF {hours} h, 54 days / 419 = {54 * 24 / 419} h")
    assert round(hours, 1) == 3.1, f"job MTBF {hours:.3f} h, ~3.1 h expected"
    assert round(s.gpu_mtbf / HOUR) == 50_677, (
        f"one GPU's MTBF {s.gpu_mtbf / HOUR:.1f} h, 16,384 x 3.0931 h = 50,677 h")
    assert round(s.per_day, 2) == 7.76, f"{s.per_day} a day, 419 / 54 = 7.76"
    # and back: N GPUs of that MTBF fail 419/54 times a day, each alone M/N apart
    for kw in ({"gpu_mtbf": s.gpu_mtbf}, {"gpu_rate": 1 / s.gpu_mtbf}):
        per_day = expected_interruptions(s.gpus, DAY, **kw)
        assert per_day == pytest.approx(419 / 54, rel=ULPS), (kw, per_day, 419 / 54)
    assert job_mtbf(s.gpu_mtbf, s.gpus) == pytest.approx(s.job_mtbf, rel=ULPS)
    assert expected_interruptions(s.gpus, s.duration, gpu_mtbf=s.gpu_mtbf) == \
        pytest.approx(419, rel=ULPS), "the 54 days' count comes back"


def test_snapshot_rejects_more_failures_than_interruptions():
    with pytest.raises(ValueError, match="cannot exceed"):
        failure_snapshot(days=54, interruptions=400, unexpected=419, gpus=16_384)
    with pytest.raises(ValueError, match="exactly one"):
        expected_interruptions(8, gpu_mtbf=1.0, gpu_rate=1.0)
    with pytest.raises(ValueError, match="exactly one"):
        expected_interruptions(8)


# -- the checkpoint interval ------------------------------------------------------


def _grid_argmin(f, hi: float, points: int) -> tuple[float, float]:
    """The grid point in (0, hi] where f is least, and the grid's step; for a
    function with one minimum, the true minimiser is within one step of it."""
    step = hi / points
    best = min(range(1, points + 1), key=lambda i: f(i * step))
    assert 1 < best < points, f"minimum at the grid's edge ({best} of {points})"
    return best * step, step


def test_failure_cost_is_half_an_interval_plus_the_restart():
    # failures uniform over the interval: the mean of U(0, τ) is τ/2, here by
    # the midpoint rule (exact for a linear integrand)
    tau, restart, k = 1800.0, 300.0, 1000
    mean_lost = sum((i + 0.5) * tau / k for i in range(k)) / k
    assert failure_cost(tau, restart) == pytest.approx(mean_lost + restart, rel=ULPS)
    assert failure_cost(tau, 0) == tau / 2


@pytest.mark.parametrize("checkpoint,restart", [(60.0, 600.0), (300.0, 0.0)])
def test_young_interval_minimises_the_first_order_waste(checkpoint, restart):
    # Young 1974: C/τ + (τ/2 + R)/M is least at τ = sqrt(2CM); here M is Llama 3's
    # job MTBF and C a stated checkpoint cost
    m = LLAMA3_FAILURES.job_mtbf
    best, step = _grid_argmin(lambda t: wasted_fraction(t, checkpoint, restart, m),
                              hi=m, points=20_000)
    young = young_interval(checkpoint, m)
    assert abs(young - best) <= step, (
        f"Young's τ {young:.2f} s, grid optimum {best:.2f} s, allowed one step "
        f"{step:.2f} s")
    wrong = math.sqrt(checkpoint * m)  # the comparison resolves: sqrt(CM) is out
    assert abs(wrong - best) > step, (wrong, best, step)
    waste = wasted_fraction(young, checkpoint, restart, m)
    print(f"\nLlama 3, C = {checkpoint:.0f} s, R = {restart:.0f} s: Young's "
          f"τ = {young / MINUTE:.1f} min, Daly's "
          f"{daly_interval(checkpoint, m) / MINUTE:.1f} min, waste {waste:.1%}")
    assert waste == pytest.approx(math.sqrt(2 * checkpoint / m) + restart / m,
                                  rel=ULPS), "at the optimum C/τ = τ/(2M)"


@pytest.mark.parametrize("mtbf_min,published_min", [
    (24 * 60, "117"), (6 * 60, "57"), (15, "9.1")])
def test_daly_interval_reproduces_dalys_worked_examples(mtbf_min, published_min):
    # Daly 2006, FGCS 22(3), figs. 3-5: R = 10 min, δ = 5 min and M = 24 h, 6 h,
    # 15 min; "the new model predicts τopt" 117 min, 57 min and 9.1 min
    tau = daly_interval(5 * MINUTE, mtbf_min * MINUTE) / MINUTE
    digits = len(published_min.split(".")[1]) if "." in published_min else 0
    assert f"{tau:.{digits}f}" == published_min, (
        f"Daly's τ {tau:.3f} min, published {published_min} min")
    young = young_interval(5 * MINUTE, mtbf_min * MINUTE) / MINUTE
    assert f"{young:.{digits}f}" != published_min, (young, "Young's must differ")


@pytest.mark.parametrize("checkpoint,mtbf", [
    (5 * MINUTE, 24 * HOUR), (5 * MINUTE, 15 * MINUTE),
    (60.0, LLAMA3_FAILURES.job_mtbf), (5.0, 50.0)])
def test_daly_interval_lands_on_the_complete_models_optimum(checkpoint, mtbf):
    # Daly 2006, sec. 4: expected wall time ∝ e^{R/M}(e^{(τ+C)/M} − 1)/τ, R aside;
    # his series is in powers of sqrt(ξ), ξ = C/(2M), so it may miss by the first
    # term left out, ~ξ^{3/2}·sqrt(2CM), plus the grid's step
    young = young_interval(checkpoint, mtbf)
    best, step = _grid_argmin(lambda t: math.expm1((t + checkpoint) / mtbf) / t,
                              hi=1.5 * young, points=20_000)
    xi = checkpoint / (2 * mtbf)
    allowed = step + xi ** 1.5 * young
    daly = daly_interval(checkpoint, mtbf)
    assert abs(daly - best) <= allowed, (
        f"Daly's τ {daly:.4f} s, grid optimum {best:.4f} s, allowed {allowed:.4f} s")
    assert abs(young - best) > allowed, (
        f"Young's τ {young:.4f} s is within {allowed:.4f} s of {best:.4f} s: the "
        f"check cannot tell Daly's from Young's")


def test_daly_interval_is_the_mtbf_once_a_checkpoint_takes_two():
    assert daly_interval(2 * HOUR, HOUR) == HOUR
    assert daly_interval(5 * HOUR, HOUR) == HOUR


# -- training that talks less -----------------------------------------------------


def _ring_all_reduce(payload: int, hosts: int, per_host: int):
    """Count a ring all-reduce chunk by chunk: N-1 reduce-scatter and N-1
    all-gather steps, in each of which rank i sends one payload/N chunk to rank
    i+1; ranks lie in contiguous blocks per host. Returns (bytes each rank sent,
    bytes that crossed between hosts)."""
    n = hosts * per_host
    assert payload % n == 0, (payload, n)
    sent, across = [0] * n, 0
    for _ in range(2 * (n - 1)):
        for i in range(n):
            sent[i] += payload // n
            if i // per_host != (i + 1) % n // per_host:
                across += payload // n
    assert len(set(sent)) == 1, sent
    return sent[0], across


@pytest.mark.parametrize("hosts,per_host", [(2, 4), (4, 2), (8, 1), (1, 8), (2, 3)])
def test_ring_bytes_per_rank_and_across_hosts_match_a_counted_ring(hosts, per_host):
    payload = 4 * 5 * 7 * 24 * 1000  # divisible by every N here
    per_rank, across = _ring_all_reduce(payload, hosts, per_host)
    n = hosts * per_host
    t = ddp_traffic(payload, n)
    assert t.average == t.peak == pytest.approx(per_rank, rel=ULPS), (
        f"DDP {t} B/step, counted {per_rank} B per rank")
    got = bytes_across_hosts(payload, hosts, per_host)
    assert got == pytest.approx(across, rel=ULPS), (
        f"{hosts} hosts x {per_host}: formula {got} B across hosts, counted {across}")


def test_diloco_communicates_500_times_less_with_h_500():
    # Douillard et al. 2023 (arXiv 2311.08105), abstract: DiLoCo on 8 workers
    # "communicating 500 times less", synchronising every H = 500 inner steps
    payload = 4 * 150_000_000  # a 150M-parameter model's fp32 outer gradients
    ddp, dil = ddp_traffic(payload, 8), diloco_traffic(payload, 8, inner_steps=500)
    ratio = ddp.average / dil.average
    print(f"\nDDP {ddp.average / 1e9:.3f} GB/step, DiLoCo H=500 "
          f"{dil.average / 1e6:.3f} MB/step: {ratio:.1f}x less")
    assert ratio == pytest.approx(500, rel=ULPS), f"{ratio}x less, 500x published"
    assert dil.peak == ddp.peak, "without fragments the sync step sends it all at once"


@pytest.mark.parametrize("inner_steps,fragments", [(100, 4), (30, 3), (8, 8), (7, 1)])
def test_streaming_fragments_cut_the_peak_not_the_average(inner_steps, fragments):
    # each of F equal fragments syncs once per H steps, fragment j at steps
    # ≡ j·H//F (mod H): count every step's bytes over 3 outer steps
    payload, n = 4 * 1_200_000, 4
    full = ddp_traffic(payload, n).peak
    per_step = [sum(full / fragments for j in range(fragments)
                    if s % inner_steps == j * inner_steps // fragments)
                for s in range(3 * inner_steps)]
    t = diloco_traffic(payload, n, inner_steps, fragments)
    assert t.peak == pytest.approx(max(per_step), rel=ULPS), (t, max(per_step))
    assert t.average == pytest.approx(sum(per_step) / len(per_step), rel=ULPS), (
        t, sum(per_step) / len(per_step))
    with pytest.raises(ValueError, match="fragments"):
        diloco_traffic(payload, n, inner_steps, inner_steps + 1)


@pytest.mark.parametrize("values,bits,block", [
    (1000, 4, 64), (999, 4, 128), (12_345, 8, 256), (1001, 3, 100), (77, 32, 7)])
def test_quantized_payload_is_what_packed_tensors_hold(values, bits, block):
    rng = np.random.default_rng(values)
    x = rng.standard_normal(values).astype(np.float32)
    blocks = -(-values // block)
    padded = np.zeros(blocks * block, np.float32)
    padded[:values] = x
    scales = np.abs(padded.reshape(blocks, block)).max(axis=1).astype(np.float32)
    levels = 2 ** bits - 1
    q = np.round((padded.reshape(blocks, block) / scales[:, None] + 1) / 2 * levels)
    codes = q.reshape(-1)[:values].astype(np.uint64)
    bitplanes = (codes[:, None] >> np.arange(bits, dtype=np.uint64)) & 1
    packed = np.packbits(bitplanes.astype(np.uint8).reshape(-1))
    measured = packed.nbytes + scales.nbytes
    assert quantized_payload(values, bits, block) == measured, (
        f"{values} values at {bits} bits, blocks of {block}: formula "
        f"{quantized_payload(values, bits, block)} B, packed {measured} B")


def test_four_bit_outer_gradients_and_the_crossover_bandwidth():
    # a 150M-parameter model on 2 hosts x 4 ranks, 0.5 s of compute a step
    values, hosts, per_host, compute = 150_000_000, 2, 4, 0.5
    fp32 = bytes_across_hosts(4 * values, hosts, per_host)
    q4 = bytes_across_hosts(quantized_payload(values, 4, 128), hosts, per_host)
    assert 4 * values / quantized_payload(values, 4, 128) == pytest.approx(
        32 / (4 + 32 / 128), rel=ULPS), "4 bits + a 32-bit scale per 128 values"
    b_ddp = crossover_bandwidth(compute, fp32)
    b_dil = crossover_bandwidth(compute, fp32, inner_steps=100)
    print(f"\nacross hosts: fp32 {fp32 / 1e9:.2f} GB a sync, 4-bit {q4 / 1e9:.3f} GB;"
          f" B* DDP {b_ddp / 1e9:.2f} GB/s, DiLoCo H=100 {b_dil / 1e6:.1f} MB/s")
    assert b_dil == pytest.approx(b_ddp / 100, rel=ULPS), (b_dil, b_ddp / 100)
    # at its B*, a step spends as long talking as computing
    for h, b in ((1, b_ddp), (100, b_dil)):
        t = sync_step_time(compute, fp32, b, inner_steps=h)
        assert t == pytest.approx(2 * compute, rel=ULPS), (h, t, 2 * compute)
    # DiLoCo on DDP's B* talks 1/H as long
    t = sync_step_time(compute, fp32, b_ddp, inner_steps=100)
    assert t == pytest.approx(compute * 1.01, rel=ULPS), (t, compute * 1.01)
    assert sync_step_time(compute, 0, 1.0) == compute, "nothing to send, no wait"


# -- input checks -----------------------------------------------------------------

BAD_REALS = [math.nan, math.inf, -math.inf, 0.0, -1.0, True]
BAD_COUNTS = [0, -1, True, 2.0, math.nan, math.inf]

REALS = [  # (function, good keyword arguments, the one to spoil, zero allowed)
    (job_mtbf, {"gpu_mtbf": 1e5, "gpus": 8}, "gpu_mtbf", False),
    (expected_interruptions, {"gpus": 8, "duration": DAY, "gpu_mtbf": 1e5},
     "duration", False),
    (expected_interruptions, {"gpus": 8, "gpu_mtbf": 1e5}, "gpu_mtbf", False),
    (expected_interruptions, {"gpus": 8, "gpu_rate": 1e-5}, "gpu_rate", False),
    (failure_snapshot, {"days": 54, "interruptions": 466, "unexpected": 419,
                        "gpus": 16}, "days", False),
    (failure_cost, {"interval": 60.0, "restart": 10.0}, "interval", False),
    (failure_cost, {"interval": 60.0, "restart": 10.0}, "restart", True),
    *[(wasted_fraction, {"interval": 60.0, "checkpoint": 5.0, "restart": 1.0,
                         "mtbf": 1e4}, name, name == "restart")
      for name in ("interval", "checkpoint", "restart", "mtbf")],
    *[(f, {"checkpoint": 5.0, "mtbf": 1e4}, name, False)
      for f in (young_interval, daly_interval) for name in ("checkpoint", "mtbf")],
    (ddp_traffic, {"payload": 1e6, "world_size": 4}, "payload", True),
    (diloco_traffic, {"payload": 1e6, "world_size": 4, "inner_steps": 10}, "payload",
     True),
    (bytes_across_hosts, {"payload": 1e6, "hosts": 2, "ranks_per_host": 2},
     "payload", True),
    *[(sync_step_time, {"compute": 0.5, "across": 1e6, "bandwidth": 1e9}, name,
       name == "across") for name in ("compute", "across", "bandwidth")],
    *[(crossover_bandwidth, {"compute": 0.5, "across": 1e6}, name, False)
      for name in ("compute", "across")],
]

COUNTS = [  # (function, good keyword arguments, the one to spoil)
    (job_mtbf, {"gpu_mtbf": 1e5, "gpus": 8}, "gpus"),
    (expected_interruptions, {"gpus": 8, "gpu_mtbf": 1e5}, "gpus"),
    *[(failure_snapshot, {"days": 54, "interruptions": 466, "unexpected": 419,
                          "gpus": 16}, name)
      for name in ("interruptions", "unexpected", "gpus")],
    (ddp_traffic, {"payload": 1e6, "world_size": 4}, "world_size"),
    *[(diloco_traffic, {"payload": 1e6, "world_size": 4, "inner_steps": 10,
                        "fragments": 2},
       name) for name in ("world_size", "inner_steps", "fragments")],
    *[(quantized_payload, {"values": 1000, "bits": 4, "block": 64}, name)
      for name in ("values", "bits", "block")],
    *[(bytes_across_hosts, {"payload": 1e6, "hosts": 2, "ranks_per_host": 2}, name)
      for name in ("hosts", "ranks_per_host")],
    (sync_step_time, {"compute": 0.5, "across": 1e6, "bandwidth": 1e9,
                      "inner_steps": 4}, "inner_steps"),
    (crossover_bandwidth, {"compute": 0.5, "across": 1e6, "inner_steps": 4},
     "inner_steps"),
]


def _case_id(case) -> str:
    return f"{case[0].__name__}-{case[2]}"


@pytest.mark.parametrize("case", REALS, ids=_case_id)
def test_real_arguments_refuse_nan_inf_non_positive_and_bool(case):
    f, good, name, zero_ok = case
    f(**good)  # the good arguments pass
    for bad in BAD_REALS:
        if zero_ok and bad == 0 and not isinstance(bad, bool):
            f(**{**good, name: bad})  # zero bytes or seconds is meaningful here
            continue
        with pytest.raises(ValueError, match=rf"\b{name}\b") as err:
            f(**{**good, name: bad})
        assert repr(bad) in str(err.value), (
            f"{f.__name__}({name}={bad!r}): message {err.value} does not say what "
            f"it got")


@pytest.mark.parametrize("case", COUNTS, ids=_case_id)
def test_count_arguments_refuse_zero_negative_bool_and_floats(case):
    f, good, name = case
    f(**good)
    for bad in BAD_COUNTS:
        with pytest.raises(ValueError, match=rf"\b{name}\b"):
            f(**{**good, name: bad})


def test_bits_above_32_are_refused():
    with pytest.raises(ValueError, match="bits"):
        quantized_payload(1000, 33, 64)
