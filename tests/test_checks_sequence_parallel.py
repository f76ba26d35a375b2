"""labkit.checks.sequence_parallel: each check passes a right answer, says "not
written yet" for a stub, and names the rank, tensor and element of wrong ones,
with what the mistake looks like."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from labkit.checks.common import ExerciseError
from labkit.checks.sequence_parallel import (
    check_online_softmax_merge,
    check_sequence_parallel_mlp,
    check_ulysses_bytes,
)
from labkit.parallel.ring_attention import Partial

pytestmark = pytest.mark.numerics  # run again under other CPUs' kernels


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


def test_merge_check(cluster, capsys):
    assert not check_online_softmax_merge(cluster, _todo)
    assert "not written yet" in capsys.readouterr().out
    assert check_online_softmax_merge(cluster, _merge)
    assert "correct" in capsys.readouterr().out
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


def _gather(x, group):
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts)


def _sp_mlp(x, w1, b1, w2, b2, group, *, bias_early=False, whole=False,
            all_reduce=False):
    partial = F.linear(F.gelu(F.linear(_gather(x, group), w1, b1)), w2)
    if bias_early:
        partial = partial + b2
    t = dist.get_world_size(group)
    if whole or all_reduce:
        dist.all_reduce(partial, group=group)
        y = partial if whole else partial.chunk(t)[dist.get_rank(group)]
    else:
        y = torch.empty_like(partial.chunk(t)[0])
        dist.reduce_scatter(y, list(partial.chunk(t)), group=group)
    return y if bias_early else y + b2


def _stuck(x, w1, b1, w2, b2, group):
    if dist.get_rank() == 0:  # rank 0 skips the all-gather: the others wait for it
        return x
    return _sp_mlp(x, w1, b1, w2, b2, group)


def test_sequence_parallel_mlp_check(cluster, capsys):
    assert not check_sequence_parallel_mlp(cluster, _todo)
    assert "not written yet" in capsys.readouterr().out
    assert check_sequence_parallel_mlp(cluster, _sp_mlp)
    assert "correct" in capsys.readouterr().out
    with pytest.raises(ExerciseError, match=r"rank 0, output element \[0, 0, 0\]: "
                       r"got .*, expected .*b2 is added 4 times instead of once"):
        check_sequence_parallel_mlp(
            cluster, lambda *a: _sp_mlp(*a, bias_early=True))
    with pytest.raises(ExerciseError, match=r"rank 0: the output has shape "
                       r"\(8, 2, 6\), the whole sequence; expected .* \(2, 2, 6\)"):
        check_sequence_parallel_mlp(cluster, lambda *a: _sp_mlp(*a, whole=True))
    with pytest.raises(ExerciseError, match=r"rank 0: the values are right, but it "
                       r"all-reduced"):
        check_sequence_parallel_mlp(cluster, lambda *a: _sp_mlp(*a, all_reduce=True))
    with pytest.raises(ExerciseError, match=r"deadlock|did not finish|waiting"):
        check_sequence_parallel_mlp(cluster, _stuck, timeout=3)


def _ulysses(s, b, h, n, e):  # four all-to-alls of (s/n, b, h), (n-1)/n of each
    return 4 * s * b * h * e / n * (n - 1) / n


def _stub(s, b, h, n, e):
    raise NotImplementedError


@pytest.mark.parametrize("wrong, says", [
    (lambda s, b, h, n, e: 4 * s * b * h * e / n, "own 1/N share"),
    (lambda s, b, h, n, e: 3 * s * b * h * e / n * (n - 1) / n, "q, k and v only"),
    (lambda s, b, h, n, e: 4 * s * b * h * e * (n - 1) / n, "a rank holds s/N rows"),
    (lambda s, b, h, n, e: 2 * _ulysses(s, b, h, n, e), "the question is the forward"),
    (lambda s, b, h, n, e: _ulysses(s, b, h, n, 2), "use dtype_bytes"),
    (lambda s, b, h, n, e: _ulysses(s, 1, h, n, e), "b sequences"),
    (lambda s, b, h, n, e: _ulysses(s, b, h, n, e) + 1,   # no known mistake
     r"got 29,360,129 bytes, expected 29,360,128\. Hint"),
    (lambda s, b, h, n, e: "58 MiB", "expected a number of bytes, got str"),
])
def test_ulysses_bytes_check(wrong, says):
    with pytest.raises(ExerciseError, match=says):
        check_ulysses_bytes(wrong)


def test_ulysses_bytes_check_passes_and_waits(capsys):
    assert check_ulysses_bytes(_ulysses), "the right formula did not pass"
    assert "correct" in capsys.readouterr().out
    assert not check_ulysses_bytes(_stub), "a stub passed"
    assert "not written yet" in capsys.readouterr().out
