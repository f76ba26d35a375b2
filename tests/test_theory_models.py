"""labkit.theory.models: parameter counts against the published totals."""

import pytest

from labkit import theory


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
