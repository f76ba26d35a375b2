"""labkit.parallel.replicas: the digest changes for every single flipped bit (sign,
exponent, mantissa) by construction; on 4 gloo ranks after a DataParallel step, a
bit flipped on rank 2 is named on every rank, even one a value comparison within
the Oracle's allowance cannot see; what one check costs, by the traffic ledger,
against the ring all-gather's 8·(N-1) bytes and one DDP all-reduce."""

import math
import pickle

import pytest
import torch
import torch.nn.functional as F

from tests.models import TiedFrozenNet, V

from labkit.numerics import Oracle, rel_err
from labkit.parallel.data_parallel import DataParallel
from labkit.parallel.replicas import (
    CHECK_PHASE,
    SEARCH_PHASE,
    Difference,
    ReplicaMismatch,
    check_replicas,
    first_difference,
    replica_digest,
)
from labkit.theory import ring_bytes_per_rank

N = 4
FLIPPED = 2  # the rank whose bit flips
# float32 bits: sign, the exponent's top and bottom bits, the last mantissa bit
BITS = {"sign": 31, "exponent top": 30, "exponent bottom": 23, "last mantissa": 0}
QNAN, OTHER_NAN = 0x7FC00000, 0x7FC00001  # float32 quiet NaNs, payloads 0 and 1


def _as_ints(t: torch.Tensor) -> torch.Tensor:
    """t's storage read as signed integers of its width, flat (shares memory)."""
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.detach().view(ints[t.element_size()]).view(-1)


def _flip(t: torch.Tensor, j: int, bit: int) -> None:
    """Flip bit `bit` of element j of t, in place."""
    w = _as_ints(t)
    width = 8 * t.element_size()
    mask = (1 << bit) - (1 << width if bit == width - 1 else 0)  # signed top bit
    w[j] ^= mask


# -- the digest, in one process ------------------------------------------------------

def _tensors():
    g = torch.Generator().manual_seed(5)
    torch.manual_seed(5)
    model = TiedFrozenNet()
    extra = {"f64": torch.randn(9, 3, dtype=torch.float64, generator=g),
             "bf16": torch.randn(77, generator=g).bfloat16(),
             "f16": torch.randn(5, generator=g).half(),
             "int8": torch.randint(-100, 100, (13,), dtype=torch.int8, generator=g),
             "scalar": torch.tensor(0.25)}
    return {**dict(model.named_parameters()), **extra}, g


def test_every_single_bit_flip_changes_the_digest():
    tensors, g = _tensors()
    before = replica_digest(tensors)
    tried = 0
    for name, t in tensors.items():
        j = int(torch.randint(t.numel(), (), generator=g))  # a random element
        for bit in range(8 * t.element_size()):  # sign, exponent, mantissa: all
            _flip(t, j, bit)
            after = replica_digest(tensors)
            _flip(t, j, bit)
            tried += 1
            assert after != before, (
                f"digest of {len(tensors)} tensors with bit {bit} of element {j} of "
                f"{name!r} ({t.dtype}) flipped: {after:#x}, the same as before; "
                "allowed: none the same (one flip is guaranteed to show)")
    assert replica_digest(tensors) == before, "flipped twice: the digest is back"
    # TiedFrozenNet's 8 float32 tensors, then f64, bf16, f16, int8 and the scalar
    assert tried == 8 * 32 + 64 + 16 + 16 + 8 + 32, f"flips tried: {tried}"


def test_what_else_it_catches_and_what_it_does_not():
    tensors, _ = _tensors()
    before = replica_digest(tensors)
    # a module and its parameters as a list: the same bits, in the same order
    torch.manual_seed(5)
    model = TiedFrozenNet()
    assert replica_digest(model) == replica_digest(list(model.parameters()))
    assert replica_digest(model, buffers=True) != replica_digest(model)
    swapped = dict(reversed(list(tensors.items())))
    assert replica_digest(swapped) != before, "the same tensors in reverse order"
    x = torch.randn(130, dtype=torch.float64)  # one element a word
    d = replica_digest([x])
    for i, j in [(0, 1), (3, 20), (5, 68), (100, 129)]:
        x[[i, j]] = x[[j, i]]
        got = replica_digest([x])
        x[[i, j]] = x[[j, i]]
        assert got != d, f"float64 elements {i} and {j} swapped: the same digest"
    y = torch.randn(130)  # two elements a word: a swap inside one word
    assert replica_digest([y]) != replica_digest([y[[1, 0, *range(2, 130)]]])
    # not guaranteed (the docstring says so): the same bit of two words 64 words
    # apart lands on the same digest bit, and the two flips cancel
    _flip(x, 3, 17)
    _flip(x, 67, 17)
    assert replica_digest([x]) == d, "two flips 64 words apart are a known blind spot"
    # a strided view is digested as its elements in order; a view that starts
    # between two 8-byte words is read all the same
    z = torch.randn(40, 30)
    assert replica_digest([z.t()]) == replica_digest([z.t().contiguous()])
    assert replica_digest([z.view(-1)[1:1025]]) == replica_digest(
        [z.view(-1)[1:1025].clone()])


