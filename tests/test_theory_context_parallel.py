"""labkit.theory.context_parallel: bytes a rank sends per attention layer for
ring attention, Ulysses and all-gather context parallelism, against Jacobs et
al. 2023's count and the layout calculator's pricing of Llama 3's CP (the
measured bytes: tests/test_parallel_context_parallel.py)."""

import dataclasses
import math

import pytest

from labkit import theory


def test_ulysses_is_the_papers_4nh_over_p():
    # Jacobs et al. 2023, sec. 3.2: q, k, v (3Nh) and the output (Nh) all-to-all
    # per layer forward, M/P a link: 4Nh/P. A rank sends P-1 of its P shares.
    n_seq, h, p = 262144, 4096, 8
    fwd = theory.ulysses_traffic(n_seq, 1, h, p, dtype_bytes=1).forward
    assert fwd == 4 * n_seq * h / p * (p - 1) / p, f"{fwd:,.0f} B"
    # "constant when N and P grow together" (up to that (P-1)/P)
    twice = theory.ulysses_traffic(2 * n_seq, 1, h, 2 * p, dtype_bytes=1).forward
    assert twice / fwd == pytest.approx((2 * p - 1) / (2 * p) / ((p - 1) / p)), (
        f"{twice:,.0f} B at 2N on 2P against {fwd:,.0f} B")
    # backward: the output's gradient in, q's, k's and v's back: the same bytes
    both = theory.ulysses_traffic(n_seq, 1, h, p)
    assert both.backward == both.forward, (
        f"backward {both.backward:,.0f} B, forward {both.forward:,.0f} B: equal")


def test_all_gather_is_what_the_calculator_prices_for_llama3():
    # the calculator (theory.layout.traffic) prices CP as Llama 3's all-gather:
    # its 128K run, TP 8 x CP 16: 1 of 8 KV heads (128 wide) per TP rank
    run = theory.PUBLISHED_RUNS["llama3-405b-128k"]
    m, lay = theory.MODELS["llama3-405b"], run.layout
    layer = theory.allgather_traffic(run.seq, 1, m.hidden // lay.tp, lay.cp,
                                     heads=m.heads, kv_heads=m.kv_heads)
    # per step: every layer of the stage (ceil(126 / 16) = 8) and micro-batch
    per_step = layer.total * math.ceil(m.layers / lay.pp) * lay.microbatches
    got = run.estimate().traffic["cp"]
    assert got == pytest.approx(per_step), (
        f"calculator {got:,.0f} B per step, closed form {per_step:,.0f}")
    # full recomputation gathers K and V again: the calculator counts it too
    full = theory.estimate(m, dataclasses.replace(lay, recompute="full"),
                           run.cluster, run.global_batch_tokens, run.seq)
    again = dataclasses.replace(
        layer, backward=theory.allgather_traffic(
            run.seq, 1, m.hidden // lay.tp, lay.cp, heads=m.heads,
            kv_heads=m.kv_heads, gathers=2).backward)
    want = again.total * math.ceil(m.layers / lay.pp) * lay.microbatches
    assert full.traffic["cp"] == pytest.approx(want), (
        f"full recomputation: {full.traffic['cp']:,.0f} B, {want:,.0f} expected")


def test_ring_forward_is_an_all_gather_and_its_backward_more():
    s, b, h, n = 8192, 2, 1024, 8
    ring, gather = theory.ring_traffic(s, b, h, n), theory.allgather_traffic(
        s, b, h, n)
    # K and V once around the ring = an all-gather of them: (n-1)/n of 2sbh
    assert ring.forward == gather.forward == 2 * (n - 1) / n * 2 * s * b * h, (
        ring.forward, gather.forward)
    # backward: K, V around again and their gradients n steps home, against
    # one reduce-scatter of the gradients
    assert ring.backward == (2 * n - 1) / (n - 1) * gather.backward, (
        ring.backward, gather.backward)
    assert theory.ring_traffic(s, b, h, 1).total == 0, "one rank sends nothing"


def test_gqa_shrinks_only_the_key_and_value_terms():
    s, b, h, n = 8192, 1, 4096, 8
    mha = theory.context_parallel_traffic(s, b, h, n)
    gqa = theory.context_parallel_traffic(s, b, h, n, heads=32, kv_heads=4)
    for m in ("all-gather", "ring"):  # only K and V travel: 4 of 32 heads
        assert gqa[m].total == mha[m].total / 8, (
            f"{m}: {gqa[m].total:,.0f} B with GQA, {mha[m].total / 8:,.0f} expected")
    # Ulysses: q and the output stay h wide, k and v become h/8
    want = mha["ulysses"].forward * (2 + 2 / 8) / 4
    assert gqa["ulysses"].forward == want, (
        f"ulysses: {gqa['ulysses'].forward:,.0f} B with GQA, {want:,.0f} expected")
    assert set(mha) == set(theory.CP_METHODS), f"{sorted(mha)}: {theory.CP_METHODS}"


@pytest.mark.parametrize("call, message", [
    (lambda: theory.ulysses_traffic(1024, 1, 64, 4, heads=8), "both heads"),
    (lambda: theory.ring_traffic(1024, 1, 64, 4, heads=8, kv_heads=3), "divide"),
    (lambda: theory.allgather_traffic(1024, 1, 64, 0), "cp_size must be"),
    (lambda: theory.allgather_traffic(1024, 1, 64, 4, gathers=0), "gathers"),
])
def test_bad_arguments_raise_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()
