"""DiLoCo against data parallelism on 2 hosts of 2 ranks, at equal tokens: the
worker, and what it measures over two network stacks (labkit.comm.two_hosts, as
root: bytes across the veth, step times on a shaped link) or, without root, on
one host with the traffic ledger. Behind `make two-hosts` and chapter 13.

In cli because it needs both labkit.parallel (DiLoCo) and labkit.comm (the two
hosts), which no lower layer may import together. Bytes, seconds; a rate in
Mbit/s (1e6 bit/s) is each direction's.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from labkit import ledger, theory
from labkit.comm import two_hosts
from labkit.parallel import DiLoCo
from labkit.probe import phase

SHAPE = (256, 512, 256)  # the MLP: 262,912 parameters, 1.05 MB of fp32 gradients
ROWS = 16  # rows each rank draws a step
HOSTS, PER_HOST = 2, 2
LR = 1e-3  # both inner optimizers: AdamW (DiLoCo's outer step: the paper's)
DDP_PHASE = "DDP: gradients averaged over all ranks"
KINDS = {DDP_PHASE: "ddp", DiLoCo.INNER_PHASE: "inner", DiLoCo.OUTER_PHASE: "outer"}


def mlp(seed: int = 0) -> nn.Sequential:
    """The model every trial trains, the same on every rank (seeded)."""
    torch.manual_seed(seed)
    d_in, hidden, d_out = SHAPE
    return nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, d_out))


def payload_bytes() -> int:
    """Bytes of one full sync: every parameter's fp32 gradient (or Δ)."""
    return 4 * sum(p.numel() for p in mlp().parameters())


