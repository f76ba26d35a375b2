"""Chapter 13's checks: a cluster's checkpoint interval (Young), the bytes a DiLoCo
step sends, the hung rank in flight-recorder dumps, and an exact resume.

Imports labkit.checks' common and verify and labkit.runtime; torch, numpy,
labkit.parallel and labkit.ledger inside functions. Every check draws its cases
afresh each run and computes its reference by its own arithmetic, refusing in the
answer the labkit function the chapter teaches; the bytes are also held to the
traffic ledger, the hung rank to a real hang, and the resume to a run on the
ranks that one rank's SIGKILL stops and the answer's own checkpoint resumes.
"""

from __future__ import annotations

import math
import os
import random
import tempfile
from fractions import Fraction

from labkit.checks.common import (
    NOT_WRITTEN,
    NOT_YET,
    PASSED,
    SHORT_TIMEOUT,
    ExerciseError,
    as_number,
    close_to,
    is_whole,
    labkit_cluster,
    run_answer,
    slips_named,
)
from labkit.checks.explain import (
    failure_message,
    student_frame,
)
from labkit.checks.verify import call_refusing, fresh_seed, own_calls, refuse_own
from labkit.checks.watch import AnswerRaised, watched
from labkit.runtime import CollectiveTimeout, Entry, GroupLog, RankError

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


# ------------------------------------------ exercise 3: the hung rank in a dump

_KEEP = 8  # entries of each group a record keeps, as runtime.flight.read_recorder
# labkit's own comparison of the records, and this check's
_HUNG_OWN = ("labkit.runtime.flight:find_mismatch", "labkit.checks.failures:_missed",
             "labkit.checks.failures:_simulate")
_KINDS = (("all_reduce", True), ("broadcast", True), ("all_gather", True),
          ("barrier", False))
_DTYPES = ("Float", "Float", "BFloat16", "Long")


def _draw_kind(rng: random.Random) -> tuple:
    """(op, sizes, dtypes) of one collective, as the recorder writes them."""
    op, tensor = rng.choice(_KINDS)
    if not tensor:
        return (op, (), ())
    shape = (rng.choice((8, 16, 64, 1024)),) if rng.random() < 0.7 else (
        rng.choice((2, 4)), rng.choice((8, 32)))
    return (op, (shape,), (rng.choice(_DTYPES),))


def _simulate(world: int, groups: dict, program: list, skip: int, skipper: int,
              ahead: bool) -> dict:
    """Every rank's record when each walks `program` ((group id, kind) a
    collective) entering the collectives of its groups, each waiting inside a
    collective until all its group's members entered it; `skipper` never enters
    collective `skip`: it stops there, or (ahead) goes on to the next."""
    entries = {r: {} for r in range(world)}  # rank -> gid -> [Entry]
    entrants = [set() for _ in program]
    at, inside, stopped = [0] * world, [None] * world, [False] * world
    moved = True
    while moved:
        moved = False
        for r in range(world):
            j = inside[r]
            if j is not None:  # waiting: done once every member entered it
                if entrants[j] != set(groups[program[j][0]]):
                    continue
                inside[r], moved = None, True
            while not stopped[r] and inside[r] is None and at[r] < len(program):
                j = at[r]
                at[r] += 1
                gid, (op, sizes, dtypes) = program[j]
                if r not in groups[gid]:
                    continue
                if j == skip and r == skipper:
                    stopped[r] = not ahead
                    continue
                log = entries[r].setdefault(gid, [])
                log.append(Entry(len(log) + 1, op, sizes, dtypes))
                entrants[j].add(r)
                inside[r], moved = j, True
    done = {}  # rank -> gid -> collectives of it that finished
    for j, (gid, _) in enumerate(program):
        if entrants[j] == set(groups[gid]):
            for r in entrants[j]:
                done.setdefault(r, {}).setdefault(gid, 0)
                done[r][gid] += 1
    return {r: {gid: GroupLog(_group_name(gid, groups[gid]), len(log),
                              done.get(r, {}).get(gid, 0), tuple(log[-_KEEP:]))
                for gid, log in sorted(entries[r].items(), key=lambda g: int(g[0]))}
            for r in range(world)}


