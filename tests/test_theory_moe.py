"""labkit.theory.moe: parameters per FLOP, expert memory and node-limited reach
against DeepSeek-V3's report; the all-to-all bytes of an MoE layer against the
calculator's EP traffic and against what ExpertParallelMoE's ranks write to
their sockets (the traffic ledger), with balanced and with uneven routing."""

import pytest
import torch

from labkit import theory
from labkit.theory import (
    PUBLISHED_RUNS,
    ClusterSpec,
    expert_memory,
    expert_traffic,
    moe_params,
    node_limited_reach,
)

# -- published numbers ------------------------------------------------------------


def test_deepseek_v3_holds_18_times_the_parameters_a_token_uses():
    # DeepSeek-AI 2024, abstract: "671B total parameters with 37B activated for
    # each token"; our active count includes the embedding and head (1.9B)
    p = moe_params("deepseek-v3")
    assert abs(p.total / 671e9 - 1) < 0.01, f"{p.total:,} total, 671B published"
    assert abs(p.active / 37e9 - 1) < 0.02, f"{p.active:,} active, 37B published"
    assert p.total_per_active == pytest.approx(671 / 37, rel=0.03), (
        f"{p.total_per_active:.1f} x, 671/37 = {671 / 37:.1f} published")
    dense = moe_params("llama3-70b")  # dense: every parameter is active
    assert dense.total == dense.active and dense.params_per_flop == 0.5, dense
    assert p.params_per_flop == pytest.approx(p.total / (2 * p.active))


def test_deepseek_v3_experts_per_rank_under_ep64():
    # DeepSeek-AI 2024, sec. 2.1.2 and 4.2: 256 routed experts (and 1 shared) per
    # MoE layer, 58 of them (3 dense); sec. 3.2: EP64 (and PP16)
    m = theory.MODELS["deepseek-v3"]
    assert (m.experts, m.shared_experts, m.experts_per_token) == (256, 1, 8)
    mem = expert_memory("deepseek-v3", ep=64, dtype_bytes=2, pp=16)
    assert mem.experts_per_layer == 4, mem
    routed = 58 * 256 * 3 * 7168 * 2048  # SwiGLU: 3 matrices of h x 2048
    # the busiest of 16 stages holds ceil(58 / 16) = 4 MoE layers, not 3.625
    assert mem.params == routed / 58 * 4 / 64, (mem.params, routed / 58 * 4 / 64)
    assert mem.bytes == 2 * mem.params
    with pytest.raises(ValueError, match="must divide"):
        expert_memory("deepseek-v3", ep=48)
    with pytest.raises(ValueError, match="must divide"):
        expert_memory("llama3-8b", ep=2)


def test_node_limited_routing_reaches_13_experts_for_the_cost_of_4_nodes():
    # DeepSeek-AI 2024, sec. 3.2.2: NVLink 160 GB/s is 3.2 x IB's 50 GB/s, so a
    # token sent to at most 4 nodes can reach "a maximum of 13 experts (4 nodes x
    # 3.2 experts/node)"
    c: ClusterSpec = PUBLISHED_RUNS["deepseek-v3"].cluster
    reach = node_limited_reach(4, c.intra_bw, c.inter_bw)
    assert round(reach) == 13, f"{reach:.1f} experts, 13 published"


