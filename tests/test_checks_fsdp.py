"""labkit.checks.fsdp: the ZeRO-3 hook-pair check passes a right answer, says
"not written yet" for a stub, and names what is wrong in wrong ones."""

import pytest
import torch
import torch.distributed as dist

from labkit.checks.common import ExerciseError
from labkit.checks.fsdp import check_min_units, check_peak_share, check_zero3_hooks

pytestmark = pytest.mark.numerics  # run again under other CPUs' kernels


def _gather(module, shards, shapes, order=None):
    n = dist.get_world_size()
    for name, shard in shards.items():
        parts = [torch.empty_like(shard) for _ in range(n)]
        dist.all_gather(parts, shard)
        if order is not None:
            parts = [parts[i] for i in order]
        numel = torch.Size(shapes[name]).numel()
        setattr(module, name, torch.cat(parts)[:numel].view(shapes[name]))


def _good(layer, shards, shapes):
    def pre(module, args):
        _gather(module, shards, shapes)

    def post(module, args, out):
        for name in shards:
            delattr(module, name)
    return pre, post


def _keeps(layer, shards, shapes):
    pre, _ = _good(layer, shards, shapes)
    return pre, lambda module, args, out: None


def _reversed(layer, shards, shapes):
    def pre(module, args):
        _gather(module, shards, shapes, order=[3, 2, 1, 0])
    return pre, _good(layer, shards, shapes)[1]


def _padded(layer, shards, shapes):
    def pre(module, args):
        for name, shard in shards.items():
            parts = [torch.empty_like(shard) for _ in range(4)]
            dist.all_gather(parts, shard)
            setattr(module, name, torch.cat(parts))  # padding left in
    return pre, _good(layer, shards, shapes)[1]


def _todo(layer, shards, shapes):
    raise NotImplementedError


def _one_hook(layer, shards, shapes):
    return _good(layer, shards, shapes)[0]  # the pre hook alone


def _rank0_gathers(layer, shards, shapes):
    def pre(module, args):
        if dist.get_rank() == 0:  # the others never call all_gather
            _gather(module, shards, shapes)
        else:
            for name in shards:
                setattr(module, name, torch.zeros(shapes[name]))
    return pre, _good(layer, shards, shapes)[1]


def _raises(layer, shards, shapes):
    def pre(module, args):
        return shards["weights"]  # KeyError: the names are "weight" and "bias"
    return pre, _good(layer, shards, shapes)[1]


def test_zero3_hooks_check(cluster, capsys):
    assert not check_zero3_hooks(cluster, _todo)
    assert "not written yet" in capsys.readouterr().out
    assert check_zero3_hooks(cluster, _good)
    assert "correct" in capsys.readouterr().out
    with pytest.raises(ExerciseError, match=r"rank 0: after forward the layer still "
                       r"holds weight with 70 elements"):
        check_zero3_hooks(cluster, _keeps)
    with pytest.raises(ExerciseError, match=r"rank 0, tensor weight, element \(0, 0\)"
                       r": forward saw .* expected"):
        check_zero3_hooks(cluster, _reversed)
    with pytest.raises(ExerciseError, match=r"rank 0, tensor weight: forward saw "
                       r"shape \(72,\), expected \(7, 10\)"):
        check_zero3_hooks(cluster, _padded)
    with pytest.raises(ExerciseError, match=r"rank 0: your function returned <function"
                       r".*: return a pair \(pre, post\) of functions"):
        check_zero3_hooks(cluster, _one_hook)
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