def _group_name(gid: str, members) -> str:
    return "default group" if gid == "0" else f"group {gid} (ranks {list(members)})"


def _kind_at(log: GroupLog, seq: int):
    """What a rank entered as #seq of a group: (op, sizes, dtypes); None when it
    is older than the entries its record keeps."""
    for e in log.last:
        if e.seq == seq:
            return (e.op, tuple(e.sizes), tuple(e.dtypes))
    return None


def _missed(records: dict) -> list[tuple[int, str, int]]:
    """(rank, group id, seq) of every collective that each other member of its
    group entered, all as one op, and that rank did not: it entered fewer, or
    entered another op under that number. Ranks are the group's members whose
    records hold it."""
    found = []
    gids = sorted({g for rec in records.values() if rec for g in rec},
                  key=lambda g: (not g.isdigit(), int(g) if g.isdigit() else g))
    for gid in gids:
        logs = {r: rec[gid] for r, rec in sorted(records.items()) if rec and gid in rec}
        top = max(log.entered for log in logs.values())
        for r, mine in logs.items():
            others = [log for q, log in logs.items() if q != r]
            for seq in range(1, top + 1):
                if not others or any(log.entered < seq for log in others):
                    break
                kinds = {_kind_at(log, seq) for log in others} - {None}
                if len(kinds) > 1:
                    break
                if mine.entered < seq or (kinds and _kind_at(mine, seq) not in (
                        None, *kinds)):
                    found.append((r, gid, seq))
                    break
    return found


