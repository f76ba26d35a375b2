"""labkit.checks.fsdp: the ZeRO-3 hooks check (autograd on) passes a right answer, says
"not written yet" for a stub, and names what is wrong in wrong ones."""

import math

import pytest
import torch
import torch.distributed as dist

from labkit.checks.common import ExerciseError
from labkit.checks.fsdp import check_min_units, check_peak_share, check_zero3_hooks

pytestmark = pytest.mark.numerics  # run again under other CPUs' kernels


def _zero3(layer, shards, shapes, *, regather=True, free="storage", mean=True,
           order=None, trim=True, data=True):
    """A ZeRO-3 layer (the solution) and, by its options, typical mistakes."""
    n = dist.get_world_size()
    fulls = {}
    for name, shard in shards.items():
        full = torch.zeros(n * shard.numel(), requires_grad=True)  # padded, flat
        full.untyped_storage().resize_(0)
        fulls[name] = full

        def reduce(full, shard=shard):
            got = torch.empty_like(full.grad)
            dist.all_to_all_single(got, full.grad)
            shard.grad = got.view(n, -1).sum(0) / (n if mean else 1)
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


def test_zero3_hooks_check(cluster, capsys):
    assert not check_zero3_hooks(cluster, _todo)
    assert "not written yet" in capsys.readouterr().out
    assert check_zero3_hooks(cluster, _good)
    assert "correct" in capsys.readouterr().out
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
        check_zero3_hooks(cluster, _rank0_gathers)  # reported after 5 s, not 30


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


def _min_units(psi, n, budget, eb):
    import math

    room = budget - eb * psi / n
    return None if room <= 0 else max(1, math.ceil(2 * eb * psi / room))


def _min_units_one_unit(psi, n, budget, eb):   # forgets the prefetched unit
    import math

    room = budget - eb * psi / n
    return None if room <= 0 else max(1, math.ceil(eb * psi / room))


def test_min_units_check(capsys):
    psi = 4 * (512 * 512 + 512)
    measured = {(psi, 4, 3 * psi, 4): 4}           # shards + two of four layers
    assert check_min_units(_min_units, measured)
    assert "as the ledger measured" in capsys.readouterr().out
    assert not check_min_units(
        lambda *a: (_ for _ in ()).throw(NotImplementedError("exercise")))
    with pytest.raises(ExerciseError, match=r"that counts one whole unit"):
        check_min_units(_min_units_one_unit, measured)
    with pytest.raises(ExerciseError, match=r"expected None"):
        check_min_units(lambda *case: _min_units(*case) or 1)
    with pytest.raises(ExerciseError, match=r"measured that peak with 5"):
        check_min_units(_min_units, {(psi, 4, 3 * psi, 4): 5})
