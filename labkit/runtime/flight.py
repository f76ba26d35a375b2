"""Which rank did not enter which collective: PyTorch's flight recorder, read on
each rank, and the mismatch found across ranks in the kernel.

Standard library at import; torch inside `read_recorder` (a rank's side). Ranks
run with TORCH_FR_BUFFER_SIZE set (Cluster), so torch keeps a ring buffer of each
rank's last collectives. On gloo (torch 2.13) it records a collective's op,
sequence number in its group, sizes and dtypes, and the group; not point-to-point
send/recv, not when a collective started or finished (its state stays
"scheduled"), and no Python line: the status line says where a rank was."""

from __future__ import annotations

import json
from dataclasses import dataclass

KEEP = 8  # of each group's entries, the last this many travel to the kernel


@dataclass(frozen=True)
class Entry:
    """One collective as the recorder saw it on one rank."""

    seq: int  # its number in its group, from 1
    op: str  # "all_reduce"
    sizes: tuple  # input shapes, e.g. ((8,),)
    dtypes: tuple  # ("Float",)

    def describe(self) -> str:
        """'all_reduce #4 of [8] float32'."""
        tensors = ", ".join(f"{list(s)} {_DTYPES.get(d, d)}"
                            for s, d in zip(self.sizes, self.dtypes))
        return f"{self.op} #{self.seq}" + (f" of {tensors}" if tensors else "")


# c10d's scalar type names, as torch names the dtypes
_DTYPES = {"Float": "float32", "Double": "float64", "Half": "float16",
           "BFloat16": "bfloat16", "Long": "int64", "Int": "int32",
           "Short": "int16", "Char": "int8", "Byte": "uint8", "Bool": "bool"}


@dataclass(frozen=True)
class GroupLog:
    """One rank's record of one process group."""

    name: str  # "default group" or "group 1 (ranks [0, 1])"
    entered: int  # collectives this rank has entered in the group
    completed: int  # of them, those it saw finish
    last: tuple[Entry, ...]  # the latest, oldest first


def read_recorder(keep: int = KEEP) -> dict[str, GroupLog] | None:
    """This rank's flight recorder, by group id; None where it records nothing
    (TORCH_FR_BUFFER_SIZE unset or 0, or a torch without it)."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace_json
    except ImportError:
        return None
    try:
        trace = json.loads(_dump_fr_trace_json(includeCollectives=True))
    except Exception:  # noqa: BLE001  (a diagnosis, never a failure)
        return None
    # pg_status is keyed by this process's own number for a group (its groups
    # counted in the order it joined them), entries by the group's name, which
    # every rank shares: name the statuses too
    ids = _names_by_id()
    for e in trace.get("entries") or ():
        ids[str(e.get("pg_id"))] = str(e["process_group"][0])
    status = {ids.get(k, k): v for k, v in (trace.get("pg_status") or {}).items()}
    entries: dict[str, list[Entry]] = {}
    for e in trace.get("entries") or ():
        if e.get("is_p2p"):
            continue
        gid = str(e["process_group"][0])
        entries.setdefault(gid, []).append(Entry(
            int(e["collective_seq_id"]), e["profiling_name"].split(":")[-1],
            tuple(tuple(s) for s in e.get("input_sizes") or ()),
            tuple(e.get("input_dtypes") or ())))
    if not entries and not status:
        return None
    members = _members()
    out = {}
    for gid in sorted(set(status) | set(entries), key=_number):
        st = status.get(gid, {})
        seen = entries.get(gid, [])
        entered = max([int(st.get("last_enqueued_collective", 0))]
                      + [x.seq for x in seen])
        name = "default group" if gid == "0" else (
            f"group {gid}" + (f" (ranks {members[gid]})" if gid in members else ""))
        out[gid] = GroupLog(name, entered,
                            int(st.get("last_completed_collective", 0)),
                            tuple(seen[-keep:]))
    return out


def _members() -> dict[str, list[int]]:
    """Group id -> its global ranks, as torch.distributed names its groups."""
    try:
        from torch.distributed import distributed_c10d as c10d

        world = c10d._world
        return {str(world.pg_names[pg]): sorted(ranks)
                for pg, ranks in world.pg_group_ranks.items()
                if pg in world.pg_names}
    except Exception:  # noqa: BLE001  (names only: a diagnosis, never a failure)
        return {}


def _names_by_id() -> dict[str, str]:
    """This process's number for each of its groups -> the group's name: the
    groups it is a member of, numbered from 0 in the order it joined them."""
    try:
        from torch.distributed import distributed_c10d as c10d

        return {str(i): str(name)
                for i, name in enumerate(c10d._world.pg_names.values())}
    except Exception:  # noqa: BLE001  (names only: a diagnosis, never a failure)
        return {}


def _number(gid: str):
    return (0, int(gid)) if gid.isdigit() else (1, gid)


def find_mismatch(logs: dict[int, dict[str, GroupLog] | None],
                  where: dict[int, str] | None = None) -> list[str]:
    """What the ranks' records disagree on, a sentence each: in each group, the
    ranks that entered fewer collectives than the others (naming the first they
    did not enter and, from `where`, what they were doing instead), and the
    collectives that ranks entered with different ops or sizes under one number.
    Empty when the records agree (or there are none)."""
    where = where or {}
    found = []
    gids = sorted({g for log in logs.values() if log for g in log}, key=_number)
    for gid in gids:
        have = {r: log[gid] for r, log in sorted(logs.items()) if log and gid in log}
        name = next(iter(have.values())).name
        most = max(g.entered for g in have.values())
        ahead = [r for r, g in have.items() if g.entered == most]
        for r, g in have.items():
            if g.entered < most:
                nxt = _entry(have, ahead, g.entered + 1)
                what = nxt.describe() if nxt else f"collective #{g.entered + 1}"
                found.append(
                    f"rank {r} did not enter {what} of the {name}, which rank"
                    f"{'s' if len(ahead) > 1 else ''} {_list(ahead)} entered"
                    + (f"; rank {r} was {where[r]}" if r in where else ""))
        for seq in sorted({e.seq for g in have.values() for e in g.last}):
            calls = {r: e for r, g in have.items() for e in g.last if e.seq == seq}
            kinds = {(e.op, e.sizes, e.dtypes) for e in calls.values()}
            if len(kinds) > 1:
                found.append(f"collective #{seq} of the {name} differs across "
                             "ranks: " + "; ".join(
                                 f"rank {r} {e.describe()}" for r, e in calls.items()))
    return found


def _entry(have: dict, ranks: list[int], seq: int) -> Entry | None:
    for r in ranks:
        for e in have[r].last:
            if e.seq == seq:
                return e
    return None


def _list(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:-1])) + " and " + str(ranks[-1]) \
        if len(ranks) > 1 else str(ranks[0])
