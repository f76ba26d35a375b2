"""labkit.parallel.ulysses and allgather_attention on 4 gloo ranks, in groups of
2 (ParallelGroups cp=2: ranks {0, 1} and {2, 3}) and of 4 (the world).

Ulysses (all-to-all rows <-> heads) and Llama 3's all-gather of K and V: exact
against one process's attention over the whole sequence, forward and backward
(dq, dk, dv), causal or not, on contiguous and on load-balanced shards; the
limit of Ulysses (heads divisible by the group); causal work per rank; and the
bytes each rank sends per layer, measured by the traffic ledger, against
theory.context_parallel's closed forms, beside ring attention's."""

import pytest
import torch

from labkit.numerics import Oracle

pytestmark = pytest.mark.numerics  # run again under other CPUs' kernels

SHAPE = (2, 4, 32, 8)  # batch, heads, sequence, head dim: (b, a, s, d)
# Ulysses runs one process's attention on a/N of the heads; the all-gather adds
# the keys in another order and sums dK, dV over ranks: their results are as far
# from float64 as one process's (labkit.numerics.Oracle). A real mistake (a
# gradient not summed over ranks, rows out of order under the mask) is off by
# order 1e-1 (the resolves() checks below).
VARIANTS = [("ulysses", False, False), ("ulysses", True, False),
            ("ulysses", True, True), ("all-gather", False, True),
            ("all-gather", True, True), ("all-gather", True, False)]
IDS = [f"{m}, {'causal' if c else 'full'}, {'balanced' if b else 'contiguous'}"
       for m, c, b in VARIANTS]
_BUILT = {}  # per rank process: the cp groups, built once


def _group(n):
    """(group, this rank's index in it); n = 4: the world (group None)."""
    import torch.distributed as dist

    from labkit.parallel.groups import ParallelGroups

    if n == dist.get_world_size():
        return None, dist.get_rank()
    if n not in _BUILT:
        _BUILT[n] = ParallelGroups.build(cp=n, dp=dist.get_world_size() // n)
    return _BUILT[n].cp_group, _BUILT[n].cp_rank


def _randn(shape, seed, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)
                       ).to(dtype)


def _whole(causal, dtype):
    """One process's attention over the whole sequence: output and gradients."""
    from labkit.parallel.ring_attention import attention

    full = [_randn(SHAPE, seed, dtype).requires_grad_() for seed in (1, 2, 3)]
    out = attention(*full, causal=causal)
    out.backward(_randn(SHAPE, 4, dtype))
    return {"out": out.detach(), **{f"d{n}": t.grad for n, t in zip("qkv", full)}}


def _one_variant(method, causal, balanced, group, i, n):
    from labkit.parallel.allgather_attention import (
        allgather_attention,
        attention_at,
        rows_of,
    )
    from labkit.parallel.ulysses import ulysses_attention

    rows = rows_of(SHAPE[2], n, i, balanced)  # the sequence positions held here
    mine = [_randn(SHAPE, seed)[..., rows, :].requires_grad_() for seed in (1, 2, 3)]
    fn = ulysses_attention if method == "ulysses" else allgather_attention
    out = fn(*mine, group, causal=causal, balanced=balanced)
    out.backward(_randn(SHAPE, 4)[..., rows, :])
    got = {"out": out.detach(), **{f"d{c}": t.grad for c, t in zip("qkv", mine)}}
    wrong = {}  # what a broken implementation would give, for resolves()
    if method == "ulysses" and balanced and causal:  # rows left out of order
        plain = [t.detach() for t in mine]
        wrong["rows out of order"] = ulysses_attention(*plain, group, causal=True)
    if method == "all-gather":  # dK as if not reduce-scattered: this rank's share
        k, v = (_randn(SHAPE, seed).requires_grad_() for seed in (2, 3))
        s = SHAPE[2]
        attention_at(mine[0].detach(), k, v, rows, torch.arange(s), causal,
                     SHAPE[3] ** -0.5).backward(_randn(SHAPE, 4)[..., rows, :])
        wrong["own share of dk"] = k.grad[..., rows, :]
    return {"got": got, "rows": rows, "wrong": wrong}


def _exact(rank, world_size, n):
    group, i = _group(n)
    return {v: _one_variant(*v, group, i, n) for v in VARIANTS}


@pytest.fixture(scope="module")
def runs(cluster):
    return {n: cluster.run(_exact, n).values for n in (2, 4)}


