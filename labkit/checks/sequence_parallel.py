"""Chapter 11's checks: the online-softmax merge that ring attention runs on every
block, a sequence-parallel MLP's forward (all-gather in, reduce-scatter out), how
a ring rank's blocks and chunks grow with fewer ranks, and the choice of a
context-parallel method under GQA and a memory limit.

Inputs are drawn fresh each run. The two on the ranks refuse labkit's own
implementation (its merge; its sequence- and tensor-parallel layers and
mappings) before looking at values, and the MLP is held to one all-gather and
one reduce-scatter of the closed form's bytes. The two formulas are tried on
cases drawn fresh each run, against references computed exactly here.
"""

from __future__ import annotations

import copy
from fractions import Fraction

from labkit.checks.common import (
    NOT_WRITTEN,
    NOT_YET,
    PASSED,
    SHORT_TIMEOUT,
    ExerciseError,
    call_answer,
    check_like,
    finite,
    is_number,
    number_text,
    rounding_tolerance,
    run_answer,
    wrong_element,
)
from labkit.checks.verify import fresh_seed, own_calls, refuse_own

RING = (2, 2, 8, 4)  # batch, heads, sequence, head dim: 8 positions, 2 per rank
SEQ, BATCH, HIDDEN, FFN = 8, 2, 6, 8  # the MLP of exercise 2: Linear(6, 8), (8, 6)
# An answer passes within its float32 reference's own rounding (the reference
# against the same computed in float64: common.rounding_tolerance). The hints
# below only name a mistake already found: they recognise it within this much of
# the largest element, far above rounding (~1e-7) and far below what tells the
# mistakes apart (a bias, a rescale: ~1e-1).
DIAGNOSIS_REL = 1e-4
# labkit's own merge, sequence-parallel layer and mappings, and this module's
# references: never an answer
_OWN_MERGE = ("labkit.parallel.ring_attention:merge_partials",)
_OWN_MLP = ("labkit.parallel.sequence_parallel", "labkit.parallel.tensor_parallel",
            "labkit.parallel.tensor_parallel_mappings",
            "labkit.parallel.reduce_scatter")
_OWN_FORMULAS = ("labkit.theory.context_parallel",
                 "labkit.checks.sequence_parallel:_growth",
                 "labkit.checks.sequence_parallel:_cp_methods")


def _fmt(shape) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"


def _like(got, guess) -> bool:
    """A diagnosis, not a pass criterion: `got` is `guess` up to DIAGNOSIS_REL of
    its largest element."""
    tol = DIAGNOSIS_REL * max(float(guess.abs().max()), 1e-12)
    return got.shape == guess.shape and bool(
        ((got.double() - guess.double()).abs() <= tol).all())


# -- exercise 1: the online-softmax merge -------------------------------------------


def _pair(seed: int, spread: float):
    """Two partials over disjoint keys for 2 x 3 query rows, scores up to
    `spread` apart, and the partial over both keys sets (by definition, one
    block over all the keys), in float32 and float64."""
    import torch

    from labkit.parallel import block_partial

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 3, 4, generator=g)
    k = torch.randn(2, 10, 4, generator=g)
    v = torch.randn(2, 10, 4, generator=g)
    k[:, 5:] *= 1 + spread  # the second block's scores run far above the first's
    a, b = block_partial(q, k[:, :5], v[:, :5], 1.0), block_partial(q, k[:, 5:],
                                                                    v[:, 5:], 1.0)
    return a, b, block_partial(q, k, v, 1.0), block_partial(
        *(t.double() for t in (q, k, v)), 1.0)  # the float64 reference


def _pair_seeds(seed: int, rank: int):
    return ((seed + 2 * rank, 0.0), (seed + 2 * rank + 1, 30.0))


