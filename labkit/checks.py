"""Exercise checks that explain what is wrong.

A check runs the student's function on real ranks, compares with the reference in
labkit.collectives, and either prints a short success line or raises
`ExerciseError` naming the rank, the chunk and what went wrong. A function that
still raises NotImplementedError is "not written yet": the check says so and
returns False without failing the notebook.
"""

from __future__ import annotations

from labkit.runtime.results import RankError


class ExerciseError(AssertionError):
    """The exercise's answer is wrong; the message says where and why."""


def _not_written(err: RankError) -> bool:
    return bool(err.exceptions) and all(
        isinstance(e, NotImplementedError) for e in err.exceptions.values())


def _contributors(value: float, n: int) -> list[int]:
    bits = int(round(value))
    return [r for r in range(n) if bits >> r & 1]


def _ring_reduce_scatter_worker(rank, world_size, fn, chunk_len):
    import torch

    # rank r contributes 2**r everywhere: a chunk's value spells out whose
    # contributions it holds (bit r set = rank r's value is in the sum)
    x = torch.full((world_size * chunk_len,), float(2 ** rank))
    chunks = list(x.tensor_split(world_size))
    fn(rank, world_size, chunks)
    return [c.tolist() for c in chunks]


def check_ring_reduce_scatter(cluster, fn, chunk_len: int = 3) -> bool:
    """Check a student's ring reduce-scatter phase.

    `fn(rank, world_size, chunks)` gets this rank's n chunks (tensor views) and
    must, with n-1 ring steps of send/recv, leave in chunks[(rank + 1) % n] the
    sum of that chunk over all ranks.
    """
    n = cluster.world_size
    try:
        res = cluster.run(_ring_reduce_scatter_worker, fn, chunk_len)
    except RankError as err:
        if _not_written(err):
            print("not written yet: replace `raise NotImplementedError` with your "
                  "ring steps, then run this cell again")
            return False
        raise
    everyone = (1 << n) - 1
    for rank, chunks in enumerate(res):
        c = (rank + 1) % n
        got = chunks[c]
        if len(set(got)) != 1:
            raise ExerciseError(
                f"rank {rank}, chunk {c}: its elements differ ({got}); a step "
                "added a different chunk into this one")
        have = _contributors(got[0], n)
        if got[0] != everyone:
            missing = sorted(set(range(n)) - set(have))
            raise ExerciseError(
                f"rank {rank}, chunk {c} should hold the sum over all {n} ranks but "
                f"holds ranks {have} (value {got[0]:g}, expected {everyone}); "
                f"missing {missing}. After step s, rank r's copy of the chunk it "
                f"receives should sum s+1 ranks: check which chunk you send "
                f"((rank - step + 1) % n) and which you add into.")
    print(f"correct: after {n - 1} steps every rank r holds the full sum of chunk "
          f"(r+1) % {n}, and sent {n - 1} chunks of M/{n}")
    return True


def check_answer(what: str, yours, expected, hint: str = "", rel: float = 1e-9) -> bool:
    """Compare a student's number with the expected one.

    None means "not answered yet": it says so and returns False without failing.
    A wrong answer raises ExerciseError with the hint; a right one prints a line.
    """
    if yours is None:
        print(f"{what}: not answered yet (replace None with your answer)")
        return False
    if isinstance(yours, bool) or not isinstance(yours, (int, float)):
        raise ExerciseError(f"{what}: expected a number, got {yours!r}")
    if abs(yours - expected) > rel * max(abs(expected), 1e-300):
        msg = f"{what}: {yours:,.6g} is not right"
        raise ExerciseError(msg + (f". Hint: {hint}" if hint else ""))
    print(f"{what}: {yours:,.6g} is right")
    return True
