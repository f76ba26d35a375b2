"""DiLoCo (Douillard et al. 2023) and Streaming DiLoCo (Douillard et al. 2025): hosts
train apart for H inner steps, then meet in one outer step on the pseudo-gradient.

    opt = torch.optim.AdamW(model.parameters())   # the inner optimizer
    diloco = DiLoCo(model, opt, sync_every=H, host_group=my_host)  # inner DP group
    opt.zero_grad(); loss_fn(model(x), y).backward(); diloco.step()

Imports labkit.parallel's guards and reduce_scatter, and labkit.probe. A step
sends DDP's all-reduce inside the host; every H steps one all-reduce of Δ over all.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from labkit.arguments import whole
from labkit.parallel import guards
from labkit.parallel.reduce_scatter import send_chunks, sum_chunks
from labkit.probe import count_as, phase

BITS = (4, 8)  # quantised outer all-reduce: 8-bit codes, or 4-bit two to a byte


@dataclass(eq=False)
class _Fragment:
    """A contiguous run of the model's parameters, synced on its own schedule."""

    index: int
    names: list[str]
    params: list[torch.nn.Parameter]
    start: torch.Tensor  # θ_start: flat (n,), fp32 (or wider), what the hosts agree on
    momentum: torch.Tensor  # the outer optimizer's momentum buffer, (n,)