def _merge_worker(rank, world_size, fn, seed):
    import torch

    from labkit.ledger import traffic
    from labkit.parallel import Partial, attention, ring_attention

    out = {"pairs": [], "own": [], "records": []}

    def merge(a, b):  # a plain tuple or list of the three tensors will do
        with own_calls(*_OWN_MERGE) as own:
            got = fn(a, b)
        out["own"] += [x for x in own if x not in out["own"]]
        return Partial(*got) if isinstance(got, (tuple, list)) and len(got) == 3 \
            else got

    for pseed, spread in _pair_seeds(seed, rank):
        a, b, want, exact = _pair(pseed, spread)
        with traffic() as led:
            got = merge(a, b)
        out["records"] += led.records
        out["pairs"].append((got, want, exact, spread))
    ok = not out["own"] and not out["records"] and all(
        isinstance(got, Partial) and all(isinstance(x, torch.Tensor)
                                         and x.shape == y.shape
                                         for x, y in zip(got, want))
        for got, want, _, _ in out["pairs"])
    out["ring"] = out["want"] = out["exact"] = None
    if not ok:  # the kernel says what is wrong with the pairs: no ring needed
        return out
    g = torch.Generator().manual_seed(seed + 1000)
    q, k, v = (torch.randn(RING, generator=g) for _ in range(3))
    c = RING[2] // world_size
    rows = slice(rank * c, (rank + 1) * c)
    with torch.no_grad():
        out["ring"] = ring_attention(q[..., rows, :].clone(), k[..., rows, :].clone(),
                                     v[..., rows, :].clone(), causal=True,
                                     merge_fn=merge)
    out["want"] = attention(q, k, v, causal=True)[..., rows, :]
    out["exact"] = attention(q.double(), k.double(), v.double(),
                             causal=True)[..., rows, :]
    return out


def _merge_hint(name, got, a, b) -> str:
    import torch

    if name == "m":
        return ("m is the running max: the larger of the two maxima, torch.maximum("
                "a.m, b.m), so that every exp(...) below is at most 1 and never "
                "overflows")
    plain = (a.acc + b.acc) if name == "acc" else (a.l + b.l)
    if _like(got, plain):
        return (f"{name} is a.{name} + b.{name}, not rescaled: each partial's sums "
                "are relative to its own max; multiply a's by exp(a.m - m) and b's "
                "by exp(b.m - m) before adding (m the new max)")
    if not bool(torch.isfinite(got).all()):
        return ("it overflowed to inf or nan: rescale each partial by exp(its max - "
                "the larger max), a factor of at most 1 (exp(m_new - m_old) grows "
                "without bound)")
    return (f"m = max(a.m, b.m); {name} = a.{name} * exp(a.m - m) + b.{name} * "
            "exp(b.m - m) (acc needs the factor per row: [..., None])")


