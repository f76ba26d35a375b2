"""Chapter 14's checks: a rank's groups for any order of the dimensions, the bytes
a rank of a 3D run sends in its data-parallel group, a ring collective's α-β
seconds, and how a long-context layout change moves each dimension's bytes.

Each draws its cases fresh in every run and computes its reference there, by
its own arithmetic (coordinates enumerated, parameters counted module by module,
exact Fractions), never with the labkit function the chapter teaches, which it
refuses in the answer. The data-parallel bytes are also held to what the
traffic ledger measured on the ranks, on configurations drawn that run.
"""

from __future__ import annotations

import itertools
import math
import random
from fractions import Fraction

from labkit.checks.common import (
    NOT_WRITTEN,
    NOT_YET,
    PASSED,
    ExerciseError,
    as_number,
    call_answer,
    close_to,
    finite,
    is_number,
    run_answer,
    slips_named,
)
from labkit.checks.verify import fresh_seed, own_calls, refuse_own

_TIMEOUT = 30.0  # seconds: building the groups and a 3D step on 8 busy ranks


def _as_ranks(x):
    """A student's group as a list of ints, or None if it is not whole numbers."""
    try:
        out = [int(v) for v in x]
        same = all(float(a) == float(b) for a, b in zip(out, x))
    except (TypeError, ValueError):
        return None
    return out if same else None


def _plural(k: int, word: str) -> str:
    return f"{k} {word}" + ("" if k == 1 else "es" if word.endswith("h") else "s")


# ------------------------------------------------- exercise 1: a rank's groups

_NAMES = ("dp", "pp", "cp", "tp")
_CHAPTER_DIMS = {"dp": 2, "pp": 2, "tp": 2}  # section 6's DeviceMesh


def _mesh_groups(rank: int, dims: dict) -> dict:
    """Each of `rank`'s groups when the ranks fill the grid `dims` (outermost
    first) row-major: every coordinate tuple enumerated in order is the next
    rank (as torch's arange(world).reshape(sizes)); a group is the ranks equal
    to `rank` in every other coordinate, in coordinate order."""
    names, sizes = list(dims), list(dims.values())
    coords = list(itertools.product(*(range(n) for n in sizes)))  # index = rank
    mine = coords[rank]
    return {name: [r for r, c in enumerate(coords)
                   if all(c[j] == mine[j] for j in range(len(names)) if j != k)]
            for k, name in enumerate(names)}


def _draw_dims(rng: random.Random, *, four: bool, tp_inside: bool) -> dict:
    """A grid of 3 or 4 named dimensions in a random order, sizes 1 to 4 (at
    most one 1), at most 64 ranks; tp_inside=False: tp is not the innermost."""
    while True:
        names = rng.sample(_NAMES, 4 if four else 3)
        if "tp" in names and tp_inside != (names[-1] == "tp"):
            continue
        sizes = [rng.randint(1, 4) for _ in names]
        if sizes.count(1) <= 1 and math.prod(sizes) <= 64 and len(set(sizes)) > 1:
            return dict(zip(names, sizes))


