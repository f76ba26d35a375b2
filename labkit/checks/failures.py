"""Chapter 13's closed-form checks: a cluster's checkpoint interval (Young) and
the bytes a DiLoCo step sends. The hung rank in flight-recorder dumps is checked
in failures_hangs and an exact resume in failures_resume (importable from here).

Imports labkit.checks' common, verify, failures_hangs and failures_resume; torch,
labkit.parallel and labkit.ledger inside functions. Each check draws its cases
afresh each run and computes its reference by its own arithmetic, refusing in the
answer the labkit function the chapter teaches; DiLoCo's bytes are also held to
the traffic ledger of a run on the ranks.
"""

from __future__ import annotations

import math
import random
from fractions import Fraction

from labkit.checks.common import (
    NOT_WRITTEN,
    NOT_YET,
    PASSED,
    ExerciseError,
    as_number,
    close_to,
    labkit_cluster,
    run_answer,
    slips_named,
)
from labkit.checks.failures_hangs import check_hung
from labkit.checks.failures_resume import check_resume
from labkit.checks.verify import call_refusing, fresh_seed

__all__ = ["check_diloco_bytes", "check_hung", "check_interval", "check_resume"]

_HOUR = 3600  # seconds


# ------------------------------------------- exercise 1: the checkpoint interval

# The Llama 3 Herd of Models (arXiv 2407.21783), sec. 3.3.4: 419 unexpected
# interruptions in 54 days on 16,384 GPUs; with section 1's one-minute save
_LLAMA3 = (60.0, 16_384, 54 * 24 * 16_384 / 419)  # (C s, GPUs, one GPU's MTBF h)
# labkit's closed forms of failures (young_interval, job_mtbf, daly_interval ...)
# and this check's own
_INTERVAL_OWN = ("labkit.theory.failures", "labkit.checks.failures:_young")


def _young(checkpoint: float, gpus: int, gpu_mtbf_h: float) -> float:
    """Young (1974): τ = sqrt(2·C·M), M the job's MTBF in seconds, one GPU's
    (hours × 3600) over the N GPUs, any of which stops the job."""
    return math.sqrt(2 * checkpoint * (gpu_mtbf_h * _HOUR / gpus))


def _interval_cases(seed: int) -> list[tuple[float, int, float]]:
    """Llama 3's cluster, then six drawn this run: saves of 10 s to 30 min,
    8 to 131,072 GPUs, one GPU failing once in 1 to 100 years."""
    rng = random.Random(seed)
    cases = [_LLAMA3]
    while len(cases) < 7:
        c = round(10 ** rng.uniform(1, math.log10(1800)), 1)
        n = int(round(2 ** rng.uniform(3, 17)))
        m = round(10 ** rng.uniform(4, 6), 1)
        if 2 * c < m * _HOUR / n:  # a save shorter than half the job's MTBF
            cases.append((c, n, m))
    return cases


def _interval_slips(c: float, n: int, m: float) -> list:
    job = m * _HOUR / n
    tau = math.sqrt(2 * c * job)
    xi = c / (2 * job)
    return [
        (math.sqrt(2 * c * m * _HOUR),
         "that uses one GPU's MTBF: the job stops when any of its GPUs fails, so "
         "its MTBF is one GPU's divided by the number of GPUs"),
        (math.sqrt(2 * c * m * _HOUR * n),
         "the GPUs multiply the failures, not the time between them: the job's "
         "MTBF is one GPU's divided by the number of GPUs"),
        (math.sqrt(2 * c * m / n),
         "gpu_mtbf_h is in hours and the save in seconds: convert the MTBF to "
         "seconds (× 3600) first"),
        (math.sqrt(2 * c * m * 60 / n), "an hour is 3600 s, not 60"),
        (math.sqrt(c * job),
         "Young's interval is sqrt(2·C·M): the 2 is there because a failure loses "
         "half an interval on average"),
        (tau / 60, "that is in minutes: return seconds"),
        (tau / _HOUR, "that is in hours: return seconds"),
        (2 * c * job, "take the square root: τ = sqrt(2·C·M)"),
        (tau * (1 + math.sqrt(xi) / 3 + xi / 9) - c,
         "that is Daly's higher-order interval; the exercise asks Young's "
         "first-order sqrt(2·C·M)"),
    ]