def test_the_digest_reads_bits_not_values():
    zero, neg = torch.zeros(3), torch.zeros(3)
    neg[1] = -0.0
    assert torch.equal(zero, neg), "values: -0.0 == 0.0"
    assert replica_digest([zero]) != replica_digest([neg]), "bits: -0.0 != 0.0"
    a, b = torch.zeros(3), torch.zeros(3)
    _as_ints(a)[1], _as_ints(b)[1] = QNAN, QNAN
    assert not torch.equal(a, b), "values: NaN != NaN, even the same NaN"
    assert replica_digest([a]) == replica_digest([b]), "the same NaN bits agree"
    _as_ints(b)[1] = OTHER_NAN
    assert replica_digest([a]) != replica_digest([b]), "two NaN payloads differ"


def test_mismatch_messages_name_the_minority_and_survive_pickling():
    e = ReplicaMismatch((0, 1, 2, 3), (7, 7, 9, 7))
    assert str(e).startswith("rank 2's parameters differ from ranks 0, 1 and 3's "
                             "(digest 0x0000000000000009 vs 0x0000000000000007): "
                             "a flipped bit, or a step one rank did differently"), e
    assert (e.suspects, e.majority) == ((2,), (0, 1, 3))
    tie = ReplicaMismatch((0, 1, 2, 3), (7, 7, 9, 9))
    assert "split evenly" in str(tie) and tie.majority is None, tie
    assert "ranks 0 and 1 hold digest 0x0000000000000007" in str(tie), tie
    assert "ranks 2 and 3 hold digest 0x0000000000000009" in str(tie), tie
    two = ReplicaMismatch((0, 1, 2, 3, 4), (7, 8, 7, 9, 7))
    assert str(two).startswith("rank 1's (0x0000000000000008) and rank 3's "
                               "(0x0000000000000009) parameters differ from "
                               "ranks 0, 2 and 4's"), two
    back = pickle.loads(pickle.dumps(e))
    assert (type(back), str(back), back.suspects) == (ReplicaMismatch, str(e), (2,))


# -- on 4 ranks, after a DataParallel step --------------------------------------------

def _batch():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, V, (8, 5), generator=g) for _ in range(2)]


def _loss(model, tok, y):
    return F.cross_entropy(model(tok).flatten(0, 1), y.flatten())


def _reference(dtype, pieces=1):
    """One SGD step of one process on the whole batch (its gradient summed from
    `pieces` equal parts), in `dtype`: what every replica should hold."""
    torch.manual_seed(0)
    model = TiedFrozenNet().to(dtype)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    tok, y = _batch()
    for t, yy in zip(tok.chunk(pieces), y.chunk(pieces)):
        (_loss(model, t, yy) / pieces).backward()
    opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _outcome(fn, *args):
    """What fn raised ('ReplicaMismatch', message, suspects), or 'ok'."""
    try:
        fn(*args)
    except ReplicaMismatch as e:
        return ("ReplicaMismatch", str(e), e.suspects)
    return "ok"


