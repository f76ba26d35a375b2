"""labkit.checks.tensor_parallel (chapter 09): the checks pass a right answer, say
"not written yet" for a stub, name the rank, element and likely mistake of wrong
ones, and fail every shortcut: no communication, values written down from an
earlier run, a gather of the whole weight, labkit's own layers and operators,
the default group instead of the tensor-parallel one, an all-reduce too many or
of another dtype; the formula checks fail NaN, labkit's closed forms, numbers
written down for the chapter's case, and name the usual wrong formulas. An
exception or a hang on one rank is reported in seconds."""

import numpy as np
import pytest
import torch
import torch.distributed as dist

from labkit.checks.common import ExerciseError
from labkit.checks.tensor_parallel import (
    check_conjugate_operators,
    check_row_parallel_forward,
    check_tp_layer_bytes,
    check_whole_over_half,
)

# a right answer is compared with one process within the Oracle's rounding, which
# other CPUs' kernels move: those tests are marked numerics (run again by `make
# test-cpus`). A mistake, shortcut, deadlock or exception differs by far more than
# rounding: those are not.

# -- exercise 1: the row-parallel forward ------------------------------------------


def _mine(x, w_part, group):
    """This rank's columns of the whole input x."""
    k, i = w_part.shape[1], dist.get_rank(group)
    return x[..., i * k:(i + 1) * k]


def _row_good(x, w_part, bias, group):
    y = _mine(x, w_part, group) @ w_part.T
    dist.all_reduce(y, group=group)
    return y + bias


def _row_bias_everywhere(x, w_part, bias, group):
    y = _mine(x, w_part, group) @ w_part.T + bias
    dist.all_reduce(y, group=group)
    return y


def _row_no_reduce(x, w_part, bias, group):
    return _mine(x, w_part, group) @ w_part.T + bias


def _row_default_group(x, w_part, bias, group):
    y = _mine(x, w_part, group) @ w_part.T
    dist.all_reduce(y)
    return y + bias


def _row_averages(x, w_part, bias, group):
    y = _mine(x, w_part, group) @ w_part.T
    dist.all_reduce(y, op=dist.ReduceOp.AVG, group=group)
    return y + bias


def _row_first_columns(x, w_part, bias, group):  # every rank: columns [0, k)
    y = x[..., :w_part.shape[1]] @ w_part.T
    dist.all_reduce(y, group=group)
    return y + bias


def _row_global_rank(x, w_part, bias, group):  # ranks 2 and 3: past the end
    k, i = w_part.shape[1], dist.get_rank()
    y = x[..., i * k:(i + 1) * k] @ w_part.T
    dist.all_reduce(y, group=group)
    return y + bias


def _row_gathers_partials(x, w_part, bias, group):
    y = _mine(x, w_part, group) @ w_part.T
    parts = [torch.empty_like(y) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, y, group=group)
    return sum(parts) + bias


def _row_gathers_the_weight(x, w_part, bias, group):
    ws = [torch.empty_like(w_part) for _ in range(dist.get_world_size(group))]
    dist.all_gather(ws, w_part, group=group)
    return x @ torch.cat(ws, 1).T + bias


def _row_labkits(x, w_part, bias, group):
    from labkit.parallel import reduce_from_tensor_model_parallel_region

    y = _mine(x, w_part, group) @ w_part.T
    return reduce_from_tensor_model_parallel_region(y, group) + bias


def _row_twice(x, w_part, bias, group):
    y = _row_good(x, w_part, bias, group)
    dist.all_reduce(torch.zeros(3), group=group)
    return y


def _row_in_float64(x, w_part, bias, group):
    y = (_mine(x, w_part, group) @ w_part.T).double()
    dist.all_reduce(y, group=group)
    return (y + bias).float()


def _row_nan(x, w_part, bias, group):
    y = _row_good(x, w_part, bias, group)
    return y.fill_(float("nan"))


def _row_wrong_shape(x, w_part, bias, group):
    return _row_good(x, w_part, bias, group)[..., :3]


