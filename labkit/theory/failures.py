"""When ranks fail and networks are slow, in closed form: interruptions at scale,
the checkpoint interval (Young 1974, Daly 2006), and the bytes DiLoCo and
Streaming DiLoCo save over data parallelism. Imports labkit.arguments and
labkit.theory's own modules only. Times in seconds, sizes in bytes."""

from __future__ import annotations

import math
from dataclasses import dataclass

from labkit.arguments import ArgumentError, real, whole
from labkit.theory._validate import check_counts
from labkit.theory.collective_cost import ring_bytes_per_rank

HOUR = 3600.0
DAY = 24 * HOUR



# -- failures at scale ------------------------------------------------------------


def job_mtbf(gpu_mtbf: float, gpus: int) -> float:
    """Mean time between failures of a job that stops when any of its N GPUs
    fails, each independently with mean time gpu_mtbf: gpu_mtbf / N."""
    return real(gpu_mtbf, "gpu_mtbf") / whole(gpus, "gpus")


def expected_interruptions(gpus: int, duration: float = DAY, *,
                           gpu_mtbf: float | None = None,
                           gpu_rate: float | None = None) -> float:
    """Failures expected among N GPUs in `duration` seconds (one a day by
    default): N · duration / gpu_mtbf, or N · duration · gpu_rate (failures per
    GPU-second). Give exactly one of gpu_mtbf and gpu_rate."""
    if (gpu_mtbf is None) == (gpu_rate is None):
        raise ArgumentError("give exactly one of gpu_mtbf (s) and gpu_rate (1/s)")
    rate = (1 / real(gpu_mtbf, "gpu_mtbf") if gpu_rate is None
            else real(gpu_rate, "gpu_rate"))
    return whole(gpus, "gpus") * real(duration, "duration") * rate


@dataclass(frozen=True)
class FailureSnapshot:
    """What a published count of interruptions implies (seconds)."""

    duration: float  # the period counted
    interruptions: int  # all of them, planned maintenance included
    unexpected: int  # the failures
    gpus: int
    job_mtbf: float  # duration / unexpected
    gpu_mtbf: float  # job_mtbf · gpus: one GPU's, if every failure is one GPU's
    per_day: float  # unexpected interruptions a day


def failure_snapshot(days: float, interruptions: int, unexpected: int,
                     gpus: int) -> FailureSnapshot:
    """The MTBFs a count of `unexpected` failures (of `interruptions` in all) over
    `days` on N GPUs implies: the job's, days / unexpected, and one GPU's, N times
    that, as if failures were independent and each one GPU's."""
    check_counts(interruptions=interruptions, unexpected=unexpected)
    if unexpected > interruptions:
        raise ArgumentError(f"unexpected ({unexpected}) cannot exceed interruptions "
                            f"({interruptions})")
    n, duration = whole(gpus, "gpus"), real(days, "days") * DAY
    mtbf = duration / unexpected
    return FailureSnapshot(duration, interruptions, unexpected, n, mtbf, mtbf * n,
                           unexpected / days)


# The Llama 3 Herd of Models (arXiv 2407.21783), sec. 3.3.4: 466 job interruptions
# in a 54-day snapshot of pre-training on 16,384 H100s, 47 planned, 419 unexpected
LLAMA3_FAILURES = failure_snapshot(days=54, interruptions=466, unexpected=419,
                                   gpus=16_384)


# -- the checkpoint interval ------------------------------------------------------


def failure_cost(interval: float, restart: float) -> float:
    """Time one failure costs: the work since the last checkpoint, half an
    interval on average (failures fall uniformly in it), plus the restart."""
    restart = real(restart, "restart", zero=True)
    return real(interval, "interval") / 2 + restart


def wasted_fraction(interval: float, checkpoint: float, restart: float,
                    mtbf: float) -> float:
    """Time lost per unit of useful work, to first order (Young 1974): writing a
    checkpoint of C seconds every τ, plus one failure_cost(τ, R) every M seconds:
    C/τ + (τ/2 + R)/M. Its minimum is at young_interval(C, M)."""
    c = real(checkpoint, "checkpoint")
    lost = failure_cost(interval, restart)
    return c / real(interval, "interval") + lost / real(mtbf, "mtbf")


