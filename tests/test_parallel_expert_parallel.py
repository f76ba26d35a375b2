"""labkit.parallel.expert_parallel and expert_routing: the router, capacity and
balancing by hand in one process; on 4 gloo ranks the all-to-all of uneven
splits (against torch's own autograd all-to-all), ExpertParallelMoE against the
one-process MoELayer on the same routing (outputs, input, router and expert
gradients; k = 1 and 2, capacity drops, node-limited sigmoid routing, a router
that sends everything to one rank's experts), node-limited routing's cross-node
copies, and training with expert data parallelism (ep 2 x 2 replicas) against
one process."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from labkit.numerics import Oracle, rel_err
from labkit.parallel import (
    ExpertParallelMoE,
    MoELayer,
    ParallelGroups,
    Router,
    all_to_all_rows,
    capacity,
    limit_nodes,
    switch_balance_loss,
    sync_expert_data_parallel_grads,
    update_bias,
    within_capacity,
)

pytestmark = pytest.mark.numerics  # run again under other CPUs' kernels

H, FFN, E, T, RANKS = 8, 16, 8, 8, 4  # hidden, expert width, experts, tokens/rank


def _randn(shape, seed, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# -- routing in one process ---------------------------------------------------------


def test_softmax_top_k_renormalised_is_mixtrals_softmax_of_the_top_k():
    # Jiang et al. 2024, sec. 2.1: G(x) = Softmax(TopK(x W_g))
    torch.manual_seed(0)
    router, x = Router(H, E, 2), _randn((T, H), 1)
    r = router(x)
    logits = router.gate(x).detach()
    top = logits.topk(2, dim=-1)
    assert torch.equal(r.experts, top.indices), "the k largest logits chosen"
    exact = top.values.double().softmax(-1)
    Oracle(exact, {"softmax of all, renormalised": r.gates.detach()}).check(
        top.values.softmax(-1), "softmax over the top-k logits")
    assert r.scores.shape == (T, E)


def test_sigmoid_gates_and_a_bias_that_only_chooses():
    # DeepSeek-AI 2024, sec. 2.1.2: sigmoid scores, the k chosen normalised; the
    # balancing bias changes the choice, never the weights
    torch.manual_seed(0)
    router, x = Router(H, E, 2, score="sigmoid"), _randn((T, H), 1)
    before = router(x)
    router.bias[before.experts[0, 0]] = -10.0  # token 0's first choice, forbidden
    after = router(x)
    assert before.experts[0, 0] not in after.experts[0].tolist(), (
        f"token 0 still chose {before.experts[0, 0]} with a bias of -10")
    s = router.gate(x).detach().sigmoid()
    want = s.gather(1, after.experts)
    exact = want.double() / want.double().sum(-1, keepdim=True)
    Oracle(exact, {"one process": want / want.sum(-1, keepdim=True)}).check(
        after.gates.detach(), "gates: the chosen sigmoid scores over their sum")


def test_capacity_and_which_pairs_an_expert_takes():
    assert capacity(1.0, 2, 8, 8) == 2 and capacity(1.25, 2, 8, 8) == 3
    assert capacity(1.0, 1, 10, 4) == math.ceil(10 / 4)
    # 4 tokens, k = 2: every first choice is expert 0, second choices expert 1
    # (token 3's: expert 0). Capacity 2: expert 0 takes tokens 0 and 1's first
    # choices; first choices go before second ones, so token 3's second is out
    ex = torch.tensor([[0, 1], [0, 1], [0, 1], [0, 0]])
    keep = within_capacity(ex, 3, 2)
    assert keep.tolist() == [[True, True], [True, True], [False, False],
                             [False, False]], keep.tolist()
    assert within_capacity(ex, 3, None).all()
    with pytest.raises(ValueError, match="capacity factor"):
        capacity(0, 2, 8, 8)


def test_switch_loss_is_alpha_when_balanced_and_grows_with_skew():
    # Fedus et al. 2021, eq. 4: alpha * E * sum f_i P_i; uniform f = P = 1/E
    from labkit.parallel import Routing

    uniform = Routing(torch.arange(E).view(E, 1), torch.ones(E, 1),
                      torch.full((E, E), 1.0 / E))
    assert switch_balance_loss(uniform).item() == pytest.approx(1e-2, rel=1e-6)
    torch.manual_seed(0)
    router = Router(H, E, 2)
    with torch.no_grad():
        router.gate.weight[0] += 3.0  # every token prefers expert 0
    r = router(_randn((4 * T, H), 1) + 1.0)
    loss = switch_balance_loss(r)
    assert loss.item() > 1.5e-2, f"skewed router: loss {loss.item():.3g}, > 0.015"
    loss.backward()
    assert router.gate.weight.grad.abs().sum() > 0, "no gradient reached the gate"


def test_loss_free_bias_moves_against_the_load():
    router = Router(H, 4, 1)
    bias = update_bias(router, torch.tensor([5, 1, 2, 0]), gamma=0.1)
    # mean load 2: expert 0 over (-γ), 1 and 3 under (+γ), 2 at the mean (0)
    assert bias.tolist() == pytest.approx([-0.1, 0.1, 0.0, 0.1])


def test_node_limited_choice_lies_in_at_most_m_nodes():
    torch.manual_seed(0)
    scores = _randn((64, 16), 3).sigmoid()
    masked = limit_nodes(scores, nodes=4, max_nodes=2, k=4)
    chosen = masked.topk(4, dim=-1).indices
    nodes = (chosen // 4).tolist()
    assert max(len(set(n)) for n in nodes) <= 2, "a token on more than M=2 nodes"
    # a node's score is its 2 best experts' sum: the masked rows keep the top 2
    per_node = scores.view(64, 4, 4).topk(2, -1).values.sum(-1)
    best = per_node.topk(2, -1).indices.sort(-1).values
    kept = (masked.view(64, 4, 4)[..., 0] > float("-inf")).nonzero()[:, 1].view(64, 2)
    assert torch.equal(kept, best), "the nodes kept are not the 2 best"
    router = Router(H, 16, 4, nodes=4, max_nodes=1)
    assert (router(_randn((32, H), 1)).experts // 4).unique(dim=1).shape[1] == 1


@pytest.mark.parametrize("kw,match", [
    ({"k": 9}, "k = 9 experts per token out of 8"),
    ({"score": "relu"}, "score must be one of"),
    ({"nodes": 3}, "nodes must divide the experts"),
    ({"nodes": 2, "max_nodes": 3}, "1 <= max_nodes <= nodes"),
    ({"k": 3, "nodes": 2, "max_nodes": 2}, "M must divide k"),
    ({"k": 1, "normalize": True}, r"one gate normalised is always 1"),
])
def test_router_refuses_what_it_cannot_route(kw, match):
    args = {"k": 2} | kw
    with pytest.raises(ValueError, match=match):
        Router(H, E, **args)


@pytest.mark.parametrize("k", [1, 2])
def test_the_gate_learns_from_the_output_with_its_default_gates(k):
    # top-k is not differentiable: the gate's gradient comes through the gates
    # alone. k = 1 keeps the probability (Switch), k > 1 normalises the chosen
    # (Mixtral); normalising one gate would leave it 1 and the gradient 0
    router, x = Router(H, E, k), _randn((T, H), 1)
    assert router.normalize == (k > 1)
    routing = router(x)
    (routing.gates * _randn(tuple(routing.gates.shape), 2)).sum().backward()
    norm = router.gate.weight.grad.norm().item()
    assert norm > 1e-3, f"k = {k}: the gate's gradient norm is {norm:.2e}"
    forced = Router(H, E, 1, normalize=False)
    forced.normalize = True  # what the constructor refuses, to show why
    forced(x).gates.sum().backward()
    left = forced.gate.weight.grad.norm().item()  # p/p: 0 up to rounding
    assert left < 1e-5 * max(norm, 1.0), (
        f"one normalised gate: gradient norm {left:.2e}, against {norm:.2e} with "
        f"k = {k}'s own gates; rounding only (< 1e-5 of it) expected")


def test_forced_routing_must_be_one_row_of_k_experts_per_token():
    # 5 rows for 8 tokens had gathered 5 gates, and tokens 5-7 came out as zeros
    torch.manual_seed(0)
    layer, x = MoELayer(H, FFN, E, 2), _randn((T, H), 1)
    with pytest.raises(ValueError, match=r"experts has shape \(5, 2\) for x of "
                       r"shape \(8, 8\): one row of k = 2 experts per token, "
                       r"\(8, 2\), expected"):
        layer(x, torch.tensor([[0, 1]] * 5))
    for bad, match in ((torch.tensor([[0, 1, 2]] * T), r"has shape \(8, 3\)"),
                       (torch.tensor([[0, 8]] * T), r"ids from 0 to 8, but this "
                        r"router has 8 experts: ids in \[0, 8\)"),
                       (torch.tensor([[0, -1]] * T), r"ids from -1 to 0"),
                       (torch.tensor([[0.0, 1.0]] * T), r"is a torch.float32 tensor"),
                       ([[0, 1]] * T, r"is a list; give an integer tensor")):
        with pytest.raises(ValueError, match=match):
            layer.router(x, bad)
    r = layer.router(x, torch.tensor([[0, 1]] * T, dtype=torch.int32))
    assert r.experts.dtype == torch.int64 and r.gates.shape == (T, 2)


@pytest.mark.parametrize("factor", [float("nan"), float("inf"), -float("inf"), 0,
                                    -1.25, True, "1.25"])
def test_capacity_factor_must_be_finite_and_positive(factor):
    # NaN was "cannot convert float NaN to integer" from math.ceil, inf an
    # OverflowError; a layer took either and failed at its first forward
    says = r"the capacity factor must be a finite number > 0 \(None: no capacity"
    with pytest.raises(ValueError, match=says):
        capacity(factor, 2, T, E)
    with pytest.raises(ValueError, match=says):
        MoELayer(H, FFN, E, 2, capacity_factor=factor)


def test_capacity_and_routing_refuse_what_they_cannot_count():
    with pytest.raises(ValueError, match=r"capacity factor 1e\+308 x k = 2 x 8 "
                       r"tokens / 8 experts is past float's range: give a smaller "
                       r"factor \(c = E/k = 4 already"):
        capacity(1e308, 2, T, E)
    assert capacity(1e300, 2, T, E) == math.ceil(1e300 * 2)  # large, finite: kept
    for args, match in (((1.0, 0, T, E), "capacity: k must be an integer >= 1"),
                        ((1.0, 2, -1, E), "tokens must be an integer >= 0"),
                        ((1.0, 2, T, 0), "experts must be an integer >= 1")):
        with pytest.raises(ValueError, match=match):
            capacity(*args)
    chosen = torch.tensor([[0, 1], [0, 1]])
    for cap in (-1, float("nan"), 2.5):
        with pytest.raises(ValueError, match=r"cap, the pairs an expert takes, "
                           r"must be an integer >= 0, got"):
            within_capacity(chosen, E, cap)
    assert not within_capacity(chosen, E, 0).any()  # capacity 0: every pair out
    with pytest.raises(ValueError, match=r"ids from 0 to 9.*ids in \[0, 8\)"):
        within_capacity(torch.tensor([[0, 9]]), E, 1)
    with pytest.raises(ValueError, match="Router: nodes must be an integer >= 1"):
        Router(H, E, 2, nodes=0)  # was a ZeroDivisionError
    with pytest.raises(ValueError, match="Router: experts must be an integer"):
        Router(H, -8, 2)
    router = Router(H, E, 2)
    routing = router(_randn((T, H), 1))
    for alpha in (float("nan"), float("inf"), -0.01):
        with pytest.raises(ValueError, match="alpha must be a finite number >= 0"):
            switch_balance_loss(routing, alpha)
    for gamma in (float("nan"), -1e-3):
        with pytest.raises(ValueError, match="gamma must be a finite number >= 0"):
            update_bias(router, routing.load(), gamma)
    assert not router.bias.isnan().any(), "a refused gamma changed the bias"


def test_one_process_layer_is_the_weighted_sum_of_its_experts():
    def run(dtype):
        torch.manual_seed(0)
        layer = MoELayer(H, FFN, E, 2).to(dtype)
        x = _randn((T, H), 1, dtype)
        y = layer(x)
        r = layer.routing
        loop = torch.stack([sum(r.gates[t, j] * layer.experts[int(r.experts[t, j])](
            x[t]) for j in range(2)) for t in range(T)])
        return y.detach(), loop.detach(), r.experts

    y, loop, chosen = run(torch.float32)
    y64, _, chosen64 = run(torch.float64)
    assert torch.equal(chosen, chosen64), "float32 and float64 chose differently"
    Oracle(y64, {"token by token": loop}).check(y, "MoELayer against a loop")


# -- on 4 ranks: the all-to-all ---------------------------------------------------

SPLITS = [[0, 3, 1, 0], [2, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 5]]  # rank -> sends


def _all_to_all(rank, world_size):
    import torch.distributed as dist
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    send = SPLITS[rank]
    receive = [SPLITS[q][rank] for q in range(world_size)]
    out = {}
    for name in ("ours", "torch"):
        x = (torch.arange(sum(send) * 2.0).view(-1, 2) + 100 * rank).requires_grad_()
        if name == "ours":
            y = all_to_all_rows(x, send, receive)
        else:  # torch 2.13's, what torchtitan's ExpertParallel called
            y = all_to_all_single_autograd(x, receive, send, dist.group.WORLD)
        y.backward(torch.arange(y.numel() * 1.0).view_as(y) * (rank + 1))
        # torch's y is an AsyncCollectiveTensor: a copy waits for the collective
        # (sent as it is, it may carry the buffer before the rows arrived)
        out[name] = (y.detach().clone(), x.grad)
    return out


def test_all_to_all_of_uneven_and_empty_splits(cluster):
    res = cluster.run(_all_to_all).values
    for rank, r in enumerate(res):
        # rows come from each rank q in rank order: q's rows for this rank
        want = []
        for q in range(RANKS):
            start = sum(SPLITS[q][:rank])
            rows = torch.arange(sum(SPLITS[q]) * 2.0).view(-1, 2) + 100 * q
            want.append(rows[start:start + SPLITS[q][rank]])
        y, dx = r["ours"]
        assert type(r["torch"][0]) is torch.Tensor, type(r["torch"][0])  # waited
        assert torch.equal(y, torch.cat(want)), f"rank {rank}: rows {y.tolist()}"
        assert dx.shape == (sum(SPLITS[rank]), 2), f"rank {rank}: {dx.shape}"
        for name in ("forward", "backward"):  # data moved, nothing added: exact
            i = name == "backward"
            assert torch.equal(r["ours"][i], r["torch"][i]), (
                f"rank {rank}: our {name} differs from torch's "
                "all_to_all_single_autograd (both only move rows)")
    # backward: each row's gradient came home from where it went, in its place
    for rank, r in enumerate(res):
        want = []
        for q in range(RANKS):  # rank q's y: rows from ranks 0..q-1 come first
            at = sum(SPLITS[s][q] for s in range(rank))
            rows = sum(SPLITS[s][q] for s in range(RANKS))
            grad = torch.arange(rows * 2.0).view(-1, 2) * (q + 1)
            want.append(grad[at:at + SPLITS[rank][q]])
        assert torch.equal(r["ours"][1], torch.cat(want)), (
            f"rank {rank}: input gradient {r['ours'][1].tolist()}")


def _unpaired(rank, world_size):
    """Each rank sends its 2 rows to the next; one rank's sizes are off."""
    from labkit.ledger import traffic

    x = torch.full((2, 3), float(rank))
    out = {}
    for case in ("expects more", "expects fewer", "sizes over x", "3 sizes", "ok"):
        send, receive = [0] * world_size, [0] * world_size
        send[(rank + 1) % world_size] = receive[(rank - 1) % world_size] = 2
        if rank == 1 and case == "expects more":  # gloo gave an unwritten row
            receive[0] = 3
        if rank == 1 and case == "expects fewer":  # gloo aborted every rank
            receive[0] = 1
        if rank == 2 and case == "sizes over x":
            send[3] = 3
        if rank == 2 and case == "3 sizes":
            receive = receive[:3]
        try:
            with traffic() as led:
                y = all_to_all_rows(x, send, receive)
            out[case] = (y, [(r.op, r.bus_bytes) for r in led.records])
        except ValueError as e:
            out[case] = str(e)
    return out


