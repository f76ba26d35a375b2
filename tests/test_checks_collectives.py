"""labkit.checks.collectives (chapter 01): each check passes a right answer and
names what a wrong one got wrong: rank, chunk, element, where the value came
from, or the bytes it sent."""

import pytest

from labkit.checks import ExerciseError
from labkit.checks.collectives import (
    check_all_to_all,
    check_bytes_per_rank,
    check_cheap_reduce_scatter,
)


def _exchange(rank, world_size, x, pick):
    """Send pick(chunks, rank, dst) to every other rank; chunk i of the result is
    what rank i sent (our own chunk `rank` stays)."""
    import torch
    import torch.distributed as dist

    chunks = x.chunk(world_size)
    out = torch.empty_like(x)
    parts = list(out.chunk(world_size))
    parts[rank].copy_(chunks[rank])
    reqs = []
    for peer in range(world_size):
        if peer != rank:
            reqs.append(dist.isend(pick(chunks, rank, peer).contiguous(), peer))
            reqs.append(dist.irecv(parts[peer], peer))
    for q in reqs:
        q.wait()
    return out


def _a2a_good(rank, world_size, x):
    return _exchange(rank, world_size, x, lambda c, me, dst: c[dst])


def _a2a_sends_own_chunk(rank, world_size, x):
    return _exchange(rank, world_size, x, lambda c, me, dst: c[me])


def _a2a_builtin(rank, world_size, x):
    import torch
    import torch.distributed as dist

    out = torch.empty_like(x)
    dist.all_to_all_single(out, x)
    return out


def _a2a_todo(rank, world_size, x):
    raise NotImplementedError("exercise: all-to-all from isend/irecv")


def test_all_to_all_check(cluster, capsys):
    assert check_all_to_all(cluster, _a2a_todo) is None
    assert "not written yet" in capsys.readouterr().out
    check_all_to_all(cluster, _a2a_good)
    assert "correct: every rank r ended with chunk r of every rank" in \
        capsys.readouterr().out
    # rank 0's chunk 1 must be rank 1's chunk 0 (value 100); it got rank 1's own
    wrong = (r"rank 0, chunk 1, element 0: got 110, expected 100; it holds element 0 "
             r"of rank 1's chunk 1, expected element 0 of rank 1's chunk 0")
    with pytest.raises(ExerciseError, match=wrong):
        check_all_to_all(cluster, _a2a_sends_own_chunk)
    with pytest.raises(ExerciseError, match=r"rank 0: the values are right, but it "
                                            r"called \['all_to_all'\]"):
        check_all_to_all(cluster, _a2a_builtin)
    with pytest.raises(ExerciseError, match=r"rank 0: shape \(4,\), expected \(8,\)"):
        check_all_to_all(cluster, lambda r, n, x: x[:4])
    with pytest.raises(ExerciseError, match=r"rank 0: dtype torch.float64, expected "
                                            r"torch.float32"):
        check_all_to_all(cluster, lambda r, n, x: x.double())


def _rs_by_all_to_all(rank, world_size, x):
    import torch
    import torch.distributed as dist

    out = torch.empty_like(x)
    dist.all_to_all_single(out, x)      # chunk `rank` of every rank, here
    return out.view(world_size, -1).sum(0)


def _rs_gloo(rank, world_size, x):
    import torch
    import torch.distributed as dist

    out = torch.empty(x.numel() // world_size)
    dist.reduce_scatter_single(out, x)  # right values, all-reduce traffic on gloo
    return out


def _rs_mean(rank, world_size, x):
    return _rs_by_all_to_all(rank, world_size, x) / world_size


def test_cheap_reduce_scatter_check(cluster, capsys):
    check_cheap_reduce_scatter(cluster, _rs_by_all_to_all)
    assert "= (N-1)/N·M to within 2%" in capsys.readouterr().out
    with pytest.raises(ExerciseError, match=r"rank 0: the values are right, but it "
                                            r"wrote .* \(2.0\d × \(N-1\)/N·M = "
                                            r"196,608\) .*an all-reduce's traffic"):
        check_cheap_reduce_scatter(cluster, _rs_gloo)
    with pytest.raises(ExerciseError, match=r"rank 0, element \[0\]: got 2500, "
                                            r"expected 10000: it holds the average "
                                            r"over ranks, not the sum"):
        check_cheap_reduce_scatter(cluster, _rs_mean)
    with pytest.raises(ValueError, match="numel 10 is not divisible by 4 ranks"):
        check_cheap_reduce_scatter(cluster, _rs_mean, numel=10)


def test_bytes_per_rank_check(capsys):
    def ring(op, size, n):
        return (2 if op == "all_reduce" else 1) * (n - 1) / n * size

    check_bytes_per_rank(ring)
    assert "1.75 GB and 0.875 GB" in capsys.readouterr().out
    with pytest.raises(ExerciseError, match=r"reduce_scatter of S = 1,000,000,000 B "
                                            r"on N = 8: got 1.75e\+09 bytes, expected "
                                            r"8.75e\+08 \(twice too much"):
        check_bytes_per_rank(lambda op, size, n: 2 * (n - 1) / n * size)
    with pytest.raises(ExerciseError, match=r"\(the large-N limit; keep the "
                                            r"\(N-1\)/N\)"):
        check_bytes_per_rank(lambda op, size, n: (2 if op == "all_reduce" else 1)
                             * size)
    with pytest.raises(ExerciseError, match=r"expected a number of bytes, got str"):
        check_bytes_per_rank(lambda op, size, n: "1.75 GB")
