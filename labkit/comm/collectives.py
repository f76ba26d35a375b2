"""Collectives: what each one does (pure Python, the reference the chapters and the
exercise checks compare real ranks against), and ring all-reduce from send/recv.

    simulate("reduce_scatter", course_example(4))  ->  [[6], [10], [14], [18]]
    ring_steps(4)                                   the N x N chunk grid, step by step
    ring_all_reduce(tensor)                         on real ranks (inside cluster.run)
"""

from __future__ import annotations

from dataclasses import dataclass

OPS = ("broadcast", "reduce", "all_reduce", "all_gather", "reduce_scatter",
       "scatter", "gather", "all_to_all")


def course_example(world_size: int = 4, length: int | None = None
                   ) -> list[list[float]]:
    """The course's running example on world_size ranks: rank r holds
    [0, 1, ..., length-1] + r (length: world_size unless given)."""
    length = world_size if length is None else length
    return [[float(i + r) for i in range(length)] for r in range(world_size)]


def _chunks(xs: list, n: int, what: str) -> list[list]:
    if len(xs) % n:
        raise ValueError(f"{what}: length {len(xs)} is not divisible by {n} ranks")
    k = len(xs) // n
    return [xs[i * k:(i + 1) * k] for i in range(n)]


def simulate(op: str, data: list[list[float]], root: int = 0
             ) -> list[list[float] | None]:
    """What every rank holds after `op`, from what each held before.

    data[r] is rank r's input. For all_gather it is r's shard; for reduce_scatter,
    scatter (root's) and all_to_all it is split into n equal chunks. A rank whose
    result the collective leaves undefined (non-roots of reduce and gather) gets None.
    """
    n = len(data)
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}; one of {OPS}")
    if n < 1 or not 0 <= root < n:
        raise ValueError(f"need at least one rank and 0 <= root < {n}, got root={root}")
    same_length = len({len(d) for d in data}) == 1
    if op in ("reduce", "all_reduce", "reduce_scatter") and not same_length:
        raise ValueError(f"{op}: every rank must hold the same number of elements")

    def total(rows):
        return [float(sum(col)) for col in zip(*rows)]

    if op == "broadcast":
        return [list(data[root]) for _ in range(n)]
    if op == "reduce":
        return [total(data) if r == root else None for r in range(n)]
    if op == "all_reduce":
        return [total(data) for _ in range(n)]
    if op == "all_gather":
        return [[x for d in data for x in d] for _ in range(n)]
    if op == "reduce_scatter":
        return _chunks(total(data), n, op)
    if op == "scatter":
        return _chunks(list(data[root]), n, op)
    if op == "gather":
        return [[x for d in data for x in d] if r == root else None for r in range(n)]
    # all_to_all: rank r receives chunk r of every rank, in rank order
    parts = [_chunks(list(d), n, op) for d in data]
    return [[x for j in range(n) for x in parts[j][r]] for r in range(n)]


# ------------------------------------------------------------ ring all-reduce


@dataclass(frozen=True)
class RingStep:
    """One step of ring all-reduce on n ranks, each holding n chunks.

    holds[r][c] is the set of ranks whose contribution rank r's copy of chunk c
    contains after this step; sends are (from, to, chunk) transfers of this step.
    """

    phase: str  # "start", "reduce-scatter" or "all-gather"
    step: int  # 1-based within the phase (0 for the start)
    sends: tuple[tuple[int, int, int], ...]
    holds: tuple[tuple[frozenset, ...], ...]


def ring_send_chunk(rank: int, world_size: int, phase: str, step: int) -> int:
    """Which chunk `rank` sends to rank+1 at 1-based `step` of `phase`, on
    n = world_size ranks.

    Reduce-scatter: chunk (r - s + 1) mod n, so after n-1 steps rank r holds the
    complete sum of chunk (r + 1) mod n. All-gather: chunk (r - s + 2) mod n, i.e.
    each rank starts by passing on the chunk it completed.
    """
    offset = 1 if phase == "reduce-scatter" else 2
    return (rank - step + offset) % world_size


def ring_steps(world_size: int) -> list[RingStep]:
    """Every state of ring all-reduce on world_size ranks, from the start to the
    end."""
    if world_size < 1:
        raise ValueError(f"a ring needs at least 1 rank, got {world_size}")
    holds = [[frozenset([r]) for _ in range(world_size)] for r in range(world_size)]
    steps = [RingStep("start", 0, (), tuple(map(tuple, holds)))]
    for phase in ("reduce-scatter", "all-gather"):
        for s in range(1, world_size):
            sends = tuple((r, (r + 1) % world_size,
                           ring_send_chunk(r, world_size, phase, s))
                          for r in range(world_size))
            new = [list(row) for row in holds]
            for src, dst, c in sends:
                if phase == "reduce-scatter":
                    new[dst][c] = holds[dst][c] | holds[src][c]
                else:
                    new[dst][c] = holds[src][c]
            holds = new
            steps.append(RingStep(phase, s, sends, tuple(map(tuple, holds))))
    return steps


def _ring(tensor, group, phases, trace):
    import torch.distributed as dist

    n = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if n == 1:
        return tensor
    to_global = (lambda r: dist.get_global_rank(group, r)) if group else (lambda r: r)
    right, left = to_global((rank + 1) % n), to_global((rank - 1) % n)
    chunks = tensor.view(-1).tensor_split(n)  # views: results land in `tensor`
    for phase in phases:
        for s in range(1, n):
            out = chunks[ring_send_chunk(rank, n, phase, s)]
            into = chunks[ring_send_chunk(rank - 1, n, phase, s)]  # left's chunk
            buf = into.new_empty(into.shape) if phase == "reduce-scatter" else into
            reqs = [dist.isend(out, right, group=group),
                    dist.irecv(buf, left, group=group)]
            for req in reqs:
                req.wait()
            if phase == "reduce-scatter":
                into.add_(buf)
            if trace is not None:
                trace.append(tensor.detach().clone())
    return tensor


def ring_all_reduce(tensor, group=None, *, trace: list | None = None):
    """Sum `tensor` over the ranks of `group`, in place, with a ring of send/recv.

    2(n-1) steps; in each, every rank sends one chunk of M/n bytes to its right
    neighbour and receives one from its left: 2(n-1)/n * M bytes sent per rank.
    If `trace` is a list, a copy of the tensor is appended after every step.
    """
    return _ring(tensor, group, ("reduce-scatter", "all-gather"), trace)


def ring_reduce_scatter(tensor, group=None, *, trace: list | None = None):
    """The first half of ring all-reduce, in place: afterwards rank r's chunk
    (r + 1) mod n of `tensor` holds that chunk's sum over all ranks (the other
    chunks hold partial sums). n-1 steps, (n-1)/n * M bytes sent per rank."""
    return _ring(tensor, group, ("reduce-scatter",), trace)


def ring_all_gather(tensor, group=None, *, trace: list | None = None):
    """The second half, in place: each rank starts with its complete chunk
    (r + 1) mod n and ends with every chunk. (n-1)/n * M bytes sent per rank."""
    return _ring(tensor, group, ("all-gather",), trace)