def batch(rank: int, step: int, rows: int = ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s batch at `step`, the same in every run: x, and y = x·T for
    one fixed random matrix T (the function to learn)."""
    teacher = torch.randn(SHAPE[0], SHAPE[-1],
                          generator=torch.Generator().manual_seed(12345))
    x = torch.randn(rows, SHAPE[0],
                    generator=torch.Generator().manual_seed(1000 * step + rank))
    return x, x @ teacher / SHAPE[0] ** 0.5


@dataclass(frozen=True)
class Trial:
    """What one window of the worker runs."""

    method: str  # "ddp", "diloco", "compute" (no communication), "idle" (no steps)
    sync_every: int = 1  # DiLoCo's H
    steps: int = 64
    ledger: bool = False  # record with the traffic ledger (it waits for each call)

    @property
    def name(self) -> str:
        return f"DiLoCo H={self.sync_every}" if self.method == "diloco" else (
            "DDP" if self.method == "ddp" else self.method)


@dataclass(frozen=True)
class Window:
    """One trial as one rank saw it."""

    trial: Trial
    losses: list[float]  # this rank's loss at each step
    seconds: float  # the steps, barrier to barrier (a timing)
    crossed: two_hosts.Crossed | None  # veth0 of this host, local rank 0 only
    retransmitted: int | None  # bytes this host's TCP sent twice to the other
    bus: dict[str, float]  # ledger: bus bytes by kind ("ddp", "inner", "outer")
    wire: dict[str, float]  # ledger: bytes written to sockets, by kind


def train(rank, world_size, trials) -> list[Window]:
    """Worker: each trial in turn, from the same model on the same batches, in a
    window of its own: DDP (one all-reduce of the gradients over all ranks a
    step), DiLoCo (an all-reduce in the host a step, over all every H) or no
    communication. One torch thread, so one host and two compute alike."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        hosts = [dist.new_group(list(range(h * PER_HOST, (h + 1) * PER_HOST)))
                 for h in range(world_size // PER_HOST)]
        return [_window(rank, world_size, t, hosts[rank // PER_HOST]) for t in trials]
    finally:
        torch.set_num_threads(threads)


def _window(rank, world_size, trial: Trial, host) -> Window:
    """One trial, between two barriers; each host's first rank reads its counters
    before (once every rank is there, before any sends) and after."""
    net = mlp()
    params = list(net.parameters())
    opt = torch.optim.AdamW(params, lr=LR)
    diloco = (DiLoCo(net, opt, sync_every=trial.sync_every, host_group=host)
              if trial.method == "diloco" else None)
    data = [batch(rank, k) for k in range(trial.steps)]
    reads = rank % PER_HOST == 0  # one rank a host reads the counters
    dist.barrier()  # whatever came before has crossed
    c0, r0 = _counters(reads)
    dist.barrier()  # no rank sends before they are read
    t0 = time.perf_counter()
    losses = []
    with ledger.traffic() if trial.ledger else contextlib.nullcontext() as led:
        for x, y in data:
            opt.zero_grad()
            loss = nn.functional.mse_loss(net(x), y)
            loss.backward()
            if diloco is not None:
                diloco.step()
            else:
                if trial.method == "ddp":
                    _all_reduce_mean(params, world_size)
                opt.step()
            losses.append(loss.item())
    dist.barrier()  # every step done on every rank: all of it has crossed
    seconds = time.perf_counter() - t0
    c1, r1 = _counters(reads)
    if diloco is not None:
        diloco.close()
    bus, wire = {}, {}
    if led is not None:
        for ph, sums in led.by_phase().items():
            if ph in KINDS:
                bus[KINDS[ph]], wire[KINDS[ph]] = sums["bus_bytes"], sums["wire_bytes"]
    return Window(trial, losses, seconds, None if c0 is None else c1 - c0,
                  None if r0 is None else r1 - r0, bus, wire)


def _counters(reads: bool):
    """(veth counters, bytes retransmitted) of this rank's host, if it reads them."""
    if not reads:
        return None, None
    return two_hosts.veth_counters(), two_hosts.retransmitted()


def _all_reduce_mean(params, n: int) -> None:
    """DDP's one all-reduce a step: every gradient in one flat buffer, averaged."""
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    with phase(DDP_PHASE):
        dist.all_reduce(flat)
    flat.div_(n)
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        p.grad.copy_(g.view_as(p))


# -- two hosts ---------------------------------------------------------------------


@dataclass(frozen=True)
class AcrossRow:
    """One trial's bytes across hosts (rank 0 reads host A's end: both ways)."""

    name: str
    sync_every: int
    steps: int
    crossed: two_hosts.Crossed  # the frames, headers and all
    retransmitted: int  # TCP payload sent again (both hosts), counted in crossed
    sent: float  # payload sent once, less the empty window's: a step's
    closed_form: float  # theory.bytes_across_hosts / H: a step's
    final_loss: float  # mean over the ranks, at the last step


@dataclass(frozen=True)
class TwoHostsComparison:
    """What `measure_two_hosts` measured; each figure a step's unless named."""

    payload: int  # bytes of one full sync
    rows: list[AcrossRow]  # DDP first, then DiLoCo by H
    idle: two_hosts.Crossed  # an empty window: its barriers
    idle_sent: float  # its payload sent once
    framing: float  # gloo's bytes a sync beyond the closed form, measured on DDP
    rate_mbit: float  # each direction of the shaped link
    burst: int  # the token bucket's bytes, each direction
    compute: float  # seconds of a step with no communication (shaped run)
    seconds: dict[tuple[str, bool], float]  # (DDP or DiLoCo H=.., shaped) -> step
    timed: dict[tuple[str, bool], two_hosts.Crossed]  # their windows' frames
    timed_steps: int
    timed_h: int
    runs: dict[str, two_hosts.TwoHostRun]  # "fast", "shaped": their Windows

    @property
    def across(self) -> float:
        """Bytes one full sync sends between the hosts (closed form)."""
        return theory.bytes_across_hosts(self.payload, HOSTS, PER_HOST)

    @property
    def bandwidth(self) -> float:
        """Bytes/s the shaped link carries across, both directions together."""
        return 2 * self.rate_mbit * 1e6 / 8


def measure_two_hosts(*, rate_mbit: float = 100.0, steps: int = 64,
                      sync_every=(1, 8, 64), timed_steps: int = 16,
                      timed_h: int = 8, burst_kib: int = 32,
                      hosts: two_hosts.TwoHosts | None = None) -> TwoHostsComparison:
    """DDP and DiLoCo (each H) over two network namespaces: the bytes a step sends
    across (full-speed link, `steps` steps each), then DDP's and DiLoCo(timed_h)'s
    step times on the link at full speed and shaped to rate_mbit. Two runs of
    4 ranks; namespaces of its own unless `hosts` is given (then left unshaped)."""
    trials = [Trial("idle", steps=0), Trial("ddp", steps=steps)]
    trials += [Trial("diloco", h, steps) for h in sync_every]
    timed = [Trial("compute", steps=timed_steps), Trial("ddp", steps=timed_steps),
             Trial("diloco", timed_h, timed_steps)]
    with contextlib.nullcontext(hosts) if hosts else two_hosts.TwoHosts("dl") as h:
        h.unshape()
        fast = h.run(train, trials + timed)
        h.shape(rate_mbit, burst_kib=burst_kib)
        try:
            shaped = h.run(train, timed)
        finally:
            h.unshape()
    return _compare(fast, shaped, len(trials), rate_mbit, burst_kib * 1024,
                    timed_steps, timed_h)


def _compare(fast_run, shaped_run, n_bytes, rate_mbit, burst, timed_steps, timed_h
             ) -> TwoHostsComparison:
    """fast_run: the windows of the idle trial, the n_bytes - 1 byte trials and
    the timed ones, per rank; shaped_run: the timed ones again."""
    fast, shaped = fast_run.values, shaped_run.values
    payload = payload_bytes()
    across = theory.bytes_across_hosts(payload, HOSTS, PER_HOST)
    a, b = fast[0], fast[PER_HOST]  # host A's and host B's readers
    idle = a[0].crossed
    idle_sent = idle.payload - a[0].retransmitted - b[0].retransmitted
    rows = []
    for k in range(1, n_bytes):
        t = a[k].trial
        retrans = a[k].retransmitted + b[k].retransmitted
        sent = a[k].crossed.payload - retrans
        rows.append(AcrossRow(t.name, t.sync_every, t.steps, a[k].crossed, retrans,
                              (sent - idle_sent) / t.steps, across / t.sync_every,
                              statistics.fmean(v[k].losses[-1] for v in fast)))
    seconds, timed = {}, {}
    for windows, is_shaped in ((a[n_bytes:], False), (shaped[0], True)):
        for w in windows:
            seconds[w.trial.name, is_shaped] = w.seconds / w.trial.steps
            timed[w.trial.name, is_shaped] = w.crossed
    return TwoHostsComparison(
        payload, rows, idle, idle_sent, rows[0].sent - rows[0].closed_form,
        rate_mbit, burst, seconds["compute", True], seconds, timed, timed_steps,
        timed_h, {"fast": fast_run, "shaped": shaped_run})


def report_two_hosts(c: TwoHostsComparison) -> str:
    """The comparison as text: bytes across a step, then the shaped link."""
    mb = lambda x: f"{x / 1e6:,.3f} MB"
    lines = [f"one full sync: {c.payload:,} B of fp32 gradients; across hosts "
             f"(theory.bytes_across_hosts, 2 hosts x 2 ranks): {c.across:,.0f} B",
             f"bytes across the veth a step ({c.rows[0].steps} steps each; TCP "
             f"payload = frames less {two_hosts.HEADER} B of headers each, less "
             "retransmissions and the empty window's barriers):",
             f"  {'':15}{'frames':>16}{'payload, sent once':>20}{'closed form':>14}"
             f"{'framing':>10}{'last loss':>11}"]
    for r in c.rows:
        lines.append(f"  {r.name:15}{mb(r.crossed.bytes / r.steps):>16}"
                     f"{mb(r.sent):>20}{mb(r.closed_form):>14}"
                     f"{r.sent - r.closed_form:>8,.0f} B{r.final_loss:>11.4f}")
    ddp = c.rows[0]
    lines.append(
        f"  headers: {two_hosts.HEADER * ddp.crossed.packets / ddp.crossed.payload:.2%}"
        f" of DDP's payload; gloo's framing {c.framing:,.0f} B a sync "
        f"({c.framing / c.across:.3%}); DiLoCo's inner all-reduces stay in "
        "their host")
    lines.append(f"step time (a timing), link at full speed and shaped to "
                 f"{c.rate_mbit:g} Mbit/s each way ({c.bandwidth / 1e6:.1f} MB/s "
                 f"across), {c.timed_steps} steps; compute alone "
                 f"{c.compute * 1e3:.1f} ms:")
    for name, h in (("DDP", 1), (f"DiLoCo H={c.timed_h}", c.timed_h)):
        fast, slow = c.seconds[name, False], c.seconds[name, True]
        model = theory.sync_step_time(c.compute, c.across, c.bandwidth, h)
        lines.append(f"  {name:15} {fast * 1e3:7.1f} ms -> {slow * 1e3:7.1f} ms "
                     f"(+{(slow - fast) * 1e3:.1f} ms; across/(H·B) = "
                     f"{c.across / (h * c.bandwidth) * 1e3:.1f} ms; "
                     f"sync_step_time {model * 1e3:.1f} ms)")
    for name, h in (("DDP", 1), (f"DiLoCo H={c.timed_h}", c.timed_h)):
        star = theory.crossover_bandwidth(c.compute, c.across, h)
        side = "below" if c.bandwidth < star else "above"
        lines.append(f"  crossover {name}: B* = {star / 1e6:,.1f} MB/s "
                     f"({star * 8 / 2e6:,.0f} Mbit/s each way): the shaped link is "
                     f"{side} it, so a step spends "
                     f"{'more' if side == 'below' else 'less'} time on the link "
                     "than computing")
    return "\n".join(lines)


# -- one host ------------------------------------------------------------------------


@dataclass(frozen=True)
class LedgerRow:
    """One trial on one host: the bytes rank 0 sends a step, by kind."""

    name: str
    sync_every: int
    steps: int
    bus: dict[str, float]  # a step's, nccl-tests' convention
    wire: dict[str, float]  # a step's, written to sockets
    closed_form: dict[str, float]  # theory.ddp_traffic / diloco_traffic
    final_loss: float
    wire_by_rank: list[dict[str, float]]  # `wire` of every rank
    losses: list[list[float]]  # every rank's, every step


def measure_one_host(cluster=None, *, steps: int = 64, sync_every=(1, 8, 64)
                     ) -> list[LedgerRow]:
    """The same trials on one host's 4 ranks (no root needed), with the traffic
    ledger: what rank 0 sends a step inside its host ("inner"), to all ("ddp",
    "outer"), against the closed forms. No bytes across hosts: one host."""
    import labkit

    trials = [Trial("ddp", steps=steps, ledger=True)]
    trials += [Trial("diloco", h, steps, ledger=True) for h in sync_every]
    with contextlib.nullcontext(cluster) if cluster else labkit.Cluster(4) as c:
        values = c.run(train, trials).values
    p, n = payload_bytes(), HOSTS * PER_HOST
    rows = []
    for k, t in enumerate(trials):
        w = values[0][k]
        closed = ({"ddp": theory.ddp_traffic(p, n).average} if t.method == "ddp"
                  else {"inner": theory.ddp_traffic(p, PER_HOST).average,
                        "outer": theory.diloco_traffic(p, n, t.sync_every).average})
        per_step = lambda d, s=t.steps: {kind: b / s for kind, b in d.items()}
        rows.append(LedgerRow(t.name, t.sync_every, t.steps, per_step(w.bus),
                              per_step(w.wire), closed,
                              statistics.fmean(v[k].losses[-1] for v in values),
                              [per_step(v[k].wire) for v in values],
                              [v[k].losses for v in values]))
    return rows


def report_one_host(rows: list[LedgerRow]) -> str:
    """measure_one_host's rows as text, with the bytes two hosts would send."""
    lines = [f"one host, 4 ranks (traffic ledger, rank 0; a step's bytes over "
             f"{rows[0].steps} steps):",
             f"  {'':15}{'kind':>7}{'bus':>14}{'wire':>14}{'closed form':>14}"
             f"{'last loss':>11}"]
    for r in rows:
        for kind, want in r.closed_form.items():
            lines.append(f"  {r.name:15}{kind:>7}{r.bus.get(kind, 0):>14,.0f}"
                         f"{r.wire.get(kind, 0):>14,.0f}{want:>14,.0f}"
                         f"{r.final_loss:>11.4f}")
    across = theory.bytes_across_hosts(payload_bytes(), HOSTS, PER_HOST)
    lines.append(f"  on two hosts a full sync would send {across:,.0f} B across "
                 "(theory.bytes_across_hosts): DDP's every step, DiLoCo's every H")
    return "\n".join(lines)


def summary(c: TwoHostsComparison) -> dict:
    """measure_two_hosts' figures as plain numbers (JSON): per trial a step's
    payload across and what the closed form plus gloo's framing allows it, with
    the TCP options a frame may carry as the allowance; the step times."""
    rows = [{"name": r.name, "sync_every": r.sync_every, "sent": r.sent,
             "closed_form": r.closed_form,
             "expected": r.closed_form + c.framing / r.sync_every,
             "allowed": two_hosts.OPTIONS * r.crossed.packets / r.steps,
             "final_loss": r.final_loss} for r in c.rows]
    times = {}
    for name, h in (("DDP", 1), (f"DiLoCo H={c.timed_h}", c.timed_h)):
        times[name] = {"sync_every": h, "fast": c.seconds[name, False],
                       "shaped": c.seconds[name, True],
                       "link": c.across / (h * c.bandwidth),
                       "crossover": theory.crossover_bandwidth(c.compute,
                                                               c.across, h)}
    return {"payload": c.payload, "across": c.across, "framing": c.framing,
            "rows": rows, "rate_mbit": c.rate_mbit, "bandwidth": c.bandwidth,
            "compute": c.compute, "times": times}


def main(argv=None) -> int:
    """`python -m labkit.cli.diloco_vs_ddp [--steps N] [--json]`: the two-host
    comparison (root), or why it cannot run here (exit 2)."""
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m labkit.cli.diloco_vs_ddp")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--timed-steps", type=int, default=16)
    p.add_argument("--rate-mbit", type=float, default=100.0)
    p.add_argument("--sync-every", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--json", action="store_true", help="the figures as JSON")
    a = p.parse_args(argv)
    why = two_hosts.cannot_make_namespaces()
    if why:
        print(why)
        return 2
    c = measure_two_hosts(rate_mbit=a.rate_mbit, steps=a.steps,
                          sync_every=tuple(a.sync_every), timed_steps=a.timed_steps)
    print(json.dumps(summary(c)) if a.json else report_two_hosts(c))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