def check_online_softmax_merge(cluster, fn, *, timeout: float = SHORT_TIMEOUT
                               ) -> bool:
    """Check a student's online-softmax merge, `fn(a, b) -> Partial`.

    a and b are Partials (acc, m, l) of the same query rows over two disjoint sets
    of keys: m the row's max score, l = sum exp(score - m), acc = sum exp(score -
    m) v. The result must be the Partial over both sets, with m the larger max.
    On every rank it is tried on two pairs drawn fresh each run (scores alike;
    scores 30x apart, where a merge that rescales upward overflows), then used
    by ring attention on the ranks, causal, against one process's attention.
    labkit's merge_partials and any communication are refused. A wrong tensor
    is reported by rank and element, expected against got, with what the
    mistake looks like."""
    seed = fresh_seed()
    res = run_answer(cluster, _merge_worker, fn, seed, what="merge",
                     timeout=timeout)
    if res is None:
        return NOT_YET
    from labkit.parallel import Partial

    for rank, r in enumerate(res):
        refuse_own(f"rank {rank}", r["own"], "online-softmax merge")
        if r["records"]:
            raise ExerciseError(
                f"rank {rank}: your merge called {sorted({x.op for x in r['records']})}"
                "; merging two partials is local arithmetic on one rank, no "
                "communication (the ring moves the keys and values)")
    allowed = 0.0
    for rank, r in enumerate(res):
        for (pseed, spread), (got, want, exact, _) in zip(_pair_seeds(seed, rank),
                                                          r["pairs"]):
            case = "scores far apart" if spread else "scores alike"
            if not isinstance(got, Partial):
                raise ExerciseError(
                    f"rank {rank} ({case}): your merge returned "
                    f"{type(got).__name__}, not a Partial: return "
                    "Partial(acc, m, l) (or a tuple of those three tensors)")
            a, b, _, _ = _pair(pseed, spread)
            for name in ("m", "l", "acc"):
                mine, ref = getattr(got, name), getattr(want, name)
                where = f"rank {rank} ({case}), the merged {name}"
                check_like(where, mine, ref, hint=f"{name} keeps the shape of a.{name}")
                bad = wrong_element(mine, ref, getattr(exact, name))
                if bad is not None:
                    i, x, y, _ = bad
                    raise ExerciseError(
                        f"{where}, element {list(i)}: got {x:.6g}, expected {y:.6g}. "
                        "Hint: " + _merge_hint(name, mine, a, b))
        check_like(f"rank {rank}: ring attention's output", r["ring"], r["want"])
        bad = wrong_element(r["ring"], r["want"], r["exact"])
        if bad is not None:
            i, x, y, _ = bad
            raise ExerciseError(
                f"rank {rank}: ring attention with your merge, output element "
                f"{list(i)}: got {x:.6g}, expected {y:.6g}. Your merge is right on "
                "two partials but not in the ring, where it merges the running "
                "result with each new block in turn: does it change its inputs in "
                "place, or keep something between calls?")
        allowed = max(allowed, rounding_tolerance(r["want"], r["exact"]))
    t = cluster.world_size
    print(f"correct on inputs drawn this run: on every rank the merged partial "
          f"is the partial over both sets of keys (scores alike, and 30x apart), "
          f"with no communication; with it, ring attention on {t} ranks gives one "
          f"process's causal attention (within {allowed:.1g}, the rounding of one "
          "process's float32)")
    return PASSED


# -- exercise 2: a sequence-parallel MLP's forward ------------------------------------


def _mlp_data(seed: int):
    import torch

    torch.manual_seed(seed)  # the same MLP and input in every process
    fc1, fc2 = torch.nn.Linear(HIDDEN, FFN), torch.nn.Linear(FFN, HIDDEN)
    x = torch.randn(SEQ, BATCH, HIDDEN,
                    generator=torch.Generator().manual_seed(seed + 1))
    return fc1, fc2, x


def _sp_mlp_worker(rank, world_size, fn, seed):
    import torch
    import torch.nn.functional as F

    from labkit.ledger import traffic

    fc1, fc2, x = _mlp_data(seed)
    s, f = SEQ // world_size, FFN // world_size
    mine, cols = slice(rank * s, (rank + 1) * s), slice(rank * f, (rank + 1) * f)
    args = (x[mine].clone(), fc1.weight.detach()[cols].clone(),
            fc1.bias.detach()[cols].clone(), fc2.weight.detach()[:, cols].clone(),
            fc2.bias.detach().clone())
    with torch.no_grad(), traffic() as led, own_calls(*_OWN_MLP) as own:
        y = fn(*args, None)
    with torch.no_grad():
        want = fc2(F.gelu(fc1(x)))
        f1, f2 = copy.deepcopy(fc1).double(), copy.deepcopy(fc2).double()
        hidden = F.gelu(f1(x.double()))
        exact = f2(hidden)
        # the ranks' partial sums, which the reduce-scatter adds and which may
        # cancel: a right answer rounds by units of these, not of their sum
        terms = max(float((hidden[mine, :, c] @ f2.weight[:, c].T).abs().max())
                    for c in (slice(q * f, (q + 1) * f) for q in range(world_size)))
    return {"y": y, "want": want[mine], "exact": exact[mine], "whole": want,
            "terms": max(terms, float(exact[mine].abs().max())),
            "bias": fc2.bias.detach(), "records": list(led.records),
            "own": list(own)}


