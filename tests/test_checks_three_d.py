"""labkit.checks.three_d.check_ring_seconds: a right answer passes, a stub is
"not written yet", and each common slip is named (no ranks: a closed form)."""

import pytest

from labkit import theory
from labkit.checks.common import ExerciseError
from labkit.checks.three_d import check_ring_seconds


def right(op, size, n, nodes, cl):
    inter = theory.latency_steps(op, nodes) if nodes > 1 else 0
    bw = cl.intra_bw if nodes == 1 else cl.inter_bw
    return ((theory.latency_steps(op, n) - inter) * cl.alpha_intra
            + inter * cl.alpha_inter + theory.ring_bytes_per_rank(op, size, n) / bw)


def test_right_answer_passes(capsys):
    assert check_ring_seconds(right)
    assert "correct" in capsys.readouterr().out


def test_stub_is_not_written_yet(capsys):
    def stub(*args):
        raise NotImplementedError("exercise: the α-β seconds of a ring")

    assert not check_ring_seconds(stub)
    assert "not written yet" in capsys.readouterr().out


def _bytes_only(op, size, n, nodes, cl):
    return theory.ring_bytes_per_rank(op, size, n) / (
        cl.intra_bw if nodes == 1 else cl.inter_bw)


def _all_network_alpha(op, size, n, nodes, cl):  # every step at alpha_inter
    bw = cl.intra_bw if nodes == 1 else cl.inter_bw
    return (theory.latency_steps(op, n) * cl.alpha_inter
            + theory.ring_bytes_per_rank(op, size, n) / bw)


def _nvlink_everywhere(op, size, n, nodes, cl):  # bytes at intra_bw across nodes
    inter = theory.latency_steps(op, nodes) if nodes > 1 else 0
    return ((theory.latency_steps(op, n) - inter) * cl.alpha_intra
            + inter * cl.alpha_inter
            + theory.ring_bytes_per_rank(op, size, n) / cl.intra_bw)


@pytest.mark.parametrize("answer, where, hint", [
    (_bytes_only, "n=8, nodes=1", "the bytes alone: every ring step also pays α"),
    (_all_network_alpha, "n=8, nodes=1", "every step paid the network's α"),
    (_nvlink_everywhere, "n=16, nodes=2", "at the network's inter_bw"),
    (lambda *a: 2 * right(*a), "n=8, nodes=1", "theory.latency_steps(op, n)"),
    (lambda *a: "fast", "n=8, nodes=1", "return seconds, a number"),
])
def test_each_slip_is_named(answer, where, hint):
    with pytest.raises(ExerciseError, match="my_ring_seconds") as e:
        check_ring_seconds(answer)
    assert where in str(e.value) and hint in str(e.value)


def test_an_exception_is_reported_not_raised():
    with pytest.raises(ExerciseError, match="raised ZeroDivisionError"):
        check_ring_seconds(lambda *a: 1 / 0)


# ------------------------------------------- my_peers for any order of the dims

def _peers_any_order(rank, dims):
    sizes = list(dims.values())
    out = {}
    for k, name in enumerate(dims):
        stride = 1
        for n in sizes[k + 1:]:
            stride *= n
        coord = rank // stride % sizes[k]
        out[name] = [rank + (i - coord) * stride for i in range(sizes[k])]
    return out


def _tp_always_innermost(rank, dims):  # the chapter's order, whatever dims says
    t, p = dims.get("tp", 1), dims.get("pp", 1)
    out = {}
    for name, stride in (("tp", 1), ("pp", t), ("dp", t * p)):
        if name in dims:
            coord = rank // stride % dims[name]
            out[name] = [rank + (i - coord) * stride for i in range(dims[name])]
    return out


def test_peers_any_order_right_answer_passes(capsys):
    from labkit.checks.three_d import check_peers_any_order

    assert check_peers_any_order(_peers_any_order)
    assert "correct" in capsys.readouterr().out


def test_peers_any_order_matches_device_mesh_layout():
    # the reference is torch's row-major layout: arange(world).reshape(sizes)
    import torch

    from labkit.checks.three_d import ORDER_CASES, mesh_groups

    for dims in ORDER_CASES:
        sizes = list(dims.values())
        grid = torch.arange(int(torch.tensor(sizes).prod())).reshape(sizes)
        for rank in range(grid.numel()):
            where = (grid == rank).nonzero()[0].tolist()
            for k, name in enumerate(dims):
                idx = list(where)
                idx[k] = slice(None)
                assert mesh_groups(rank, dims)[name] == grid[tuple(idx)].tolist()


@pytest.mark.parametrize("answer, hint", [
    (_tp_always_innermost, "the last dimension named is the innermost"),
    (lambda r, d: {"tp": [r]}, "return a dict with the keys"),
    (lambda r, d: None, "return a dict with the keys"),
])
def test_peers_any_order_slips_are_named(answer, hint):
    from labkit.checks.three_d import check_peers_any_order

    with pytest.raises(ExerciseError, match="my_peers") as e:
        check_peers_any_order(answer)
    assert hint in str(e.value)


def test_peers_any_order_stub_is_not_written_yet(capsys):
    from labkit.checks.three_d import check_peers_any_order

    def stub(rank, dims):
        raise NotImplementedError("exercise")

    assert not check_peers_any_order(stub)
    assert "not written yet" in capsys.readouterr().out


# ------------------------------------------------------- my_traffic_ratios

RIGHT_RATIOS = {"tp": 1.0, "pp": 1.0,
                "cp": 2 * (31 / 32) / (15 / 16),   # twice the micro-batches
                "dp": (32 + 1) / (16 + 1)}         # ZeRO-2: RS per micro-batch


def test_traffic_ratios_right_answer_passes(capsys):
    from labkit.checks.three_d import check_traffic_ratios

    assert check_traffic_ratios(lambda: dict(RIGHT_RATIOS))
    assert "correct" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, dim, hint", [
    ({"tp": 0.5}, "tp", "32 micro-batches"),
    ({"cp": 1.0}, "cp", "twice the micro-batches"),
    ({"dp": 1.0}, "dp", "after every micro-batch's backward"),
    ({"dp": 2.0}, "dp", "once per step"),
    ({"pp": "same"}, "pp", "return a number"),
])
def test_traffic_ratios_slips_are_named(wrong, dim, hint):
    from labkit.checks.three_d import check_traffic_ratios

    with pytest.raises(ExerciseError, match=dim) as e:
        check_traffic_ratios(lambda: RIGHT_RATIOS | wrong)
    assert hint in str(e.value)


def test_traffic_ratios_wants_every_dimension():
    from labkit.checks.three_d import check_traffic_ratios

    with pytest.raises(ExerciseError, match="keys"):
        check_traffic_ratios(lambda: {"tp": 1.0})
