"""What a torch.distributed call is, as the traffic and timeline ledgers see it
at the dispatcher: which collective (c10d and functional ops, our names), which
argument holds its payload S, the group it travels in, how to wait for it, and
the bytes the process has written to its sockets (`wchar` in /proc/self/io).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.conventions import BUS_FACTOR


def tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in tensors(item)]
    return []


# op name -> (our name, which positional argument holds the payload S, multiply by n?)
_C10D = {
    "allreduce_": ("all_reduce", 0, False),
    "allreduce_coalesced_": ("all_reduce", 0, False),
    "broadcast_": ("broadcast", 0, False),
    "reduce_": ("reduce", 0, False),
    "allgather_": ("all_gather", 0, False),
    "_allgather_base_": ("all_gather", 0, False),
    "allgather_coalesced_": ("all_gather", 0, False),
    "allgather_into_tensor_coalesced_": ("all_gather", 0, False),
    "reduce_scatter_": ("reduce_scatter", 1, False),
    "_reduce_scatter_base_": ("reduce_scatter", 1, False),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, False),
    "alltoall_": ("all_to_all", 1, False),
    "alltoall_base_": ("all_to_all", 1, False),
    "scatter_": ("scatter", 0, True),
    "gather_": ("gather", 1, True),
    "send": ("send", 0, False),
    "recv_": ("recv", 0, False),
    "recv_any_source_": ("recv", 0, False),
    "barrier": ("barrier", None, False),
    "monitored_barrier_": ("barrier", None, False),
}
_FUNCTIONAL = {
    "all_reduce": ("all_reduce", 0, False),
    "all_reduce_": ("all_reduce", 0, False),
    "all_reduce_coalesced": ("all_reduce", 0, False),
    "all_reduce_coalesced_": ("all_reduce", 0, False),
    "all_gather_into_tensor": ("all_gather", 0, True),
    "all_gather_into_tensor_out": ("all_gather", 0, True),
    "all_gather_into_tensor_coalesced": ("all_gather", 0, True),
    "reduce_scatter_tensor": ("reduce_scatter", 0, False),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0, False),
    "all_to_all_single": ("all_to_all", 0, False),
    "broadcast": ("broadcast", 0, False),
    "broadcast_": ("broadcast", 0, False),
}
_NAMESPACES = {"c10d": _C10D, "_c10d_functional": _FUNCTIONAL,
               "_c10d_functional_autograd": _FUNCTIONAL}


# where an all-to-all's input split sizes are (its rows per peer; empty: even)
_SPLITS = {"alltoall_base_": 4, "all_to_all_single": 2}


def sent_to_others(name: str, args, payload, nbytes: int, world_size: int,
                   me: int) -> float:
    """Bytes an all-to-all in a group of n = world_size ranks sends to the other
    ranks: the payload less this rank's own chunk. With uneven splits (an MoE
    dispatch) that chunk is not 1/n of it, so the bus factor's (n-1)/n would be
    wrong."""
    if name == "alltoall_" and len(payload) == world_size:  # one input tensor per peer
        mine = payload[me]
        return nbytes - mine.numel() * mine.element_size()
    at = _SPLITS.get(name)
    splits = list(args[at]) if at is not None and at < len(args) else []
    rows = payload[0].shape[0] if payload and payload[0].dim() else 0
    if len(splits) != world_size or not rows:
        return nbytes * BUS_FACTOR["all_to_all"](world_size)
    return nbytes - splits[me] * nbytes / rows


def classify(func):
    ns, _, name = func._schema.name.partition("::")
    table = _NAMESPACES.get(ns)
    return ns, name, (table[name] if table and name in table else None)


def group_of(ns: str, args) -> tuple[int, tuple[int, ...]]:
    """The size of the group a call travels in, and its members' global ranks."""
    pg = None
    if ns == "c10d":
        for a in args:
            if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type()):
                pg = dist.ProcessGroup.unbox(a)
                break
    else:
        for a in reversed(args):  # functional ops name their group last
            if isinstance(a, str):
                pg = dist.distributed_c10d._resolve_process_group(a)
                break
    if pg is None:
        return dist.get_world_size(), tuple(range(dist.get_world_size()))
    return pg.size(), members_of(pg)


def members_of(pg) -> tuple[int, ...]:
    """Global ranks of `pg`, in its own rank order (empty if c10d does not know it:
    a group it did not create)."""
    try:
        return tuple(dist.get_process_group_ranks(pg))
    except (ValueError, KeyError, RuntimeError):
        by_name = {g.group_name: g for g in dist.distributed_c10d._world.pg_map}
        g = by_name.get(pg.group_name)
        return tuple(dist.get_process_group_ranks(g)) if g is not None else ()


def wait_for(ns: str, res) -> None:
    """Wait for a collective to finish (double waits are harmless for these)."""
    if ns != "c10d":
        for t in tensors(res):
            torch.ops._c10d_functional.wait_tensor(t)
        return
    for a in res if isinstance(res, tuple) else (res,):
        if isinstance(a, torch.ScriptObject) and "Work" in str(a._type()):
            work = dist.distributed_c10d.Work.unbox(a)
            if work is not None:  # NCCL may hand back none: the stream orders it
                work.wait()
    cuda = [t for t in tensors(res) if t.is_cuda]
    if cuda:  # wait() orders the GPU's stream only; the record's time needs the end
        torch.cuda.synchronize(cuda[0].device)


def io_path_ok() -> bool:
    try:
        return wchar() >= 0
    except OSError:
        return False


def wchar() -> int:
    with open("/proc/self/io", "rb") as f:
        for line in f:
            if line.startswith(b"wchar:"):
                return int(line.split()[1])
    return -1
