"""ZeRO stages 1 and 2 (Rajbhandari et al. 2020, sec. 5.1-5.2): each of N
data-parallel ranks keeps the optimizer state (stage 1), and the averaged gradient
(stage 2), of one 1/N slice of the parameters; parameters stay whole on every rank.

    opt = ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)  # ZeRO-1
    loss.backward(); <all-reduce the gradients, op=AVG>; opt.step()
    ShardedOptimizer(..., stage=2, bucket_mib=1)  # averaged during backward

Imports labkit.probe, zero_buckets and zero_state. The parameters become views into
one flat buffer per param group, so `optimizer_cls` must be element-wise (no LAMB).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from labkit.parallel import guards, zero_state
from labkit.parallel.zero_buckets import (GATHERS, BucketHooks, gather_slices,
                                         make_buckets, reduce_scatter)
from labkit.probe import count_as


@dataclass(eq=False)
class _Group:
    """One param group's flat buffer and this rank's slice [lo, hi) of it."""

    flat: torch.Tensor  # (N*s,) the parameters are views into it
    params: list  # trainable parameters, in buffer order
    offset: dict  # parameter -> first element in `flat`
    s: int  # elements per rank, padding included
    lo: int  # this rank's real elements: flat[lo:hi]
    hi: int
    buckets: list = field(default_factory=list)
    grad: torch.Tensor | None = None  # (s,) the averaged gradient of r*s...(r+1)*s
    got: set = field(default_factory=set)  # stage 2: reduced with a gradient
    stepped: set = field(default_factory=set)  # parameters stepped at least once

    def part(self, p) -> tuple[int, int]:
        """The elements [i, j) of p.reshape(-1) that fall in this rank's slice."""
        a, k = self.offset[p], p.numel()
        return min(max(self.lo - a, 0), k), min(max(self.hi - a, 0), k)

    def gaps(self, got: set) -> list[tuple[int, int]]:
        """The ranges [a, b) of this rank's slice held by parameters not in `got`."""
        out: list[tuple[int, int]] = []
        for p in self.params:
            i, j = self.part(p)
            if p in got or i == j:
                continue
            a = self.offset[p] + i - self.lo
            if out and out[-1][1] == a:  # neighbours (a weight and its bias): one
                out[-1] = (out[-1][0], a + j - i)
            else:
                out.append((a, a + j - i))
        return out


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO-1/2: `optimizer_cls` steps only this rank's 1/N slice; step() all-gathers.

    `param_groups` hold your parameters (an lr scheduler works as usual); `state` is
    the slice's (Adam: m and v of s elements per group, plus a step counter).
    `state_dict()` is collective and returns what `optimizer_cls` itself would
    save; `load_state_dict` takes either, on any number of ranks. `gather` picks
    the parameters' all-gather: "all_gather" (NCCL's default) or "broadcast", N
    broadcasts side by side, one from each slice's owner (gloo's default).

    torch.distributed.optim.ZeroRedundancyOptimizer's role (ZeRO-1), plus stage
    2; unlike it, each rank owns an equal 1/N slice of one zero-padded flat
    buffer, not whole parameters, and a slice's state counts the slice's steps.
    """

    def __init__(self, params, optimizer_cls: type[torch.optim.Optimizer], *,
                 stage: int = 1, reduce_scatter_gradients: bool | None = None,
                 bucket_mib: float = 25.0, gather: str | None = None, group=None,
                 **optimizer_kwargs):
        if stage not in (1, 2):
            raise ValueError(f"ShardedOptimizer does ZeRO stage 1 or 2, not {stage!r} "
                             "(stage 3 shards the parameters too: that is FSDP)")
        if reduce_scatter_gradients is None:
            reduce_scatter_gradients = stage == 2
        if stage == 2 and not reduce_scatter_gradients:
            raise ValueError("stage 2 always reduce-scatters the gradients (in "
                             "backward); leave out reduce_scatter_gradients")
        guards.positive_mib(bucket_mib, "bucket_mib")
        if gather not in (None, *GATHERS):
            raise ValueError(f"gather must be one of {GATHERS} (or None: the "
                             f"backend's faster), not {gather!r}")
        guards.require_process_group("ShardedOptimizer")
        self.process_group = group
        self.dp_rank, self.dp_size = dist.get_rank(group), dist.get_world_size(group)
        self.stage, self.reduce_scatter_gradients = stage, reduce_scatter_gradients
        self._backend = dist.get_backend(group)
        # NCCL's all-gather is one kernel; gloo's is a ring of N-1 steps one after
        # another, which N broadcasts side by side beat (bench strategies)
        self.gather = gather or ("broadcast" if self._backend == "gloo"
                                 else "all_gather")
        self._bucket_bytes = bucket_mib * 2**20  # MiB, like DDP's bucket_cap_mb
        self._cls, self.inner, self.groups = optimizer_cls, None, []
        self._hooks = BucketHooks(self._reduce_bucket) if stage == 2 else None
        super().__init__(params, dict(optimizer_kwargs))
        self.state = self.inner.state  # the slice's state (holdings counts it)

    # -- layout -----------------------------------------------------------------

    def add_param_group(self, param_group: dict) -> None:
        """torch.optim's, and: the group's trainable parameters move into a flat
        buffer of their own (a group added later re-shards none of the others),
        and this rank's slice of it becomes a group of the inner optimizer."""
        super().add_param_group(param_group)
        g = self.param_groups[-1]
        grp = self._flatten([p for p in g["params"] if p.requires_grad])
        self.groups.append(grp)
        # an empty slice (a tiny group on many ranks) keeps every rank's groups alike
        piece = {**g, "params": [grp.flat[grp.lo:grp.hi]]}
        if self.inner is None:
            self.inner = self._cls([piece], **self.defaults)
        else:
            self.inner.add_param_group(piece)
        for k, v in self.inner.param_groups[-1].items():
            g.setdefault(k, v)  # the full hyperparameters, as optimizer_cls keeps them
        if self._hooks is not None:
            self._hooks.add(grp, grp.buckets)

    @torch.no_grad()
    def _flatten(self, params: list) -> _Group:
        n, r = self.dp_size, self.dp_rank
        device = "cuda" if self._backend == "nccl" else "cpu"
        for p in params:
            if p.device.type != device:
                raise ValueError(
                    f"a parameter of shape {tuple(p.shape)} is on {p.device}, but the "
                    f"process group ({self._backend}) works on {device}: move the "
                    "model first")
        if len({p.dtype for p in params}) > 1:
            raise ValueError("a param group's parameters must share one dtype: "
                             "put each dtype in its own group")
        numel = sum(p.numel() for p in params)
        s = math.ceil(numel / n)  # zero-padded to N*s: rank r owns [r*s, (r+1)*s)
        like = params[0] if params else torch.empty(0)
        flat = like.new_zeros(n * s)
        offset, o = {}, 0
        for p in params:
            flat[o:o + p.numel()].copy_(p.reshape(-1))
            p.data = flat[o:o + p.numel()].view_as(p)  # the parameter lives in `flat`
            offset[p], o = o, o + p.numel()
        cap = max(1, int(self._bucket_bytes // flat.element_size()))
        return _Group(flat, params, offset, s, min(r * s, numel),
                      min((r + 1) * s, numel), make_buckets(params, offset, n * s, cap))

    # -- gradients ----------------------------------------------------------------

    @torch.no_grad()
    def _reduce_bucket(self, grp: _Group, b, keep=None) -> None:
        """Average bucket b's gradients over ranks into this rank's slice. In stage
        2, free the full gradients once copied, all but `keep`'s."""
        buf = grp.flat.new_zeros(b.end - b.start)  # zeros where no gradient came
        count_as(buf, "Temp")  # a copy made to send: a buffer, not model state
        for p in b.params:
            if p.grad is not None:
                o = grp.offset[p] - b.start
                buf[o:o + p.numel()].view_as(p).copy_(p.grad)
                grp.got.add(p)
            if self.stage == 2 and p is not keep:
                p.grad = None
        if grp.grad is None:
            grp.grad = grp.flat.new_zeros(grp.s)
        # stage 2 keeps the slice from backward to step(), in place of the .grads;
        # stage 1 makes and uses it inside step(): a step temporary
        count_as(grp.grad, "Gradient" if self.stage == 2 else "Temp")
        reduce_scatter(buf, b.start, grp.s, grp.grad, self.process_group)

    def _grad_slices(self) -> list[tuple[torch.Tensor, set]]:
        """This rank's averaged gradient slice of each group, (hi - lo,) each, and
        the group's parameters that got a gradient (the others are not stepped)."""
        params = [p for grp in self.groups for p in grp.params]
        got = [grp.got if self.stage == 2 else
               {p for p in grp.params if p.grad is not None} for grp in self.groups]
        if self.stage == 2:
            if all(grp.grad is None for grp in self.groups):
                raise RuntimeError("step() before backward(): stage 2 has reduced no "
                                   "gradient since the last step() or zero_grad()")
            if any(p.grad is not None for p in params):
                raise RuntimeError(
                    "stage 2 reduce-scatters gradients during backward and frees "
                    "them, but a parameter has a .grad set outside backward")
        elif not any(p.grad is not None for p in params):
            raise RuntimeError("step() before backward(): no parameter has a "
                               "gradient")
        elif self.reduce_scatter_gradients:
            for grp in self.groups:
                for b in grp.buckets:
                    self._reduce_bucket(grp, b)
        if self.reduce_scatter_gradients:
            return [(grp.flat.new_zeros(grp.hi - grp.lo) if grp.grad is None
                     else grp.grad[:grp.hi - grp.lo], mine)
                    for grp, mine in zip(self.groups, got)]
        out = []  # gradients averaged by the caller: copy out this rank's slice
        for grp, mine in zip(self.groups, got):
            g = grp.flat.new_zeros(grp.hi - grp.lo)
            count_as(g, "Temp")  # a copy of the .grads' values, for the inner step
            for p in grp.params:
                i, j = grp.part(p)
                if p.grad is not None and i < j:
                    at = grp.offset[p] + i - grp.lo
                    g[at:at + j - i] = p.grad.reshape(-1)[i:j]
            out.append((g, mine))
        return out

    def remove_hooks(self) -> None:
        """Stop stage 2's gradient hooks (the parameters keep working without them)."""
        if self._hooks is not None:
            self._hooks.remove()

    # -- step ---------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        """Step `optimizer_cls` on this rank's slice of each group's averaged
        gradient (reduce-scattered here first with reduce_scatter_gradients in
        stage 1), then all-gather every rank's updated slice into the parameters.
        A parameter without a gradient keeps its values and state bit for bit."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        held = []  # what the step must not change: the skipped parameters' elements
        for i, (g, inner, grp, (grad, got)) in enumerate(zip(
                self.param_groups, self.inner.param_groups, self.groups,
                self._grad_slices())):
            inner.update({k: v for k, v in g.items() if k != "params"})  # lr, ...
            piece = inner["params"][0]
            piece.grad = grad if got else None  # none got one: torch.optim skips it
            gaps = grp.gaps(got) if got else []
            if gaps:
                held.append((i, piece, gaps, {
                    k: [t[a:b].clone() for a, b in gaps]
                    for k, t in self._elementwise(i, piece).items()}))
            grp.stepped |= got
        self.inner.step()
        for i, piece, gaps, saved in held:  # put the skipped elements back
            for k, t in self._elementwise(i, piece).items():
                # state born in this step starts at zero for a skipped parameter
                # (where Adam's starts): an optimizer that keeps a master copy in
                # its state must make it before the first step
                for n, (a, b) in enumerate(gaps):  # state born in this step: zero
                    t[a:b].copy_(saved[k][n]) if k in saved else t[a:b].zero_()
        for inner in self.inner.param_groups:
            inner["params"][0].grad = None
        for grp in self.groups:
            grp.grad, grp.got = None, set()  # consumed: a new backward starts anew
            if grp.s:  # every rank gets every rank's updated slice, in place
                gather_slices(grp.flat, grp.s, self.gather, self.process_group)
        return loss

    def _elementwise(self, i: int, piece: torch.Tensor) -> dict[str, torch.Tensor]:
        """Group i's slice and what the inner optimizer keeps of it element by
        element: an OffloadedOptimizer's master copy, the state of either (Adam's
        m and v; not a step counter)."""
        keys = {"slice": piece}
        master = getattr(self.inner, "master", None)  # an OffloadedOptimizer's
        if isinstance(master, list):
            keys["master"] = master[i]
        out = dict(keys)
        for name, key in keys.items():
            for k, v in self.inner.state.get(key, {}).items():
                if torch.is_tensor(v) and v.dim() == 1 and v.numel() == piece.numel():
                    out[f"{name} {k}"] = v
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for grp in self.groups:
            if set_to_none:
                grp.grad, grp.got = None, set()
            elif grp.grad is not None:
                grp.grad.zero_()  # as torch.optim's zeroed .grad: still stepped

    @property
    def optim(self) -> torch.optim.Optimizer:
        """The `optimizer_cls` instance that steps this rank's slice (an
        OffloadedOptimizer's `bytes_moved`, say); ZeroRedundancyOptimizer's name."""
        return self.inner

    def host_resident(self) -> dict[str, list[torch.Tensor]]:
        """What the inner optimizer keeps in host memory, by category (an
        OffloadedOptimizer's master slice, state and gradient copy), so that the
        memory ledger counts it as host memory; {} for an ordinary optimizer."""
        if self.inner is None:
            return {}
        return getattr(self.inner, "host_resident", dict)()

    # -- checkpoints ------------------------------------------------------------------

    def state_dict(self) -> dict:
        """What `optimizer_cls` itself would save, whole: collective, call it on every
        rank. Element-wise state (Adam's m and v) is all-gathered from the slices."""
        return zero_state.state_dict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a `state_dict()` of this class or of `optimizer_cls` (same groups, any
        number of ranks): each rank keeps its slice. No communication."""
        zero_state.load_state_dict(self, state_dict)