class DiLoCo(torch.nn.Module):
    """Inner data parallelism within each host, an outer Nesterov step across all.

    Every `step()`: the host's ranks average their gradients (one all-reduce over
    `host_group`, as DDP's) and `inner_optimizer` steps; the host's replicas stay
    identical. Every `sync_every` (H) inner steps, the outer step: the
    pseudo-gradient Δ = θ_start − θ is averaged over `outer_group` (default: all
    ranks) by one all-reduce, and outer SGD with Nesterov momentum (the paper's
    lr 0.7, momentum 0.9) steps θ_start with Δ as its gradient; every rank then
    continues from θ_start. So the outer bytes per inner step are DDP's ÷ H.

    num_fragments F > 1 is Streaming DiLoCo: the parameters split into F
    contiguous runs in model order, balanced by numel; fragment f syncs at the
    inner steps where (step − (f+1)·H/F) % H == 0 (torchft's order: fragment 0
    first, H/F steps in), with its own θ_start and momentum, so the most bytes
    one step sends are ÷ F. bits (4 or 8) sends Δ
    quantised (see `quantized_average`). Parameters and buffers are broadcast
    from the outer group's rank 0 at construction, as DataParallel does.
    """

    INNER_PHASE = "DiLoCo: gradients averaged in the host"  # the traffic ledger's
    OUTER_PHASE = "DiLoCo: outer step"  # phases, to tell the two apart

    def __init__(self, module: torch.nn.Module, inner_optimizer: torch.optim.Optimizer,
                 *, sync_every: int, num_fragments: int = 1, bits: int | None = None,
                 block: int = 64, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 host_group: dist.ProcessGroup | None = None,
                 outer_group: dist.ProcessGroup | None = None):
        super().__init__()
        _check_schedule(sync_every, num_fragments)
        _check_quantization(bits, block)
        if not 0 <= outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got "
                             f"{outer_momentum!r}")
        guards.require_process_group("DiLoCo")
        self.module, self.inner_optimizer = module, inner_optimizer
        self.sync_every, self.num_fragments = sync_every, num_fragments
        self.bits, self.block = bits, block
        self.outer_lr, self.outer_momentum = outer_lr, outer_momentum
        self.host_group = host_group  # None: every rank is a host of its own
        self.outer_group = outer_group if outer_group is not None else dist.group.WORLD
        self.dp_rank = dist.get_rank(host_group) if host_group is not None else 0
        self.dp_size = dist.get_world_size(host_group) if host_group is not None else 1
        self.outer_rank = dist.get_rank(self.outer_group)
        self.outer_size = dist.get_world_size(self.outer_group)
        _check_groups(host_group, self.outer_group)
        guards.check_devices(module, self.outer_group, "DiLoCo")

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("DiLoCo: the module has no trainable parameters")
        if len({p.dtype for _, p in named}) > 1:
            raise ValueError("DiLoCo: the trainable parameters must share one dtype "
                             "(their gradients travel in one flat buffer)")
        _check_optimizer(inner_optimizer, named)
        runs = split_evenly([p.numel() for _, p in named], num_fragments)
        with torch.no_grad():  # every rank starts from the outer group's rank 0
            for t in [p for _, p in module.named_parameters()] + list(module.buffers()):
                dist.broadcast(t, group=self.outer_group, group_src=0)
        self._params = [p for _, p in named]
        self.param_ids = frozenset(id(p) for p in self._params)
        wide = torch.promote_types(self._params[0].dtype, torch.float32)
        self._fragments = []
        for i, (a, b) in enumerate(runs):
            start = _flat([p for _, p in named[a:b]], wide)  # θ_start: a copy
            count_as(start, "Optstate")
            momentum = torch.zeros_like(start)
            count_as(momentum, "Optstate")
            self._fragments.append(_Fragment(i, [n for n, _ in named[a:b]],
                                             [p for _, p in named[a:b]],
                                             start, momentum))
        self._inner_steps = 0
        self._inside_step = False  # our own inner_optimizer.step() is running
        guards.track(self)  # a bare inner_optimizer.step() is refused
        self._finalizer = weakref.finalize(self, guards.release, [])

    # -- public ------------------------------------------------------------------

    @property
    def inner_steps(self) -> int:
        """Inner steps done so far (step() calls)."""
        return self._inner_steps

    @property
    def fragments(self) -> list[list[str]]:
        """The parameter names of each fragment, in model order."""
        return [list(f.names) for f in self._fragments]

    def fragment_at(self, step: int) -> int | None:
        """The fragment whose outer step runs after inner step `step` (1, 2, ...),
        or None: f where (step − (f+1)·H/F) % H == 0. Fragments take turns every
        H/F steps, so at most one syncs in a step; with F = 1, every H steps."""
        every = self.sync_every // self.num_fragments
        if step < 1 or step % every:
            return None
        return (step // every - 1) % self.num_fragments

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def step(self) -> int | None:
        """One inner step: average the gradients over the host, step the inner
        optimizer; then, if its turn has come, one fragment's outer step. Call
        it where you would call optimizer.step(), on every rank. Returns the
        fragment that synced, or None."""
        self._average_gradients()
        self._inside_step = True
        try:
            self.inner_optimizer.step()
        finally:
            self._inside_step = False
        self._inner_steps += 1
        f = self.fragment_at(self._inner_steps)
        if f is not None:
            self._outer_step(self._fragments[f])
        return f

    def step_problem(self) -> str | None:
        """Why a step of an optimizer over these parameters is wrong now: any
        step but the one diloco.step() makes."""
        if self._inside_step:
            return None
        return ("DiLoCo: call diloco.step(), not the inner optimizer's step(): it "
                f"first averages the gradients over the host's {self.dp_size} "
                "ranks, and counts the inner steps to the next outer step")

    def close(self) -> None:
        """Stop checking optimizer steps (also done when it is collected)."""
        guards.forget(self)
        self._finalizer()

    def extra_repr(self) -> str:
        quantized = f", bits={self.bits}, block={self.block}" if self.bits else ""
        return (f"sync_every={self.sync_every}, num_fragments={self.num_fragments}"
                f"{quantized}, outer_lr={self.outer_lr}, "
                f"outer_momentum={self.outer_momentum}, dp_size={self.dp_size}, "
                f"outer_size={self.outer_size}")

    # -- the two steps -------------------------------------------------------------

    def _average_gradients(self) -> None:
        """The host's mean gradient on each of its ranks: one all-reduce of every
        gradient in one flat buffer (a missing one goes as zeros, stays None)."""
        grads = [p.grad for p in self._params]
        if all(g is None for g in grads):
            raise RuntimeError("DiLoCo: step() before backward(): no parameter has "
                               "a gradient")
        if self.dp_size == 1:
            return
        flat = torch.cat([torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
                          if g is None else g.reshape(-1)
                          for p, g in zip(self._params, grads)])
        count_as(flat, "Temp")
        with phase(self.INNER_PHASE):
            dist.all_reduce(flat, group=self.host_group)
        flat.div_(self.dp_size)  # sum -> mean: each rank's loss is a mean
        for g, piece in zip(grads, flat.split([p.numel() for p in self._params])):
            if g is not None:
                g.copy_(piece.view_as(g))

    def _outer_step(self, frag: _Fragment) -> None:
        delta = frag.start - _flat(frag.params, frag.start.dtype)  # Δ = θ_start − θ
        count_as(delta, "Temp")
        with phase(self.OUTER_PHASE):
            if self.bits is None:  # the all-reduce DDP issues, once per sync
                dist.all_reduce(delta, group=self.outer_group)
                delta.div_(self.outer_size)
            else:
                delta = quantized_average(delta, self.bits, self.outer_group,
                                          block=self.block)
        # outer SGD with Nesterov momentum, as torch.optim.SGD(nesterov=True):
        # m ← μm + Δ;  θ_start ← θ_start − lr·(Δ + μm)
        mu = self.outer_momentum
        frag.momentum.mul_(mu).add_(delta)
        frag.start.add_(delta.add(frag.momentum, alpha=mu), alpha=-self.outer_lr)
        at = 0  # every rank continues from the new θ_start
        for p in frag.params:
            p.copy_(frag.start[at:at + p.numel()].view_as(p))
            at += p.numel()


# -- the quantised all-reduce --------------------------------------------------------


def quantized_average(x: torch.Tensor, bits: int, group=None, *,
                      block: int = 64) -> torch.Tensor:
    """The average of the 1-D `x` over `group`'s ranks, sent as `bits`-bit codes.

    An all-reduce made of a reduce-scatter (an all-to-all of quantised chunks;
    each rank sums the N it gets, in rank order) and an all-gather of each rank's
    reduced chunk, quantised again. Codes are symmetric, q = 2^(b−1) − 1 levels
    each side of 0 (127 or 7), with one fp32 scale, max|x|/q, per `block` values.
    A rank sends 2(N−1)/N·(m·b/8 + 4m/block) bytes (m: x padded to N whole
    blocks a rank): fp32's all-reduce × b/32, plus the scales. What is lost:
    each value is rounded to its block's nearest level twice (before the
    exchange, and the reduced chunk before the all-gather), up to half a level,
    max|block|/2q, each time. Every rank gets the same fp32 result, bit for bit.
    """
    _check_quantization(bits, block)
    n = dist.get_world_size(group)
    k = x.numel()
    c = -(-k // (n * block)) * block  # values in each rank's chunk: whole blocks
    padded = x.new_zeros(n * c, dtype=torch.float32)
    padded[:k] = x.reshape(-1)
    # reduce-scatter: chunk j of every rank goes, quantised, to rank j
    send = torch.cat([_quantize(chunk, bits, block) for chunk in padded.view(n, c)])
    count_as(send, "Temp")
    got, _ = send_chunks(send, group, category="Temp")  # (n·L,) bytes, rank 0's first
    pieces = torch.cat([_dequantize(p, bits, block) for p in got.view(n, -1)])
    mine = sum_chunks(pieces, n, average=True)  # (c,) this rank's chunk of the mean
    # all-gather: every rank's reduced chunk, quantised once more
    piece = _quantize(mine, bits, block)
    gathered = piece.new_empty(n * piece.numel())
    count_as(gathered, "Temp")
    dist.all_gather_single(gathered, piece, group=group)
    out = torch.cat([_dequantize(p, bits, block) for p in gathered.view(n, -1)])
    return out[:k]


def _quantize(x: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """x (whole blocks, fp32) -> bytes: its codes (b bits each), then its scales."""
    q = 2 ** (bits - 1) - 1
    blocks = x.view(-1, block)
    scale = blocks.abs().amax(dim=1) / q  # one fp32 scale a block
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # all-zero block
    codes = torch.round(blocks / safe[:, None]).clamp_(-q, q).to(torch.int8)
    if bits == 8:
        packed = codes.view(torch.uint8).reshape(-1)
    else:  # 4 bits: code + 8 in 1..15, two to a byte (low nibble first)
        u = (codes.reshape(-1) + 8).to(torch.uint8)
        packed = u[0::2] | (u[1::2] << 4)
    return torch.cat([packed, scale.view(torch.uint8)])


def _dequantize(data: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """_quantize's bytes -> the values they stand for (fp32)."""
    # bytes = values·b/8 + 4·values/block
    values = data.numel() * 8 * block // (bits * block + 32)
    codes_bytes = values * bits // 8
    scale = data[codes_bytes:].view(torch.float32)
    packed = data[:codes_bytes]
    if bits == 8:
        codes = packed.view(torch.int8)
    else:
        codes = torch.stack([packed & 15, packed >> 4], dim=1).reshape(-1)
        codes = codes.to(torch.int8) - 8
    return (codes.to(torch.float32).view(-1, block) * scale[:, None]).reshape(-1)


# -- helpers ---------------------------------------------------------------------


def split_evenly(sizes: list[int], parts: int) -> list[tuple[int, int]]:
    """Cut a list of sizes into `parts` contiguous runs [a, b) of at least one
    item each, whose sums are as close as whole items allow to sum/parts: each
    cut falls where the running sum is nearest k·sum/parts."""
    if parts > len(sizes):
        raise ValueError(f"cannot split {len(sizes)} parameters into {parts} "
                         "fragments: a fragment holds at least one parameter")
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    cuts = [0]
    for k in range(1, parts):
        target = k * prefix[-1] / parts
        first, last = cuts[-1] + 1, len(sizes) - (parts - k)  # room for the rest
        cuts.append(min(range(first, last + 1), key=lambda i: abs(prefix[i] - target)))
    cuts.append(len(sizes))
    return list(zip(cuts[:-1], cuts[1:]))


def _flat(params, dtype: torch.dtype) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).to(dtype) for p in params])


def _check_schedule(sync_every, num_fragments) -> None:
    whole(sync_every, "sync_every (H, inner steps between outer steps)")
    whole(num_fragments, "num_fragments")
    if num_fragments > sync_every or sync_every % num_fragments:
        raise ValueError(
            f"num_fragments = {num_fragments} must divide sync_every = {sync_every}: "
            "the fragments take turns every sync_every/num_fragments inner steps, "
            "one at a time")


def _check_quantization(bits, block) -> None:
    if bits is not None and bits not in BITS:
        raise ValueError(f"bits must be one of {BITS} (or None: fp32), got {bits!r}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 8 or block % 8:
        raise ValueError(f"block (values per scale) must be a positive multiple of "
                         f"8, got {block!r}")


def _check_groups(host_group, outer_group) -> None:
    if host_group is None:
        return
    host = dist.get_process_group_ranks(host_group)
    outer = dist.get_process_group_ranks(outer_group)
    stray = sorted(set(host) - set(outer))
    if stray:
        raise ValueError(f"DiLoCo: host_group's ranks {stray} are not in outer_group "
                         f"{outer}: every host's ranks take part in the outer step")


def _check_optimizer(opt: torch.optim.Optimizer, named) -> None:
    mine = {id(p) for _, p in named}
    stray = [tuple(p.shape) for g in opt.param_groups for p in g["params"]
             if id(p) not in mine]
    if stray:
        raise ValueError(f"DiLoCo: the inner optimizer steps {len(stray)} tensors "
                         f"that are not the module's trainable parameters (shapes "
                         f"{stray[:4]}): build it over module.parameters()")
