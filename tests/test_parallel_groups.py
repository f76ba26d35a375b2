"""labkit.parallel.groups: the rank grid without processes (against picotron's
layout, arange(world).view(dp, pp, cp, tp)), and real groups on 4 ranks whose
all-reduces sum exactly the ranks the grid lists."""

import itertools

import pytest
import torch

from labkit.parallel.groups import DIMS, ParallelGroups, coordinates, grid


def _picotron(world, tp, pp, dp, cp):
    """Groups read off the 4-D tensor view(dp, pp, cp, tp): vary one axis."""
    g = torch.arange(world).view(dp, pp, cp, tp)
    axis = {"dp": 0, "pp": 1, "cp": 2, "tp": 3}
    out = {}
    for d in DIMS:
        moved = g.movedim(axis[d], -1).reshape(-1, g.shape[axis[d]])
        out[d] = sorted(row.tolist() for row in moved)
    return out


SHAPES = [(8, 2, 2, 2, 1), (16, 2, 4, 2, 1), (16, 2, 2, 2, 2), (6, 3, 1, 2, 1),
          (4, 4, 1, 1, 1), (4, 1, 1, 4, 1), (1, 1, 1, 1, 1), (24, 2, 3, 2, 2)]


@pytest.mark.parametrize("world,tp,pp,dp,cp", SHAPES)
def test_grid_is_picotrons_layout(world, tp, pp, dp, cp):
    got = grid(world, tp, pp, dp, cp)
    assert list(got) == list(DIMS)
    assert got == _picotron(world, tp, pp, dp, cp)
    for d, size in zip(DIMS, (tp, cp, pp, dp)):
        assert len(got[d]) == world // size and all(len(g) == size for g in got[d])
        assert sorted(itertools.chain(*got[d])) == list(range(world))  # a partition


def test_grid_by_hand():
    g = grid(8, tp=2, pp=2, dp=2)
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["pp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["cp"] == [[r] for r in range(8)]
    assert coordinates(5, tp=2, pp=2, dp=2) == {"tp": 1, "cp": 0, "pp": 0, "dp": 1}
    assert coordinates(6, tp=2, pp=2, dp=1, cp=2) == {"tp": 0, "cp": 1, "pp": 1,
                                                      "dp": 0}


@pytest.mark.parametrize("world,tp,pp,dp,cp", SHAPES)
def test_coordinates_invert_the_rank_formula(world, tp, pp, dp, cp):
    for r in range(world):
        c = coordinates(r, tp, pp, dp, cp)
        assert ((c["dp"] * pp + c["pp"]) * cp + c["cp"]) * tp + c["tp"] == r
        for d in DIMS:  # the rank sits at its coordinate in its group of that dim
            mine = next(g for g in grid(world, tp, pp, dp, cp)[d] if r in g)
            assert mine.index(r) == c[d]


@pytest.mark.parametrize("args,match", [
    ((8, 2, 2, 1), r"tp\*cp\*pp\*dp = 2\*1\*2\*1 = 4 ranks, but the world has 8"),
    ((8, 3, 1, 3), r"= 9 ranks, but the world has 8"),
    ((8, 0, 2, 2), r"tp must be an integer >= 1, got 0"),
    ((8, 2.0, 2, 2), r"tp must be an integer >= 1, got 2.0"),
])
def test_grid_refuses_a_grid_that_is_not_the_world(args, match):
    with pytest.raises(ValueError, match=match):
        grid(*args)


def _build(rank, world_size, tp, pp, dp, cp):
    import torch.distributed as dist

    g = ParallelGroups.build(tp=tp, pp=pp, dp=dp, cp=cp)
    sums = {}
    for d in DIMS:  # each group's all-reduce sums exactly its own ranks
        x = torch.tensor([float(rank)])
        dist.all_reduce(x, group=getattr(g, f"{d}_group"))
        sums[d] = x.item()
        assert dist.get_rank(getattr(g, f"{d}_group")) == getattr(g, f"{d}_rank")
    fields = {k: getattr(g, k) for k in g.__dataclass_fields__ if "group" not in k}
    return {"str": str(g), "repr": repr(g), "sums": sums, "fields": fields}


@pytest.mark.parametrize("tp,pp,dp,cp", [(2, 1, 2, 1), (1, 2, 2, 1), (2, 1, 1, 2),
                                         (4, 1, 1, 1)])
def test_groups_on_four_ranks(cluster, tp, pp, dp, cp):
    res = cluster.run(_build, tp, pp, dp, cp)
    lists = grid(4, tp, pp, dp, cp)
    for rank, r in enumerate(res):
        c = coordinates(rank, tp, pp, dp, cp)
        for d in DIMS:
            mine = next(g for g in lists[d] if rank in g)
            assert r["sums"][d] == sum(mine)
            assert r["fields"][f"{d}_ranks"] == tuple(mine)
            assert r["fields"][f"{d}_rank"] == c[d]
        cps = f"-CP({cp})" if cp > 1 else ""
        assert r["str"] == f"TP({tp}){cps}-PP({pp})-DP({dp})-Rank({rank})"
        assert r["fields"]["rank"] == rank and r["fields"]["world_size"] == 4


def test_str_shows_sizes_and_repr_coordinates(cluster):
    r = cluster.run(_build, 2, 1, 2, 1)[3]
    assert r["str"] == "TP(2)-PP(1)-DP(2)-Rank(3)"
    assert r["repr"] == "ParallelGroups(TP(2)-PP(1)-DP(2)-Rank(3): tp 1/2, pp 0/1, " \
        "dp 1/2)"


def _frozen(rank, world_size):
    import dataclasses

    g = ParallelGroups.build(tp=2, dp=2)
    try:
        g.tp_size = 4
    except dataclasses.FrozenInstanceError:
        return "frozen"
    return "changed"


def _wrong_size(rank, world_size):
    try:
        ParallelGroups.build(tp=2, pp=1, dp=1)
    except ValueError as e:
        return str(e)


def test_immutable_and_checked(cluster):
    assert cluster.run(_frozen).values == ["frozen"] * 4
    msgs = cluster.run(_wrong_size).values
    assert all("= 2 ranks, but the world has 4" in m for m in msgs)


def test_build_needs_ranks():
    with pytest.raises(RuntimeError, match="inside cluster.run"):
        ParallelGroups.build(tp=1)