def test_all_to_all_sizes_that_do_not_pair_up_are_refused_on_every_rank(cluster):
    res = cluster.run(_unpaired).values
    says = {"expects more": "rank 0 sends 2 rows to rank 1, which expects 3",
            "expects fewer": "rank 0 sends 2 rows to rank 1, which expects 1",
            "sizes over x": "rank 2's send sizes [0, 0, 0, 3] add up to 3 rows, but "
                            "its x has 2",
            "3 sizes": "rank 2 gave 3 receive sizes for a group of 4 ranks"}
    for case, part in says.items():
        for rank, r in enumerate(res):
            assert isinstance(r[case], str), (
                f"{case}, rank {rank}: no error, received {r[case][0].tolist()}")
            assert part in r[case] and "raised on every rank, before any row " \
                "moved" in r[case], f"{case}, rank {rank}: {r[case]}"
            assert r[case] == res[0][case], f"{case}: rank {rank}'s words differ"
    assert "exchange the counts first" in res[0]["expects more"]
    # the check is one all-to-all of every rank's plan (5 + 2N int64) before
    # the rows': the rows' bytes are what they were
    n, row = RANKS, 3 * 4
    for rank, r in enumerate(res):
        y, records = r["ok"]
        assert torch.equal(y, torch.full((2, 3), float((rank - 1) % n))), rank
        assert records == [("all_to_all", 8 * (5 + 2 * n) * (n - 1)),
                           ("all_to_all", 2 * row)], f"rank {rank}: {records}"
    assert cluster.run(lambda r, w: r).values == [0, 1, 2, 3]  # no rank died


