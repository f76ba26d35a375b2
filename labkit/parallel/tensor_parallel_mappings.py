"""Tensor parallelism's conjugate operators (tensor_parallel.py's helper), with
Megatron-LM's names (Shoeybi et al. 2019, sec. 3, fig. 3; sequence parallelism:
Korthikanti et al. 2022, sec. 4.2.2): f, g, and the scatters, gathers and
reduce-scatter along the last (features) or first (sequence) dimension.

Imports labkit.parallel.reduce_scatter. Each is an autograd Function over an
explicit process group (None: the world), the identity on one rank, whose backward
is its forward's conjugate (f: identity forward, all-reduce backward; g: reverse).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.parallel.reduce_scatter import send_chunks, sum_chunks


def divide(n: int, t: int, what: str) -> int:
    """n // t, or ValueError naming both sizes when t does not divide n."""
    if n % t:
        raise ValueError(f"{what} = {n} is not divisible by the tensor-parallel "
                         f"size {t}: each of the {t} ranks must get an equal part")
    return n // t


def _size(group) -> int:
    return dist.get_world_size(group)


def _rank(group) -> int:
    return dist.get_rank(group)


# -- the collectives, on plain tensors -------------------------------------------


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if _size(group) == 1:
        return x
    out = x.contiguous().clone()  # never sum into a tensor autograd may have saved
    dist.all_reduce(out, group=group)
    return out


def _gather_flat(x: torch.Tensor, group) -> torch.Tensor:
    """(t, *x.shape): every rank's x, in group-rank order; one all_gather_single
    into a 1-D buffer (gloo's all-gather takes only a 1-D output)."""
    t = _size(group)
    out = x.new_empty(t * x.numel())
    dist.all_gather_single(out, x.contiguous().view(-1), group=group)
    return out.view(t, *x.shape)


def _all_gather_last(x: torch.Tensor, group) -> torch.Tensor:
    """(..., h/t) on each rank -> (..., h), rank r's part at [r*h/t, (r+1)*h/t)."""
    if _size(group) == 1:
        return x
    parts = _gather_flat(x, group)  # (t, ..., h/t)
    return torch.cat(parts.unbind(0), dim=-1)


def all_gather_first(x: torch.Tensor, group) -> torch.Tensor:
    """(s/t, ...) on each rank -> (s, ...), rank r's rows at [r*s/t, (r+1)*s/t)."""
    if _size(group) == 1:
        return x
    parts = _gather_flat(x, group)  # (t, s/t, ...): concatenated along dim 0
    return parts.view(x.shape[0] * parts.shape[0], *x.shape[1:])


def reduce_scatter_first(x: torch.Tensor, group) -> torch.Tensor:
    """(s, ...) on each rank -> (s/t, ...): rank r gets rows [r*s/t, (r+1)*s/t)
    summed over the ranks (reduce_scatter.py: an all-to-all and a local sum)."""
    t = _size(group)
    if t == 1:
        return x
    divide(x.shape[0], t, "the sequence length (dim 0)")
    got, _ = send_chunks(x, group)
    return sum_chunks(got, t)


def _keep_last(x: torch.Tensor, group) -> torch.Tensor:
    t = _size(group)
    if t == 1:
        return x
    k = divide(x.shape[-1], t, "the last dimension")
    r = _rank(group)
    return x[..., r * k:(r + 1) * k].contiguous()


def _keep_first(x: torch.Tensor, group) -> torch.Tensor:
    t = _size(group)
    if t == 1:
        return x
    k = divide(x.shape[0], t, "the sequence length (dim 0)")
    r = _rank(group)
    return x[r * k:(r + 1) * k].contiguous()


# -- the autograd Functions ------------------------------------------------------


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterLast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _keep_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_last(grad, ctx.group), None


class _GatherLast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _keep_last(grad, ctx.group), None


class _ScatterFirst(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _keep_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_first(grad, ctx.group), None


class _GatherFirst(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_first(grad, ctx.group), None


class _ReduceScatterFirst(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_first(grad, ctx.group), None


# -- the operators ---------------------------------------------------------------


def copy_to_tensor_model_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """f: identity forward, all-reduce (sum) of the gradient backward."""
    return _Copy.apply(x, group)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group=None
                                             ) -> torch.Tensor:
    """g: all-reduce (sum) forward, identity backward."""
    return _Reduce.apply(x, group)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group=None
                                            ) -> torch.Tensor:
    """Keep this rank's slice of the last dim forward; all-gather it backward."""
    return _ScatterLast.apply(x, group)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group=None
                                             ) -> torch.Tensor:
    """All-gather along the last dim forward; keep this rank's slice backward."""
    return _GatherLast.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Keep this rank's rows of dim 0 ([s, b, h] -> [s/t, b, h]) forward;
    all-gather dim 0 backward."""
    return _ScatterFirst.apply(x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather dim 0 forward ([s/t, b, h] -> [s, b, h]); reduce-scatter dim 0
    backward."""
    return _GatherFirst.apply(x, group)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group=None
                                               ) -> torch.Tensor:
    """Reduce-scatter dim 0 forward ([s, b, h] partial sums -> [s/t, b, h] of the
    total); all-gather dim 0 backward."""
    return _ReduceScatterFirst.apply(x, group)
