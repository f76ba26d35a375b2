"""Fully sharded data parallelism (全分片数据并行), ZeRO stage 3 (Rajbhandari et al.
2020, sec. 5.3; PyTorch FSDP, Zhao et al. 2023, VLDB): each of N ranks keeps 1/N
of every parameter, its gradient and (with any optimizer) its optimizer state.
A wrapped module gathers its parameters just before it computes and frees them
right after: gather, compute, free.

    fsdp = FullyShardedDataParallel(model)          # rank 0's weights, sharded
    opt = torch.optim.Adam(fsdp.parameters())       # steps this rank's shards
    loss_fn(fsdp(x), y).backward()                  # gathers, reduce-scatters
    fsdp.finish_gradient_synchronization()          # wait: shard.grad averaged
    opt.step()

Layout: each parameter is flattened, zero-padded to N*s elements (s = ceil(numel
/ N)), and rank r keeps [r*s, (r+1)*s) as a 1-D nn.Parameter of s elements, under
the parameter's own name (`model.named_parameters()` lists the shards).

A unit is a module `wrap(module)` selects (default: every module with parameters
of its own) and, with root=True (the default), the wrapped model itself; it owns
its parameters not owned by a unit inside it. A parameter registered in several
modules (tied weights) belongs to the innermost unit that holds every
registration. So by default the root owns what no inner unit took (a tied
embedding and head, a final norm) and every parameter is sharded: 4Ψ/N bytes per
rank plus padding, as FSDP2's recipe (fully_shard on the blocks, then the root).
With root=False, parameters of no unit stay replicated (a warning names them
once): broadcast from rank 0, gradients all-reduced (averaged) in finish.

Gradients follow torch.optim: a trainable parameter that got no gradient in any
backward since the last finish keeps .grad None on every rank (never sent, never
stepped: no weight decay, momentum, Adam state or gradient memory for it), as
DDP, ZeroRedundancyOptimizer and FSDP2 leave it. The decision is per parameter
and local; every rank is assumed to use the same parameters in a step (FSDP2 and
ZeroRedundancyOptimizer assume it too), so every rank sends the same gradients,
in the same order, and the shards stay consistent. A parameter used in some
micro-batches (backwards) and not others is sent in those that gave it one:
its gradient is their sum, as if zeros were sent for the others.

Each gradient as it arrives, reduce-scattered with its unit's or held whole for
gradient accumulation (set_requires_gradient_sync, no_sync): fsdp_accumulation.py.

Per unit and step (bytes per rank, Ψ padded elements, 4-byte fp32):
forward: all-gather, compute, free                 (N-1)/N · 4Ψ
backward: all-gather (when its output's gradient arrives), compute, free,
reduce-scatter its gradients into shard.grad      2 × (N-1)/N · 4Ψ
each one collective for the whole unit, as FSDP2 (flat buffers: fsdp_hooks.py).
A unit's backward is over when the gradients of its inputs are computed (or, for
one whose inputs need none, when all its trainable parameters have gradients, or
backward ends): then its gradients are sent and it is freed.
prefetch=True issues the next unit's all-gather (async_op=True) before this one
computes: the next in forward, the previous in backward (order of the first
forward). compute_dtype=bfloat16 gathers and computes in bf16; the shards, their
gradients and the reduce-scatter's sum stay fp32 (the gradient crosses the wire
in bf16, the N pieces are summed in fp32: see fsdp_hooks.py).

Activation checkpointing (a forward inside a backward is a recompute), and the
start and end of a backward: fsdp_recompute.py.
"""

from __future__ import annotations

import warnings
import weakref

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

from labkit.parallel import fsdp_hooks as H
from labkit.parallel import guards
from labkit.parallel.fsdp_accumulation import GradientAccumulation
from labkit.parallel.fsdp_recompute import RecomputeAware
from labkit.probe import Span, Spans, in_backward


def has_own_parameters(m: torch.nn.Module) -> bool:
    """The default `wrap`: a module with parameters of its own."""
    return any(True for _ in m.parameters(recurse=False))


