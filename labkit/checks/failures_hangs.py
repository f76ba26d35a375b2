"""Chapter 13's exercise 3: the hung rank in every rank's flight-recorder record,
{rank: {group id: GroupLog}}, on five dumps drawn each run (ranks simulated
entering their groups' collectives, one rank skipping one) and on the dump of a
real hang the check runs on the cluster's ranks.

Imports labkit.checks' common and verify and labkit.runtime; torch inside
functions. The reference (_missed) is the check's own, held to the recorders of
the real hang; labkit's find_mismatch is refused in the answer.
"""

from __future__ import annotations

import random

from labkit.checks.common import (
    NOT_WRITTEN,
    NOT_YET,
    PASSED,
    SHORT_TIMEOUT,
    ExerciseError,
    is_whole,
    labkit_cluster,
)
from labkit.checks.verify import call_refusing, fresh_seed
from labkit.runtime import CollectiveTimeout, Entry, GroupLog

_KEEP = 8  # entries of each group a record keeps, as runtime.flight.read_recorder
# labkit's own comparison of the records, and this check's
_HUNG_OWN = ("labkit.runtime.flight:find_mismatch",
             "labkit.checks.failures_hangs:_missed",
             "labkit.checks.failures_hangs:_simulate")
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