def _moe_calls(rank, world_size):
    from labkit.ledger import traffic

    ep = ExpertParallelMoE.from_moe(_layer({"k": 2}))
    x = _randn((T, H), 10 + rank).requires_grad_()
    with traffic(ep) as led:
        ep(x).backward(_randn((T, H), 20 + rank))
    return [(r.op, r.phase) for r in led.records]


def test_the_moe_layer_makes_no_size_check_call(cluster):
    # its receive sizes come from the counts it exchanged: chapter 12 holds it
    # to three all-to-alls forward (counts, rows, rows back), two backward
    for rank, calls in enumerate(cluster.run(_moe_calls).values):
        assert calls == [("all_to_all", "forward")] * 3 + [
            ("all_to_all", "backward")] * 2, f"rank {rank}: {calls}"


# -- on 4 ranks: ExpertParallelMoE against the one-process layer ---------------------

# name: (MoELayer keyword arguments, a forced routing or None: the router's)
CASES = {
    "k=2": ({"k": 2}, None),
    "k=1, Switch's gate": ({"k": 1, "normalize": False}, None),
    "k=2, capacity factor 1": ({"k": 2, "capacity_factor": 1.0}, None),
    "sigmoid, one node of two": ({"k": 2, "score": "sigmoid", "nodes": 2,
                                  "max_nodes": 1}, None),
    # every token to experts 0 and 1: rank 0 computes all, ranks 1-3 receive none
    "everything to rank 0": ({"k": 2}, torch.tensor([[0, 1]] * T)),
}