_RS = ("reduce_scatter", "all_to_all")  # gloo's, or labkit's way: all-to-all + sum


def check_sequence_parallel_mlp(cluster, fn, *, timeout: float = SHORT_TIMEOUT
                                ) -> bool:
    """Check a student's sequence-parallel MLP forward on Linear(6, 8), GeLU,
    Linear(8, 6), with weights and input drawn fresh each run.

    `fn(x, w1, b1, w2, b2, group)` gets this rank's sequence shard x (8/t, 2, 6),
    its rows of the first layer (w1 (8/t, 6), b1 (8/t,)), its columns of the
    second (w2 (6, 8/t)), the whole second bias b2 (6,) and the group (None: all
    ranks). It must return this rank's shard (8/t, 2, 6) of fc2(gelu(fc1(x))):
    all-gather the sequence, the local column- and row-parallel matmuls, a
    reduce-scatter back to sequence shards, the bias once. labkit's sequence-
    and tensor-parallel code and an all-reduce are refused before the values;
    then each rank is held to one all-gather and one reduce-scatter (gloo's,
    or an all-to-all and a local sum), each sending (t-1)/t of the whole
    (s, b, 6) tensor."""
    t = cluster.world_size
    if SEQ % t or FFN % t:
        raise ValueError(f"this check splits 8 positions and 8 features: it needs "
                         f"1, 2, 4 or 8 ranks, not {t}")
    res = run_answer(cluster, _sp_mlp_worker, fn, fresh_seed(),
                     what="sequence-parallel MLP", timeout=timeout)
    if res is None:
        return NOT_YET
    for rank, r in enumerate(res):
        refuse_own(f"rank {rank}", r["own"], "sequence-parallel layers or mappings")
        ops = [x.op for x in r["records"]]
        if "all_reduce" in ops:
            raise ExerciseError(
                f"rank {rank}: it all-reduced ({ops}): with sequence parallelism a "
                "reduce-scatter replaces the all-reduce (and sends half its "
                "bytes), since each rank keeps only its rows of the output")
        other = sorted(set(ops) - {"all_gather", *_RS})
        if other:
            raise ExerciseError(
                f"rank {rank}: it called {other}; the sequence-parallel MLP is one "
                "all-gather of the sequence in and one reduce-scatter out")
    for rank, r in enumerate(res):
        y, want = r["y"], r["want"]
        if hasattr(y, "shape") and tuple(y.shape) == tuple(r["whole"].shape) != \
                tuple(want.shape):
            raise ExerciseError(
                f"rank {rank}: the output has shape {_fmt(y.shape)}, the whole "
                f"sequence; expected this rank's shard {_fmt(want.shape)}: "
                "reduce-scatter the partial sums along dim 0 instead of summing "
                "them whole (rank r keeps rows [r*s/t, (r+1)*s/t))")
        check_like(f"rank {rank}: the output", y, want,
                   hint="x (s/t, b, 6) gathered is (s, b, 6); after both layers "
                        "and the reduce-scatter, (s/t, b, 6)")
        bad = wrong_element(y, want, r["exact"], scale=r["terms"])
        if bad is not None:
            i, a, b, _ = bad
            raise ExerciseError(f"rank {rank}, output element {list(i)}: got "
                                f"{a:.6g}, expected {b:.6g}. Hint: "
                                + _mlp_hint(y, want, r["bias"], t))
    whole = SEQ * BATCH * HIDDEN * 4  # one (s, b, 6) float32 tensor
    share = whole * (t - 1) // t
    for rank, r in enumerate(res):
        _mlp_messages(rank, r["records"], share, t)
    print(f"correct on weights and input drawn this run: on {t} ranks each rank "
          f"gives one process's MLP on its rows; measured on every rank: one "
          f"all-gather and one reduce-scatter, each {share:,} bytes to the other "
          f"ranks ({t - 1}/{t} of the {whole:,}-byte (s, b, 6) sequence), no "
          "all-reduce")
    return PASSED


