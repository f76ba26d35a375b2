"""labkit.checks.tensor_parallel: both of chapter 09's checks pass a right answer,
say "not written yet" for a stub, and name the rank, element and likely mistake of
wrong ones; an exception or a hang on one rank is reported in seconds."""

import numpy as np
import pytest
import torch
import torch.distributed as dist

from labkit.checks.common import ExerciseError
from labkit.checks.tensor_parallel import (
    check_conjugate_operators,
    check_row_parallel_forward,
)

pytestmark = pytest.mark.numerics  # run again under other CPUs' kernels

# -- exercise 1: the row-parallel forward ------------------------------------------


def _row_good(x_part, w_part, bias, group):
    y = x_part @ w_part.T
    dist.all_reduce(y, group=group)
    return y + bias


def _row_bias_everywhere(x_part, w_part, bias, group):
    y = x_part @ w_part.T + bias
    dist.all_reduce(y, group=group)
    return y


def _row_no_reduce(x_part, w_part, bias, group):
    return x_part @ w_part.T + bias


def _row_gathers(x_part, w_part, bias, group):
    y = x_part @ w_part.T
    parts = [torch.empty_like(y) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, y, group=group)
    return sum(parts) + bias


def _row_wrong_shape(x_part, w_part, bias, group):
    y = x_part @ w_part.T
    dist.all_reduce(y, group=group)
    return y[..., :3]


def _row_rank0_only(x_part, w_part, bias, group):
    y = x_part @ w_part.T
    if dist.get_rank() == 0:
        dist.all_reduce(y, group=group)
    return y + bias


def _row_raises_on_rank1(x_part, w_part, bias, group):
    if dist.get_rank() == 1:
        raise ValueError("shapes do not match")
    return _row_good(x_part, w_part, bias, group)


def _todo(*args):
    raise NotImplementedError("exercise: not yet")


def test_row_parallel_forward_check(cluster, capsys):
    assert not check_row_parallel_forward(cluster, _todo)
    assert "not written yet" in capsys.readouterr().out
    assert check_row_parallel_forward(cluster, _row_good)
    assert "correct" in capsys.readouterr().out
    with pytest.raises(ExerciseError, match=r"rank 0, element \(0, 0, 0\): got .*, "
                       r"expected .*\. The bias is added 4 times instead of once"):
        check_row_parallel_forward(cluster, _row_bias_everywhere)
    with pytest.raises(ExerciseError, match=r"rank 0, element .* only this rank's "
                       "partial sum"):
        check_row_parallel_forward(cluster, _row_no_reduce)
    with pytest.raises(ExerciseError, match=r"rank 0: the values are right, but the "
                       r"collectives were \[\('all_gather', 420\)\]"):
        check_row_parallel_forward(cluster, _row_gathers)
    with pytest.raises(ExerciseError, match=r"rank 0: the output has shape "
                       r"\(5, 3, 3\), expected \(5, 3, 7\)"):
        check_row_parallel_forward(cluster, _row_wrong_shape)
    with pytest.raises(ExerciseError, match=r"rank 1: your row-parallel forward "
                       r"raised ValueError: shapes do not match at line \d+ of "
                       r"test_checks_tensor_parallel.py, in _row_raises_on_rank1"):
        check_row_parallel_forward(cluster, _row_raises_on_rank1)


def test_a_hang_is_reported_in_seconds(cluster):
    import time

    t0 = time.monotonic()
    with pytest.raises(ExerciseError, match=r"(?s)deadlock: rank 0 still waiting "
                       r"after 2 s.*rank 0: in all_reduce.*rank 1: finished"):
        check_row_parallel_forward(cluster, _row_rank0_only, timeout=2)
    took = time.monotonic() - t0  # the 2 s timeout, not the cluster's 20
    assert took < 10, f"the deadlock was told after {took:.1f} s, under 10 expected"
    assert check_row_parallel_forward(cluster, _row_good)  # ranks back


# -- exercise 2: f and g ---------------------------------------------------------


class _F(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _G(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GReducesBackward(_G):
    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad, None


class _FReducesForward(_F):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x


class _FIdentityBackward(_F):
    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _f(x, group):
    return _F.apply(x, group)


def _g(x, group):
    return _G.apply(x, group)


def _f_detached(x, group):
    return x.detach()


def test_conjugate_operators_check(cluster, capsys):
    assert not check_conjugate_operators(cluster, _todo, _todo)
    assert "not written yet" in capsys.readouterr().out
    assert check_conjugate_operators(cluster, _f, _g)
    assert "correct" in capsys.readouterr().out
    with pytest.raises(ExerciseError, match=r"rank 0, the output, element .*: got .*"
                       r"expected .*The forward is wrong: f must return x"):
        check_conjugate_operators(cluster, lambda x, gr: _FReducesForward.apply(x, gr),
                                  _g)
    with pytest.raises(ExerciseError, match=r"rank 0, the gradient of fc1.weight, "
                       r"element .* \(it is 4x the right value everywhere\)\. g's "
                       "backward must be the identity"):
        check_conjugate_operators(cluster, _f,
                                  lambda x, gr: _GReducesBackward.apply(x, gr))
    with pytest.raises(ExerciseError, match=r"rank 0, x's gradient, element .*f's "
                       "backward must all-reduce"):
        check_conjugate_operators(cluster,
                                  lambda x, gr: _FIdentityBackward.apply(x, gr), _g)
    with pytest.raises(ExerciseError, match=r"rank 0: x got no gradient"):
        check_conjugate_operators(cluster, _f_detached, _g)


# -- exercise 4: the t at which the whole activations outweigh the split ones -------

# chapter 09's block as a fused attention kernel would hold it (a b·a·s log-sum-exp
# where the chapter's written-out attention keeps the a·s²·b scores): the
# inequality alone holds from t = 3, which cannot split 8 heads, so every branch
# of the check shows
SBH, SB, BAS = 64 * 4 * 64, 64 * 4, 4 * 8 * 64
WHOLE = 4 * (5 * SBH + 4 * SB)


def _activation_bytes(t):
    return WHOLE + 4 * (12 * SBH + BAS) // t


def _check_t(t):
    from labkit.checks.tensor_parallel import check_whole_over_half
    return check_whole_over_half("t", t, heads=8, ffn=256, whole=WHOLE,
                                 activation_bytes=_activation_bytes)


def test_whole_over_half_passes_the_divisor_of_the_heads(capsys):
    assert _check_t(4)
    assert "t = 3 would satisfy the inequality but cannot split 8 heads" in (
        capsys.readouterr().out)


def test_whole_over_half_rejects_a_t_that_cannot_split_the_heads():
    # 3 is the smallest t of the inequality alone: 8 heads do not split in 3
    with pytest.raises(ExerciseError, match=r"t = 3 cannot split the model: 8 "
                       r"attention heads .* leave 2.66667 heads .* t must divide 8"):
        _check_t(3)


def test_whole_over_half_names_too_small_and_too_large():
    with pytest.raises(ExerciseError, match=r"at t = 2 the whole activations are "
                       r"\d+% of a rank's, not more than half yet"):
        _check_t(2)
    with pytest.raises(ExerciseError, match=r"already at t = 4"):
        _check_t(8)
    with pytest.raises(ExerciseError, match="whole number of ranks"):
        _check_t(2.5)
    assert _check_t(4.0) and _check_t(np.int64(4))     # the same t
    assert not _check_t(None)