def check_interval(fn) -> bool:
    """`fn(checkpoint_s, gpus, gpu_mtbf_h)`: seconds between checkpoints by
    Young's formula, sqrt(2·C·M), M the job's MTBF in seconds (one GPU's MTBF,
    in hours, over the GPUs). Llama 3's cluster and six drawn this run;
    labkit's closed forms of failures are refused; the usual slips (one GPU's
    MTBF, hours, the 2, minutes) are named."""
    cases = _interval_cases(fresh_seed())
    for c, n, m in cases:
        call = f"my_interval({c:g}, {n}, {m!r})"
        got = call_refusing(
            call, fn, (c, n, m), "my_interval", _INTERVAL_OWN,
            "closed forms of failures (theory.young_interval, job_mtbf), "
            "or this check's")
        if got is NOT_WRITTEN:
            return NOT_YET
        got = as_number(call, got)
        want = _young(c, n, m)
        if close_to(got, want):
            continue
        hint = slips_named(got, want, _interval_slips(c, n, m),
                           "τ = sqrt(2·C·M) in seconds, C the save's seconds, M "
                           "the job's MTBF: one GPU's (hours × 3600) over the GPUs")
        raise ExerciseError(f"{call} = {got:.6g} s, expected {want:.6g} s. "
                            f"Hint: {hint}")
    print(f"correct: Young's interval for Llama 3's cluster (a one-minute save: "
          f"every {_young(*_LLAMA3) / 60:.1f} min) and for {len(cases) - 1} "
          "clusters drawn this run")
    return PASSED


# --------------------------------------------- exercise 2: DiLoCo's bytes a step

# labkit's DiLoCo prices (diloco_traffic, ddp_traffic), the wrapper and the
# ledger (measuring instead of computing), the ranks, and this check's own
_DILOCO_OWN = ("labkit.theory.failures:diloco_traffic",
               "labkit.theory.failures:ddp_traffic", "labkit.parallel.diloco",
               "labkit.ledger.traffic_ledger", "labkit.runtime.cluster:Cluster.run",
               "labkit.checks.failures:_diloco_exact")
_HOSTS: dict = {}  # on a rank: world size -> its host groups (new_group: collective)


def _diloco_exact(params: int, n: int, h: int, f: int) -> tuple[Fraction, Fraction]:
    """(average, peak) bytes a rank sends per inner step in the outer all-reduces:
    a ring all-reduce of the fp32 model, 2(N-1)/N · 4·params, once per H steps
    in all (average), one fragment, 1/F of it, in the busiest step (peak)."""
    full = Fraction(2 * (n - 1), n) * 4 * params
    return full / h, full / f


def _diloco_slips(params: int, n: int, h: int, f: int) -> dict[str, list]:
    avg, peak = _diloco_exact(params, n, h, f)
    full = avg * h
    factors = [
        (Fraction(n, 2 * (n - 1)), "a ring all-reduce sends 2(N-1)/N of the payload "
                                   "a rank holds, not the payload"),
        (Fraction(1, 2), "(N-1)/N is a reduce-scatter's share: an all-reduce is a "
                         "reduce-scatter and an all-gather, 2(N-1)/N"),
        (Fraction(1, 2), "fp32 values are 4 bytes each, not 2"),
        (Fraction(n, n - 1), "a ring rank sends 2(N-1)/N of the payload, not twice "
                             "all of it"),
        (Fraction(1, 4), "that counts values, not bytes: 4 bytes each (fp32)"),
    ]
    out = {}
    for name, right in (("average", avg), ("peak", peak)):
        out[name] = [(right * k, why) for k, why in factors]
    out["average"] += [
        (full, "the outer all-reduce comes once every H inner steps: the average "
               "is its bytes / H"),
        (full / (h * f), "the fragments do not lower the average: each of the F "
                         "(1/F of the model) syncs once every H steps, the whole "
                         "model's bytes every H steps in all")]
    out["average"] += [(peak, "that is the peak (one fragment in the busiest "
                              "step); the average spreads the whole model's bytes "
                              "over H steps")] if f > 1 else []  # else: full
    out["peak"] += [
        (full, "Streaming DiLoCo syncs one fragment, 1/F of the model, in a step: "
               "the peak is the all-reduce's bytes / F"),
        (full / (h * f), "the peak is one step's bytes, a fragment's all-reduce "
                         "(1/F of the model), not spread over H steps")]
    out["peak"] += [(avg, "that is the average; the peak is the busiest step, the "
                          "one where a fragment (1/F of the model) syncs")
                    ] if h > f else []
    return out


