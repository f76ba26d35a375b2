"""The rank grid of combined parallelism: which ranks share a tensor-, context-,
pipeline-, data- (or expert-) parallel group, and this rank's place in it.

    g = ParallelGroups.build(tp=2, pp=2, dp=2)      # on every rank, same arguments
    str(g)            'TP(2)-PP(2)-DP(2)-Rank(5)'    sizes, then the global rank
    layer = ColumnParallelLinear(h, 4 * h, g.tp_group)

Imports labkit.theory. Ranks are numbered tp innermost, then cp, pp, dp outermost
(rank = ((dp_i * pp + pp_i) * cp + cp_i) * tp + tp_i), as picotron lays them out.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.theory import check_counts

# innermost first: tensor-parallel ranks are neighbours (they talk the most)
DIMS = ("tp", "cp", "pp", "dp")
EXPERT_DIMS = ("ep", "edp")  # inside dp, with ep > 1: dp_i = edp_i * ep + ep_i


def _sizes(world_size: int, tp: int, pp: int, dp: int, cp: int) -> dict[str, int]:
    sizes = {"tp": tp, "cp": cp, "pp": pp, "dp": dp}
    check_counts(world_size=world_size, **sizes)
    if tp * cp * pp * dp != world_size:
        raise ValueError(f"tp*cp*pp*dp = {tp}*{cp}*{pp}*{dp} = {tp * cp * pp * dp} "
                         f"ranks, but the world has {world_size}: the grid must "
                         "cover every rank exactly once")
    return sizes


def _check_ep(dp: int, ep: int) -> None:
    check_counts(ep=ep)
    if dp % ep:
        raise ValueError(f"ep = {ep} must divide dp = {dp}: the expert groups are "
                         "made of data-parallel ranks")


def coordinates(rank: int, tp: int, pp: int, dp: int, cp: int = 1, ep: int = 1
                ) -> dict[str, int]:
    """{"tp": i, "cp": i, "pp": i, "dp": i}: where `rank` sits in the grid; with
    ep > 1 also "ep" and "edp" (dp_i = edp_i * ep + ep_i)."""
    sizes = _sizes(tp * cp * pp * dp, tp, pp, dp, cp)
    _check_ep(dp, ep)
    if not 0 <= rank < tp * cp * pp * dp:
        raise ValueError(f"rank {rank} is outside a grid of {tp * cp * pp * dp}")
    out = {}
    for d in DIMS:  # innermost first: the lowest "digit" of the rank
        rank, out[d] = divmod(rank, sizes[d])
    if ep > 1:
        out["edp"], out["ep"] = divmod(out["dp"], ep)
        out = {d: out[d] for d in DIMS + EXPERT_DIMS}
    return out


def grid(world_size: int, tp: int, pp: int, dp: int, cp: int = 1, ep: int = 1
         ) -> dict[str, list[list[int]]]:
    """The groups of every dimension: {"tp": [[0, 1], [2, 3], ...], "cp": ...,
    "pp": ..., "dp": ...}; each list is the ranks that differ only in that
    coordinate, in coordinate order, and the lists are in order of their first
    rank. With ep > 1 also "ep" (ep consecutive ranks of each dp group) and
    "edp" (every ep-th rank of it). ValueError when tp*cp*pp*dp != world_size
    or ep does not divide dp."""
    sizes = _sizes(world_size, tp, pp, dp, cp)
    _check_ep(dp, ep)
    stride, out = 1, {}
    for d in DIMS:
        n = sizes[d]
        firsts = [r for r in range(world_size) if (r // stride) % n == 0]
        out[d] = [[f + i * stride for i in range(n)] for f in firsts]
        stride *= n
    if ep > 1:  # split each dp group: dp_i = edp_i * ep + ep_i
        out["ep"] = sorted(g[i:i + ep] for g in out["dp"] for i in range(0, dp, ep))
        out["edp"] = sorted(g[i::ep] for g in out["dp"] for i in range(ep))
    return out


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's coordinates in the grid, and its groups (ProcessGroups) and
    their global ranks. Build it with `ParallelGroups.build(...)` on every rank."""

    global_rank: int  # dist.get_rank(): this rank's number in the whole world
    world_size: int
    tp_size: int
    cp_size: int
    pp_size: int
    dp_size: int
    tp_rank: int  # this rank's coordinate along each dimension
    cp_rank: int
    pp_rank: int
    dp_rank: int
    tp_ranks: tuple[int, ...]  # the global ranks of this rank's group, in order
    cp_ranks: tuple[int, ...]
    pp_ranks: tuple[int, ...]
    dp_ranks: tuple[int, ...]
    tp_group: object = None  # torch.distributed ProcessGroups
    cp_group: object = None
    pp_group: object = None
    dp_group: object = None
    # expert parallelism (ep of the dp ranks): this rank's expert group, which
    # splits the experts, and its expert-data-parallel group, the replicas of
    # its experts. With ep = 1: ep_ranks (rank,) and ep_group None (no group to
    # talk in), edp_ranks and edp_group those of dp.
    ep_size: int = 1
    ep_ranks: tuple[int, ...] = ()
    edp_ranks: tuple[int, ...] = ()
    ep_group: object = None
    edp_group: object = None

    @property
    def ep_rank(self) -> int:
        """This rank's place in its expert group: which E/ep experts it holds."""
        return self.dp_rank % self.ep_size

    @property
    def edp_size(self) -> int:
        """Replicas of each expert: dp / ep."""
        return self.dp_size // self.ep_size

    @property
    def edp_rank(self) -> int:
        return self.dp_rank // self.ep_size

    @classmethod
    def build(cls, tp: int = 1, pp: int = 1, dp: int = 1, cp: int = 1, ep: int = 1
              ) -> ParallelGroups:
        """Create every group of the grid (a collective: call it on every rank,
        with the same sizes) and keep this rank's; with ep > 1 the expert and
        expert-data-parallel groups too."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("ParallelGroups.build needs a torch.distributed "
                               "process group: call it inside cluster.run(fn)")
        world, rank = dist.get_world_size(), dist.get_rank()
        lists = grid(world, tp, pp, dp, cp, ep)
        mine: dict[str, tuple] = {}
        for d in lists:  # the same order on every rank: new_group is collective
            for ranks in lists[d]:
                pg = dist.new_group(ranks)
                if rank in ranks:
                    mine[d] = (tuple(ranks), pg)
        if ep == 1:
            mine["ep"], mine["edp"] = ((rank,), None), mine["dp"]
        at = coordinates(rank, tp, pp, dp, cp)
        return cls(rank, world, tp, cp, pp, dp, at["tp"], at["cp"], at["pp"],
                   at["dp"], *(mine[d][0] for d in DIMS), *(mine[d][1] for d in DIMS),
                   ep_size=ep, ep_ranks=mine["ep"][0], edp_ranks=mine["edp"][0],
                   ep_group=mine["ep"][1], edp_group=mine["edp"][1])

    def __str__(self) -> str:
        """Sizes, then the global rank: 'TP(2)-PP(2)-DP(2)-Rank(5)' ('CP(2)-'
        after TP when context parallelism is on, '-EP(2)' after DP when expert
        parallelism is)."""
        cp = f"-CP({self.cp_size})" if self.cp_size > 1 else ""
        ep = f"-EP({self.ep_size})" if self.ep_size > 1 else ""
        return (f"TP({self.tp_size}){cp}-PP({self.pp_size})-DP({self.dp_size})"
                f"{ep}-Rank({self.global_rank})")

    def coords(self) -> str:
        """This rank's coordinate along each dimension, of its size:
        'tp 1/2, pp 0/2, dp 1/2' (cp only when it is on; ep and edp, after dp,
        only when expert parallelism is)."""
        dims = [d for d in DIMS if d != "cp" or self.cp_size > 1]
        dims += list(EXPERT_DIMS) if self.ep_size > 1 else []
        return ", ".join(f"{d} {getattr(self, d + '_rank')}/"
                         f"{getattr(self, d + '_size')}" for d in dims)

    def __repr__(self) -> str:
        return f"ParallelGroups({self}: {self.coords()})"