def _replicas(rank, world_size):
    from labkit.ledger import traffic

    torch.manual_seed(rank)  # a different model on every rank until the broadcast
    model = TiedFrozenNet()
    dp = DataParallel(model, bucket_mib=25)  # one bucket: one all-reduce a step
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    tok, y = _batch()
    mine = slice(rank * 2, rank * 2 + 2)
    with traffic() as step:
        _loss(dp, tok[mine], y[mine]).backward()
        dp.finish_gradient_synchronization()
        opt.step()
    out = {"step": [(r.op, r.phase, r.bus_bytes) for r in step.records]}
    with traffic() as check:
        out["identical"] = _outcome(check_replicas, model)
    out["check"] = [(r.op, r.phase, r.bus_bytes, r.payload_bytes)
                    for r in check.records]
    out["no difference"] = first_difference(model)

    params = dict(model.named_parameters())
    g = torch.Generator().manual_seed(11)  # the same choice on every rank
    names = sorted(params)
    for label, bit in BITS.items():
        name = names[int(torch.randint(len(names), (), generator=g))]
        j = int(torch.randint(params[name].numel(), (), generator=g))
        if rank == FLIPPED:
            _flip(params[name], j, bit)
        got = {"where": (name, j), "check": _outcome(check_replicas, model)}
        with traffic() as search:
            got["difference"] = first_difference(model)
        got["search bytes"] = search.sum("bus_bytes", phase=SEARCH_PHASE)
        got["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if rank == FLIPPED:
            _flip(params[name], j, bit)
        got["after"] = _outcome(check_replicas, model)
        out[label] = got

    w = _as_ints(params["up.weight"])  # ties: 2 vs 2, then 2 vs 1 vs 1
    if rank >= 2:
        _flip(params["up.weight"], 3, 0)
    out["tie"] = _outcome(check_replicas, model)
    if rank == 3:
        _flip(params["up.weight"], 3, 0)
    if rank == 1:
        _flip(params["up.weight"], 4, 0)
    out["two minorities"] = _outcome(check_replicas, model)
    for r, j in [(1, 4), (2, 3)]:
        if rank == r:
            _flip(params["up.weight"], j, 0)

    w[5] = QNAN  # the same NaN on every rank: the same bits
    out["same NaN"] = _outcome(check_replicas, model)
    if rank == FLIPPED:
        w[5] = OTHER_NAN  # another NaN: as much a NaN, other bits
    out["other NaN"] = _outcome(check_replicas, model)
    out["NaN difference"] = first_difference(model)
    return out


@pytest.fixture(scope="module")
def runs(cluster):
    return cluster.run(_replicas)


def test_identical_replicas_pass(runs):
    for rank, out in enumerate(runs):
        assert out["identical"] == "ok", f"rank {rank}, one DataParallel step: {out}"
        assert out["no difference"] is None, f"rank {rank}: {out['no difference']}"


@pytest.mark.parametrize("label", list(BITS))
def test_a_flipped_bit_on_rank_2_is_named_on_every_rank(runs, label):
    for rank, out in enumerate(runs):
        got = out[label]
        kind, message, suspects = got["check"]
        assert kind == "ReplicaMismatch" and suspects == (FLIPPED,), (
            f"rank {rank}, {label} bit ({BITS[label]}) of {got['where']} flipped on "
            f"rank {FLIPPED}: got {got['check']}, want rank {FLIPPED} named")
        assert message.startswith(f"rank {FLIPPED}'s parameters differ from ranks "
                                   "0, 1 and 3's (digest "), message
        assert got["after"] == "ok", f"rank {rank}, flipped back: {got['after']}"
        diff: Difference = got["difference"]
        name, j = got["where"]
        shape = got["state"][name].shape
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(j), shape))
        assert (diff.name, diff.index) == (name, index), (
            f"rank {rank}: first_difference found {diff}, the flip was {name}[{j}]")
        want = {r: b for r, b in zip(diff.ranks, diff.bits)}
        assert want[FLIPPED] ^ want[0] == 1 << BITS[label], str(diff)
        assert len({want[r] for r in (0, 1, 3)}) == 1, str(diff)
        assert got["search bytes"] == diff.bus_bytes == 8 * diff.words * (N - 1), (
            f"rank {rank}: first_difference's bus bytes by the ledger "
            f"{got['search bytes']}, by its own count {diff.bus_bytes}")
        rounds = 5 + math.ceil(math.log2(8)) + math.ceil(math.log2(shape.numel()))
        assert diff.words <= rounds, (  # TiedFrozenNet: 8 tensors
            f"rank {rank}: first_difference sent {diff.words} words a rank; its "
            f"docstring allows at most 5 + ceil(log2 P) + ceil(log2 n) = {rounds}")
    got = runs[0][label]
    print(f"{label}: {got['check'][1]}\n  first_difference: {got['difference']}, "
          f"found with {got['search bytes']:.0f} B a rank")


