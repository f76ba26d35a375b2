"""The timeline ledger on real gloo ranks: compute and communication spans of any
code, recorded without changing when anything runs."""

import pickle

import pytest
import torch

from labkit.ledger import Span, overlap_fraction, timeline

DELAY = 0.3  # seconds rank 1 waits before joining a collective


def _async_then_compute(rank, world_size):
    import time

    import torch.distributed as dist

    x = torch.ones(1 << 10)
    with timeline():  # the first dispatch mode a process enters imports a lot
        dist.barrier()  # and both ranks are up and connected before the clock matters
    with timeline() as tl:
        if rank == 1:
            time.sleep(DELAY)  # the all-reduce cannot finish before rank 1 joins
        t_issue = time.perf_counter()
        work = dist.all_reduce(x, async_op=True)
        returned = time.perf_counter() - t_issue
        a = torch.randn(64, 64)
        for _ in range(20):
            a = a @ a / 64                   # compute while the all-reduce is out
        work.wait()
        dist.reduce_scatter_single(torch.empty(1 << 8), torch.ones(1 << 10))
    return tl, returned


def _train_step(rank, world_size):
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 16)
    with timeline() as tl:
        model(x).sum().backward()
        opt.step()
    return tl


@pytest.fixture(scope="module")
def recorded(cluster):
    return cluster.run(_async_then_compute).values


def test_an_async_collective_is_not_waited_for_and_ends_when_it_completes(recorded):
    tl, returned = recorded[0]  # rank 0 issued first and waited for rank 1
    comm = [s for s in tl.spans if s.kind == "comm"]
    assert [s.name for s in comm] == ["all_reduce", "reduce_scatter"]
    assert comm[0].nbytes == 4 << 10 and comm[1].nbytes == 4 << 10
    assert returned < DELAY / 3                       # the call returned at once
    assert comm[0].seconds > DELAY * 0.8              # done only once rank 1 joined
    assert tl.unfinished == 0
    # the matmuls ran while the all-reduce was out: compute inside the comm span
    assert overlap_fraction(tl.spans) > 0
    compute = [s for s in tl.spans if s.kind == "compute"]
    assert any(comm[0].start < s.start < comm[0].end for s in compute)


def test_a_blocking_collective_without_a_future_still_gets_its_end(recorded):
    # gloo's reduce_scatter_single returns a work with no future: the ledger waits
    # for it where the caller would (async_op=False), so its span is complete
    for tl, _ in recorded:
        rs = [s for s in tl.spans if s.name == "reduce_scatter"]
        assert len(rs) == 1 and rs[0].end >= rs[0].start
        assert tl.start <= rs[0].start and rs[0].end <= tl.stop


def test_spans_are_sorted_pickle_and_rank_is_known(recorded):
    for rank, (tl, _) in enumerate(recorded):
        assert tl.rank == rank
        starts = [s.start for s in tl.spans]
        assert starts == sorted(starts)
        back = pickle.loads(pickle.dumps(tl))
        assert back.spans == tl.spans and back.unfinished == 0


def test_compute_is_named_by_phase(cluster):
    tl = cluster.run(_train_step).values[0]
    names = [s.name for s in tl.spans if s.kind == "compute"]
    assert names[0] == "forward" and "backward" in names and "optimizer" in names
    first = {n: names.index(n) for n in ("forward", "backward", "optimizer")}
    assert first["forward"] < first["backward"] < first["optimizer"]
    # operators less than `gap` apart merge: fewer spans than operators ran
    assert len(names) < 30
    assert all(isinstance(s, Span) and s.kind == "compute" for s in tl.spans)


def test_one_timeline_at_a_time():
    with timeline():
        with pytest.raises(RuntimeError, match="already recording"):
            with timeline():
                pass