def _row_rank0_only(x, w_part, bias, group):
    y = _mine(x, w_part, group) @ w_part.T
    if dist.get_rank() == 0:
        dist.all_reduce(y, group=group)
    return y + bias


def _row_raises_on_rank1(x, w_part, bias, group):
    if dist.get_rank() == 1:
        raise ValueError("shapes do not match")
    return _row_good(x, w_part, bias, group)


def _todo(*args):
    raise NotImplementedError("exercise: not yet")


@pytest.mark.numerics
def test_a_right_row_parallel_forward_passes_and_says_what_was_measured(
        cluster, capsys):
    assert not check_row_parallel_forward(cluster, _todo)
    assert "not written yet" in capsys.readouterr().out
    assert check_row_parallel_forward(cluster, _row_good)
    assert ("correct: on inputs drawn this run, every rank of 2 groups of 2 "
            "returned its replica's whole output; measured on every rank: one "
            "all-reduce of 105 float32 elements (420 bytes) in its group, no other "
            "collective") in capsys.readouterr().out


@pytest.mark.parametrize("answer, message", [
    (_row_bias_everywhere, r"rank \d, element \(\d+, \d+, \d+\): got .*, expected "
                           r".*\. The bias is added 2 times instead of once"),
    (_row_no_reduce, r"rank \d, element .* only this rank's partial sum"),
    (_row_default_group, r"rank \d, element .*This is the sum over all 4 ranks: "
                         r"the all-reduce ran in the default group"),
    (_row_averages, r"The output is 1/t of the answer"),
    (_row_first_columns, r"rank \d, element .*Every rank of the group multiplied "
                         r"the same columns of x, \[0, 6\), by its own columns of "
                         r"W"),
    (_row_global_rank, r"rank[s 23and]+: your row-parallel forward raised "
                       r"RuntimeError: .*\. Hint: x is the whole input.*"
                       r"dist.get_rank\(group\) \(not its global rank"),
    (_row_nan, r"rank 0, element \(0, 0, 0\): got nan, expected"),
    (_row_wrong_shape, r"rank 0: the output has shape \(5, 3, 3\), expected "
                       r"\(5, 3, 7\)"),
])
def test_wrong_row_parallel_forwards_are_named(cluster, answer, message):
    with pytest.raises(ExerciseError, match=message):
        check_row_parallel_forward(cluster, answer)


@pytest.mark.parametrize("answer, message", [
    (_row_gathers_partials, r"rank 0: your answer called \['all_gather'\]; a "
                            r"tensor-parallel rank never gathers the whole weight"),
    (_row_gathers_the_weight, r"rank 0: your answer called \['all_gather'\]"),
    (_row_labkits, r"rank 0: your answer calls labkit.parallel."
                   r"tensor_parallel_mappings.reduce_from_tensor_model_parallel_"
                   r"region, labkit's own tensor-parallel layer; the exercise is to "
                   r"write it yourself"),
    (_row_twice, r"rank 0: the values are right, but: it called all-reduce 2 "
                 r"times; a row-parallel layer's forward is one all-reduce of the "
                 r"105 elements it sums"),
    (_row_in_float64, r"rank 0: the values are right, but: its all-reduce carried "
                      r"840 bytes; 105 float32 elements are 420"),
])
def test_shortcuts_to_the_row_parallel_forward_fail(cluster, answer, message):
    with pytest.raises(ExerciseError, match=message):
        check_row_parallel_forward(cluster, answer)


def test_outputs_written_down_from_one_run_fail_the_next(cluster, tmp_path):
    """No communication at all: each rank returns the output it saved from an
    earlier run; the inputs are drawn anew, so it is another layer's output."""
    def save(x, w_part, bias, group):
        y = _row_good(x, w_part, bias, group)
        torch.save(y, tmp_path / f"{dist.get_rank()}.pt")
        return y

    def replay(x, w_part, bias, group):
        return torch.load(tmp_path / f"{dist.get_rank()}.pt")

    assert check_row_parallel_forward(cluster, save)
    with pytest.raises(ExerciseError, match=r"rank \d, element .*: got .*, expected"):
        check_row_parallel_forward(cluster, replay)


