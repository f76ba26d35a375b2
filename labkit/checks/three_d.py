"""Chapter 13's checks: which ranks share each of a rank's groups (on the
cluster's ranks, or for any order of the dimensions), the bytes a rank sends in
its data-parallel group per step, a ring collective's α-β seconds, and how a
layout change moves each dimension's bytes. The cluster checks run the
student's function on every rank of an 8-rank cluster, next to what the ranks
really built or sent; each names the rank, grid, group or dimension that is
wrong."""

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
    from labkit.parallel import ParallelGroups

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
    from labkit.parallel import ParallelGroups
    from labkit.parallel import ThreeD, TinyGPT

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
    from labkit.theory import ring_bytes_per_rank, ring_latency

    a_in = cl.alpha_intra if alpha_in is None else alpha_in
    a_out = cl.alpha_inter if alpha_out is None else alpha_out
    beta = bw or (cl.intra_bw if nodes == 1 else cl.inter_bw)
    return (ring_latency(op, n, nodes, a_in, a_out)
            + ring_bytes_per_rank(op, size, n) / beta)


def check_ring_seconds(fn, spec=None) -> bool:
    """`fn(op, size, n, nodes, spec)`: the α-β seconds of a ring collective of
    `size` bytes over n ranks spread on `nodes` nodes of `spec` (a
    theory.ClusterSpec; LLAMA3_CLUSTER by default): the ring's steps, those
    between nodes at alpha_inter and the rest at alpha_intra, plus the bytes each
    rank sends over NVLink (one node) or the network. Checked on four
    collectives, from one node to 2048; the first wrong one is named, with what
    it looks like you left out."""
    from labkit.checks.common import NOT_WRITTEN, call_answer
    from labkit.theory import LLAMA3_CLUSTER

    cl = spec or LLAMA3_CLUSTER
    for op, size, n, nodes in RING_CASES:
        call = f"my_ring_seconds({op!r}, {size:.3g}, n={n}, nodes={nodes}, spec)"
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


# ------------------------------------------------ exercise 1: any order of dims

ORDER_CASES = (  # dimensions outermost first, as init_device_mesh names them
    {"dp": 2, "pp": 2, "tp": 2},
    {"tp": 2, "pp": 2, "dp": 2},
    {"pp": 2, "dp": 4, "tp": 2},
    {"dp": 2, "pp": 4, "cp": 2, "tp": 4},
)


def mesh_groups(rank: int, dims: dict) -> dict:
    """Reference: the ranks of each of `rank`'s groups when the ranks fill a grid
    of `dims` (name -> size, outermost first) row-major, the last dimension
    innermost: how torch's init_device_mesh(..., mesh_dim_names=tuple(dims))
    lays them out (chapter 13, section 6). A group of dimension k is the ranks
    whose other coordinates are equal, in coordinate order."""
    sizes = list(dims.values())
    strides, s = [], 1
    for n in reversed(sizes):
        strides.insert(0, s)
        s *= n
    out = {}
    for k, (name, n) in enumerate(dims.items()):
        coord = rank // strides[k] % n
        base = rank - coord * strides[k]
        out[name] = [base + i * strides[k] for i in range(n)]
    return out


def check_peers_any_order(fn) -> bool:
    """`fn(rank, dims)`: {name: [global ranks]} for each dimension of `dims`
    (name -> size, outermost first; the last one innermost), as DeviceMesh lays
    the ranks out. Every rank of four grids (8 to 32 ranks, three or four
    dimensions, tensor parallelism innermost or not); the first wrong group is
    named, with the stride it should have."""
    from labkit.checks.common import NOT_WRITTEN, call_answer

    for dims in ORDER_CASES:
        world = 1
        for n in dims.values():
            world *= n
        shape = " x ".join(f"{k} {n}" for k, n in dims.items())
        for rank in range(world):
            call = f"my_peers({rank}, {dims})"
            got = call_answer(fn, rank, dict(dims), what="my_peers")
            if got is NOT_WRITTEN:
                return NOT_YET
            want = mesh_groups(rank, dims)
            if not isinstance(got, dict) or set(got) != set(dims):
                raise ExerciseError(f"{call} returned {got!r}; return a dict with "
                                    f"the keys {list(dims)}")
            for d, ranks in want.items():
                if _as_ranks(got[d]) == ranks:
                    continue
                inner = [k for k in list(dims)[list(dims).index(d) + 1:]]
                stride = ranks[1] - ranks[0] if len(ranks) > 1 else 1
                why = (f"the product of the sizes of the dimensions inside it "
                       f"({' x '.join(inner)})" if inner else
                       "1: it is the innermost dimension")
                raise ExerciseError(
                    f"{call} on the grid {shape} ({world} ranks): its {d} group is "
                    f"{got[d]!r}, expected {ranks}. Hint: {d}'s ranks are {stride} "
                    f"apart, {why}; the last dimension named is the innermost, "
                    "not always tp")
    print(f"correct: every rank of {len(ORDER_CASES)} grids named its groups as "
          "DeviceMesh lays them out, whichever dimension is innermost")
    return PASSED


