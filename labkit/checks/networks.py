"""Chapter 03's checks: the MoE return trip (combine) on real ranks, and two rings
that share no link on a torus.

The combine runs after a dispatch the check draws afresh each run (tokens,
routing, the experts' outputs), under the traffic ledger: labkit's own
all-to-all of rows and any collective but all-to-all are refused, split sizes
that do not match across ranks are named before gloo sees them, and after the
values each rank is held to the bytes of the rows it sends home. The rings are
tried on the chapter's 4x4 torus and on tori drawn afresh each run.
"""

from __future__ import annotations

from labkit.checks.common import (
    NOT_WRITTEN,
    NOT_YET,
    PASSED,
    SHORT_TIMEOUT,
    ExerciseError,
    call_answer,
    run_answer,
)
from labkit.checks.verify import (
    SizesDisagree,
    fresh_seed,
    messages,
    own_calls,
    refuse_own,
    sizes_agree,
)

FEATURES = 4  # the width of a token's row

# labkit's own MoE exchange: never an answer
_OWN = ("labkit.parallel.expert_parallel",)


def _plural(k: int, word: str) -> str:
    return f"{k} {word}" + ("" if k == 1 else "s")


# ------------------------------------------------------------------ the combine


def _draw_moe(seed: int, n: int):
    """Fresh tokens, routing and expert marks for n ranks: x[r] (T_r, FEATURES)
    rows of distinct whole numbers, expert[r] the expert of each token (every
    rank sends some tokens away, the counts uneven), mark[e] what expert e adds
    to a row. Whole numbers below 2**24: exact in float32."""
    import torch

    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(6, 15, (n,), generator=g).tolist()
    ids = torch.randperm(1 << 20, generator=g)[:sum(sizes) * FEATURES] + 1
    rows = ids.float().view(-1, FEATURES).split(sizes)
    experts = []
    for r, t in enumerate(sizes):
        lean = torch.rand(n, generator=g) + 0.2  # each rank prefers some experts
        e = torch.multinomial(lean, t, replacement=True, generator=g)
        if bool((e == r).all()):  # some tokens must travel
            e[0] = (r + 1) % n
        experts.append(e)
    mark = torch.randint(1, 1 << 20, (n, FEATURES), generator=g).float()
    return list(rows), experts, mark


_REVERSE = ("the return trip is the dispatch reversed: y's rows arrived by "
            "recv_counts, so they leave by recv_counts (input_split_sizes) and "
            "come home by send_counts (output_split_sizes)")


def _mismatch(plans: list[dict]) -> str:
    """What is wrong with one all_to_all_single call across the ranks (the
    plans verify.sizes_agree stopped it on)."""
    n = len(plans)
    for q, p in enumerate(plans):
        for k, (side, rows, key) in enumerate((("input", "in_rows", "ins"),
                                                ("output", "out_rows", "outs"))):
            split, tensor = p[key], f"its {side} tensor"
            if split is None:
                if p["given"][k]:
                    return f"rank {q}: {p['problem']}"
                return (f"rank {q} called all_to_all_single without {side}_split_"
                        f"sizes on {tensor} of {p[rows]} rows, which does not split "
                        f"into {n} equal parts; the splits here are uneven, and "
                        + _REVERSE)
            if len(split) != n:
                return (f"rank {q} passed {side}_split_sizes {split}: one size per "
                        f"rank, {n} of them")
            if sum(split) != p[rows]:
                return (f"rank {q} passed {side}_split_sizes {split}, {sum(split)} "
                        f"rows in all, for {tensor} of {p[rows]} rows; " + _REVERSE)
        if p["row"] != p["out_row"] or p["dtype"] != p["out_dtype"]:
            return (f"rank {q}'s input rows are {p['row']} {p['dtype']}, its output "
                    f"rows {p['out_row']} {p['out_dtype']}: make the output like y "
                    "(y.new_empty(rows, y.shape[1]))")
    for i, p in enumerate(plans):
        for j, other in enumerate(plans):
            if p["ins"][j] != other["outs"][i]:
                equal = [f"rank {q} passed no {side}_split_sizes"
                         for q, side, k in ((i, "input", 0), (j, "output", 1))
                         if not plans[q]["given"][k]]
                return (f"rank {i} sends {_plural(p['ins'][j], 'row')} to rank {j}, "
                        f"which expects {other['outs'][i]} from it"
                        + (f" ({' and '.join(equal)}: equal parts)" if equal else "")
                        + " (gloo would abort every rank on this); " + _REVERSE)
    return "the ranks' all-to-all sizes do not pair up; " + _REVERSE