def young_interval(checkpoint: float, mtbf: float) -> float:
    """Young (1974), "A first order approximation to the optimum checkpoint
    interval", CACM 17(9): τ = sqrt(2·C·M), compute time between checkpoints."""
    return math.sqrt(2 * real(checkpoint, "checkpoint") * real(mtbf, "mtbf"))


def daly_interval(checkpoint: float, mtbf: float) -> float:
    """Daly (2006), "A higher order estimate of the optimum checkpoint interval
    for restart dumps", FGCS 22(3): with ξ = C/(2M),
    τ = sqrt(2CM)·[1 + sqrt(ξ)/3 + ξ/9] − C for C < 2M, else τ = M.
    The restart time R does not move the optimum (it scales every segment's
    expected cost alike)."""
    c, m = real(checkpoint, "checkpoint"), real(mtbf, "mtbf")
    if c >= 2 * m:
        return m
    xi = c / (2 * m)
    return math.sqrt(2 * c * m) * (1 + math.sqrt(xi) / 3 + xi / 9) - c


# -- training that talks less -----------------------------------------------------


@dataclass(frozen=True)
class SyncTraffic:
    """Bytes one rank sends to keep the replicas in step, per inner step."""

    average: float  # amortised over the steps between syncs
    peak: float  # in the busiest step


def ddp_traffic(payload: float, world_size: int) -> SyncTraffic:
    """Data parallelism over N = world_size ranks: one ring all-reduce of the
    payload every step, 2(N-1)/N · payload each step, so average = peak."""
    sent = ring_bytes_per_rank("all_reduce", real(payload, "payload", zero=True),
                               whole(world_size, "world_size, the number of ranks,"))
    return SyncTraffic(sent, sent)


def diloco_traffic(payload: float, world_size: int, inner_steps: int,
                   fragments: int = 1) -> SyncTraffic:
    """DiLoCo (Douillard et al. 2023, arXiv 2311.08105): the same all-reduce
    once per H inner steps, average = DDP's / H. Streaming DiLoCo (Douillard
    et al. 2025, arXiv 2501.18512): F equal fragments, each synced once per H
    steps at staggered steps, so peak = a full sync / F and the average is
    unchanged. Needs F <= H (at most one fragment a step)."""
    h = whole(inner_steps, "inner_steps")
    f = whole(fragments, "fragments", high=h)
    full = ddp_traffic(payload, world_size).peak
    return SyncTraffic(full / h, full / f)


def quantized_payload(values: int, bits: int, block: int) -> int:
    """Bytes of `values` outer-gradient values sent as `bits`-bit integers packed
    into bytes, with one fp32 scale per block of `block` values (the last block
    may be short): ceil(values·bits/8) + 4·ceil(values/block), about the fp32
    payload × bits/32 (Streaming DiLoCo sends 4-bit floats)."""
    v, b = whole(values, "values"), whole(bits, "bits", high=32)
    k = whole(block, "block")
    return -(-v * b // 8) + 4 * -(-v // k)


def bytes_across_hosts(payload: float, hosts: int, ranks_per_host: int) -> float:
    """Bytes one ring all-reduce sends between hosts, its N = hosts · r ranks in
    contiguous blocks of r per host: every edge of the ring carries the ring's
    per-rank 2(N-1)/N · payload, and h of its edges leave a host (none for one
    host), so h · 2(N-1)/N · payload."""
    check_counts(hosts=hosts, ranks_per_host=ranks_per_host)
    per_edge = ddp_traffic(payload, hosts * ranks_per_host).peak
    return (hosts if hosts > 1 else 0) * per_edge


def sync_step_time(compute: float, across: float, bandwidth: float,
                   inner_steps: int = 1) -> float:
    """Seconds a step takes, compute then communication (no overlap), when the
    `across` bytes of one full sync cross one link of `bandwidth` bytes/s and a
    sync comes every H steps: t_c + across / (H·B); DDP is H = 1. All crossing
    bytes share that one link; where each host's egress is shaped on its own,
    pass B times the links that carry them at once."""
    h = whole(inner_steps, "inner_steps")
    return real(compute, "compute") + real(across, "across", zero=True) / (
        h * real(bandwidth, "bandwidth"))


def crossover_bandwidth(compute: float, across: float, inner_steps: int = 1) -> float:
    """The bandwidth B* at which a sync's communication takes as long as its
    compute: across / (H·t_c); DDP's (H = 1) over H is DiLoCo's."""
    h = whole(inner_steps, "inner_steps")
    return real(across, "across") / (h * real(compute, "compute"))
