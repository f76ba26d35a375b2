"""labkit.checks.fsdp: the ZeRO-3 hooks check (autograd on) passes a right answer, says
"not written yet" for a stub, and names what is wrong in wrong ones and each
shortcut (an all-reduce of the gradients, a gather too many, labkit's own FSDP,
the old fixed weights, NaN); the fewest-units check holds a formula to the
ledger's peaks and to cases drawn fresh, and names the usual mistakes."""

import math

import pytest
import torch
import torch.distributed as dist

from labkit.checks.common import ExerciseError
from labkit.checks.fsdp import check_min_units, check_peak_share, check_zero3_hooks

# a right answer is compared with one process within the Oracle's rounding, which
# other CPUs' kernels move: those tests are marked numerics (run again by `make
# test-cpus`). A mistake, shortcut, deadlock or exception differs by far more than
# rounding: those are not.


def _zero3(layer, shards, shapes, *, regather=True, free="storage", mean=True,
           order=None, trim=True, data=True, reduce_op="all_to_all", gathers=1,
           poison=False):
    """A ZeRO-3 layer (the solution) and, by its options, typical mistakes."""
    n = dist.get_world_size()
    fulls = {}
    for name, shard in shards.items():
        full = torch.zeros(n * shard.numel(), requires_grad=True)  # padded, flat
        full.untyped_storage().resize_(0)
        fulls[name] = full

        def reduce(full, shard=shard):
            got = torch.empty_like(full.grad)
            if reduce_op == "all_reduce":  # every rank gets every whole gradient
                summed = full.grad.clone()
                dist.all_reduce(summed)
                r = dist.get_rank()
                shard.grad = summed.view(n, -1)[r] / (n if mean else 1)
            else:
                dist.all_to_all_single(got, full.grad)
                shard.grad = got.view(n, -1).sum(0) / (n if mean else 1)
            if poison:
                shard.grad.fill_(float("nan"))
            full.grad = None
            full.untyped_storage().resize_(0)
        full.register_post_accumulate_grad_hook(reduce)

    def gather():
        with torch.no_grad():
            for name, full in fulls.items():
                full.untyped_storage().resize_(full.numel() * full.element_size())
                parts = list((full.data if data else torch.empty_like(full)).chunk(n))
                if order is not None:
                    parts = [parts[i] for i in order]
                for _ in range(gathers):
                    dist.all_gather(parts, shards[name])
                if not data:  # copied into the tensor autograd saved: an edit
                    full.copy_(torch.cat(parts))

    def pre(module, args):
        if free == "delattr":  # a new tensor each forward, its name dropped after
            for name, shard in shards.items():
                parts = [torch.empty_like(shard) for _ in range(n)]
                dist.all_gather(parts, shard)
                whole = torch.cat(parts)[:math.prod(shapes[name])]
                setattr(module, name, whole.view(shapes[name]))
            return
        gather()
        for name, full in fulls.items():
            whole = full[:math.prod(shapes[name])] if trim else full
            setattr(module, name, whole.view(shapes[name]) if trim else whole)

    def post(module, args, out):
        if free == "delattr":
            for name in shards:
                delattr(module, name)
            return
        if free == "storage":
            for full in fulls.values():
                full.untyped_storage().resize_(0)
        if regather:
            out.register_hook(lambda grad: gather())

    layer.register_forward_pre_hook(pre)
    layer.register_forward_hook(post)


def _good(layer, shards, shapes):
    _zero3(layer, shards, shapes)


def _no_regather(layer, shards, shapes):
    _zero3(layer, shards, shapes, regather=False)


def _delattr(layer, shards, shapes):
    _zero3(layer, shards, shapes, free="delattr")


def _keeps(layer, shards, shapes):
    _zero3(layer, shards, shapes, free="nothing")


def _summed(layer, shards, shapes):
    _zero3(layer, shards, shapes, mean=False)


def _reversed(layer, shards, shapes):
    _zero3(layer, shards, shapes, order=[3, 2, 1, 0])


def _padded(layer, shards, shapes):
    _zero3(layer, shards, shapes, trim=False)


def _versioned(layer, shards, shapes):  # copies into `full`, not `full.data`
    _zero3(layer, shards, shapes, data=False)


def _todo(layer, shards, shapes):
    raise NotImplementedError


def _returns_pair(layer, shards, shapes):  # the old exercise's answer
    return (lambda m, a: None), (lambda m, a, o: None)