def _layer(kw, dtype=torch.float32):
    torch.manual_seed(0)
    kw = dict(kw)
    return MoELayer(H, FFN, E, kw.pop("k"), **kw).to(dtype)


def _grads(layer, experts):
    return {f"{i}.{n}": p.grad.clone() for i in experts
            for n, p in layer.experts[i].named_parameters()}


def _one_process(kw, forced, dtype, choices=None):
    """The layer in one process on each rank's quarter of the batch in turn
    (capacity counts one quarter's tokens, as a rank does): outputs, input
    grads and router grads per quarter, expert grads over all four."""
    layer = _layer(kw, dtype)
    out = {"y": [], "dx": [], "router": [], "choices": [], "stats": []}
    for q in range(RANKS):
        x = _randn((T, H), 10 + q, dtype).requires_grad_()
        pick = forced if forced is not None else (
            None if choices is None else choices[q])
        y = layer(x, pick)
        y.backward(_randn((T, H), 20 + q, dtype))
        out["y"].append(y.detach())
        out["dx"].append(x.grad)
        out["router"].append(layer.router.gate.weight.grad.clone())
        layer.router.gate.weight.grad = None
        out["choices"].append(layer.routing.experts)
        out["stats"].append(layer.stats)
    out["experts"] = _grads(layer, range(E))
    return out


