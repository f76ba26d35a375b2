"""Chapter 12's checks: which ranks share each of a rank's three groups, and the
bytes a rank sends in its data-parallel group per step. Both run the student's
function on every rank of an 8-rank cluster, next to what the ranks really
built or sent, and name the rank, the grid and the group that is wrong."""

from __future__ import annotations

from labkit.checks.common import NOT_YET, PASSED, ExerciseError, run_answer

GRIDS = ((2, 2, 2), (4, 1, 2), (1, 2, 4))  # (tp, pp, dp), 8 ranks
CFG = dict(vocab=64, seq=16, hidden=32, heads=4, layers=2)
ROWS, MICRO = 8, 2
TIMEOUT = 30.0  # seconds: building the groups and a 3D step on 8 busy ranks


def _as_ranks(x):
    try:
        out = [int(v) for v in x]
    except (TypeError, ValueError):
        return None
    return out if all(float(a) == float(b) for a, b in zip(out, x)) else None


# ---------------------------------------------------------------- exercise 1


def _peers_worker(rank, world_size, fn, grids):
    from labkit.parallel.groups import ParallelGroups

    out = []
    for tp, pp, dp in grids:
        g = ParallelGroups.build(tp=tp, pp=pp, dp=dp)
        want = {"tp": list(g.tp_ranks), "pp": list(g.pp_ranks),
                "dp": list(g.dp_ranks)}
        out.append((str(g), want, fn(rank, tp, pp, dp)))
    return out


def check_peers(cluster, fn) -> bool:
    """`fn(rank, tp, pp, dp)` returns {"tp": [...], "pp": [...], "dp": [...]}: the
    global ranks of each of `rank`'s groups, in coordinate order. Every rank of
    the cluster answers for itself, on four grids, next to ParallelGroups."""
    if cluster.world_size != 8:
        raise ValueError(f"check_peers needs 8 ranks, got {cluster.world_size}")
    res = run_answer(cluster, _peers_worker, fn, GRIDS, what="my_peers",
                     timeout=TIMEOUT)
    if res is None:
        return NOT_YET
    for rank, rows in enumerate(res):
        for (name, want, got), (tp, pp, dp) in zip(rows, GRIDS):
            call = f"my_peers({rank}, tp={tp}, pp={pp}, dp={dp}) on rank {rank}"
            if not isinstance(got, dict) or set(got) != {"tp", "pp", "dp"}:
                raise ExerciseError(f"{call} returned {got!r}; return a dict with "
                                    "the keys 'tp', 'pp' and 'dp'")
            for d, size, stride in (("tp", tp, 1), ("pp", pp, tp), ("dp", dp, tp * pp)):
                ranks = _as_ranks(got[d])
                if ranks != want[d]:
                    raise ExerciseError(
                        f"{call}: its {d} group is {got[d]!r}, expected {want[d]} "
                        f"({name}). Hint: ranks are numbered tp innermost, then "
                        f"pp, then dp, so a {d} group is {size} ranks {stride} "
                        "apart that share the other two coordinates")
    print(f"correct: all 8 ranks named their tp, pp and dp peers on {len(GRIDS)} "
          "grids, as ParallelGroups.build made them")
    return PASSED


# ---------------------------------------------------------------- exercise 2


def _dp_worker(rank, world_size, fn, grid):
    import torch

    from labkit.ledger import traffic
    from labkit.parallel.groups import ParallelGroups
    from labkit.parallel.three_d import ThreeD, TinyGPT

    tp, pp, dp = grid
    g = ParallelGroups.build(tp=tp, pp=pp, dp=dp)
    torch.manual_seed(0)
    run = ThreeD(TinyGPT(**CFG), g, microbatches=MICRO)
    t = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CFG["vocab"], (ROWS, CFG["seq"] + 1), generator=t)
    with traffic() as led:
        run.step(tokens[:, :-1], tokens[:, 1:])
    sent = led.by_group({"dp": g.dp_ranks})["dp"]["bus_bytes"]
    return str(g), g.pp_rank, sent, fn(g.pp_rank, tp, pp, dp, dict(CFG))


