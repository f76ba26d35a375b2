"""The memory ledger and holdings() on FSDP2 (fully_shard) on 2 gloo ranks: each
rank counts the DTensor shards it holds, checked against numel x element size."""

import gc
import math

import pytest
import torch

import labkit

N = 2
SHAPES = {"even": 64, "odd": 63}  # hidden width: 63 rows do not split in 2


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _bytes(tensors):
    return sum(_local(t).numel() * t.element_size() for t in tensors)


def _padded(params, n):
    """FSDP2 stores each rank's shard padded to ceil(rows / n) rows (dim-0 chunks),
    so every rank holds that many rows of storage, its shard being shorter."""
    return sum(math.ceil(p.shape[0] / n) * math.prod(p.shape[1:]) * p.element_size()
               for p in params)


def _fsdp_adam(hidden):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(),
                                torch.nn.Linear(hidden, 8))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def _measure(rank, world_size, hidden):
    from labkit import ledger

    model, opt = _fsdp_adam(hidden)
    params = list(model.parameters())
    x = torch.randn(4, 64)
    out = {"psi": sum(p.numel() for p in params), "local": _bytes(params),
           "padded": _padded(params, world_size),
           "before": ledger.holdings(model, opt)}
    with ledger.memory(model, opt) as backward_only:
        model(x).sum().backward()
    out["backward_only"] = backward_only
    with ledger.memory(model, opt) as m, ledger.traffic(model) as t:
        model(x).sum().backward()
        opt.step()
        gc.collect()  # FSDP2 can leave its reduce-scatter input in a cycle
    out["one"], out["traffic"] = m, t
    out["state"] = _bytes(v for s in opt.state.values() for k, v in s.items()
                          if k != "step")
    out["counters"] = _bytes(s["step"] for s in opt.state.values())
    out["after"] = ledger.holdings(model, opt)
    with ledger.memory(model, opt) as two:
        for _ in range(2):
            model(x).sum().backward()
            opt.step()
    out["two"] = two
    return out


@pytest.fixture(scope="module")
def runs():
    with labkit.Cluster(N, timeout=60) as c:
        return {name: c.run(_measure, hidden).values
                for name, hidden in SHAPES.items()}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_each_rank_counts_its_local_shards(runs, shape):
    for r in runs[shape]:
        m = r["one"]
        assert m.local_shards and r["after"].local_shards
        assert m.current["Parameter"] == r["padded"]
        assert m.current["Gradient"] == r["padded"]
        assert m.current["Optstate"] == 2 * r["local"] + r["counters"]  # Adam m, v
        assert r["state"] == 2 * r["local"]
        assert r["counters"] == 4 * 4  # one fp32 step counter per parameter tensor
        assert m.current["Temp"] == 0 == m.current["Activation"]
    # the ranks' shards are the whole model: 4 bytes per parameter, split in N
    assert sum(r["local"] for r in runs[shape]) == 4 * runs[shape][0]["psi"]


def test_even_shards_are_exactly_the_local_shards(runs):
    for r in runs["even"]:
        assert r["one"].current["Parameter"] == r["local"] == r["padded"]


def test_odd_shards_hold_fsdp2_padding_on_the_short_rank(runs):
    long, short = runs["odd"]
    assert long["psi"] % N == 1
    assert long["one"].current["Parameter"] == long["local"]
    # rank 1 has 31 of the 63 rows of Linear(64, 63) and its bias, stored as 32
    assert short["one"].current["Parameter"] - short["local"] == (64 + 1) * 4
    assert short["one"].current["Optstate"] == 2 * short["local"] + 16


@pytest.mark.parametrize("shape", list(SHAPES))
def test_holdings_agrees_with_the_ledger(runs, shape):
    for r in runs[shape]:
        assert r["before"] == labkit.ledger.Holdings(r["padded"], 0, 0, 0, True)
        cur, h = r["one"].current, r["after"]
        assert (h.parameter, h.gradient, h.optstate) == (
            cur["Parameter"], cur["Gradient"], cur["Optstate"])


def test_reduce_scattered_gradients_count_without_a_step(runs):
    for r in runs["odd"]:
        m = r["backward_only"]
        assert m.current["Gradient"] == r["padded"] and not m.steps


def test_two_fsdp2_steps_and_the_traffic_beside_them(runs):
    for r in runs["odd"]:
        two = r["two"]
        assert len(two.steps) == 2
        for s in two.steps:
            assert s.current["Optstate"] == r["one"].current["Optstate"]
            assert s.current["Parameter"] == s.current["Gradient"] == r["padded"]
        ops = [rec.op for rec in r["traffic"].records]
        assert ops.count("all_gather") == 4 and ops.count("reduce_scatter") == 2
