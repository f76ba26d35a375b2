"""What a check verifies besides the answer's values: that the answer did the work.

Imports labkit.checks.common; torch inside functions.

Inputs come from `fresh_seed()` anew each run (values written down from one run
fail the next); `own_calls`/`refuse_own` refuse labkit's own implementation, and
`messages`/`require_ring` hold a rank's traffic to the pattern asked for.
"""

from __future__ import annotations

import contextlib
import importlib
import secrets
import sys

from labkit.checks.common import ExerciseError, call_answer


def fresh_seed() -> int:
    """A seed no one can know before the check runs: inputs drawn from it differ
    in every run, so an answer fitted to one run's values fails the next."""
    return secrets.randbits(31)


# ------------------------------------------------------------- labkit's own code


def _targets(targets) -> dict[str, tuple[str, str]]:
    """{code file: (module, qualname prefix)} for targets "module" (every
    function in it) or "module:qualname" (that function, a class's methods)."""
    out = {}
    for target in targets:
        module, _, qual = target.partition(":")
        mod = importlib.import_module(module)
        out.setdefault(mod.__file__, []).append((module, qual))
    return out


@contextlib.contextmanager
def own_calls(*targets: str):
    """Record, in the list it yields, each of `targets` the block calls (on this
    thread, however it was imported or renamed): "module" stands for every
    function defined in that module, "module:qualname" for one function (or a
    class's methods). Works here and on a rank."""
    files = _targets(targets)
    seen: list[str] = []
    previous = sys.getprofile()

    def profile(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        for module, qual in files.get(code.co_filename, ()):
            name = code.co_qualname
            if not qual or name == qual or name.startswith(qual + "."):
                label = f"{module}.{name}"
                if label not in seen:
                    seen.append(label)

    sys.setprofile(profile)
    try:
        yield seen
    finally:
        sys.setprofile(previous)


def refuse_own(where: str, seen: list[str], what: str) -> None:
    """ExerciseError naming the first of `seen` (what own_calls recorded): the
    answer called labkit's own `what` instead of writing it."""
    if seen:
        raise ExerciseError(
            f"{where}: your answer calls {seen[0]}, labkit's own {what}; the "
            "exercise is to write it yourself (read labkit's code if it helps, "
            "then close it)")


# ---------------------------------------------------------------- messages


def messages(records) -> tuple[list[tuple[int, int]], list[tuple[int, int]],
                                 list[str]]:
    """One rank's traffic records as (sends, recvs, collectives): (peer, bytes)
    for each send and each recv, in order, and the op of every other call."""
    sends = [(r.peer, r.payload_bytes) for r in records if r.op == "send"]
    recvs = [(r.peer, r.payload_bytes) for r in records if r.op == "recv"]
    other = [r.op for r in records if r.op not in ("send", "recv")]
    return sends, recvs, other


def _ordinal(k: int) -> str:
    return {1: "1st", 2: "2nd", 3: "3rd"}.get(k, f"{k}th")


def refuse_collectives(where: str, records, what: str) -> None:
    """ExerciseError if this rank's records hold any collective: `what` (a ring,
    an all-to-all from send/recv) is point-to-point messages alone."""
    other = messages(records)[2]
    if other:
        raise ExerciseError(
            f"{where}: it called {sorted(set(other))}; {what} is point-to-point "
            "messages alone (isend/irecv or send/recv), no collective")


def require_ring(where: str, rank: int, world_size: int, records, chunk_bytes: int,
                 what: str) -> None:
    """ExerciseError unless this rank's records are one ring phase: no
    collective, N-1 sends of `chunk_bytes` each to the right neighbour, N-1
    receives of as many bytes from the left one (N = world_size)."""
    refuse_collectives(where, records, what)
    sends, recvs, _ = messages(records)
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    for name, got, peer, direction in (("sent", sends, right, "to its right"),
                                       ("received", recvs, left, "from its left")):
        if len(got) != world_size - 1:
            raise ExerciseError(
                f"{where}: it {name} {len(got)} message{'s' * (len(got) != 1)}; "
                f"{what} on {world_size} ranks takes {world_size - 1} steps, one "
                f"message {direction} neighbour per step")
        for k, (p, nbytes) in enumerate(got, 1):
            if p != peer:
                raise ExerciseError(
                    f"{where}: its {_ordinal(k)} message was {name} "
                    f"{'to' if name == 'sent' else 'from'} rank {p}; in a ring each "
                    f"rank talks only to its neighbours, rank {rank} {direction} "
                    f"neighbour, rank {peer}")
            if nbytes != chunk_bytes:
                raise ExerciseError(
                    f"{where}: its {_ordinal(k)} message {name} was {nbytes:,} "
                    f"bytes; each step moves one chunk, M/N = {chunk_bytes:,} bytes")


# ------------------------------------------------- all-to-alls that do not pair


class SizesDisagree(Exception):
    """Raised on every rank alike, before an all-to-all whose sizes do not pair
    up: `plans` is every rank's plan of that call (`plan_of`), `call` which
    all-to-all of the block it was (1 for the first), `me` this rank's place in
    the call's group."""

    def __init__(self, call: int, plans: list[dict], me: int):
        super().__init__(f"all-to-all {call}: the ranks' sizes do not pair up")
        self.call, self.plans, self.me = call, plans, me

    def info(self) -> dict:
        """This rank's view: bytes it sends each rank and expects from each, what
        each sends it (`theirs`), its output row's bytes, its own problem."""
        mine = self.plans[self.me]
        return {"call": self.call, "sends": mine["sends"], "expects": mine["expects"],
                "theirs": [p["sends"][self.me] for p in self.plans],
                "row": mine["row_bytes"], "problem": mine["problem"]}


def _side(t, splits, n: int, what: str):
    """(rows, split sizes in rows, problem or None) of one side of an
    all_to_all_single: tensor t and the split sizes it was given (as given,
    whole numbers, even where they do not fit; None where there are none to
    read: not given and t does not split evenly, or not whole numbers)."""
    rows = int(t.shape[0]) if t.dim() else 1
    if splits is None:
        if rows % n:
            return rows, None, (f"its {what} tensor has {rows} rows, which do not "
                                f"split evenly over {n} ranks: give the split sizes")
        return rows, [rows // n] * n, None
    try:
        splits = [int(v) for v in splits]
    except (TypeError, ValueError):
        return rows, None, f"its {what} split sizes {splits!r} are not whole numbers"
    if len(splits) != n:
        return rows, splits, (f"its {what} split sizes {splits} are not {n} "
                              "numbers, one per rank")
    if sum(splits) != rows:
        return rows, splits, (f"its {what} split sizes {splits} add up to "
                              f"{sum(splits)} rows, but its {what} tensor has {rows}")
    return rows, splits, None


def plan_of(output, input, output_split_sizes, input_split_sizes,
            world_size: int) -> dict:
    """What one rank's all_to_all_single asks for in a group of world_size
    ranks: rows and split sizes of each side (None where they do not fit),
    whether split sizes were given, row shape and dtype of each side, bytes to
    and from each rank, the problem."""
    import math

    def row_bytes(t):
        return (math.prod(t.shape[1:]) if t.dim() else 1) * t.element_size()

    in_rows, ins, p_in = _side(input, input_split_sizes, world_size, "input")
    out_rows, outs, p_out = _side(output, output_split_sizes, world_size, "output")
    return {"in_rows": in_rows, "out_rows": out_rows, "ins": ins, "outs": outs,
            "given": [input_split_sizes is not None, output_split_sizes is not None],
            "row": list(input.shape[1:]), "out_row": list(output.shape[1:]),
            "dtype": str(input.dtype), "out_dtype": str(output.dtype),
            "row_bytes": row_bytes(output),
            "sends": ([k * row_bytes(input) for k in ins] if not p_in
                      else [0] * world_size),
            "expects": ([k * row_bytes(output) for k in outs] if not p_out
                        else [0] * world_size),
            "problem": p_in or p_out}


def _plan_of_lists(outputs, inputs, n: int) -> dict:
    """plan_of for dist.all_to_all's lists of tensors, one per rank."""
    ins, outs = list(inputs), list(outputs)
    problem = (None if len(ins) == len(outs) == n else
               f"it passed {len(ins)} input and {len(outs)} output tensors, not "
               f"{n} of each")

    def nbytes(ts):
        return ([t.numel() * t.element_size() for t in ts] + [0] * n)[:n]

    rows = [int(t.shape[0]) if t.dim() else 1 for t in ins]
    out_rows = [int(t.shape[0]) if t.dim() else 1 for t in outs]
    first = (outs or ins or [None])[0]
    return {"in_rows": sum(rows), "out_rows": sum(out_rows), "ins": rows,
            "outs": out_rows, "given": [True, True],
            "row": list(ins[0].shape[1:]) if ins else [],
            "out_row": list(outs[0].shape[1:]) if outs else [],
            "dtype": str(ins[0].dtype) if ins else "-",
            "out_dtype": str(outs[0].dtype) if outs else "-",
            "row_bytes": max(1, first.element_size() if first is not None else 1),
            "sends": nbytes(ins), "expects": nbytes(outs), "problem": problem}


@contextlib.contextmanager
def sizes_agree(token: str):
    """While open (on a rank), every dist.all_to_all_single and dist.all_to_all
    first posts this rank's plan of the call to the process group's store and
    reads every member's: where the sizes do not pair up (or a rank's split
    sizes do not fit its tensors), every rank raises SizesDisagree instead of
    making the call, which gloo would answer by aborting every process. The
    store is no collective: a traffic ledger sees only the real calls. `token`,
    the same on every rank and new for each check run, keeps runs apart."""
    import json

    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    real_single, real_list = dist.all_to_all_single, dist.all_to_all
    calls: dict[tuple, int] = {}

    def agree(plan: dict, group) -> None:
        ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
        me = ranks.index(dist.get_rank())
        call = calls[ranks] = calls.get(ranks, 0) + 1
        key = f"labkit/sizes/{token}/{'-'.join(map(str, ranks))}/{call}"
        store.set(f"{key}/{me}", json.dumps(plan))
        plans = [json.loads(store.get(f"{key}/{q}")) for q in range(len(ranks))]
        if any(p["problem"] for p in plans) or any(
                p["sends"][j] != plans[j]["expects"][i]
                for i, p in enumerate(plans) for j in range(len(plans))):
            raise SizesDisagree(call, plans, me)

    def single(output, input, output_split_sizes=None, input_split_sizes=None,
               group=None, async_op=False):
        agree(plan_of(output, input, output_split_sizes, input_split_sizes,
                      dist.get_world_size(group)), group)
        return real_single(output, input, output_split_sizes, input_split_sizes,
                           group=group, async_op=async_op)

    def listed(output_tensor_list, input_tensor_list, group=None, async_op=False):
        agree(_plan_of_lists(output_tensor_list, input_tensor_list,
                             dist.get_world_size(group)), group)
        return real_list(output_tensor_list, input_tensor_list, group=group,
                         async_op=async_op)

    # labkit.parallel.all_to_all_rows then leaves the sizes to this guard
    single.labkit_checks_sizes = listed.labkit_checks_sizes = True
    dist.all_to_all_single, dist.all_to_all = single, listed
    try:
        yield
    finally:
        dist.all_to_all_single, dist.all_to_all = real_single, real_list


def call_refusing(call: str, fn, args: tuple, what: str, targets: tuple,
                  own: str):
    """fn(*args) as call_answer gives it (NOT_WRITTEN for a stub), labkit's
    `targets` refused (refuse_own, naming `own`); a refused call is said even
    when the answer then raised (labkit's function needing ranks, say)."""
    with own_calls(*targets) as seen:
        try:
            got = call_answer(fn, *args, what=what)
        except ExerciseError:
            refuse_own(call, seen, own)
            raise
    refuse_own(call, seen, own)
    return got