def _draw_dump(rng: random.Random, where: str, ahead: bool):
    """One drawn hang: (records, (rank, gid, seq)), the hang in a subgroup or
    the default group ("sub" / "default"), its skipper stopped or gone ahead
    into another op of that group; None when the draw is not one hang that
    the records name alone (the caller draws again)."""
    world = rng.randint(4, 8)
    ids = [str(rng.randint(1, 4) + k) for k in range(rng.randint(1, 3))]
    groups = {"0": tuple(range(world))}
    for gid in ids:
        groups[gid] = tuple(sorted(rng.sample(range(world), rng.randint(
            2, world - 1))))
    subs = [g for g in ids if not ahead or len(groups[g]) >= 3]
    if where == "sub" and not subs:
        return None
    program = [(rng.choice(["0", "0"] + ids), _draw_kind(rng))
               for _ in range(rng.randint(8, 18))]
    target = rng.choice(subs) if where == "sub" else "0"
    j = rng.randint(len(program) // 3, len(program) - 1)
    program.insert(j, (target, _draw_kind(rng)))
    if ahead:  # the skipper's next collective: another op of the same group
        other = _draw_kind(rng)
        if other == program[j][1]:
            return None
        program.insert(j + 1, (target, other))
    k = sum(1 for g, _ in program[:j + 1] if g == target)
    if k < 2:
        return None  # every member holds the group's record: it entered one
    skipper = rng.choice(groups[target])
    records = _simulate(world, groups, program, j, skipper, ahead)
    want = (skipper, target, k)
    return (records, want) if _missed(records) == [want] else None


def _dump_cases(seed: int) -> list[tuple[dict, tuple, str]]:
    """Five dumps drawn this run: the hang in a subgroup (twice: the skipper
    stopped, and gone ahead into another op), in the default group (both
    ways), and one either way."""
    rng = random.Random(seed)
    slots = [("sub", False), ("sub", True), ("default", False), ("default", True),
             (rng.choice(("sub", "default")), rng.random() < 0.5)]
    cases = []
    for where, ahead in slots:
        got = None
        while got is None:
            got = _draw_dump(rng, where, ahead)
        how = "went on into another op" if ahead else "stopped"
        cases.append((*got, f"a hang drawn this run (its skipper {how})"))
    return cases


def _hang_plan(seed: int, world: int) -> dict:
    """A real hang to run: groups nested (each inside the one before, so that
    every rank numbers them alike), a short program on them, and the skipper
    and collective it never calls, in a subgroup two times in three."""
    rng = random.Random(seed)
    outer = sorted(rng.sample(range(world), world - 1))
    inner = sorted(rng.sample(outer, 2))
    members = {"world": list(range(world)), "outer": outer, "inner": inner}
    while True:
        program = [(rng.choice(list(members)), rng.choice(
            ("all_reduce", "broadcast", "all_gather", "barrier")),
            rng.choice((4, 8, 16))) for _ in range(rng.randint(6, 9))]
        place = "world" if rng.random() < 1 / 3 else rng.choice(("outer", "inner"))
        # the one skipped must hold every other member of its group: a
        # broadcast's root can send and go on without a receiver, and a
        # barrier counts twice in gloo's recorder status
        spots = [j for j, (g, op, _) in enumerate(program) if g == place
                 and op in ("all_reduce", "all_gather")
                 and any(q == place for q, _, _ in program[:j]) and j >= 2]
        if spots:
            skip = rng.choice(spots)
            return dict(members=members, program=program, skip=skip,
                        skipper=rng.choice(members[place]))


_CHAIN: dict = {}  # on a rank: the hang's groups, made before it (new_group)


def _hang_groups(rank, world_size, members):
    """Make the plan's groups, every rank in this order (a collective), and
    import what the hang runs: its timeout then measures collectives alone."""
    import torch.distributed as dist

    _CHAIN.clear()
    _CHAIN.update({"world": None}, **{name: dist.new_group(members[name])
                                      for name in ("outer", "inner")})


def _hang_worker(rank, world_size, plan):
    """Run the plan's collectives; the skipper sleeps instead of the one it
    skips, so that the others wait in it until the call's timeout."""
    import time

    import torch
    import torch.distributed as dist

    made = _CHAIN
    for j, (name, op, n) in enumerate(plan["program"]):
        if rank not in plan["members"][name]:
            continue
        if j == plan["skip"] and rank == plan["skipper"]:
            time.sleep(60)  # never enters it; stopped at the timeout
        group, x = made[name], torch.ones(n)
        if op == "all_reduce":
            dist.all_reduce(x, group=group)
        elif op == "broadcast":
            dist.broadcast(x, group=group, group_src=0)
        elif op == "all_gather":
            size = len(plan["members"][name])
            dist.all_gather([torch.empty(n) for _ in range(size)], x, group=group)
        else:
            dist.barrier(group=group)


_HANG_TIMEOUT = 1.5  # seconds: the plan's collectives take milliseconds


def _real_hang(cluster, seed: int, timeout: float = SHORT_TIMEOUT):
    """(records, (rank, gid, seq), what) of a hang run on fresh ranks (a
    record numbers the groups a process made: fresh ranks number them alike)."""
    plan = _hang_plan(seed, cluster.world_size)
    cluster.restart()
    cluster.run(_hang_groups, plan["members"], timeout=timeout)
    try:
        cluster.run(_hang_worker, plan, timeout=_HANG_TIMEOUT)
    except CollectiveTimeout as err:
        records = dict(err.collectives)
    else:
        raise RuntimeError("the check's hang did not time out")
    name, op, _ = plan["program"][plan["skip"]]
    members = set(plan["members"][name])
    gids = [g for g in {g for rec in records.values() if rec for g in rec}
            if {r for r, rec in records.items() if rec and g in rec} == members]
    k = sum(1 for q, _, _ in plan["program"][:plan["skip"] + 1] if q == name)
    want = (plan["skipper"], "0" if name == "world" else (gids or ["?"])[0], k)
    if _missed(records) != [want]:  # labkit's recorder against what was run
        raise RuntimeError(f"the check's hang: rank {want[0]} skipped {op} #{k} of "
                           f"the group of ranks {sorted(members)}, but the flight "
                           f"recorders say {_entered(records)}")
    return records, want, f"a real hang the check ran on the {cluster.world_size} ranks"


def _entered(records: dict) -> str:
    return "; ".join(f"rank {r}: " + ", ".join(
        f"group {g} {log.entered}" for g, log in (rec or {}).items())
        for r, rec in sorted(records.items()))


def _as_answer(call: str, got) -> tuple[int, str, int]:
    if not isinstance(got, (tuple, list)) or len(got) != 3:
        raise ExerciseError(f"{call} returned {got!r}; return (rank, group id, "
                            "seq): the rank, the group and the number of the first "
                            "collective that rank did not enter")
    rank, gid, seq = got
    if not (is_whole(rank) and is_whole(seq)) or not isinstance(gid, (str, int)) \
            or isinstance(gid, bool):
        raise ExerciseError(f"{call} returned {got!r}; the rank and seq are whole "
                            "numbers and the group id a key of the records (\"0\" "
                            "is the default group)")
    return int(rank), str(gid), int(seq)


def _hung_hint(records: dict, got, want) -> str:
    rank, gid, seq = want
    mine = records[rank][gid]
    in_zero = {r: rec["0"].entered for r, rec in records.items() if rec and "0" in rec}
    fewest = min(in_zero, key=lambda r: (in_zero[r], r)) if in_zero else None
    if gid != "0" and fewest is not None and got == (fewest, "0",
                                                     in_zero[fewest] + 1):
        return ("that is the rank with the fewest collectives in the default group; "
                "this hang is in another group: look at every group's records")
    if got[0] != rank:
        if mine.entered >= seq:
            return (f"in group {gid!r} every rank entered #{seq}, but not all as one "
                    "op: compare what each rank entered under each number (op, "
                    "sizes, dtypes), not only how many")
        if _waiting(records, got[0]):
            return (f"rank {got[0]} entered a collective some of its group's ranks "
                    "did not, and waits inside it: the ranks stuck in a collective "
                    "are the healthy ones; find a collective that every rank of its "
                    "group but one entered")
        return ("find a collective that every rank of its group but one entered; "
                "that one is the hung rank")
    if got[1] != gid:
        return (f"rank {rank} is the one, but the collective it did not enter is in "
                f"another group: the one where each of its other ranks entered a "
                f"collective and rank {rank} did not")
    if got[2] == mine.entered and mine.entered < seq:
        return (f"#{got[2]} is the last collective rank {rank} entered in group "
                f"{gid!r}; return the first it did not enter")
    if mine.entered >= seq:
        return (f"rank {rank} entered as many collectives of group {gid!r} as the "
                f"others, but under #{seq} another op than theirs: that is the "
                "first it did not enter")
    return f"count the collectives of group {gid!r} each rank entered"


def _waiting(records: dict, rank: int) -> bool:
    """`rank` entered a collective that some rank of its group did not."""
    return any(log.entered > min(rec[g].entered for rec in records.values()
                                 if rec and g in rec)
               for g, log in (records.get(rank) or {}).items())


def check_hung(cluster, fn, *, timeout: float = SHORT_TIMEOUT) -> bool:
    """`fn(records)`: (rank, group id, seq) of the first collective a rank did
    not enter, from every rank's flight-recorder record, {rank: {group id:
    GroupLog}}. Five dumps drawn this run (4 to 8 ranks, subgroups, the skipper
    stopped or gone ahead into another op) and one of a real hang the check runs
    on the cluster (about 2 s). labkit's find_mismatch is refused."""
    cluster = labkit_cluster(cluster)
    if cluster.world_size < 3:
        raise ValueError(f"check_hung needs 3 ranks or more; the cluster has "
                         f"{cluster.world_size}")
    seed = fresh_seed()
    cases = _dump_cases(seed)
    real = None
    for k in range(len(cases) + 1):
        if k == len(cases):  # drawn ones first: a stub stops before the hang
            real = _real_hang(cluster, seed, timeout)
            cases.append(real)
        records, want, what = cases[k]
        call = f"my_hung(records) on {what}"
        got = call_refusing(
            call, fn, (_copy_records(records),), "my_hung", _HUNG_OWN,
            "comparison of the records (find_mismatch), or this check's")
        if got is NOT_WRITTEN:
            return NOT_YET
        got = _as_answer(call, got)
        if got == want:
            continue
        raise ExerciseError(
            f"{call}: you said rank {got[0]}, group {got[1]!r}, #{got[2]}; the "
            f"collectives each rank entered, by group: {_entered(records)}. "
            f"Hint: {_hung_hint(records, got, want)}")
    rank, gid, seq = real[1]
    print(f"correct: you found the hung rank in {len(cases) - 1} dumps drawn this "
          f"run and in a real hang's (rank {rank} never entered #{seq} of group "
          f"{gid!r})")
    return PASSED


def _copy_records(records: dict) -> dict:
    """A copy the answer may change without changing the check's."""
    return {r: (dict(rec) if rec is not None else None) for r, rec in records.items()}


# --------------------------------------- exercise 4: what an exact resume saves

# labkit's own checkpointing (the training state, its random streams, the files
# under it), and this check's own
_RESUME_OWN = tuple(f"labkit.parallel.resume:{f}" for f in (
    "save_train_state", "load_train_state", "rng_state", "set_rng_state")) + (
    "labkit.parallel.checkpoint_files", "labkit.parallel.sharded_checkpoint",
    "labkit.checks.failures:_own_save", "labkit.checks.failures:_own_load")
_PIECES = {
    "weights": "the model's weights",
    "optimizer": "the optimizer's state (AdamW's moments and step count)",
    "sampler": "the sampler's position",
    "torch": "torch's random stream (dropout)",
    "numpy": "numpy's random stream (the input noise)",
    "python": "Python's random stream (the input scale)",
}
_FIX = {
    "weights": "load model.state_dict() back into the model",
    "optimizer": "save optimizer.state_dict() and load it back: without it AdamW "
                 "starts its moments from zero",
    "sampler": "save sampler.state_dict() and load it back (load_state_dict): "
               "without it the data starts the epoch again",
    "rng": "save each rank's random states, torch.get_rng_state(), "
           "np.random.get_state() and random.getstate(), and set them back, last, "
           "in my_load",
    "torch": "save torch.get_rng_state() and set it back (torch.set_rng_state)",
    "numpy": "save np.random.get_state() and set it back (np.random.set_state)",
    "python": "save random.getstate() and set it back (random.setstate)",
}
_STREAMS = ("torch", "numpy", "python")


def _resume_case(seed: int, world: int) -> dict:
    """A run drawn this run: data, model, dropout, steps crossing an epoch, the
    rank killed and the step it is killed at (the last save before it: the even
    step at or below it)."""
    rng = random.Random(seed)
    batch = world * rng.choice((2, 3))
    per_epoch = rng.randint(2, 3)
    steps = rng.randint(5, 6)
    kill_at = rng.randint(3, steps - 1)
    return dict(seed=rng.randrange(10**6), data_seed=rng.randrange(10**6),
                samples=batch * per_epoch + rng.randrange(batch), batch=batch,
                per_epoch=per_epoch, inputs=rng.randint(4, 8),
                width=rng.choice((8, 12, 16)), classes=rng.randint(2, 4),
                p=round(rng.uniform(0.15, 0.4), 2), lr=round(rng.uniform(0.005, 0.03),
                                                            3),
                noise=round(rng.uniform(0.02, 0.1), 3), steps=steps, kill_at=kill_at,
                saved=2 * (kill_at // 2), victim=rng.randrange(world))


def _data(case: dict):
    import torch

    g = torch.Generator().manual_seed(case["data_seed"])
    return (torch.randn(case["samples"], case["inputs"], generator=g),
            torch.randint(0, case["classes"], (case["samples"],), generator=g))


def _job(rank: int, world_size: int, case: dict, other: bool = False):
    """The model (with dropout, rank 0's weights on every rank), AdamW and the
    sampler of one rank, its streams seeded its own (other: seeded otherwise,
    as a run that went elsewhere)."""
    from types import SimpleNamespace

    import numpy as np
    import torch
    import torch.distributed as dist
    from torch import nn

    from labkit.parallel import ResumableSampler

    seed = case["seed"] + rank + (7919 if other else 0)
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    model = nn.Sequential(nn.Linear(case["inputs"], case["width"]), nn.Tanh(),
                          nn.Dropout(case["p"]), nn.Linear(case["width"],
                                                           case["classes"]))
    params = list(model.parameters())
    with torch.no_grad():  # one broadcast of every weight
        flat = torch.cat([p.reshape(-1) for p in params])
        dist.broadcast(flat, src=0)
        for p, v in zip(params, flat.split([p.numel() for p in params])):
            p.copy_(v.view_as(p))
    opt = torch.optim.AdamW(params, lr=case["lr"])
    sampler = ResumableSampler(case["samples"], case["batch"], seed=case["seed"] % 997,
                               dp_rank=rank, dp_size=world_size)
    return SimpleNamespace(model=model, opt=opt, sampler=sampler, world=world_size)


def _train(job, data, case: dict, steps: int) -> None:
    """`steps` steps of data parallelism: this rank's indices, its inputs with
    numpy's noise and Python's scale, dropout, the gradients averaged (one
    all-reduce), AdamW."""
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    X, Y = data
    params = list(job.model.parameters())
    for _ in range(steps):
        idx = next(job.sampler)
        job.opt.zero_grad()
        noise = torch.from_numpy(np.random.standard_normal(tuple(X[idx].shape)))
        x = (X[idx] + case["noise"] * noise.float()) * (1 + 0.1 * random.random())
        F.cross_entropy(job.model(x), Y[idx]).backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat)
        flat.div_(job.world)
        for p, g in zip(params, flat.split([p.numel() for p in params])):
            p.grad.copy_(g.view_as(p))
        job.opt.step()


def _params_of(job) -> dict:
    return {k: v.detach().clone() for k, v in job.model.state_dict().items()}


def _snapshot(job) -> dict:
    """Everything the run's next steps depend on, copied."""
    import copy

    import numpy as np
    import torch

    return {"weights": _params_of(job), "optimizer": copy.deepcopy(
        job.opt.state_dict()), "sampler": (job.sampler.epoch, job.sampler.step),
        "torch": torch.get_rng_state(), "numpy": np.random.get_state(),
        "python": random.getstate()}


def _same(a, b) -> bool:
    """Nested dicts, lists, tuples, tensors and arrays alike, bit for bit."""
    import numpy as np
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _differs(a: dict, b: dict) -> list[str]:
    return [k for k in _PIECES if not _same(a[k], b[k])]


def _step_value(x):
    """What my_load returned, as something that travels: an int, or its repr."""
    return int(x) if is_whole(x) else repr(x)[:80]


def _own_save(folder: str, job, rank: int, step: int) -> None:
    """The check's own checkpoint of this rank (the resumes it compares with)."""
    import torch

    state = _snapshot(job)
    state["sampler"] = job.sampler.state_dict()
    torch.save({**state, "step": step}, os.path.join(folder, f"rank{rank}.pt"))


def _own_load(folder: str, job, rank: int, leave_out: str) -> None:
    """Load the check's checkpoint, but for the piece `leave_out` ("rank q":
    every stream from rank q's file instead of this rank's)."""
    import numpy as np
    import torch

    state = torch.load(os.path.join(folder, f"rank{rank}.pt"), weights_only=False)
    if leave_out != "weights":
        job.model.load_state_dict(state["weights"])
    if leave_out != "optimizer":
        job.opt.load_state_dict(state["optimizer"])
    if leave_out != "sampler":
        job.sampler.load_state_dict(state["sampler"])
    if leave_out.startswith("rank "):
        state = torch.load(os.path.join(folder, f"rank{leave_out[5:]}.pt"),
                           weights_only=False)
    setters = {"torch": torch.set_rng_state, "numpy": np.random.set_state,
               "python": random.setstate}
    for stream, put in setters.items():
        if leave_out not in (stream, "rng"):
            put(state[stream])


def _resume_first(rank, world_size, my_save, my_load, case, scratch):
    """On each rank: the answer's save and load once (what the save moved, what
    the load left out, its step, labkit's own code called), then the unbroken
    run's weights."""
    data = _data(case)
    job = _job(rank, world_size, case)
    # into the second epoch, at an odd step (the run's saves are at even ones)
    first = case["per_epoch"] + (1 if case["per_epoch"] % 2 == 0 else 2)
    _train(job, data, case, first)
    before = _snapshot(job)
    with own_calls(*_RESUME_OWN) as own:
        my_save(scratch, job.model, job.opt, job.sampler, first)
    moved = _differs(before, _snapshot(job))
    elsewhere = _job(rank, world_size, case, other=True)  # another run's state
    _train(elsewhere, data, case, 1)
    with own_calls(*_RESUME_OWN) as own_load:
        start = my_load(scratch, elsewhere.model, elsewhere.opt, elsewhere.sampler)
    lost = _differs(before, _snapshot(elsewhere))
    whole = _job(rank, world_size, case)
    _train(whole, data, case, case["steps"])
    return dict(own=own + own_load, moved=moved, lost=lost, start=_step_value(start),
                saved=first, params=_params_of(whole))


def _resume_killed(rank, world_size, my_save, case, folder, ref):
    """Train with the answer's save (and the check's own) every 2 steps; rank
    `victim` is killed with SIGKILL when step `kill_at` begins."""
    import signal

    data = _data(case)
    job = _job(rank, world_size, case)
    for step in range(case["steps"]):
        if step == case["kill_at"] and rank == case["victim"]:
            os.kill(os.getpid(), signal.SIGKILL)  # no cleanup: a node lost
        _train(job, data, case, 1)
        if (step + 1) % 2 == 0:
            _own_save(ref, job, rank, step + 1)
            my_save(folder, job.model, job.opt, job.sampler, step + 1)


def _resume_again(rank, world_size, my_load, case, folder):
    """New ranks: build the run, the answer's load, train to the end."""
    data = _data(case)
    job = _job(rank, world_size, case)
    with own_calls(*_RESUME_OWN) as own:
        start = my_load(folder, job.model, job.opt, job.sampler)
    start = _step_value(start)
    params = None
    if start == case["saved"]:
        _train(job, data, case, case["steps"] - start)
        params = _params_of(job)
    return dict(own=own, start=start, params=params)


def _resume_without(rank, world_size, case, ref, variants):
    """The check's own resumes from its own checkpoint, each leaving one piece
    out: their weights at the end."""
    data = _data(case)
    out = {}
    for leave_out in variants:
        job = _job(rank, world_size, case)
        _own_load(ref, job, rank, leave_out)
        _train(job, data, case, case["steps"] - case["saved"])
        out[leave_out] = _params_of(job)
    return out


def _first_difference(a: dict, b: dict) -> str | None:
    for k in b:
        if not _same(a[k], b[k]):
            return f"{k} differs by up to {(a[k] - b[k]).abs().max().item():.2e}"
    return None


def _step_problem(call: str, start, saved: int) -> None:
    if start != saved:  # an int, or the repr of what it was
        raise ExerciseError(
            f"{call} returned {start}, but the checkpoint my_save wrote was saved "
            f"after step {saved}: return the step saved with it (the next step to "
            "run)")


def check_resume(cluster, my_save, my_load, *, timeout: float = 20.0) -> bool:
    """`my_save(path, model, optimizer, sampler, step)` and `my_load(path, model,
    optimizer, sampler) -> step` (path a folder, the same on every rank).
    A data-parallel run drawn this run (dropout, numpy's and Python's draws in
    its inputs, steps past an epoch) trains unbroken; then with my_save every 2
    steps, one rank SIGKILLed mid-run, and new ranks resumed with my_load: the
    weights must equal the unbroken run's bit for bit. When they do not, the
    check runs resumes of its own that leave one piece out and names the one
    yours matches. labkit's save_train_state and load_train_state are refused."""
    import shutil

    cluster = labkit_cluster(cluster)
    case = _resume_case(fresh_seed(), cluster.world_size)
    top = tempfile.mkdtemp(prefix="labkit-resume-")
    folder, ref, scratch = (os.path.join(top, d) for d in ("yours", "check", "once"))
    for d in (folder, ref, scratch):
        os.mkdir(d)
    try:
        return _check_resume(cluster, my_save, my_load, case, folder, ref, scratch,
                             timeout)
    finally:
        shutil.rmtree(top, ignore_errors=True)


def _check_resume(cluster, my_save, my_load, case, folder, ref, scratch,
                  timeout: float) -> bool:
    first = run_answer(cluster, _resume_first, my_save, my_load, case, scratch,
                       what="my_save and my_load", timeout=timeout, prepare=False)
    if first is None:
        return NOT_YET
    saved = first[0]["saved"]
    for rank, r in enumerate(first):
        refuse_own(f"rank {rank}, my_save then my_load", r["own"],
                   "checkpointing (save_train_state, load_train_state, rng_state), "
                   "or this check's")
        if r["moved"]:
            raise ExerciseError(
                f"rank {rank}: your my_save changed "
                f"{_and([_PIECES[p] for p in r['moved']])} of the run it saved: a "
                "save must leave the run as it was (draw nothing, step nothing)")
        _step_problem(f"rank {rank}: my_load", r["start"], saved)
    whole = [r["params"] for r in first]
    try:
        cluster.run(watched, _resume_killed, my_save, case, folder, ref,
                    timeout=timeout)
    except RankError as err:
        _killed_as_planned(err, case["victim"])
    else:
        raise RuntimeError("the check's run was not stopped: its rank "
                           f"{case['victim']} was to be killed")
    again = run_answer(cluster, _resume_again, my_load, case, folder,
                       what="my_load", timeout=timeout, prepare=False)
    if again is None:
        return NOT_YET
    for rank, r in enumerate(again):
        refuse_own(f"rank {rank}, my_load", r["own"], "checkpointing "
                   "(load_train_state, set_rng_state), or this check's")
        _step_problem(f"rank {rank}: my_load", r["start"], case["saved"])
    run = (f"rank {case['victim']} was killed with SIGKILL when step "
           f"{case['kill_at']} began, and new ranks resumed from what your my_save "
           f"wrote after step {case['saved']}")
    bad = [(rank, _first_difference(r["params"], w))
           for rank, (r, w) in enumerate(zip(again, whole))]
    bad = [(rank, d) for rank, d in bad if d]
    if not bad:
        print(f"correct: {run}; after all {case['steps']} steps every rank's "
              "weights equal the unbroken run's, bit for bit")
        return PASSED
    rank, diff = bad[0]
    msg = (f"{run}: after all {case['steps']} steps, rank {rank}'s {diff} from "
           "the unbroken run's.")
    raise ExerciseError(msg + _resume_diagnosis(cluster, case, ref, again, first))


def _killed_as_planned(err: RankError, victim: int) -> None:
    """Nothing if the run stopped because `victim` died; ExerciseError naming
    the answer's line if my_save raised."""
    mine = [e for e in err.exceptions.values() if isinstance(e, AnswerRaised)
            and student_frame(e.frames) is not None]
    if mine or victim not in err.failures:
        raise ExerciseError(failure_message(err, "my_save"))


def _resume_diagnosis(cluster, case, ref, again, first) -> str:
    """Which piece the answer's resume leaves out: the check's resume that ends
    with its weights, bit for bit; with what the load lost in the first try."""
    variants = ["everything", "sampler", "rng", *_STREAMS, "optimizer", "weights"]
    variants += [f"rank {q}" for q in range(cluster.world_size)]
    runs = run_answer(cluster, _resume_without, case, ref, variants,
                      what="the check's own resumes", timeout=20.0, prepare=False)
    whole = [r["params"] for r in first]
    for rank, r in enumerate(runs):
        if _first_difference(r["everything"], whole[rank]):
            raise RuntimeError(f"rank {rank}: the check's own resume differs from "
                               "the unbroken run")
    same = [v for v in variants[1:] if all(
        _first_difference(a["params"], r[v]) is None for a, r in zip(again, runs))]
    lost = sorted({p for r in first for p in r["lost"]}, key=list(_PIECES).index)
    out, explained = "", set()
    if same:
        v = same[0]
        explained = set(_STREAMS) if v == "rng" or v.startswith("rank ") else {v}
        if v.startswith("rank "):
            out = (f" They equal, bit for bit, those of a resume in which every rank "
                   f"took {v}'s random streams. Hint: each rank has its own; save a "
                   "file a rank (named by dist.get_rank()) and load each rank's own")
        else:
            what = "every random stream" if v == "rng" else _PIECES[v]
            out = (f" They equal, bit for bit, those of a resume of the check's own "
                   f"that leaves out {what}. Hint: {_FIX[v]}")
    rest = [p for p in lost if p not in explained]
    if rest:
        out += (f"{'. Also, l' if out else ' Hint: l'}oaded into a run in another "
                f"state, your my_load left {_and([_PIECES[p] for p in rest])} as that "
                f"run had {'it' if len(rest) == 1 else 'them'}: "
                + "; ".join(_FIX[p] for p in rest))
    if not out:
        out = (" Hint: an exact resume brings back the weights, the optimizer's "
               "state, the sampler's position and every rank's torch, numpy and "
               "Python random streams")
    return out


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]