def _combine_worker(rank, world_size, fn, rows, experts, mark, token):
    import torch
    import torch.distributed as dist

    from labkit.ledger import traffic

    x, expert = rows[rank], experts[rank]
    order = expert.argsort(stable=True)  # the dispatch of section 4
    send_counts = torch.bincount(expert, minlength=world_size)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)
    received = x.new_empty(int(recv_counts.sum()), FEATURES)
    dist.all_to_all_single(received, x[order],
                           output_split_sizes=recv_counts.tolist(),
                           input_split_sizes=send_counts.tolist())
    y = received + mark[rank]  # "the expert ran": this rank's expert marks each row
    problem = None
    with traffic() as t, own_calls(*_OWN) as own:
        try:
            with sizes_agree(token):
                out = fn(y, send_counts.clone(), recv_counts.clone(), order.clone())
        except SizesDisagree as e:
            out, problem = None, _mismatch(e.plans)
    if isinstance(out, torch.Tensor):
        out = out.detach().clone()
    return {"out": out, "records": t.records, "own": list(own), "problem": problem,
            "recv_counts": recv_counts.tolist()}


def _lookup(rows, mark) -> dict[tuple, str]:
    """Every row a combine could return, by its values: each token after each
    expert, and each token as it was."""
    table = {}
    for src, x in enumerate(rows):
        for i, row in enumerate(x):
            table[tuple(row.tolist())] = (f"token {i} of rank {src}, not through "
                                          "an expert")
            for e in range(len(mark)):
                table[tuple((row + mark[e]).tolist())] = (
                    f"token {i} of rank {src}, through expert {e}", src, i, e)
    return table


def check_moe_combine(cluster, fn, *, timeout: float = SHORT_TIMEOUT) -> bool:
    """Check a student's MoE combine: the all-to-all that brings each token's
    expert output back to the rank it came from, in its original order.

    `fn(y, send_counts, recv_counts, order)` runs on every rank after a dispatch
    like section 4's: y holds the expert's outputs for the rows this rank received
    (grouped by source rank), send_counts / recv_counts are the dispatch's split
    sizes and order the argsort that grouped this rank's tokens by expert. It
    returns one row per token this rank sent, row i for its token i. Tokens,
    routing and expert outputs are drawn afresh each run; the answer must move
    the rows with all-to-all (or send/recv), each row to its own rank only.
    """
    n = cluster.world_size
    rows, experts, mark = _draw_moe(fresh_seed(), n)
    token = f"labkit-combine-{fresh_seed()}"
    res = run_answer(cluster, _combine_worker, fn, rows, experts, mark, token,
                     what="combine", timeout=timeout)
    if res is None:
        return NOT_YET
    for r in res:
        if r["problem"]:
            raise ExerciseError(f"before the all-to-all: {r['problem']}")
    for rank, r in enumerate(res):
        refuse_own(f"rank {rank}", r["own"], "all-to-all of rows")
        other = sorted(set(messages(r["records"])[2]) - {"all_to_all"})
        if other:
            raise ExerciseError(
                f"rank {rank}: it called {other}; the combine is an all-to-all: each "
                "row goes back to one rank, the one its token came from "
                "(dist.all_to_all_single with the dispatch's split sizes swapped, "
                "or isend/irecv)")
        away = int((experts[rank] != rank).sum())
        if not r["records"] and away:
            raise ExerciseError(
                f"rank {rank} sent and received nothing, but {_plural(away, 'token')} "
                "of it went to experts on other ranks: their outputs are there, "
                "in those ranks' y, and come back only by an all-to-all")
    table = _lookup(rows, mark)
    for rank, r in enumerate(res):
        _combined_rows(rank, r["out"], experts[rank], rows[rank], mark, table, n)
    row_bytes = 4 * FEATURES
    for rank, r in enumerate(res):
        sends, _, _ = messages(r["records"])
        sent = round(sum(b for _, b in sends) + sum(
            x.bus_bytes for x in r["records"] if x.op == "all_to_all"))
        home = sum(c for q, c in enumerate(r["recv_counts"]) if q != rank)
        if sent != home * row_bytes:
            raise ExerciseError(
                f"rank {rank}, the rows are right, but it sent {sent:,} bytes to "
                f"other ranks; the rows it holds for them are {_plural(home, 'row')} "
                f"of {row_bytes} bytes, {home * row_bytes:,} bytes: send each row "
                "once, only to the rank its token came from")
    sent = [sum(c for q, c in enumerate(r["recv_counts"]) if q != rank)
            for rank, r in enumerate(res)]
    print(f"correct: on {n} ranks, with tokens and routing drawn this run, every "
          "token came back from its expert to its own rank, in its original place; "
          f"measured: each rank sent exactly the rows it held for the others "
          f"({', '.join(map(str, sent))} rows of {row_bytes} bytes)")
    return PASSED