def test_an_exception_and_a_hang_are_reported_by_rank(cluster):
    import time

    with pytest.raises(ExerciseError, match=r"rank 1: your row-parallel forward "
                       r"raised ValueError: shapes do not match at line \d+ of "
                       r"test_checks_tensor_parallel.py, in _row_raises_on_rank1"):
        check_row_parallel_forward(cluster, _row_raises_on_rank1)
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
    def forward(ctx, x, group):
        ctx.group = group
        return _G.forward(ctx, x, group)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
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


class _FDefaultGroup(_F):
    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad, None


class _GDefaultGroup(_G):
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x)
        return x


class _FGathers(_F):
    @staticmethod
    def backward(ctx, grad):
        parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return sum(parts), None


class _GTwice(_G):
    @staticmethod
    def forward(ctx, x, group):
        dist.all_reduce(torch.zeros(1), group=group)
        return _G.forward(ctx, x, group)


def _f(x, group):
    return _F.apply(x, group)


def _g(x, group):
    return _G.apply(x, group)


def _f_detached(x, group):
    return x.detach()


def _labkits_f(x, group):
    from labkit.parallel import copy_to_tensor_model_parallel_region

    return copy_to_tensor_model_parallel_region(x, group)


@pytest.mark.numerics
def test_right_f_and_g_pass_and_the_line_says_what_was_measured(cluster, capsys):
    assert not check_conjugate_operators(cluster, _todo, _todo)
    assert "not written yet" in capsys.readouterr().out
    assert check_conjugate_operators(cluster, _f, _g)
    out = capsys.readouterr().out
    assert "correct: on weights and batches drawn this run" in out
    assert ("measured on every rank: one all-reduce of 180 float32 elements forward "
            "(g) and one backward (f), in its group, no other collective") in out


@pytest.mark.parametrize("f, g, message", [
    (lambda x, gr: _FReducesForward.apply(x, gr), _g,
     r"rank \d, the output, element .*: got .*expected .*The forward is wrong: f "
     r"must return x"),
    (_f, lambda x, gr: _GReducesBackward.apply(x, gr),
     r"rank \d, the gradient of fc1.weight, element .* \(it is 2x the right value "
     r"everywhere\)\. g's backward must be the identity"),
    (lambda x, gr: _FIdentityBackward.apply(x, gr), _g,
     r"rank \d, x's gradient, element .*f's backward must all-reduce"),
    (lambda x, gr: _FDefaultGroup.apply(x, gr), _g,
     r"rank \d, x's gradient, element .*This is the sum over all 4 ranks: f's "
     r"backward all-reduced in the default group"),
    (_f, lambda x, gr: _GDefaultGroup.apply(x, gr),
     r"rank \d, the output, element .*This is the sum over all 4 ranks: g "
     r"all-reduced in the default group"),
    (_f_detached, _g, r"rank \d: x got no gradient"),
    (_f, lambda x, gr: _G.apply(x, gr) * float("nan"),
     r"rank \d, the output, element .*: got nan"),
])
def test_wrong_f_and_g_are_named(cluster, f, g, message):
    with pytest.raises(ExerciseError, match=message):
        check_conjugate_operators(cluster, f, g)


@pytest.mark.parametrize("f, g, message", [
    (_labkits_f, _g, r"rank 0: your answer calls labkit.parallel."
                     r"tensor_parallel_mappings.copy_to_tensor_model_parallel_"
                     r"region, labkit's own f and g"),
    (lambda x, gr: _FGathers.apply(x, gr), _g,
     r"rank 0: your answer called \['all_gather'\]"),
    (_f, lambda x, gr: _GTwice.apply(x, gr),
     r"rank 0: the values are right, but in forward: it called all-reduce 2 times; "
     r"g in forward is one all-reduce of the 180 elements it sums"),
])
def test_shortcuts_to_f_and_g_fail(cluster, f, g, message):
    with pytest.raises(ExerciseError, match=message):
        check_conjugate_operators(cluster, f, g)