def _mlp_messages(rank: int, records, share: int, t: int) -> None:
    """After the values: one all-gather of x and one reduce-scatter of the part
    sums, (t-1)/t of the whole (s, b, 6) tensor each."""
    gathers = [x for x in records if x.op == "all_gather"]
    scatters = [x for x in records if x.op in _RS]
    where = f"rank {rank}, the values are right, but"
    if len(gathers) == 2 and not scatters:
        raise ExerciseError(
            f"{where} it all-gathered twice and no reduce-scatter: the part sums "
            "gathered whole and added locally send t times a reduce-scatter's "
            "bytes; a reduce-scatter brings each rank only its rows' sum")
    if len(gathers) != 1 or len(scatters) != 1:
        raise ExerciseError(
            f"{where} its collectives were {[x.op for x in records]}: expected one "
            "all-gather of the sequence in and one reduce-scatter out")
    for rec, what in ((gathers[0], "all-gather"), (scatters[0], "reduce-scatter")):
        if rec.bus_bytes != share:
            raise ExerciseError(
                f"{where} its {what} sent {rec.bus_bytes:,.0f} bytes to other "
                f"ranks; (t-1)/t of the whole (s, b, 6) float32 tensor is "
                f"{share:,}: {what} the whole sequence once, nothing more")


def _mlp_hint(y, want, bias, t) -> str:
    if _like(y, want + (t - 1) * bias):
        return (f"b2 is added {t} times instead of once: every one of the {t} "
                "ranks added it before the reduce-scatter, which summed it with the "
                "rest; add it once, after")
    if _like(y, want - bias):
        return "the output lacks b2: add it once, after the reduce-scatter"
    return ("gather the shards in rank order (rank r's rows at [r*s/t, (r+1)*s/t)), "
            "apply w1, b1, GeLU and w2 on the whole sequence, then reduce-scatter "
            "along dim 0 so that rank r keeps rows [r*s/t, (r+1)*s/t) of the sum")


# -- exercise 3: how a ring rank's block and chunk grow -------------------------------

RING_CASE = (2048, 4, 2)  # the chapter's: section 7's sequence, N = 4 -> 2


def _growth(s: int, n_from: int, n_to: int) -> tuple[Fraction, Fraction]:
    """(block, chunk): how many times one (s/N) x (s/N) block of scores and one
    chunk of s/N positions grow from n_from to n_to ranks, exactly."""
    chunk = Fraction(s, n_to) / Fraction(s, n_from)
    return chunk * chunk, chunk


def _growth_cases(seed: int) -> list[tuple[int, int, int]]:
    import random

    rng = random.Random(seed)
    cases = [RING_CASE]
    while len(cases) < 6:
        a, b = rng.sample(range(2, 17), 2)
        cases.append((a * b * rng.choice((64, 128, 256)), a, b))
    return cases


def _growth_hint(which: str, got: float, s: int, n_from: int, n_to: int) -> str:
    r = n_from / n_to
    near = {
        "block": ((r, "that is how a chunk grows: a block is (s/N) x (s/N), and "
                      "both of its sides grow"),
                  (1 / r ** 2, "upside down: fewer ranks, larger blocks"),
                  (r ** 3, "a block has two sides of s/N, not three"),
                  ((s / n_to) ** 2, "that is the block's size at N = n_to, not "
                                    "how many times it grew")),
        "chunk": ((r * r, "that is how a block grows: a chunk is s/N positions "
                          "of d values, only one side grows"),
                  (1 / r, "upside down: fewer ranks, larger chunks"),
                  (s / n_to, "that is the chunk's length at N = n_to, not how "
                             "many times it grew")),
    }[which]
    for v, why in near:
        if abs(got - v) <= 1e-9 * abs(v):
            return f"; {why}"
    return ""