def _combined_rows(rank, out, expert, x, mark, table, n) -> None:
    """ExerciseError naming the first wrong row of this rank's combine."""
    import torch

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
    if out.dtype != torch.float32:
        raise ExerciseError(f"rank {rank}: combine returned {out.dtype}; keep the "
                            "expert outputs' dtype (float32)")
    want = x + mark[expert]
    wrong = [i for i in range(tokens) if not torch.equal(out[i], want[i])]
    if not wrong:
        return
    found = [table.get(tuple(out[i].tolist())) for i in wrong]
    # a row from another rank is the deeper mistake: report it before order
    foreign = [k for k, f in enumerate(found) if isinstance(f, tuple) and f[1] != rank]
    k = (foreign or [0])[0]
    i, f = wrong[k], found[k]
    msg = (f"rank {rank}, row {i}: expected token {i} of rank {rank}, through "
           f"expert {int(expert[i])}, got ")
    if f is None:
        values = [float(v) for v in out[i]]
        raise ExerciseError(msg + f"the values {values}, which no token had after "
                            "any expert: return the rows y holds, moved, not "
                            "computed")
    if isinstance(f, str):
        raise ExerciseError(msg + f + ": return the expert outputs y holds")
    _, src, idx, _ = f
    if src != rank:
        hint = ("rows went back to the wrong rank: " + _REVERSE)
    elif idx != i:
        hint = ("the right rank, the wrong place: rows come back grouped by "
                "expert, in `order`; put row j at position order[j] "
                "(out[order] = back)")
    else:
        hint = "each row comes back from the expert its token was sent to"
    raise ExerciseError(msg + f[0] + f". Hint: {hint}")


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


def _steps(ring) -> list[tuple[str, str]]:
    """The one-way links a ring's transfers use: each device to the next."""
    ring = list(ring)
    return list(zip(ring, ring[1:] + ring[:1]))


def _tori(seed: int) -> list[tuple[int, int]]:
    """The chapter's 4x4 torus and two drawn afresh: 3 to 8 columns, an even
    number of rows from 4 to 8 (so that the snake closes), not 4x4 again."""
    import random

    rng = random.Random(seed)
    dims = [(4, 4)]
    while len(dims) < 3:
        d = (rng.randint(3, 8), rng.choice((4, 6, 8)))
        if d not in dims:
            dims.append(d)
    return dims


def check_two_rings(fn, dims=None, size: float = 1e9) -> bool:
    """Check a student's pair of rings on a torus.

    `fn(topo)` gets a 2-D torus (labkit.comm.topology.torus) and returns two rings,
    each a list of all its device names in ring order. Each ring all-reduces half of
    `size` bytes at the same time as the other. Right when every step of both rings
    is one hop and no link (one direction of a cable) carries both, so that the
    busiest link carries (N-1)/N * size, half of one ring's 2(N-1)/N * size. Tried
    on the 4x4 torus and on two tori drawn afresh each run (`dims` to choose).
    """
    from labkit.comm import ring_all_reduce_transfers, route, torus

    drawn = dims is None
    dims = _tori(fresh_seed()) if drawn else dims
    names = []
    for d in dims:
        topo = torus(d, 45e9)
        names.append(topo.name)
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
        a, b = _steps(rings[0]), _steps(rings[1])
        shared = [s for s in b if s in set(a)]
        if len(shared) == len(a):
            raise ExerciseError(
                f"on the {topo.name}: ring B is ring A again (perhaps starting at "
                "another device): every one of its steps uses a link ring A uses, "
                "in the same direction. Hint: the rings may share a cable if they "
                "cross it in opposite directions")
        if shared:
            (u, v) = shared[0]
            raise ExerciseError(
                f"on the {topo.name}: link {u} -> {v} carries both rings, and "
                f"{len(shared)} links do: on each, the two rings' bytes queue one "
                "behind the other. Hint: the rings may share a cable if they cross "
                "it in opposite directions")
    # what routing the student's rings gives, for the line below (the verdict
    # above counted their steps directly)
    both = route(topo, ring_all_reduce_transfers(list(rings[0]), size / 2)
                 + ring_all_reduce_transfers(list(rings[1]), size / 2))
    n = len(topo.devices)
    print(f"correct on the {', the '.join(names)}"
          + (" (the last two drawn this run)" if drawn else "")
          + ": two rings, every step one hop, no one-way link in both. Routed on the "
          f"{topo.name}, your rings put {both.max_link_bytes / 1e9:.4g} GB on the "
          f"busiest link for M = {size / 1e9:g} GB on {n} chips, (N-1)/N·M, half "
          "of one ring's 2(N-1)/N·M: the all-reduce takes half the time")
    return PASSED