def test_a_last_mantissa_bit_inside_the_oracles_allowance_is_still_caught(runs):
    oracle = Oracle(exact=_reference(torch.float64),
                    one_process={"whole batch": _reference(torch.float32),
                                 "4 quarters": _reference(torch.float32, N)})
    torch.manual_seed(0)
    oracle.resolves(TiedFrozenNet().state_dict(), "the untrained model")
    states = [out["last mantissa"]["state"] for out in runs]
    for rank, state in enumerate(states):
        oracle.check(state, f"rank {rank}'s weights after one DataParallel step")
    apart = rel_err(states[FLIPPED], states[0])
    assert 0 < apart < oracle.allowed, (
        f"rank {FLIPPED}'s flipped weights are {apart:.1e} from rank 0's: a value "
        f"comparison allows {oracle.allowed:.1e}, so it cannot see the flip")
    assert all(out["last mantissa"]["check"][0] == "ReplicaMismatch" for out in runs)
    print(f"last mantissa bit: {apart:.1e} from rank 0 by value, allowed "
          f"{oracle.allowed:.1e} ({oracle}); the digest catches it")


def test_ties_and_several_minorities(runs):
    for rank, out in enumerate(runs):
        kind, message, suspects = out["tie"]
        assert (kind, suspects) == ("ReplicaMismatch", (0, 1, 2, 3)), (
            f"rank {rank}, ranks 2 and 3 flipped: {out['tie']}; want every rank a "
            "suspect (no majority)")
        assert "split evenly" in message and "ranks 0 and 1 hold" in message \
            and "ranks 2 and 3 hold" in message, f"rank {rank}: {message}"
        kind, message, suspects = out["two minorities"]
        assert suspects == (1, 2), (
            f"rank {rank}, ranks 1 and 2 flipped other bits: {out['two minorities']}")
        assert message.startswith("rank 1's (0x") and " and rank 2's (0x" in message \
            and "parameters differ from ranks 0 and 3's" in message, (
                f"rank {rank}: {message}")


def test_nan_payloads(runs):
    # every rank holds the same NaN: the same bits, so no alarm (a value
    # comparison would call NaN != NaN a difference); another NaN on rank 2 is
    # other bits, so an alarm, though both are "NaN"
    for rank, out in enumerate(runs):
        assert out["same NaN"] == "ok", f"rank {rank}: {out['same NaN']}"
        assert out["other NaN"][2] == (FLIPPED,), f"rank {rank}: {out['other NaN']}"
        diff = out["NaN difference"]
        assert (diff.name, diff.index) == ("up.weight", (0, 5)), str(diff)
        assert dict(zip(diff.ranks, diff.bits)) == {0: QNAN, 1: QNAN,
                                                    2: OTHER_NAN, 3: QNAN}, str(diff)
    print(runs[0]["NaN difference"])


def test_one_check_costs_8_n_minus_1_bytes_a_rank(runs):
    torch.manual_seed(0)
    model = TiedFrozenNet()
    psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # ring all-gather and all-reduce: nccl-tests' bus factors (doc/PERFORMANCE.md:
    # (n-1)/n and 2(n-1)/n of the array S), held to published figures in
    # tests/test_theory_collective_cost.py
    check_bytes = ring_bytes_per_rank("all_gather", 8 * N, N)  # S: N int64s
    reduce_bytes = ring_bytes_per_rank("all_reduce", 4 * psi, N)
    assert check_bytes == 8 * (N - 1)
    for rank, out in enumerate(runs):
        assert out["check"] == [("all_gather", CHECK_PHASE, check_bytes, 8 * N)], (
            f"rank {rank}: one check_replicas recorded {out['check']}; want one "
            f"all-gather of {N} int64s, {check_bytes:.0f} bus bytes")
        all_reduce = [b for op, _, b in out["step"] if op == "all_reduce"]
        assert all_reduce == [reduce_bytes], (
            f"rank {rank}: the DataParallel step's all-reduces {all_reduce} bus "
            f"bytes; want one of 2(N-1)/N x {4 * psi} B = {reduce_bytes:.0f}")
    print(f"one check: {check_bytes:.0f} B a rank (8·(N-1), N={N}); one DDP "
          f"all-reduce of the same {psi}-parameter model: {reduce_bytes:.0f} B; "
          f"overhead {check_bytes / reduce_bytes:.2%}")
