"""labkit.checks.sequence_parallel (chapter 11): each check passes a right answer,
says "not written yet" for a stub, names the rank, tensor and element of wrong
ones with what the mistake looks like, and fails every shortcut: labkit's own
merge or sequence-parallel mappings, communication where none belongs, an
all-reduce or all-gathers instead of a reduce-scatter, answers fitted to the
chapter's fixed inputs, labkit's closed forms, NaN."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from labkit.checks.common import ExerciseError
from labkit.checks.sequence_parallel import (
    check_cp_choice,
    check_online_softmax_merge,
    check_ring_growth,
    check_sequence_parallel_mlp,
)
from labkit.parallel.ring_attention import Partial

# a right answer is compared with one process within the Oracle's rounding, which
# other CPUs' kernels move: those tests are marked numerics (run again by `make
# test-cpus`). A mistake, shortcut, deadlock or exception differs by far more than
# rounding: those are not.


# -- exercise 1: the online-softmax merge ---------------------------------------------


def _merge(a, b):
    m = torch.maximum(a.m, b.m)
    wa, wb = torch.exp(a.m - m), torch.exp(b.m - m)
    return Partial(a.acc * wa[..., None] + b.acc * wb[..., None], m,
                   a.l * wa + b.l * wb)


def _no_rescale(a, b):
    return Partial(a.acc + b.acc, torch.maximum(a.m, b.m), a.l + b.l)


def _upward(a, b):  # rescales to the smaller max: exact on paper, overflows
    m = torch.minimum(a.m, b.m)
    wa, wb = torch.exp(a.m - m), torch.exp(b.m - m)
    return Partial(a.acc * wa[..., None] + b.acc * wb[..., None], m,
                   a.l * wa + b.l * wb)


def _as_list(a, b):
    return list(_merge(a, b))


def _todo(*args):
    raise NotImplementedError("exercise: merge two partials")


@pytest.mark.numerics
def test_merge_check(cluster, capsys):
    assert not check_online_softmax_merge(cluster, _todo)
    assert "not written yet" in capsys.readouterr().out
    assert check_online_softmax_merge(cluster, _merge)
    assert "correct on inputs drawn this run" in capsys.readouterr().out
    assert check_online_softmax_merge(cluster, _as_list)  # a tuple will do
    with pytest.raises(ExerciseError, match=r"rank 0 \(scores alike\), the merged l, "
                       r"element \[.*\]: got .* expected .* not rescaled"):
        check_online_softmax_merge(cluster, _no_rescale)
    with pytest.raises(ExerciseError, match=r"rank 0 \(scores alike\), the merged m.*"
                       r"running max"):
        check_online_softmax_merge(cluster, _upward)
    with pytest.raises(ExerciseError, match=r"returned int, not a Partial"):
        check_online_softmax_merge(cluster, lambda a, b: 3)
    with pytest.raises(ExerciseError, match=r"raised ZeroDivisionError"):
        check_online_softmax_merge(cluster, lambda a, b: 1 / 0)


def _labkits_merge(a, b):
    from labkit.parallel import merge_partials

    return merge_partials(a, b)


def _reduced(a, b):  # "merges" by summing over the ranks: communication
    out = _merge(a, b)
    dist.all_reduce(out.l.clone())
    return out


def _nan(a, b):
    out = _merge(a, b)
    return Partial(out.acc, out.m, out.l * float("nan"))


def test_merge_shortcuts_fail(cluster):
    with pytest.raises(ExerciseError, match=r"rank 0: your answer calls labkit\."
                       r"parallel\.ring_attention\.merge_partials"):
        check_online_softmax_merge(cluster, _labkits_merge)
    with pytest.raises(ExerciseError, match=r"rank 0: your merge called "
                       r"\['all_reduce'\]; merging two partials is local"):
        check_online_softmax_merge(cluster, _reduced)
    with pytest.raises(ExerciseError, match=r"the merged l, element .*: got nan"):
        check_online_softmax_merge(cluster, _nan)


# -- exercise 2: a sequence-parallel MLP's forward ------------------------------------


def _gather(x, group):
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts)


def _sp_mlp(x, w1, b1, w2, b2, group, *, bias_early=False, whole=False,
            all_reduce=False, gather_sums=False, all_to_all=False):
    partial = F.linear(F.gelu(F.linear(_gather(x, group), w1, b1)), w2)
    if bias_early:
        partial = partial + b2
    t, r = dist.get_world_size(group), dist.get_rank(group)
    if whole or all_reduce:
        dist.all_reduce(partial, group=group)
        y = partial if whole else partial.chunk(t)[r]
    elif gather_sums:
        y = sum(_gather(partial, group).chunk(t)).chunk(t)[r]
    elif all_to_all:  # labkit's way: an all-to-all of the chunks, a local sum
        got = torch.empty_like(partial)
        dist.all_to_all_single(got, partial.contiguous(), group=group)
        y = got.view(t, -1, *partial.shape[1:]).sum(0)
    else:
        y = torch.empty_like(partial.chunk(t)[0])
        dist.reduce_scatter(y, list(partial.chunk(t)), group=group)
    return y if bias_early else y + b2


def _stuck(x, w1, b1, w2, b2, group):
    if dist.get_rank() == 0:  # rank 0 skips the all-gather: the others wait for it
        return x
    return _sp_mlp(x, w1, b1, w2, b2, group)


def _labkits_mappings(x, w1, b1, w2, b2, group):
    from labkit.parallel import (
        gather_from_sequence_parallel_region,
        reduce_scatter_to_sequence_parallel_region,
    )

    whole = gather_from_sequence_parallel_region(x, group)
    part = F.linear(F.gelu(F.linear(whole, w1, b1)), w2)
    return reduce_scatter_to_sequence_parallel_region(part, group) + b2


def _fixed_inputs(x, w1, b1, w2, b2, group):
    # the old check's MLP (seeds 0 and 1), computed whole here: no communication
    t, r = dist.get_world_size(group), dist.get_rank(group)
    torch.manual_seed(0)
    fc1, fc2 = torch.nn.Linear(6, 8), torch.nn.Linear(8, 6)
    old = torch.randn(8, 2, 6, generator=torch.Generator().manual_seed(1))
    return fc2(F.gelu(fc1(old))).chunk(t)[r].detach()


@pytest.mark.numerics
def test_sequence_parallel_mlp_check(cluster, capsys):
    assert not check_sequence_parallel_mlp(cluster, _todo)
    assert "not written yet" in capsys.readouterr().out
    assert check_sequence_parallel_mlp(cluster, _sp_mlp)
    assert ("measured on every rank: one all-gather and one reduce-scatter, each "
            "288 bytes to the other ranks") in capsys.readouterr().out
    assert check_sequence_parallel_mlp(cluster, lambda *a: _sp_mlp(*a,
                                                                   all_to_all=True))
    with pytest.raises(ExerciseError, match=r"rank 0, output element \[0, 0, 0\]: "
                       r"got .*, expected .*b2 is added 4 times instead of once"):
        check_sequence_parallel_mlp(
            cluster, lambda *a: _sp_mlp(*a, bias_early=True))
    with pytest.raises(ExerciseError, match=r"rank 0: it all-reduced"):
        check_sequence_parallel_mlp(cluster, lambda *a: _sp_mlp(*a, whole=True))
    with pytest.raises(ExerciseError, match=r"rank 0: it all-reduced"):
        check_sequence_parallel_mlp(cluster, lambda *a: _sp_mlp(*a, all_reduce=True))
    with pytest.raises(ExerciseError, match=r"rank 0, the values are right, but it "
                       r"all-gathered twice and no reduce-scatter"):
        check_sequence_parallel_mlp(cluster, lambda *a: _sp_mlp(*a, gather_sums=True))
    with pytest.raises(ExerciseError, match=r"deadlock|did not finish|waiting"):
        check_sequence_parallel_mlp(cluster, _stuck, timeout=3)


def test_sequence_parallel_mlp_shortcuts_fail(cluster):
    with pytest.raises(ExerciseError, match=r"rank 0: your answer calls labkit\."
                       r"parallel\.tensor_parallel_mappings\.gather_from_sequence"):
        check_sequence_parallel_mlp(cluster, _labkits_mappings)
    with pytest.raises(ExerciseError, match=r"rank 0, output element \[.*\]: got"):
        check_sequence_parallel_mlp(cluster, _fixed_inputs)
    with pytest.raises(ExerciseError, match=r"output element \[.*\]: got nan"):
        check_sequence_parallel_mlp(cluster, lambda *a: _sp_mlp(*a) * float("nan"))


# -- exercise 3: how a ring rank's block and chunk grow -------------------------------


def _growth(s, n_from, n_to):
    side = (s / n_to) / (s / n_from)
    return side**2, side


def test_ring_growth_check_passes_and_waits(capsys):
    assert check_ring_growth(_growth)
    assert "from 4 to 2 ranks a block grows 4x, a chunk 2x" in capsys.readouterr().out
    assert not check_ring_growth(_todo)
    assert "not written yet" in capsys.readouterr().out


@pytest.mark.parametrize("fn,says", [
    (lambda s, a, b: (a / b, a / b), r"block growth 2, expected 4; that is how a "
                                     r"chunk grows"),
    (lambda s, a, b: ((a / b) ** 2, (a / b) ** 2), r"chunk growth 4, expected 2; "
                                                   r"that is how a block grows"),
    (lambda s, a, b: ((b / a) ** 2, b / a), r"upside down"),
    (lambda s, a, b: ((a / b) ** 3, a / b), r"two sides of s/N, not three"),
    (lambda s, a, b: ((s / b) ** 2, s / b), r"the block's size at N = n_to"),
    (lambda s, a, b: (4, 2), r"ring_growth\(\d+, \d+, \d+\): block growth 4, "
                             r"expected"),  # the chapter's answer written down
    (lambda s, a, b: (float("nan"), 2), r"not a number an answer can be"),
    (lambda s, a, b: 4, r"expected two numbers \(block_growth, chunk_growth\)"),
])
def test_ring_growth_check_names_the_mistake(fn, says):
    with pytest.raises(ExerciseError, match=says):
        check_ring_growth(fn)


# -- exercise 4: choosing a context-parallel method ----------------------------------


def _cp(s, b, h, heads, kv, n, e, memory, *, gqa=True, forward_only=False,
        heads_divide=True, fit=True, ring_chunks=3):
    q = s * b * h * e
    k = q * kv / heads if gqa else q
    sent = {"ring": (3 * n - 2) * 2 * k / n,
            "ulysses": 2 * (2 * q + 2 * k) / n * (n - 1) / n,
            "all-gather": 4 * k * (n - 1) / n}
    held = {"ring": (ring_chunks if n > 2 else 2) * 2 * k / n, "ulysses": 2 * k / n,
            "all-gather": 2 * k}
    runs = {"ring": True, "all-gather": True,
            "ulysses": heads % n == 0 and kv % n == 0 or not heads_divide}
    ok = [m for m in sent if runs[m] and (held[m] <= memory or not fit)]
    best = min(ok, key=sent.get)
    return best, sent[best] / (2 if forward_only else 1)


def test_cp_choice_check_passes_and_waits(capsys):
    assert check_cp_choice(_cp)
    assert ("Llama 3's 128K stage (one KV head on 16 ranks): the all-gather, "
            "125,829,120 B") in capsys.readouterr().out
    assert check_cp_choice(lambda *a: (_cp(*a)[0].upper().replace("-", "_"),
                                       _cp(*a)[1]))  # ALL_GATHER will do
    assert not check_cp_choice(_todo)
    assert "not written yet" in capsys.readouterr().out


@pytest.mark.parametrize("kw,says", [
    ({"gqa": False}, r"all-gather is right, but it sends 125,829,120 B .* K and V "
                     r"counted at Q's width: under GQA they are 1/16 of it"),
    ({"forward_only": True}, r"the forward only"),
    ({"heads_divide": False}, r"you chose ulysses, expected all-gather: Ulysses "
                              r"cannot run here: .* N = 16 must divide the 32 "
                              r"query heads and the 8 KV heads"),
    ({"fit": False}, r"you chose all-gather, expected (ring|ulysses): the "
                     r"all-gather holds the whole sequence's K and V"),
    ({"ring_chunks": 2}, r"you chose ring, expected ulysses: the ring holds "
                         r"12,582,912 B .* the one arriving"),
])
def test_cp_choice_check_names_the_mistake(kw, says):
    with pytest.raises(ExerciseError, match=says):
        check_cp_choice(lambda *a: _cp(*a, **kw))


def test_cp_choice_shortcuts_fail():
    def theirs(s, b, h, heads, kv, n, e, memory):
        from labkit.theory import context_parallel_traffic

        t = context_parallel_traffic(s, b, h, n, e, heads=heads, kv_heads=kv)
        return "all-gather", t["all-gather"].total

    with pytest.raises(ExerciseError, match=r"labkit\.theory\.context_parallel"):
        check_cp_choice(theirs)
    # Llama 3's answer written down: right once, wrong on the other cases
    with pytest.raises(ExerciseError, match=r"8192, b = 1, h = 4096, 32 heads"):
        check_cp_choice(lambda *a: ("all-gather", 125_829_120))
    with pytest.raises(ExerciseError, match=r"not a number an answer can be"):
        check_cp_choice(lambda *a: (_cp(*a)[0], float("nan")))
    with pytest.raises(ExerciseError, match=r"method 'flash' is none of"):
        check_cp_choice(lambda *a: ("flash", 1.0))
