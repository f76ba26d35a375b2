"""labkit.checks.fsdp: the ZeRO-3 hook-pair check passes a right answer, says
"not written yet" for a stub, and names what is wrong in wrong ones."""

import pytest
import torch
import torch.distributed as dist

from labkit.checks.common import ExerciseError
from labkit.checks.fsdp import check_zero3_hooks


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
