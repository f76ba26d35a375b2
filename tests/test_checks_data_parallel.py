"""labkit.checks.data_parallel: chapter 05's checks say precisely what is wrong in
the answers a student writes — a flush that waits, that returns no function, that
deadlocks; a sync that rebinds instead of writing in place; a wrong byte count —
never a bare traceback, and a deadlock as what each rank waits for."""

import pytest
import torch
import torch.distributed as dist

from labkit.checks.common import ExerciseError
from labkit.checks.data_parallel import (
    check_bucket_count,
    check_bucket_flush,
    check_bytes_per_step,
    check_uneven_shards,
)

pytestmark = pytest.mark.numerics  # run again under other CPUs' kernels


def _flush(grads, world_size, async_op=True):
    flat = torch.cat([g.reshape(-1) for g in grads])
    work = dist.all_reduce(flat, async_op=async_op)

    def finish():
        if work is not None:
            work.wait()
        flat.div_(world_size)
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))
    return finish


def _flush_blocking(grads, world_size):
    return _flush(grads, world_size, async_op=False)  # right values, no overlap


def _flush_returns_tensor(grads, world_size):
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    return flat


def _flush_rank0_only(grads, world_size):
    if dist.get_rank() == 0:
        return _flush(grads, world_size)
    return lambda: None


def _flush_wrong_shape(grads, world_size):
    flat = torch.cat([g.reshape(-1) for g in grads])
    work = dist.all_reduce(flat, async_op=True)

    def finish():
        work.wait()
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part)                      # a 1-D slice into a 2-D weight
    return finish


def test_flush_right_passes_and_mistakes_are_named(cluster, capsys):
    assert check_bucket_flush(cluster, _flush)
    assert "one all-reduce" in capsys.readouterr().out
    with pytest.raises(ExerciseError, match=r"rank 0, bucket 0 \(2.bias, 2.weight\): "
                                            r"flush waited for its all-reduce"):
        check_bucket_flush(cluster, _flush_blocking)
    with pytest.raises(ExerciseError, match=r"rank 0, bucket 0: flush returned "
                                            r"Tensor, not a function"):
        check_bucket_flush(cluster, _flush_returns_tensor)
    with pytest.raises(ExerciseError, match=r"your flush raised RuntimeError.*"
                                            r"in finish"):
        check_bucket_flush(cluster, _flush_wrong_shape)


def test_flush_deadlock_is_reported(cluster):
    with pytest.raises(ExerciseError, match=r"deadlock: rank 0 still waiting"):
        check_bucket_flush(cluster, _flush_rank0_only)


def _sync_rebinds(grads, n_local, n_global, world_size):
    for g in grads:
        g = g * n_local / n_global             # a new tensor: grads never change
        dist.all_reduce(g)


def _sync_nothing(grads, n_local, n_global, world_size):
    pass


def test_uneven_rebinding_is_told_apart_from_no_all_reduce(cluster):
    with pytest.raises(ExerciseError, match=r"your all-reduce ran, but not on these "
                                            r"tensors"):
        check_uneven_shards(cluster, _sync_rebinds)
    with pytest.raises(ExerciseError, match=r"no all-reduce reached it"):
        check_uneven_shards(cluster, _sync_nothing)


def _bytes(S, n):
    return {"server": (n - 1) * S, "worker": S, "ring": 2 * (n - 1) / n * S}


def _bytes_server_to_all(S, n):
    return {**_bytes(S, n), "server": n * S}


def _bytes_ring_limit(S, n):
    return {**_bytes(S, n), "ring": 2 * S}


def _bytes_todo(S, n):
    raise NotImplementedError("exercise")


def _bytes_raises(S, n):
    return {"server": S[0]}


MEASURED = {(1000.0, 4): {"server": 3010.0, "worker": [1005.0, 1004.0, 1006.0],
                          "ring": [1504.0, 1505.0, 1503.0, 1506.0]}}


