"""labkit.parallel.models in one process: the written-out attention against
PyTorch's fused scaled_dot_product_attention (forward and backward, causal or
not), and the layout: token ids (b, s) in, logits (b, s, V) out, [s, b, h] in
between, each sequence computed on its own and causally.

Tolerance: the two attentions add in different orders; each must be as far from
the float64 answer as the other is (labkit.numerics.Oracle), where a wrong mask
or scale is off by order 1."""

import pytest
import torch
import torch.nn.functional as F

from labkit.numerics import Oracle
from labkit.parallel.models import (
    Embedding,
    TinyGPT,
    attention,
    merge_heads,
    split_heads,
)

pytestmark = pytest.mark.numerics  # run again under other CPUs' kernels

B, N, S, D = 2, 3, 10, 8  # batch, heads, sequence, head dim


def _qkv(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, N, S, D, generator=g).to(dtype).requires_grad_()
            for _ in range(3)]


def _run(fn, dtype, causal):
    q, k, v = _qkv(dtype)
    out = fn(q, k, v, causal)
    out.backward(torch.ones_like(out) / out.numel() ** 0.5)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _sdpa(q, k, v, causal):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_attention_is_pytorchs_fused_attention(causal):
    exact = _run(attention, torch.float64, causal)
    oracle = Oracle(exact, {"fused, fp32": _run(_sdpa, torch.float32, causal)})
    oracle.check(_run(attention, torch.float32, causal),
                 f"attention(causal={causal}): output and gradients")
    other = _run(attention, torch.float64, not causal)  # the other mask
    oracle.resolves(other, f"attention(causal={not causal})")


def test_heads_split_and_merge_back():
    x = torch.arange(S * B * N * D, dtype=torch.float32).view(S, B, N * D)
    heads = split_heads(x, D)
    assert heads.shape == (B, N, S, D), tuple(heads.shape)
    assert torch.equal(heads[1, 2, 4], x[4, 1, 2 * D:3 * D]), "head 2 of (s 4, b 1)"
    assert torch.equal(merge_heads(heads), x), "merge_heads(split_heads(x)) != x"


def test_tinygpt_takes_b_s_tokens_and_runs_sequence_first():
    torch.manual_seed(0)
    model = TinyGPT(vocab=13, seq=6, hidden=8, heads=2, layers=2).double()
    tokens = torch.randint(0, 13, (3, 6), generator=torch.Generator().manual_seed(1))
    inner = model[0](tokens)
    assert isinstance(model[0], Embedding) and inner.shape == (6, 3, 8), (
        f"embedding: {tuple(inner.shape)}, [s, b, h] = (6, 3, 8) expected")
    logits = model(tokens)
    assert logits.shape == (3, 6, 13), f"{tuple(logits.shape)}, (b, s, V) expected"
    # the same shapes run the same operations in the same order, so what a token
    # must not reach is bit for bit unchanged: other sequences (a layout that
    # mixed b and s would leak), and earlier positions (causal)
    other = tokens.clone()
    other[0] = (other[0] + 1) % 13
    moved = (model(other) - logits).abs().amax(dim=(1, 2))
    assert moved[1:].max() == 0 and moved[0] > 0, f"logits moved by sequence {moved}"
    later = tokens.clone()
    later[:, -1] = (later[:, -1] + 1) % 13
    moved = (model(later) - logits).abs().amax(dim=(0, 2))
    assert moved[:-1].max() == 0 and moved[-1] > 0, f"logits moved by position {moved}"
