"""Data parallelism (数据并行), torch.nn.parallel.DistributedDataParallel's algorithm:
every rank holds the whole model, runs its share of the batch, and the ranks
average their gradients before the optimizer step.

    dp = DataParallel(model)                # rank 0's weights on every rank
    loss_fn(dp(x), y).backward()            # overlap: all-reduces start here
    dp.finish_gradient_synchronization(); opt.step()    # wait and average; step

Imports labkit.parallel's guards and buckets, and labkit.probe. Unlike
DDP, the average is awaited by that explicit call, not at the end of backward.
"""

from __future__ import annotations

import time
import weakref
from contextlib import contextmanager
from functools import partial

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

from labkit.parallel import guards
from labkit.parallel.buckets import Bucket, fill, pack_bits, unpack_bits
from labkit.probe import Span, Spans, completed_at, count_as, phase


class DataParallel(torch.nn.Module):
    """Average gradients of `module` over the ranks of `group` (default: all).

    torch.nn.parallel.DistributedDataParallel's algorithm (one process per rank,
    all-reduces overlapped with backward), not torch.nn.DataParallel's
    single-process one; unlike DDP, finish_gradient_synchronization() waits for
    the average, buckets default to one per parameter, and a parameter no rank
    used is allowed.

    Parameters and buffers are broadcast from rank 0 at construction; tied
    weights are synced once, frozen ones never. bucket_mib: None sends one
    collective per parameter; else parameters, in reverse registration order
    (about the order backward produces them), fill buckets of about bucket_mib MiB;
    first_bucket_mib caps the first one (DDP's defaults: 25 and 1).
    broadcast_buffers: send rank 0's buffers at every forward, as DDP does.
    `events` holds this step's compute and communication spans (labkit.probe's
    Span; the usage check's all-gather is not among them). `mode` is one of MODES.
    """

    MODES = ("overlap", "naive", "parameter_server")
    # the traffic ledger's phase for the usage check: an all-gather of a bitmask of
    # the parameters each rank's backward reached, ceil(P/8) bytes a rank
    CHECK_PHASE = "DataParallel: same parameters used on every rank"

    def __init__(self, module: torch.nn.Module, bucket_mib: float | None = None,
                 mode: str = "overlap", *, broadcast_buffers: bool = False,
                 group: dist.ProcessGroup | None = None,
                 first_bucket_mib: float | None = None):
        super().__init__()
        guards.positive_mib(first_bucket_mib, "first_bucket_mib", "no cap of its own")
        if mode not in self.MODES:
            raise ValueError(f"mode must be one of {self.MODES}, not {mode!r}")
        guards.positive_mib(bucket_mib, "bucket_mib", "one collective per parameter")
        guards.require_process_group("DataParallel")
        self.module, self.mode, self.bucket_mib = module, mode, bucket_mib
        self.broadcast_buffers = broadcast_buffers
        self.group = group if group is not None else dist.group.WORLD
        self.dp_rank = dist.get_rank(self.group)
        self.dp_size = dist.get_world_size(self.group)
        guards.check_devices(module, self.group, "DataParallel")

        unique: dict[int, tuple[str, torch.nn.Parameter]] = {}  # tied: synced once
        for name, p in module.named_parameters(remove_duplicate=False):
            unique.setdefault(id(p), (name, p))
        with torch.no_grad():  # every rank starts from rank 0's state
            for t in [p for _, p in unique.values()] + list(module.buffers()):
                dist.broadcast(t, group=self.group, group_src=0)
        trainable = [(n, p) for n, p in unique.values() if p.requires_grad]
        self.param_ids = frozenset(id(p) for _, p in trainable)
        cap = None if bucket_mib is None else bucket_mib * 2**20
        first = None if first_bucket_mib is None else first_bucket_mib * 2**20
        names = {id(p): n for n, p in trainable}
        self._buckets = [Bucket(i, ps, [names[id(p)] for p in ps]) for i, ps in
                         enumerate(fill([p for _, p in trainable[::-1]], cap, first))]
        self._names = [n for b in self._buckets for n in b.names]  # by index
        self._used = bytearray(len(self._names))  # backward reached it this step
        self._next = 0  # the next bucket to send (in order, as DDP)

        self._spans = Spans()  # this step's, for `events`
        self._pending = False  # backward made gradients not yet averaged
        self._sync = True  # False inside no_sync(): backward only accumulates
        self._accumulated = False  # a backward ran inside no_sync() since finish
        self._awaiting_weights = False  # parameter_server: step done, not sent
        self._backward = guards.Backward(self, "_backward_ended")
        ref = weakref.ref(self)  # hooks must not keep this wrapper alive
        params = [(b, p) for b in self._buckets for p in b.params]
        handles = [p.register_post_accumulate_grad_hook(partial(_on_grad, ref, b, i))
                   for i, (b, p) in enumerate(params)]
        guards.track(self)
        self._finalizer = weakref.finalize(self, guards.release, handles)

    # -- public ------------------------------------------------------------------

    @property
    def buckets(self) -> list[list[str]]:
        """Parameter names of each bucket, in the order backward fills them."""
        return [list(b.names) for b in self._buckets]

    @property
    def events(self) -> list[Span]:
        """This step's spans (this rank's clock); cleared when a new step starts."""
        return list(self._spans)

    def forward(self, *args, **kwargs):
        if self._awaiting_weights:
            raise RuntimeError(
                "parameter_server mode: call broadcast_parameters() after the "
                "server's optimizer.step(), before the next forward")
        if self.broadcast_buffers:
            with torch.no_grad():
                for t in self.module.buffers():
                    dist.broadcast(t, group=self.group, group_src=0)
        out = self.module(*args, **kwargs)
        if torch.is_grad_enabled():  # the first output gradient starts backward
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda grad: self._backward_started())
        return out

    @contextmanager
    def no_sync(self):
        """Backward inside this block adds this rank's gradients into `.grad` and
        sends nothing; the next backward outside it (then
        finish_gradient_synchronization()) averages the sum, once. Every rank
        must enter it for the same micro-batches."""
        was, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = was

    def step_problem(self) -> str | None:
        """Why an optimizer step on this wrapper's parameters would be wrong now."""
        if self._accumulated and not self._pending:
            return ("DataParallel: the gradients accumulated under no_sync() are "
                    "this rank's own; run the last micro-batch's backward outside "
                    "no_sync() and finish_gradient_synchronization() before "
                    "optimizer.step()")
        if self._pending:
            return ("DataParallel: call finish_gradient_synchronization() before "
                    "optimizer.step(): this rank's gradients are not yet averaged "
                    f"over the {self.dp_size} ranks")
        if self.mode == "parameter_server" and self.dp_rank != 0:
            return (f"DataParallel(mode='parameter_server'): rank {self.dp_rank} is a "
                    "worker; only rank 0, the server, calls optimizer.step(). "
                    "Workers call broadcast_parameters() to receive its weights.")
        return None

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        """Wait for every gradient's collective and average.

        overlap and naive: every rank then holds the mean gradient. In
        parameter_server mode only rank 0 (the server) does; the workers' grads
        become None, and every rank must call `broadcast_parameters()` after the
        server's `opt.step()`. Call it after each backward, on every rank;
        with no_sync(), after the backward outside it.

        Raises RuntimeError, on every rank, if the ranks' backwards (since the
        last finish) reached different parameters, naming them and the ranks;
        that step's gradients are then dropped (set to None).
        """
        if not self._sync:
            raise RuntimeError(
                "DataParallel: finish_gradient_synchronization() inside no_sync(): "
                "the backwards in it only accumulate this rank's gradients, there "
                "is nothing to average yet. Run the last micro-batch's backward "
                "after the with-block, then finish.")
        for b in self._buckets[self._next:]:  # naive, parameter_server, or a
            self._launch(b)  # bucket not complete in backward: the rest, in order
        check = self._issue_check()  # after every bucket, on every rank
        op = "gather" if self.mode == "parameter_server" else "all_reduce"
        try:
            for b in self._buckets:
                b.work.wait()
                self._spans.comm(f"{op} bucket {b.index}", b.issued, b.done.wait(),
                                 b.sent.nbytes)
                self._average(b)
            problem = self._usage_problem(*check) if check else None
        finally:
            for b in self._buckets:
                b.sent = b.gathered = b.work = b.done = None
                b.ready = 0
            self._used[:] = bytes(len(self._used))
            self._next = 0
            self._pending, self._accumulated = False, False
            self._backward.reset()
        if problem:
            for b in self._buckets:  # averaged with gradients that do not match
                for p in b.params:
                    p.grad = None
            raise RuntimeError(problem)
        self._awaiting_weights = self.mode == "parameter_server"

    @torch.no_grad()
    def broadcast_parameters(self) -> None:
        """Rank 0 sends its trainable parameters to every other rank.

        A star, as from a parameter server: the server sends each worker the whole
        model ((N-1)x the bytes: a scatter of N copies); a worker receives it once.
        """
        n = self.dp_size
        for b in self._buckets:
            sizes = [p.numel() for p in b.params]
            flat = torch.cat([p.reshape(-1) for p in b.params])  # rank 0: the source
            out = torch.empty_like(flat)
            with self._spans.timed(f"scatter bucket {b.index}", n * flat.nbytes):
                dist.scatter(out, [flat] * n if self.dp_rank == 0 else None,
                             group=self.group, group_src=0)
            if self.dp_rank != 0:
                for p, v in zip(b.params, out.split(sizes)):
                    p.copy_(v.view(p.shape))
        self._awaiting_weights = False

    def close(self) -> None:
        """Remove this wrapper's hooks now (they also go when it is collected)."""
        guards.forget(self)
        self._finalizer()

    def extra_repr(self) -> str:
        return (f"mode={self.mode!r}, bucket_mib={self.bucket_mib}, "
                f"buckets={len(self._buckets)}, dp_size={self.dp_size}")

    # -- backward ----------------------------------------------------------------

    def _backward_started(self) -> None:
        """Called by every hook; acts once per backward (autograd graph task). A
        reentrant checkpoint runs a backward (a new graph task) inside ours: it is
        part of ours."""
        if self._backward.seen():
            return
        if not self._backward.running and self._pending and self.mode == "overlap":
            raise RuntimeError(
                "DataParallel(mode='overlap'): a second backward before "
                "finish_gradient_synchronization(), while the first one's "
                "all-reduces run. Call finish after each backward, or accumulate "
                "the first micro-batches' gradients under dp.no_sync().")
        if not self._backward.enter():  # inside ours
            return
        if not (self._pending or self._accumulated):  # a new step: new spans
            self._spans.clear()
        if self._sync:
            self._pending = True
        else:
            self._accumulated = True
        self._spans.start("backward")

    def _backward_ended(self) -> None:
        self._spans.stop()

    def _grad_ready(self, b: Bucket, index: int) -> None:
        self._backward_started()
        self._used[index] = 1
        if self.mode != "overlap" or not self._sync:  # all wait for finish
            return
        b.ready += 1  # each grad once: AccumulateGrad runs once per backward
        # in bucket order, as DDP: a bucket waits for the ones before it, so the
        # ranks send the same sequence even where backward's order differs
        buckets = self._buckets
        while (self._next < len(buckets)
               and buckets[self._next].ready == len(buckets[self._next].params)):
            self._launch(buckets[self._next])

    def _launch(self, b: Bucket) -> None:
        """Send bucket b. Every rank sends every bucket, in order, once a step: a
        gradient this rank did not make goes as zeros (its part of the sum)."""
        self._next = b.index + 1
        b.sent = b.to_send()  # the .grads' flat buffer, or a lone gradient
        b.issued = time.perf_counter()
        if self.mode == "parameter_server":
            b.gathered = ([torch.empty_like(b.sent) for _ in range(self.dp_size)]
                          if self.dp_rank == 0 else None)
            for t in b.gathered or ():
                count_as(t, "Temp")  # receive buffers for the workers' gradients
            b.work = dist.gather(b.sent, b.gathered, group=self.group, group_dst=0,
                                 async_op=True)
        else:
            b.work = dist.all_reduce(b.sent, group=self.group, async_op=True)
        # completion time: the future's callback runs on the thread that finishes it
        b.done = b.work.get_future().then(completed_at)

    def _average(self, b: Bucket) -> None:
        if self.mode == "parameter_server":
            if self.dp_rank != 0:  # a worker does not hold the average
                for p in b.params:
                    p.grad = None
                return
            b.sent.copy_(b.gathered[0])
            for g in b.gathered[1:]:  # in rank order
                b.sent += g
        b.sent.div_(self.dp_size)  # sum -> mean: each rank's loss is a mean
        b.received(b.sent)  # the .grads are views of what was sent, or get a copy

    # -- the usage check ---------------------------------------------------------

    def _issue_check(self):
        """Start the all-gather of every rank's bitmask of the parameters its
        backward reached; (work, masks), or None with nothing to compare."""
        if self.dp_size == 1 or not self._names:
            return None
        mine = pack_bits(self._used).to(self._buckets[0].params[0].device)
        masks = [torch.empty_like(mine) for _ in range(self.dp_size)]
        for t in (mine, *masks):
            count_as(t, "Temp")
        with phase(self.CHECK_PHASE):
            work = dist.all_gather(masks, mine, group=self.group, async_op=True)
        return work, masks

    def _usage_problem(self, work, masks) -> str | None:
        """What the ranks' masks say if they differ: each parameter some ranks
        used and others did not, with both lists of (global) ranks."""
        work.wait()
        used = [unpack_bits(m.cpu(), len(self._names)) for m in masks]
        ranks = dist.get_process_group_ranks(self.group)
        odd = []
        for i, name in enumerate(self._names):
            yes = [r for r, u in zip(ranks, used) if u[i]]
            if yes and len(yes) < len(ranks):
                no = [r for r in ranks if r not in yes]
                odd.append(f"{name!r} got a gradient on {_ranks(yes)} but not on "
                           f"{_ranks(no)}")
        if not odd:
            return None
        shown = "; ".join(odd[:8]) + (f"; and {len(odd) - 8} more" if len(odd) > 8
                                      else "")
        return ("DataParallel: the ranks used different parameters in this step "
                f"(the backwards since the last finish): {shown}. DataParallel "
                "needs every rank to use the same parameters each step (one that "
                "no rank uses is fine: its .grad stays as it was; PyTorch's DDP, "
                "by default, refuses even that). Run a data-dependent branch on "
                "every rank "
                "(e.g. add 0 * its output to the loss), or take the same branch "
                "on all of them. This step's gradients were dropped (set to "
                "None); run it again.")


def _ranks(ranks: list[int]) -> str:
    return (f"rank {ranks[0]}" if len(ranks) == 1
            else "ranks " + ", ".join(map(str, ranks)))


def _on_grad(ref, bucket: Bucket, index: int, param: torch.Tensor) -> None:
    dp = ref()
    if dp is not None:
        dp._grad_ready(bucket, index)
