"""labkit.bandwidth: algbw and busbw as nccl-tests defines them (no timing asserts)."""

import pytest

from labkit.comm.bandwidth import sweep
from labkit.theory import bus_factor


def test_sweep_points_follow_the_nccl_tests_definitions(cluster):
    ops = ("all_reduce", "all_gather", "ring_all_reduce")
    pts = sweep(cluster, ops, sizes=[1024, 65536], progress=False, min_seconds=0.01,
                max_iters=3)
    assert [(p.op, p.size) for p in pts] == [(op, s) for op in ops
                                             for s in (1024, 65536)]
    for p in pts:
        assert p.seconds > 0 and 1 <= p.iters <= 3
        assert p.algbw == pytest.approx(p.size / p.seconds)
        base = "all_reduce" if p.op == "ring_all_reduce" else p.op
        assert p.busbw == pytest.approx(p.algbw * bus_factor(base, 4))


def test_unknown_op_is_reported(cluster):
    import labkit

    with pytest.raises(labkit.RankError, match="unknown op"):
        sweep(cluster, ("all_sum",), sizes=[1024], progress=False)
