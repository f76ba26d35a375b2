"""Fully sharded data parallelism (全分片数据并行), ZeRO stage 3, as PyTorch's FSDP2
(`fully_shard`): each of N ranks keeps 1/N of every parameter, its gradient and
its optimizer state; a unit (a wrapped module) gathers its parameters just before
it computes and frees them right after. The whole wrapper is this one class: its
forward and recompute hooks, its backward, its gradient accumulation.

Imports torch, labkit.probe and parallel's fsdp_units (a sharded parameter, a
unit, the all-gather and reduce-scatter), guards. A forward that runs inside a
backward is an activation checkpoint's recompute (docs/design.md: FSDP).
"""

from __future__ import annotations

import contextlib
import warnings
import weakref

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

from labkit.parallel import fsdp_units as H
from labkit.parallel import guards
from labkit.probe import Span, Spans, count_as, in_backward


def has_own_parameters(m: torch.nn.Module) -> bool:
    """The default `wrap`: a module with parameters of its own."""
    return any(True for _ in m.parameters(recurse=False))


class FullyShardedDataParallel(torch.nn.Module):
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
        guards.require_process_group("FullyShardedDataParallel")
        if compute_dtype is not None and not compute_dtype.is_floating_point:
            raise ValueError(f"compute_dtype must be a floating dtype (e.g. "
                             f"torch.bfloat16), not {compute_dtype}")
        self.module, self.prefetch = module, prefetch
        self.compute_dtype = compute_dtype
        self.group = group if group is not None else dist.group.WORLD
        self.dp_rank = dist.get_rank(self.group)
        self.dp_size = n = dist.get_world_size(self.group)
        guards.check_devices(module, self.group, "FullyShardedDataParallel")

        with torch.no_grad():  # every rank starts from rank 0's state
            for t in [*_unique_parameters(module), *module.buffers()]:
                dist.broadcast(t, group=self.group, group_src=0)
        owned, self._replicated = H.assign(module, wrap or has_own_parameters, root)
        self.sharded_units: list[H.Unit] = []
        for path, m, plist in owned:
            sharded = []
            for names, slots, p in plist:
                sh = H.make_sharded(names, slots, p, n, self.dp_rank,
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
        self._sync = True  # each backward reduce-scatters (set_requires_gradient_sync)
        self._held: dict[H.Sharded, torch.Tensor] = {}  # whole fp32 gradients, sync off
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
        """The wrapped module's forward: each unit gathers its parameters in its
        pre-forward hook and frees them after (the root's stay whole until its
        backward); a unit prefetched but never run is freed at the end."""
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
                    f"reduce-scattered over the {self.dp_size} ranks")
        return None

    def set_requires_gradient_sync(self, requires: bool) -> None:
        """False: the next backwards keep each unit's whole gradient (fp32,
        summed across backwards) and send nothing; True (the default): each
        backward reduce-scatters, the held sums included. finish sends what is
        still held. Every rank must set the same."""
        self._sync = bool(requires)

    @contextlib.contextmanager
    def no_sync(self):
        """`with fsdp.no_sync(): loss.backward()`: that backward sends nothing."""
        before, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = before

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
                p.grad.div_(self.dp_size)
        self._pending = False
        self._backward.reset()

    @torch.no_grad()
    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """{name: the whole parameter, fp32, original shape} for every name
        (tied weights under each of theirs). Collective: call it on every rank."""
        out = {}
        for u in self.sharded_units:
            for p in u.params:
                full = p.shard.new_empty(self.dp_size * p.s)
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
                f"dp_size={self.dp_size}, prefetch={self.prefetch}, "
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

    def _pre_forward(self, u: H.Unit, module, args, kwargs):
        recompute = in_backward()  # activation checkpointing
        self._spans.lap(f"{'recompute' if recompute else 'forward'} {u.name}")
        if u not in self._order:
            self._order.append(u)
        self._gather(u)
        later = self._order[self._order.index(u) + 1:]
        if recompute:  # the units after it in forward order that backward needs
            self._prefetch(v for v in later if not v.began and not v.reduced)
        else:
            u.ran = True
            self._stack.append(u)
            self._prefetch(v for v in later if not v.ran)
        self._spans.resume()
        if self.compute_dtype is not None:
            args, kwargs = (H.cast_floating(args, self.compute_dtype),
                            H.cast_floating(kwargs, self.compute_dtype))
        if torch.is_grad_enabled():  # its backward is over once its inputs' is
            args, kwargs = H.after_backward(args, kwargs,
                                            self._hook("_post_backward", u))
        return args, kwargs

    def _post_forward(self, u: H.Unit, module, args, out):
        self._spans.lap()
        if in_backward():
            # a recompute: its backward follows, so it stays gathered until that
            # is over (a non-reentrant recompute that stops early never gets here)
            self._spans.rename("backward")
        else:
            self._stack.remove(u)
            self._release(u)
            self._spans.rename(f"forward {self._stack[-1].name}" if self._stack
                               else "(outside units)")
        if torch.is_grad_enabled():  # its output's gradient: its backward is next
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._hook("_pre_backward", u))
        self._spans.resume()

    # -- backward ----------------------------------------------------------------

    def _backward_started(self, _=None, grad=None) -> None:
        """Called by every backward hook; acts once per backward. A reentrant
        checkpoint runs a backward (a new graph task) inside ours: part of it."""
        if self._backward.seen() or not self._backward.enter():  # inside ours
            return
        self._pending = True
        for u in self.sharded_units:
            u.began, u.got, u.reduced = False, set(), False
        self._spans.start("backward")

    def _backward_ended(self) -> None:
        """The outermost graph task ended: send and free what is still due."""
        self._spans.stop()
        for u in self.sharded_units:  # a unit whose backward never said it was over
            if any(p.leaf.grad is not None for p in u.trainable):
                self._reduce(u)
            H.wait_gather(u, self._spans)
            if u.state == "full":
                self._release(u)


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

    def _grad_ready(self, u: H.Unit, leaf) -> None:
        """A gradient of `u` is in (post-accumulate-grad): with sync off, hold it;
        once the unit has every one, send them."""
        self._spans.lap()
        u.got.add(id(leaf))
        if not self._sync:  # hold it, whole, in fp32: sent in a later backward
            p = next(p for p in u.trainable if p.leaf is leaf)
            with torch.no_grad():
                if p in self._held:
                    self._held[p].add_(leaf.grad)
                else:
                    self._held[p] = leaf.grad.to(torch.float32)
            count_as(self._held[p], "Gradient")
            leaf.grad = None
        if len(u.got) == len(u.trainable):  # every one: send them now
            self._reduce(u)
            if len(u.trainable) == len(u.params):  # no frozen one still needed
                self._release(u)  # before the reduce-scatter allocates: a lower
        self._spans.resume()  # peak

    @torch.no_grad()
    def _reduce(self, u: H.Unit, force: bool = False) -> None:
        """Reduce-scatter the gradients `u`'s parameters have, with what was held
        for them (each rank has the same ones, in the same order: see fsdp.py's
        docstring); with sync off, nothing (finish: force)."""
        u.reduced = True
        if not (self._sync or force):
            return
        for p in u.trainable:  # the held sum and this backward's, as one
            held = self._held.pop(p, None)
            if held is not None:
                if p.leaf.grad is not None:
                    held.add_(p.leaf.grad)
                p.leaf.grad = held.to(p.full.dtype)  # on the wire as forward's
        send = [p for p in u.trainable if p.leaf.grad is not None]
        if not send:
            return
        self._fold()  # at most one unit's reduce-scatter in flight
        self._reductions = H.launch_reduce(send, self.group, self.dp_size,
                                           u.name)

    def _send_held(self) -> None:
        """finish: send what set_requires_gradient_sync(False) still holds."""
        for u in self.sharded_units:  # unit order: the same on every rank
            if any(p in self._held for p in u.trainable):
                self._reduce(u, force=True)

    def _fold(self) -> None:
        for r in self._reductions:
            H.fold(r, self.dp_size, self._spans)
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