def check_ring_growth(fn) -> bool:
    """Check a student's `fn(s, n_from, n_to) -> (block_growth, chunk_growth)`:
    how many times one block of scores ((s/N) x (s/N)) and one chunk of Q, K or
    V (s/N positions) on a ring rank grow when the same s positions go from
    n_from to n_to ranks. Tried on the chapter's 2048 positions, 4 -> 2 ranks,
    and on cases drawn fresh each run (more ranks as well as fewer)."""
    cases = _growth_cases(fresh_seed())
    for s, n_from, n_to in cases:
        with own_calls(*_OWN_FORMULAS) as own:
            got = call_answer(fn, s, n_from, n_to, what="ring_growth")
        where = f"ring_growth({s}, {n_from}, {n_to})"
        refuse_own(where, own, "closed forms (or this check's reference)")
        if got is NOT_WRITTEN:
            return NOT_YET
        if not isinstance(got, (tuple, list)) or len(got) != 2 or not all(
                is_number(x) for x in got):
            raise ExerciseError(f"{where}: expected two numbers (block_growth, "
                                f"chunk_growth), got {got!r}")
        for which, x, want in zip(("block", "chunk"), got, _growth(s, n_from, n_to)):
            finite(f"{where}, {which} growth", x)
            if not abs(x - want) <= 1e-9 * want:
                raise ExerciseError(
                    f"{where}: {which} growth {float(x):.6g}, expected "
                    f"{float(want):.6g}" + _growth_hint(which, float(x), s, n_from,
                                                        n_to))
    block, chunk = _growth(*RING_CASE)
    print(f"correct on {len(cases)} cases drawn this run; from 4 to 2 ranks a "
          f"block grows {block}x, a chunk {chunk}x")
    return PASSED


# -- exercise 4: choosing a context-parallel method ----------------------------------

# Llama 3 405B's 128K stage, per tensor-parallel rank (Llama Team 2024, sec.
# 3.3.2; theory.PUBLISHED_RUNS): 16 query heads of 128, one KV head, CP 16,
# bf16; a 7B-wide layer with as many KV heads as query heads on 8 ranks; and
# 32 query heads with 8 KV heads on 16 ranks, where Ulysses would send least
CP_CASES = ((131072, 1, 2048, 16, 1, 16, 2, 2**30),
            (8192, 1, 4096, 32, 32, 8, 2, 2**30),
            (32768, 1, 4096, 32, 8, 16, 2, 2**30),
            # 64 heads, 4 KV heads on 4 ranks, 10 MiB: the ring's three chunks
            # (12 MiB) do not fit, two would; Ulysses (2 MiB) does
            (8192, 1, 8192, 64, 4, 4, 2, 10 * 2**20))
METHODS = ("ring", "ulysses", "all-gather")


def _cp_methods(s, b, h, heads, kv_heads, n, e, memory):
    """{method: (bytes a rank sends per layer, forward and backward; bytes of K
    and V it holds at once; whether it can run)}, exactly. M: one whole-sequence
    K (or V) in bytes, kv_heads/heads of Q's width."""
    q = Fraction(s * b * h * e)
    kv = q * Fraction(kv_heads, heads)
    return {
        # n-1 K, V hops forward, 2n-1 (K, V and their gradients) backward; it
        # holds its own chunk (kept for backward), the one it computes with and
        # the one arriving: 3 chunks, 2 on 2 ranks (the one computed with is its own)
        "ring": ((3 * n - 2) * 2 * kv / n, (3 if n > 2 else 2) * 2 * kv / n, True),
        # q, k, v in and the output back, each (n-1)/n of a rank's 1/n share,
        # and again backward; the whole sequence of kv_heads/n heads
        "ulysses": (2 * (2 * q + 2 * kv) / n * Fraction(n - 1, n), 2 * kv / n,
                    heads % n == 0 and kv_heads % n == 0),
        # all-gather K, V forward, reduce-scatter their gradients backward; the
        # whole sequence's K and V
        "all-gather": (2 * 2 * kv * Fraction(n - 1, n), 2 * kv, True),
    }