class FullyShardedDataParallel(GradientAccumulation, RecomputeAware,
                               torch.nn.Module):
    """ZeRO-3 over the ranks of `group` (default: all). `events` holds this step's
    spans: compute per unit (between hooks), all-gather issue→done, reduce-scatter
    issue→done. `units` names the wrapped modules, in forward order.

    root=True (default): the model itself is a unit owning every parameter no
    unit `wrap` selects took, so none is replicated; root=False keeps those
    replicated (named in a warning). With compute_dtype, every module computes
    in it: a unit's floating inputs and gathered weights, and a replicated
    module's inputs and (cast copies of) its fp32 parameters. A unit with a
    frozen parameter stays gathered until its backward is over (backward may
    still need it after its gradients are in). Two backwards before finish
    accumulate into shard.grad."""

    def __init__(self, module: torch.nn.Module, compute_dtype: torch.dtype | None =
                 None, wrap=None, prefetch: bool = True, group=None, *,
                 root: bool = True):
        super().__init__()
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "FullyShardedDataParallel needs a torch.distributed process group: "
                "build it inside a function you run on the ranks (cluster.run(fn)).")
        if compute_dtype is not None and not compute_dtype.is_floating_point:
            raise ValueError(f"compute_dtype must be a floating dtype (e.g. "
                             f"torch.bfloat16), not {compute_dtype}")
        self.module, self.prefetch = module, prefetch
        self.compute_dtype = compute_dtype
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = n = dist.get_world_size(self.group)
        guards.check_devices(module, self.group, "FullyShardedDataParallel")

        with torch.no_grad():  # every rank starts from rank 0's state
            for t in [*_unique_parameters(module), *module.buffers()]:
                dist.broadcast(t, group=self.group, group_src=0)
        owned, self._replicated = H.assign(module, wrap or has_own_parameters, root)
        self.sharded_units: list[H.Unit] = []
        for path, m, plist in owned:
            sharded = []
            for names, slots, p in plist:
                sh = H.make_sharded(names, slots, p, n, self.rank,
                                    compute_dtype or p.dtype)
                for mod, attr in sh.slots:
                    mod._parameters[attr] = sh.shard
                sharded.append(sh)
            self.sharded_units.append(H.Unit(path or "(root)", m, sharded))
        if not self.sharded_units:
            raise ValueError(
                "FullyShardedDataParallel: `wrap` selected no module that owns a "
                "parameter and root=False, so nothing would be sharded; select some "
                "modules (the default wraps every module with parameters of its "
                "own) or leave root=True (the root owns what no unit took)")
        if self._replicated:
            _say_replicated(module, self._replicated)

        self.param_ids = frozenset(
            [id(p.shard) for u in self.sharded_units for p in u.params]
            + [id(p) for p in self._replicated])
        self._order: list[H.Unit] = []  # forward order, from the first forward
        self._spans = Spans()  # this step's, for `events`; and the compute clock
        self._reductions: list[H.Reduction] = []
        self._stack: list[H.Unit] = []  # units whose forward is running
        self._pending = False  # backward ran; finish not yet called
        self._backward = guards.Backward(self, "_backward_ended")
        self._start_holding()  # set_requires_gradient_sync: fsdp_accumulation
        ref = weakref.ref(self)  # hooks must not keep this wrapper alive
        handles = []
        for u in self.sharded_units:
            handles.append(u.module.register_forward_pre_hook(
                _call(ref, "_pre_forward", u), with_kwargs=True))
            handles.append(u.module.register_forward_hook(_call(ref, "_post_forward",
                                                                u)))
            for p in u.trainable:
                handles.append(p.leaf.register_post_accumulate_grad_hook(
                    _call(ref, "_grad_ready", u)))
        if compute_dtype is not None:  # replicated modules compute in it too
            handles += H.cast_replicated(module, self._replicated, compute_dtype)
        guards.track(self)
        self._finalizer = weakref.finalize(self, guards.release, handles)

    # -- public ------------------------------------------------------------------

    @property
    def events(self) -> list[Span]:
        """This step's spans (this rank's clock); cleared when a new step starts."""
        return list(self._spans)

    @property
    def units(self) -> list[str]:
        return [u.name for u in (self._order or self.sharded_units)]

    def forward(self, *args, **kwargs):
        if not self._pending:  # a new step: forget the last one's spans
            self._spans.clear()
        if not in_backward():  # no backward of ours runs
            self._backward.reset()
        self._stack = []
        for u in self.sharded_units:
            u.ran = False
        self._spans.start("(outside units)")
        out = self.module(*args, **kwargs)
        self._spans.stop()  # the loss, outside: not ours to time
        for u in self.sharded_units:  # prefetched but never run (a skipped branch)
            H.wait_gather(u, self._spans)
            if u.state == "full":
                self._release(u)
        if torch.is_grad_enabled():  # the first output gradient starts backward
            hook = self._hook("_backward_started", None)
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(hook)
        return out

    def step_problem(self) -> str | None:
        """Why an optimizer step on this wrapper's parameters would be wrong now."""
        if self._pending:
            return ("FullyShardedDataParallel: call finish_gradient_synchronization() "
                    "before optimizer.step(): this rank's shard gradients are not yet "
                    f"reduce-scattered over the {self.world_size} ranks")
        return None

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        """Send what set_requires_gradient_sync(False) still holds; wait for every
        reduce-scatter; average the replicated parameters' gradients. A trainable
        shard that got a gradient in some backward since the last finish then has
        an fp32 .grad of its shape; one that got none keeps .grad None, so the
        optimizer skips it (as torch.optim does)."""
        self._send_held()
        self._fold()
        for p in self._replicated:
            if p.requires_grad and p.grad is not None:  # None on every rank: skip
                with self._spans.timed("all_reduce (replicated)", p.grad.nbytes):
                    dist.all_reduce(p.grad, group=self.group)
                p.grad.div_(self.world_size)
        self._pending = False
        self._backward.reset()

    @torch.no_grad()
    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """{name: the whole parameter, fp32, original shape} for every name
        (tied weights under each of theirs). Collective: call it on every rank."""
        out = {}
        for u in self.sharded_units:
            for p in u.params:
                full = p.shard.new_empty(self.world_size * p.s)
                dist.all_gather_single(full, p.shard.detach(), group=self.group)
                for name in p.names:
                    out[name] = full[:p.numel].view(p.shape).clone()
        for name, p in self.module.named_parameters(remove_duplicate=False):
            if name not in out:
                out[name] = p.detach().clone()
        return out

    def close(self) -> None:
        """Remove this wrapper's hooks now (they also go when it is collected)."""
        guards.forget(self)
        self._finalizer()

    def extra_repr(self) -> str:
        return (f"units={len(self.sharded_units)}, replicated={len(self._replicated)}, "
                f"world_size={self.world_size}, prefetch={self.prefetch}, "
                f"compute_dtype={self.compute_dtype}")

    # -- forward -----------------------------------------------------------------

    def _hook(self, method: str, u):
        """A hook that calls `method` of this wrapper while it lives."""
        return _call(weakref.ref(self), method, u)

    def _gather(self, u: H.Unit) -> None:
        """Gather `u` (or wait for its prefetch) and put the whole weights into
        its module, where forward and a recompute read them."""
        if u.state == "free":
            H.issue_gather(u, self.group)
        H.wait_gather(u, self._spans)
        for p in u.params:
            for mod, attr in p.slots:
                mod._parameters[attr] = p.leaf

    def _release(self, u: H.Unit) -> None:
        """Free `u`'s whole weights; its module holds the shards again."""
        for p in u.params:
            for mod, attr in p.slots:
                mod._parameters[attr] = p.shard
        H.free(u)

    def _prefetch(self, candidates) -> None:
        if self.prefetch:
            nxt = next((v for v in candidates if v.state == "free"), None)
            if nxt is not None:
                H.issue_gather(nxt, self.group)

    # -- backward ----------------------------------------------------------------

    def _pre_backward(self, u: H.Unit, grad):
        self._backward_started()
        if u.began and u.state == "full":  # a second output of the same unit
            return None
        first, u.began = not u.began, True
        self._spans.lap(f"backward {u.name}")
        self._fold()  # the last unit's reduce-scatter: its buffers go before this
        self._gather(u)  # unit's gradients arrive (a lower peak)
        if first:
            self._prefetch(v for v in self._order[::-1]
                           if not v.began and not v.reduced)
        self._spans.resume()
        return None

    def _post_backward(self, u: H.Unit) -> None:
        """The gradients of `u`'s inputs are computed: its backward is over. Send
        the gradients it got (a parameter that got none: not sent), free it."""
        self._spans.lap()
        self._reduce(u)
        if u.state != "free":
            H.wait_gather(u, self._spans)
            self._release(u)
        self._spans.resume()

    def _fold(self) -> None:
        for r in self._reductions:
            H.fold(r, self.world_size, self._spans)
        self._reductions = []


def _say_replicated(module, replicated) -> None:
    """Warn once, by name and size, about the parameters no unit shards."""
    names = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    parts = [f"{' = '.join(names[id(p)])} ({p.numel():,} elements, "
             f"{p.numel() * p.element_size():,} B)" for p in replicated]
    total = sum(p.numel() * p.element_size() for p in replicated)
    warnings.warn(
        f"FullyShardedDataParallel: {len(replicated)} parameter(s) of no unit stay "
        f"whole on every rank, {total:,} B: {', '.join(parts)}. root=True (the "
        "default) shards them in the root unit", stacklevel=3)


def _unique_parameters(module):
    return list({id(p): p for _, p in module.named_parameters()}.values())


def _call(ref, method: str, u):
    """A hook that calls `method` of the wrapper if it still lives."""
    def hook(*args, **kwargs):
        f = ref()
        if f is not None:
            return getattr(f, method)(u, *args, **kwargs)
    return hook
