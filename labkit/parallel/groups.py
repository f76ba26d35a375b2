"""The rank grid of combined parallelism: which ranks share a tensor-, context-,
pipeline- or data-parallel group, and this rank's place in it.

    g = ParallelGroups.build(tp=2, pp=2, dp=2)      # on every rank, same arguments
    str(g)            'TP(2)-PP(2)-DP(2)-Rank(5)'    sizes, then the global rank
    g.coords()        'tp 1/2, pp 0/2, dp 1/2'       this rank's place (coordinates)
    layer = ColumnParallelLinear(h, 4 * h, g.tp_group)

Ranks are numbered with tp innermost, then cp, pp, and dp outermost, as picotron's
process_group_manager lays out arange(world).view(dp, pp, cp, tp). Tensor-parallel
ranks are neighbours because they talk the most, twice per layer each way: with 8
GPUs a server they share its NVLink (Narayanan et al. 2021, sec. 3.3, takeaway #1):

    rank = ((dp_i * pp + pp_i) * cp + cp_i) * tp + tp_i

A group of one dimension is the ranks whose other coordinates are equal. `grid`
lists them without any process; `ParallelGroups.build` creates one process group
per list, every list of every dimension in the same order on every rank (each
`dist.new_group` is a collective over the whole world, even for ranks outside
it), and keeps the four its rank belongs to. Nothing is global: pass the object,
or one of its groups, to whatever needs it.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.theory import check_counts

DIMS = ("tp", "cp", "pp", "dp")  # innermost first


def _sizes(world_size: int, tp: int, pp: int, dp: int, cp: int) -> dict[str, int]:
    sizes = {"tp": tp, "cp": cp, "pp": pp, "dp": dp}
    check_counts(world_size=world_size, **sizes)
    if tp * cp * pp * dp != world_size:
        raise ValueError(f"tp*cp*pp*dp = {tp}*{cp}*{pp}*{dp} = {tp * cp * pp * dp} "
                         f"ranks, but the world has {world_size}: the grid must "
                         "cover every rank exactly once")
    return sizes


def coordinates(rank: int, tp: int, pp: int, dp: int, cp: int = 1) -> dict[str, int]:
    """{"tp": i, "cp": i, "pp": i, "dp": i}: where `rank` sits in the grid."""
    sizes = _sizes(tp * cp * pp * dp, tp, pp, dp, cp)
    if not 0 <= rank < tp * cp * pp * dp:
        raise ValueError(f"rank {rank} is outside a grid of {tp * cp * pp * dp}")
    out = {}
    for d in DIMS:  # innermost first: the lowest "digit" of the rank
        rank, out[d] = divmod(rank, sizes[d])
    return out


def grid(world_size: int, tp: int, pp: int, dp: int, cp: int = 1
         ) -> dict[str, list[list[int]]]:
    """The groups of every dimension: {"tp": [[0, 1], [2, 3], ...], "cp": ...,
    "pp": ..., "dp": ...}; each list is the ranks that differ only in that
    coordinate, in coordinate order, and the lists are in order of their first
    rank. ValueError when tp*cp*pp*dp != world_size."""
    sizes = _sizes(world_size, tp, pp, dp, cp)
    stride, out = 1, {}
    for d in DIMS:
        n = sizes[d]
        firsts = [r for r in range(world_size) if (r // stride) % n == 0]
        out[d] = [[f + i * stride for i in range(n)] for f in firsts]
        stride *= n
    return out


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's coordinates in the grid, and its groups (ProcessGroups) and
    their global ranks. Build it with `ParallelGroups.build(...)` on every rank."""

    rank: int  # global rank
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

    @classmethod
    def build(cls, tp: int = 1, pp: int = 1, dp: int = 1, cp: int = 1
              ) -> ParallelGroups:
        """Create every group of the grid (a collective: call it on every rank,
        with the same sizes) and keep this rank's."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("ParallelGroups.build needs a torch.distributed "
                               "process group: call it inside cluster.run(fn)")
        world, rank = dist.get_world_size(), dist.get_rank()
        lists = grid(world, tp, pp, dp, cp)
        mine: dict[str, tuple] = {}
        for d in DIMS:  # the same order on every rank: new_group is collective
            for ranks in lists[d]:
                pg = dist.new_group(ranks)
                if rank in ranks:
                    mine[d] = (tuple(ranks), pg)
        at = coordinates(rank, tp, pp, dp, cp)
        return cls(rank, world, tp, cp, pp, dp, at["tp"], at["cp"], at["pp"],
                   at["dp"], *(mine[d][0] for d in DIMS), *(mine[d][1] for d in DIMS))

    def __str__(self) -> str:
        """Sizes, then the global rank: 'TP(2)-PP(2)-DP(2)-Rank(5)' ('CP(2)-'
        after TP when context parallelism is on)."""
        cp = f"-CP({self.cp_size})" if self.cp_size > 1 else ""
        return (f"TP({self.tp_size}){cp}-PP({self.pp_size})-DP({self.dp_size})"
                f"-Rank({self.rank})")

    def coords(self) -> str:
        """This rank's coordinate along each dimension, of its size:
        'tp 1/2, pp 0/2, dp 1/2' (cp only when it is on)."""
        dims = [d for d in DIMS if d != "cp" or self.cp_size > 1]
        return ", ".join(f"{d} {getattr(self, d + '_rank')}/"
                         f"{getattr(self, d + '_size')}" for d in dims)

    def __repr__(self) -> str:
        return f"ParallelGroups({self}: {self.coords()})"