# -- exercise 3: bytes per GPU per layer ----------------------------------------------


def _bytes(b, s, h, t, elem_bytes, recompute):
    return (6 if recompute else 4) * 2 * (t - 1) / t * b * s * h * elem_bytes


def test_right_layer_bytes_pass(capsys):
    assert not check_tp_layer_bytes(_todo)
    assert "not written yet" in capsys.readouterr().out
    assert check_tp_layer_bytes(_bytes)
    assert ("a GPT-3 layer at t = 8 sends 336 MiB per GPU per step, 504 MiB with "
            "the layer recomputed in backward") in capsys.readouterr().out
    assert check_tp_layer_bytes(lambda *a: np.float64(_bytes(*a)))


@pytest.mark.parametrize("answer, message", [
    (lambda b, s, h, t, e, r: (6 if r else 4) * (t - 1) / t * b * s * h * e,
     r"the ring's factor is 2\(t-1\)/t"),
    (lambda b, s, h, t, e, r: (6 if r else 4) * b * s * h * e,
     r"that is the payload of the all-reduces"),
    (lambda b, s, h, t, e, r: (6 if r else 4) * 2 * (t - 1) / t * b * s * h,
     r"that counts elements"),
    (lambda b, s, h, t, e, r: 2 * 2 * (t - 1) / t * b * s * h * e,
     r"forward only: backward sends f's two all-reduces"),
    (lambda b, s, h, t, e, r: 4 * 2 * (t - 1) / t * b * s * h * e,
     r"recompute=True.*the forward run again in backward sends g's two once more"),
    (lambda b, s, h, t, e, r: (8 if r else 4) * 2 * (t - 1) / t * b * s * h * e,
     r"not four: f is the identity in forward"),
    (lambda b, s, h, t, e, r: (6 if r else 4) * 2 * (t - 1) / t * 12 * h * h * e,
     r"that is the layer's weights"),
])
def test_wrong_layer_bytes_are_named(answer, message):
    with pytest.raises(ExerciseError, match=message):
        check_tp_layer_bytes(answer)


def test_shortcuts_to_the_layer_bytes_fail():
    def labkits(b, s, h, t, e, r):
        from labkit.theory import layer_traffic

        return layer_traffic(b, s, h, t, e).bytes_per_rank * (1.5 if r else 1)

    def the_checks(*args):
        from labkit.checks.tensor_parallel import _layer_bytes

        return float(_layer_bytes(*args))

    for cheat, what in ((labkits, "layer_traffic"), (the_checks, "_layer_bytes")):
        with pytest.raises(ExerciseError, match=rf"calls .*{what}, labkit's own "
                           r"tensor-parallel traffic"):
            check_tp_layer_bytes(cheat)
    # the chapter's number, written down, fails the cases drawn this run
    with pytest.raises(ExerciseError, match=r"got 3.52322e\+08 bytes|got 5.28482e"):
        check_tp_layer_bytes(lambda *a: 352_321_536 * (1.5 if a[-1] else 1))
    with pytest.raises(ExerciseError, match=r"nan is not a number an answer can be"):
        check_tp_layer_bytes(lambda *a: float("nan"))
    with pytest.raises(ExerciseError, match=r"expected a number of bytes, got str"):
        check_tp_layer_bytes(lambda *a: "336 MiB")


# -- exercise 4: the t at which the whole activations outweigh the split ones -------


def _smallest_t(s, b, h, heads, ffn):
    whole = 5 * s * b * h + 4 * s * b
    split = 4 * s * b * h + 2 * s * b * ffn + heads * s * s * b
    return next((t for t in range(1, heads + 1) if heads % t == 0
                 and ffn % t == 0 and whole * t > split), None)