def _cp_pick(methods, memory):
    """The method that sends the fewest bytes among those that run and fit."""
    ok = {m: v[0] for m, v in methods.items() if v[2] and v[1] <= memory}
    return min(ok, key=ok.get) if ok else None


def _cp_kind(methods, memory) -> str | None:
    """Why the pick is the pick: "ring", "ulysses", "all-gather, Ulysses cannot
    run" or "all-gather, fewer bytes"; None if no method fits or two tie."""
    pick = _cp_pick(methods, memory)
    fits = sorted(v[0] for v in methods.values() if v[2] and v[1] <= memory)
    if pick is None or len(fits) > 1 and fits[0] == fits[1]:
        return None
    if pick != "all-gather":
        return pick
    return "ag-bytes" if methods["ulysses"][2] else "ag-heads"


def _cp_cases(seed: int):
    """The chapter's cases, then cases drawn from `seed` until each reason for a
    choice has come up at least once (8 in all)."""
    import random

    rng = random.Random(seed)
    cases, kinds = list(CP_CASES), set()
    while len(cases) < 8:
        n = rng.choice((2, 3, 4, 6, 8, 16))
        heads = rng.choice((8, 12, 16, 24, 32, 48, 64))
        kv_heads = rng.choice([d for d in range(1, heads + 1) if heads % d == 0])
        s = n * rng.choice((1024, 2048, 4096, 8192))
        b, e = rng.choice((1, 2)), rng.choice((2, 4))
        h = heads * rng.choice((64, 128))
        methods = _cp_methods(s, b, h, heads, kv_heads, n, e, 0)
        ring_needs, ag_needs = methods["ring"][1], methods["all-gather"][1]
        memory = int(rng.choice((ring_needs * 2, ag_needs * 2,
                                 (ring_needs + ag_needs) / 2)))
        kind = _cp_kind(methods, memory)
        if kind is None or kind in kinds and len(kinds) < 4:
            continue  # a tie, or a reason already met while others are not
        kinds.add(kind)
        cases.append((s, b, h, heads, kv_heads, n, e, memory))
    return cases


def _method_name(x) -> str | None:
    if not isinstance(x, str):
        return None
    key = x.strip().lower().replace("_", "-").replace(" ", "-")
    return {"allgather": "all-gather", "ring-attention": "ring",
            "deepspeed-ulysses": "ulysses"}.get(key, key)


def _cp_method_hint(mine, pick, methods, case) -> str:
    s, b, h, heads, kv_heads, n, e, memory = case
    sent = {m: v[0] for m, v in methods.items()}
    if mine == "ulysses" and not methods["ulysses"][2]:
        return (f"Ulysses cannot run here: each rank takes heads/N whole heads, so "
                f"N = {n} must divide the {heads} query heads and the {kv_heads} "
                "KV heads")
    if mine == "all-gather" and methods["all-gather"][1] > memory:
        return (f"the all-gather holds the whole sequence's K and V, "
                f"{number_text(float(methods['all-gather'][1]), 'bytes')}, more "
                f"than the {number_text(memory, 'bytes')} a rank can hold")
    if mine == "ring" and methods["ring"][1] > memory:
        return (f"the ring holds {number_text(float(methods['ring'][1]), 'bytes')} "
                "of K and V at once: its own chunk, kept for backward, the one it "
                "computes with and the one arriving (two on 2 ranks); more than "
                f"the {number_text(memory, 'bytes')} a rank can hold")
    if mine == "ring":
        return (f"the ring sends {float(sent['ring'] / sent['all-gather']):.3g}x "
                "the all-gather's bytes ((3N-2)/(2N-2)); it is the choice only "
                "where the others cannot run or do not fit")
    if mine == "ulysses" and pick == "all-gather":
        return (f"under GQA K and V are {kv_heads}/{heads} of Q's width: the "
                "all-gather moves only them, Ulysses moves Q and the output too; "
                f"here Ulysses sends {number_text(float(sent['ulysses']), 'bytes')}"
                f", the all-gather {number_text(float(sent['all-gather']), 'bytes')}")
    if mine == "all-gather" and pick == "ulysses":
        return (f"Ulysses sends {number_text(float(sent['ulysses']), 'bytes')}, "
                f"the all-gather {number_text(float(sent['all-gather']), 'bytes')}"
                ": Ulysses' share falls as 1/N, and here it runs and fits")
    return "the fewest bytes among the methods that run and fit"