def test_calculator_ep_traffic_is_the_layer_formula_per_layer_and_microbatch():
    # the calculator's EP bytes (labkit.theory.layout.costs) are this formula x
    # the MoE layers of a stage x micro-batches; node-limited routing sends a
    # token's 4 node copies over the network, not its 8 experts' (sec. 3.2.2),
    # and 7 in 8 of them go to another of EP 64's 8 nodes (the rest stay inside)
    run = PUBLISHED_RUNS["deepseek-v3"]
    est = run.estimate()
    layer = expert_traffic(run.seq, 4, 7168, 64, dtype_bytes=2, leave=7 / 8)
    moe_layers, m = -(-58 // run.layout.pp), run.layout.microbatches
    assert est.traffic["ep"] == pytest.approx(layer.total * moe_layers * m), (
        f"calculator {est.traffic['ep']:.4g} B, formula "
        f"{layer.total * moe_layers * m:.4g} B")
    assert layer.total == pytest.approx(4 * run.seq * 4 * 7168 * 2 * 7 / 8)


def test_formula_by_hand():
    t = expert_traffic(10, 2, 4, ep=4, dtype_bytes=4, experts=8)
    rows = 10 * 2 * 4 * 4  # bytes of the T·k rows
    assert (t.dispatch, t.combine) == (rows * 3 / 4, rows * 3 / 4), t
    assert t.counts == 8 * 8 * 3 / 4  # E/ep = 2 int64 to each of 3 other ranks
    assert t.forward == t.counts + 2 * rows * 3 / 4 and t.backward == 2 * rows * 3 / 4
    skew = expert_traffic(10, 2, 4, ep=4, dtype_bytes=4, leave=0.5, arrive=1.0)
    assert (skew.dispatch, skew.combine, skew.counts) == (rows / 2, rows, 0.0)
    one = expert_traffic(10, 2, 4, ep=1)
    assert one.total == 0, "one rank sends nothing"
    with pytest.raises(ValueError):
        expert_traffic(10, 2, 4, ep=4, leave=-0.1)


# -- measured: the traffic ledger of ExpertParallelMoE on 4 ranks ----------------------

T, K, H, E, RANKS = 8, 2, 64, 8, 4
# gloo writes a header with each message it sends (measured: 144 bytes a message
# here, 288 a ring step in tests/test_parallel_tensor_parallel.py); allowed: 512
# for each of the ep-1 peers of an all-to-all, on top of the payload
HEADER = 512


def _balanced():
    """Token t to experts 2t and 2t+1 (mod 8), both on rank t mod 4: every rank
    sends T·k/4 rows to each rank, (ep-1)/ep of them away, and gets as many."""
    return torch.tensor([[(2 * t) % E, (2 * t + 1) % E] for t in range(T)])


def _measure(rank, world_size, balanced):
    from labkit.ledger import traffic
    from labkit.parallel import ExpertParallelMoE, MoELayer

    torch.manual_seed(0)
    ep = ExpertParallelMoE.from_moe(MoELayer(H, 2 * H, E, K))
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(rank))
    x.requires_grad_()
    with traffic(ep) as led:
        ep(x, _balanced() if balanced else None).sum().backward()
    return {"records": [(r.op, r.phase, r.dtype, r.elements, r.wire_bytes)
                        for r in led.records], "stats": ep.stats}


@pytest.mark.parametrize("balanced", [True, False], ids=["balanced", "router"])
def test_measured_bytes_per_rank_match_the_closed_form(cluster, balanced):
    res = cluster.run(_measure, balanced).values
    row = H * 4  # float32
    for rank, r in enumerate(res):
        s, recs = r["stats"], r["records"]
        away, back = sum(s.sent) - s.sent[rank], sum(s.received) - s.received[rank]
        # the five all-to-alls: counts, dispatch, combine, then backward the
        # combine's and the dispatch's, each payload with the splits it had
        ops = [(op, phase, dtype) for op, phase, dtype, _, _ in recs]
        assert ops == [("all_to_all", "forward", "int64")] + [
            ("all_to_all", "forward", "float32")] * 2 + [
            ("all_to_all", "backward", "float32")] * 2, ops
        sent = [8 * E * 3 // 4, away * row, back * row, away * row, back * row]
        for (_, phase, _, _, wire), want in zip(recs, sent):
            assert 0 <= wire - want <= (RANKS - 1) * HEADER, (
                f"rank {rank}, {phase}: {wire:,} B written, {want:,} B of rows to "
                f"other ranks + at most {(RANKS - 1) * HEADER} of headers expected")
        form = expert_traffic(T, K, H, RANKS, dtype_bytes=4, experts=E,
                              leave=None if balanced else away / (T * K),
                              arrive=None if balanced else back / (T * K))
        measured = sum(rec[4] for rec in recs)
        assert 0 <= measured - form.total <= 5 * (RANKS - 1) * HEADER, (
            f"rank {rank}: {measured:,} B written per layer, closed form "
            f"{form.total:,.0f} B + at most {5 * (RANKS - 1) * HEADER} of headers")
        assert form.total - form.counts == s.layer_bytes, (rank, s)
        if balanced:  # (ep-1)/ep of the T·k rows leave: 4·T·k·h·b·3/4
            assert s.layer_bytes == 4 * T * K * row * 3 // 4, s
