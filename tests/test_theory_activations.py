"""labkit.theory.activations: Korthikanti et al. 2022, by hand and by table."""

import pytest

from labkit import theory
from labkit.theory.activations import SCORE_TERMS, activation_terms

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


@pytest.mark.parametrize("tp,sp", [(1, False), (8, False), (8, True)])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_activation_terms_add_up_to_table_2(tp, sp, recompute):
    s, b, h, a = 2048, 2, 12288, 96
    terms = activation_terms(s, b, h, a, tp=tp, sp=sp, recompute=recompute)
    total = theory.activation_memory(s, b, h, a, tp=tp, sp=sp, recompute=recompute)
    assert sum(terms.values()) == pytest.approx(total, rel=1e-12)


def test_activation_terms_by_hand():
    # sec. 4.1: attention 11sbh + 5as^2b, MLP 19sbh, LayerNorms 4sbh
    s, b, h, a = 64, 2, 32, 4
    sbh = s * b * h
    terms = activation_terms(s, b, h, a)
    assert len(terms) == 14
    assert terms["GeLU input"] == 8 * sbh and terms["MLP dropout mask"] == sbh
    assert sum(terms[k] for k in SCORE_TERMS) == 5 * a * s * s * b
    mlp = ("LayerNorm 2 input", "fc1 input (LayerNorm 2 output)", "GeLU input",
           "fc2 input (GeLU output)", "MLP dropout mask")
    assert sum(terms[k] for k in mlp) == 21 * sbh  # 19sbh + its LayerNorm's 2sbh
    # tensor parallelism leaves the LayerNorm and dropout terms whole: 10sbh
    tp = activation_terms(s, b, h, a, tp=4)
    whole = {k for k in tp if tp[k] == terms[k]}
    assert sum(tp[k] for k in whole) == 10 * sbh
    assert all(tp[k] == terms[k] / 4 for k in tp if k not in whole)
    # sequence parallelism splits those too; selective drops exactly the scores
    sp = activation_terms(s, b, h, a, tp=4, sp=True, recompute="selective")
    assert set(sp) == set(terms) - set(SCORE_TERMS)
    assert all(sp[k] == terms[k] / 4 for k in sp)
    assert activation_terms(s, b, h, a, tp=4, sp=True, recompute="full") == {
        "layer input": 2 * sbh / 4}
