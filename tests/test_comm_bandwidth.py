"""labkit.comm.bandwidth: algbw and busbw as nccl-tests defines them.

nccl-tests doc/PERFORMANCE.md: algbw = S / t; busbw = algbw * 2(n-1)/n for
all-reduce, * (n-1)/n for all-gather, reduce-scatter and all-to-all, * 1 for
broadcast. The numbers below are worked by hand for n = 4 ranks.
"""

import time

import pytest

from labkit.comm.bandwidth import sweep


class FixedTimes:
    """A stand-in cluster whose ranks report fixed (seconds per call, iters)."""

    world_size = 4

    def __init__(self, per_rank):
        self.per_rank, self.calls = per_rank, []

    def run(self, fn, op, size, **kw):
        self.calls.append((op, size))
        return self.per_rank


def test_algbw_and_busbw_worked_by_hand():
    # 1 MiB in 4 ms (the slowest rank; the others were faster): algbw = 2**20 / 0.004
    # = 262_144_000 B/s; all-reduce busbw 1.5x that, all-gather 0.75x, broadcast 1x
    fake = FixedTimes([(0.002, 10), (0.004, 10), (0.001, 10), (0.003, 10)])
    ops = ("all_reduce", "ring_all_reduce", "all_gather", "reduce_scatter",
           "all_to_all", "broadcast")
    pts = sweep(fake, ops, sizes=[1 << 20], progress=False)
    assert fake.calls == [(op, 1 << 20) for op in ops]
    assert {p.size for p in pts} == {1_048_576}
    assert {p.seconds for p in pts} == {0.004} and {p.iters for p in pts} == {10}
    assert [p.algbw for p in pts] == pytest.approx([262_144_000] * 6)
    assert {p.op: p.busbw for p in pts} == {
        "all_reduce": pytest.approx(393_216_000),
        "ring_all_reduce": pytest.approx(393_216_000),
        "all_gather": pytest.approx(196_608_000),
        "reduce_scatter": pytest.approx(196_608_000),
        "all_to_all": pytest.approx(196_608_000),
        "broadcast": pytest.approx(262_144_000),
    }


def test_size_is_whole_float32_elements_per_rank():
    # S counts the array actually moved: 1000 B is 250 floats, cut to 248 so 4 ranks
    # get 62 each -> 992 B; 8 B is less than one float per rank -> 4 floats, 16 B
    fake = FixedTimes([(0.5, 1)] * 4)
    pts = sweep(fake, ("all_reduce",), sizes=[1000, 8], progress=False)
    assert [(p.size, p.algbw) for p in pts] == [(992, 1984.0), (16, 32.0)]


def test_sweep_on_real_ranks(cluster):
    ops = ("all_reduce", "all_gather", "ring_all_reduce")
    t0 = time.perf_counter()
    pts = sweep(cluster, ops, sizes=[1024, 65536], progress=False, min_seconds=0.01,
                max_iters=3)
    elapsed = time.perf_counter() - t0
    assert [(p.op, p.size) for p in pts] == [(op, s) for op in ops
                                             for s in (1024, 65536)]
    factor = {"all_reduce": 1.5, "ring_all_reduce": 1.5, "all_gather": 0.75}
    for p in pts:
        assert 1 <= p.iters <= 3, f"{p.op}, {p.size} B: {p.iters} iterations"
        assert p.busbw / p.algbw == pytest.approx(factor[p.op])
    # seconds are per iteration and measured inside the sweep: all of them
    # together fit in the time the sweep took
    inside = sum(p.seconds * p.iters for p in pts)
    assert 0 < inside <= elapsed, (
        f"{inside:.3f} s of timed iterations in a sweep of {elapsed:.3f} s")


def test_a_call_longer_than_min_seconds_is_its_own_timing(cluster):
    # every call takes longer than 1 ns: the first timed call is the measurement,
    # none more (a 64 MiB all-reduce is not repeated to reach min_seconds)
    pts = sweep(cluster, ("all_reduce", "broadcast"), sizes=[1024, 1 << 20],
                progress=False, min_seconds=1e-9)
    assert [p.iters for p in pts] == [1] * 4, [(p.op, p.size, p.iters) for p in pts]
    assert all(0 < p.seconds < 60 for p in pts), [p.seconds for p in pts]


def test_unknown_op_is_reported(cluster):
    import labkit

    with pytest.raises(labkit.RankError, match="unknown op"):
        sweep(cluster, ("all_sum",), sizes=[1024], progress=False)
