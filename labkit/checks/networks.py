"""Chapter 03's checks: the MoE return trip (combine) on real ranks, and two rings
that share no link on a torus."""

from __future__ import annotations

import math

from labkit.checks.common import (
    NOT_WRITTEN,
    NOT_YET,
    PASSED,
    ExerciseError,
    call_answer,
    run_answer,
)

FEATURES = 3  # a token here is (source rank, index on that rank, expert's mark)


def _experts(rank: int, n: int) -> list[int]:
    """The expert of each of this rank's n(n+1)/2 tokens: rank r sends (e - r) % n
    + 1 tokens to expert e, shuffled. Every rank sends and receives the same total,
    but r -> e and e -> r differ, so a return trip with its split sizes swapped
    moves the right number of rows to the wrong ranks instead of failing."""
    import torch

    picks = [e for e in range(n) for _ in range((e - rank) % n + 1)]
    g = torch.Generator().manual_seed(100 + rank)
    return [picks[i] for i in torch.randperm(len(picks), generator=g).tolist()]


def _combine_worker(rank, world_size, fn):
    import torch
    import torch.distributed as dist

    expert = torch.tensor(_experts(rank, world_size))
    tokens = len(expert)
    x = torch.zeros(tokens, FEATURES)
    x[:, 0], x[:, 1] = rank, torch.arange(tokens)
    order = expert.argsort(stable=True)  # the dispatch of section 4
    send_counts = torch.bincount(expert, minlength=world_size)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)
    received = x.new_empty(int(recv_counts.sum()), FEATURES)
    dist.all_to_all_single(received, x[order],
                           output_split_sizes=recv_counts.tolist(),
                           input_split_sizes=send_counts.tolist())
    y = received.clone()
    y[:, 2] = 10 + rank  # "the expert ran": this rank's expert marks each row
    out = fn(y, send_counts.clone(), recv_counts.clone(), order.clone())
    if isinstance(out, torch.Tensor):
        out = out.detach().clone()
    return {"out": out, "expert": expert.tolist()}


def _as_ints(row) -> tuple | None:
    vals = [float(v) for v in row]
    if not all(math.isfinite(v) for v in vals):
        return None
    return tuple(int(round(v)) for v in vals)


def _describe(row) -> str:
    got = _as_ints(row)
    if got is None:
        return f"the values {[float(v) for v in row]}"
    src, idx, mark = got
    return f"token {idx} of rank {src}, marked by expert {mark - 10}"


def check_moe_combine(cluster, fn) -> bool:
    """Check a student's MoE combine: the all-to-all that brings each token's
    expert output back to the rank it came from, in its original order.

    `fn(y, send_counts, recv_counts, order)` runs on every rank after a dispatch
    like section 4's: y holds the expert's outputs for the rows this rank received
    (grouped by source rank), send_counts / recv_counts are the dispatch's split
    sizes and order the argsort that grouped this rank's tokens by expert. It
    returns one row per token this rank sent, row i for its token i. Here a row is
    (source rank, token index, 10 + expert), so a wrong row says where it came from.
    """
    import torch

    res = run_answer(cluster, _combine_worker, fn, what="combine")
    if res is None:
        return NOT_YET
    n = cluster.world_size
    for rank, r in enumerate(res):
        out, expert = r["out"], r["expert"]
        tokens = len(expert)
        if not isinstance(out, torch.Tensor):
            raise ExerciseError(f"rank {rank}: combine returned {type(out).__name__}, "
                                f"expected a tensor of shape ({tokens}, {FEATURES})")
        if tuple(out.shape) != (tokens, FEATURES):
            raise ExerciseError(
                f"rank {rank}: combine returned shape {tuple(out.shape)}, expected "
                f"({tokens}, {FEATURES}): one row per token this rank sent "
                f"(send_counts.sum() = {tokens}); the return trip's output split "
                "sizes are the dispatch's send_counts")
        if not out.dtype.is_floating_point:
            raise ExerciseError(f"rank {rank}: combine returned {out.dtype}; keep the "
                                "expert outputs' dtype (float32)")
        wrong = [i for i in range(tokens)
                 if [float(v) for v in out[i]] != [rank, i, 10 + expert[i]]]
        if not wrong:
            continue
        # a row from another rank is the deeper mistake: report it before order
        foreign = [i for i in wrong if (_as_ints(out[i]) or (rank,))[0] != rank]
        i = (foreign or wrong)[0]
        got = _as_ints(out[i])
        msg = (f"rank {rank}, row {i}: expected token {i} of rank {rank} marked by "
               f"expert {expert[i]}, got {_describe(out[i])}")
        if got is None:
            hint = "the row holds values no token had: return the rows y holds"
        elif got[0] != rank and 0 <= got[0] < n:
            hint = ("rows went back to the wrong rank: the return trip reverses the "
                    "dispatch, so its input_split_sizes are recv_counts and its "
                    "output_split_sizes send_counts")
        elif got[0] == rank and got[1] != i:
            hint = ("the right rank, the wrong place: rows come back grouped by "
                    "expert, in `order`; put row j at position order[j] "
                    "(out[order] = back)")
        else:
            hint = ("send each expert's output rows back with dist.all_to_all_single, "
                    "then undo the sort by expert")
        raise ExerciseError(f"{msg}. Hint: {hint}")
    print(f"correct: on {n} ranks every token came back from its expert to its own "
          "rank, in its original place")
    return PASSED


