"""Pipeline parallelism (流水线并行): a model's layers cut into p stages, one per
rank of `group`; micro-batches flow forward through the stages and their gradients
flow back, passed with send/recv (GPipe, Huang et al. 2019; 1F1B, Narayanan et al.
2021, sec. 2.2.1).

    pipe = PipelineParallel(model, microbatches=4, loss_fn=F.mse_loss)
    loss = pipe.step(x, y)      # every rank: the same batch; the loss on the last

Imports labkit.arguments, labkit.probe and pipeline_schedules. Each micro-batch's
loss is divided by m, so the accumulated gradients are the whole batch's.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from labkit.arguments import whole
from labkit.parallel import guards
from labkit.parallel.pipeline_schedules import stage_order
from labkit.probe import Span, Spans, count_as, union

RUNTIME_SCHEDULES = ("gpipe", "1f1b")
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
           torch.int32)
_HEADER = 10  # int64 slots: dtype index, number of dims, up to 8 sizes


def split_layers(n_layers: int, p: int, balance=None) -> list[tuple[int, int]]:
    """[lo, hi) of each of p stages: equal counts, or `balance` layers per stage."""
    if balance is None:
        if n_layers % p:
            raise ValueError(
                f"{n_layers} layers cannot be cut into {p} equal stages; pass "
                f"balance=[layers per stage] ({p} counts summing to {n_layers})")
        balance = [n_layers // p] * p
    balance = list(balance)
    if (len(balance) != p or sum(balance) != n_layers or any(
            isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in balance)):
        raise ValueError(f"balance must be {p} integers >= 1 summing to {n_layers} "
                         f"layers, got {balance}")
    bounds = [sum(balance[:s]) for s in range(p + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


class PipelineParallel(torch.nn.Module):
    """This rank's stage of a pipeline over the ranks of `group` (default: all).
    `module` holds the stage's layers; `step(x, target)` runs one schedule of m
    micro-batches, forward and backward, and leaves the stage's gradients in
    `.grad` (accumulated: zero them before each step).

    torch.distributed.pipelining's PipelineStage with ScheduleGPipe or
    Schedule1F1B in one object; unlike it, every rank passes the whole model
    (or its layers) and keeps its own stage, `step(x, target)` takes the batch
    on every rank and returns the mean loss on the last stage.

    `pp_size` is the number of stages (the ranks of `group`); `stage` is this
    rank's stage index, its pp rank (its rank in `group`).
    """

    def __init__(self, layers, *, microbatches: int, loss_fn, schedule: str = "1f1b",
                 group=None, balance=None):
        super().__init__()
        guards.require_process_group("PipelineParallel")
        if schedule not in RUNTIME_SCHEDULES:
            raise ValueError(f"schedule must be one of {RUNTIME_SCHEDULES} on real "
                             f"ranks (the simulator has more), not {schedule!r}")
        m = whole(microbatches, "microbatches")
        self.group = group if group is not None else dist.group.WORLD
        self.pp_size = dist.get_world_size(self.group)
        self.stage = dist.get_rank(self.group)  # this rank's pp rank
        if self.stage < 0:
            raise ValueError("this rank is not in the pipeline's process group")
        seq = (layers if isinstance(layers, torch.nn.Sequential)
               else torch.nn.Sequential(*layers))
        lo, hi = split_layers(len(seq), self.pp_size, balance)[self.stage]
        self.module = seq[lo:hi]  # a Sequential slice keeps the layers' names
        self.layers = (lo, hi)
        self.microbatches, self.loss_fn, self.schedule = m, loss_fn, schedule
        self.order = stage_order(schedule, self.pp_size, m, self.stage)
        peer = lambda s: dist.get_global_rank(self.group, s)
        self.prev = peer(self.stage - 1) if self.stage > 0 else None
        self.next = peer(self.stage + 1) if self.stage < self.pp_size - 1 else None
        self._spans = Spans()  # the last step's, for `events`
        self._sends: list = []  # (work, tensor, name, start) of sends in flight
        self._shapes: dict = {}  # micro-batch shape of x -> (input shape, dtype)
        self.peak_in_flight = 0  # most micro-batches held at once, last step

    @property
    def events(self) -> list[Span]:
        """The last step's spans (this rank's clock): compute "forward i",
        "backward i"; comm "send activation i", "recv gradient i", ..., a
        receive from posted to done (waiting for the peer shows there)."""
        return list(self._spans)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.pp_size - 1

    def forward(self, *args, **kwargs):
        raise RuntimeError("PipelineParallel runs whole steps: call "
                           "pipe.step(x, target), not pipe(x)")

    def extra_repr(self) -> str:
        return (f"stage={self.stage} of {self.pp_size}, layers=[{self.layers[0]}, "
                f"{self.layers[1]}), schedule={self.schedule!r}, "
                f"microbatches={self.microbatches}")

    # -- the step ------------------------------------------------------------------

    def step(self, x: torch.Tensor, target: torch.Tensor | None = None):
        """Forward and backward of the whole batch, micro-batch by micro-batch, in
        this stage's order. Returns the loss (mean over micro-batches) on the last
        stage, None on the others."""
        m = self.microbatches
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            raise ValueError("step(x, target): x must be the batch, a tensor with "
                             "the batch along dim 0, on every rank")
        if x.shape[0] % m:
            raise ValueError(f"a batch of {x.shape[0]} rows cannot be cut into {m} "
                             f"equal micro-batches")
        if self.is_last and (target is None or target.shape[0] != x.shape[0]):
            got = None if target is None else tuple(target.shape)
            raise ValueError(f"the last stage needs target with {x.shape[0]} rows "
                             f"(one per row of x), got {got}")
        xs = x.tensor_split(m) if self.is_first else None
        ts = target.tensor_split(m) if self.is_last else None
        key = (tuple(xs[0].shape) if xs else (x.shape[0] // m, *x.shape[1:]),
               x.dtype)
        first_time = key not in self._shapes
        if self.is_first:
            self._shapes[key] = key
        self._sends = []
        self._spans.clear()
        self._inputs, self._outputs, self._losses = {}, {}, {}
        losses, self.peak_in_flight = [], 0
        try:
            for a in self.order:
                if a.kind == "F":
                    self._forward(a.microbatch, xs, ts, key, first_time, losses)
                else:
                    self._backward(a.microbatch)
        finally:
            self._finish_sends()  # every send done before we return
        return torch.stack(losses).mean() if self.is_last else None

    def _forward(self, i, xs, ts, key, first_time, losses) -> None:
        if self.is_first:
            self._finish_sends()
            inp = xs[i]
        else:
            if first_time and i == 0:  # every stage's first pass is F 0
                self._shapes[key] = self._recv_header()
            shape, dtype = self._shapes[key]
            inp = self._recv(shape, dtype, self.prev, f"recv activation {i}")
            inp.requires_grad_(inp.is_floating_point())
        with self._spans.timed(f"forward {i}", kind="compute"):
            out = self.module(inp)
            if self.is_last:
                loss = self.loss_fn(out, ts[i])
                losses.append(loss.detach())
                # / m: with a mean loss, the m gradients add up to the batch's
                self._losses[i] = loss / self.microbatches
        self._inputs[i], self._outputs[i] = inp, out
        self.peak_in_flight = max(self.peak_in_flight, len(self._outputs))
        if not self.is_last:
            if first_time and i == 0:  # a new batch shape: its shape and dtype, once
                self._send_header(out)
            self._send(out.detach(), self.next, f"send activation {i}")

    def _backward(self, i) -> None:
        inp, out = self._inputs.pop(i), self._outputs.pop(i)
        if self.is_last:
            self._finish_sends()
            with self._spans.timed(f"backward {i}", kind="compute"):
                self._losses.pop(i).backward()
        else:
            grad = self._recv(out.shape, out.dtype, self.next, f"recv gradient {i}")
            count_as(grad, "Temp")  # a gradient passing through, not an activation
            with self._spans.timed(f"backward {i}", kind="compute"):
                torch.autograd.backward(out, grad)
        del out
        if not self.is_first:  # (an input the stage ignores has no gradient)
            g = inp.grad if inp.grad is not None else torch.zeros_like(inp)
            self._send(g, self.prev, f"send gradient {i}")

    # -- point to point -----------------------------------------------------------
    # A pass first posts the receive of its input, then waits for the sends of the
    # pass before, then for the receive (Megatron-LM pairs them the same way:
    # neighbours never wait on each other). A send so completes before the stage
    # computes again; on CPU ranks that also keeps it from queuing behind the
    # compute, since gloo moves the data on a thread of the sending rank.

    def _send(self, t: torch.Tensor, peer: int, name: str) -> None:
        t = t.contiguous()  # (held until the send is done)
        self._sends.append((dist.isend(t, peer, group=self.group), t, name,
                            time.perf_counter()))

    def _finish_sends(self) -> None:
        for work, t, name, t0 in self._sends:
            work.wait()
            self._spans.comm(name, t0, time.perf_counter(),
                             t.numel() * t.element_size())
        self._sends = []

    def _recv(self, shape, dtype, peer: int, name: str) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype)
        with self._spans.timed(name, buf.numel() * buf.element_size()):
            work = dist.irecv(buf, peer, group=self.group)
            self._finish_sends()
            work.wait()
        return buf

    def _send_header(self, out: torch.Tensor) -> None:
        if out.dim() > _HEADER - 2 or out.dtype not in _DTYPES:
            raise ValueError(f"stage {self.stage}'s output must be a tensor of at most "
                             f"{_HEADER - 2} dims and a dtype in {_DTYPES}, got "
                             f"{out.dtype} {tuple(out.shape)}")
        h = torch.zeros(_HEADER, dtype=torch.int64)
        h[0], h[1] = _DTYPES.index(out.dtype), out.dim()
        h[2:2 + out.dim()] = torch.tensor(out.shape)
        dist.send(h, self.next, group=self.group)

    def _recv_header(self) -> tuple[tuple[int, ...], torch.dtype]:
        h = torch.empty(_HEADER, dtype=torch.int64)
        dist.recv(h, self.prev, group=self.group)
        return tuple(h[2:2 + int(h[1])].tolist()), _DTYPES[int(h[0])]


def bubble_of_total_by_rank(events_by_rank) -> list[float]:
    """Each rank's idle share of the step, from its compute spans: 1 - (time it
    computed) / (first compute start to last compute end, over all ranks). The
    ranks' clocks are one (CLOCK_MONOTONIC), so their spans share a time axis."""
    ranks = list(events_by_rank.values() if isinstance(events_by_rank, dict)
                 else events_by_rank)
    compute = [[s for s in evs if s.kind == "compute"] for evs in ranks]
    spans = [s for evs in compute for s in evs]
    if not spans:
        raise ValueError("no compute spans: nothing ran")
    window = max(s.end for s in spans) - min(s.start for s in spans)
    return [1 - sum(b - a for a, b in union(evs)) / window for evs in compute]