# ------------------------------------------- exercise 4: move a long-context run

LONG_CONTEXT_CP = 32  # the layout the student reasons about: CP 32 x DP 4


def _long_context_pair():
    import dataclasses

    from labkit.theory import PUBLISHED_RUNS, estimate
    from labkit.theory import MODELS

    run = PUBLISHED_RUNS["llama3-405b-128k"]
    lay = run.layout
    dp = lay.dp * lay.cp // LONG_CONTEXT_CP
    seqs = run.global_batch_tokens // run.seq
    other = dataclasses.replace(lay, cp=LONG_CONTEXT_CP, dp=dp,
                                microbatches=seqs // dp, name="")
    new = estimate(MODELS[run.model], other, run.cluster, run.global_batch_tokens,
                   run.seq)
    return run.estimate(), new


def check_traffic_ratios(fn) -> bool:
    """`fn()`: {"tp": r, "cp": r, "pp": r, "dp": r}, each the bytes a GPU sends
    per step in that dimension when Llama 3 405B's long-context layout (TP 8,
    PP 16, CP 16, DP 8, ZeRO-2, interleaved v = 2, 128 sequences of 131,072 per
    step, one per micro-batch) becomes CP 32 x DP 4, divided by the published
    layout's. Compared with what theory.estimate prices for both (the
    chapter's section 7); the first dimension that is off is named with what it
    looks like was missed."""
    from labkit.checks.common import NOT_WRITTEN, call_answer

    got = call_answer(fn, what="my_traffic_ratios")
    if got is NOT_WRITTEN:
        return NOT_YET
    dims = ("tp", "cp", "pp", "dp")
    if not isinstance(got, dict) or set(got) != set(dims):
        raise ExerciseError(f"my_traffic_ratios() returned {got!r}; return a dict "
                            f"with the keys {list(dims)}")
    old, new = _long_context_pair()
    hints = {
        "tp": "each micro-batch's all-reduces carry b s h with s the local "
              "sequence, which CP 32 halves (8,192 -> 4,096 tokens), while a "
              "replica of DP 4 runs 32 micro-batches, not 16",
        "pp": "one activation per micro-batch and chunk, b s h / t each: the local "
              "sequence and the number of micro-batches both change",
        "cp": "the K and V all-gathered per layer and micro-batch are the whole "
              "sequence's, whatever CP is; a ring of n sends (n-1)/n of it; and "
              "there are twice the micro-batches",
        "dp": "ZeRO-2 over DP x CP = 128 ranks both ways: it reduce-scatters its "
              "gradient shard after every micro-batch's backward and all-gathers "
              "the weights once per step (n-1)/n of the stage's weights each",
    }
    for d in dims:
        want = new.traffic[d] / old.traffic[d]
        v = got[d]
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ExerciseError(f"my_traffic_ratios()[{d!r}] is {v!r}; return a "
                                "number, the new layout's bytes over the old's")
        if abs(v - want) <= 1e-9 * want:  # closed forms in float64: rounding only
            continue
        raise ExerciseError(
            f"{d}: {v:.4g} x the published layout's bytes per GPU per step, but "
            f"the calculator prices CP {LONG_CONTEXT_CP} x DP "
            f"{new.layout.dp} at {want:.4g} x ({new.traffic[d] / 1e9:,.2f} GB "
            f"against {old.traffic[d] / 1e9:,.2f} GB). Hint: {hints[d]}")
    print("correct: tp, cp, pp and dp bytes per GPU move as the calculator "
          "prices them")
    return PASSED