def _rank0_gathers(layer, shards, shapes):
    def pre(module, args):
        if dist.get_rank() == 0:  # the others never call all_gather
            parts = [torch.empty_like(shards["weight"]) for _ in range(4)]
            dist.all_gather(parts, shards["weight"])
        for name in shards:
            setattr(module, name, torch.zeros(shapes[name]))
    layer.register_forward_pre_hook(pre)


def _raises(layer, shards, shapes):
    def pre(module, args):
        return shards["weights"]  # KeyError: the names are "weight" and "bias"
    layer.register_forward_pre_hook(pre)


def _all_reduced(layer, shards, shapes):
    _zero3(layer, shards, shapes, reduce_op="all_reduce")


def _gathers_twice(layer, shards, shapes):
    _zero3(layer, shards, shapes, gathers=2)  # each gather made twice


def _labkit_own(layer, shards, shapes):
    from labkit.parallel.reduce_scatter import sum_chunks

    _zero3(layer, shards, shapes)
    n = dist.get_world_size()
    sum_chunks(torch.zeros(2 * n), n, average=True)  # labkit's own local sum


def _old_fixed_weights(layer, shards, shapes):
    """The weights of the old check's layer (torch.manual_seed(0)) set directly:
    no gather, and no longer the layer."""
    torch.manual_seed(0)
    old = torch.nn.Linear(10, 7)

    def pre(module, args):
        module.weight, module.bias = old.weight * 1, old.bias * 1
    layer.register_forward_pre_hook(pre)


def _nan_gradient(layer, shards, shapes):
    _zero3(layer, shards, shapes, poison=True)


@pytest.mark.numerics
def test_zero3_hooks_check(cluster, capsys):
    assert not check_zero3_hooks(cluster, _todo)
    assert "not written yet" in capsys.readouterr().out
    assert check_zero3_hooks(cluster, _good)
    out = capsys.readouterr().out
    assert "on a layer and data drawn this run" in out
    assert "all-gathers of 160 elements, a reduce-scatter of 72 + 8" in out
    with pytest.raises(ExerciseError, match=r"rank 0: the layer's backward read the "
                       r"weight it saved in forward .* found it freed: gather it "
                       r"again"):
        check_zero3_hooks(cluster, _no_regather)
    with pytest.raises(ExerciseError, match=r"rank 0: after forward autograd's graph "
                       r"still holds \d+ bytes .* \(delattr\) leaves the tensor"):
        check_zero3_hooks(cluster, _delattr)
    with pytest.raises(ExerciseError, match=r"rank 0: after forward the layer still "
                       r"holds weight with 70 elements"):
        check_zero3_hooks(cluster, _keeps)
    with pytest.raises(ExerciseError, match=r"rank 0: backward says a tensor it saved "
                       r"was modified in place"):
        check_zero3_hooks(cluster, _versioned)
    with pytest.raises(ExerciseError, match=r"rank 0, shards\['weight'\].grad, "
                       r"element \(0,\).*N times the mean"):
        check_zero3_hooks(cluster, _summed)
    with pytest.raises(ExerciseError, match=r"rank 0, tensor weight, element \(0, 0\)"
                       r": forward saw .* expected"):
        check_zero3_hooks(cluster, _reversed)
    with pytest.raises(ExerciseError, match=r"rank 0, tensor weight: forward saw "
                       r"shape \(72,\), expected \(7, 10\)"):
        check_zero3_hooks(cluster, _padded)
    with pytest.raises(ExerciseError, match=r"rank 0: your function returned \(<"
                       r".*register the hooks on the layer yourself"):
        check_zero3_hooks(cluster, _returns_pair)
    with pytest.raises(ExerciseError, match=r"raised KeyError: 'weights' at line \d+ "
                       r"of test_checks_fsdp.py"):
        check_zero3_hooks(cluster, _raises)
    with pytest.raises(ExerciseError, match=r"(?s)deadlock: rank 0 still waiting.*"
                       r"in all_gather"):
        check_zero3_hooks(cluster, _rank0_gathers, timeout=2)  # after 2 s, not 30


