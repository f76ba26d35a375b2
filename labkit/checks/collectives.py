"""Chapter 01's checks: all-to-all from point-to-point calls, a reduce-scatter that
sends (N-1)/N·M where gloo's sends twice that, and the bytes a GPU sends in a
two-level all-reduce (within its node, between nodes).

The two answers that communicate run on inputs drawn fresh each time (whole
numbers, so any order of adding them is exact in float32) under the traffic
ledger: labkit's own implementation and the collectives that would do the job
are refused before the values are looked at, the bytes or messages each rank
sent after. The formula is tried on cases drawn fresh each run, against an
exact reference (fractions) of this module's own.
"""

from __future__ import annotations

from fractions import Fraction

from labkit.checks.common import (
    NOT_WRITTEN,
    SHORT_TIMEOUT,
    ExerciseError,
    call_answer,
    check_like,
    finite,
    first_wrong,
    is_number,
    run_answer,
)
from labkit.checks.verify import fresh_seed, messages, own_calls, refuse_own

# labkit's own collectives from send/recv, its reduce-scatter by all-to-all, and
# its all-to-all of rows: never an answer
_OWN = ("labkit.comm.collectives", "labkit.parallel.reduce_scatter",
        "labkit.parallel.expert_parallel:all_to_all_rows")


def _plural(k: int, word: str) -> str:
    return f"{k} {word}" + ("" if k == 1 else "s")


def _answer_worker(rank, world_size, fn, x):
    """Run the answer on this rank's x (x[rank], copied) under the traffic
    ledger, with labkit's own implementations watched for."""
    import torch

    from labkit.ledger import traffic

    mine = x[rank].clone()
    with traffic() as t, own_calls(*_OWN) as own:
        out = fn(rank, world_size, mine.clone())
    if isinstance(out, torch.Tensor):
        out = out.detach().clone()
    return out, t.records, t.written, list(own)


def _silent(rank: int, records, why: str) -> None:
    """ExerciseError if this rank neither sent nor received anything."""
    if not records:
        raise ExerciseError(f"rank {rank} sent and received nothing: {why}; the "
                            "inputs are drawn afresh each run, so no rank can know "
                            "another's values without a message")


# ------------------------------------------------------------------ all-to-all
#
# Every element of every rank's x is a different whole number, drawn afresh:
# any value says which rank it started on, in which chunk and where in it.

_A2A_CHUNK = 2