def _peer_cases(seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [dict(_CHAPTER_DIMS), _draw_dims(rng, four=True, tp_inside=False),
            _draw_dims(rng, four=False, tp_inside=False),
            _draw_dims(rng, four=True, tp_inside=True),
            _draw_dims(rng, four=rng.random() < 0.5, tp_inside=rng.random() < 0.5)]


def _shape(dims: dict) -> str:
    return " x ".join(f"{k} {n}" for k, n in dims.items())


def _group_hint(rank: int, dims: dict, d: str, got: list[int], want: list[int],
                coordinates: bool) -> str:
    """Why rank's group of dimension d is `got` instead of `want`; coordinates:
    every group the answer returned is range(size)."""
    n, names = dims[d], list(dims)
    if coordinates:
        return (f"those are the coordinates along each dimension; return global "
                f"ranks: rank {rank} and the ranks that differ from it only along "
                "that dimension")
    inner = names[names.index(d) + 1:]
    stride = math.prod(dims[k] for k in inner)
    chapter = {k: dims[k] for k in _NAMES if k in dims}  # tp innermost
    if list(chapter) != names and got == _mesh_groups(rank, chapter)[d]:
        return ("that is the chapter's order, tp innermost, whatever `dims` says; "
                "DeviceMesh makes the last dimension named the innermost")
    if got == _mesh_groups(rank, dict(reversed(dims.items())))[d]:
        return ("that is the first dimension taken as the innermost (column-"
                "major); DeviceMesh lays the ranks out row-major: the last "
                "dimension named is the innermost, the first the outermost")
    if len(got) != n:
        return (f"it has {len(got)} ranks; a {d} group has dims[{d!r}] = {n}, "
                "one rank per coordinate along it")
    if sorted(got) == want:
        return ("the right ranks in another order: list them in coordinate order "
                f"(coordinate 0 of {d} first), which is increasing rank")
    if rank not in got:
        return f"rank {rank} is not in it, and every rank is in each of its groups"
    why = (f"the product of the sizes of the dimensions inside it "
           f"({' x '.join(inner)} = {stride})" if inner else
           "1: it is the innermost dimension")
    return f"{d}'s ranks are {stride} apart, {why}"


def check_peers_any_order(fn) -> bool:
    """`fn(rank, dims)`: {name: [global ranks]} for each dimension of `dims`
    (name -> size, outermost first; the last one innermost), as DeviceMesh lays
    the ranks out. Every rank of five grids: section 6's and four drawn this run
    (3 or 4 dimensions in any order, tp innermost or not); labkit's own grid
    code is refused, and the first wrong group is named, with what it looks
    like."""
    cases = _peer_cases(fresh_seed())
    for dims in cases:
        world = math.prod(dims.values())
        for rank in range(world):
            call = f"my_peers({rank}, {dims})"
            with own_calls("labkit.parallel.groups",
                           "labkit.checks.three_d:_mesh_groups") as own:
                got = call_answer(fn, rank, dict(dims), what="my_peers")
            refuse_own(call, own, "rank grid (or this check's reference)")
            if got is NOT_WRITTEN:
                return NOT_YET
            if not isinstance(got, dict) or set(got) != set(dims):
                raise ExerciseError(f"{call} returned {got!r}; return a dict with "
                                    f"the keys {list(dims)}, one group each")
            want = _mesh_groups(rank, dims)
            for d in dims:
                ranks = _as_ranks(got[d])
                if ranks == want[d]:
                    continue
                where = (f"{call} on the grid {_shape(dims)} ({world} ranks): its "
                         f"{d} group is {got[d]!r}, expected {want[d]}")
                if ranks is None:
                    raise ExerciseError(f"{where}; return a list of whole-number "
                                        "global ranks")
                coordinates = all(_as_ranks(got[k]) == list(range(n))
                                  for k, n in dims.items())
                raise ExerciseError(f"{where}. Hint: " + _group_hint(
                    rank, dims, d, ranks, want[d], coordinates))
    print(f"correct: every rank of {len(cases)} grids named its groups as "
          f"DeviceMesh lays them out: section 6's {_shape(cases[0])} and "
          f"{len(cases) - 1} drawn this run, 3 or 4 dimensions in any order")
    return PASSED


# ------------------------------------------ exercise 2: a rank's dp bytes


def _modules(cfg: dict, tp: int) -> list[tuple[str, int]]:
    """(name, parameters on one tensor rank) of each of TinyGPT's L + 2 modules,
    counted tensor by tensor: Megatron's split divides q, k, v and fc1 (weights
    and biases) and the weights of proj and fc2 by tp; LayerNorms, the row-
    parallel biases, the embedding and the head stay whole."""
    h, V, s, L = cfg["hidden"], cfg["vocab"], cfg["seq"], cfg["layers"]
    f = 4 * h
    split = 3 * (h * h + h) + h * h + (h * f + f) + f * h  # q k v, proj, fc1, fc2
    whole = 2 * (2 * h) + h + h  # ln1, ln2 (weight, bias); proj's, fc2's biases
    return ([("the embedding", V * h + s * h)]  # token and position tables
            + [(f"block {i}", split // tp + whole) for i in range(L)]
            + [("the head", 2 * h + h * V)])  # final LayerNorm, Linear(h, V)


def _stage_params(stage: int, tp: int, pp: int, cfg: dict) -> int:
    mods = _modules(cfg, tp)
    k = len(mods) // pp  # the check draws L + 2 divisible by pp
    return sum(n for _, n in mods[stage * k:(stage + 1) * k])


def _dp_bytes(params: int, dp: int) -> Fraction:
    """A ring all-reduce of `params` fp32 gradients: 2(dp-1)/dp of 4 B each."""
    return Fraction(4 * params * 2 * (dp - 1), dp)


def _draw_cfg(rng: random.Random, tp: int, pp: int, small: bool) -> dict:
    """A TinyGPT whose L + 2 modules cut into pp equal stages and whose heads
    split over tp; small: one whose step runs in a fraction of a second (the
    others stay under 50M parameters too, should an answer build one)."""
    k = rng.choice([j for j in range(1, 9) if 1 <= pp * j - 2 <= (6 if small
                                                                  else 14)])
    heads = tp * rng.choice((1, 2) if small else (1, 2, 4))
    head_dim = rng.choice((2, 4, 8) if small else (8, 16))
    return dict(vocab=rng.randint(16, 96) if small else rng.randint(100, 5000),
                seq=rng.randint(4, 16) if small else rng.choice((128, 512, 1024)),
                hidden=heads * head_dim, heads=heads, layers=pp * k - 2)


def _grids(world: int) -> list[tuple[int, int, int]]:
    return [(t, p, world // (t * p)) for t in range(1, world + 1)
            for p in range(1, world + 1) if world % (t * p) == 0]


def _dp_cases(seed: int, world: int):
    """(measured, computed): grids of `world` ranks with dp > 1 (the first with
    tp, pp and dp all above 1 where the world allows) and a TinyGPT drawn for
    each, run on the ranks; and larger layouts, every stage, checked against
    the count alone (the chapter's own first)."""
    rng = random.Random(seed)
    dp_grids = [g for g in _grids(world) if g[2] > 1]
    full = [g for g in dp_grids if min(g) > 1] or [g for g in dp_grids if g[1] > 1]
    first = rng.choice(full or dp_grids)
    second = rng.choice([g for g in dp_grids if g != first] or dp_grids)
    measured = []
    for tp, pp, dp in (first, second):
        cfg = _draw_cfg(rng, tp, pp, small=True)
        m = rng.randint(1, 3)
        measured.append(((tp, pp, dp), cfg, m, dp * m * rng.randint(1, 2)))
    computed = [((2, 2, 2), dict(vocab=64, seq=16, hidden=32, heads=4, layers=2))]
    for k in range(4):  # the first: tp, dp > 1 and 3 stages or more
        tp = rng.choice((2, 4, 8) if k == 0 else (1, 2, 4, 8))
        pp = rng.randint(3, 8) if k == 0 else rng.randint(1, 8)
        dp = rng.randint(2, 64) if k == 0 else rng.randint(1, 64)
        computed.append(((tp, pp, dp), _draw_cfg(rng, tp, pp, small=False)))
    return measured, computed


def _dp_worker(rank, world_size, grid, cfg, m, rows, seed):
    """One step of ThreeD(TinyGPT(**cfg)) on `grid`: this rank's stage and the
    bus bytes its traffic ledger counted in its dp group."""
    import torch

    from labkit.ledger import traffic
    from labkit.parallel import ParallelGroups, ThreeD, TinyGPT

    tp, pp, dp = grid
    g = ParallelGroups.build(tp=tp, pp=pp, dp=dp)
    torch.manual_seed(seed)
    run = ThreeD(TinyGPT(**cfg), g, microbatches=m)
    t = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg["vocab"], (rows, cfg["seq"] + 1), generator=t)
    with traffic() as led:
        run.step(tokens[:, :-1], tokens[:, 1:])
    dp_row = led.by_group({"dp": g.dp_ranks}).get("dp", {})
    params = sum(p.numel() for p in run.parameters())
    return g.pp_rank, dp_row.get("bus_bytes", 0.0), params


# labkit's TinyGPT, its 3D run and grid, the ledger and the ranks: measuring
# instead of counting; and this check's own count
_DP_OWN = ("labkit.parallel.three_d", "labkit.parallel.models",
           "labkit.parallel.groups", "labkit.ledger.traffic_ledger",
           "labkit.runtime.cluster:Cluster.run", "labkit.checks.three_d:_modules")


def _dp_slips(stage: int, tp: int, pp: int, dp: int, cfg: dict) -> list:
    """(bytes, why) for the usual mistakes, each on its own."""
    h, V, s = cfg["hidden"], cfg["vocab"], cfg["seq"]
    mods = _modules(cfg, tp)
    k = len(mods) // pp
    lo, hi = stage * k, (stage + 1) * k
    on = mods[lo:hi]
    P = sum(n for _, n in on)
    whole_blocks = sum(n for _, n in _modules(cfg, 1)[lo:hi])
    has_embed, has_head = lo == 0, hi == len(mods)
    blocks = [n for name, n in on if name.startswith("block")]
    ends = P - sum(blocks)
    L = cfg["layers"]
    bk = L // pp  # a pipeline of the blocks alone, embedding and head added
    b_lo, b_hi = stage * bk, (stage + 1) * bk if stage < pp - 1 else L
    alt_cut = ((mods[0][1] if stage == 0 else 0)
               + sum(n for _, n in mods[1 + b_lo:1 + b_hi])
               + (mods[-1][1] if stage == pp - 1 else 0))
    flip = sum(n for _, n in mods[(pp - 1 - stage) * k:(pp - stage) * k])
    a = Fraction(2 * (dp - 1), dp)
    out = [
        (4 * a * sum(n for _, n in mods),
         "that is every stage's parameters: a rank all-reduces only its own "
         f"stage's, modules {lo} to {hi - 1} of the L + 2 = {len(mods)}"),
        (4 * a * whole_blocks,
         "the blocks counted whole: their split matrices (q, k, v, proj, fc1, "
         "fc2) are 1/tp on a rank (theory.layer_params(h, tp))"),
        (4 * a * (Fraction(sum(n for _, n in _modules(cfg, 1)[lo:hi]), tp)),
         "everything divided by tp: LayerNorms, the row-parallel biases, the "
         "embedding and the head stay whole on every tensor rank"),
        (4 * a * (sum(blocks) + Fraction(ends, tp)),
         "the embedding and the head stay whole on the tensor ranks of their "
         "stage: only the blocks are split"),
        (4 * a * alt_cut,
         "the pipeline cuts all L + 2 modules (embedding, blocks, head) into pp "
         "equal runs, not the blocks alone with the embedding and head added"),
        (4 * a * flip, "stage 0 is the first: it holds the embedding, the last "
                       "stage the head"),
        (4 * Fraction(dp - 1, dp) * P,
         "half of it: a ring all-reduce sends 2(dp-1)/dp of the gradients "
         "((dp-1)/dp is a reduce-scatter's share), 4 bytes each (fp32, not "
         "bf16's 2)"),
        (4 * 2 * P, "a ring all-reduce sends 2(dp-1)/dp of the gradients, not "
                    "twice all of them"),
        (4 * P, "that is the gradients' size; a ring all-reduce sends "
                "2(dp-1)/dp of it"),
        (a * P, "that counts gradients, not bytes: 4 bytes each (fp32)"),
        (4 * a * (P + V), "the head's Linear(h, V) has no bias")
        if has_head else None,
        (4 * a * (P - s * h), "the embedding holds a position table (seq x "
                              "hidden) as well as the tokens'")
        if has_embed else None,
        (4 * a * (P - 2 * h), "the head holds the final LayerNorm (weight and "
                              "bias, 2h) as well") if has_head else None,
    ]
    return [(v, why) for v, why in filter(None, out)]


def check_dp_bytes(cluster, fn, *, timeout: float = _TIMEOUT) -> bool:
    """`fn(stage, tp, pp, dp, cfg)`: the bytes one rank of pipeline stage `stage`
    sends in its data-parallel group in one step (a ring all-reduce of its fp32
    gradient shard) of ThreeD(TinyGPT(**cfg)) on a tp x pp x dp grid. Two grids
    of the cluster's ranks with a TinyGPT drawn this run each are run for one
    step, and every stage's answer is compared with the bytes its ranks'
    traffic ledgers recorded; five larger layouts (the chapter's and four drawn)
    with the check's own count. labkit's model, 3D run and ledgers are refused
    in the answer: it is a prediction."""
    if cluster.world_size < 2:
        raise ValueError(f"check_dp_bytes needs a data-parallel group of 2 ranks "
                         f"or more; the cluster has {cluster.world_size}")
    measured, computed = _dp_cases(fresh_seed(), cluster.world_size)
    # first the answers (a stub stops here, before any rank runs)
    answers = {}
    cases = ([(g, cfg) for g, cfg, _, _ in measured] + computed)
    for (tp, pp, dp), cfg in cases:
        for stage in range(pp):
            call = f"my_dp_bytes({stage}, tp={tp}, pp={pp}, dp={dp}, {cfg})"
            with own_calls(*_DP_OWN) as own:
                got = call_answer(fn, stage, tp, pp, dp, dict(cfg),
                                  what="my_dp_bytes")
            refuse_own(call, own, "model, 3D run or ledger (measuring, not "
                       "predicting), or this check's count")
            if got is NOT_WRITTEN:
                return NOT_YET
            answers[call] = as_number(call, got)
    seed = fresh_seed()
    for (tp, pp, dp), cfg, m, rows in measured:
        res = run_answer(cluster, _dp_worker, (tp, pp, dp), cfg, m, rows, seed,
                         what="3D step", timeout=timeout)
        for rank, (stage, sent, params) in enumerate(res):
            want = _dp_bytes(_stage_params(stage, tp, pp, cfg), dp)
            if params != _stage_params(stage, tp, pp, cfg) or not close_to(sent, want):
                raise RuntimeError(  # labkit's own count against its ThreeD
                    f"rank {rank}: ThreeD holds {params:,} parameters and sent "
                    f"{sent:,.0f} B in dp; the check counts "
                    f"{_stage_params(stage, tp, pp, cfg):,} and {float(want):,.0f} B")
            call = f"my_dp_bytes({stage}, tp={tp}, pp={pp}, dp={dp}, {cfg})"
            _compare_dp(call, answers[call], sent, stage, (tp, pp, dp), cfg,
                        f"rank {rank} sent {sent:,.0f} B in its dp group in one "
                        f"step ({_plural(m, 'micro-batch')} of "
                        f"{_plural(rows // dp // m, 'row')}), measured by its "
                        "traffic ledger")
    for (tp, pp, dp), cfg in computed:
        for stage in range(pp):
            call = f"my_dp_bytes({stage}, tp={tp}, pp={pp}, dp={dp}, {cfg})"
            want = _dp_bytes(_stage_params(stage, tp, pp, cfg), dp)
            _compare_dp(call, answers[call], want, stage, (tp, pp, dp), cfg,
                        f"expected {float(want):,.0f} B")
    grids = " and ".join(f"TP {t} x PP {p} x DP {d}" for (t, p, d), *_ in measured)
    print(f"correct: your prediction is what every rank sent in its dp group in "
          f"one step the check ran on {grids} (TinyGPTs drawn this run; traffic "
          f"ledger), and the check's own count on {len(computed)} larger layouts")
    return PASSED


def _compare_dp(call: str, got: float, want, stage: int, grid, cfg: dict,
                against: str) -> None:
    if close_to(got, want):
        return
    tp, pp, dp = grid
    hint = slips_named(got, want, _dp_slips(stage, tp, pp, dp, cfg), None)
    if hint is None:
        params = _stage_params(stage, tp, pp, cfg)
        implied = (f"; at 4 B x 2(dp-1)/dp that is {got / (8 * (dp - 1) / dp):,.1f} "
                   f"parameters, and stage {stage} holds {params:,} on a rank"
                   if dp > 1 else "")
        hint = (f"count the parameters of stage {stage} only (embedding on the "
                "first, final LayerNorm and head on the last), each block at 1/tp "
                "of its split matrices, 4 bytes each, times 2(dp-1)/dp" + implied)
    raise ExerciseError(f"{call} = {got:,.0f} B, but {against}. Hint: {hint}")


# ------------------------------------------ exercise 3: α-β seconds of a ring

_RING_OPS = ("all_reduce", "all_gather", "reduce_scatter")
_FIXED_RINGS = (("all_reduce", 268e6, 8, 1), ("reduce_scatter", 64e6, 16, 2),
                ("all_reduce", 1e6, 64, 8), ("all_gather", 797e6, 2048, 2048))
# labkit's α-β prices of a ring (the calculator's ring_latency and the rest of
# its step-time functions, alpha_beta_time), and this check's own
_RING_OWN = tuple(f"labkit.theory.layout.costs:{f}" for f in (
    "bubble_of_ideal", "ring_latency", "dp_latency_of", "latency", "dp_latency",
    "_dp_exposed", "step_time")) + (
    "labkit.theory.collective_cost:alpha_beta_time",
    "labkit.theory.collective_cost:AlphaBeta", "labkit.checks.three_d:_ring_exact")


def _ring_exact(op: str, size: float, n: int, nodes: int, spec, *, a_in=None,
                a_out=None, bw=None, inter=None, steps=None, sent=None) -> Fraction:
    """Seconds, exactly: steps x α (those between nodes at alpha_inter) + the
    bytes a rank sends over the link; a keyword replaces one term (a slip)."""
    twice = 2 if op == "all_reduce" else 1
    steps = twice * (n - 1) if steps is None else steps
    inter = (twice * (nodes - 1) if nodes > 1 else 0) if inter is None else inter
    a_in = Fraction(spec.alpha_intra if a_in is None else a_in)
    a_out = Fraction(spec.alpha_inter if a_out is None else a_out)
    bw = Fraction((spec.intra_bw if nodes == 1 else spec.inter_bw) if bw is None
                  else bw)
    sent = Fraction(twice * (n - 1), n) * Fraction(size) if sent is None else sent
    return (steps - inter) * a_in + inter * a_out + sent / bw


def _ring_cases(seed: int):
    """Four fixed collectives on LLAMA3_CLUSTER, and six drawn this run,
    each on a cluster drawn with it: one node, one rank per node, and several
    ranks on each of several nodes; α and bandwidths all distinct."""
    from labkit.theory import LLAMA3_CLUSTER, ClusterSpec

    rng = random.Random(seed)
    cases = [(op, size, n, nodes, LLAMA3_CLUSTER)
             for op, size, n, nodes in _FIXED_RINGS]
    for shape in ("node", "spread", "nodes", "node", "spread", "nodes"):
        per_node = rng.choice((4, 8, 16, 72))
        k = rng.randint(2, per_node)  # ranks in each node
        nodes = {"node": 1, "spread": rng.randint(2, 512),
                 "nodes": rng.randint(2, 256)}[shape]
        n = {"node": k, "spread": nodes, "nodes": k * nodes}[shape]
        a_in = rng.uniform(1e-6, 10e-6)
        spec = ClusterSpec(gpu_memory=80e9, gpus_per_node=per_node,
                           nodes=max(nodes, 1), intra_bw=rng.uniform(100e9, 900e9),
                           inter_bw=rng.uniform(10e9, 90e9), flops=1e15,
                           alpha_intra=a_in, alpha_inter=a_in * rng.uniform(2, 8),
                           name="drawn this run")
        cases.append((rng.choice(_RING_OPS), 10 ** rng.uniform(3, 10), n, nodes,
                      spec))
    return cases


def _ring_slips(op, size, n, nodes, spec) -> list:
    twice = 2 if op == "all_reduce" else 1
    inter = twice * (nodes - 1) if nodes > 1 else 0
    return [
        (_ring_exact(op, size, n, nodes, spec, a_in=0, a_out=0),
         "that is the bytes alone: every ring step also pays α"),
        (_ring_exact(op, size, n, nodes, spec, a_in=spec.alpha_inter),
         "every step paid the network's α: only the ring's steps between nodes "
         "(latency_steps(op, nodes) of them) do; the rest pay alpha_intra"),
        (_ring_exact(op, size, n, nodes, spec, a_out=spec.alpha_intra),
         "every step paid NVLink's α: the ring's steps between nodes "
         "(latency_steps(op, nodes) of them) pay alpha_inter"),
        (_ring_exact(op, size, n, nodes, spec, steps=twice * (n - 1) + inter),
         "the steps between nodes are some of the ring's latency_steps(op, n), "
         "not extra ones: latency_steps(op, n) - latency_steps(op, nodes) pay "
         "alpha_intra"),
        (_ring_exact(op, size, n, nodes, spec, inter=nodes - 1 if nodes > 1 else 0),
         "an all-reduce's ring crosses each node boundary twice (its reduce-"
         "scatter and its all-gather): latency_steps(op, nodes) = 2(nodes-1)"),
        (_ring_exact(op, size, n, nodes, spec, steps=n - 1,
                     inter=nodes - 1 if nodes > 1 else 0),
         "an all-reduce takes 2(n-1) steps, a reduce-scatter then an all-gather "
         "(theory.latency_steps)"),
        (_ring_exact(op, size, n, nodes, spec, bw=spec.intra_bw),
         "a ring that leaves its node moves its bytes at the network's inter_bw, "
         "not NVLink's"),
        (_ring_exact(op, size, n, nodes, spec, bw=spec.inter_bw),
         "inside one node the bytes go over NVLink (intra_bw)"),
        (_ring_exact(op, size, n, nodes, spec, sent=Fraction(size)),
         "that sends the whole array: a ring rank sends 2(n-1)/n of it for an "
         "all-reduce, (n-1)/n otherwise (theory.ring_bytes_per_rank(op, size, n))"),
    ]


def check_ring_seconds(fn) -> bool:
    """`fn(op, size, n, nodes, spec)`: the α-β seconds of a ring collective of
    `size` bytes over n ranks spread on `nodes` nodes of `spec` (a
    theory.ClusterSpec): the ring's steps, those between nodes at alpha_inter
    and the rest at alpha_intra, plus the bytes each rank sends over NVLink
    (one node) or the network. Checked on four fixed collectives and six
    drawn this run, each on a cluster drawn with it; labkit's own ring
    pricing (ring_latency, alpha_beta_time) is refused; the first wrong one is
    named, with what it looks like you left out."""
    cases = _ring_cases(fresh_seed())
    for op, size, n, nodes, spec in cases:
        call = f"my_ring_seconds({op!r}, {size:.4g}, n={n}, nodes={nodes}, spec)"
        with own_calls(*_RING_OWN) as own:
            got = call_answer(fn, op, size, n, nodes, spec, what="my_ring_seconds")
        refuse_own(call, own, "α-β price of a ring (or this check's)")
        if got is NOT_WRITTEN:
            return NOT_YET
        got = as_number(call, got)
        want = _ring_exact(op, size, n, nodes, spec)
        if close_to(got, want):
            continue
        hint = slips_named(
            got, want, _ring_slips(op, size, n, nodes, spec),
            "steps from theory.latency_steps(op, n), those between nodes "
            "from theory.latency_steps(op, nodes), bytes each rank sends "
            "from theory.ring_bytes_per_rank(op, size, n)")
        raise ExerciseError(
            f"{call} = {got:.6g} s, expected {float(want):.6g} s (alpha_intra "
            f"{spec.alpha_intra * 1e6:.3g} µs, alpha_inter "
            f"{spec.alpha_inter * 1e6:.3g} µs, intra_bw {spec.intra_bw / 1e9:.4g} "
            f"GB/s, inter_bw {spec.inter_bw / 1e9:.4g} GB/s). Hint: {hint}")
    drawn = len(cases) - len(_FIXED_RINGS)
    print(f"correct: your α-β seconds are the ring's on {len(_FIXED_RINGS)} fixed "
          f"collectives on Llama 3's cluster and on {drawn} drawn this run, each on "
          "a cluster drawn with it")
    return PASSED


# ----------------------------- exercise 4: move Llama 3's long-context stage

# the published long-context layout (Llama Team 2024, table 4; the calculator's
# PUBLISHED_RUNS["llama3-405b-128k"]): TP 8, PP 16, CP 16, DP 8, ZeRO-2,
# interleaved v = 2, 16 micro-batches of one 131,072-token sequence per replica
_TOKENS = 128 * 131072  # per step
_OLD = dict(cp=16, dp=8, seq=131072, microbatches=16)
_NEW = dict(cp=32, dp=4, seq=131072, microbatches=32)  # the chapter's question
_DIMS = ("tp", "cp", "pp", "dp")
# the calculator (estimate and the traffic it prices) and this check's own
_RATIO_OWN = tuple(f"labkit.theory.layout.costs:{f}" for f in (
    "dp_phases_of", "dp_traffic", "_cp_layer_bytes", "_ep_layer_bytes", "traffic",
    "estimate")) + ("labkit.theory.layout.runs", "labkit.checks.three_d:_per_gpu")


def _per_gpu(cp: int, dp: int, seq: int, m: int, *, zero_over_cp=True,
             rs_per_microbatch=True, gather=True, ring=True, whole_kv=True,
             sequences_per_mb=True) -> dict[str, Fraction]:
    """What a GPU sends per step in each dimension, up to factors the layouts
    share (h, bytes, layers, K and V's width, TP's and PP's ring factors), as
    section 7 prices it; a keyword set to False makes one slip."""
    seqs = Fraction(_TOKENS, seq * dp)  # sequences per replica per step
    b = seqs / m if sequences_per_mb else 1  # sequences per micro-batch
    tokens = m * b * Fraction(seq, cp)  # a GPU's tokens per step
    kv = m * b * (seq if whole_kv else Fraction(seq, cp))
    n = dp * cp if zero_over_cp else dp
    share = Fraction(n - 1, n)
    dp_calls = (m if rs_per_microbatch else 1) + (1 if gather else 0)
    return {"tp": tokens, "pp": tokens,
            "cp": kv * (Fraction(cp - 1, cp) if ring else 1),
            "dp": dp_calls * share}


def _ratios(layout: dict, **slip) -> dict[str, Fraction]:
    new = _per_gpu(layout["cp"], layout["dp"], layout["seq"],
                   layout["microbatches"], **slip)
    old = _per_gpu(_OLD["cp"], _OLD["dp"], _OLD["seq"], _OLD["microbatches"],
                   **slip)
    return {d: new[d] / old[d] for d in _DIMS}


def _ratio_cases(seed: int) -> list[dict]:
    """The chapter's CP 32 x DP 4, and five layouts drawn this run: CP and DP
    powers of two (any number of GPUs), sequences of 32K to 256K, any
    micro-batch count that divides a replica's sequences."""
    rng = random.Random(seed)
    cases = [dict(_NEW)]
    while len(cases) < 6:
        cp, dp = rng.choice((1, 2, 4, 8, 32, 64)), rng.choice((1, 2, 4, 16, 32))
        seq = rng.choice((32768, 65536, 131072, 262144))
        per_replica = _TOKENS // seq // dp
        b = rng.choice([k for k in (1, 2, 4) if per_replica % k == 0])
        if len(cases) == 1 and (b == 1 or 128 in (cp * dp, cp * dp * b)):
            continue  # one layout with several sequences a micro-batch, GPUs moved
        case = dict(cp=cp, dp=dp, seq=seq, microbatches=per_replica // b)
        if cp * dp > 1 and case not in cases:
            cases.append(case)
    return cases


_RATIO_SLIPS = {
    "tp": [
        (dict(sequences_per_mb=False),
         "a micro-batch holds b = (sequences per replica) / microbatches "
         "sequences, and b s h is what each all-reduce carries"),
    ],
    "cp": [
        (dict(whole_kv=False),
         "each layer all-gathers the K and V of the whole sequence, seq tokens, "
         "not the seq / cp a rank holds"),
        (dict(ring=False),
         "a ring all-gather over cp ranks sends (cp-1)/cp of what it gathers"),
    ],
    "dp": [
        (dict(zero_over_cp=False),
         "ZeRO-2 shards over DP x CP ranks: the CP ranks of a replica hold the "
         "same weights, so its ring's (n-1)/n has n = dp x cp"),
        (dict(rs_per_microbatch=False),
         "ZeRO-2 keeps 1/n of the gradients, so it reduce-scatters after every "
         "micro-batch's backward, not once per step"),
        (dict(gather=False),
         "and it all-gathers the updated weights once per step: microbatches + "
         "1 collectives of (n-1)/n of the stage's weights each"),
    ],
}
_RATIO_SLIPS["pp"] = _RATIO_SLIPS["tp"]
_RATIO_HINTS = {
    "tp": "4 all-reduces of b s h per layer and micro-batch, s the local "
          "sequence seq / cp: a GPU's bytes go with its tokens per step, "
          "microbatches x b x seq / cp",
    "pp": "one activation of b s h / t per micro-batch and chunk each way, s the "
          "local sequence: a GPU's bytes go with its tokens per step, "
          "microbatches x b x seq / cp",
    "cp": "per layer and micro-batch, K and V of the whole sequence gathered by "
          "a ring over cp ranks ((cp-1)/cp of it) and their gradients "
          "reduce-scattered back",
    "dp": "ZeRO-2 over n = dp x cp ranks: a reduce-scatter of the stage's "
          "gradients after every micro-batch and one all-gather of its weights "
          "per step, (n-1)/n each",
}


def check_traffic_ratios(fn) -> bool:
    """`fn(cp, dp, seq, microbatches)`: {"tp": r, "cp": r, "pp": r, "dp": r},
    each the bytes a GPU sends per step in that dimension when Llama 3 405B's
    long-context layout (TP 8, PP 16, CP 16, DP 8, ZeRO-2, interleaved v = 2,
    16 micro-batches of one 131,072-token sequence per replica, 16M tokens a
    step) becomes CP `cp` x DP `dp` with `seq`-token sequences in `microbatches`
    micro-batches per replica (same TP, PP and tokens per step), divided by the
    published layout's. The check prices both as section 7 does, with its own
    Fractions, on CP 32 x DP 4 and five layouts drawn this run; the calculator
    (estimate) is refused in the answer; the first dimension that is off is
    named with what it looks like was missed."""
    cases = _ratio_cases(fresh_seed())
    for layout in cases:
        args = ", ".join(f"{k}={v}" for k, v in layout.items())
        call = f"my_traffic_ratios({args})"
        with own_calls(*_RATIO_OWN) as own:
            got = call_answer(fn, *layout.values(), what="my_traffic_ratios")
        refuse_own(call, own, "layout calculator (estimate: reason it out "
                   "instead) or this check's")
        if got is NOT_WRITTEN:
            return NOT_YET
        if not isinstance(got, dict) or set(got) != set(_DIMS):
            raise ExerciseError(f"{call} returned {got!r}; return a dict with the "
                                f"keys {list(_DIMS)}")
        want = _ratios(layout)
        for d in _DIMS:
            v = got[d]
            if not is_number(v):
                raise ExerciseError(f"{call}[{d!r}] is {v!r}; return a number, "
                                    "the new layout's bytes over the old's")
            finite(f"{call}[{d!r}]", v)
            v = float(v)
            if close_to(v, want[d]):
                continue
            slips = [(Fraction(1), "a GPU's tokens per step, microbatches x b x "
                      "seq / cp = (tokens per step) / (dp x cp), changed with "
                      "this layout")] if d in ("tp", "pp") else []
            slips += [(_ratios(layout, **kw)[d], why)
                      for kw, why in _RATIO_SLIPS.get(d, ())]
            hint = slips_named(v, want[d], slips, _RATIO_HINTS[d])
            raise ExerciseError(
                f"{call}: {d} is {v:.6g} x the published layout's bytes per GPU "
                f"per step, but section 7's pricing gives {float(want[d]):.6g} x. "
                f"Hint: {hint}")
    print(f"correct: your tp, cp, pp and dp ratios are section 7's pricing "
          f"(the check's own closed forms) for CP 32 x DP 4 and for "
          f"{len(cases) - 1} layouts drawn this run")
    return PASSED
