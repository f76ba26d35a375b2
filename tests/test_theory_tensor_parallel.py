"""labkit.theory.tensor_parallel: Megatron-LM's per-layer communication and
parameter counts, against the papers' figures."""

import pytest

from labkit.theory.models import param_count
from labkit.theory.tensor_parallel import layer_params, layer_traffic


def test_two_all_reduces_forward_and_two_backward():
    # Shoeybi et al. 2019, sec. 3: "two all-reduce operations in the forward path
    # and two in the backward path" per transformer layer
    t = layer_traffic(batch=1, seq=2048, hidden=12288, tp=8)
    assert (t.all_reduces_forward, t.all_reduces_backward, t.all_reduces) == (2, 2, 4)
    assert t.elements == 2048 * 12288


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_per_layer_traffic_is_8bsh_t_minus_1_over_t(tp):
    # Narayanan et al. 2021, sec. 3.3: 8bsh(t-1)/t per layer per device per
    # microbatch (elements); with 2-byte activations, twice that in bytes
    b, s, h = 4, 1024, 4096
    t = layer_traffic(b, s, h, tp, elem_bytes=2)
    assert t.bytes_per_rank == pytest.approx(2 * 8 * b * s * h * (tp - 1) / tp)
    assert t.bytes_each == pytest.approx(2 * (tp - 1) / tp * b * s * h * 2)
    if tp == 1:
        assert t.bytes_per_rank == 0  # one rank: nothing to send


def test_layer_params_is_12h2_plus_13h():
    # Narayanan et al. 2021, eq. 2: P = 12lh^2 (1 + 13/(12h) + (V+s)/(12lh))
    for h in (768, 4096, 12288):
        assert layer_params(h).total == 12 * h * h + 13 * h


def test_gpt3_layers_match_the_model_count():
    # GPT-3 175B (Brown et al. 2020): 96 layers of h = 12288; the layers are all of
    # theory.param_count but the embeddings (50257 + 2048 rows) and the last norm
    h, layers = 12288, 96
    rest = (50257 + 2048) * h + 2 * h
    assert layers * layer_params(h).total + rest == param_count("gpt3-175b")


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_tensor_parallel_shards_all_but_norms_and_row_biases(tp):
    h = 12288
    p = layer_params(h, tp)
    assert p.replicated == 6 * h
    assert p.sharded * tp == 12 * h * h + 7 * h
    # GPT-3 on t = 8: each rank holds a little over 1/8 of a layer
    assert p.total / layer_params(h).total == pytest.approx(1 / tp, rel=1e-3)


@pytest.mark.parametrize("kw", [{"tp": 0}, {"hidden": 10, "tp": 4},
                                {"ffn": 6, "tp": 4}])
def test_bad_sizes(kw):
    args = {"hidden": 8} | kw
    with pytest.raises(ValueError):
        layer_params(**args)
    with pytest.raises(ValueError):
        layer_traffic(1, 1, 0, 2)