def _cp_bytes_hint(method, got, case) -> str:
    s, b, h, heads, kv_heads, n, e, memory = case
    want = float(_cp_methods(*case)[method][0])
    plain = float(_cp_methods(s, b, h, heads, heads, n, e, memory)[method][0])
    others = {m: float(v[0]) for m, v in _cp_methods(*case).items() if m != method}
    near = [(want / 2, "the forward only: backward sends as much again"),
            (plain, "K and V counted at Q's width: under GQA they are "
                    f"{kv_heads}/{heads} of it"),
            (want * n / (n - 1), "all of each tensor counted as sent: a rank "
                                 "keeps its own 1/N share")]
    near += [(v, f"those are {m}'s bytes") for m, v in others.items()]
    for v, why in near:
        if abs(got - v) <= 1e-9 * abs(v):
            return f"; {why}"
    if abs(got - want) <= 1e-3 * want:
        return (f"; within {abs(got - want) / want:.2g} of it: rounded? The "
                "bytes are exact")
    return ""


def check_cp_choice(fn) -> bool:
    """Check a student's `fn(s, b, h, heads, kv_heads, n, dtype_bytes,
    kv_memory) -> (method, bytes)`: of "ring", "ulysses" and "all-gather", the
    method that sends the fewest bytes per rank per attention layer (forward and
    backward) among those that can run (Ulysses needs N to divide the query and
    the KV heads) and whose keys and values held at once fit in kv_memory bytes;
    and those bytes. Tried on Llama 3's 128K stage, a layer without GQA, and
    cases drawn fresh each run; labkit's closed forms are refused."""
    cases = _cp_cases(fresh_seed())
    for case in cases:
        s, b, h, heads, kv_heads, n, e, memory = case
        with own_calls(*_OWN_FORMULAS) as own:
            got = call_answer(fn, *case, what="cp_choice")
        where = (f"s = {s}, b = {b}, h = {h}, {heads} heads, {kv_heads} KV heads, "
                 f"N = {n}, {e} bytes an element, kv_memory = "
                 f"{number_text(memory, 'bytes')}")
        refuse_own(where, own, "context-parallel closed forms (or this check's "
                   "reference)")
        if got is NOT_WRITTEN:
            return NOT_YET
        if not isinstance(got, (tuple, list)) or len(got) != 2 \
                or not is_number(got[1]):
            raise ExerciseError(f"{where}: expected (method, bytes), got {got!r}")
        finite(f"{where}, bytes", got[1])
        mine, nbytes = _method_name(got[0]), float(got[1])
        if mine not in METHODS:
            raise ExerciseError(f"{where}: method {got[0]!r} is none of "
                                f"{list(METHODS)}")
        methods = _cp_methods(*case)
        pick = _cp_pick(methods, memory)
        if mine != pick:
            raise ExerciseError(f"{where}: you chose {mine}, expected {pick}: "
                                + _cp_method_hint(mine, pick, methods, case))
        want = float(methods[pick][0])
        if not abs(nbytes - want) <= 1e-9 * want:
            raise ExerciseError(f"{where}: {pick} is right, but it sends "
                                f"{number_text(want, 'bytes')} per rank per layer, "
                                f"not {number_text(nbytes, 'bytes')}"
                                + _cp_bytes_hint(pick, nbytes, case))
    llama = CP_CASES[0]
    sent = float(_cp_methods(*llama)["all-gather"][0])
    print(f"correct on {len(cases)} cases drawn this run; Llama 3's 128K stage "
          f"(one KV head on 16 ranks): the all-gather, "
          f"{number_text(sent, 'bytes')} per rank per layer")
    return PASSED
