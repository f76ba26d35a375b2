"""The traffic ledger on 4 real gloo ranks: what each call records, and the bytes
each rank really wrote, against the ring formulas."""

import pickle

import pytest
import torch

import labkit
import labkit.ledger as L

N = 4
M = 1 << 20  # elements: 4 MiB of float32


def approx(measured, expected, rel=0.01):
    return abs(measured - expected) <= rel * expected


def _collectives(rank, world_size, m):
    import torch.distributed as dist

    from labkit.ledger import traffic

    with traffic() as t:
        dist.all_reduce(torch.ones(m))
        dist.all_gather_single(torch.empty(m), torch.ones(m // world_size))
        dist.reduce_scatter_single(torch.empty(m // world_size), torch.ones(m))
        dist.broadcast(torch.ones(m), src=0)
        dist.all_to_all_single(torch.empty(m), torch.ones(m))
        if rank == 0:
            dist.send(torch.ones(m), dst=1)
        elif rank == 1:
            dist.recv(torch.empty(m), src=0)
        dist.barrier()
    return t


@pytest.fixture(scope="module")
def ledgers(cluster):
    return cluster.run(_collectives, M)


def _one(t, op):
    recs = [r for r in t.records if r.op == op]
    assert len(recs) == 1, [r.op for r in t.records]
    return recs[0]


def test_all_reduce_writes_2_n_minus_1_over_n_times_m(ledgers):
    S = 4 * M
    for t in ledgers:
        r = _one(t, "all_reduce")
        got = (r.group_size, r.dtype, r.elements, r.payload_bytes)
        assert got == (N, "float32", M, S)
        assert r.bus_bytes == 2 * (N - 1) / N * S
        assert approx(r.wire_bytes, 2 * (N - 1) / N * S)  # 1.5 * M bytes on the wire


def test_all_gather_and_all_to_all_move_n_minus_1_over_n(ledgers):
    S = 4 * M
    for t in ledgers:
        for op in ("all_gather", "all_to_all"):
            r = _one(t, op)
            assert r.payload_bytes == S  # nccl-tests: S is the whole gathered array
            assert r.bus_bytes == (N - 1) / N * S
            assert approx(r.wire_bytes, (N - 1) / N * S), (op, r.wire_bytes)


def test_gloo_reduce_scatter_sends_as_much_as_an_all_reduce(ledgers):
    # the ring model says (n-1)/n S; gloo implements it as a full all-reduce
    S = 4 * M
    for t in ledgers:
        r = _one(t, "reduce_scatter")
        assert r.payload_bytes == S and r.bus_bytes == (N - 1) / N * S
        assert approx(r.wire_bytes, 2 * (N - 1) / N * S)


def test_broadcast_is_a_tree_in_gloo(ledgers):
    S = 4 * M
    wires = [_one(t, "broadcast").wire_bytes for t in ledgers]
    assert all(_one(t, "broadcast").bus_bytes == S for t in ledgers)
    assert approx(sum(wires), (N - 1) * S)  # every non-root rank receives S once
    assert approx(wires[0], 2 * S)  # the root feeds two children ...
    assert wires[2] < 0.01 * S and wires[3] < 0.01 * S  # ... leaves send nothing


def test_point_to_point_and_barrier(ledgers):
    S = 4 * M
    send, recv = _one(ledgers[0], "send"), _one(ledgers[1], "recv")
    assert (send.payload_bytes, recv.payload_bytes) == (S, S)
    # not waited for, so no per-call bytes; they show in the block's total
    assert send.wire_bytes is None and not send.complete
    assert not [r for r in ledgers[2].records if r.op in ("send", "recv")]
    assert all(_one(t, "barrier").payload_bytes == 0 for t in ledgers)
    # everything rank 0 wrote = its collectives + the send, within 1%
    colls = ledgers[0].sum("wire_bytes")
    assert approx(ledgers[0].written, colls + S)
    assert approx(ledgers[1].written, ledgers[1].sum("wire_bytes"))


def test_summaries_and_pickling(ledgers):
    t = ledgers[0]
    assert [r.rank for r in t.records] == [0] * len(t.records)
    assert t.sum("payload_bytes", op="all_reduce") == 4 * M
    by_op = t.by_op()
    assert by_op["all_reduce"]["calls"] == 1
    assert by_op["all_reduce"]["wire_bytes"] == _one(t, "all_reduce").wire_bytes
    assert set(t.by_phase()) == {"other"}
    # each call is timed inside the ledger's block
    assert 0 < t.sum("seconds") <= t.stop - t.start, (
        f"{t.sum('seconds'):.4f} s of calls in a {t.stop - t.start:.4f} s block")
    back = pickle.loads(pickle.dumps(t))
    assert back.records == t.records
    with pytest.raises(ValueError, match="field"):
        t.sum("colour")


def _ddp_and_phases(rank, world_size):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from labkit.ledger import traffic

    class Sync(torch.nn.Module):  # a module whose forward makes a collective
        def forward(self, x):
            dist.all_reduce(x)
            return x

    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    ddp = DDP(model, bucket_cap_mb=100)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with traffic(ddp) as t:
        ddp(torch.randn(8, 256)).sum().backward()
        with t.phase("my phase"):
            dist.all_reduce(torch.ones(4))
        Sync()(torch.ones(4))
        import torch.distributed._functional_collectives as fc

        fc.all_reduce(torch.ones(8), "sum", dist.group.WORLD).wait()
    return t, grad_bytes


def test_ddp_bucket_all_reduce_phases_modules_and_functional(cluster):
    res = cluster.run(_ddp_and_phases)
    for t, grad_bytes in res:
        backward = [r for r in t.records if r.phase == "backward"]
        assert [r.op for r in backward] == ["all_reduce"]  # one bucket
        assert backward[0].payload_bytes == grad_bytes
        assert approx(backward[0].wire_bytes, 2 * (N - 1) / N * grad_bytes)
        assert [r.phase for r in t.records[1:]] == ["my phase", "forward", "other"]
        assert t.records[2].module == "Sync"
        assert t.records[3].op == "all_reduce" and t.records[3].elements == 8


def test_traffic_needs_a_process_group_and_refuses_nesting(cluster):
    with pytest.raises(RuntimeError, match="process group"):
        with L.traffic():
            pass

    def nested(rank, world_size):
        from labkit.ledger import traffic

        with traffic():
            try:
                with traffic():
                    pass
            except RuntimeError as e:
                msg = str(e)
        with traffic() as again:  # the guard is released on exit
            pass
        return msg, again.rank

    for rank, (msg, again) in enumerate(cluster.run(nested)):
        assert "nested" in msg and again == rank


def _hooks_after(rank, world_size):
    from torch.nn.modules import module as nn_module
    from torch.optim import optimizer as optim

    from labkit.ledger import traffic

    def counts():
        return (len(nn_module._global_forward_pre_hooks),
                len(nn_module._global_forward_hooks),
                len(optim._global_optimizer_pre_hooks),
                len(optim._global_optimizer_post_hooks),
                torch._C._len_torch_dispatch_stack())

    before = counts()
    with traffic():
        inside = counts()
    return before, inside, counts()


def test_leaving_the_block_removes_every_hook(cluster):
    for before, inside, after in cluster.run(_hooks_after):
        assert inside != before and after == before


def _ring(rank, world_size, m):
    import torch.distributed as dist

    from labkit.ledger import traffic

    x = torch.ones(m)
    chunks = x.tensor_split(world_size)
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    with traffic() as t:  # isend/irecv pairs must not be serialised by the ledger
        for s in range(world_size - 1):
            buf = torch.empty_like(chunks[(rank - s - 1) % world_size])
            reqs = [dist.isend(chunks[(rank - s) % world_size], right),
                    dist.irecv(buf, left)]
            for q in reqs:
                q.wait()
    return t


def test_async_point_to_point_in_a_ring_does_not_deadlock(cluster):
    for t in cluster.run(_ring, M, timeout=20):
        assert [r.op for r in t.records] == ["send", "recv"] * (N - 1)
        assert approx(t.written, (N - 1) / N * 4 * M)  # N-1 chunks of M/N


def test_timeout_names_the_running_collective_and_its_size():
    def lonely(rank, world_size):
        import torch.distributed as dist

        from labkit.ledger import traffic

        if rank == 0:
            with traffic():
                dist.all_reduce(torch.ones(1 << 18))  # 1 MiB

    def warm(rank, world_size):  # a process's first dispatch mode imports a lot
        from labkit.ledger import traffic

        with traffic():
            torch.ones(1).add_(1)

    with labkit.Cluster(2, timeout=2) as c:
        c.run(warm, timeout=60)  # so the 2 s below time the collective, not imports
        with pytest.raises(labkit.CollectiveTimeout) as ei:
            c.run(lonely)
        assert "all_reduce of 1.0 MiB (group of 2)" in ei.value.busy[0]


def test_timeout_names_the_collective_even_without_a_ledger():
    def lonely(rank, world_size):
        import torch.distributed as dist

        if rank == 1:
            dist.broadcast(torch.ones(1 << 16), src=1)  # 256 KiB

    with labkit.Cluster(2, timeout=2) as c:
        with pytest.raises(labkit.CollectiveTimeout) as ei:
            c.run(lonely)
        assert "broadcast of 256.0 KiB" in ei.value.busy[1]


def _fsdp2_step(rank, world_size):
    from torch.distributed.fsdp import fully_shard

    from labkit.ledger import traffic

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 8))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    with traffic(model) as t:
        model(torch.randn(4, 64)).sum().backward()
    return t


def test_fsdp2_all_gathers_and_reduce_scatters_are_recorded():
    with labkit.Cluster(2) as c:
        for t in c.run(_fsdp2_step):
            got = [(r.op, r.payload_bytes, r.phase) for r in t.records]
            first, last = (64 * 64 + 64) * 4, (64 * 8 + 8) * 4  # each layer's params
            # forward gathers each layer; backward gathers again (resharded after
            # forward) and reduce-scatters each layer's gradients
            assert got[:2] == [("all_gather", first, "forward"),
                               ("all_gather", last, "forward")]
            assert sorted(got[2:]) == sorted([
                ("all_gather", last, "backward"), ("all_gather", first, "backward"),
                ("reduce_scatter", last, "backward"),
                ("reduce_scatter", first, "backward")])
            assert t.records[0].module == "0" and t.records[1].module == "2"


def _subgroups(rank, world_size):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc

    from labkit.ledger import traffic

    evens, odds = dist.new_group([0, 2]), dist.new_group([1, 3])
    mine = evens if rank % 2 == 0 else odds
    with traffic() as t:
        dist.all_reduce(torch.ones(1024), group=mine)
        dist.all_reduce(torch.ones(256))  # the whole world
        if rank == 0:
            dist.send(torch.ones(512), dst=2, group=mine)
        elif rank == 2:
            dist.recv(torch.empty(512), src=0, group=mine)
        fc.all_reduce(torch.ones(2048), "sum", mine).wait()
    return t


def test_each_call_records_the_global_ranks_of_its_group(cluster):
    for rank, t in enumerate(cluster.run(_subgroups)):
        pair = (0, 2) if rank % 2 == 0 else (1, 3)
        p2p = {0: ["send"], 2: ["recv"]}.get(rank, [])
        assert [r.op for r in t.records] == ["all_reduce", "all_reduce", *p2p,
                                             "all_reduce"]
        assert [r.group_ranks for r in t.records] == [pair, (0, 1, 2, 3),
                                                      *[pair] * len(p2p), pair]
        assert all(r.group_size == len(r.group_ranks) for r in t.records)
        groups = t.by_group({"pair": pair})
        assert set(groups) == {"pair", (0, 1, 2, 3)}
        row = groups["pair"]
        assert row["calls"] == 2 + len(p2p)
        assert row["payload_bytes"] == 4 * (1024 + 2048 + 512 * len(p2p))
        # sent: wire bytes of the collectives, plus the payload of a send
        wire = sum(r.wire_bytes for r in t.records
                   if r.group_ranks == pair and r.op == "all_reduce")
        assert row["sent"] == wire + (4 * 512 if rank == 0 else 0)
        assert groups[(0, 1, 2, 3)]["payload_bytes"] == 4 * 256
        assert pickle.loads(pickle.dumps(t)).records == t.records


def _uneven_all_to_all(rank, world_size):
    import torch.distributed as dist

    from labkit.ledger import traffic

    # rank r sends (r + j) % n + 1 rows of 64 float32 to rank j: its own chunk is
    # not 1/n of what it holds, as in an MoE dispatch
    send = [(rank + j) % world_size + 1 for j in range(world_size)]
    receive = [(j + rank) % world_size + 1 for j in range(world_size)]
    x = torch.ones(sum(send), 64)
    with traffic() as t:
        dist.all_to_all_single(torch.empty(sum(receive), 64), x, receive, send)
        # (gloo's list form, dist.all_to_all, takes equal sizes only)
    return t, send


def test_uneven_all_to_all_counts_what_leaves_the_rank(cluster):
    for rank, (t, send) in enumerate(cluster.run(_uneven_all_to_all)):
        others = 256 * (sum(send) - send[rank])  # bytes to the other ranks
        assert [r.op for r in t.records] == ["all_to_all"], t.records
        for r in t.records:
            assert r.bus_bytes == others, (
                f"rank {rank}, {r.op}: {r.bus_bytes:,} bus bytes recorded, "
                f"{others:,} B sent to other ranks ({send} rows of 256 B)")
            assert r.wire_bytes >= others, (
                f"rank {rank}: {r.wire_bytes:,} B written to sockets, less than "
                f"the {others:,} B of rows it sent")
