"""Chapter 11's checks: the online-softmax merge that ring attention runs on every
block, a sequence-parallel MLP's forward (all-gather in, reduce-scatter out) and
the bytes a rank sends in a layer of Ulysses.
Each runs the answer on the ranks against one process, with a short time limit:
a rank left waiting in a collective is reported in seconds."""

from __future__ import annotations

import copy

from labkit.checks.common import (
    NOT_WRITTEN,
    NOT_YET,
    PASSED,
    SHORT_TIMEOUT,
    ExerciseError,
    call_answer,
    check_like,
    is_number,
    rounding_tolerance,
    run_answer,
    wrong_element,
)

RING = (2, 2, 8, 4)  # batch, heads, sequence, head dim: 8 positions, 2 per rank
SEQ, BATCH, HIDDEN, FFN = 8, 2, 6, 8  # the MLP of exercise 2: Linear(6, 8), (8, 6)
# An answer passes within its float32 reference's own rounding (the reference
# against the same computed in float64: common.rounding_tolerance). The hints
# below only name a mistake already found: they recognise it within this much of
# the largest element, far above rounding (~1e-7) and far below what tells the
# mistakes apart (a bias, a rescale: ~1e-1).
DIAGNOSIS_REL = 1e-4


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
    `spread` apart, and the partial over both keys sets (by definition)."""
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


def _merge_worker(rank, world_size, fn):
    import torch

    from labkit.parallel import Partial, attention, ring_attention

    def merge(a, b):  # a plain tuple or list of the three tensors will do
        got = fn(a, b)
        return Partial(*got) if isinstance(got, (tuple, list)) and len(got) == 3 \
            else got

    out = {"pairs": []}
    for seed, spread in ((rank, 0.0), (10 + rank, 30.0)):
        a, b, want, exact = _pair(seed, spread)
        out["pairs"].append((merge(a, b), want, exact, spread))
    ok = all(isinstance(got, Partial) and all(
        isinstance(x, torch.Tensor) and x.shape == y.shape for x, y in zip(got, want))
        for got, want, _, _ in out["pairs"])
    out["ring"] = out["want"] = out["exact"] = None
    if not ok:  # the kernel says what is wrong with the pairs: no ring needed
        return out
    g = torch.Generator().manual_seed(99)
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
    On every rank it is tried on two pairs (scores alike; scores 30x apart, where
    a merge that rescales upward overflows), then used by ring attention on the
    ranks, causal, against one process's attention. A wrong tensor is reported by
    rank and element, expected against got, with what the mistake looks like."""
    res = run_answer(cluster, _merge_worker, fn, what="merge", timeout=timeout)
    if res is None:
        return NOT_YET
    from labkit.parallel import Partial

    allowed = 0.0
    for rank, r in enumerate(res):
        for got, want, exact, spread in r["pairs"]:
            case = "scores far apart" if spread else "scores alike"
            if not isinstance(got, Partial):
                raise ExerciseError(
                    f"rank {rank} ({case}): your merge returned "
                    f"{type(got).__name__}, not a Partial: return "
                    "Partial(acc, m, l) (or a tuple of those three tensors)")
            a, b, _, _ = _pair(*((rank, 0.0) if not spread else (10 + rank, 30.0)))
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
    print(f"correct: the merge rescales both partials to the larger max and adds "
          f"them; with it, ring attention on {t} ranks gives one process's causal "
          f"attention (within {allowed:.1g}, the rounding of one process's float32)")
    return PASSED


# -- exercise 2: a sequence-parallel MLP's forward ------------------------------------


def _mlp_data():
    import torch

    torch.manual_seed(0)  # the same MLP and input in every process
    fc1, fc2 = torch.nn.Linear(HIDDEN, FFN), torch.nn.Linear(FFN, HIDDEN)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(1))
    return fc1, fc2, x


def _sp_mlp_worker(rank, world_size, fn):
    import torch
    import torch.nn.functional as F

    from labkit.ledger import traffic

    fc1, fc2, x = _mlp_data()
    s, f = SEQ // world_size, FFN // world_size
    mine, cols = slice(rank * s, (rank + 1) * s), slice(rank * f, (rank + 1) * f)
    args = (x[mine].clone(), fc1.weight.detach()[cols].clone(),
            fc1.bias.detach()[cols].clone(), fc2.weight.detach()[:, cols].clone(),
            fc2.bias.detach().clone())
    with torch.no_grad(), traffic() as led:
        y = fn(*args, None)
    with torch.no_grad():
        want = fc2(F.gelu(fc1(x)))
        exact = copy.deepcopy(fc2).double()(
            F.gelu(copy.deepcopy(fc1).double()(x.double())))
    return {"y": y, "want": want[mine], "exact": exact[mine], "whole": want,
            "bias": fc2.bias.detach(),
            "ops": [r.op for r in led.records]}


