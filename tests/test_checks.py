"""labkit.checks: the exercise checks say what is wrong, and where."""

import pytest

from labkit import checks


def _ring_steps(rank, world_size, chunks, steps):
    import torch.distributed as dist

    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    for s in range(1, steps + 1):
        into = chunks[(rank - s) % world_size]
        buf = into.clone()
        reqs = [dist.isend(chunks[(rank - s + 1) % world_size], right),
                dist.irecv(buf, left)]
        for q in reqs:
            q.wait()
        into += buf


def _good(rank, world_size, chunks):
    _ring_steps(rank, world_size, chunks, world_size - 1)


def _one_step_short(rank, world_size, chunks):
    _ring_steps(rank, world_size, chunks, world_size - 2)


def _todo(rank, world_size, chunks):
    raise NotImplementedError


def test_ring_reduce_scatter_check(cluster, capsys):
    assert checks.check_ring_reduce_scatter(cluster, _todo) is False
    assert "not written yet" in capsys.readouterr().out
    assert checks.check_ring_reduce_scatter(cluster, _good) is True
    wrong = r"rank 0, chunk 1 .* holds ranks \[0\].* missing \[1, 2, 3\]"
    with pytest.raises(checks.ExerciseError, match=wrong):
        checks.check_ring_reduce_scatter(cluster, _one_step_short)


def test_check_answer(capsys):
    assert checks.check_answer("x", None, 3) is False
    assert "not answered yet" in capsys.readouterr().out
    assert checks.check_answer("x", 3.0, 3) is True
    with pytest.raises(checks.ExerciseError, match="Hint: think"):
        checks.check_answer("x", 4, 3, hint="think")
    with pytest.raises(checks.ExerciseError, match="number"):
        checks.check_answer("x", "3", 3)
