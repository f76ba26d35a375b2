"""FSDP's parts, as plain data and functions with explicit arguments: a sharded
parameter, a unit (the parameters a wrapped module gathers together), the unit's
all-gather and reduce-scatter, and `after_backward`, which tells when a unit's
backward is over. Imports torch, labkit.probe and parallel.reduce_scatter.

The gathered parameter's storage is freed by resizing it to 0 bytes and refilled
before backward: autograd saved views of it in forward, and those views see the
refilled storage (docs/design.md: FSDP).
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from labkit.parallel.reduce_scatter import send_chunks, sum_chunks
from labkit.probe import Spans, completed_at, count_as


def assign(module: torch.nn.Module, wrap, root: bool = True):
    """Which unit owns which parameter: [(path, module, [(names, slots, p)])] for
    the modules `wrap` selects (and, with root=True, `module` itself), in module
    order, and the replicated parameters. A parameter belongs to the innermost
    selected module holding every module that registers it (a tied weight: their
    common ancestor, if selected); with root=True the root holds every one, so
    none is replicated."""
    regs = defaultdict(list)  # id(p) -> [(name, module path, module, attribute)]
    params = {}
    for path, mod in module.named_modules():
        for attr, p in mod._parameters.items():
            if p is not None:
                regs[id(p)].append((f"{path}.{attr}" if path else attr, path, mod,
                                    attr))
                params[id(p)] = p
    selected = [(path, m) for path, m in module.named_modules()
                if (root and path == "") or wrap(m)]
    owned, replicated = defaultdict(list), []
    for key, rs in regs.items():
        holders = [path for path, _ in selected
                   if all(_inside(r[1], path) for r in rs)]
        if holders:
            owned[max(holders, key=len)].append(
                ([r[0] for r in rs], [(r[2], r[3]) for r in rs], params[key]))
        else:
            replicated.append(params[key])
    return [(path, m, owned[path]) for path, m in selected if owned[path]], \
        replicated


def _inside(path: str, ancestor: str) -> bool:
    return ancestor == "" or path == ancestor or path.startswith(ancestor + ".")


@dataclass(eq=False)
class Sharded:
    """One parameter, flattened, zero-padded to N*s elements; this rank keeps
    elements [r*s, (r+1)*s) as `shard`, the nn.Parameter the module holds."""

    names: list  # every name it is registered under (tied: more than one)
    slots: list  # (module, attribute) of each registration
    shape: torch.Size
    numel: int
    s: int
    shard: torch.nn.Parameter  # (s,) fp32
    full: torch.Tensor  # (N*s,) compute dtype; 0 bytes while not gathered
    leaf: torch.Tensor  # full[:numel] in `shape`: what forward sees

    @property
    def trainable(self) -> bool:
        return self.shard.requires_grad


def make_sharded(names, slots, p: torch.Tensor, n: int, r: int,
                 dtype: torch.dtype) -> Sharded:
    numel = p.numel()
    s = math.ceil(numel / n)
    padded = p.detach().new_zeros(n * s)
    padded[:numel] = p.detach().reshape(-1)
    shard = torch.nn.Parameter(padded[r * s:(r + 1) * s].clone(),
                               requires_grad=p.requires_grad)
    full = torch.empty(n * s, dtype=dtype, device=p.device)
    stride = torch.empty(p.shape, device="meta").stride()
    leaf = torch.empty(0, dtype=dtype, device=p.device).set_(
        full.untyped_storage(), 0, p.shape, stride)
    leaf.requires_grad_(p.requires_grad)
    full.untyped_storage().resize_(0)
    return Sharded(list(names), list(slots), p.shape, numel, s, shard, full, leaf)


@dataclass(eq=False)
class Unit:
    """The parameters one wrapped module gathers before its forward and backward."""

    name: str
    module: torch.nn.Module
    params: list
    state: str = "free"  # "free", "gathering" (async, in flight), "full"
    works: list = field(default_factory=list)
    flats: list = field(default_factory=list)  # (params, flat) per all-gather
    issued: float = 0.0
    done: object = None  # future of the completion time
    ran: bool = False  # its forward ran in this forward
    began: bool = False  # its backward began in this backward
    got: set = field(default_factory=set)  # ids of leaves whose gradient arrived
    reduced: bool = False  # its gradients were sent in this backward

    @property
    def trainable(self) -> list:
        return [p for p in self.params if p.trainable]


def _by_dtype(params: list, dtype_of) -> list:
    """[[params of one dtype], ...], in order of first appearance: one flat
    buffer each (a unit's parameters share one dtype but for odd models)."""
    groups: dict = {}
    for p in params:
        groups.setdefault(dtype_of(p), []).append(p)
    return list(groups.values())


def issue_gather(u: Unit, group) -> None:
    """Start (async_op=True) the all-gather of `u`: its shards, cast to the
    compute dtype, side by side in this rank's chunk of one flat buffer of
    N x S elements; `wait_gather` completes it and copies each parameter out."""
    u.issued = time.perf_counter()
    n, r = dist.get_world_size(group), dist.get_rank(group)
    u.works, u.flats = [], []
    for ps in _by_dtype(u.params, lambda p: p.full.dtype):
        size = sum(p.s for p in ps)
        flat = torch.empty(n * size, dtype=ps[0].full.dtype,
                           device=ps[0].full.device)
        count_as(flat, "Parameter")  # the unit's parameters, being gathered
        mine = flat[r * size:(r + 1) * size]  # the input is the output's chunk,
        torch.cat([p.shard.detach() for p in ps], out=mine)  # as FSDP2's (cast)
        u.works.append(dist.all_gather_single(flat, mine, group=group,
                                              async_op=True))
        u.flats.append((ps, flat))
    futures = torch.futures.collect_all([w.get_future() for w in u.works])
    u.done = futures.then(completed_at)
    u.state = "gathering"


def wait_gather(u: Unit, spans: Spans) -> None:
    """Wait for `u`'s all-gather; copy each parameter into its `full` and free
    the flat buffer."""
    if u.state != "gathering":
        return
    for w in u.works:
        w.wait()
    nbytes = sum(flat.nbytes for _, flat in u.flats)
    spans.comm(f"all_gather {u.name}", u.issued, u.done.wait(), nbytes)
    for ps, flat in u.flats:
        for p in ps:  # a parameter while it is whole: tagged before it grows, so
            count_as(p.full, "Parameter")  # its bytes are never seen as another
            p.full.untyped_storage().resize_(p.full.numel() * p.full.element_size())
        n = flat.numel() // sum(p.s for p in ps)
        torch.split_with_sizes_copy(flat.view(n, -1), [p.s for p in ps], dim=1,
                                    out=[p.full.view(n, p.s) for p in ps])
        flat.untyped_storage().resize_(0)  # the unit is held once: in its fulls
    # copying out, the unit is whole twice for a moment (flat and fulls), as in
    # FSDP2 (its all-gather output and its unsharded parameters)
    u.works, u.flats, u.done, u.state = [], [], None, "full"


def free(u: Unit) -> None:
    for p in u.params:
        p.full.untyped_storage().resize_(0)
    u.state = "free"


@dataclass(eq=False)
class Reduction:
    """One unit's reduce-scatter in flight: its parameters, sent, received, when."""

    params: list  # the Sharded sent, in the order of the buffer's columns
    send: torch.Tensor
    got: torch.Tensor
    work: object
    done: object
    issued: float
    name: str


def launch_reduce(params: list, group, n: int, name: str) -> list:
    """Send the full gradients of `params` (each zero-padded to N*s), rank i's
    piece of each one, side by side, to rank i: one all-to-all (per dtype); free
    them. Only parameters that have one: one without is not sent (fsdp.py)."""
    out = []
    for ps in _by_dtype(params, lambda p: p.leaf.grad.dtype):
        send = torch._chunk_cat([p.leaf.grad.reshape(-1) for p in ps], 0, n)
        for p in ps:
            p.leaf.grad = None
        # copies made to move the gradients: buffers, Temp (the ledger's rule);
        # the gradient is what fold() leaves in each shard's .grad
        count_as(send, "Temp")
        t0 = time.perf_counter()
        got, work = send_chunks(send.view(-1), group, category="Temp", async_op=True)
        out.append(Reduction(ps, send, got, work,
                             work.get_future().then(completed_at), t0, name))
    return out


@torch.no_grad()
def fold(r: Reduction, n: int, spans: Spans) -> None:
    """Wait; average the N pieces received, in fp32, into this rank's shard.grad
    of each parameter sent."""
    r.work.wait()
    spans.comm(f"reduce_scatter {r.name}", r.issued, r.done.wait(), r.send.nbytes)
    summed = sum_chunks(r.got, n, average=True, dtype=torch.float32)
    for p, mine in zip(r.params, summed.split([p.s for p in r.params])):
        shard = p.shard
        if shard.grad is None:
            shard.grad = mine
        else:
            shard.grad += mine
        count_as(shard.grad, "Gradient")
    r.send = r.got = r.work = r.done = None


class _AfterBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once the gradients of those
    inputs are computed, so the unit's own backward is over (PyTorch's FSDP2 does
    the same: RegisterPostBackwardFunction)."""

    @staticmethod
    def forward(ctx, callback, *tensors):
        ctx.callback = callback
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)


def after_backward(args, kwargs, callback):
    """(args, kwargs) with every tensor that requires grad passed through one
    _AfterBackward: `callback()` runs when the module's backward is over. None
    requires grad (token ids into the root): unchanged, no call."""
    flat, spec = tree_flatten((args, kwargs))
    at = [i for i, t in enumerate(flat)
          if isinstance(t, torch.Tensor) and t.requires_grad]
    if not at:
        return args, kwargs
    for i, t in zip(at, _AfterBackward.apply(callback, *(flat[i] for i in at))):
        flat[i] = t
    return tree_unflatten(flat, spec)


def cast_floating(tree, dtype: torch.dtype):
    """Every floating tensor in `tree` (args, kwargs) as `dtype`."""
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor)
                    and t.is_floating_point() else t, tree)


def cast_replicated(module: torch.nn.Module, replicated, dtype: torch.dtype) -> list:
    """compute_dtype for modules holding replicated parameters (a LayerNorm left
    out of `wrap`): during their forward, their floating inputs and their own
    floating parameters are cast copies, so they compute in `dtype` like the
    units; autograd casts each gradient back to the fp32 parameter, which is put
    back after forward. Returns the hook handles."""
    ids = {id(p) for p in replicated if p.is_floating_point()}
    handles = []
    for mod in module.modules():
        attrs = [a for a, p in mod._parameters.items() if p is not None
                 and id(p) in ids]
        if not attrs:
            continue
        kept: dict[str, torch.nn.Parameter] = {}

        def pre(m, args, kwargs, attrs=attrs, kept=kept):
            for a in attrs:
                kept[a] = m._parameters[a]
                m._parameters[a] = kept[a].to(dtype)
            return cast_floating(args, dtype), cast_floating(kwargs, dtype)

        def post(m, args, out, attrs=attrs, kept=kept):
            for a in attrs:
                if a in kept:
                    m._parameters[a] = kept.pop(a)

        handles += [mod.register_forward_pre_hook(pre, with_kwargs=True),
                    mod.register_forward_hook(post, always_call=True)]
    return handles