@pytest.mark.parametrize("fn, message", [
    (_all_reduced, r"rank 0, the values are right, but it used \['all_reduce'\]: "
                   r".*where an all-reduce sends every rank all of them"),
    (_gathers_twice, r"rank 0, the values are right, but its all-gathers carried "
                     r"320 elements in a step"),
    (_labkit_own, r"rank 0: your answer calls labkit.parallel.reduce_scatter."
                  r"sum_chunks, labkit's own FSDP"),
    (_old_fixed_weights, r"rank 0, tensor weight, element \(0, 0\): forward saw "
                         r".*, expected"),
    (_nan_gradient, r"rank 0, shards\['weight'\].grad, element \(0,\): got nan"),
])
def test_zero3_shortcuts_are_named(cluster, fn, message):
    with pytest.raises(ExerciseError, match=message):
        check_zero3_hooks(cluster, fn)


def test_peak_share_check(capsys):
    measured = {(4, 4): 0.75}  # what chapter 07's memory ledger measures
    assert not check_peak_share(lambda n, u: (_ for _ in ()).throw(
        NotImplementedError), measured)
    assert "not written yet" in capsys.readouterr().out
    assert check_peak_share(lambda n, u: 1 / n + 2 / u, measured)
    with pytest.raises(ExerciseError, match=r"peak_share\(4, 4\) = 0.5, but the "
                       r"memory ledger measured 0.75"):
        check_peak_share(lambda n, u: 1 / n + 1 / u, measured)  # one unit, not two
    with pytest.raises(ExerciseError, match=r"peak_share\(4, 32\) = 0.75, but "
                       r"expected 0.3125"):
        check_peak_share(lambda n, u: 0.75, measured)  # right for (4, 4) only
    with pytest.raises(ExerciseError, match=r"returned '0.75': return a number"):
        check_peak_share(lambda n, u: "0.75", measured)


def _min_units(psi, n, budget, shard_bytes, compute_bytes):
    room = budget - shard_bytes * psi / n
    if room <= 0:
        return None
    return max(1, math.ceil(2 * compute_bytes * psi / room))


PSI = 4 * (512 * 512 + 512)
# what chapter 07's memory ledger measures with 4 units: shards + two layers
PEAKS = {(PSI, 4, PSI + 2 * 4 * PSI // 4, 4, 4): 4,   # fp32 units (section 2)
         (PSI, 4, PSI + 2 * 2 * PSI // 4, 4, 2): 4}   # bf16 units (section 4)


def test_min_units_right_passes(capsys):
    assert check_min_units(_min_units, PEAKS)
    out = capsys.readouterr().out
    assert "cases drawn this run and the 2 the memory ledger measured" in out
    assert "70B on 64 ranks, 10 GB, bf16 units: 50 units" in out
    assert check_min_units(lambda *case: float(_min_units(*case) or 0) or None)
    assert not check_min_units(
        lambda *a: (_ for _ in ()).throw(NotImplementedError("exercise")))
    assert "not written yet" in capsys.readouterr().out


def _one_unit(psi, n, budget, sb, cb):         # forgets the prefetched unit
    room = budget - sb * psi / n
    return None if room <= 0 else max(1, math.ceil(cb * psi / room))


def _old_answer(psi, n, budget, sb, cb):       # the old exercise: one dtype
    return _min_units(psi, n, budget, sb, sb)


@pytest.mark.parametrize("fn, message", [
    (_one_unit, r"= 25, but expected 50. That counts one whole unit"),
    (lambda psi, n, b, sb, cb: _min_units(psi, n, b, cb, cb),
     r"= 36, but expected 50. That counts the shards in the compute dtype"),
    (_old_answer, r"= 100, but expected 50. That counts the gathered units in "
                  r"shard_bytes"),
    (lambda psi, n, b, sb, cb: math.floor(2 * cb * psi / (b - sb * psi / n)),
     r"= 49, but expected 50. That rounds down"),
    (lambda *case: 0, r"A model is at least one unit"),
    (lambda *case: _min_units(*case) or 1, r"expected None: the shards alone"),
    (lambda *case: None, r"returned None: return a whole number of units \(None "
                         r"only when"),
    (lambda *case: float("nan"), r"returned nan: return a whole number"),
    (lambda psi, n, b, sb, cb: __import__("labkit.theory.zero").theory.zero.
     zero_breakdown(psi, n, 3) and 50, r"your answer calls labkit.theory.zero."
                                       r"zero_breakdown"),
])
def test_min_units_mistakes_are_named(fn, message):
    with pytest.raises(ExerciseError, match=message):
        check_min_units(fn)


def test_min_units_measured_wins():
    with pytest.raises(ExerciseError, match=r"measured that peak with 5"):
        check_min_units(_min_units, {(PSI, 4, PSI + 2 * 4 * PSI // 4, 4, 4): 5})