def _a2a_inputs(seed: int, n: int, k: int):
    """x[i]: rank i's n chunks of k elements, all n·n·k values distinct whole
    numbers below 2**24 (exact in float32)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    values = torch.randperm(1 << 20, generator=g)[:n * n * k] + 1
    return values.float().view(n, n * k)


def _value(v: float) -> str:
    """A value as a message shows it: whole numbers in full (1007060, not
    %g's 1.00706e+06, which hides the digits a student compares)."""
    v = float(v)
    if v == v and abs(v) < 2**53 and v.is_integer():
        return f"{v:.0f}"
    return f"{v:g}"


def _origin(v: float, x, k: int) -> str:
    hit = (x == v).nonzero()
    if not len(hit):
        return f"{_value(v)}, a value no rank's x held (uninitialised memory? a sum?)"
    i, e = (int(a) for a in hit[0])
    return f"element {e % k} of rank {i}'s chunk {e // k}"


def check_all_to_all(cluster, fn, *, timeout: float = SHORT_TIMEOUT) -> None:
    """Check a student's all-to-all built from send/recv.

    `fn(rank, world_size, x)` gets this rank's x, n equal chunks, and returns a new
    tensor like x whose chunk i is chunk `rank` of rank i's x, using only
    point-to-point calls (isend/irecv, send/recv). The values are drawn afresh each
    run; a mistake is told by rank, chunk and element, with where the value came
    from; then each rank is held to one message of one chunk to each other rank.
    """
    n, k = cluster.world_size, _A2A_CHUNK
    x = _a2a_inputs(fresh_seed(), n, k)
    res = run_answer(cluster, _answer_worker, fn, x, what="all-to-all", timeout=timeout)
    if res is None:
        return
    for rank, (_, records, _, own) in enumerate(res):
        refuse_own(f"rank {rank}", own, "collectives")
        ops = messages(records)[2]
        if ops:
            raise ExerciseError(
                f"rank {rank}: it called {sorted(set(ops))}; the exercise builds "
                "the all-to-all from point-to-point messages alone (isend/irecv "
                "or send/recv), no collective")
        _silent(rank, records, f"chunk r of the result is rank r's chunk {rank}, "
                               "which only rank r has")
    for rank, (out, _, _, _) in enumerate(res):
        want = x.view(n, n, k)[:, rank].reshape(-1)  # chunk i: rank i's chunk `rank`
        check_like(f"rank {rank}", out, want,
                   "return a new tensor with x's shape and dtype")
        bad = first_wrong(out, want)
        if bad is not None:
            (e,) = bad
            got = float(out[e])
            raise ExerciseError(
                f"rank {rank}, chunk {e // k}, element {e % k}: got {_value(got)}, "
                f"expected {_value(want[e])}; it holds {_origin(got, x, k)}, expected "
                f"{_origin(float(want[e]), x, k)}. Chunk j of rank i goes to rank j "
                "and lands there as chunk i: send x.chunk(n)[dst] to each dst, and "
                "put what rank src sends at position src")
    chunk_bytes = 4 * k
    for rank, (_, records, _, _) in enumerate(res):
        _one_each(rank, n, records, chunk_bytes)
    print(f"correct: every rank r ended with chunk r of every rank, in rank order, "
          f"on values drawn this run; measured on every rank: one message of "
          f"{chunk_bytes} bytes (M/{n}) to each of the {n - 1} other ranks, one "
          "from each, no collective")


def _one_each(rank: int, n: int, records, chunk_bytes: int) -> None:
    """After the values: one message of one chunk to and from each other rank."""
    sends, recvs, _ = messages(records)
    where = f"rank {rank}, the values are right, but"
    for name, got, to in (("sent", sends, "to"), ("received", recvs, "from")):
        for peer in range(n):
            mine = [b for p, b in got if p == peer]
            if peer == rank and mine:
                raise ExerciseError(
                    f"{where} it {name} {_plural(len(mine), 'message')} {to} "
                    "itself: its own chunk stays, copy it")
            if peer != rank and len(mine) != 1:
                raise ExerciseError(
                    f"{where} it {name} {_plural(len(mine), 'message')} {to} rank "
                    f"{peer}; an all-to-all moves one chunk {to} each other rank")
            if peer != rank and mine[0] != chunk_bytes:
                raise ExerciseError(
                    f"{where} its message {name} {to} rank {peer} was {mine[0]:,} "
                    f"bytes; it carries one chunk, M/N = {chunk_bytes:,} bytes")


# ------------------------------------------------------- reduce-scatter, cheaply

_RS_NUMEL = 1 << 16  # 256 KiB of float32: a few hundred bytes of headers is < 1%

# collectives that add: the exercise is to add up the chunks after moving them
_ADDING = {"all_reduce": "an all-reduce, which moves 2(N-1)/N·M",
           "reduce_scatter": "gloo's reduce_scatter, an all-reduce underneath: "
                             "2(N-1)/N·M",
           "reduce": "a reduce to one root, which moves every rank's whole chunk"}


def _rs_inputs(seed: int, n: int, numel: int):
    """x[r]: rank r's numel whole numbers in [1, 1000): their sum over n ranks is
    exact in float32 in any order."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 1000, (n, numel), generator=g).float()


def _rs_why(got, rank: int, x, n: int) -> str:
    """What a wrong reduce-scatter result is instead, if it is something simple."""
    import torch

    chunks = x.view(n, n, -1)  # [rank q, chunk c]
    total = chunks.sum(0)
    candidates = {"the average over ranks, not the sum": total[rank] / n,
                  "this rank's own chunk, not summed over ranks": chunks[rank, rank],
                  f"this rank's own chunk times {n}: the other ranks' chunks were "
                  "never received": chunks[rank, rank] * n}
    for c in range(n):
        if c != rank:
            candidates[f"the sum of chunk {c}, not chunk {rank}"] = total[c]
    # a diagnosis, not the pass criterion: the sums are exact, the average is one
    # division off by a rounding (6e-8 relative); 1e-6 relative tells them all
    # apart (they differ by whole numbers)
    for why, t in candidates.items():
        if tuple(got.shape) == tuple(t.shape) and torch.allclose(got, t, rtol=1e-6,
                                                                  atol=0):
            return f": it holds {why}"
    return ""


def _sent(records) -> int:
    """Bytes a rank's calls sent, from the calls themselves (where the machine
    cannot count socket writes): sends' payloads, collectives' bus bytes."""
    return round(sum(r.payload_bytes if r.op == "send" else
                     0 if r.op == "recv" else r.bus_bytes for r in records))


def _rs_bytes_why(ratio: float, n: int) -> str:
    if abs(ratio - 2) < 0.1:
        return (": an all-reduce's traffic. Send each rank only its own chunk "
                "(all_to_all_single or isend/irecv) and add up what arrives")
    if abs(ratio - n) < 0.1:
        return (f": {n} times too much, an all-gather's traffic: every rank "
                "sent all of its x to every other rank, which needs only its "
                "own chunk of it")
    if ratio > 1:
        return (": more than the chunks the other ranks need; each rank needs "
                "from you only its own chunk, once")
    return ": less than the chunks the other ranks need from this one"


def check_cheap_reduce_scatter(cluster, fn, numel: int = _RS_NUMEL, *,
                               timeout: float = SHORT_TIMEOUT) -> None:
    """Check a student's reduce-scatter that sends (N-1)/N·M per rank.

    `fn(rank, world_size, x)` gets this rank's x (numel divisible by N, drawn
    afresh each run) and returns a tensor of numel/N: chunk `rank` of the sum of
    every rank's x. Collectives that add (gloo's reduce_scatter, all_reduce,
    reduce) and labkit's own reduce-scatters are refused; right values are not
    enough: each rank must write about (N-1)/N·M bytes to its sockets (2%).
    """
    n = cluster.world_size
    if numel % n:
        raise ValueError(f"numel {numel} is not divisible by {n} ranks")
    x = _rs_inputs(fresh_seed(), n, numel)
    res = run_answer(cluster, _answer_worker, fn, x, what="reduce-scatter",
                     timeout=timeout)
    if res is None:
        return
    s, m = numel // n, 4 * numel
    ring = (n - 1) / n * m
    for rank, (_, records, written, own) in enumerate(res):
        refuse_own(f"rank {rank}", own, "reduce-scatter")
        adding = [op for op in messages(records)[2] if op in _ADDING]
        if adding:
            op = adding[0]
            sent = written if written is not None else _sent(records)
            raise ExerciseError(
                f"rank {rank}: it called {op}, {_ADDING[op]} (here it wrote "
                f"{sent:,} bytes, {sent / ring:.2f} × (N-1)/N·M = {ring:,.0f}); "
                "the exercise moves only the chunks each rank needs and adds them "
                "up itself: all_to_all_single (or isend/irecv), then a sum")
        _silent(rank, records, f"chunk {rank} of the sum needs chunk {rank} of every "
                               "other rank's x")
    total = x.sum(0)
    for rank, (out, _, _, _) in enumerate(res):
        want = total[rank * s:(rank + 1) * s]
        hint = f"return chunk {rank} of the sum, {s} elements of float32"
        check_like(f"rank {rank}", out, want, hint)
        bad = first_wrong(out, want)  # whole numbers: every sum order is exact
        if bad is not None:
            raise ExerciseError(
                f"rank {rank}, element {list(bad)}: got {_value(out[bad])}, expected "
                f"{_value(want[bad])}{_rs_why(out, rank, x, n)}. Hint: {hint}")
    sent = []
    for rank, (_, records, written, _) in enumerate(res):
        # where this machine cannot count socket writes: from the calls
        sent.append(written if written is not None else _sent(records))
        if abs(sent[-1] - ring) > 0.02 * ring:
            ratio = sent[-1] / ring
            raise ExerciseError(
                f"rank {rank}: the values are right, but it sent {sent[-1]:,} "
                f"bytes ({ratio:.2f} × (N-1)/N·M = {ring:,.0f}) using "
                f"{sorted({r.op for r in records})}" + _rs_bytes_why(ratio, n))
    how = ("wrote {} bytes to its sockets" if all(r[2] is not None for r in res)
           else "sent {} bytes (counted from its calls)")
    amount = (f"{sent[0]:,}" if min(sent) == max(sent)
              else f"{min(sent):,} to {max(sent):,}")
    print(f"correct: chunk r of the sum on every rank r, on values drawn this run; "
          f"measured: each rank {how.format(amount)}, (N-1)/N·M = {ring:,.0f} to "
          "within 2% (gloo's reduce_scatter: 2(N-1)/N·M)")


# ------------------------------------------- a two-level all-reduce, bytes per GPU


def _two_level(size, per_node: int, nodes: int) -> tuple[Fraction, Fraction]:
    """(within a node, between nodes) bytes one GPU sends, exactly: a ring
    reduce-scatter and a ring all-gather among the per_node GPUs of its node,
    each sending (per_node - 1) chunks of size/per_node; between them a ring
    all-reduce of its size/per_node shard among the `nodes` GPUs of its local
    rank, 2 (nodes - 1) chunks of that shard / nodes."""
    s, a, b = Fraction(size), per_node, nodes
    return 2 * (a - 1) * (s / a), 2 * (b - 1) * (s / a / b)


def _two_level_cases(seed: int) -> list[tuple[int, int, int]]:
    import random

    rng = random.Random(seed)
    cases = [(10**9, 8, 4)]  # the chapter's question: 1 GB on 4 nodes of 8 GPUs
    for _ in range(5):
        cases.append((rng.randint(10**5, 10**11), rng.randint(2, 16),
                      rng.randint(2, 128)))
    cases.append((rng.randint(10**5, 10**11), 1, rng.randint(2, 128)))  # 1 per node
    cases.append((rng.randint(10**5, 10**11), rng.randint(2, 16), 1))   # one node
    return cases


def _near(got: float, v: float) -> bool:
    return abs(got - v) <= 1e-9 * max(abs(v), 1.0)


def _two_level_why(part: str, got: float, size: int, a: int, b: int) -> str:
    """The usual mistakes, by what the wrong number equals."""
    s, n = float(size), a * b
    if part == "within":
        near = {
            (a - 1) / a * s: "one phase; within the node there are two, the "
                             "reduce-scatter before and the all-gather after",
            2 * (n - 1) / n * s: f"one ring through all N = {n} GPUs; here a ring "
                                 f"spans the {a} GPUs of one node",
            2 * s: "the large-N limit; keep the (per_node - 1)/per_node",
            2 * (b - 1) / b * s / a: "the bytes between nodes: the pair is "
                                     "(within, between)",
        }
    else:
        near = {
            2 * (b - 1) / b * s: "the whole array; after the reduce-scatter each "
                                 "GPU all-reduces only its shard, size/per_node",
            (b - 1) / b * s / a: "one phase; the step between nodes is a whole "
                                 "all-reduce, reduce-scatter and all-gather",
            2 * (n - 1) / n * s: f"one ring through all N = {n} GPUs",
            2 * s / a: "the large-N limit; keep the (nodes - 1)/nodes",
            2 * (a - 1) / a * s: "the bytes within the node: the pair is "
                                 "(within, between)",
        }
    for v, why in near.items():
        if _near(got, v):
            return f"; that is {why}"
    return ""


def check_bytes_per_rank(fn) -> None:
    """Check a student's `fn(size, per_node, nodes)`: the bytes each GPU sends in
    a two-level all-reduce of `size` bytes on `nodes` nodes of `per_node` GPUs
    (a ring reduce-scatter within each node, a ring all-reduce of each GPU's
    shard between nodes, a ring all-gather within each node), as the pair
    (within its node, between nodes). Cases are drawn fresh each run; labkit's
    own ring formulas are refused."""
    import pkgutil

    import labkit.theory

    theory = [f"labkit.theory.{m.name}" for m in pkgutil.iter_modules(
        labkit.theory.__path__)]
    cases = _two_level_cases(fresh_seed())
    for size, a, b in cases:
        call = f"two_level_bytes({size:,}, per_node={a}, nodes={b})"
        with own_calls(*theory, "labkit.checks.collectives:_two_level") as own:
            got = call_answer(fn, size, a, b, what="bytes per GPU")
        refuse_own(call, own, "formulas (or this check's reference)")
        if got is NOT_WRITTEN:
            return
        within, between = _two_level(size, a, b)
        if is_number(got):
            finite(call, got)
            total = 2 * (a * b - 1) / (a * b) * size
            raise ExerciseError(
                f"{call}: got the one number {got!r}; return the pair (bytes "
                "within the node, bytes between nodes)" + (
                    ", whose sum that is" if _near(float(got), total) else ""))
        if (not isinstance(got, (tuple, list)) or len(got) != 2
                or not all(is_number(v) for v in got)):
            raise ExerciseError(f"{call}: expected a pair of numbers (within, "
                                f"between), got {type(got).__name__} {got!r}")
        for part, yours, want in (("within", got[0], within),
                                  ("between", got[1], between)):
            what = f"{call}, bytes {part} {'its node' if part == 'within' else 'nodes'}"
            finite(what, yours)
            # a formula in float64: another order of the same operations differs
            # in the 16th digit; 1e-9 relative absorbs that and nothing else
            if not abs(yours - want) <= 1e-9 * max(want, 1):
                raise ExerciseError(
                    f"{what}: got {float(yours):,.6g}, expected {float(want):,.6g}"
                    + _two_level_why(part, float(yours), size, a, b))
    size, a, b = cases[0]
    within, between = (float(v) for v in _two_level(size, a, b))
    n = a * b
    print(f"correct on {len(cases)} cases, {len(cases) - 1} of them drawn this run: "
          f"for 1 GB on {b} nodes of {a} GPUs each GPU sends {within / 1e9:g} GB "
          f"within its node and {between / 1e9:g} GB between nodes, "
          f"{(within + between) / 1e9:g} GB in all: the 2(N-1)/N·S of one ring "
          f"through all {n}, with {a} times fewer bytes between nodes")
