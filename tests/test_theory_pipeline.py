"""labkit.theory.pipeline: GPipe's and Megatron's bubble, activations in flight."""

import pytest

from labkit import theory


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