# ---------------------------------------------------------------- two rings


def _ring_problem(name: str, ring, topo) -> str | None:
    devices = set(topo.devices)
    try:
        ring = list(ring)
    except TypeError:
        return f"{name} is a {type(ring).__name__}, not a list of device names"
    unknown = [d for d in ring if d not in devices]
    if unknown:
        return (f"{name} names {unknown[0]!r}, which is not a device of the "
                f"{topo.name} (devices are named like {topo.devices[1]!r})")
    seen = set()
    for d in ring:
        if d in seen:
            return f"{name} visits {d} twice: a ring passes every device once"
        seen.add(d)
    if seen != devices:
        missing = sorted(devices - seen)
        return (f"{name} misses {len(missing)} of {len(devices)} devices, e.g. "
                f"{missing[0]}: a ring passes every device once")
    for a, b in zip(ring, ring[1:] + ring[:1]):
        if (a, b) not in topo.links:
            hops = len(topo.path(a, b)) - 1
            return (f"{name} goes {a} -> {b}, which are {hops} hops apart: "
                    "consecutive devices (and the last and the first) must be "
                    "neighbours, so that every transfer is one hop")
    return None


def check_two_rings(fn, dims=((4, 4), (6, 4)), size: float = 1e9) -> bool:
    """Check a student's pair of rings on a torus.

    `fn(topo)` gets a 2-D torus (labkit.comm.topology.torus) and returns two rings,
    each a list of all its device names in ring order. Each ring all-reduces half of
    `size` bytes at the same time as the other. Right when every step of both rings
    is one hop and no link (one direction of a cable) carries both, so that the
    busiest link carries (N-1)/N * size, half of one ring's 2(N-1)/N * size.
    """
    from labkit.comm import ring_all_reduce_transfers, route, torus

    names = []
    for d in dims:
        topo = torus(d, 45e9)
        names.append(topo.name)
        n = len(topo.devices)
        try:
            rings = call_answer(fn, topo, what="two_rings")
        except ExerciseError as err:
            raise ExerciseError(f"on the {topo.name}: {err}") from None
        if rings is NOT_WRITTEN:
            return NOT_YET
        if not isinstance(rings, (tuple, list)) or len(rings) != 2:
            raise ExerciseError(f"on the {topo.name}: return two rings, e.g. "
                                f"(ring_a, ring_b); got {type(rings).__name__}"
                                + (f" of {len(rings)}" if hasattr(rings, "__len__")
                                   else ""))
        for name, ring in zip(("ring A", "ring B"), rings):
            problem = _ring_problem(name, ring, topo)
            if problem:
                raise ExerciseError(f"on the {topo.name}: {problem}")
        both = route(topo, ring_all_reduce_transfers(list(rings[0]), size / 2)
                     + ring_all_reduce_transfers(list(rings[1]), size / 2))
        one = 2 * (n - 1) / n * size / 2  # what each ring puts on each link it uses
        shared = [(link, b) for link, b in both.link_bytes.items() if b > one * 1.001]
        if shared:
            (a, b), nbytes = shared[0]
            raise ExerciseError(
                f"on the {topo.name}: link {a} -> {b} carries both rings "
                f"({nbytes / 1e9:.3g} GB, one ring's share is {one / 1e9:.3g} GB), "
                f"and {len(shared)} links do. Hint: the rings may share a cable if "
                "they cross it in opposite directions")
    print(f"correct on the {' and the '.join(names)}: two rings, every step one "
          f"hop, no link carrying both. The busiest link carries (N-1)/N·M (here "
          f"{one / 1e9:.3g} GB for M = {size / 1e9:g} GB on {n} chips), half of one "
          "ring's 2(N-1)/N·M, so the all-reduce takes half the time")
    return PASSED