def test_bytes_per_step(capsys):
    assert check_bytes_per_step(_bytes, MEASURED)
    assert "as measured in section 4" in capsys.readouterr().out
    assert not check_bytes_per_step(_bytes_todo)
    assert "not written yet" in capsys.readouterr().out
    with pytest.raises(ExerciseError, match=r"'server'\] = 4,000 bytes, but the "
                                            r"traffic ledger measured 3,010 written "
                                            r"by rank 0, the server"):
        check_bytes_per_step(_bytes_server_to_all, MEASURED)
    with pytest.raises(ExerciseError, match=r"that is N·S: the server does not send "
                                            r"to itself"):
        check_bytes_per_step(_bytes_server_to_all)
    with pytest.raises(ExerciseError, match=r"that is 2S, the limit of large N"):
        check_bytes_per_step(_bytes_ring_limit)
    with pytest.raises(ExerciseError, match=r"raised TypeError"):
        check_bytes_per_step(_bytes_raises)
    with pytest.raises(ExerciseError, match=r"return a dict with the keys"):
        check_bytes_per_step(lambda S, n: (n - 1) * S)
    # the closed form and a measurement 1% off disagree: the measurement wins
    off = {(1000.0, 4): {**MEASURED[1000.0, 4], "ring": [1600.0]}}
    with pytest.raises(ExerciseError, match=r"'ring'\] = 1,500 bytes, but the "
                                            r"traffic ledger measured 1,600 written "
                                            r"by rank 0"):
        check_bytes_per_step(_bytes, off)


def _sync_finds_total(grads, n_local, world_size):
    total = torch.tensor([float(n_local)])
    dist.all_reduce(total)
    for g in grads:
        g.mul_(n_local / total.item())
        dist.all_reduce(g)


def _sync_guesses_total(grads, n_local, world_size):
    for g in grads:                            # B = N · n_local: only if equal
        g.mul_(1 / world_size)
        dist.all_reduce(g)


def test_uneven_total_unknown(cluster, capsys):
    assert check_uneven_shards(cluster, _sync_finds_total, total_known=False)
    assert "every rank holds" in capsys.readouterr().out
    with pytest.raises(ExerciseError, match=r"plain mean of the ranks' gradients"):
        check_uneven_shards(cluster, _sync_guesses_total, total_known=False)
    with pytest.raises(ExerciseError, match=r"no all-reduce reached it"):
        check_uneven_shards(cluster, lambda g, n, w: None, total_known=False)


def _n_buckets(tensor_bytes, bucket_mb):
    count, held = 0, None
    for b in tensor_bytes:
        if held is None or held >= bucket_mb * 2**20:
            count, held = count + 1, 0
        held += b
    return count


def _n_buckets_divides(tensor_bytes, bucket_mb):
    return -(-sum(tensor_bytes) // (bucket_mb * 2**20))


def _n_buckets_strict(tensor_bytes, bucket_mb):   # closes only above the cap
    count, held = 0, None
    for b in tensor_bytes:
        if held is None or held > bucket_mb * 2**20:
            count, held = count + 1, 0
        held += b
    return count


def test_bucket_count(capsys):
    mib = 2**20
    model = (40, 20_480, 2_048, mib + 0, 2_048, mib, 2_048, mib)
    measured = {(model, 1): 3, (model, 4): 1}
    assert check_bucket_count(_n_buckets, measured)
    assert "as DataParallel measured" in capsys.readouterr().out
    assert not check_bucket_count(
        lambda *a: (_ for _ in ()).throw(NotImplementedError("exercise")))
    with pytest.raises(ExerciseError, match=r"total divided by the bucket size"):
        check_bucket_count(_n_buckets_divides, measured)
    with pytest.raises(ExerciseError, match=r"AT LEAST bucket_mb MiB"):
        check_bucket_count(_n_buckets_strict)
    with pytest.raises(ExerciseError, match=r"but DataParallel made 2"):
        check_bucket_count(_n_buckets, {(model, 1): 2})
    with pytest.raises(ExerciseError, match=r"return a whole number"):
        check_bucket_count(lambda t, mb: 3.0)
