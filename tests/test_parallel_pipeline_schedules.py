"""labkit.parallel.pipeline_schedules: each stage's order of passes, and the
simulator placing them in time, against the published bubbles (labkit.theory):
GPipe and 1F1B (p-1)/(m+p-1) of the step, interleaved (p-1)/(vm) of the ideal
time, ZB-H1 a third of 1F1B's with equal F, B and W times."""

import pytest

from labkit.parallel.pipeline_schedules import (
    Action,
    peak_in_flight,
    simulate_schedule,
    stage_order,
)
from labkit.theory.pipeline import (
    activations_in_flight,
    pipeline_bubble,
    zero_bubble_h1,
)

SHAPES = [(1, 1), (1, 4), (2, 1), (2, 4), (4, 4), (4, 8), (4, 16), (3, 7), (8, 8),
          (8, 3)]


def _fb(order):
    return "".join(f"{a.kind}{a.microbatch}" for a in order)


def test_orders_of_one_stage():
    # p = 4, m = 6, stage 1: two forwards of warm-up, then F B pairs, then B's
    assert _fb(stage_order("1f1b", 4, 6, 1)) == "F0F1F2B0F3B1F4B2F5B3B4B5"
    assert _fb(stage_order("1f1b", 4, 6, 3)) == "F0B0F1B1F2B2F3B3F4B4F5B5"
    assert _fb(stage_order("gpipe", 2, 3, 1)) == "F0F1F2B0B1B2"
    assert _fb(stage_order("1f1b", 4, 2, 0)) == "F0F1B0B1"  # m < p: all forwards
    # ZB-H1, p = 3, m = 4: stage 2 holds back its first two W's, stage 0 none
    assert _fb(stage_order("zb-h1", 3, 4, 0)) == "F0F1F2B0W0F3B1W1B2W2B3W3"
    assert _fb(stage_order("zb-h1", 3, 4, 2)) == "F0B0F1B1F2B2W0F3B3W1W2W3"
    # interleaved, p = 2, v = 2, m = 2: the first stage's four forwards cover
    # micro-batches 0, 1 of chunk 0, then of chunk 1
    assert stage_order("interleaved", 2, 2, 0, v=2)[:4] == [
        Action("F", 0, 0), Action("F", 1, 0), Action("F", 0, 1), Action("F", 1, 1)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("p,m", SHAPES)
def test_every_pass_once_and_after_its_forward(schedule, p, m):
    for rank in range(p):
        order = stage_order(schedule, p, m, rank)
        kinds = "FBW" if schedule == "zb-h1" else "FB"
        assert sorted(order) == sorted(Action(k, i) for k in kinds for i in range(m))
        seen = set()
        for a in order:
            assert a.kind == "F" or ("F" if a.kind == "B" else "B", a.microbatch) \
                in seen
            seen.add((a.kind, a.microbatch))


@pytest.mark.parametrize("p,m", SHAPES)
def test_gpipe_and_1f1b_bubble_is_published_one(p, m):
    want = pipeline_bubble(p, m)
    for schedule in ("gpipe", "1f1b"):
        for f, b, w in ((1, 1, 1), (1, 2, 0), (2, 0.5, 0.5)):  # any F:B ratio
            sim = simulate_schedule(schedule, p, m, f=f, b=b, w=w)
            assert sim.makespan == pytest.approx((m + p - 1) * (f + b + w))
            for r in range(p):
                assert sim.bubble(r) == pytest.approx(want.of_total)
            assert sim.bubble_of_ideal == pytest.approx(want.of_ideal)


@pytest.mark.parametrize("p,m", SHAPES)
def test_in_flight_is_theory(p, m):
    for schedule in ("gpipe", "1f1b", "zb-h1"):
        held = [peak_in_flight(stage_order(schedule, p, m, r)) for r in range(p)]
        assert held[0] == activations_in_flight(schedule, p, m)
        assert max(held) == held[0]  # the first stage holds the most
    assert [peak_in_flight(stage_order("1f1b", p, m, r)) for r in range(p)] == [
        min(p - r, m) for r in range(p)]


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8), (4, 16), (8, 16)])
@pytest.mark.parametrize("v", [1, 2, 4])
def test_interleaved_bubble_is_megatrons(p, m, v):
    # Narayanan et al. 2021, sec. 2.2.2: (p-1)/(v m) of the ideal time
    sim = simulate_schedule("interleaved", p, m, v, f=1, b=1, w=1)
    assert sim.bubble_of_ideal == pytest.approx(pipeline_bubble(p, m, v).of_ideal)
    assert sim.bubble_of_total == pytest.approx(pipeline_bubble(p, m, v).of_total)


@pytest.mark.parametrize("p,m", [(2, 2), (2, 4), (4, 4), (4, 8), (3, 7), (8, 8)])
def test_zb_h1_is_a_third_of_1f1b(p, m):
    # Qi et al. 2024: with T_F = T_B = T_W the bubble rate is (p-1)/(3m), against
    # 1F1B's (p-1)/m (sail-sg/zero-bubble-pipeline-parallelism, README table)
    zb, one = simulate_schedule("zb-h1", p, m), simulate_schedule("1f1b", p, m)
    assert zb.bubble_of_ideal == pytest.approx((p - 1) / (3 * m))
    assert one.bubble_of_ideal == pytest.approx((p - 1) / m)
    assert zb.bubble_of_ideal == pytest.approx(zero_bubble_h1(p, m).of_ideal)
    for f, b, w in ((1, 2, 1), (2, 1, 0.5), (1, 1, 2), (0.5, 2, 1)):  # unequal
        sim = simulate_schedule("zb-h1", p, m, f=f, b=b, w=w)
        assert sim.bubble_of_total == pytest.approx(
            zero_bubble_h1(p, m, f, b, w).of_total)


def test_communication_delay_adds_to_the_bubble():
    # GPipe: the fill and the drain each cross p-1 links, 2(p-1) delays of c.
    # 1F1B waits on more of them: in its steady state a stage's next backward
    # needs a round trip to the next stage
    for p, m in ((2, 4), (4, 8)):
        base = (m + p - 1) * 3
        gpipe = simulate_schedule("gpipe", p, m, comm=0.25).makespan
        assert gpipe == pytest.approx(base + 2 * (p - 1) * 0.25)
        assert simulate_schedule("1f1b", p, m, comm=0.25).makespan > gpipe


def test_ops_are_ordered_and_never_overlap():
    sim = simulate_schedule("interleaved", 4, 8, 2)
    for r, ops in sim.ops.items():
        assert [(o.kind, o.microbatch, o.chunk) for o in ops] == [
            tuple(a) for a in stage_order("interleaved", 4, 8, r, 2)]
        assert all(a.end <= b.start + 1e-12 for a, b in zip(ops, ops[1:]))


def test_mistakes():
    with pytest.raises(ValueError, match="schedule must be one of"):
        stage_order("pipedream", 4, 8, 0)
    with pytest.raises(ValueError, match="m = 6 is not a multiple of 4"):
        stage_order("interleaved", 4, 6, 0, v=2)
    with pytest.raises(ValueError, match="v = 2 model chunks per rank needs"):
        stage_order("1f1b", 4, 8, 0, v=2)
    with pytest.raises(ValueError, match=r"rank must be an integer in \[0, 3\]"):
        stage_order("1f1b", 4, 8, 4)
    with pytest.raises(ValueError, match="m must be an integer >= 1"):
        simulate_schedule("gpipe", 4, 0)
