"""labkit.theory.pipeline: GPipe's and Megatron's bubble, ZB-H1's, activations in
flight."""

import pytest

from labkit import theory
from labkit.theory.pipeline import zero_bubble_h1


def test_pipeline_bubble():
    # GPipe (Huang et al. 2019): (p-1)/(m+p-1); Megatron (Narayanan et al. 2021):
    # (p-1)/m relative to ideal, divided by v with the interleaved schedule
    b = theory.pipeline_bubble(4, 8)
    assert b.of_total == pytest.approx(3 / 11) and b.of_ideal == pytest.approx(3 / 8)
    assert theory.pipeline_bubble(4, 8, v=2).of_ideal == pytest.approx(3 / 16)
    assert theory.pipeline_bubble(4, 8, v=2).of_total == pytest.approx(3 / 19)
    assert theory.pipeline_bubble(1, 8).of_total == 0
    assert theory.activations_in_flight("gpipe", 4, 16) == 16
    assert theory.activations_in_flight("1f1b", 4, 16) == 4
    assert theory.activations_in_flight("1f1b", 8, 2) == 2  # fewer than p in flight
    with pytest.raises(ValueError):
        theory.pipeline_bubble(0, 8)
    with pytest.raises(ValueError):
        theory.activations_in_flight("zb", 4, 8)


def test_zero_bubble_h1():
    # Qi et al. 2024 (sail-sg/zero-bubble-pipeline-parallelism, README): with
    # T_F = T_B = T_W the bubble rate is (p-1)/(3m); 1F1B's is (p-1)/m
    zb = zero_bubble_h1(4, 8)
    assert zb.of_ideal == pytest.approx(3 / 24)
    assert zb.of_ideal == pytest.approx(theory.pipeline_bubble(4, 8).of_ideal / 3)
    assert zb.of_total == pytest.approx(3 / (24 + 3))
    # idle (p-1)(f+b-w) against m(f+b+w) while W is no longer than F and B
    assert zero_bubble_h1(4, 8, f=2, b=2, w=1).of_ideal == pytest.approx(9 / 40)
    # a longer W cannot fill the fill phase's F- and B-long gaps
    assert zero_bubble_h1(4, 8, f=1, b=1, w=2).of_ideal == pytest.approx(3 / 32)
    assert theory.activations_in_flight("zb-h1", 4, 8) == 4  # 1F1B's memory
    with pytest.raises(ValueError, match="needs m >= p"):
        zero_bubble_h1(4, 2)
    with pytest.raises(ValueError, match="must be > 0"):
        zero_bubble_h1(4, 8, w=0)
