"""labkit.checks.zero: the ZeRO-1 step check names the wrong element with a hint
for mistakes the other tests do not cover (a wrong slice, a deadlock in the
all-gather), and the ZeRO-2 peak-gradient check holds a formula to measurements
and says what a wrong one counted."""

import pytest
import torch
import torch.distributed as dist

from labkit.checks.common import ExerciseError
from labkit.checks.zero import elements_shared, check_zero1_step, check_zero2_peak


def _zero1(rank, world_size, a, e, sgd, owner=None, skip_gather_on=None):
    s = a.numel() // world_size
    g = torch.empty(s, dtype=a.dtype)
    dist.reduce_scatter_single(g, e, op=dist.ReduceOp.AVG)
    q = rank if owner is None else owner(rank, world_size)
    mine = a[q * s:(q + 1) * s]
    sgd(mine, g)
    if rank != skip_gather_on:
        dist.all_gather_single(a, mine.clone())


def _zero1_next_slice(rank, world_size, a, e, sgd):
    _zero1(rank, world_size, a, e, sgd, owner=lambda r, n: (r + 1) % n)


def _zero1_rank0_skips_gather(rank, world_size, a, e, sgd):
    _zero1(rank, world_size, a, e, sgd, skip_gather_on=0)


def _zero1_whole_vector(rank, world_size, a, e, sgd):
    sgd(a, e)                                  # the whole of a, not the slice


def test_zero1_wrong_slice_wrong_shape_and_deadlock(cluster):
    assert check_zero1_step(cluster, _zero1)
    with pytest.raises(ExerciseError, match=r"step 1, rank 0, tensor a \(the "
                                            r"parameters\), element 0 .* each rank "
                                            r"updates a\[rank\*s:\(rank\+1\)\*s\]"):
        check_zero1_step(cluster, _zero1_next_slice)
    with pytest.raises(ExerciseError, match=r"sgd\(p=...\) got shape \(1024,\): it "
                                            r"updates this rank's slice only"):
        check_zero1_step(cluster, _zero1_whole_vector)
    with pytest.raises(ExerciseError, match=r"(?s)deadlock: .*rank 1: in all_gather"):
        check_zero1_step(cluster, _zero1_rank0_skips_gather)


def _peak(psi, n, bucket, elem_bytes):
    return elem_bytes * (-(-psi // n) + bucket)


LAYER = 512 * 512 + 512
MEASURED = {(4 * LAYER, 4, LAYER, 2): 2 * 2 * LAYER,
            (4 * LAYER, 4, 2 * LAYER, 2): 2 * 3 * LAYER}


def test_zero2_peak(capsys):
    assert check_zero2_peak(_peak, MEASURED)
    assert "as measured" in capsys.readouterr().out
    assert not check_zero2_peak(lambda *a: (_ for _ in ()).throw(NotImplementedError))
    assert "not written yet" in capsys.readouterr().out
    with pytest.raises(ExerciseError, match=r"but the memory ledger measured a peak "
                                            r"of 1,050,624 bytes.*the slice alone"):
        check_zero2_peak(lambda psi, n, b, eb: eb * -(-psi // n), MEASURED)
    with pytest.raises(ExerciseError, match=r"the slice alone"):
        check_zero2_peak(lambda psi, n, b, eb: eb * psi / n, MEASURED)
    with pytest.raises(ExerciseError, match=r"that counts elements: multiply by "
                                            r"elem_bytes"):
        check_zero2_peak(lambda psi, n, b, eb: psi / n + b)
    # at the measured sizes elements (one layer's slice + one layer's bucket) and
    # the slice alone in bf16 bytes are the same number: the mistake is still named
    with pytest.raises(ExerciseError, match=r"measured a peak of 1,050,624 bytes.*"
                                            r"that counts elements"):
        check_zero2_peak(lambda psi, n, b, eb: psi // n + b, MEASURED)
    with pytest.raises(ExerciseError, match=r"the slice is ceil\(psi/n\) elements"):
        check_zero2_peak(lambda psi, n, b, eb: eb * (psi / n + b))
    with pytest.raises(ExerciseError, match=r"returned None, not a number"):
        check_zero2_peak(lambda *a: None)
    with pytest.raises(ExerciseError, match=r"raised ZeroDivisionError"):
        check_zero2_peak(lambda psi, n, b, eb: psi / 0)
    # a measurement the formula misses is reported as such
    with pytest.raises(ExerciseError, match=r"measured a peak of 1"):
        check_zero2_peak(_peak, {(4 * LAYER, 4, LAYER, 2): 1})


def test_zero2_peak_names_double_buffering():
    with pytest.raises(ExerciseError, match=r"double-buffered ZeRO-2"):
        check_zero2_peak(lambda psi, n, b, eb: eb * (-(-psi // n) + 2 * b))


def test_elements_shared_counts_views_of_one_buffer():
    flat = torch.zeros(10)
    p, other = flat[2:7], torch.zeros(4)
    assert elements_shared(p, [flat[0:4], flat[6:10], other]) == 2 + 1
