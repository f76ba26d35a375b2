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
        assert r["fields"]["global_rank"] == rank and r["fields"]["world_size"] == 4


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


# -- expert parallelism: ep of the dp ranks, and the replicas of their experts --------

EP_SHAPES = [(4, 1, 1, 4, 1, 2), (8, 2, 1, 4, 1, 2), (8, 1, 2, 4, 1, 4),
             (16, 2, 1, 4, 2, 2), (4, 1, 1, 4, 1, 4)]


def test_expert_groups_by_hand():
    g = grid(4, tp=1, pp=1, dp=4, ep=2)
    assert g["ep"] == [[0, 1], [2, 3]], g["ep"]
    assert g["edp"] == [[0, 2], [1, 3]], g["edp"]
    g = grid(8, tp=2, pp=1, dp=4, ep=2)  # dp groups [0, 2, 4, 6] and [1, 3, 5, 7]
    assert g["ep"] == [[0, 2], [1, 3], [4, 6], [5, 7]], g["ep"]
    assert g["edp"] == [[0, 4], [1, 5], [2, 6], [3, 7]], g["edp"]
    assert coordinates(6, tp=2, pp=1, dp=4, ep=2) == {
        "tp": 0, "cp": 0, "pp": 0, "dp": 3, "ep": 1, "edp": 1}
    # ep = 1, the default: the grid and coordinates of before, nothing added
    assert list(grid(8, 2, 1, 4, ep=1)) == list(DIMS)
    assert list(coordinates(3, 2, 1, 4, ep=1)) == list(DIMS)


@pytest.mark.parametrize("world,tp,pp,dp,cp,ep", EP_SHAPES)
def test_expert_groups_split_each_dp_group(world, tp, pp, dp, cp, ep):
    g = grid(world, tp, pp, dp, cp, ep)
    assert list(g) == list(DIMS) + ["ep", "edp"], list(g)
    for d, size in (("ep", ep), ("edp", dp // ep)):
        assert all(len(x) == size for x in g[d]), (d, g[d])
        assert sorted(itertools.chain(*g[d])) == list(range(world)), (d, g[d])
    for r in range(world):
        c = coordinates(r, tp, pp, dp, cp, ep)
        assert c["dp"] == c["edp"] * ep + c["ep"], (r, c)
        dp_group = next(x for x in g["dp"] if r in x)
        for d in ("ep", "edp"):  # inside its dp group, at its coordinate
            mine = next(x for x in g[d] if r in x)
            assert set(mine) <= set(dp_group) and mine.index(r) == c[d], (r, d, mine)


def test_ep_must_divide_dp():
    with pytest.raises(ValueError, match="ep = 3 must divide dp = 4"):
        grid(4, 1, 1, 4, ep=3)
    with pytest.raises(ValueError, match="ep must be an integer >= 1"):
        coordinates(0, 1, 1, 4, ep=0)


def _build_ep(rank, world_size, tp, dp, ep):
    import torch.distributed as dist

    g = ParallelGroups.build(tp=tp, dp=dp, ep=ep)
    sums = {}
    for d in ("ep", "edp", "dp"):
        x = torch.tensor([float(rank)])
        dist.all_reduce(x, group=getattr(g, f"{d}_group"))
        sums[d] = x.item()
    return {"sums": sums, "ranks": {d: getattr(g, f"{d}_ranks") for d in ("ep", "edp")},
            "at": (g.ep_rank, g.edp_rank, g.edp_size), "str": str(g),
            "coords": g.coords()}


@pytest.mark.parametrize("tp,dp,ep", [(1, 4, 2), (2, 2, 2), (1, 4, 4)])
def test_expert_groups_on_four_ranks(cluster, tp, dp, ep):
    lists = grid(4, tp, 1, dp, ep=ep)
    for rank, r in enumerate(cluster.run(_build_ep, tp, dp, ep)):
        c = coordinates(rank, tp, 1, dp, ep=ep)
        for d in ("ep", "edp"):
            mine = next(x for x in lists[d] if rank in x)
            assert r["ranks"][d] == tuple(mine), (rank, d, r["ranks"][d], mine)
            assert r["sums"][d] == sum(mine), (
                f"rank {rank}: {d} all-reduce summed {r['sums'][d]}, the ranks "
                f"{mine} sum to {sum(mine)}")
        assert r["at"] == (c["ep"], c["edp"], dp // ep), (rank, r["at"], c)
        assert r["str"] == f"TP({tp})-PP(1)-DP({dp})-EP({ep})-Rank({rank})", r["str"]
        assert r["coords"].endswith(f"ep {c['ep']}/{ep}, edp {c['edp']}/{dp // ep}")


def _no_ep(rank, world_size):
    g = ParallelGroups.build(dp=4)
    return (g.ep_size, g.ep_ranks, g.ep_group, g.edp_ranks == g.dp_ranks,
            g.edp_group is g.dp_group, g.ep_rank, g.edp_size, str(g))


def test_without_ep_the_experts_replicas_are_the_dp_group(cluster):
    for rank, r in enumerate(cluster.run(_no_ep)):
        assert r == (1, (rank,), None, True, True, 0, 4,
                     f"TP(1)-PP(1)-DP(4)-Rank({rank})"), r