def check_sequence_parallel_mlp(cluster, fn, *, timeout: float = SHORT_TIMEOUT
                                ) -> bool:
    """Check a student's sequence-parallel MLP forward on Linear(6, 8), GeLU,
    Linear(8, 6).

    `fn(x, w1, b1, w2, b2, group)` gets this rank's sequence shard x (8/t, 2, 6),
    its rows of the first layer (w1 (8/t, 6), b1 (8/t,)), its columns of the
    second (w2 (6, 8/t)), the whole second bias b2 (6,) and the group (None: all
    ranks). It must return this rank's shard (8/t, 2, 6) of fc2(gelu(fc1(x))):
    all-gather the sequence, the local column- and row-parallel matmuls, a
    reduce-scatter back to sequence shards, the bias once. No all-reduce."""
    t = cluster.world_size
    if SEQ % t or FFN % t:
        raise ValueError(f"this check splits 8 positions and 8 features: it needs "
                         f"1, 2, 4 or 8 ranks, not {t}")
    res = run_answer(cluster, _sp_mlp_worker, fn, what="sequence-parallel MLP",
                     timeout=timeout)
    if res is None:
        return NOT_YET
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
        bad = wrong_element(y, want, r["exact"])
        if bad is not None:
            i, a, b, _ = bad
            raise ExerciseError(f"rank {rank}, output element {list(i)}: got "
                                f"{a:.6g}, expected {b:.6g}. Hint: "
                                + _mlp_hint(y, want, r["bias"], t))
        if "all_reduce" in r["ops"]:
            raise ExerciseError(
                f"rank {rank}: the values are right, but it all-reduced ({r['ops']}):"
                " with sequence parallelism a reduce-scatter replaces the all-reduce "
                "(and sends half its bytes), since each rank keeps only its rows")
        if not ({"all_gather"} <= set(r["ops"])
                and {"reduce_scatter", "all_to_all"} & set(r["ops"])):
            raise ExerciseError(
                f"rank {rank}: the values are right, but the collectives were "
                f"{r['ops']}: expected one all-gather in and one reduce-scatter out")
    print(f"correct: on {t} ranks, all-gather of the sequence, column- then "
          "row-parallel matmuls, a reduce-scatter back to sequence shards and the "
          "bias once give one process's MLP, row for row")
    return PASSED


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


# -- exercise 4: the bytes of a layer of Ulysses --------------------------------------

# s, b, h, n, bytes an element: 8 ranks in bf16; 6 ranks (not a power of two);
# 4 ranks in fp32 (so a fixed 2 bytes an element is caught)
_ULYSSES_CASES = ((8192, 1, 4096, 8, 2), (6144, 2, 1536, 6, 2), (4096, 2, 1024, 4, 4))


def _count(x) -> str:
    """29,360,128 for a whole number of bytes, never 2.93601e+07."""
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,.2f}"


def check_ulysses_bytes(fn) -> bool:
    """Check a student's `fn(s, b, h, n, dtype_bytes)`: the bytes one rank sends in
    one attention layer's forward under Ulysses (theory.ulysses_traffic): four
    all-to-alls (q, k, v in, the output back) of the rank's (s/n, b, h) tensor,
    each sending all of it but its own 1/n share. A known mistake is named."""
    from labkit.theory import ulysses_traffic

    for s, b, h, n, e in _ULYSSES_CASES:
        got = call_answer(fn, s, b, h, n, e, what="ulysses_bytes")
        if got is NOT_WRITTEN:
            return NOT_YET
        case = f"s = {s}, b = {b}, h = {h}, N = {n}, {e} bytes an element"
        if not is_number(got):
            raise ExerciseError(f"{case}: expected a number of bytes, got "
                                f"{type(got).__name__} {got!r}")
        want = ulysses_traffic(s, b, h, n, e).forward
        # a formula in float64: another order of the same operations differs
        # in the 16th digit; 1e-9 relative absorbs that and nothing else
        if abs(got - want) <= 1e-9 * want:
            continue
        mine = s * b * h * e / n  # one of the rank's q, k, v, output: (s/N, b, h)
        # (value, mistake), in order: where two coincide (at b = 2 with 4-byte
        # elements, dropping b and taking 2 bytes both halve it) the first names it
        near = ((4 * mine, "the whole of each tensor: an all-to-all keeps the "
                           "rank's own 1/N share, it sends (N-1)/N"),
                (3 * mine * (n - 1) / n, "q, k and v only: the output's "
                 "all-to-all back to sequence shards sends as much"),
                (4 * mine * (n - 1), "the whole sequence's tensors: a rank holds "
                                     "s/N rows"),
                (2 * want, "forward and backward: the question is the forward"),
                (4 * s * b * h * 2 / n * (n - 1) / n, "2 bytes an element: use "
                                                      "dtype_bytes"),
                (want / b, "b sequences: every tensor holds b of them"))
        why = next((w for v, w in near if abs(got - v) <= 1e-9 * v), "")
        raise ExerciseError(f"{case}: got {_count(got)} bytes, expected "
                            f"{_count(want)}" + (f" ({why})" if why else "")
                            + ". Hint: four "
                            "all-to-alls of a (s/N, b, h) tensor, each sending "
                            "(N-1)/N of it")
    s, b, h, n, e = _ULYSSES_CASES[0]
    mib = ulysses_traffic(s, b, h, n, e).forward / 2**20
    print(f"correct: 4 (N-1)/N x sbh e/N a rank per layer forward; at s = {s}, "
          f"h = {h}, N = {n}, bf16: {mib:,.0f} MiB, the same again backward")
    return PASSED
