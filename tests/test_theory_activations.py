"""labkit.theory.activations: Korthikanti et al. 2022, by hand and by table."""

import pytest

from labkit import theory

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