def test_a_right_smallest_t_passes(capsys):
    assert not check_whole_over_half(_todo)
    assert "not written yet" in capsys.readouterr().out
    assert check_whole_over_half(_smallest_t)
    assert "in the chapter's block t = 4: 50.3% of a rank's activations stay whole" in (
        capsys.readouterr().out)
    assert check_whole_over_half(lambda *a: float(_smallest_t(*a)))
    assert check_whole_over_half(lambda *a: np.int64(_smallest_t(*a)))


def test_the_chapters_answer_written_down_fails():
    with pytest.raises(ExerciseError, match=r"smallest_t\(s=\d+, b=\d+, h=\d+, "
                       r"heads=\d+, ffn=\d+\): (at t = 4 the whole activations are|"
                       r"t = 4 cannot split the block)"):
        check_whole_over_half(lambda *a: 4)


def test_the_layernorm_statistics_tip_the_chapters_block():
    """5 sbh against 20 sbh / t: without the 4 sb, t = 4 is exactly half."""
    def no_statistics(s, b, h, heads, ffn):
        split = 4 * s * b * h + 2 * s * b * ffn + heads * s * s * b
        return next(t for t in range(1, heads + 1) if heads % t == 0
                    and 5 * s * b * h * t > split)

    with pytest.raises(ExerciseError, match=r"smallest_t\(s=64, b=4, h=64, heads=8, "
                       r"ffn=256\): at t = 8 .*but already at t = 4.*the LayerNorms' "
                       r"statistics"):
        check_whole_over_half(no_statistics)


def _mlp_as_8sbh(s, b, h, heads, ffn):
    return _smallest_t(s, b, h, heads, 4 * h)


def _no_scores(s, b, h, heads, ffn):
    whole, split = 5 * s * b * h + 4 * s * b, 4 * s * b * h + 2 * s * b * ffn
    return next(t for t in range(1, heads + 1) if heads % t == 0
                and ffn % t == 0 and whole * t > split)


def _any_t(s, b, h, heads, ffn):
    whole = 5 * s * b * h + 4 * s * b
    split = 4 * s * b * h + 2 * s * b * ffn + heads * s * s * b
    return next(t for t in range(1, heads + 1) if whole * t > split)


@pytest.mark.parametrize("case, answer, message", [
    # an MLP 2h wide: 2·sb·ffn is 4 sbh, not 8
    ((16, 1, 64, 4, 128), _mlp_as_8sbh, r"at t = 4 .*but already at t = 2.*the "
                                        r"MLP's hidden activations are 2·sb·ffn"),
    # long enough a sequence that the scores decide
    ((64, 1, 64, 4, 128), _no_scores, r"at t = 2 .*not more than half yet; the "
                                      r"attention scores"),
    # the inequality alone holds from t = 3, which cannot split 4 heads
    ((64, 1, 64, 4, 128), _any_t, r"t = 3 cannot split the block: 4 attention "
                                  r"heads and 128 MLP features over 3 ranks"),
    ((64, 1, 64, 4, 128), lambda *a: None, r"got None; t = 4 splits the block"),
    ((64, 1, 64, 4, 128), lambda *a: 2.5, r"t is a whole number of ranks >= 1, "
                                          r"not 2.5"),
    ((64, 1, 64, 4, 128), lambda *a: float("nan"), r"nan is not a number"),
    ((64, 1, 64, 4, 128), lambda *a: True, r"expected a whole number of ranks, "
                                           r"got bool"),
])
def test_wrong_smallest_t_are_named(monkeypatch, case, answer, message):
    from labkit.checks import tensor_parallel

    monkeypatch.setattr(tensor_parallel, "_block_cases", lambda seed: [case])
    with pytest.raises(ExerciseError, match=message):
        check_whole_over_half(answer)


def test_labkits_activation_formulas_are_refused():
    def labkits(s, b, h, heads, ffn):
        from labkit.theory import activation_memory

        activation_memory(s, b, h, heads)
        return _smallest_t(s, b, h, heads, ffn)

    with pytest.raises(ExerciseError, match=r"calls labkit.theory.activations."
                       r"activation_memory, labkit's own activation formulas"):
        check_whole_over_half(labkits)