def _diloco_cases(seed: int) -> tuple[list, list]:
    """(measured, computed): two small models of equal fragments run on the
    ranks (DiLoCo, then Streaming DiLoCo), and five larger settings drawn this
    run (up to 100B parameters and 1024 ranks, F dividing H)."""
    rng = random.Random(seed)
    measured = []
    for f in (1, rng.choice((2, 4))):  # F equal fragments: F x 1 or 2 layers
        h = rng.randint(2, 4) if f == 1 else 2 * f
        measured.append(dict(width=rng.choice((8, 12, 16)), layers=f * rng.randint(
            1, 2), bias=rng.random() < 0.5, h=h, f=f))
    computed = []
    while len(computed) < 5:
        h = rng.choice((4, 6, 8, 12, 16, 30, 50, 100, 128, 500))
        fs = [k for k in range(2, h) if h % k == 0]
        f = 1 if len(computed) == 0 else rng.choice(fs)
        n = rng.choice((3, 5, 8, 16, 24, 64, 256, 1024))
        computed.append((int(10 ** rng.uniform(6, 11)), n, h, f))
    return measured, computed


def _host_groups(world_size: int):
    """This rank's host group: hosts of 2 ranks, built once a process."""
    import torch.distributed as dist

    if world_size not in _HOSTS:
        _HOSTS[world_size] = [dist.new_group([2 * k, 2 * k + 1])
                              for k in range(world_size // 2)]
    return _HOSTS[world_size][dist.get_rank() // 2]


def _diloco_worker(rank, world_size, configs, seed):
    """Each config: DiLoCo on Linear layers for 2H inner steps; the parameters
    and the bus bytes of the outer phase in each step (traffic ledger)."""
    import torch
    from torch import nn

    from labkit.ledger import traffic
    from labkit.parallel import DiLoCo

    host = _host_groups(world_size)
    out = []
    for cfg in configs:
        torch.manual_seed(seed)
        w = cfg["width"]
        model = nn.Sequential(*[nn.Linear(w, w, bias=cfg["bias"])
                                for _ in range(cfg["layers"])])
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        diloco = DiLoCo(model, opt, sync_every=cfg["h"], num_fragments=cfg["f"],
                        host_group=host)
        g = torch.Generator().manual_seed(seed + rank)
        steps = []
        for _ in range(2 * cfg["h"]):
            opt.zero_grad()
            model(torch.randn(2, w, generator=g)).square().mean().backward()
            with traffic() as t:
                diloco.step()
            steps.append(t.sum("bus_bytes", phase=DiLoCo.OUTER_PHASE))
        diloco.close()
        out.append((sum(p.numel() for p in model.parameters()), steps))
    return out


def _pair(call: str, got) -> tuple[float, float]:
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        raise ExerciseError(f"{call} returned {got!r}; return a pair (average, "
                            "peak) of bytes")
    return as_number(f"{call}'s average", got[0]), as_number(f"{call}'s peak", got[1])


def _compare_diloco(call: str, got, want, params: int, n: int, h: int, f: int,
                    against: tuple[str, str]) -> None:
    slips = _diloco_slips(params, n, h, f)
    for k, name in enumerate(("average", "peak")):
        if close_to(got[k], want[k]):
            continue
        hint = slips_named(got[k], want[k], slips[name], (
            "the outer step is one ring all-reduce of the fp32 model, "
            "2(N-1)/N x 4 bytes a parameter: once every H inner steps in all "
            "(the average), one fragment of 1/F in the busiest step (the peak)"))
        raise ExerciseError(f"{call}: your {name} is {got[k]:,.1f} B a step, but "
                            f"{against[k]}. Hint: {hint}")


def check_diloco_bytes(cluster, fn, *, timeout: float = 30.0) -> bool:
    """`fn(params, ranks, sync_every, fragments)`: (average, peak) bytes one rank
    sends per inner step in DiLoCo's outer all-reduces (fp32, a ring over all
    `ranks`). Two models drawn this run are trained on the cluster's ranks (hosts
    of 2, DiLoCo then Streaming DiLoCo) and the answer is held to the bus bytes
    the traffic ledger measured in DiLoCo.OUTER_PHASE; five larger settings to
    the check's own closed form. labkit's diloco_traffic, DiLoCo and ledgers are
    refused in the answer: it is a prediction."""
    cluster = labkit_cluster(cluster)
    n = cluster.world_size
    if n < 4 or n % 2:
        raise ValueError(f"check_diloco_bytes needs hosts of 2 ranks and 2 hosts or "
                         f"more: an even world of 4 or more, not {n}")
    measured, computed = _diloco_cases(fresh_seed())
    ran = [(_params(cfg), n, cfg["h"], cfg["f"]) for cfg in measured]
    answers = {}
    for args in ran + computed:  # first the answers: a stub stops here
        call = "my_diloco_bytes({}, {}, {}, {})".format(*args)
        got = call_refusing(call, fn, args, "my_diloco_bytes", _DILOCO_OWN,
                            "DiLoCo prices, wrapper or ledger (measuring, not "
                            "predicting), or this check's")
        if got is NOT_WRITTEN:
            return NOT_YET
        answers[args] = (call, _pair(call, got))
    res = run_answer(cluster, _diloco_worker, measured, fresh_seed(),
                     what="DiLoCo run", timeout=timeout)
    for cfg_k, args in enumerate(ran):
        call, got = answers[args]
        want = _diloco_exact(*args)
        for rank, runs in enumerate(res):
            params, steps = runs[cfg_k]
            avg, peak = sum(steps) / len(steps), max(steps)
            if params != args[0] or not (close_to(avg, want[0])
                                         and close_to(peak, want[1])):
                raise RuntimeError(  # labkit's wrapper against this check's count
                    f"rank {rank}: DiLoCo over {params:,} parameters sent "
                    f"{steps} B a step; the check counts {args[0]:,} parameters "
                    f"and (average, peak) {float(want[0]):,.1f}, "
                    f"{float(want[1]):,.1f} B")
            what = (f"over {len(steps)} inner steps rank {rank} sent {{}} "
                    "(its traffic ledger, DiLoCo.OUTER_PHASE)")
            _compare_diloco(call, got, (avg, peak), *args, against=(
                what.format(f"{avg:,.1f} B a step on average"),
                what.format(f"at most {peak:,.1f} B in a step")))
    for args in computed:
        call, got = answers[args]
        want = _diloco_exact(*args)
        _compare_diloco(call, got, want, *args, against=(
            f"expected {float(want[0]):,.1f} B", f"expected {float(want[1]):,.1f} B"))
    shapes = " and ".join(f"H = {c['h']}, F = {c['f']}" for c in measured)
    print(f"correct: your bytes are what every rank's traffic ledger measured in "
          f"the outer all-reduces of two DiLoCo runs on {n} ranks ({shapes}, "
          f"models drawn this run), and the check's own closed form on "
          f"{len(computed)} larger settings")
    return PASSED


def _params(cfg: dict) -> int:
    w = cfg["width"]
    return cfg["layers"] * (w * w + (w if cfg["bias"] else 0))