@pytest.fixture(scope="module")
def references():
    return {c: tuple(_whole(c, d) for d in (torch.float32, torch.float64))
            for c in (False, True)}


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_exact_against_whole_sequence_attention(runs, references, n, variant):
    method, causal, balanced = variant
    one, exact = references[causal]
    wrong = {}  # name -> (every rank's wrong rows, their exact and one process's)
    for rank, res in enumerate(runs[n]):
        r = res[variant]
        rows = r["rows"]
        assert set(r["got"]) == {"out", "dq", "dk", "dv"}, (
            f"rank {rank} returned {sorted(r['got'])}: out, dq, dk, dv expected")
        what = f"{method} on {n}, causal={causal}, balanced={balanced}, rank {rank}"
        oracle = Oracle({k: exact[k][..., rows, :] for k in exact},
                        {"one process": {k: one[k][..., rows, :] for k in one}})
        oracle.check(r["got"], f"{what}: output, dq, dk, dv")
        for name, bad in r["wrong"].items():
            key = "out" if name == "rows out of order" else "dk"
            for j, x in enumerate((bad, exact[key], one[key])):
                wrong.setdefault(name, ([], [], []))[j].append(x[..., rows, :]
                                                               if j else x)
    # the checks have power: what a broken implementation gives, over all ranks
    # (under a causal mask the last rank's keys get gradient from its own
    # queries only, so its own share alone is right)
    for name, (bad, ex, op) in wrong.items():
        Oracle(ex, {"one process": op}).resolves(
            bad, f"{method} on {n}, causal={causal}, balanced={balanced}: {name}")


def _limits(rank, world_size):
    from labkit.parallel.allgather_attention import shard_balanced
    from labkit.parallel.ulysses import ulysses_attention

    said = []
    for call in (lambda: ulysses_attention(*(torch.zeros(1, 6, 2, 4),) * 3),
                 lambda: ulysses_attention(torch.zeros(1, 4, 2, 4),
                                           torch.zeros(1, 4, 2, 4),
                                           torch.zeros(1, 4, 3, 4)),
                 lambda: shard_balanced(torch.zeros(1, 4, 12, 4))):
        try:
            call()
        except ValueError as e:
            said.append(str(e))
    return said


def test_heads_must_divide_among_the_ranks(cluster):
    said = cluster.run(_limits)[0]
    assert len(said) == 3, f"{len(said)} ValueErrors of 3 expected: {said}"
    assert "6 heads are not divisible by the 4 ranks" in said[0], said[0]
    assert "(1, 4, 2, 4), (1, 4, 2, 4), (1, 4, 3, 4)" in said[1], said[1]
    assert "12 is not divisible by 2 x 4 ranks = 8 chunks" in said[2], said[2]


def _divides(rank, world_size):
    from labkit.parallel.allgather_attention import allgather_attention
    from labkit.parallel.ring_attention import ring_attention
    from labkit.parallel.ulysses import heads_to_sequence, sequence_to_heads

    said = {}
    for name, call in (
            ("sequence", lambda: heads_to_sequence(torch.zeros(1, 1, 6, 4))),
            ("heads", lambda: sequence_to_heads(torch.zeros(1, 6, 2, 4))),
            ("no heads", lambda: sequence_to_heads(torch.zeros(2, 4))),
            ("no sequence", lambda: heads_to_sequence(torch.zeros(2, 4))),
            ("balanced", lambda: allgather_attention(*(torch.zeros(1, 2, 3, 4),) * 3)),
            ("all-gather 1-d", lambda: allgather_attention(*(torch.zeros(4),) * 3)),
            ("ring 1-d", lambda: ring_attention(*(torch.zeros(4),) * 3))):
        try:
            call()
            said[name] = None
        except ValueError as e:
            said[name] = str(e)
    return said


def test_what_must_divide_is_named(cluster):
    # heads_to_sequence with 6 rows on 4 ranks was torch's "shape '[1, 1, 4, 1,
    # 4]' is invalid for input of size 24"; a tensor without heads an IndexError
    said = cluster.run(_divides)[0]
    want = {"sequence": "sequence length 6 is not divisible by the 4 ranks of the "
                        "group: Ulysses gives every rank s/N rows back, so N must "
                        "divide s",
            "heads": "6 heads are not divisible by the 4 ranks",
            "no heads": "sequence_to_heads: x of shape (2, 4); (..., a, s/N, d) "
                        "expected",
            "no sequence": "heads_to_sequence: y of shape (2, 4); (..., a/N, s, d)"
                           " expected",
            "balanced": "sequence length 12 is not divisible by 2 x 4 ranks = 8 "
                        "chunks",
            "all-gather 1-d": "q, k and v must have one shape (..., s/N, d), got "
                              "(4,)",
            "ring 1-d": "q, k and v must have one shape (..., s/N, d), got (4,)"}
    for name, part in want.items():
        assert said[name] and part in said[name], f"{name}: {said[name]}"