def _expert_parallel(rank, world_size):
    out = {}
    for name, (kw, forced) in CASES.items():
        ep = ExpertParallelMoE.from_moe(_layer(kw))
        x = _randn((T, H), 10 + rank).requires_grad_()
        y = ep(x, forced)
        y.backward(_randn((T, H), 20 + rank))
        local = E // world_size
        out[name] = {"y": y.detach(), "dx": x.grad,
                     "router": ep.router.gate.weight.grad,
                     "experts": {f"{rank * local + i}.{n}": p.grad
                                 for i, f in enumerate(ep.experts)
                                 for n, p in f.named_parameters()},
                     "choices": ep.routing.experts, "stats": ep.stats}
    return out


@pytest.fixture(scope="module")
def expert_parallel(cluster):
    return cluster.run(_expert_parallel).values


def _mine(ref, rank):
    """What rank `rank` holds of a one-process run."""
    local = E // RANKS
    names = [k for k in ref["experts"] if int(k.split(".")[0]) // local == rank]
    return {"y": ref["y"][rank], "dx": ref["dx"][rank],
            "router": ref["router"][rank],
            "experts": {k: ref["experts"][k] for k in names}}


@pytest.mark.parametrize("case", list(CASES))
def test_expert_parallel_equals_one_process(expert_parallel, case):
    kw, forced = CASES[case]
    one = _one_process(kw, forced, torch.float32)
    exact = _one_process(kw, forced, torch.float64, one["choices"])
    for q in range(RANKS):
        assert torch.equal(exact["choices"][q], one["choices"][q]), case
    for rank, res in enumerate(expert_parallel):
        r, where = res[case], f"{case}, rank {rank}"
        # the router ran on the same rows with the same weights: the same choice
        assert torch.equal(r["choices"], one["choices"][rank]), (
            f"{where}: experts chosen {r['choices'].tolist()}, one process "
            f"chose {one['choices'][rank].tolist()}")
        got = {k: r[k] for k in ("y", "dx", "router", "experts")}
        oracle = Oracle(_mine(exact, rank), {"one process": _mine(one, rank)})
        oracle.check(got, f"{where}: output, input, router and expert gradients")
        wrong = dict(got, y=torch.zeros_like(got["y"]))  # as if no expert ran
        oracle.resolves(wrong, f"{where}: a zero output")
        s, want = r["stats"], one["stats"][rank]
        assert (s.routed, s.dropped, s.capacity) == (want.routed, want.dropped,
                                                      want.capacity), (
            f"{where}: routed/dropped/capacity {s.routed}, {s.dropped}, "
            f"{s.capacity}; one process {want.routed}, {want.dropped}, "
            f"{want.capacity}")


def test_expert_parallel_accounting(expert_parallel):
    stats = {c: [r[c]["stats"] for r in expert_parallel] for c in CASES}
    for case, per_rank in stats.items():
        for rank, s in enumerate(per_rank):
            # what q sends r is what r receives from q; every kept pair travels
            for q in range(RANKS):
                assert s.received[q] == per_rank[q].sent[rank], (case, rank, q)
            kept = sum(s.routed) - s.dropped
            assert sum(s.sent) == kept, (
                f"{case}, rank {rank}: {sum(s.sent)} rows sent, {kept} kept pairs")
            assert sum(s.expert_rows) == sum(s.received), (case, rank)
    capped = stats["k=2, capacity factor 1"]
    assert all(s.capacity == 2 for s in capped), [s.capacity for s in capped]
    assert sum(s.dropped for s in capped) > 0, "capacity 1 dropped nothing"
    zero = stats["everything to rank 0"]
    assert zero[0].expert_rows == (2 * T * RANKS // 2,) * 2, zero[0].expert_rows
    for s in zero[1:]:  # received nothing, ran their experts on empty batches
        assert s.received == (0,) * RANKS and s.expert_rows == (0, 0), s
    for rank, res in enumerate(expert_parallel[1:], start=1):
        g = res["everything to rank 0"]["experts"]
        assert all(not v.any() for v in g.values()), (
            f"rank {rank}: an expert that saw no token has a nonzero gradient")


def _bad_split(rank, world_size):
    try:
        ExpertParallelMoE.from_moe(MoELayer(H, FFN, 6, 2))
    except ValueError as e:
        return str(e)


def test_experts_must_split_over_the_group(cluster):
    for msg in cluster.run(_bad_split).values:
        assert msg and "6 experts do not split over the 4 ranks" in msg, msg


# -- node-limited routing: copies that cross nodes ----------------------------------

def _cross_node(rank, world_size):
    out = {}
    for m in (4, 2, 1):  # four nodes of one rank; at most m nodes a token
        torch.manual_seed(0)
        layer = MoELayer(H, FFN, 16, 4, score="sigmoid", nodes=4, max_nodes=m)
        ep = ExpertParallelMoE.from_moe(layer, ranks_per_node=1)
        ep(_randn((4 * T, H), 10 + rank)).sum().backward()
        nodes = (ep.routing.experts // 4).tolist()
        out[m] = {"stats": ep.stats, "most": max(len(set(n)) for n in nodes)}
    return out


def test_node_limited_routing_crosses_fewer_nodes(cluster):
    res = cluster.run(_cross_node).values
    total = {m: sum(r[m]["stats"].cross_node_bytes(one_copy_per_node=True)
                    for r in res) for m in (4, 2, 1)}
    rows = {m: sum(r[m]["stats"].cross_node_bytes() for r in res) for m in (4, 2, 1)}
    for m in (4, 2, 1):
        assert max(r[m]["most"] for r in res) <= m, f"a token on more than {m} nodes"
        for rank, r in enumerate(res):
            s = r[m]["stats"]
            # one node per rank: every row to another rank crosses a node
            assert s.cross_node_rows == sum(s.sent) - s.sent[rank], (m, rank)
            assert s.cross_node_tokens <= s.tokens * min(m, 3), (m, rank, s)
    assert total[1] < total[2] < total[4], (
        f"one copy per node: {total} bytes by M; fewer nodes should send fewer")
    assert rows[1] > 0.5 * rows[4], (
        f"a row per pair: {rows} bytes by M; node limiting alone saves little")


# -- expert data parallelism: ep 2 x 2 replicas, trained ----------------------------

STEPS, LR = 3, 0.1


class _Net(nn.Module):
    """A dense layer, then an MoE layer with a residual."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(H, H)
        self.moe = MoELayer(H, FFN, 4, 2)
        self.to(dtype)

    def forward(self, x):
        h = self.inp(x)
        return h + self.moe(h)


def _batch(dtype):
    return _randn((RANKS * T, H), 30, dtype), _randn((RANKS * T, H), 31, dtype)


def _train_one(dtype, parts):
    """SGD on the whole batch: its gradient summed from `parts` equal parts."""
    net, (x, target) = _Net(dtype), _batch(dtype)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    n = RANKS * T // parts
    for _ in range(STEPS):
        opt.zero_grad()
        for p in range(parts):
            sl = slice(p * n, (p + 1) * n)
            (F.mse_loss(net(x[sl]), target[sl]) / parts).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def _train_expert_dp(rank, world_size):
    g = ParallelGroups.build(dp=4, ep=2)
    net = _Net()
    net.moe = ExpertParallelMoE.from_moe(net.moe, g.ep_group)
    x, target = _batch(torch.float32)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    mine = slice(rank * T, (rank + 1) * T)
    for _ in range(STEPS):
        opt.zero_grad()
        F.mse_loss(net(x[mine]), target[mine]).backward()
        sync_expert_data_parallel_grads(net, g)
        opt.step()
    state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    return {"state": state, "ep": g.ep_ranks, "edp": g.edp_ranks,
            "ep_rank": g.ep_rank, "str": str(g)}


def _held(state, ep_rank):
    """The entries of a one-process state dict that rank `ep_rank` of an expert
    group of 2 holds: experts 2·ep_rank and 2·ep_rank + 1, as its 0 and 1."""
    out = {}
    for k, v in state.items():
        if k.startswith("moe.experts."):
            i = int(k.split(".")[2])
            if i // 2 != ep_rank:
                continue
            k = f"moe.experts.{i % 2}." + k.split(".", 3)[3]
        out[k] = v
    return out


def test_expert_data_parallel_training_equals_one_process(cluster):
    res = cluster.run(_train_expert_dp).values
    exact = _train_one(torch.float64, 1)
    one = {"whole batch": _train_one(torch.float32, 1),
           "4 quarters": _train_one(torch.float32, RANKS)}
    start = {k: v.detach() for k, v in _Net().state_dict().items()}
    for rank, r in enumerate(res):
        assert r["ep"] == ((0, 1), (0, 1), (2, 3), (2, 3))[rank], r["ep"]
        assert r["edp"] == ((0, 2), (1, 3), (0, 2), (1, 3))[rank], r["edp"]
        def held(state, i=r["ep_rank"]):
            return _held(state, i)

        assert r["state"].keys() == held(exact).keys(), (
            f"rank {rank} holds {sorted(r['state'])}")
        oracle = Oracle(held(exact), {n: held(s) for n, s in one.items()})
        oracle.check(r["state"], f"rank {rank} ({r['str']}): weights after "
                                 f"{STEPS} SGD steps")
        oracle.resolves(held(start), f"rank {rank}: the untrained weights")
    for a, b in ((0, 2), (1, 3)):  # replicas: the same update, bit for bit
        for k, v in res[a]["state"].items():
            assert torch.equal(v, res[b]["state"][k]), (
                f"ranks {a} and {b} hold replicas, but {k} differs by "
                f"{rel_err(v, res[b]['state'][k]):.1e}")


def test_stats_print_in_one_line(expert_parallel):
    s = expert_parallel[1]["k=2"]["stats"]
    kept = sum(s.routed) - s.dropped
    assert str(s) == (f"rank 1: {T} tokens, {kept} pairs kept (0 dropped); rows "
                      f"sent {s.sent}, received {s.received}; its experts ran "
                      f"{s.expert_rows}"), str(s)
