"""Chapter 02's check: a ring reduce-scatter written from send/recv."""

from __future__ import annotations

from labkit.checks.common import ExerciseError, run_answer


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
    res = run_answer(cluster, _ring_reduce_scatter_worker, fn, chunk_len,
                     what="ring steps")
    if res is None:
        return False
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
