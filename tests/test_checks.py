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


# -- chapter 05: the bucket flush and uneven shards ------------------------------------


def _flush_good(grads, world_size):
    import torch
    import torch.distributed as dist

    flat = torch.cat([g.reshape(-1) for g in grads])
    work = dist.all_reduce(flat, async_op=True)

    def finish():
        work.wait()
        flat.div_(world_size)
        for g, v in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(v.view_as(g))
    return finish


def _flush_no_mean(grads, world_size):
    return _flush_good(grads, 1)  # sums, never divides by the 4 ranks


def _flush_not_copied_back(grads, world_size):
    import torch
    import torch.distributed as dist

    flat = torch.cat([g.reshape(-1) for g in grads])
    work = dist.all_reduce(flat, async_op=True)
    return lambda: (work.wait(), flat.div_(world_size))  # the mean stays in flat


def _flush_per_tensor(grads, world_size):
    import torch.distributed as dist

    works = [dist.all_reduce(g, async_op=True) for g in grads]

    def finish():
        for g, w in zip(grads, works):
            w.wait()
            g.div_(world_size)
    return finish


def _flush_returns_nothing(grads, world_size):
    import torch.distributed as dist

    for g in grads:
        dist.all_reduce(g)


def _flush_todo(grads, world_size):
    raise NotImplementedError


def test_bucket_flush_check(cluster, capsys):
    assert checks.check_bucket_flush(cluster, _flush_todo) is False
    assert "not written yet" in capsys.readouterr().out
    assert checks.check_bucket_flush(cluster, _flush_good) is True
    assert "one all-reduce" in capsys.readouterr().out
    # the first bucket backward fills holds the last layer: '2.bias', '2.weight'
    wrong = (r"rank 0, bucket 0, tensor '2.bias', element \[\d\]: got .*, expected "
             r"the mean over ranks .*; that is 4x the mean: divide")
    with pytest.raises(checks.ExerciseError, match=wrong):
        checks.check_bucket_flush(cluster, _flush_no_mean)
    wrong = r"rank 0, bucket 0, tensor '2.bias', .*this rank's own gradient"
    with pytest.raises(checks.ExerciseError, match=wrong):
        checks.check_bucket_flush(cluster, _flush_not_copied_back)
    wrong = (r"rank 0, bucket 0 \(2.bias, 2.weight\): flush made \['all_reduce', "
             r"'all_reduce'\]; a bucket goes as ONE all_reduce")
    with pytest.raises(checks.ExerciseError, match=wrong):
        checks.check_bucket_flush(cluster, _flush_per_tensor)
    with pytest.raises(checks.ExerciseError, match=r"rank 0, bucket 0: flush returned "
                                                   r"None"):
        checks.check_bucket_flush(cluster, _flush_returns_nothing)


def _sync_weighted(grads, n_local, n_global, world_size):
    import torch.distributed as dist

    for g in grads:
        g.mul_(n_local / n_global)
        dist.all_reduce(g)


def _sync_plain_mean(grads, n_local, n_global, world_size):
    import torch.distributed as dist

    for g in grads:
        dist.all_reduce(g)
        g.div_(world_size)


def _sync_sum(grads, n_local, n_global, world_size):
    import torch.distributed as dist

    for g in grads:
        dist.all_reduce(g)


def _sync_weighted_then_divided(grads, n_local, n_global, world_size):
    _sync_weighted(grads, n_local, n_global, world_size)
    for g in grads:
        g.div_(world_size)


def test_uneven_shards_check(cluster):
    assert checks.check_uneven_shards(cluster, _sync_weighted) is True
    wrong = (r"rank 0 \(holding 1 of 13 examples\), tensor '0.weight', element "
             r"\[\d, \d\]: got .*; that is the plain mean .* n_local / n_global")
    with pytest.raises(checks.ExerciseError, match=wrong):
        checks.check_uneven_shards(cluster, _sync_plain_mean)
    with pytest.raises(checks.ExerciseError, match=r"that is 1/4 of it"):
        checks.check_uneven_shards(cluster, _sync_weighted_then_divided)
    with pytest.raises(checks.ExerciseError, match=r"the plain sum of the ranks'"):
        checks.check_uneven_shards(cluster, _sync_sum)


# -- chapter 06: the ZeRO-1 step ----------------------------------------------------


def _zero1_good(rank, world_size, a, e, sgd):
    import torch
    import torch.distributed as dist

    s = a.numel() // world_size
    g = torch.empty(s, dtype=a.dtype)
    dist.reduce_scatter_single(g, e, op=dist.ReduceOp.AVG)  # my slice of E, averaged
    mine = a[rank * s:(rank + 1) * s]
    sgd(mine, g)                                            # my slice of A, and C
    dist.all_gather_single(a, mine.clone())                 # everyone's new A


def _zero1_summed(rank, world_size, a, e, sgd):
    import torch
    import torch.distributed as dist

    s = a.numel() // world_size
    g = torch.empty(s, dtype=a.dtype)
    dist.reduce_scatter_single(g, e)                        # a sum, not an average
    mine = a[rank * s:(rank + 1) * s]
    sgd(mine, g)
    dist.all_gather_single(a, mine.clone())


def _zero1_no_gather(rank, world_size, a, e, sgd):
    import torch
    import torch.distributed as dist

    s = a.numel() // world_size
    g = torch.empty(s, dtype=a.dtype)
    dist.reduce_scatter_single(g, e, op=dist.ReduceOp.AVG)
    sgd(a[rank * s:(rank + 1) * s], g)                      # and nobody else hears


def _zero1_all_reduce(rank, world_size, a, e, sgd):
    import torch.distributed as dist

    s = a.numel() // world_size
    dist.all_reduce(e, op=dist.ReduceOp.AVG)                # right values, 3(N-1)/N
    mine = a[rank * s:(rank + 1) * s]
    sgd(mine, e[rank * s:(rank + 1) * s])
    dist.all_gather_single(a, mine.clone())


def _zero1_todo(rank, world_size, a, e, sgd):
    raise NotImplementedError


def test_zero1_step_check(cluster, capsys):
    assert checks.check_zero1_step(cluster, _zero1_todo) is False
    assert "not written yet" in capsys.readouterr().out
    assert checks.check_zero1_step(cluster, _zero1_good) is True
    assert "correct" in capsys.readouterr().out
    # 1021 elements on 4 ranks: slices of s = 256, the last padded with 3 zeros
    summed = (r"step 1, rank 0, tensor C \(the momentum of rank 0's slice\), element "
              r"0 .*got .*, expected .*; it was updated with the sum over ranks, not "
              r"the average")
    with pytest.raises(checks.ExerciseError, match=summed):
        checks.check_zero1_step(cluster, _zero1_summed)
    stale = (r"step 1, rank 0, tensor a \(the parameters\), element 256 \(in rank "
             r"1's slice \[256, 512\)\): .* the all-gather did not bring rank 1's")
    with pytest.raises(checks.ExerciseError, match=stale):
        checks.check_zero1_step(cluster, _zero1_no_gather)
    with pytest.raises(checks.ExerciseError, match=r"rank 0: the values are right, "
                                                    r"but it all-reduced"):
        checks.check_zero1_step(cluster, _zero1_all_reduce)