def check_dp_bytes(cluster, fn) -> bool:
    """`fn(stage, tp, pp, dp, cfg)`: the bytes one rank of pipeline stage `stage`
    sends in its data-parallel group in one step (ring all-reduce of its fp32
    gradient shard) of ThreeD(TinyGPT(**cfg)). Every rank answers for itself on
    two grids; each is compared with the bus bytes its traffic ledger recorded."""
    if cluster.world_size != 8:
        raise ValueError(f"check_dp_bytes needs 8 ranks, got {cluster.world_size}")
    for grid in ((2, 2, 2), (1, 2, 4)):
        res = run_answer(cluster, _dp_worker, fn, grid, what="my_dp_bytes",
                         timeout=TIMEOUT)
        if res is None:
            return NOT_YET
        tp, pp, dp = grid
        for rank, (name, stage, sent, got) in enumerate(res):
            call = f"my_dp_bytes({stage}, tp={tp}, pp={pp}, dp={dp}, cfg)"
            if isinstance(got, bool) or not isinstance(got, (int, float)):
                raise ExerciseError(f"{call} on rank {rank} returned {got!r}; "
                                    "return a number of bytes")
            # bytes the ledger counted against a formula evaluated in float64
            # (2(dp-1)/dp of a whole number): 1e-6 absorbs the formula's rounding
            # (1e-16) and is far below a stage or a factor miscounted
            if abs(got - sent) > 1e-6 * sent:
                raise ExerciseError(
                    f"rank {rank} ({name}): {call} = {got:,.0f} bytes, but the "
                    f"rank sent {sent:,.0f} in its dp group. Hint: count the "
                    f"parameters of stage {stage} only (embedding on the first, "
                    "final LayerNorm and head on the last), each block's share "
                    "1/tp of the split ones (theory.layer_params), 4 bytes each, "
                    "times 2(dp-1)/dp")
    print("correct: your prediction is what every rank sent in its dp group, on "
          "DP(2) x PP(2) x TP(2) and on DP(4) x PP(2)")
    return PASSED


# ---------------------------------------------------------------- exercise 3

RING_CASES = (("all_reduce", 268e6, 8, 1), ("reduce_scatter", 64e6, 16, 2),
              ("all_reduce", 1e6, 64, 8), ("all_gather", 797e6, 2048, 2048))


def _ring_seconds(op, size, n, nodes, cl, alpha_in=None, alpha_out=None, bw=None):
    """The calculator's own α-β price (theory's ring_latency and
    ring_bytes_per_rank), with a slip's α or bandwidth in place of the right one."""
    from labkit.theory import ring_bytes_per_rank
    from labkit.theory._layout_time import ring_latency

    a_in = cl.alpha_intra if alpha_in is None else alpha_in
    a_out = cl.alpha_inter if alpha_out is None else alpha_out
    beta = bw or (cl.intra_bw if nodes == 1 else cl.inter_bw)
    return (ring_latency(op, n, nodes, a_in, a_out)
            + ring_bytes_per_rank(op, size, n) / beta)


def check_ring_seconds(fn, cluster=None) -> bool:
    """`fn(op, size, n, nodes, cluster)`: the α-β seconds of a ring collective of
    `size` bytes over n ranks spread on `nodes` nodes of `cluster` (a
    theory.layouts.Cluster): the ring's steps, those between nodes at
    alpha_inter and the rest at alpha_intra, plus the bytes each rank sends over
    NVLink (one node) or the network. Checked on four collectives, from one
    node to 2048; the first wrong one is named, with what it looks like you
    left out."""
    from labkit.checks.common import NOT_WRITTEN, call_answer
    from labkit.theory.layouts import LLAMA3_CLUSTER

    cl = cluster or LLAMA3_CLUSTER
    for op, size, n, nodes in RING_CASES:
        call = f"my_ring_seconds({op!r}, {size:.3g}, n={n}, nodes={nodes}, cluster)"
        got = call_answer(fn, op, size, n, nodes, cl, what="my_ring_seconds")
        if got is NOT_WRITTEN:
            return NOT_YET
        if isinstance(got, bool) or not isinstance(got, (int, float)):
            raise ExerciseError(f"{call} returned {got!r}; return seconds, a number")
        want = _ring_seconds(op, size, n, nodes, cl)
        if abs(got - want) <= 1e-9 * want:  # float64 formulas: rounding only
            continue
        hints = [  # what a common slip gives, and what to say about it
            (_ring_seconds(op, size, n, nodes, cl, 0.0, 0.0),
             "that is the bytes alone: every ring step also pays α"),
            (_ring_seconds(op, size, n, nodes, cl, cl.alpha_inter, cl.alpha_inter),
             "every step paid the network's α: only the ring's steps between nodes "
             "(latency_steps(op, nodes) of them) do; the rest pay alpha_intra"),
            (_ring_seconds(op, size, n, nodes, cl, bw=cl.intra_bw),
             "a ring that leaves its node moves its bytes at the network's "
             "inter_bw, not NVLink's"),
            (_ring_seconds(op, size, n, nodes, cl, bw=cl.inter_bw),
             "inside one node the bytes go over NVLink (intra_bw)")]
        hint = next((h for v, h in hints if abs(got - v) <= 1e-9 * v),
                    "steps from theory.latency_steps(op, n), bytes each rank sends "
                    "from theory.ring_bytes_per_rank(op, size, n)")
        raise ExerciseError(f"{call} = {got:.6g} s, expected {want:.6g} s. Hint: "
                            f"{hint}")
    print(f"correct: your α-β seconds match on all {len(RING_CASES)} collectives, "
          "from 8 GPUs in a node to a ring over 2048 nodes")
    return PASSED