def test_balanced_rows_even_out_causal_work():
    from labkit.parallel.allgather_attention import balanced_rows, causal_work

    s, n = 32, 4
    assert balanced_rows(s, n, 1).tolist() == [4, 5, 6, 7, 24, 25, 26, 27], (
        f"rank 1 holds {balanced_rows(s, n, 1).tolist()}: chunks 1 and 6 expected")
    held = sorted(torch.cat([balanced_rows(s, n, r) for r in range(n)]).tolist())
    assert held == list(range(s)), "the ranks' rows are not the sequence once"
    work = causal_work(s, n, balanced=False)
    # contiguous: rank r's 8 rows see 8r+1 .. 8r+8 keys: 36 + 64r pairs
    assert work == [36 + 64 * r for r in range(n)], f"contiguous: {work}"
    even = causal_work(s, n)
    assert even == [s * (s + 1) // 2 // n] * n, f"balanced: {even}, all equal"


# -- what each rank sends ------------------------------------------------------------

BIG = (2, 4, 128, 16)  # b, a, s, d: a rank's (b, a, s/4, d) fp32 tensor is 16 KiB


def _traffic(rank, world_size, method):
    from labkit.ledger import traffic
    from labkit.parallel.allgather_attention import allgather_attention, rows_of
    from labkit.parallel.ring_attention import ring_attention
    from labkit.parallel.ulysses import ulysses_attention

    fn = {"ring": ring_attention, "ulysses": ulysses_attention,
          "all-gather": allgather_attention}[method]
    rows = rows_of(BIG[2], world_size, rank, method == "all-gather")
    for _ in range(2):  # the second call is measured (the first connects peers)
        mine = [_randn(BIG, s)[..., rows, :].requires_grad_() for s in (1, 2, 3)]
        with traffic() as led:
            with led.phase("forward"):  # no module around it: name the phase
                out = fn(*mine, causal=True)
            out.backward(torch.ones_like(out))
    return [(r.op, r.phase, r.payload_bytes, r.bus_bytes, r.wire_bytes)
            for r in led.records]


def test_bytes_per_layer_match_the_closed_forms(cluster):
    from labkit.theory import context_parallel_traffic

    b, a, s, d = BIG
    n = cluster.world_size
    want = context_parallel_traffic(s, b, a * d, n, dtype_bytes=4)
    calls = {"ring": {"send": (n - 1, 2 * n - 1)},
             "ulysses": {"all_to_all": (4, 4)},
             "all-gather": {"all_gather": (1, 0), "all_to_all": (0, 1)}}
    for method in ("ring", "ulysses", "all-gather"):
        res = cluster.run(_traffic, method).values
        for r, recs in enumerate(res):
            for op, (fwd, bwd) in calls[method].items():
                got = [sum(rec[1] == ph and rec[0] == op for rec in recs)
                       for ph in ("forward", "backward")]
                assert got == [fwd, bwd], (
                    f"{method}, rank {r}: {got} {op} calls forward, backward; "
                    f"{[fwd, bwd]} expected")
            # a send's bytes are its payload (not waited for: no wire count)
            sent = {ph: sum(rec[2] if rec[0] == "send" else rec[3] for rec in recs
                            if rec[1] == ph and rec[0] != "recv")
                    for ph in ("forward", "backward")}
            w = want[method]
            assert (sent["forward"], sent["backward"]) == (w.forward, w.backward), (
                f"{method}, rank {r}: {sent} B sent (bus bytes), closed form "
                f"{w.forward:,.0f} forward, {w.backward:,.0f} backward")
            # on the wire: the bus bytes plus gloo's headers, a fixed 144 bytes
            # or so a message (at most 12 messages a call here), whatever the
            # payload
            for rec in recs:
                if rec[4] is not None:
                    assert 0 <= rec[4] - rec[3] <= 2048, (
                        f"{method}, rank {r}, {rec[0]}: {rec[4] - rec[3]:,} B of "
                        "headers, at most 2048")
